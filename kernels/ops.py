"""The Triton flash kernels as PyTorch operators (torch.library), so torch.compile traces a whole GPT through them.

`flash_forensics::flash_fwd` and `flash_forensics::flash_bwd` are custom ops with fake (meta) implementations:
dynamo and AOTAutograd trace them from their schemas, and inductor treats them as opaque calls, so it never fuses
into them or reorders their roundings: compiled and eager attention run the same kernels on the same inputs and
agree bit for bit. An optional key_keep (1 or B, T) (bool / int8 / uint8, nonzero = attend) masks keys on top of
causality (transformers' padded batches; kernels/triton_launch.py key_padding); None runs the kernels without key
masks, as before. The knobs travel as ONE string argument, `spec` (op_spec: recipe, tiling, tiles, softmax, beta,
eps, delta, pv_fp32, FP32-O heads, rounding points, FP32 GEMM mode, exp_form; floats by repr, so exact): torch's
dispatch of a mutating custom op fills in the schema's defaults over `schema.arguments`, rebuilt for every argument,
so its cost grows with the square of the argument count (a no-op op with the 18 arguments these ops had: 127 us a
call, with 8: 45 us, on a 2-core CPU; benchmarks/host_overhead.py), and a compiled graph calls the ops through that
dispatch.
The forward adds into the layer's AttnStats counters, which its schema declares as mutated (`Tensor(a!)?`). Its
third output is pbar_clamp's tie bits (kernels/triton_launch.py tie_buffer; empty when the knob is off), which the
backward reads. torch.library refuses an autograd formula on a mutating op, so autograd is one
torch.autograd.Function around the two ops, which dynamo traces without a graph break. In eager mode the same
Function calls the launchers directly (the dispatcher's Python overhead is tens of microseconds a call, visible at
small shapes); the kernels and their arguments are the same.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from flash_forensics.kernels import triton_launch as tf
from flash_forensics.kernels.config import AttentionKnobs

LIB = "flash_forensics"


def _knobs(recipe: str, tiling: bool, block_q: int, block_k: int, softmax: str = "safe", beta: float = 2.0,
           eps: float = 1e-3, delta: str = "dO_O", pv_fp32: bool = False,
           fp32_heads: Optional[List[int]] = None, rounding: int = -1, fp32_gemm: str = "ieee",
           pbar_clamp: bool = False, stochastic_round: bool = False, sr_seed: int = 0,
           exp_form: str = "exp") -> AttentionKnobs:
    """The knobs an op call carries, as the launchers take them (read only: one object per distinct call, cached,
    since building it resolves the recipe, tens of microseconds a call on the host). `rounding`: the BF16 rounding
    points as flash_forensics.kernels.triton_flash.round_mask gives them (pv_fp32 included); -1: the recipe's own."""
    return _knobs_cached(recipe, bool(tiling), int(block_q), int(block_k), softmax, float(beta), float(eps), delta,
                         bool(pv_fp32), tuple(int(h) for h in fp32_heads or ()), int(rounding), fp32_gemm,
                         bool(pbar_clamp), bool(stochastic_round), int(sr_seed), exp_form)


@functools.lru_cache(maxsize=1024)
def _knobs_cached(recipe, tiling, block_q, block_k, softmax, beta, eps, delta, pv_fp32, fp32_heads, rounding,
                  fp32_gemm, pbar_clamp, stochastic_round, sr_seed, exp_form) -> AttentionKnobs:
    keep, rnd = tf.mask_points(recipe, rounding) if rounding >= 0 else ([], [])
    return AttentionKnobs(impl="flash", backend="triton", recipe=recipe, tiling=tiling, block_q=block_q,
                          block_k=block_k, softmax=softmax, beta=beta, eps=eps, delta=delta, pv_fp32=pv_fp32,
                          o_fp32_heads=list(fp32_heads or ()), keep_fp32=keep, round_bf16=rnd, fp32_gemm=fp32_gemm,
                          pbar_clamp=pbar_clamp, stochastic_round=stochastic_round, sr_seed=sr_seed,
                          exp_form=exp_form)


SPEC_FIELDS = ("recipe", "tiling", "block_q", "block_k", "softmax", "beta", "eps", "delta", "pv_fp32", "fp32_heads",
               "rounding", "fp32_gemm", "pbar_clamp", "stochastic_round", "sr_seed", "exp_form")


def op_spec(knobs: AttentionKnobs, n_head: int) -> str:
    """The ops' `spec`: op_args, the rounding bitmask, the FP32 GEMM mode, op_stabilizers and exp_form,
    ';'-separated (beta and eps by repr, so parse_spec gives back the same floats). Plain string work on constants:
    dynamo folds it without a graph break."""
    recipe, tiling, bq, bk, softmax, beta, eps, delta, pv, heads = op_args(knobs, n_head)
    hs = ",".join([str(h) for h in heads])
    clamp, sr, seed = op_stabilizers(knobs)
    return (f"{recipe};{int(tiling)};{bq};{bk};{softmax};{beta!r};{eps!r};{delta};{int(pv)};{hs};"
            f"{op_rounding(knobs)};{knobs.fp32_gemm};{int(clamp)};{int(sr)};{seed};{knobs.exp_form}")


@functools.lru_cache(maxsize=1024)
def parse_spec(spec: str) -> tuple:
    """op_spec's fields back, typed (fp32_heads a tuple); a malformed spec names what it expected."""
    f = spec.split(";")
    if len(f) != len(SPEC_FIELDS):
        raise ValueError(f"spec={spec!r} is not allowed: expected {len(SPEC_FIELDS)} ';'-separated fields "
                         f"({', '.join(SPEC_FIELDS)}), as kernels/ops.py op_spec writes them")
    return (f[0], f[1] == "1", int(f[2]), int(f[3]), f[4], float(f[5]), float(f[6]), f[7], f[8] == "1",
            tuple(int(h) for h in f[9].split(",") if h), int(f[10]), f[11], f[12] == "1", f[13] == "1", int(f[14]),
            f[15])


def _fwd_knobs(spec: str) -> AttentionKnobs:
    """The knobs the forward launches with for `spec` (cached objects: the launchers' per-knobs caches key on them)."""
    recipe, tiling, bq, bk, softmax, beta, eps, _dl, pv, heads, rounding, gemm, clamp, sr, seed, ef = parse_spec(spec)
    return _knobs(recipe, tiling, bq, bk, softmax, beta, eps, "dO_O", pv, heads, rounding, gemm, clamp, sr, seed, ef)


def _fwd_body(q, k, v, rep, maxl, under, p1, key_keep, spec):
    knobs = _fwd_knobs(spec)
    ties = tf.tie_buffer(knobs, q)
    o, lse, _, _ = tf._forward(q, k, v, knobs, rep, maxl, under=under, key_keep=key_keep, p1=p1, ties=ties)
    return o, lse, ties


def _bwd_body(do, q, k, v, o, lse, key_keep, ties, spec):
    recipe, tiling, bq, bk, _softmax, _beta, _eps, delta, _pv, heads, rounding, gemm, *_ = parse_spec(spec)
    clamp = ties is not None and ties.numel() > 0
    return tf._backward(do, q, k, v, o, lse, _knobs(recipe, tiling, bq, bk, delta=delta, fp32_heads=heads,
                                                    rounding=rounding, fp32_gemm=gemm, pbar_clamp=clamp),
                        key_keep=key_keep, ties=ties if clamp else None)


@torch.library.custom_op(f"{LIB}::flash_fwd",
                         mutates_args=("repeated_max_rows", "max_logit", "underflow_rows", "sfa_p1_rows"))
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeated_max_rows: Optional[torch.Tensor],
              max_logit: Optional[torch.Tensor], underflow_rows: Optional[torch.Tensor],
              sfa_p1_rows: Optional[torch.Tensor], key_keep: Optional[torch.Tensor],
              spec: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal flash forward: (O as stored for the backward, lse (B, H, T) FP32, pbar_clamp's tie bits (B, H, T,
    tie_words(T)) uint8, empty when it is off). Counters are added into repeated_max_rows (H,) int64 and max_logit
    () FP32 when given (both or neither), and into underflow_rows and sfa_p1_rows (H,) int64 when given with them
    (rows whose row sum underflowed; pairs where a stabilized softmax fired but P̄ = 1 remained). `key_keep` (1 or
    B, T): keys masked on top of
    causality (rows with no key: O = 0, lse = +inf). `spec`: the knobs (op_spec): among them the BF16 rounding points
    (flash_forensics.kernels.triton_flash.round_mask) and how FP32 GEMMs run (ieee | tf32x3).
    No argument has a default: torch <= 2.11 drops a default-valued argument before its version-counter bookkeeping
    and fails on it (IndexError; pytorch issue 176078), which broke compile with counters off."""
    return _fwd_body(q, k, v, repeated_max_rows, max_logit, underflow_rows, sfa_p1_rows, key_keep, spec)


@flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, repeated_max_rows, max_logit, underflow_rows, sfa_p1_rows, key_keep, spec):
    B, H, T, D = q.shape
    recipe, tiling, bq, bk, _softmax, _beta, _eps, _delta, pv, heads, rounding, _gemm, clamp, *_ = parse_spec(spec)
    mask = rounding if rounding >= 0 else tf.round_mask(_knobs(recipe, tiling, bq, bk, pv_fp32=pv))
    ties = (B, H, T, tf.tie_words(T)) if clamp else (0,)
    return (tf.empty_like_order(q, (B, H, T, D), tf.saved_o_dtype(mask, heads)),
            q.new_empty((B, H, T), dtype=torch.float32), q.new_empty(ties, dtype=torch.uint8))


@torch.library.custom_op(f"{LIB}::flash_bwd", mutates_args=())
def flash_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
              key_keep: Optional[torch.Tensor], ties: Optional[torch.Tensor],
              spec: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal flash backward from the forward's stored O and lse: (dq, dk, dv) in q's, k's, v's dtypes; key_keep
    and spec the forward's; ties: the forward's third output (pbar_clamp when not empty)."""
    return _bwd_body(do, q, k, v, o, lse, key_keep, ties, spec)


@flash_bwd.register_fake
def _flash_bwd_fake(do, q, k, v, o, lse, key_keep, ties, spec):
    shape = tuple(q.shape)  # as tf._backward allocates them: dV in dK's order (one set of strides for both)
    return (tf.empty_like_order(q, shape, q.dtype), tf.empty_like_order(k, shape, k.dtype),
            tf.empty_like_order(k, shape, v.dtype))


class FlashAttention(torch.autograd.Function):
    """Autograd over the two ops: saves q, k, v, the stored O, lse and the tie bits; the backward is one flash_bwd
    call."""

    @staticmethod
    def forward(ctx, q, k, v, rep, maxl, under, p1, key_keep, spec):
        args = (q, k, v, rep, maxl, under, p1, key_keep, spec)
        if torch.compiler.is_compiling():
            o, lse, ties = torch.ops.flash_forensics.flash_fwd(*args)
        else:  # the op's own body, without the dispatcher's per-call overhead
            o, lse, ties = _fwd_body(*args)
        ctx.save_for_backward(q, k, v, o, lse, key_keep, ties)
        ctx.spec = spec
        # returned O: BF16 for paper_bf16 / fa2 (also for heads whose stored O is FP32), FP32 for fp32
        out_dtype = torch.float32 if spec.startswith("fp32;") else torch.bfloat16
        return o if o.dtype == out_dtype else o.to(out_dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, key_keep, ties = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dq, dk, dv = torch.ops.flash_forensics.flash_bwd(do, q, k, v, o, lse, key_keep, ties, ctx.spec)
        else:
            dq, dk, dv = _bwd_body(do, q, k, v, o, lse, key_keep, ties, ctx.spec)
        return (dq, dk, dv) + (None,) * 6


def op_args(knobs: AttentionKnobs, n_head: int) -> tuple:
    """The knobs as the ops' scalar arguments, in FlashAttention.forward's order after rep, maxl."""
    return (knobs.recipe, bool(knobs.tiling), int(knobs.block_q), int(knobs.block_k), knobs.softmax,
            float(knobs.beta), float(knobs.eps), knobs.delta, bool(knobs.pv_fp32),
            [int(h) for h in knobs.fp32_o_heads(n_head)])


def op_stabilizers(knobs: AttentionKnobs) -> tuple:
    """The stabilizer knobs the spec carries last: (pbar_clamp, stochastic_round, sr_seed)."""
    sr = bool(knobs.stochastic_round)
    return bool(knobs.pbar_clamp), sr, int(knobs.sr_seed) if sr else 0


def op_rounding(knobs: AttentionKnobs) -> int:
    """The spec's `rounding`: keep_fp32 / round_bf16 / pv_fp32 on the recipe as one bitmask."""
    return tf.round_mask(knobs)


def flash_attention(q, k, v, knobs: AttentionKnobs, stats=None, key_keep=None):
    """flash_attention_triton's body (kernels/triton_flash.py): the ops, then rows_seen (a Python int, or with
    key_keep a device count as the emulator's masked path counts it: no host sync either way)."""
    B, H, T, _ = q.shape
    counters = stats is not None and knobs.counters
    rep, maxl = (stats.repeated_max_rows, stats.max_logit) if counters else (None, None)
    under = getattr(stats, "underflow_rows", None) if counters else None
    p1 = getattr(stats, "sfa_p1_rows", None) if counters else None
    o = FlashAttention.apply(q, k, v, rep, maxl, under, p1, key_keep, op_spec(knobs, H))
    if counters and getattr(stats, "rows_seen", None) is not None:
        stats.rows_seen.add_(B * tf._rows_per_head(T, knobs) if key_keep is None
                             else tf.rows_seen_padded(key_keep, B, T, knobs))
    return o


def prepare_device(knobs: AttentionKnobs, n_head: int, dev) -> None:
    """What the launchers keep per device for `knobs` on n_head heads, made now (kernels/triton_launch.py
    prepare_device's constants, and the FP32-O head flags under the key the ops' own knobs give them)."""
    dev = torch.device(dev)
    tf.prepare_device(dev)
    tf._ofp32_flags(_fwd_knobs(op_spec(knobs, n_head)), n_head, dev)


__all__ = ["flash_fwd", "flash_bwd", "FlashAttention", "flash_attention", "op_args", "op_rounding", "op_stabilizers",
           "op_spec", "parse_spec", "prepare_device"]
