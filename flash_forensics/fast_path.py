"""On CUDA, a transformers call whose mask is only the causal triangle runs as a plain causal call, which the Triton
kernels compute (flash_forensics/sdpa.py routes it; kernels/triton_flash.py): transformers' materialised masks
otherwise keep every call on the emulator.

- `causal_only(mask, Tq, Tk)`: True when a bool mask (B or 1, 1, Tq, Tq) is the causal triangle in every batch row
  (no padding, no window). Reading it costs one device-to-host sync; transformers passes one mask object to every
  layer of a forward, so the answer is kept per mask object (and its in-place version) and the sync is paid once
  per forward, not per layer. Never while dynamo traces (a data-dependent branch: a graph break per layer), so a
  compiled model keeps its masked calls on the emulator.
- `plain_scale(scaling, D)`: None where the module's scale is the default 1/sqrt(D) (what the kernels use).
- `key_padding(mask, Tq, Tk)`: the (B, T) key-keep vector when a bool mask is the causal triangle and a per-batch key
  padding (left, right or holes: transformers' padded batches), else None; the Triton kernels take it as key_keep.
  One sync per mask object, cached as causal_only's answer; never while dynamo traces.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional

import torch

# id(mask) -> (weakref to it, its _version, Tq, the answer); a tensor cannot key a WeakKeyDictionary (its == is
# elementwise). A few entries: one per mask kind a forward builds (full, sliding window).
_SEEN: Dict[int, tuple] = {}


def cached(mask: torch.Tensor) -> Optional[bool]:
    """The answer kept for this mask object, None when there is none (or it changed in place since)."""
    hit = _SEEN.get(id(mask))
    if hit is None or hit[0]() is not mask or hit[1] != mask._version:
        return None
    return hit[3]


def causal_only(mask: Optional[torch.Tensor], Tq: int, Tk: int) -> bool:
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or Tq != Tk or Tq < 2:
        return False
    if mask.shape[1] != 1 or mask.shape[-2:] != (Tq, Tk) or torch.compiler.is_compiling():
        return False
    hit = cached(mask)
    if hit is not None:
        return hit
    tri = torch.ones(Tq, Tk, dtype=torch.bool, device=mask.device).tril()
    answer = bool(torch.equal(mask, tri.expand_as(mask)))  # the one sync
    if len(_SEEN) > 8:
        _SEEN.clear()
    _SEEN[id(mask)] = (weakref.ref(mask), mask._version, Tq, answer)
    return answer


_PADS: Dict[int, tuple] = {}  # id(mask) -> (weakref, _version, Tq, key-keep (B, T) or None), as _SEEN


def key_padding(mask: Optional[torch.Tensor], Tq: int, Tk: int) -> Optional[torch.Tensor]:
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or Tq != Tk or Tq < 2:
        return None
    if mask.shape[1] != 1 or mask.shape[-2:] != (Tq, Tk) or torch.compiler.is_compiling():
        return None
    hit = _PADS.get(id(mask))
    if hit is not None and hit[0]() is mask and hit[1] == mask._version:
        return hit[3]
    keys = mask[:, 0, -1, :]  # the last row sees every key causality allows: the batch's kept keys
    tri = torch.ones(Tq, Tk, dtype=torch.bool, device=mask.device).tril()
    answer = keys.contiguous() if bool(torch.equal(mask[:, 0], tri & keys[:, None, :])) else None  # the one sync
    if len(_PADS) > 8:
        _PADS.clear()
    _PADS[id(mask)] = (weakref.ref(mask), mask._version, Tq, answer)
    return answer


def plain_scale(scaling, D: int):
    """None for the default scale (as a float it may be written 1/sqrt(D) or D**-0.5: both round alike), else it."""
    if scaling is None:
        return None
    s = float(scaling)
    return None if s in (D ** -0.5, 1.0 / D ** 0.5) else scaling


__all__ = ["causal_only", "key_padding", "plain_scale"]
