"""Fused Triton flash attention (the fast path on CUDA) implementing the emulator's recipes and knobs.

Work in progress: the public signatures below are stable; the kernels land in follow-up commits.
"""
from __future__ import annotations

import torch

from kernels.config import AttentionKnobs


def supports(knobs: AttentionKnobs, q: torch.Tensor) -> bool:
    """True when the Triton kernels implement these knobs for this input (CUDA, head dim 64/128)."""
    return False


def flash_attention_triton(q, k, v, knobs: AttentionKnobs, stats=None):
    """Causal attention O for q, k, v of shape (B, H, T, D); autograd-capable; updates `stats` on the device."""
    raise NotImplementedError("Triton flash attention is not implemented yet")


__all__ = ["supports", "flash_attention_triton"]
