"""Stochastic rounding FP32 -> BF16 with a counter-based generator on the device (knob `stochastic_round`).

Rounding: BF16 keeps the top 16 bits of an FP32 pattern. Adding a uniform 16-bit integer r to the pattern and
dropping the low 16 bits rounds the magnitude up with probability (low 16 bits) / 2^16, which is exactly the
position of x between its two BF16 neighbours (the patterns are linear in the value inside a binade, and the next
binade starts at the pattern the carry gives). So E[round(x)] = x: unbiased. Non-finite values are left as they are
(their patterns would carry into the sign); a value past the largest BF16 may round up to inf, as nearest would.

Generator: no torch.Generator (seeding one from a device value would need a host sync). A 32-bit integer hash
(Wellons' lowbias32) of the element index, keyed twice, in int64 arithmetic that never overflows. The keys come
from the knob `sr_seed`, a digest of the call's inputs (q, k, v as the kernel stores them) and a per-rounding-point
stream id (point, query tile, key tile). So the bits are a pure function of (seed, inputs, point): a replayed run,
a resumed run and a fork redraw exactly the same bits (no counter to checkpoint), while two calls with other inputs
(other steps, layers, micro-batches, ranks) draw other bits.
"""
from __future__ import annotations

from typing import Optional

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, without an int64 overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer (Chris Wellons' lowbias32) on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix(a: int) -> int:
    """lowbias32 of a Python int (stream ids and seeds: host values, no device work)."""
    x = a & _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _digest(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit int64 digest of x's values, order-sensitive, exact (integer sums do not depend on reduction order).
    x holds BF16 values (the kernel's rounded q, k, v): the top 16 bits of each FP32 pattern carry them."""
    bits = (x.detach().float().contiguous().view(torch.int32).to(torch.int64) >> 16) & 0xFFFF
    weight = torch.arange(bits.numel(), device=x.device, dtype=torch.int64).view(bits.shape) % 65521 + 1
    return (bits * weight).sum() & _M32  # < 2^32 * numel: no overflow below 2^31 elements


def call_key(seed: int, *inputs: torch.Tensor) -> torch.Tensor:
    """The call's base key, an int64 device scalar in [0, 2^32): seed and the inputs' digests, mixed."""
    key = torch.tensor(_mix(seed), dtype=torch.int64, device=inputs[0].device)
    for i, x in enumerate(inputs):
        key = lowbias32((key ^ _digest(x)) + i) & _M32
    return key


def uniform16(key: torch.Tensor, stream: int, shape, device) -> torch.Tensor:
    """Uniform integers in [0, 2^16), int64 of `shape`: element index hashed under two keys derived from (key,
    stream). Two keys: streams whose first keys make their index ranges overlap are still decorrelated."""
    s = _mix(stream)
    k1 = lowbias32((key + s) & _M32)
    k2 = lowbias32(k1 ^ _mix(s ^ 0x9E3779B9))
    n = 1
    for d in shape:
        n *= int(d)
    ctr = torch.arange(n, device=device, dtype=torch.int64).view(tuple(shape))
    return lowbias32(lowbias32((ctr + k1) & _M32) ^ k2) >> 16


def stochastic_round(x: torch.Tensor, bits16: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (FP32) rounded stochastically to BF16 with the uniform 16-bit integers `bits16`, returned in FP32; where
    `keep` is True (it broadcasts, e.g. (1, H, 1, 1)), x unchanged."""
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic rounding takes FP32 (the emulator's working dtype), got {x.dtype}")
    pattern = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    up = (pattern + bits16) & 0xFFFF0000
    signed = torch.where(up >= 2 ** 31, up - 2 ** 32, up).to(torch.int32)
    y = signed.view(torch.float32)
    y = torch.where(torch.isfinite(x), y, x)
    return y if keep is None else torch.where(keep, x, y)


__all__ = ["call_key", "uniform16", "stochastic_round", "lowbias32"]
