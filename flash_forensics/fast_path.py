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
  It shares causal_only's one read-back per mask object.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional

import torch

# id(mask) -> (weakref to it, its _version, Tq, causal only?, key-keep (B, T) or None); a tensor cannot key a
# WeakKeyDictionary (its == is elementwise). A few entries: one per mask kind a forward builds (full, sliding window).
_SEEN: Dict[int, tuple] = {}


def _hit(mask: torch.Tensor) -> Optional[tuple]:
    hit = _SEEN.get(id(mask))
    if hit is None or hit[0]() is not mask or hit[1] != mask._version:
        return None
    return hit


def cached(mask: torch.Tensor) -> Optional[bool]:
    """The causal_only answer kept for this mask object, None when there is none (or it changed in place since)."""
    hit = _hit(mask)
    return None if hit is None else hit[3]


def _classify(mask: Optional[torch.Tensor], Tq: int, Tk: int) -> Optional[tuple]:
    """(causal only?, key-keep or None) of a (B or 1, 1, Tq, Tq) bool mask, from one read-back (cached per mask
    object); None for any other mask or while dynamo traces."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or Tq != Tk or Tq < 2:
        return None
    if mask.shape[1] != 1 or mask.shape[-2:] != (Tq, Tk) or torch.compiler.is_compiling():
        return None
    hit = _hit(mask)
    if hit is not None:
        return hit[3], hit[4]
    keys = mask[:, 0, -1, :]  # the last row sees every key causality allows: the batch's kept keys
    tri = torch.ones(Tq, Tk, dtype=torch.bool, device=mask.device).tril()
    padded, full = torch.stack([(mask[:, 0] == (tri & keys[:, None, :])).all(), keys.all()]).tolist()  # the one sync
    answer = (padded and full, keys.contiguous() if padded else None)
    if len(_SEEN) > 8:
        _SEEN.clear()
    _SEEN[id(mask)] = (weakref.ref(mask), mask._version, Tq, *answer)
    return answer


def causal_only(mask: Optional[torch.Tensor], Tq: int, Tk: int) -> bool:
    got = _classify(mask, Tq, Tk)
    return bool(got and got[0])


def key_padding(mask: Optional[torch.Tensor], Tq: int, Tk: int) -> Optional[torch.Tensor]:
    got = _classify(mask, Tq, Tk)
    return None if got is None else got[1]


def plain_scale(scaling, D: int):
    """None for the default scale (as a float it may be written 1/sqrt(D) or D**-0.5: both round alike), else it."""
    if scaling is None:
        return None
    s = float(scaling)
    return None if s in (D ** -0.5, 1.0 / D ** 0.5) else scaling


__all__ = ["causal_only", "key_padding", "plain_scale"]
