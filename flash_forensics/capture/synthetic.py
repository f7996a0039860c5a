"""Attention inputs for tests, benchmarks and demos: plain random ones, and ones with repeated maxima.

`tied_inputs`: keys come in pairs, the second of each pair equal to the first (`exact` ties: equal in FP32 scores
too) or the first plus a perturbation far below one BF16 ulp of the score (ties `created` by rounding S to BF16);
queries are aligned with a few keys and scaled so the row max stands out (large logits, P̄ = 1 at the tied maxima):
the regime of the paper's failure. Everything in BF16 (what a BF16 kernel sees).
"""
from __future__ import annotations

import torch


def random_inputs(B: int, H: int, T: int, D: int, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(4))  # q, k, v, dO


def tied_inputs(B: int, H: int, T: int, D: int, seed: int = 0, gain: float = 4.0, align: float = 1.0,
                dtype=torch.bfloat16):
    """(q, k, v, dO) with repeated row maxima: every other key repeats its predecessor (head h: exact duplicates
    for even h, sub-ulp perturbations for odd h), each query close to one key times `gain`."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g)
    k[:, :, 1::2] = k[:, :, 0::2][:, :, : k[:, :, 1::2].shape[2]]
    odd = torch.arange(H) % 2 == 1
    k[:, odd, 1::2] += 1e-4 * torch.randn(k[:, odd, 1::2].shape, generator=g)  # ties only after rounding S
    k = k.to(dtype)
    # each query points at an earlier key pair (causal: visible), with noise: large, repeated maxima
    idx = (torch.arange(T) // 2 * 2).clamp(min=0)
    pick = (idx - 2 * torch.randint(0, 4, (T,), generator=g)).clamp(min=0)
    q = gain * k.float()[:, :, pick] + 0.3 * torch.randn(B, H, T, D, generator=g)
    v = torch.randn(B, H, T, D, generator=g) + 0.5  # a nonzero mean: O's rounding errors do not cancel
    # dO leans towards the value of the key each query attends to (as a trained model's does): the direction in
    # which P̄'s rounding moves O, so the delta error's bias shows, as in the paper
    do = align * v[:, :, pick] + torch.randn(B, H, T, D, generator=g)
    return q.to(dtype), k, v.to(dtype), do.to(dtype)


__all__ = ["random_inputs", "tied_inputs"]
