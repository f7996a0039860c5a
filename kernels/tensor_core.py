"""A model of the Hopper (sm_90) tensor cores' accumulation: knob tensor_core (kernels/knobs.py).

An MMA does not round each product-add to FP32. Per block of K products (BF16/FP16: 16, one m16n8k16 step; FP8: 32,
one wgmma k-step), the products are exact, the block's terms and the accumulator C are aligned to the largest
exponent among them, every term is truncated (toward zero) to F fraction bits below that exponent, the truncated
terms are summed exactly and the sum is truncated (toward zero) to FP32. FP32 accumulators with fewer bits than
FP32 for FP8: the "limited accumulation precision" of FP8 GEMMs on H800 (DeepSeek-V3 report, Sec. 3.3.2: about 14
bits); cuBLAS' default FP8 GEMM (torch._scaled_mm, use_fast_accum=False) promotes the accumulator to an FP32 sum in
CUDA cores every PROMOTE products; fast accumulation and FlashAttention-3 never do.

The parameters are measurements, not specifications (a grid run once on the H200 captures of issue 30; the table
they give is results/real_kernels/table.md, its README says how it was made):
- BF16, BLOCK 16, F 25: torch SDPA's flash backend (FlashAttention-2, mma.sync) with the kernel's own tiles, loop
  order and exp2 softmax reproduces 100% of O on the D 64 repeated-maxima captures; F = 23, 24 or 26 gave
  99.73-99.89%, blocks of 8 or 32 99.77-99.90%, round-to-nearest accumulation 99.1-99.7%.
- FP8, BLOCK 32, F 13, PROMOTE 128: the best of a grid (blocks 16/32/64, F 10..25, promotion none/64/128/256)
  against torch._scaled_mm: 53-73% of the default products, 75-89% of use_fast_accum's without promotion; a
  partial fit, not bit-exact.
Values are FP32 (the working dtype) holding BF16 / FP8 values; the arithmetic runs in FP64, where the products and
the aligned sums are exact.
"""
from __future__ import annotations

from typing import Optional

import torch

F64 = torch.float64
KINDS = ("exact", "sm90", "sm90_fast_fp8")
# (block of products, fraction bits kept below the largest exponent, products between promotions or None)
BF16_MMA = (16, 25, None)
FP8_MMA = (32, 13, 128)
FP8_MMA_FAST = (32, 13, None)


def params(kind: str, fp8: bool):
    """(block, bits, promote) for a GEMM of the given operand width under knob value `kind` (None: exact)."""
    if kind == "exact":
        return None
    if kind not in KINDS:
        raise ValueError(f"attention.tensor_core={kind!r} is not allowed: expected one of {', '.join(KINDS)}")
    if not fp8:
        return BF16_MMA
    return FP8_MMA_FAST if kind == "sm90_fast_fp8" else FP8_MMA


def round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """FP64 x to the FP32 value next to it toward zero (returned in FP64)."""
    y = x.to(torch.float32)
    over = y.to(F64).abs() > x.abs()
    return torch.where(over, torch.nextafter(y, torch.zeros_like(y)), y).to(F64)


def _block(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bits: int) -> torch.Tensor:
    """One block FMA: c + sum_k a[..., k] b[..., k, :] with alignment truncation (module docstring); FP64 in/out."""
    terms = torch.cat([a.unsqueeze(-1) * b.unsqueeze(-3), c.unsqueeze(-2)], dim=-2)  # (..., M, k + 1, N), exact
    top = terms.abs().amax(dim=-2, keepdim=True)
    _, e = torch.frexp(torch.where(top > 0, top, torch.ones_like(top)))  # top = f * 2^e, f in [0.5, 1)
    unit = torch.ldexp(torch.ones_like(top), (e - 1 - bits).to(torch.int32))
    return round_toward_zero((torch.trunc(terms / unit) * unit).sum(dim=-2))


def matmul(a: torch.Tensor, b: torch.Tensor, acc: Optional[torch.Tensor], block: int, bits: int,
           promote: Optional[int]) -> torch.Tensor:
    """acc + a @ b (acc None: 0) as the modelled tensor core accumulates it, in a's dtype. a (..., M, K), b (..., K,
    N)."""
    out_dtype = a.dtype
    a64, b64 = a.to(F64), b.to(F64)
    K = a.shape[-1]
    shape = (*a.shape[:-1], b.shape[-1])
    c = torch.zeros(shape, dtype=F64, device=a.device) if acc is None or promote else acc.to(F64)
    total = acc.to(F64) if (acc is not None and promote) else None
    for k0 in range(0, K, block):
        c = _block(a64[..., k0:k0 + block], b64[..., k0:k0 + block, :], c, bits)
        if promote and ((k0 + block) % promote == 0 or k0 + block >= K):  # an FP32 add in the CUDA cores
            total = c if total is None else (total + c).to(torch.float32).to(F64)
            c = torch.zeros_like(c)
    return (c if total is None else total).to(out_dtype)


__all__ = ["KINDS", "params", "matmul", "round_toward_zero", "BF16_MMA", "FP8_MMA", "FP8_MMA_FAST"]
