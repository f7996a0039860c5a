"""Fused Triton flash attention: the fast path on CUDA for the emulator's recipes and knobs.

Causal attention over q, k, v of shape (B, H, T, D). One kernel per pass, like Triton's fused-attention tutorial:
forward; backward preprocess (delta); backward dK/dV (one program per key block, looping over query tiles); backward
dQ (one program per query block, looping over key tiles). dQ gets its own pass instead of atomics so that results are
deterministic (a replayed run must reproduce bit for bit) and so that paper_bf16 can round its accumulator in the
emulator's tile order.

Every knob is a compile-time switch (tl.constexpr), so a run pays only for what it uses. Where a block size carries
meaning (the tile whose row max the stabilized softmax and the counters see, the tiles paper_bf16 rounds between) it
is the knob's block_q / block_k; elsewhere the kernel picks what runs fastest. tiling=False (one block spans the
sequence) is computed as passes over key tiles with a fixed row max and FP32 accumulators rounded once, which is the
one-block computation up to GEMM summation order, for any T.

Recipe rounding points follow kernels/emulator.py (the source of truth); `_rb` marks each BF16 storage point.
"""
from __future__ import annotations

import math
import os

import torch

from kernels.config import AttentionKnobs
from kernels.knobs import unsupported

try:  # Triton is optional: the emulator serves machines without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

RECIPE_IDS = {"fp32": 0, "fa2": 1, "paper_bf16": 2}
DELTA_IDS = {"dO_O": 0, "dP_P": 1, "recompute_fp32": 2}
HEAD_DIMS = (16, 32, 64, 128)
TILE_SIZES = (16, 32, 64, 128)
NEG_BF16 = -torch.finfo(torch.bfloat16).max  # masked score: the most negative BF16, as in the paper's code


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read at import: the kernels were built for it


def _interpret() -> bool:
    return _INTERPRET


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
    return not knobs.tiling or (knobs.block_q in TILE_SIZES and knobs.block_k in TILE_SIZES)


if triton is not None:

    @triton.jit
    def _rb(x):
        """Round an FP32 value to BF16 storage (round to nearest even) and back: one emulated BF16 store."""
        return x.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def _rpv(x, keep, PV_FP32: tl.constexpr, HAS_OFP32: tl.constexpr):
        """A BF16 store on the P̄V path, lifted by pv_fp32 (all heads) or o_fp32 (heads where `keep`)."""
        if PV_FP32:
            return x
        elif HAS_OFP32:
            return tl.where(keep, x, _rb(x))
        else:
            return _rb(x)

    @triton.jit
    def _scores(q, k_ptrs, offs_m, offs_n, T, scale, RECIPE: tl.constexpr, GEMM_DT: tl.constexpr,
                MASKED: tl.constexpr):
        """S for one tile, scaled; MASKED: causal and past-T entries set to the most negative BF16."""
        if MASKED:
            k = tl.load(k_ptrs, mask=(offs_n < T)[:, None], other=0.0).to(GEMM_DT)
        else:  # a tile wholly below the diagonal: every key exists and is visible
            k = tl.load(k_ptrs).to(GEMM_DT)
        if RECIPE == 0:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k))
            if RECIPE == 2:  # paper_bf16: QK^T stored in BF16, then scaled in BF16
                s = _rb(_rb(s) * scale)
            else:
                s = s * scale
        if MASKED:
            s = tl.where((offs_n[None, :] <= offs_m[:, None]) & (offs_n < T)[None, :], s, -3.3895313892515355e38)
        return s

    @triton.jit
    def _valid(offs_m, offs_n, T, MASKED: tl.constexpr):
        if MASKED:
            return (offs_n[None, :] <= offs_m[:, None]) & (offs_n < T)[None, :]
        else:
            return offs_n[None, :] >= 0

    @triton.jit
    def _fwd_inner(acc, l_i, m_i, raw_max, fired, pmax, q, k_base, v_base, skt, svt, offs_m, offs_n, row_ok,
                   lo, hi, T, scale, beta, eps, o_fp32,
                   BLOCK_N: tl.constexpr, RECIPE: tl.constexpr, GEMM_DT: tl.constexpr, STABILIZED: tl.constexpr,
                   NEED_REP: tl.constexpr, PROBE: tl.constexpr, PV_FP32: tl.constexpr, HAS_OFP32: tl.constexpr,
                   ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr):
        """The forward over key tiles [lo, hi): online softmax (or, ONE_BLOCK, a fixed row max) and P̄V."""
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            s = _scores(q, k_base + cols[:, None] * skt, offs_m, cols, T, scale, RECIPE, GEMM_DT, MASKED)
            if ONE_BLOCK:
                if RECIPE == 2:
                    p = tl.exp(_rb(s - m_i[:, None]))
                else:
                    p = tl.exp(s - m_i[:, None])
                l_i += tl.sum(p, 1)
                if PROBE:
                    pmax = tl.where(fired > 0, tl.maximum(pmax, tl.max(p, 1)), pmax)
            else:
                rm = tl.max(s, 1)
                raw_max = tl.maximum(raw_max, rm)
                if NEED_REP:  # Algorithm 3 on this key tile (masked entries never count)
                    thr = rm - eps
                    if RECIPE == 2:
                        thr = _rb(thr)
                    near = _valid(offs_m, cols, T, MASKED) & (s >= thr[:, None])
                    fire = (tl.sum(near.to(tl.int32), 1) > 1) & row_ok
                    fired += fire.to(tl.int32)
                    if STABILIZED:
                        rm_s = rm * beta
                        if RECIPE == 2:
                            rm_s = _rb(rm_s)
                        rm = tl.where(fire & (rm > 0), rm_s, rm)
                        rm = tl.where(fire & (rm < 0), 0.0, rm)
                m_new = tl.maximum(m_i, rm)
                if RECIPE == 2:  # subtractions stored in BF16, exp and row sum in FP32, l stored in BF16
                    alpha = tl.exp(_rb(m_i - m_new))
                    p = tl.exp(_rb(s - m_new[:, None]))
                    l_i = _rb(alpha * l_i + tl.maximum(tl.sum(p, 1), 1e-10))
                else:
                    alpha = tl.exp(m_i - m_new)
                    p = tl.exp(s - m_new[:, None])
                    l_i = alpha * l_i + tl.sum(p, 1)
                if PROBE:
                    pmax = tl.where(fire, tl.maximum(pmax, tl.max(p, 1)), pmax)
                acc = acc * alpha[:, None]
                if RECIPE == 2:
                    acc = _rpv(acc, o_fp32, PV_FP32, HAS_OFP32)
                m_i = m_new
            if MASKED:
                v = tl.load(v_base + cols[:, None] * svt, mask=(cols < T)[:, None], other=0.0).to(GEMM_DT)
            else:
                v = tl.load(v_base + cols[:, None] * svt).to(GEMM_DT)
            if RECIPE == 0:
                pv = tl.dot(p, v, input_precision="ieee")
            elif PV_FP32:  # P̄ unrounded, FP32 GEMM
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            elif HAS_OFP32:  # heads with FP32 O skip P̄'s rounding; FP32 GEMM on BF16-exact values elsewhere
                pv = tl.dot(tl.where(o_fp32, p, _rb(p)), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(tl.bfloat16), v)
            if RECIPE == 2 and not ONE_BLOCK:  # P̄V stored in BF16, then O_acc = r(r(O_acc * alpha) + P̄V)
                acc = _rpv(acc + _rpv(pv, o_fp32, PV_FP32, HAS_OFP32), o_fp32, PV_FP32, HAS_OFP32)
            else:
                acc += pv
        return acc, l_i, m_i, raw_max, fired, pmax

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, REP, MAXL, OFP32, PMAX, FIRED,
                    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
                    H, T, scale, beta, eps,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    RECIPE: tl.constexpr, STABILIZED: tl.constexpr, COUNTERS: tl.constexpr,
                    PV_FP32: tl.constexpr, HAS_OFP32: tl.constexpr, ONE_BLOCK: tl.constexpr,
                    PROBE: tl.constexpr):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        GEMM_DT: tl.constexpr = tl.float32 if RECIPE == 0 else tl.bfloat16
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < T
        q = tl.load(Q + off_b * sqb + off_h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                    mask=row_ok[:, None], other=0.0).to(GEMM_DT)
        k_base = K + off_b * skb + off_h * skh + offs_d[None, :] * skd
        v_base = V + off_b * svb + off_h * svh + offs_d[None, :] * svd
        # O kept in FP32 for this head (o_fp32 / o_fp32_heads): a runtime flag per program
        o_fp32 = tl.load(OFP32 + off_h) != 0  # used only where HAS_OFP32
        hi = tl.minimum((start_m + 1) * BLOCK_M, T)

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 3.3895313892515355e38
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        raw_max = tl.zeros([BLOCK_M], dtype=tl.float32) - 3.3895313892515355e38
        fired = tl.zeros([BLOCK_M], dtype=tl.int32)
        pmax = tl.zeros([BLOCK_M], dtype=tl.float32)  # PROBE: largest P̄ in a tile where the SFA condition fired
        NEED_REP: tl.constexpr = STABILIZED or COUNTERS or PROBE

        if ONE_BLOCK:
            # pass 1: the row max over the whole (causal) row, as one block would see it
            for start_n in range(0, hi, BLOCK_N):
                s = _scores(q, k_base + (start_n + offs_n)[:, None] * skt, offs_m, start_n + offs_n, T,
                            scale, RECIPE, GEMM_DT, True)
                m_i = tl.maximum(m_i, tl.max(s, 1))
            raw_max = m_i
            if NEED_REP:
                # pass 2: how many scores of the row reach its max - eps (threshold stored like the scores)
                thr = m_i - eps
                if RECIPE == 2:
                    thr = _rb(thr)
                cnt = tl.zeros([BLOCK_M], dtype=tl.int32)
                for start_n in range(0, hi, BLOCK_N):
                    s = _scores(q, k_base + (start_n + offs_n)[:, None] * skt, offs_m, start_n + offs_n, T,
                                scale, RECIPE, GEMM_DT, True)
                    near = _valid(offs_m, start_n + offs_n, T, True) & (s >= thr[:, None])
                    cnt += tl.sum(near.to(tl.int32), 1)
                fire = (cnt > 1) & row_ok
                fired = fire.to(tl.int32)
                if STABILIZED:
                    m_s = m_i * beta
                    if RECIPE == 2:
                        m_s = _rb(m_s)
                    m_i = tl.where(fire & (m_i > 0), m_s, m_i)
                    m_i = tl.where(fire & (m_i < 0), 0.0, m_i)

        # key tiles wholly below this query block's diagonal need no mask; the rest do
        mid = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N
        acc, l_i, m_i, raw_max, fired, pmax = _fwd_inner(
            acc, l_i, m_i, raw_max, fired, pmax, q, k_base, v_base, skt, svt, offs_m, offs_n, row_ok, 0, mid, T,
            scale, beta, eps, o_fp32, BLOCK_N, RECIPE, GEMM_DT, STABILIZED, NEED_REP, PROBE, PV_FP32, HAS_OFP32,
            ONE_BLOCK, False)
        acc, l_i, m_i, raw_max, fired, pmax = _fwd_inner(
            acc, l_i, m_i, raw_max, fired, pmax, q, k_base, v_base, skt, svt, offs_m, offs_n, row_ok, mid, hi, T,
            scale, beta, eps, o_fp32, BLOCK_N, RECIPE, GEMM_DT, STABILIZED, NEED_REP, PROBE, PV_FP32, HAS_OFP32,
            ONE_BLOCK, True)

        if ONE_BLOCK:
            if RECIPE == 2:  # one tile: l and the P̄V product stored once
                l_i = _rb(tl.maximum(l_i, 1e-10))
                acc = _rpv(acc, o_fp32, PV_FP32, HAS_OFP32)
        o = acc / l_i[:, None]
        if RECIPE != 0:  # O stored in BF16 unless this head keeps an FP32 O
            if HAS_OFP32:
                o = tl.where(o_fp32, o, _rb(o))
            else:
                o = _rb(o)
        lse = m_i + tl.log(l_i)
        tl.store(O + off_b * sob + off_h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
                 o.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + off_bh * T + offs_m, lse, mask=row_ok)
        if PROBE:
            tl.store(PMAX + off_bh * T + offs_m, pmax, mask=row_ok)
            tl.store(FIRED + off_bh * T + offs_m, fired, mask=row_ok)
        if COUNTERS:
            tl.atomic_add(REP + off_h, tl.sum(fired, 0).to(tl.int64))
            tl.atomic_max(MAXL, tl.max(tl.where(row_ok, raw_max, -3.3895313892515355e38), 0))

    @triton.jit
    def _bwd_delta_kernel(Q, K, V, O, DO, LSE, DELTA, OFP32,
                          sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                          sob, soh, sot, sod, sdb, sdh, sdt, sdd,
                          H, T, scale,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          RECIPE: tl.constexpr, DELTA_MODE: tl.constexpr, HAS_OFP32: tl.constexpr):
        """delta = rowsum(r(dO*O)) | sum_j rowsum(dP_j*P_j) | rowsum(dO*(sum_j P_j V_j in FP32))."""
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        GEMM_DT: tl.constexpr = tl.float32 if RECIPE == 0 else tl.bfloat16
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < T
        do = tl.load(DO + off_b * sdb + off_h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd,
                     mask=row_ok[:, None], other=0.0).to(GEMM_DT)
        if DELTA_MODE == 0:
            o = tl.load(O + off_b * sob + off_h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
                        mask=row_ok[:, None], other=0.0).to(tl.float32)
            prod = do.to(tl.float32) * o
            if RECIPE == 2:  # the product is a BF16 op (FP32 for heads whose stored O is FP32)
                if HAS_OFP32:
                    prod = tl.where(tl.load(OFP32 + off_h) != 0, prod, _rb(prod))
                else:
                    prod = _rb(prod)
            delta = tl.sum(prod, 1)
        else:
            offs_n = tl.arange(0, BLOCK_N)
            q = tl.load(Q + off_b * sqb + off_h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                        mask=row_ok[:, None], other=0.0).to(GEMM_DT)
            lse = tl.load(LSE + off_bh * T + offs_m, mask=row_ok, other=0.0)
            k_base = K + off_b * skb + off_h * skh + offs_d[None, :] * skd
            v_base = V + off_b * svb + off_h * svh + offs_d[None, :] * svd
            hi = tl.minimum((start_m + 1) * BLOCK_M, T)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            dsum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start_n in range(0, hi, BLOCK_N):
                s = _scores(q, k_base + (start_n + offs_n)[:, None] * skt, offs_m, start_n + offs_n, T,
                            scale, RECIPE, GEMM_DT, True)
                p = tl.where(_valid(offs_m, start_n + offs_n, T, True), tl.exp(s - lse[:, None]), 0.0)
                v = tl.load(v_base + (start_n + offs_n)[:, None] * svt,
                            mask=((start_n + offs_n) < T)[:, None], other=0.0).to(GEMM_DT)
                if DELTA_MODE == 1:  # dP as the backward computes it (stored like its GEMM outputs)
                    if RECIPE == 0:
                        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
                    else:
                        dp = tl.dot(do, tl.trans(v))
                        if RECIPE == 2:
                            dp = _rb(dp)
                    dsum += tl.sum(dp * p, 1)
                else:  # O recomputed as P V with nothing rounded
                    acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
            if DELTA_MODE == 1:
                delta = dsum
            else:
                delta = tl.sum(do.to(tl.float32) * acc, 1)
        tl.store(DELTA + off_bh * T + offs_m, delta, mask=row_ok)

    @triton.jit
    def _dkdv_inner(dk, dv, k, v, q_base, do_base, sqt, sdt, LSE, DELTA, off_bh, offs_n, offs_m0, lo, hi, T, scale,
                    BLOCK_M: tl.constexpr, RECIPE: tl.constexpr, GEMM_DT: tl.constexpr, ONE_BLOCK: tl.constexpr,
                    MASKED: tl.constexpr):
        """dK, dV of one key block over query tiles [lo, hi) (paper_bf16: chunks and accumulators in BF16)."""
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < T  # rows past T load as zeros and contribute nothing
            q = tl.load(q_base + offs_m[:, None] * sqt, mask=m_ok[:, None], other=0.0).to(GEMM_DT)
            do = tl.load(do_base + offs_m[:, None] * sdt, mask=m_ok[:, None], other=0.0).to(GEMM_DT)
            lse = tl.load(LSE + off_bh * T + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + off_bh * T + offs_m, mask=m_ok, other=0.0)
            if RECIPE == 0:
                sT = tl.dot(k, tl.trans(q), input_precision="ieee") * scale
            else:
                sT = tl.dot(k, tl.trans(q))
                if RECIPE == 2:
                    sT = _rb(_rb(sT) * scale)
                else:
                    sT = sT * scale
            pT = tl.exp(sT - lse[None, :])
            if MASKED:
                pT = tl.where((offs_n[:, None] <= offs_m[None, :]) & m_ok[None, :], pT, 0.0)
            if RECIPE == 0:
                dv_c = tl.dot(pT, do, input_precision="ieee")
                dpT = tl.dot(v, tl.trans(do), input_precision="ieee")
            else:
                dv_c = tl.dot(pT.to(tl.bfloat16), do)
                dpT = tl.dot(v, tl.trans(do))
                if RECIPE == 2:
                    dpT = _rb(dpT)
            dsT = (pT * scale) * (dpT - delta[None, :])
            if RECIPE == 0:
                dk_c = tl.dot(dsT, q, input_precision="ieee")
            else:
                dk_c = tl.dot(dsT.to(tl.bfloat16), q)
            if RECIPE == 2 and not ONE_BLOCK:  # chunk products and accumulators stored in BF16
                dv = _rb(dv + _rb(dv_c))
                dk = _rb(dk + _rb(dk_c))
            else:
                dv += dv_c
                dk += dk_c
        return dk, dv

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                         sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
                         sgb, sgh, sgt, sgd,
                         H, T, scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         RECIPE: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """dK, dV for BLOCK_N keys, looping over query tiles of BLOCK_M (= block_q where rounding is emulated)."""
        start_n = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        GEMM_DT: tl.constexpr = tl.float32 if RECIPE == 0 else tl.bfloat16
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        col_ok = offs_n < T
        k = tl.load(K + off_b * skb + off_h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd,
                    mask=col_ok[:, None], other=0.0).to(GEMM_DT)
        v = tl.load(V + off_b * svb + off_h * svh + offs_n[:, None] * svt + offs_d[None, :] * svd,
                    mask=col_ok[:, None], other=0.0).to(GEMM_DT)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        q_base = Q + off_b * sqb + off_h * sqh + offs_d[None, :] * sqd
        do_base = DO + off_b * sdb + off_h * sdh + offs_d[None, :] * sdd
        lo = (start_n * BLOCK_N) // BLOCK_M * BLOCK_M  # first query tile touching this key block
        # query tiles starting at or past this block's last key see every key of it: no mask there
        mid = tl.minimum(tl.cdiv((start_n + 1) * BLOCK_N - 1, BLOCK_M) * BLOCK_M, T)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, sqt, sdt, LSE, DELTA, off_bh, offs_n, offs_m0, lo, mid, T,
                             scale, BLOCK_M, RECIPE, GEMM_DT, ONE_BLOCK, True)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, sqt, sdt, LSE, DELTA, off_bh, offs_n, offs_m0, mid, T, T,
                             scale, BLOCK_M, RECIPE, GEMM_DT, ONE_BLOCK, False)
        g = off_b * sgb + off_h * sgh + offs_n[:, None] * sgt + offs_d[None, :] * sgd
        tl.store(DK + g, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV + g, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])

    @triton.jit
    def _dq_inner(dq, q, do, lse, delta, k_base, v_base, skt, svt, offs_m, offs_n0, lo, hi, T, scale,
                  BLOCK_N: tl.constexpr, RECIPE: tl.constexpr, GEMM_DT: tl.constexpr, ONE_BLOCK: tl.constexpr,
                  MASKED: tl.constexpr):
        """dQ of one query block over key tiles [lo, hi) (paper_bf16: chunks and accumulator in BF16)."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            s = _scores(q, k_base + offs_n[:, None] * skt, offs_m, offs_n, T, scale, RECIPE, GEMM_DT, MASKED)
            p = tl.exp(s - lse[:, None])
            if MASKED:
                p = tl.where(_valid(offs_m, offs_n, T, True), p, 0.0)
                v = tl.load(v_base + offs_n[:, None] * svt, mask=(offs_n < T)[:, None], other=0.0).to(GEMM_DT)
                k = tl.load(k_base + offs_n[:, None] * skt, mask=(offs_n < T)[:, None], other=0.0).to(GEMM_DT)
            else:
                v = tl.load(v_base + offs_n[:, None] * svt).to(GEMM_DT)
                k = tl.load(k_base + offs_n[:, None] * skt).to(GEMM_DT)
            if RECIPE == 0:
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            else:
                dp = tl.dot(do, tl.trans(v))
                if RECIPE == 2:
                    dp = _rb(dp)
            ds = (p * scale) * (dp - delta[:, None])
            if RECIPE == 0:
                dq_c = tl.dot(ds, k, input_precision="ieee")
            else:
                dq_c = tl.dot(ds.to(tl.bfloat16), k)
            if RECIPE == 2 and not ONE_BLOCK:
                dq = _rb(dq + _rb(dq_c))
            else:
                dq += dq_c
        return dq

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                       sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
                       sgb, sgh, sgt, sgd,
                       H, T, scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       RECIPE: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """dQ for BLOCK_M queries, looping over key tiles of BLOCK_N (= block_k where rounding is emulated)."""
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        GEMM_DT: tl.constexpr = tl.float32 if RECIPE == 0 else tl.bfloat16
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < T
        q = tl.load(Q + off_b * sqb + off_h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                    mask=row_ok[:, None], other=0.0).to(GEMM_DT)
        do = tl.load(DO + off_b * sdb + off_h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd,
                     mask=row_ok[:, None], other=0.0).to(GEMM_DT)
        lse = tl.load(LSE + off_bh * T + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + off_bh * T + offs_m, mask=row_ok, other=0.0)
        k_base = K + off_b * skb + off_h * skh + offs_d[None, :] * skd
        v_base = V + off_b * svb + off_h * svh + offs_d[None, :] * svd
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        mid = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N  # key tiles before mid lie wholly below the diagonal
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, skt, svt, offs_m, offs_n0, 0, mid, T, scale,
                       BLOCK_N, RECIPE, GEMM_DT, ONE_BLOCK, False)
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, skt, svt, offs_m, offs_n0, mid, hi, T, scale,
                       BLOCK_N, RECIPE, GEMM_DT, ONE_BLOCK, True)
        tl.store(DQ + off_b * sgb + off_h * sgh + offs_m[:, None] * sgt + offs_d[None, :] * sgd,
                 dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------------------------
# Launch configuration: block sizes that carry meaning come from the knobs; the rest is chosen for speed.

# Speed-only launch choices per head dim (benchmarks/attention.py --tune measures alternatives):
#   forward (BLOCK_M, num_warps, num_stages); backward (dkdv BLOCK_M, dkdv BLOCK_N, dq BLOCK_M, dq BLOCK_N,
#   num_warps, num_stages). Block sizes that carry meaning (block_k in the forward under SFA / counters /
#   paper_bf16; block_q / block_k in paper_bf16's backward) override these.
FWD_CONFIG = {16: (64, 4, 3), 32: (64, 4, 3), 64: (64, 4, 3), 128: (64, 8, 3)}  # D=64: --tune on an H200
BWD_CONFIG = {16: (32, 64, 64, 32, 4, 3), 32: (32, 64, 64, 32, 4, 3), 64: (64, 64, 64, 64, 4, 3),
              128: (32, 128, 128, 32, 8, 2)}
FWD_FREE_BLOCK_N = {16: 64, 32: 64, 64: 64, 128: 64}
# The fp32 recipe's IEEE FP32 dots run on the CUDA cores (no tensor cores), with operands and accumulators in
# registers: the BF16 tables' 64-row tiles with 3 stages spill there. Its own, smaller tiles (--tune-recipe fp32).
FP32_FWD_CONFIG = {16: (32, 4, 2), 32: (32, 4, 2), 64: (32, 4, 2), 128: (32, 4, 1)}
FP32_BWD_CONFIG = {16: (32, 32, 32, 32, 4, 2), 32: (32, 32, 32, 32, 4, 2), 64: (32, 32, 32, 32, 4, 2),
                   128: (16, 32, 32, 16, 4, 1)}
FP32_FREE_BLOCK_N = {16: 32, 32: 32, 64: 32, 128: 32}


def launch_tables(recipe: str):
    """(forward table, backward table, free forward BLOCK_N) for a recipe: fp32 has its own (see above)."""
    if recipe == "fp32":
        return FP32_FWD_CONFIG, FP32_BWD_CONFIG, FP32_FREE_BLOCK_N
    return FWD_CONFIG, BWD_CONFIG, FWD_FREE_BLOCK_N


def _fwd_blocks(knobs: AttentionKnobs, D: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward."""
    fwd, _, free_n = launch_tables(knobs.recipe)
    block_m, warps, stages = fwd[D]
    # the key tile is the unit Algorithm 3, the counters and paper_bf16's rescaling roundings see
    exact_n = knobs.tiling and (knobs.recipe == "paper_bf16" or knobs.softmax == "stabilized" or knobs.counters)
    block_n = knobs.block_k if exact_n else free_n[D]
    if _interpret():
        block_m, block_n = 16, (block_n if exact_n else 16)
    return block_m, block_n, warps, stages


def _bwd_blocks(knobs: AttentionKnobs, D: int):
    """((dkdv BLOCK_M, BLOCK_N), (dq BLOCK_M, BLOCK_N), num_warps, num_stages) of the backward passes."""
    m1, n1, m2, n2, warps, stages = launch_tables(knobs.recipe)[1][D]
    if knobs.recipe == "paper_bf16" and knobs.tiling:  # BF16 accumulators rounded per emulator tile
        m1, n2 = knobs.block_q, knobs.block_k
    elif _interpret():
        m1, n2 = 16, 16
    if _interpret():
        n1, m2 = 16, 16
    return (m1, n1), (m2, n2), warps, stages


def _strides(x):
    return tuple(x.stride())


_DEVICE_CACHE: dict = {}


def _cached(key, make):
    """Small per-device constants (head masks, dummy pointers), made once: no host-to-device copy per call."""
    t = _DEVICE_CACHE.get(key)
    if t is None:
        t = _DEVICE_CACHE[key] = make()
    return t


def _rows_per_head(T: int, knobs: AttentionKnobs) -> int:
    """(query row, key tile) pairs one head visits per batch element, as AttnStats.rows_seen counts them."""
    if not knobs.tiling:
        return T
    bq, bk = min(knobs.block_q, T), min(knobs.block_k, T)
    return sum((min(qs + bq, T) - qs) * -(-min(qs + bq, T) // bk) for qs in range(0, T, bq))


def _forward(q, k, v, knobs: AttentionKnobs, stats=None, probe: bool = False):
    """Launch the forward: (O stored for delta, lse, per-head FP32-O flags, pmax, fired); pmax/fired only if probe."""
    B, H, T, D = q.shape
    dev = q.device
    recipe = RECIPE_IDS[knobs.recipe]
    fp32_heads = tuple(knobs.fp32_o_heads(H))
    has_ofp32 = recipe != 0 and len(fp32_heads) > 0
    o_dtype = torch.float32 if (recipe == 0 or has_ofp32) else torch.bfloat16
    o = torch.empty((B, H, T, D), device=dev, dtype=o_dtype)
    lse = torch.empty((B, H, T), device=dev, dtype=torch.float32)
    ofp32 = _cached(("ofp32", str(dev), H, fp32_heads), lambda: torch.tensor(
        [int(h in fp32_heads) for h in range(H)], dtype=torch.int32).to(dev))
    counters = stats is not None and knobs.counters
    if counters:
        rep, maxl = stats.repeated_max_rows, stats.max_logit
    else:  # unused pointers still need a tensor
        rep = _cached(("rep", str(dev)), lambda: torch.zeros(1, device=dev, dtype=torch.int64))
        maxl = _cached(("maxl", str(dev)), lambda: torch.zeros(1, device=dev, dtype=torch.float32))
    if probe:
        pmax = torch.zeros((B, H, T), device=dev, dtype=torch.float32)
        fired = torch.zeros((B, H, T), device=dev, dtype=torch.int32)
    else:
        pmax = fired = lse
    bm, bn, warps, stages = _fwd_blocks(knobs, D)
    grid = (triton.cdiv(T, bm), B * H)
    _fwd_kernel[grid](q, k, v, o, lse, rep, maxl, ofp32, pmax, fired,
                      *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                      H, T, 1.0 / math.sqrt(D), float(knobs.beta), float(knobs.eps),
                      HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, RECIPE=recipe,
                      STABILIZED=knobs.softmax == "stabilized", COUNTERS=counters,
                      PV_FP32=bool(knobs.pv_fp32), HAS_OFP32=has_ofp32, ONE_BLOCK=not knobs.tiling,
                      PROBE=probe, num_warps=warps, num_stages=stages)
    if counters and getattr(stats, "rows_seen", None) is not None:
        stats.rows_seen.add_(B * _rows_per_head(T, knobs))  # a Python int: no host sync
    return o, lse, ofp32, (pmax if probe else None), (fired if probe else None)


def fired_pbar_max(q, k, v, knobs: AttentionKnobs):
    """Probe for tests: per row (B, H, T), the largest FP32 P̄ in key tiles where the SFA condition fired, and
    whether it fired in any tile. Safe softmax gives P̄ = 1 there; the stabilized softmax must not."""
    with torch.no_grad():
        _, _, _, pmax, fired = _forward(q, k, v, knobs, probe=True)
    return pmax, fired.bool()


class _TritonFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, knobs, stats):
        o_saved, lse, ofp32, _, _ = _forward(q, k, v, knobs, stats)
        ctx.save_for_backward(q, k, v, o_saved, lse, ofp32)
        ctx.knobs = knobs
        # returned O: BF16 for paper_bf16 / fa2 (also for heads whose stored O is FP32), FP32 for fp32
        out_dtype = torch.float32 if knobs.recipe == "fp32" else torch.bfloat16
        return o_saved if o_saved.dtype == out_dtype else o_saved.to(out_dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, ofp32 = ctx.saved_tensors
        knobs = ctx.knobs
        B, H, T, D = q.shape
        recipe = RECIPE_IDS[knobs.recipe]
        scale = 1.0 / math.sqrt(D)
        has_ofp32 = recipe != 0 and len(knobs.fp32_o_heads(H)) > 0
        (m1, n1), (m2, n2), warps, stages = _bwd_blocks(knobs, D)
        delta = torch.empty_like(lse)
        dq = torch.empty((B, H, T, D), device=q.device, dtype=q.dtype)  # gradients in the inputs' dtypes
        dk = torch.empty((B, H, T, D), device=q.device, dtype=k.dtype)
        dv = torch.empty((B, H, T, D), device=q.device, dtype=v.dtype)
        dbm, dbn = (16, 16) if _interpret() else (32, 32) if recipe == 0 else (64, 64)  # fp32: see FP32_*
        _bwd_delta_kernel[(triton.cdiv(T, dbm), B * H)](
            q, k, v, o, do, lse, delta, ofp32,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do),
            H, T, scale, HEAD_DIM=D, BLOCK_M=dbm, BLOCK_N=dbn, RECIPE=recipe,
            DELTA_MODE=DELTA_IDS[knobs.delta], HAS_OFP32=has_ofp32, num_warps=4)
        _bwd_dkdv_kernel[(triton.cdiv(T, n1), B * H)](
            q, k, v, do, lse, delta, dk, dv,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), H, T, scale,
            HEAD_DIM=D, BLOCK_M=m1, BLOCK_N=n1, RECIPE=recipe,
            ONE_BLOCK=not knobs.tiling, num_warps=warps, num_stages=stages)
        _bwd_dq_kernel[(triton.cdiv(T, m2), B * H)](
            q, k, v, do, lse, delta, dq,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), H, T, scale,
            HEAD_DIM=D, BLOCK_M=m2, BLOCK_N=n2, RECIPE=recipe,
            ONE_BLOCK=not knobs.tiling, num_warps=warps, num_stages=stages)
        return dq, dk, dv, None, None


def flash_attention_triton(q, k, v, knobs: AttentionKnobs, stats=None):
    """Causal attention O for q, k, v of shape (B, H, T, D); autograd-capable; updates `stats` on the device.

    Same contract as kernels.flash_attention (the emulator): O in BF16 for paper_bf16 / fa2 and FP32 for fp32,
    gradients in the inputs' dtypes; `stats` (AttnStats) gains, per head, the (row, key tile) pairs where the SFA
    condition fires, the pairs seen, and the running max of the scaled scores. Nothing is synced to the host.
    """
    if triton is None:
        raise RuntimeError("flash_attention_triton needs triton; use the emulator (backend=emulator)")
    return _TritonFlash.apply(q, k, v, knobs, stats)


__all__ = ["supports", "flash_attention_triton", "fired_pbar_max", "RECIPE_IDS", "DELTA_IDS"]
