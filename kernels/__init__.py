"""Attention numerics: precision recipes, the plain-PyTorch flash attention emulator, device-side statistics.

`flash_attention(q, k, v, cfg, stats=None)` is the emulator (runs anywhere; the source of truth for the recipes);
models/ routes to kernels.triton_flash on CUDA where it supports the knobs.
"""
from kernels.config import AttentionConfig, AttentionKnobs, LayerOverride
from kernels.emulator import capture_forward, flash_attention, reference_attention
from kernels.recipes import Recipe, resolve, round_to
from kernels.stats import AttnStats

__all__ = ["flash_attention", "reference_attention", "capture_forward", "AttnStats", "Recipe", "resolve",
           "round_to", "AttentionKnobs", "AttentionConfig", "LayerOverride"]
