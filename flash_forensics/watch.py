"""Noticing that use()'d attention modules are not being called, and saying why (NotRoutedWarning).

transformers reads each module's `config._attn_implementation` on every forward; the config object is shared, so a
second model built from it with another attn_implementation (or set_attn_implementation) switches this model too,
and then no call reaches the backend. use() installs two hooks on the model it is given:
- before each forward: a routed module whose config no longer says "forensics" -> a warning naming the value;
- after each forward: no routed module was called -> a warning with the cause found.
Both are skipped while torch.compile traces (dynamo guards on the config value instead; the Monitor's device call
counters, read at each flush, cover compiled runs). Each distinct message is given once per model.
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Sequence

import torch

from flash_forensics.sites import Site


class NotRoutedWarning(UserWarning):
    """Attention modules that use() set up are not computing through the forensics backend."""


def switched(sites: Sequence[Site], name: str) -> List[str]:
    """'<path>: <impl>' for each site whose config no longer names the backend."""
    out = []
    for s in sites:
        impl = getattr(getattr(s.module, "config", None), "_attn_implementation", None)
        if impl != name:
            out.append(f"{s.path}: {impl!r}")
    return out


def cause(sites: Sequence[Site], name: str) -> str:
    """Why these sites are not called: a switched config, else not on the forward path."""
    moved = switched(sites, name)
    if moved:
        return (f"config._attn_implementation is no longer {name!r} ({'; '.join(moved[:3])}"
                f"{'; ...' if len(moved) > 3 else ''}): transformers writes the attention choice into the config "
                "object, so a model built from the same config object with another attn_implementation (or "
                "set_attn_implementation) switched this one; build each model from copy.deepcopy(config), or call "
                f"model.set_attn_implementation({name!r}) and use() again")
    return ("their config still names the backend, so they were not on this forward's path (e.g. an encoder not "
            "run, a cross-attention without encoder states) or the forward ran on another model object")


class Watch:
    """The two hooks of one model (module docstring)."""

    def __init__(self, model, sites: Sequence[Site], states, name: str):
        self.model, self.sites, self.states, self.name = model, list(sites), list(states), name
        self.said: set = set()
        self.handles = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def warn(self, message: str) -> None:
        if message not in self.said:
            self.said.add(message)
            warnings.warn(message, NotRoutedWarning, stacklevel=3)

    def _before(self, module, args) -> None:
        if torch.compiler.is_compiling():
            return
        for st in self.states:
            st.seen = False
        moved = switched(self.sites, self.name)
        if moved:
            self.warn(f"{type(self.model).__name__}.forward: {len(moved)} of {len(self.sites)} attention modules set "
                      f"up by use() will not run the {self.name} backend: {cause(self.sites, self.name)}")

    def _after(self, module, args, output) -> None:
        if torch.compiler.is_compiling() or any(st.seen for st in self.states) or switched(self.sites, self.name):
            return  # called, or the cause already said before the forward
        self.warn(f"{type(self.model).__name__}.forward made no call to the {self.name} backend ({len(self.sites)} "
                  f"attention modules set up by use()): {cause(self.sites, self.name)}")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def install(model, sites: Sequence[Site], states, name: str) -> Watch:
    """The model's Watch, replacing one installed by an earlier use()."""
    old: Optional[Watch] = getattr(model, "_ff_watch", None)
    if old is not None:
        old.remove()
    w = Watch(model, sites, states, name)
    model._ff_watch = w
    return w


__all__ = ["NotRoutedWarning", "Watch", "install", "switched", "cause"]
