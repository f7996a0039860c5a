"""Fused Triton flash attention: the fast path on CUDA for the emulator's recipes and knobs.

Causal attention over q, k, v of shape (B, H, T, D), optionally with a per-batch key mask (key_keep (B, T): the
key padding of a padded batch). One kernel per pass, like Triton's fused-attention tutorial:
forward; backward preprocess (delta); backward dK/dV (one program per key block, looping over query tiles); backward
dQ (one program per query block, looping over key tiles). dQ gets its own pass instead of atomics so that results are
deterministic (a replayed run must reproduce bit for bit) and so that paper_bf16 can round its accumulator in the
emulator's tile order.

Every knob is a compile-time switch (tl.constexpr), so a run pays only for what it uses. Where a block size carries
meaning (the tile whose row max the stabilized softmax and the counters see, the tiles paper_bf16 rounds between) it
is the knob's block_q / block_k; elsewhere the kernel picks what runs fastest. tiling=False (one block spans the
sequence) is computed as passes over key tiles with a fixed row max and FP32 accumulators rounded once, which is the
one-block computation up to GEMM summation order, for any T.

Recipe rounding points follow kernels/emulator.py (the source of truth); `_rb` marks each BF16 storage point. A
recipe is a set of rounding points: the kernels take it as one constexpr bitmask, ROUND (`round_mask`: one bit per
flash_forensics.kernels.recipes.ROUNDING_POINTS entry), plus INPUT_F32 (the dtype Q, K, V, dO enter the GEMMs in) and
FLOOR (paper_bf16's 1e-10 row-sum floor). So keep_fp32 / round_bf16 / pv_fp32 are compile-time switches, and a lifted
GEMM operand is an IEEE FP32 GEMM (input_precision="ieee", never TF32).
Key padding (`key_keep`, a constexpr KEYPAD in every kernel; None builds the kernels without it, unchanged): key j of
batch element b is masked for every query when key_keep[b, j] is False, on top of causality, exactly as the
emulator's Masking(keep=causal & key_keep[:, None, None, :]) masks it: the fill value in the forward, P = 0 in the
backward, never in the counters (rows_seen counts, as the emulator's masked path does, the (row, key tile) pairs
with a key). Key tiles before a batch element's first kept key are skipped (they add nothing). A row with no key
at all (left padding: the queries before the first kept key) is the caller's to define: these kernels give it
O = 0 (what SDPA returns, and what flash_forensics/sdpa.py returns on either route) and lse = +inf, and its
gradients are 0; the emulator gives it the mean of the V of the key tiles it visits (an artefact of its tile
sizes) and the same zero gradients. So O differs from the emulator's only in those rows, and dQ, dK, dV do not
differ at all; the transformers backend's outputs are equal on both routes.
The stabilizer knobs (issue 34; kernels/triton_kernels.py's section on them): pbar_clamp (P̄ = 1 at a key tile's
repeated row max fed to P̄V as 0.99609375; the forward stores those positions as bits, 8 keys a byte, and the backward
reads them: the clamp is held constant, as the emulator's backward holds it), softmax=stabilized_guarded (the bounded
shift of the emulator's _new_max, the next representable value where rounding gives back the max) and
stochastic_round (the P̄V product and O accumulator stores rounded with the emulator's random bits:
kernels/stochastic.py's hash of the call key, the emulator's stream ids and its element indices, so both round the
same values the same way). The forward also counts sfa_p1_rows with a stabilized softmax. Their numerics against the
emulator:
tests/unit/test_triton_stabilizers.py (its `gpu` tests are what checks them on CUDA).
Three modules: the jit kernels (kernels/triton_kernels.py, needs triton), their launchers (kernels/triton_launch.py)
and the torch.library operators (kernels/ops.py); this one is the public face: `supports` and
`flash_attention_triton`.
"""
from __future__ import annotations

import torch

from flash_forensics.kernels import ops as _ops
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.knobs import unsupported
from flash_forensics.kernels.triton_launch import (  # noqa: F401  (re-exported: tests and benchmarks read them here)
    DELTA_IDS,
    HEAD_DIMS,
    RECIPE_IDS,
    SHAPE_TABLE,
    TILE_SIZES,
    _backward,
    _bwd_blocks,
    _forward,
    _fwd_blocks,
    _interpret,
    _jit,
    _k,
    fired_pbar_max,
    fold_supported,
    fwd_family,
    launch_config,
    length_class,
    mask_points,
    round_mask,
    saved_o_dtype,
    sr_key,
    tie_buffer,
    tie_words,
)

triton = _jit.triton if _jit is not None else None  # None where triton is not installed


def supports(knobs: AttentionKnobs, q: torch.Tensor) -> bool:
    """True when these kernels implement `knobs` for inputs like `q` (else the caller uses the emulator).

    Which knobs and values they compute is the knob table's (kernels/knobs.py: `triton` in computed_by); what is
    checked here is only this file's own limits: device, head dim, dtype and tile sizes.
    """
    if triton is None or knobs.impl != "flash" or unsupported(knobs, "triton"):
        return False
    if not (q.is_cuda or _interpret()):
        return False
    if q.dim() != 4 or q.shape[-1] not in HEAD_DIMS:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if knobs.exp_form == "exp2_folded" and not fold_supported(knobs):  # BF16 scores or statistics, or no tiling
        return False
    return not knobs.tiling or (knobs.block_q in TILE_SIZES and knobs.block_k in TILE_SIZES)


def flash_attention_triton(q, k, v, knobs: AttentionKnobs, stats=None, key_keep=None):
    """Causal attention O for q, k, v of shape (B, H, T, D); autograd-capable; updates `stats` on the device.

    key_keep: None, or (1 or B, T) bool / int8 / uint8 (nonzero = attend): keys masked on top of causality, as the
    emulator's Masking(keep=tril & key_keep[:, None, None, :]); rows with no key return 0 (module docstring).

    Same contract as flash_forensics.kernels.emulator.flash_attention (the emulator): O in BF16 for paper_bf16 / fa2 and
    FP32 for fp32, gradients in the inputs' dtypes; `stats` (AttnStats) gains, per head, the (row, key tile) pairs where
    the SFA condition fires, the pairs seen, and the running max of the scaled scores. Nothing is synced to the host.
    Runs through the torch.library operators of kernels/ops.py, so torch.compile traces it without a graph break.
    """
    if triton is None:
        raise RuntimeError("flash_attention_triton needs triton; use the emulator (backend=emulator)")
    return _ops.flash_attention(q, k, v, knobs, stats, key_keep)


def prepare_device(knobs: AttentionKnobs, n_head: int, device) -> None:
    """The launchers' per-device tensors for a layer of `knobs` made on `device` now, outside any CUDA graph
    (models/attention.py prepare_device); nothing where triton is missing or these knobs are not Triton's."""
    if triton is not None and not unsupported(knobs, "triton"):
        _ops.prepare_device(knobs, n_head, device)


__all__ = ["supports", "flash_attention_triton", "prepare_device", "fired_pbar_max", "round_mask", "mask_points",
           "saved_o_dtype", "RECIPE_IDS", "DELTA_IDS"]
