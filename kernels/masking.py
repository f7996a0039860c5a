"""What one attention call attends to beyond the emulator's default (causal self-attention, Tq == Tk, 1/sqrt(D)).

`Masking` is the emulator's optional `masking=` argument (kernels/emulator.py); None keeps the default path, op for
op. It carries what torch's scaled_dot_product_attention calls is_causal, attn_mask and scale, already normalised by
the caller (flash_forensics/sdpa.py):

- causal: key j is masked for query i when j > i: torch's `ones(Tq, Tk).tril(diagonal=0)`, top-left aligned also
  when Tq != Tk.
- keep: bool (b, h, Tq, Tk), b in {1, B}, h in {1, H}; True = attend. Masked entries are the recipe's fill value
  in the forward (-max of `scores`) and -inf in the backward, as causal ones are; they never count in the counters.
- bias: float (b, h, Tq, Tk), finite, added to the scaled scores and rounded at `scores` (the additive mask of SDPA;
  its -inf entries belong in `keep`).
- scale: the softmax scale (None: 1/sqrt(D)).
Rows with no key at all (every entry masked) are the caller's to define (SDPA returns 0 there): the emulator gives
them the mean of V and a gradient of 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Masking:
    causal: bool = True
    keep: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    scale: Optional[float] = None

    def problem(self, q: torch.Tensor, tk: int) -> Optional[str]:
        """None, or what is wrong (naming the field and what is allowed) for q (B, H, Tq, D) and Tk keys."""
        B, H, Tq, _ = q.shape
        if not isinstance(self.causal, bool):
            return f"masking.causal={self.causal!r} is not allowed: expected true or false"
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))
                                       or not math.isfinite(self.scale) or self.scale <= 0):
            return f"masking.scale={self.scale!r} is not allowed: expected a finite number > 0 or None"
        for name, want in (("keep", (torch.bool,)), ("bias", (torch.bfloat16, torch.float16, torch.float32,
                                                               torch.float64))):
            x = getattr(self, name)
            if x is None:
                continue
            if not isinstance(x, torch.Tensor) or x.dtype not in want:
                return f"masking.{name}={type(x).__name__} is not allowed: expected a tensor of dtype {want}"
            if x.dim() != 4 or x.shape[0] not in (1, B) or x.shape[1] not in (1, H) or tuple(x.shape[2:]) != (Tq, tk):
                return (f"masking.{name}.shape={tuple(x.shape)} is not allowed: expected (1 or {B}, 1 or {H}, "
                        f"{Tq}, {tk})")
            if x.device != q.device:
                return f"masking.{name}.device={x.device} is not allowed: expected q's device {q.device}"
            if x.requires_grad:
                return f"masking.{name} requires grad: not allowed (no gradient flows to a mask)"
        return None


__all__ = ["Masking"]
