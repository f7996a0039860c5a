"""use()'s `overrides`: {where: {knob: value}}, where = a module path, a pattern of paths, or a layer number.

- a module path of an attention module (flash_forensics/sites.py), e.g. "model.decoder.layers.0.encoder_attn";
- a pattern of paths (fnmatch: "*", "?", "[...]"), e.g. "model.decoder.layers.*.encoder_attn": every match;
- a layer_idx, the shorthand where one module has it (a decoder-only model); refused where several share it (BART's
  encoder, decoder self- and cross-attention all have layer 0), naming their paths.
Applied in order, later keys winning; every key must match a module (a typo would otherwise change nothing).
"""
from __future__ import annotations

import fnmatch
from typing import List, Mapping, Sequence

from flash_forensics.kernels.checks import is_int
from flash_forensics.kernels.config import AttentionKnobs, LayerOverride
from flash_forensics.sdpa import check_no_tensors, shown
from flash_forensics.sites import Site

_EXAMPLE = "{'model.layers.1.self_attn': {'pv_fp32': True}, 3: {'o_fp32_heads': [0, 5]}}"


def _paths(sites: Sequence[Site], n: int = 4) -> str:
    shown = ", ".join(repr(s.path) for s in sites[:n])
    return shown + (f", ... ({len(sites)} in all)" if len(sites) > n else "")


def matches(sites: Sequence[Site], key) -> List[int]:
    """Indices of the sites `key` names (ValueError naming the key, the value and what is allowed)."""
    if is_int(key, 0):
        hit = [i for i, s in enumerate(sites) if s.layer == key]
        if len(hit) > 1:
            raise ValueError(f"overrides key {key!r} is not allowed: layer {key} is shared by {len(hit)} attention "
                             f"modules ({_paths([sites[i] for i in hit])}): expected one module path, or a pattern "
                             "such as 'model.decoder.layers.*.encoder_attn'")
        if not hit:
            layers = sorted({s.layer for s in sites if s.layer is not None})
            raise ValueError(f"overrides key {key!r} is not allowed: expected a layer_idx in "
                             f"{layers[0]}..{layers[-1]} or a module path ({_paths(sites)})" if layers else
                             f"overrides key {key!r} is not allowed: expected a module path ({_paths(sites)})")
        return hit
    if isinstance(key, str):
        hit = [i for i, s in enumerate(sites) if s.path == key or fnmatch.fnmatchcase(s.path, key)]
        if not hit:
            raise ValueError(f"overrides key {key!r} is not allowed: expected the path of an attention module or a "
                             f"pattern matching one ({_paths(sites)})")
        return hit
    raise ValueError(f"overrides key {key!r} ({type(key).__name__}) is not allowed: expected a module path (str) "
                     "or a layer_idx (int >= 0)")


def layer_overrides(sites: Sequence[Site], overrides) -> List[tuple]:
    """[(key, LayerOverride over site indices)], in the order given."""
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise ValueError(f"overrides={type(overrides).__name__} is not allowed: expected a dict {{module path or "
                         f"layer_idx: {{knob: value}}}}, e.g. {_EXAMPLE}")
    out = []
    for key, patch in overrides.items():
        hit = matches(sites, key)
        if not isinstance(patch, Mapping):
            raise ValueError(f"overrides[{key!r}]={shown(patch)} is not allowed: expected a dict {{knob: value}}")
        check_no_tensors(f"overrides[{key!r}]", patch)
        try:
            out.append((key, LayerOverride(layers=hit, **dict(patch))))
        except TypeError:
            names = list(AttentionKnobs.__dataclass_fields__)
            unknown = sorted(set(patch) - set(names))
            raise ValueError(f"overrides[{key!r}]: unknown knob(s) {unknown}; allowed: {', '.join(names)}") from None
    return out


__all__ = ["matches", "layer_overrides"]
