"""Real kernels as rules over the knob table: for a call's shape, the knobs that describe how a kernel computes it.

A rule is general (a function of B, H, T, D and the GPU), never fitted to one capture. Each names its source: the
kernel's public code, or a measurement (results/real_kernels/, from scripts/capture_kernels.py on an H200).

- torch_flash_sm90: torch SDPA's flash backend, FlashAttention-2 (torch's copy of Dao-AILab/flash-attention
  csrc/flash_attn): tiles from flash_fwd_launch_template.h (D <= 64: 128 x 128; D <= 128: 128 x 64 on sm90, not
  sm8x), the split-KV path when flash_api.cpp's num_splits_heuristic picks more than one split (64 x 256 for
  D <= 64, 64 x 128 for D <= 128; 2 x the SM count as the wave size), key blocks last to first, the exp2 softmax
  with the scale folded in, O = acc * (1 / l), per-thread row sums, mma.sync accumulation.
- cudnn_sm90, efficient_sm90: measured (their tiles and order chosen from a grid once, the same for every input).
- triton_<recipe>: the project's Triton kernels (kernels/triton_kernels.py): the launcher's tiles, Triton's tl.exp
  (exp2 of x * log2(e)), wgmma accumulation.
"""
from __future__ import annotations

import math
from typing import Callable, Dict

from flash_forensics.kernels import triton_launch
from flash_forensics.kernels.config import AttentionKnobs

H100_SMS = 132  # H100 SXM / H200: what the split heuristic divides by


def num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """FlashAttention-2's flash_api.cpp num_splits_heuristic (the efficiency rule, as written there)."""
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def eligible(n: int) -> bool:
        return n == 1 or math.ceil(num_n_blocks / n) != math.ceil(num_n_blocks / (n - 1))

    eff = {}
    for n in range(1, max_splits + 1):
        if eligible(n):
            waves = batch_nheads_mblocks * n / num_sms
            eff[n] = waves / math.ceil(waves)
    best = max(eff.values(), default=0.0)
    for n in range(1, max_splits + 1):
        if n in eff and eff[n] >= 0.85 * best:
            return n
    return 1


_FA2 = dict(recipe="fa2", exp_form="exp2_folded", key_order="reverse", normalize="reciprocal",
            rowsum_order="fa2_threads", tensor_core="sm90")


def torch_flash_sm90(B: int, H: int, T: int, D: int, sms: int = H100_SMS) -> dict:
    split_n = 256 if D <= 64 else 128  # run_mha_fwd_splitkv_dispatch's kBlockN
    n_blocks = -(-T // split_n)
    splits = num_splits_heuristic(B * H * -(-T // 64), 2 * sms, n_blocks, 128)
    if splits > 1:
        return dict(_FA2, block_q=64, block_k=split_n, kv_split=-(-n_blocks // splits) * split_n)
    return dict(_FA2, block_q=128, block_k=128 if D <= 64 else 64)


def cudnn_sm90(B: int, H: int, T: int, D: int) -> dict:
    return dict(recipe="fa2", exp_form="exp2_folded", rowsum_order="fa2_threads", tensor_core="sm90",
                block_q=128, block_k=128)


def efficient_sm90(B: int, H: int, T: int, D: int) -> dict:
    return dict(recipe="fa2", exp_form="exp2_folded", tensor_core="sm90", block_q=64, block_k=64 if D <= 64 else 128)


def _triton(recipe: str) -> Callable[[int, int, int, int], dict]:
    def rule(B: int, H: int, T: int, D: int) -> dict:
        bm, bn, _, _ = triton_launch._fwd_blocks(AttentionKnobs(recipe=recipe), D, T)
        return dict(recipe=recipe, exp_form="exp2_mul", tensor_core="sm90", block_q=bm, block_k=bn)
    return rule


RULES: Dict[str, Callable[[int, int, int, int], dict]] = {
    "torch_flash_sm90": torch_flash_sm90, "cudnn_sm90": cudnn_sm90, "efficient_sm90": efficient_sm90,
    "triton_paper_bf16": _triton("paper_bf16"), "triton_fa2": _triton("fa2"),
}


def rule_knobs(name: str, B: int, H: int, T: int, D: int) -> dict:
    """The knob values of rule `name` for a call of this shape (ValueError naming the rule and the allowed ones)."""
    if name not in RULES:
        raise ValueError(f"real-kernel rule {name!r} is not allowed: expected one of {', '.join(RULES)}")
    return dict(RULES[name](B, H, T, D), counters=False)


__all__ = ["RULES", "rule_knobs", "num_splits_heuristic", "torch_flash_sm90", "cudnn_sm90", "efficient_sm90",
           "H100_SMS"]
