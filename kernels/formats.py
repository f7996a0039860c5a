"""Number formats of the rounding points and how a value is cast to each: FP32, BF16, FP16, FP8 E4M3 and E5M2.

A cast rounds to nearest even (torch's `Tensor.to`) and returns the value in the working dtype: FP8 has no arithmetic
in torch 2.13 on the CPU (`add` raises; casts work), so every FP8 value is a "fake-quantised" FP32/FP64 value, as
the emulator keeps BF16 values in FP32. Overflow, per format (measured with torch 2.13.0+cpu; tests/unit/
test_formats.py checks each):

    fp16   IEEE: |x| >= 65520 (65504 + half an ulp) becomes inf. Subnormals kept (down to 2^-24). Torch and CUDA's
           __float2half_rn agree. Counted per head (AttnStats.fp16_overflow: finite values that became inf).
    bf16   as fp16 with FP32's exponent range (overflow only beyond 3.39e38, never seen in attention).
    e4m3   (torch.float8_e4m3fn) has no inf. torch's plain cast *saturates*: 500, 1e6 and inf all become 448, NaN
           stays NaN (measured; it is not NaN as the OCP spec's non-saturating mode would give). Max 448, smallest
           normal 2^-6, smallest subnormal 2^-9 (2^-10 rounds to 0, ties to even). Below 1.0 the next value is
           0.9375, so P̄ in [0.96875, 1.0625] rounds to 1.0.
    e5m2   (torch.float8_e5m2) has inf, and torch's plain cast overflows: |x| >= 61440 (57344 + half an ulp) becomes
           inf. Max 57344, smallest normal 2^-14, smallest subnormal 2^-16. Below 1.0 the next value is 0.875.
Choice: FP8 casts here *saturate* (clamp to +-max, then cast; NaN stays NaN), for both FP8 formats, as the
hardware's satfinite conversions FlashAttention-3 and Transformer Engine use do (cvt.rn.satfinite: +-inf and values
beyond max become +-max). For e4m3 that is torch's own cast; for e5m2 it differs from torch beyond 61440. A clipped
value is counted (AttnStats.fp8_saturated): |x * scale| >= the overflow threshold above (464 for e4m3, 61440 for
e5m2), i.e. exactly the values a round-to-nearest cast with an unbounded exponent would take beyond max. Values
in (448, 464) round to 448 in either reading and are not counted.

Scales. An FP8 store multiplies by a scale s before the cast and divides by it after (in the working dtype):
`quantize(x, dtype, s) = cast(x * s) / s`. The hardware keeps cast(x * s) and applies the descale 1/s to the FP32
GEMM accumulator; the two agree up to FP32 rounding (one 2^-24 relative rounding of the descale), and exactly for
powers of two (P̄'s 2^8). `amax_scale` is current scaling: s = max / amax(|x|) over the given dims (1 where
amax = 0), so the largest entry maps to the format's max.

Incoherent processing (FlashAttention-3, Sec. 3.3): Q and K multiplied by one random orthogonal
M = diag(signs) H / sqrt(D) (H the Sylvester Hadamard matrix) along the head dimension before their FP8 cast:
(QM)(KM)^T = QK^T in exact arithmetic; outliers are spread over the head dimension, so the amax (and with it
the rounding error of the other entries) shrinks.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS: Dict[str, torch.dtype] = {"fp32": F32, "bf16": BF16, "fp16": F16, "e4m3": E4M3, "e5m2": E5M2}
FP8 = (E4M3, E5M2)
NAMES = {dt: name for name, dt in FORMATS.items()} | {torch.float64: "fp64"}
# |x| from which a round-to-nearest cast leaves the format (max + half an ulp at max): what saturation clips
OVERFLOW_AT = {E4M3: 464.0, E5M2: 61440.0, F16: 65520.0}
PBAR_SCALES = {"none": 1.0, "fa3": 256.0, "sage": 448.0}  # FA3 scales P̄ by 2^8; SageAttention by 448 (e4m3's max)


def dtype_of(name: str) -> torch.dtype:
    return FORMATS[name]


def name_of(dtype: torch.dtype) -> str:
    """'bf16', 'e4m3', ... ('fp64' for the FP64 working dtype)."""
    return NAMES[dtype]


def is_fp8(dtype) -> bool:
    return dtype in FP8


def bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def fmax(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` (nearest even) and returned in x's dtype; FP8 saturates at +-max (module docstring).
    A `dtype` at least as wide as x's leaves x alone (a lift to the working dtype)."""
    if dtype == x.dtype or bits(dtype) >= bits(x.dtype):
        return x
    if dtype in FP8:
        m = fmax(dtype)
        x = x.clamp(-m, m)  # NaN survives clamp
    return x.to(dtype).to(x.dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale=None) -> torch.Tensor:
    """cast(x * scale) / scale (scale None or 1: cast(x)); see the module docstring."""
    if scale is None or (isinstance(scale, float) and scale == 1.0):
        return cast(x, dtype)
    return cast(x * scale, dtype) / scale


def saturated(x: torch.Tensor, dtype: torch.dtype, scale=None) -> torch.Tensor:
    """Bool mask of the entries an FP8 `quantize(x, dtype, scale)` clips (|x * scale| >= OVERFLOW_AT)."""
    v = x if scale is None else x * scale
    return v.abs() >= OVERFLOW_AT[dtype]


def amax_scale(x: torch.Tensor, dtype: torch.dtype, dims: Sequence[int]) -> torch.Tensor:
    """Current scaling: max(dtype) / amax(|x|) over `dims` (kept), 1 where the amax is 0 or not finite."""
    amax = x.detach().abs().amax(dim=tuple(dims), keepdim=True)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, fmax(dtype) / torch.where(ok, amax, torch.ones_like(amax)), torch.ones_like(amax))


def block_scale(x: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    """Block quantization (FlashAttention-3): one scale per (batch, head, tile of `block` rows), as (B, H, T, 1)."""
    T = x.shape[2]
    parts = [amax_scale(x[:, :, s:min(s + block, T)], dtype, (2, 3)).expand(-1, -1, min(s + block, T) - s, 1)
             for s in range(0, T, block)]
    return torch.cat(parts, dim=2)


def input_scale(x: torch.Tensor, dtype: torch.dtype, scaling: str, block: int) -> Optional[torch.Tensor]:
    """The scale of an FP8 input (Q, K, V or dO): `tensor` (one amax), `head` (FA3's per-(batch, head) descales),
    `block` (one per tile of `block` rows); None for a format that is not FP8 (no scale)."""
    if dtype not in FP8:
        return None
    if scaling == "tensor":
        return amax_scale(x, dtype, tuple(range(x.dim())))
    if scaling == "head":
        return amax_scale(x, dtype, (2, 3))
    if scaling == "block":
        return block_scale(x, dtype, block)
    raise ValueError(f"input scaling={scaling!r} is not allowed: expected tensor, head or block")


def hadamard(n: int, dtype=F32, device=None) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries +-1); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"head_dim={n} is not allowed: expected a power of two (Hadamard rotation)")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotation(n: int, dtype=F32, device=None, seed: int = 0) -> torch.Tensor:
    """M = diag(random signs) H / sqrt(n): orthogonal (M M^T = I), seeded so forward and backward draw the same."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
    m = signs[:, None] * hadamard(n, torch.float64) / math.sqrt(n)
    return m.to(dtype=dtype, device=device)


def next_below_one(dtype: torch.dtype) -> float:
    """The largest value of `dtype` below 1.0, 1 - eps/2 (BF16 0.99609375, FP16 0.99951171875, e4m3 0.9375, e5m2
    0.875): P̄ above the midpoint between it and 1 rounds to 1."""
    return 1.0 - float(torch.finfo(dtype).eps) / 2


__all__ = ["FORMATS", "FP8", "OVERFLOW_AT", "PBAR_SCALES", "dtype_of", "name_of", "is_fp8", "cast", "quantize",
           "saturated", "amax_scale", "block_scale", "input_scale", "hadamard", "rotation", "next_below_one", "fmax"]
