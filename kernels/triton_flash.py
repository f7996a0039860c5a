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

Recipe rounding points follow kernels/emulator.py (the source of truth); `_rb` marks each BF16 storage point. A
recipe is a set of rounding points: the kernels take it as one constexpr bitmask, ROUND (`round_mask`: one bit per
flash_forensics.kernels.recipes.ROUNDING_POINTS entry), plus INPUT_F32 (the dtype Q, K, V, dO enter the GEMMs in) and FLOOR
(paper_bf16's 1e-10 row-sum floor). So keep_fp32 / round_bf16 / pv_fp32 are compile-time switches, and a lifted
GEMM operand is an IEEE FP32 GEMM (input_precision="ieee", never TF32).
Over 400 lines because the four kernels share their jit helpers and launch tables; the torch.library operators
around them are kernels/ops.py.
"""
from __future__ import annotations

import math
import os

import torch

from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.knobs import unsupported
from flash_forensics.kernels.recipes import PV_POINTS, RECIPES, ROUNDING_POINTS, resolve

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


def _bits(*points: str) -> int:
    return sum(1 << ROUNDING_POINTS.index(pt) for pt in points)


# Points whose BF16 storage carries state from one key tile to the next (the running max, sum and accumulator): the
# forward's key tile must then be block_k, as in the emulator. The backward's accumulators: the same for its tiles.
_FWD_TILED = _bits("shift", "stats", "pv_out", "acc")
_BWD_TILED = _bits("bwd_out", "grad_acc")
_O_STORE_BIT = _bits("o_store")
_OFP32_BITS = _bits("pbar", "pv_out", "acc", "o_store", "delta_prod")  # what o_fp32 heads keep in FP32


_RECIPE_MASK = {name: _bits(*resolve(name).rounded()) for name in RECIPES}
_PV_MASK = _bits(*PV_POINTS)


def round_mask(knobs: AttentionKnobs) -> int:
    """The kernels' ROUND constexpr: bit i set = ROUNDING_POINTS[i] stored in BF16, i.e.
    flash_forensics.kernels.recipes.for_knobs(knobs).rounded() as bits (tests check the two agree). Plain integer work, so that
    torch.compile traces it without a graph break (it runs per call, building the ops' arguments)."""
    mask = _RECIPE_MASK[knobs.recipe]
    if knobs.pv_fp32:
        mask &= ~_PV_MASK
    for pt in knobs.keep_fp32:
        mask &= ~(1 << ROUNDING_POINTS.index(pt))
    for pt in knobs.round_bf16:
        mask |= 1 << ROUNDING_POINTS.index(pt)
    return mask


def mask_points(recipe: str, mask: int):
    """(keep_fp32, round_bf16) that give `mask` on `recipe`: round_mask's inverse, for the ops' int argument."""
    base = resolve(recipe).rounded()
    rounded = [pt for i, pt in enumerate(ROUNDING_POINTS) if mask >> i & 1]
    return [pt for pt in base if pt not in rounded], [pt for pt in rounded if pt not in base]


def saved_o_dtype(mask: int, fp32_heads) -> torch.dtype:
    """The forward stores O in BF16 where o_store is a BF16 point and no head keeps an FP32 O, else in FP32."""
    return torch.bfloat16 if (mask & _O_STORE_BIT and len(fp32_heads) == 0) else torch.float32


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
    # One bit per rounding point (kernels/recipes.py ROUNDING_POINTS order): set = stored in BF16 there. The kernels
    # take the bitmask as one tl.constexpr (ROUND), so each point is a compile-time switch.
    # The interpreter's BF16 tl.dot is wrong: there, BF16 operands enter an FP32 GEMM (their values are BF16-exact,
    # so the products and the FP32 accumulation are what the GPU's BF16 GEMM computes, up to summation order).
    INTERP_DOT = tl.constexpr(_INTERPRET)
    _SCORES = tl.constexpr(1 << 0)
    _SHIFT = tl.constexpr(1 << 1)
    _STATS = tl.constexpr(1 << 2)
    _PBAR = tl.constexpr(1 << 3)
    _PV_OUT = tl.constexpr(1 << 4)
    _ACC = tl.constexpr(1 << 5)
    _O_STORE = tl.constexpr(1 << 6)
    _DELTA_PROD = tl.constexpr(1 << 7)
    _BWD_GEMM_IN = tl.constexpr(1 << 8)
    _BWD_OUT = tl.constexpr(1 << 9)
    _GRAD_ACC = tl.constexpr(1 << 10)

    if not _INTERPRET:
        @triton.jit
        def _rb(x):
            """Round an FP32 value to BF16 storage (round to nearest even) and back: one emulated BF16 store."""
            return x.to(tl.bfloat16).to(tl.float32)
    else:
        @triton.jit
        def _rb(x):
            """The interpreter's .to(tl.bfloat16) truncates; round to nearest even on the bits instead (finite x),
            so that the CPU tests of the fp32 recipe with rounded points (FP32 GEMMs) check the kernels' logic."""
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True)

    if not _INTERPRET:
        @triton.jit
        def _cast_out(x, ptr):
            """x in the element type of the gradient tensor it is stored to."""
            return x.to(ptr.dtype.element_ty)
    else:
        @triton.jit
        def _cast_out(x, ptr):
            """The interpreter truncates FP32 -> BF16: round to nearest even first (as the GPU's conversion does)."""
            if ptr.dtype.element_ty == tl.bfloat16:
                x = _rb(x)
            return x.to(ptr.dtype.element_ty)

    @triton.jit
    def _r(x, keep, ON: tl.constexpr, HAS_OFP32: tl.constexpr):
        """A store at a point of the P̄V path / O / delta: BF16 when ON, except for heads (o_fp32) where `keep`."""
        if not ON:
            return x
        elif HAS_OFP32:
            return tl.where(keep, x, _rb(x))
        else:
            return _rb(x)

    @triton.jit
    def _dot_in(a, b, INPUT_F32: tl.constexpr):
        """A GEMM of two inputs (Q, K, V, dO): IEEE FP32 on FP32 inputs (never TF32), else BF16 x BF16 -> FP32."""
        if INPUT_F32 or INTERP_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _dot_pt(p, x, ROUNDED: tl.constexpr, INPUT_F32: tl.constexpr):
        """A GEMM of a computed FP32 operand (P̄, P, dS) with an input: p rounded to BF16 when ROUNDED (its point),
        else kept FP32 (the lifted point: an IEEE FP32 GEMM, never TF32)."""
        if ROUNDED and not INPUT_F32 and not INTERP_DOT:
            return tl.dot(p.to(tl.bfloat16), x)
        elif ROUNDED:
            return tl.dot(_rb(p), x.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(p, x.to(tl.float32), input_precision="ieee")

    @triton.jit
    def _scores(q, k_ptrs, offs_m, offs_n, T, scale, ROUND: tl.constexpr, INPUT_F32: tl.constexpr,
                GEMM_DT: tl.constexpr, MASKED: tl.constexpr):
        """S for one tile, scaled; MASKED: causal and past-T entries set to the most negative BF16."""
        if MASKED:
            k = tl.load(k_ptrs, mask=(offs_n < T)[:, None], other=0.0).to(GEMM_DT)
        else:  # a tile wholly below the diagonal: every key exists and is visible
            k = tl.load(k_ptrs).to(GEMM_DT)
        s = _dot_in(q, tl.trans(k), INPUT_F32)
        if (_SCORES & ROUND) != 0:  # QK^T stored in BF16, then scaled in BF16
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
                   BLOCK_N: tl.constexpr, ROUND: tl.constexpr, INPUT_F32: tl.constexpr, FLOOR: tl.constexpr,
                   GEMM_DT: tl.constexpr, STABILIZED: tl.constexpr, NEED_REP: tl.constexpr, PROBE: tl.constexpr,
                   HAS_OFP32: tl.constexpr, ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr):
        """The forward over key tiles [lo, hi): online softmax (or, ONE_BLOCK, a fixed row max) and P̄V."""
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            s = _scores(q, k_base + cols[:, None] * skt, offs_m, cols, T, scale, ROUND, INPUT_F32, GEMM_DT, MASKED)
            if ONE_BLOCK:
                d_s = s - m_i[:, None]
                if (_SHIFT & ROUND) != 0:
                    d_s = _rb(d_s)
                p = tl.exp(d_s)
                l_i += tl.sum(p, 1)
                if PROBE:
                    pmax = tl.where(fired > 0, tl.maximum(pmax, tl.max(p, 1)), pmax)
            else:
                rm = tl.max(s, 1)
                raw_max = tl.maximum(raw_max, rm)
                if NEED_REP:  # Algorithm 3 on this key tile (masked entries never count)
                    thr = rm - eps
                    if (_SCORES & ROUND) != 0:
                        thr = _rb(thr)
                    near = _valid(offs_m, cols, T, MASKED) & (s >= thr[:, None])
                    fire = (tl.sum(near.to(tl.int32), 1) > 1) & row_ok
                    fired += fire.to(tl.int32)
                    if STABILIZED:
                        rm_s = rm * beta
                        if (_SCORES & ROUND) != 0:
                            rm_s = _rb(rm_s)
                        rm = tl.where(fire & (rm > 0), rm_s, rm)
                        rm = tl.where(fire & (rm < 0), 0.0, rm)
                m_new = tl.maximum(m_i, rm)
                if (_STATS & ROUND) != 0:  # m stored in BF16 (a no-op when the scores are BF16 already)
                    m_new = _rb(m_new)
                d_m = m_i - m_new
                d_s = s - m_new[:, None]
                if (_SHIFT & ROUND) != 0:  # the arguments of exp stored in BF16, exp and row sum in FP32
                    d_m = _rb(d_m)
                    d_s = _rb(d_s)
                alpha = tl.exp(d_m)
                p = tl.exp(d_s)
                rs = tl.sum(p, 1)
                if FLOOR:
                    rs = tl.maximum(rs, 1e-10)
                l_i = alpha * l_i + rs
                if (_STATS & ROUND) != 0:
                    l_i = _rb(l_i)
                if PROBE:
                    pmax = tl.where(fire, tl.maximum(pmax, tl.max(p, 1)), pmax)
                acc = _r(acc * alpha[:, None], o_fp32, (_ACC & ROUND) != 0, HAS_OFP32)
                m_i = m_new
            if MASKED:
                v = tl.load(v_base + cols[:, None] * svt, mask=(cols < T)[:, None], other=0.0).to(GEMM_DT)
            else:
                v = tl.load(v_base + cols[:, None] * svt).to(GEMM_DT)
            if HAS_OFP32 and (_PBAR & ROUND) != 0:  # heads with FP32 O skip P̄'s rounding: FP32 GEMM
                pv = _dot_pt(tl.where(o_fp32, p, _rb(p)), v, False, INPUT_F32)
            else:
                pv = _dot_pt(p, v, (_PBAR & ROUND) != 0, INPUT_F32)
            if ONE_BLOCK:  # stored once, after the last tile
                acc += pv
            else:  # O_acc = r(r(O_acc * alpha) + r(P̄V))
                acc = _r(acc + _r(pv, o_fp32, (_PV_OUT & ROUND) != 0, HAS_OFP32), o_fp32, (_ACC & ROUND) != 0,
                         HAS_OFP32)
        return acc, l_i, m_i, raw_max, fired, pmax

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, REP, MAXL, OFP32, PMAX, FIRED,
                    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
                    H, T, scale, beta, eps,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    ROUND: tl.constexpr, INPUT_F32: tl.constexpr, FLOOR: tl.constexpr, STABILIZED: tl.constexpr,
                    COUNTERS: tl.constexpr, HAS_OFP32: tl.constexpr, ONE_BLOCK: tl.constexpr,
                    PROBE: tl.constexpr):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        GEMM_DT: tl.constexpr = tl.float32 if INPUT_F32 else tl.bfloat16
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
                            scale, ROUND, INPUT_F32, GEMM_DT, True)
                m_i = tl.maximum(m_i, tl.max(s, 1))
            raw_max = m_i
            if NEED_REP:
                # pass 2: how many scores of the row reach its max - eps (threshold stored like the scores)
                thr = m_i - eps
                if (_SCORES & ROUND) != 0:
                    thr = _rb(thr)
                cnt = tl.zeros([BLOCK_M], dtype=tl.int32)
                for start_n in range(0, hi, BLOCK_N):
                    s = _scores(q, k_base + (start_n + offs_n)[:, None] * skt, offs_m, start_n + offs_n, T,
                                scale, ROUND, INPUT_F32, GEMM_DT, True)
                    near = _valid(offs_m, start_n + offs_n, T, True) & (s >= thr[:, None])
                    cnt += tl.sum(near.to(tl.int32), 1)
                fire = (cnt > 1) & row_ok
                fired = fire.to(tl.int32)
                if STABILIZED:
                    m_s = m_i * beta
                    if (_SCORES & ROUND) != 0:
                        m_s = _rb(m_s)
                    m_i = tl.where(fire & (m_i > 0), m_s, m_i)
                    m_i = tl.where(fire & (m_i < 0), 0.0, m_i)
            if (_STATS & ROUND) != 0:
                m_i = _rb(m_i)

        # key tiles wholly below this query block's diagonal need no mask; the rest do
        mid = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N
        acc, l_i, m_i, raw_max, fired, pmax = _fwd_inner(
            acc, l_i, m_i, raw_max, fired, pmax, q, k_base, v_base, skt, svt, offs_m, offs_n, row_ok, 0, mid, T,
            scale, beta, eps, o_fp32, BLOCK_N, ROUND, INPUT_F32, FLOOR, GEMM_DT, STABILIZED, NEED_REP, PROBE,
            HAS_OFP32, ONE_BLOCK, False)
        acc, l_i, m_i, raw_max, fired, pmax = _fwd_inner(
            acc, l_i, m_i, raw_max, fired, pmax, q, k_base, v_base, skt, svt, offs_m, offs_n, row_ok, mid, hi, T,
            scale, beta, eps, o_fp32, BLOCK_N, ROUND, INPUT_F32, FLOOR, GEMM_DT, STABILIZED, NEED_REP, PROBE,
            HAS_OFP32, ONE_BLOCK, True)

        if ONE_BLOCK:  # one tile: l and the P̄V product stored once
            if FLOOR:
                l_i = tl.maximum(l_i, 1e-10)
            if (_STATS & ROUND) != 0:
                l_i = _rb(l_i)
            acc = _r(acc, o_fp32, ((_PV_OUT | _ACC) & ROUND) != 0, HAS_OFP32)
        o = _r(acc / l_i[:, None], o_fp32, (_O_STORE & ROUND) != 0, HAS_OFP32)  # O stored (for delta)
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
                          ROUND: tl.constexpr, INPUT_F32: tl.constexpr, DELTA_MODE: tl.constexpr,
                          HAS_OFP32: tl.constexpr):
        """delta = rowsum(r(dO*O)) | sum_j rowsum(dP_j*P_j) | rowsum(dO*(sum_j P_j V_j in FP32))."""
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        GEMM_DT: tl.constexpr = tl.float32 if INPUT_F32 else tl.bfloat16
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < T
        do = tl.load(DO + off_b * sdb + off_h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd,
                     mask=row_ok[:, None], other=0.0).to(GEMM_DT)
        if DELTA_MODE == 0:
            o = tl.load(O + off_b * sob + off_h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
                        mask=row_ok[:, None], other=0.0).to(tl.float32)
            # the product stored at delta_prod (FP32 for heads whose stored O is FP32)
            prod = _r(do.to(tl.float32) * o, tl.load(OFP32 + off_h) != 0, (_DELTA_PROD & ROUND) != 0, HAS_OFP32)
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
                            scale, ROUND, INPUT_F32, GEMM_DT, True)
                p = tl.where(_valid(offs_m, start_n + offs_n, T, True), tl.exp(s - lse[:, None]), 0.0)
                v = tl.load(v_base + (start_n + offs_n)[:, None] * svt,
                            mask=((start_n + offs_n) < T)[:, None], other=0.0).to(GEMM_DT)
                if DELTA_MODE == 1:  # dP as the backward computes it (stored like its GEMM outputs)
                    dp = _dot_in(do, tl.trans(v), INPUT_F32)
                    if (_BWD_OUT & ROUND) != 0:
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
    def _grad_add(g, c, ROUND: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """g + c with the chunk c stored at bwd_out and the sum at grad_acc (ONE_BLOCK: once, after the loop)."""
        if ONE_BLOCK:
            return g + c
        else:
            if (_BWD_OUT & ROUND) != 0:
                c = _rb(c)
            g = g + c
            if (_GRAD_ACC & ROUND) != 0:
                g = _rb(g)
            return g

    @triton.jit
    def _grad_end(g, ROUND: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """ONE_BLOCK: the one chunk stored at bwd_out, then at grad_acc (one rounding: both BF16 or not)."""
        if ONE_BLOCK and ((_BWD_OUT | _GRAD_ACC) & ROUND) != 0:
            return _rb(g)
        else:
            return g

    @triton.jit
    def _dkdv_inner(dk, dv, k, v, q_base, do_base, sqt, sdt, LSE, DELTA, off_bh, offs_n, offs_m0, lo, hi, T, scale,
                    BLOCK_M: tl.constexpr, ROUND: tl.constexpr, INPUT_F32: tl.constexpr, GEMM_DT: tl.constexpr,
                    ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr):
        """dK, dV of one key block over query tiles [lo, hi) (chunks at bwd_out, accumulators at grad_acc)."""
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < T  # rows past T load as zeros and contribute nothing
            q = tl.load(q_base + offs_m[:, None] * sqt, mask=m_ok[:, None], other=0.0).to(GEMM_DT)
            do = tl.load(do_base + offs_m[:, None] * sdt, mask=m_ok[:, None], other=0.0).to(GEMM_DT)
            lse = tl.load(LSE + off_bh * T + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + off_bh * T + offs_m, mask=m_ok, other=0.0)
            sT = _dot_in(k, tl.trans(q), INPUT_F32)
            if (_SCORES & ROUND) != 0:
                sT = _rb(_rb(sT) * scale)
            else:
                sT = sT * scale
            pT = tl.exp(sT - lse[None, :])
            if MASKED:
                pT = tl.where((offs_n[:, None] <= offs_m[None, :]) & m_ok[None, :], pT, 0.0)
            dv_c = _dot_pt(pT, do, (_BWD_GEMM_IN & ROUND) != 0, INPUT_F32)
            dpT = _dot_in(v, tl.trans(do), INPUT_F32)
            if (_BWD_OUT & ROUND) != 0:
                dpT = _rb(dpT)
            dsT = (pT * scale) * (dpT - delta[None, :])
            dk_c = _dot_pt(dsT, q, (_BWD_GEMM_IN & ROUND) != 0, INPUT_F32)
            dv = _grad_add(dv, dv_c, ROUND, ONE_BLOCK)
            dk = _grad_add(dk, dk_c, ROUND, ONE_BLOCK)
        return dk, dv

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                         sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
                         sgb, sgh, sgt, sgd,
                         H, T, scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         ROUND: tl.constexpr, INPUT_F32: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """dK, dV for BLOCK_N keys, looping over query tiles of BLOCK_M (= block_q where rounding is emulated)."""
        start_n = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        GEMM_DT: tl.constexpr = tl.float32 if INPUT_F32 else tl.bfloat16
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
                             scale, BLOCK_M, ROUND, INPUT_F32, GEMM_DT, ONE_BLOCK, True)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, sqt, sdt, LSE, DELTA, off_bh, offs_n, offs_m0, mid, T, T,
                             scale, BLOCK_M, ROUND, INPUT_F32, GEMM_DT, ONE_BLOCK, False)
        dk = _grad_end(dk, ROUND, ONE_BLOCK)
        dv = _grad_end(dv, ROUND, ONE_BLOCK)
        g = off_b * sgb + off_h * sgh + offs_n[:, None] * sgt + offs_d[None, :] * sgd
        tl.store(DK + g, _cast_out(dk, DK), mask=col_ok[:, None])
        tl.store(DV + g, _cast_out(dv, DV), mask=col_ok[:, None])

    @triton.jit
    def _dq_inner(dq, q, do, lse, delta, k_base, v_base, skt, svt, offs_m, offs_n0, lo, hi, T, scale,
                  BLOCK_N: tl.constexpr, ROUND: tl.constexpr, INPUT_F32: tl.constexpr, GEMM_DT: tl.constexpr,
                  ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr):
        """dQ of one query block over key tiles [lo, hi) (chunks at bwd_out, the accumulator at grad_acc)."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            s = _scores(q, k_base + offs_n[:, None] * skt, offs_m, offs_n, T, scale, ROUND, INPUT_F32, GEMM_DT,
                        MASKED)
            p = tl.exp(s - lse[:, None])
            if MASKED:
                p = tl.where(_valid(offs_m, offs_n, T, True), p, 0.0)
                v = tl.load(v_base + offs_n[:, None] * svt, mask=(offs_n < T)[:, None], other=0.0).to(GEMM_DT)
                k = tl.load(k_base + offs_n[:, None] * skt, mask=(offs_n < T)[:, None], other=0.0).to(GEMM_DT)
            else:
                v = tl.load(v_base + offs_n[:, None] * svt).to(GEMM_DT)
                k = tl.load(k_base + offs_n[:, None] * skt).to(GEMM_DT)
            dp = _dot_in(do, tl.trans(v), INPUT_F32)
            if (_BWD_OUT & ROUND) != 0:
                dp = _rb(dp)
            ds = (p * scale) * (dp - delta[:, None])
            dq = _grad_add(dq, _dot_pt(ds, k, (_BWD_GEMM_IN & ROUND) != 0, INPUT_F32), ROUND, ONE_BLOCK)
        return dq

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                       sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
                       sgb, sgh, sgt, sgd,
                       H, T, scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       ROUND: tl.constexpr, INPUT_F32: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """dQ for BLOCK_M queries, looping over key tiles of BLOCK_N (= block_k where rounding is emulated)."""
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        GEMM_DT: tl.constexpr = tl.float32 if INPUT_F32 else tl.bfloat16
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
                       BLOCK_N, ROUND, INPUT_F32, GEMM_DT, ONE_BLOCK, False)
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, skt, svt, offs_m, offs_n0, mid, hi, T, scale,
                       BLOCK_N, ROUND, INPUT_F32, GEMM_DT, ONE_BLOCK, True)
        dq = _grad_end(dq, ROUND, ONE_BLOCK)
        tl.store(DQ + off_b * sgb + off_h * sgh + offs_m[:, None] * sgt + offs_d[None, :] * sgd,
                 _cast_out(dq, DQ), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------------------------
# Launch configuration: block sizes that carry meaning come from the knobs; the rest is chosen for speed.
#
# A launch family per forward: fa2 (key tile free), fa2_exact (SFA / counters: the key tile is block_k, the unit
# Algorithm 3 and the counters see), paper_bf16 (block_k: its rescaling roundings), fp32 (IEEE FP32 dots on the CUDA
# cores, operands and accumulators in registers: smaller tiles). The backward's family is the recipe.
#   forward (BLOCK_M, free BLOCK_N, num_warps, num_stages); BLOCK_M never changes a row's arithmetic
#   backward (dkdv BLOCK_M, dkdv BLOCK_N, dq BLOCK_M, dq BLOCK_N, num_warps, num_stages); paper_bf16 overrides
#   dkdv BLOCK_M = block_q and dq BLOCK_N = block_k (its BF16 accumulators round per emulator tile).
# FWD_TABLE / BWD_TABLE are the defaults per head dim; SHAPE_TABLE holds per-(family, D, length class) choices that
# benchmarks/tune.py measured (`python benchmarks/attention.py --tune` prints them). Fixed tables, not run-time
# autotuning: the same knobs launch the same configuration in every process, so a replayed fa2 run is bit-identical.
FWD_TABLE = {  # D=64 and D=128: measured by benchmarks/tune.py on an H200 (results/bench/tune-h200.json)
    "fa2": {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (64, 64, 4, 3)},
    "fa2_exact": {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (64, 64, 4, 3)},
    "paper_bf16": {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (64, 64, 4, 3)},
    "fp32": {16: (32, 32, 4, 2), 32: (32, 32, 4, 2), 64: (32, 32, 4, 2), 128: (32, 32, 8, 2)},
}
BWD_TABLE = {
    "fa2": {16: (32, 64, 64, 32, 4, 3), 32: (32, 64, 64, 32, 4, 3), 64: (32, 64, 64, 32, 4, 3),
            128: (64, 64, 64, 64, 4, 2)},
    "paper_bf16": {16: (32, 64, 64, 32, 4, 3), 32: (32, 64, 64, 32, 4, 3), 64: (64, 64, 64, 64, 4, 3),
                   128: (64, 64, 64, 64, 4, 2)},
    "fp32": {16: (32, 32, 32, 32, 4, 2), 32: (32, 32, 32, 32, 4, 2), 64: (32, 32, 32, 32, 4, 2),
             128: (32, 32, 32, 32, 8, 2)},
}
SHAPE_TABLE: dict = {  # ("fwd" | "bwd", family, D, length class) -> config tuple, as above
    ("fwd", "fp32", 64, "short"): (16, 32, 4, 2),
}


def length_class(T: int) -> str:
    """Short sequences (mini_repro's 256) fill the GPU with fewer, smaller programs: tuned apart from long ones."""
    return "short" if T <= 256 else "long"


def fwd_family(knobs: AttentionKnobs) -> str:
    if knobs.recipe in ("fp32", "paper_bf16"):
        return knobs.recipe
    exact_n = knobs.tiling and (knobs.softmax == "stabilized" or knobs.counters)
    return "fa2_exact" if exact_n else "fa2"


def _fwd_blocks(knobs: AttentionKnobs, D: int, T: int = 1024):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward."""
    fam = fwd_family(knobs)
    block_m, free_n, warps, stages = SHAPE_TABLE.get(("fwd", fam, D, length_class(T))) or FWD_TABLE[fam][D]
    # the key tile is the unit Algorithm 3, the counters and BF16 rescaling roundings (paper_bf16's) see
    exact_n = knobs.tiling and (fam in ("fa2_exact", "paper_bf16") or knobs.counters
                                or bool(round_mask(knobs) & _FWD_TILED))
    block_n = knobs.block_k if exact_n else free_n
    if _interpret():
        block_m, block_n = 16, (block_n if exact_n else 16)
    return block_m, block_n, warps, stages


def _bwd_blocks(knobs: AttentionKnobs, D: int, T: int = 1024):
    """((dkdv BLOCK_M, BLOCK_N), (dq BLOCK_M, BLOCK_N), num_warps, num_stages) of the backward passes."""
    m1, n1, m2, n2, warps, stages = SHAPE_TABLE.get(("bwd", knobs.recipe, D, length_class(T))) or BWD_TABLE[knobs.recipe][D]
    if knobs.tiling and round_mask(knobs) & _BWD_TILED:  # BF16 chunks / accumulators rounded per emulator tile
        m1, n2 = knobs.block_q, knobs.block_k
    elif _interpret():
        m1, n2 = 16, 16
    if _interpret():
        n1, m2 = 16, 16
    return (m1, n1), (m2, n2), warps, stages


def launch_config(knobs: AttentionKnobs, D: int, T: int) -> dict:
    """What the kernels launch for these knobs at head dim D, length T (benchmarks record it)."""
    bm, bn, fw, fs = _fwd_blocks(knobs, D, T)
    (m1, n1), (m2, n2), bw, bs = _bwd_blocks(knobs, D, T)
    return dict(fwd=dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=fw, num_stages=fs),
                bwd=dict(dkdv=[m1, n1], dq=[m2, n2], num_warps=bw, num_stages=bs))


def _strides(x):
    return tuple(x.stride())


_DEVICE_CACHE: dict = {}


def _cdiv(a: int, b: int) -> int:
    """Host-side ceil division (triton.cdiv is a jit function: ~10 us a call through its dispatch on the host)."""
    return -(-a // b)


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


def _forward(q, k, v, knobs: AttentionKnobs, rep=None, maxl=None, probe: bool = False):
    """Launch the forward: (O stored for delta, lse, pmax, fired); pmax/fired only if probe.

    rep (H,) int64 / maxl () float32: the counters the kernel adds into (atomics, one per program); None: off."""
    B, H, T, D = q.shape
    dev = q.device
    mask = round_mask(knobs)
    ofp32, has_ofp32 = _ofp32_flags(knobs, H, dev)
    o = torch.empty((B, H, T, D), device=dev, dtype=saved_o_dtype(mask, knobs.fp32_o_heads(H)))
    lse = torch.empty((B, H, T), device=dev, dtype=torch.float32)
    counters = rep is not None
    if not counters:  # unused pointers still need a tensor
        rep = _cached(("rep", dev), lambda: torch.zeros(1, device=dev, dtype=torch.int64))
        maxl = _cached(("maxl", dev), lambda: torch.zeros(1, device=dev, dtype=torch.float32))
    if probe:
        pmax = torch.zeros((B, H, T), device=dev, dtype=torch.float32)
        fired = torch.zeros((B, H, T), device=dev, dtype=torch.int32)
    else:
        pmax = fired = lse
    bm, bn, warps, stages = _fwd_blocks(knobs, D, T)
    grid = (_cdiv(T, bm), B * H)
    _fwd_kernel[grid](q, k, v, o, lse, rep, maxl, ofp32, pmax, fired,
                      *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                      H, T, 1.0 / math.sqrt(D), float(knobs.beta), float(knobs.eps),
                      HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, ROUND=mask, INPUT_F32=knobs.recipe == "fp32",
                      FLOOR=knobs.recipe == "paper_bf16", STABILIZED=knobs.softmax == "stabilized",
                      COUNTERS=counters, HAS_OFP32=has_ofp32, ONE_BLOCK=not knobs.tiling,
                      PROBE=probe, num_warps=warps, num_stages=stages)
    return o, lse, (pmax if probe else None), (fired if probe else None)


def _ofp32_flags(knobs: AttentionKnobs, H: int, dev):
    """(per-head int32 flags of heads whose stored O is FP32, whether any is), made once per device and knobs.

    Per call this is a dict lookup: the host work per launch is what bounds the kernels at T <= 1024."""
    mask = round_mask(knobs)
    key = ("ofp32", dev, H, mask, knobs.o_fp32, tuple(knobs.o_fp32_heads))
    hit = _DEVICE_CACHE.get(key)
    if hit is None:
        fp32_heads = tuple(knobs.fp32_o_heads(H))
        flags = torch.tensor([int(h in fp32_heads) for h in range(H)], dtype=torch.int32).to(dev)
        hit = _DEVICE_CACHE[key] = (flags, bool(mask & _OFP32_BITS) and len(fp32_heads) > 0)
    return hit


def _backward(do, q, k, v, o, lse, knobs: AttentionKnobs):
    """Launch the backward (delta, dK/dV, dQ): (dq, dk, dv) in the inputs' dtypes."""
    B, H, T, D = q.shape
    recipe = RECIPE_IDS[knobs.recipe]
    mask, f32_in = round_mask(knobs), knobs.recipe == "fp32"
    scale = 1.0 / math.sqrt(D)
    ofp32, has_ofp32 = _ofp32_flags(knobs, H, q.device)
    (m1, n1), (m2, n2), warps, stages = _bwd_blocks(knobs, D, T)
    delta = torch.empty_like(lse)
    dq = torch.empty((B, H, T, D), device=q.device, dtype=q.dtype)  # gradients in the inputs' dtypes
    dk = torch.empty((B, H, T, D), device=q.device, dtype=k.dtype)
    dv = torch.empty((B, H, T, D), device=q.device, dtype=v.dtype)
    dbm, dbn = (16, 16) if _interpret() else (32, 32) if recipe == 0 else (64, 64)  # fp32: see FP32_*
    _bwd_delta_kernel[(_cdiv(T, dbm), B * H)](
        q, k, v, o, do, lse, delta, ofp32,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do),
        H, T, scale, HEAD_DIM=D, BLOCK_M=dbm, BLOCK_N=dbn, ROUND=mask, INPUT_F32=f32_in,
        DELTA_MODE=DELTA_IDS[knobs.delta], HAS_OFP32=has_ofp32, num_warps=4)
    _bwd_dkdv_kernel[(_cdiv(T, n1), B * H)](
        q, k, v, do, lse, delta, dk, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), H, T, scale,
        HEAD_DIM=D, BLOCK_M=m1, BLOCK_N=n1, ROUND=mask, INPUT_F32=f32_in,
        ONE_BLOCK=not knobs.tiling, num_warps=warps, num_stages=stages)
    _bwd_dq_kernel[(_cdiv(T, m2), B * H)](
        q, k, v, do, lse, delta, dq,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), H, T, scale,
        HEAD_DIM=D, BLOCK_M=m2, BLOCK_N=n2, ROUND=mask, INPUT_F32=f32_in,
        ONE_BLOCK=not knobs.tiling, num_warps=warps, num_stages=stages)
    return dq, dk, dv


def fired_pbar_max(q, k, v, knobs: AttentionKnobs):
    """Probe for tests: per row (B, H, T), the largest FP32 P̄ in key tiles where the SFA condition fired, and
    whether it fired in any tile. Safe softmax gives P̄ = 1 there; the stabilized softmax must not."""
    with torch.no_grad():
        _, _, pmax, fired = _forward(q, k, v, knobs, probe=True)
    return pmax, fired.bool()


def flash_attention_triton(q, k, v, knobs: AttentionKnobs, stats=None):
    """Causal attention O for q, k, v of shape (B, H, T, D); autograd-capable; updates `stats` on the device.

    Same contract as flash_forensics.kernels.emulator.flash_attention (the emulator): O in BF16 for paper_bf16 / fa2 and FP32 for fp32,
    gradients in the inputs' dtypes; `stats` (AttnStats) gains, per head, the (row, key tile) pairs where the SFA
    condition fires, the pairs seen, and the running max of the scaled scores. Nothing is synced to the host.
    Runs through the torch.library operators of kernels/ops.py, so torch.compile traces it without a graph break.
    """
    if triton is None:
        raise RuntimeError("flash_attention_triton needs triton; use the emulator (backend=emulator)")
    return _ops.flash_attention(q, k, v, knobs, stats)


__all__ = ["supports", "flash_attention_triton", "fired_pbar_max", "round_mask", "mask_points", "saved_o_dtype",
           "RECIPE_IDS", "DELTA_IDS"]

from flash_forensics.kernels import ops as _ops  # noqa: E402  (last: kernels/ops.py imports the launchers above)
