"""3xTF32: an FP32-accurate GEMM from three TF32 tensor-core passes (the `fp32_gemm=tf32x3` knob, kernels/knobs.py).

Each FP32 operand x is split as x = hi + lo + r with hi = tf32(x) and lo = tf32(x - hi), where tf32() keeps the sign,
the 8 exponent bits and the top 10 of FP32's 23 fraction bits, rounding to nearest with ties away from zero (PTX's
cvt.rna.tf32.f32, what Triton's input_precision="tf32x3" uses). hi and lo hold 11 significant bits each, so each of
the products hi_a*hi_b, hi_a*lo_b, lo_a*hi_b is exact in FP32, and the tensor cores sum them in FP32:

    a @ b ~= (lo_a @ hi_b + hi_a @ lo_b) + hi_a @ hi_b        (lo_a @ lo_b, ~2^-22 relative, is dropped)

Relative to IEEE FP32 this loses the r terms (|r| <= 2^-22 |x|) and lo*lo: about 2^-21 of a product, a few ulp of the
result, against BF16's 2^-9 per rounding. A BF16 operand (8 significant bits) splits exactly (lo = 0), so a GEMM of
BF16 values gives what one pass gives. The emulator computes each pass as an FP32 GEMM on the CPU; the GPU's
accumulation order inside a tensor-core pass is its own, so the emulator models the split, not the hardware's sums.
"""
from __future__ import annotations

import torch

_LOW = (1 << 13) - 1  # the 13 fraction bits TF32 drops
_HALF = 1 << 12


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """x (FP32) rounded to TF32 (10 fraction bits), nearest with ties away from zero; inf and NaN unchanged."""
    if x.dtype != torch.float32:
        raise TypeError(f"to_tf32 takes float32, got {x.dtype}")
    bits = x.view(torch.int32)
    # on the magnitude bits (sign-magnitude: the same integer arithmetic rounds both signs away from zero); a carry
    # out of the fraction increments the exponent, which is the correct rounding up to the next binade
    rounded = ((bits + _HALF) & ~_LOW).view(torch.float32)
    special = ~torch.isfinite(x)
    return torch.where(special, x, rounded)


def split(x: torch.Tensor):
    """(hi, lo) of x: hi = tf32(x), lo = tf32(x - hi)."""
    hi = to_tf32(x)
    return hi, to_tf32(x - hi)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as 3xTF32 computes it (module docstring); other dtypes than FP32 are multiplied as they are."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        return a @ b
    ah, al = split(a)
    bh, bl = split(b)
    return (al @ bh + ah @ bl) + ah @ bh


__all__ = ["to_tf32", "split", "matmul"]
