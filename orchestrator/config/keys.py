"""Command-line keys checked against the schema before Hydra composes: a key that is not a config field
(`train.max_step=10`) is refused naming the closest fields (`train.max_steps`), with nothing launched.

Hydra's own error names the key too, but suggests `+train.max_step=10`, which the structured config refuses as well.
Only plain `a.b.c=value` overrides are checked: `+`/`~` (adding, deleting), group selections (`model=tiny`,
`hydra/launcher=...`), `hydra.*` and indexed keys are left to Hydra. The walk stops at a field that is not a
dataclass (a dict, a list, Any): what lies below it is free-form.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import List, Optional, Sequence

from flash_forensics.orchestrator.config.schema import Config


def _dataclass_of(tp):
    """The dataclass a field's type names (through Optional), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _elsewhere(name: str, root) -> List[str]:
    """`section.name` for every top-level section of the schema that has a field `name`."""
    hints = typing.get_type_hints(root)
    out = []
    for f in dataclasses.fields(root):
        cls = _dataclass_of(hints[f.name])
        if cls is not None and name in {g.name for g in dataclasses.fields(cls)}:
            out.append(f"{f.name}.{name}")
    return out


def unknown_key(key: str, root=Config) -> Optional[str]:
    """Why `key` (dotted) is not a field of the schema, naming the closest ones; None when it is (or cannot say)."""
    cls, walked = root, []
    for part in key.split("."):
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            where = ".".join(walked) or "the root config"
            prefix = ".".join(walked) + "." if walked else ""
            close = [prefix + c for c in difflib.get_close_matches(part, names, n=3, cutoff=0.6)]
            close += [s for s in _elsewhere(part, root) if s not in close]  # train.lr: optimizer.lr
            hint = f"; did you mean {' or '.join(close)}?" if close else (
                f"; its keys: {', '.join(prefix + n for n in names[:12])}{', ...' if len(names) > 12 else ''}")
            return f"{key} is not a config key: {where} has no field {part!r}{hint}"
        walked.append(part)
        cls = _dataclass_of(hints[part])
        if cls is None:  # free-form below (a dict, a list, a scalar): Hydra and the schema judge it
            return None
    return None


def check_keys(args: Sequence[str]) -> List[str]:
    """The refusals for the plain dotted overrides among command-line `args` (flags and group selections skipped)."""
    out = []
    for arg in args:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key = arg.split("=", 1)[0]
        if "." not in key or "/" in key or "[" in key or key.startswith("hydra."):
            continue
        why = unknown_key(key)
        if why:
            out.append(why)
    return out


__all__ = ["unknown_key", "check_keys"]
