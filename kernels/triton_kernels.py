"""The fused Triton kernels of kernels/triton_flash.py, at module level: forward, backward delta, dK/dV, dQ.

Importing this module needs triton; kernels/triton_launch.py imports it only where triton is installed. Its
launchers (block sizes, grids, arguments) are kernels/triton_launch.py; the recipe semantics are
kernels/emulator.py's (the source of truth), documented at the top of kernels/triton_flash.py.
Over 400 lines because the four kernels share their jit helpers (one rounding helper per storage point).

KEYPAD (a constexpr, off: the kernels are built exactly as without it): a per-batch key-keep vector KP (B, T) uint8
(1 = attend; row stride skpb) masks keys on top of causality, as the emulator's
Masking(keep=causal & keep) does: masked scores are the fill value (-max BF16) in the forward, P = 0 in the
backward, and never counted. FIRST (B,) int32 is each batch element's first kept key (T if none): query rows before
it have no key at all, and key tiles before it are masked for every row, so they are skipped (adding nothing: the
emulator visits them and its running state drops them, alpha = 0). Rows with no key store O = 0 and lse = +inf
(the emulator gives them the mean of the V it visits, a tile-size artefact; see kernels/triton_flash.py).
"""
import os

import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read at import: the kernels are built for it


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
    from triton.language.extra import libdevice

    @triton.jit
    def _mul_rn(a, b):
        """a * b rounded on its own (mul.rn: never contracted into an FMA with a following add)."""
        return libdevice.mul_rn(a, b)
else:
    @triton.jit
    def _mul_rn(a, b):
        return a * b  # NumPy rounds every product on its own

if not _INTERPRET:
    @triton.jit
    def _exp(x, FTZ: tl.constexpr):
        """exp(x). FTZ off: tl.exp, ex2.approx.f32 of fl(x log2(e)) with its denormal fix-up (a compare and two
        predicated multiplies per element, scripts/kernel_sass.py). FTZ on: the same product into ex2.approx.ftz.f32,
        which differs only where exp(x) < 2^-126 (flushed to 0): an opt-in speed knob (triton_launch.exp_instruction),
        not a default, since with large logits it moves gradient bits (results/bench/gpu-h100-2026-12-06e/)."""
        if FTZ:
            return tl.math.exp2(x * 1.4426950408889634)
        else:
            return tl.exp(x)
else:
    @triton.jit
    def _exp(x, FTZ: tl.constexpr):
        return tl.exp(x)  # NumPy's exp: the interpreter cannot tell ftz apart

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
def _dot_in(a, b, INPUT_F32: tl.constexpr, F32_DOT: tl.constexpr):
    """A GEMM of two inputs (Q, K, V, dO): on FP32 inputs an F32_DOT GEMM (fp32_gemm: "ieee", never plain TF32, or
    "tf32x3"), else BF16 x BF16 -> FP32."""
    if INPUT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=F32_DOT)
    elif INTERP_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)

@triton.jit
def _dot_pt(p, x, ROUNDED: tl.constexpr, INPUT_F32: tl.constexpr, F32_DOT: tl.constexpr):
    """A GEMM of a computed FP32 operand (P̄, P, dS) with an input: p rounded to BF16 when ROUNDED (its point),
    else kept FP32 (the lifted point: an F32_DOT GEMM, "ieee" or "tf32x3", never plain TF32)."""
    if ROUNDED and not INPUT_F32 and not INTERP_DOT:
        return tl.dot(p.to(tl.bfloat16), x)
    elif ROUNDED and INPUT_F32:
        return tl.dot(_rb(p), x.to(tl.float32), input_precision=F32_DOT)
    elif ROUNDED:  # the interpreter: BF16 values in an exact FP32 GEMM (see INTERP_DOT)
        return tl.dot(_rb(p), x.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(p, x.to(tl.float32), input_precision=F32_DOT)

@triton.jit
def _key_ok(kp, offs_n, T):
    """KEYPAD: the keep flags of keys offs_n (False past T), kp this batch element's row of KP."""
    return tl.load(kp + offs_n, mask=offs_n < T, other=0) != 0

@triton.jit
def _qk(q, k_ptrs, offs_n, T, INPUT_F32: tl.constexpr, GEMM_DT: tl.constexpr, MASKED: tl.constexpr,
        F32_DOT: tl.constexpr):
    """QK^T of one key tile, as the GEMM gives it (FP32); MASKED: keys past T read as 0."""
    if MASKED:
        k = tl.load(k_ptrs, mask=(offs_n < T)[:, None], other=0.0).to(GEMM_DT)
    else:  # a tile wholly below the diagonal: every key exists and is visible
        k = tl.load(k_ptrs).to(GEMM_DT)
    return _dot_in(q, tl.trans(k), INPUT_F32, F32_DOT)

@triton.jit
def _scores(q, k_ptrs, offs_m, offs_n, T, scale, ROUND: tl.constexpr, INPUT_F32: tl.constexpr,
            GEMM_DT: tl.constexpr, MASKED: tl.constexpr, F32_DOT: tl.constexpr, kp,
            KEYPAD: tl.constexpr):
    """S for one tile, scaled; MASKED: causal and past-T entries set to the most negative BF16; KEYPAD: also the
    keys KP masks."""
    return _scored(_qk(q, k_ptrs, offs_n, T, INPUT_F32, GEMM_DT, MASKED, F32_DOT), offs_m, offs_n, T, scale, ROUND,
                   MASKED, kp, KEYPAD)

@triton.jit
def _scored(s, offs_m, offs_n, T, scale, ROUND: tl.constexpr, MASKED: tl.constexpr, kp, KEYPAD: tl.constexpr):
    """_scores from the tile's QK^T (_qk): scaled (and rounded where the recipe stores S), then masked."""
    if (_SCORES & ROUND) != 0:  # QK^T stored in BF16, then scaled in BF16
        s = _rb(_rb(s) * scale)
    else:
        s = s * scale
    if MASKED:
        s = tl.where((offs_n[None, :] <= offs_m[:, None]) & (offs_n < T)[None, :], s, -3.3895313892515355e38)
    if KEYPAD:
        s = tl.where(_key_ok(kp, offs_n, T)[None, :], s, -3.3895313892515355e38)
    return s

@triton.jit
def _valid(offs_m, offs_n, T, MASKED: tl.constexpr, kp, KEYPAD: tl.constexpr):
    if MASKED:
        ok = (offs_n[None, :] <= offs_m[:, None]) & (offs_n < T)[None, :]
    else:
        ok = offs_n[None, :] >= 0
    if KEYPAD:
        ok = ok & _key_ok(kp, offs_n, T)[None, :]
    return ok

# ---------------------------------------------------------------------------------------- the stabilizer knobs
# pbar_clamp: where a key tile's row max repeats (`fire`, the rows Algorithm 3 and the counters call repeated) and
# P̄ = 1, the P̄ fed to P̄V is PBAR_CLAMP (the largest BF16 value below 1); l, m and lse keep the unclamped P̄. The
# forward stores those (row, key) positions as a bitmask (TIES: 8 keys a byte, bit j % 8 of byte j // 8 of the row,
# `ntw` bytes a row), which the backward reads instead of rebuilding the forward's running max: O = (c o P) V with
# c = PBAR_CLAMP there, so dV = (c o P)^T dO and dS = P o (c o dP - delta) (kernels/emulator.py backward).
PBAR_CLAMP = tl.constexpr(0.99609375)
# softmax=stabilized_guarded (kernels/emulator.py _new_max): the shift's bounds
GUARD_LO = tl.constexpr(0.015625)  # 2^-6: emulator.SFA_GUARD_LO
GUARD_HI = tl.constexpr(8.0)  # emulator.SFA_GUARD_HI


@triton.jit
def _tie_store(tb, tie, offs_m, start_n, row_ok, ntw, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """pbar_clamp: the tie mask (BLOCK_M, BLOCK_N) of key tile start_n, packed 8 keys a byte, into the rows' bytes."""
    w = tie.to(tl.int32) << (tl.arange(0, BLOCK_N) % 8)[None, :]
    w = tl.sum(tl.reshape(w, (BLOCK_M, BLOCK_N // 8, 8)), 2)  # distinct bits: the sum is their OR
    nb = start_n // 8 + tl.arange(0, BLOCK_N // 8)
    tl.store(tb + offs_m[:, None] * ntw + nb[None, :], w.to(tl.uint8), mask=row_ok[:, None])

@triton.jit
def _tie_load(tb, rows, cols, ntw, ok):
    """pbar_clamp: the forward's tie bits at (rows, cols), broadcast shapes (False where not `ok`)."""
    b = tl.load(tb + rows * ntw + cols // 8, mask=ok, other=0)
    return ((b.to(tl.int32) >> (cols % 8)) & 1) != 0

@triton.jit
def _next_up(x, STEP: tl.constexpr):
    """torch.nextafter(x, +inf) in BF16 (STEP 65536: x a BF16 value held in FP32) or FP32 (STEP 1), on the bits:
    away from 0 above 0, towards it below; +-0 gives the smallest positive subnormal; NaN and +inf stay."""
    b = x.to(tl.int32, bitcast=True)
    up = tl.where(x > 0, b + STEP, tl.where(x < 0, b - STEP, STEP)).to(tl.float32, bitcast=True)
    return tl.where((x == x) & (x < float("inf")), up, x)

@triton.jit
def _guard_shift(rm, bm1, ROUND: tl.constexpr):
    """stabilized_guarded's shifted max of a tile whose max rm repeats: rm + d, d = clamp((beta - 1) |rm|, 2^-6, 8),
    stored like m (the stats point); where that gives back rm, the next value above rm in m's dtype. bm1 = beta - 1
    as the host rounds it to FP32 (torch's scalar)."""
    d = tl.minimum(tl.maximum(bm1 * tl.abs(rm), GUARD_LO), GUARD_HI)
    sh = rm + d
    if (_STATS & ROUND) != 0:
        sh = _rb(sh)
        up = _next_up(_rb(rm), 65536)
    else:
        up = _next_up(rm, 1)
    return tl.where(sh > rm, sh, up)

@triton.jit
def _guarded(rm, m_i, fire, bm1, ROUND: tl.constexpr):
    """stabilized_guarded on a tile (kernels/emulator.py _new_max): (the tile max merged into the running max m_i,
    the rows where the shift is meant to act: a repeated max (`fire`) that reaches the running max). The shift fires
    there unless it would exceed GUARD_HI (|rm| >= 2048 in BF16: counted in sfa_p1_rows instead)."""
    sfa = fire & (rm + GUARD_LO > m_i)
    sh = _guard_shift(rm, bm1, ROUND)
    return tl.where(sfa & (sh - rm <= GUARD_HI), sh, rm), sfa

@triton.jit
def _lowbias32(x):
    """Wellons' lowbias32 on uint32 (kernels/stochastic.py lowbias32, there in int64: the same bits)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)

@triton.jit
def _sr_bits(key, stream, ctr):
    """kernels/stochastic.py uniform16, bit for bit: uniform integers in [0, 2^16) (uint32) for the elements whose
    flat index in the emulator's (B, H, rows, D) query tile is ctr (BLOCK_M, D) uint32, under the call's key (uint32)
    and the per-row stream ids `stream` (BLOCK_M,) uint32."""
    s = _lowbias32(stream)
    k1 = _lowbias32(key + s)
    k2 = _lowbias32(k1 ^ _lowbias32(s ^ 0x9E3779B9))
    return _lowbias32(_lowbias32(ctr + k1[:, None]) ^ k2[:, None]) >> 16

@triton.jit
def _sr(x, bits):
    """kernels/stochastic.py stochastic_round: FP32 x to BF16 (held in FP32), rounding up with probability (low 16
    bits) / 2^16: the uniform bits added to the pattern, the low 16 bits dropped; non-finite x unchanged."""
    y = ((x.to(tl.uint32, bitcast=True) + bits) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) <= 3.4028234663852886e38, y, x)

@triton.jit
def _rs(x, keep, key, stream, ctr_row, ON: tl.constexpr, SR: tl.constexpr, HAS_OFP32: tl.constexpr,
        HEAD_DIM: tl.constexpr):
    """A store at pv_out / acc: stochastic_round where the point is BF16 (ON) and SR (stream: the point's per-row
    stream ids, ctr_row: the rows' flat index of element d = 0), else as _r; heads with FP32 O (`keep`) unchanged."""
    if ON and SR:
        y = _sr(x, _sr_bits(key, stream, ctr_row[:, None] + tl.arange(0, HEAD_DIM).to(tl.uint32)[None, :]))
        if HAS_OFP32:
            y = tl.where(keep, x, y)
        return y
    else:
        return _r(x, keep, ON, HAS_OFP32)

@triton.jit
def _program(LPT: tl.constexpr, LAST_FIRST: tl.constexpr):
    """(tile, batch-head) of this program. LPT (longest processing time first): the grid (heads of a section, tiles,
    sections), so the GPU, which starts programs in launch order, starts the longest tile of every head of a
    section, then the next longest, and so on; a section's K and V fit in L2 (kernels/triton_launch.py _grid, sized
    as FlashAttention-3's tile scheduler sizes them). Under the causal mask a query tile's work grows with its index
    (LAST_FIRST: the last is the longest) and a key block's shrinks with it. In tile order, head by head (the grid
    (tiles, heads) of before, without LPT), the longest programs of the last heads started last and ran nearly alone
    at the end of the grid. Which program computes which tile changes no arithmetic (each program's rows are its
    own; the counters' atomics add integers and take a max), so the order keeps every bit."""
    if LPT:
        bh = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        t = tl.program_id(1)
        if LAST_FIRST:
            t = tl.num_programs(1) - 1 - t
    else:
        t = tl.program_id(0)
        bh = tl.program_id(1)
    return t, bh

@triton.jit
def _top2(a1, a2, b1, b2):
    """tl.reduce's combine for a row's two largest scores (a multiset's: a tie gives top2 == top1). A NaN score is
    never either (max ignores it; the min that feeds top2 propagates it, and the max then drops it), as s >= thr
    never counts it. The leaves' second value is NaN: max(x, NaN) = x folds away (with -inf it cost an FMNMX per
    score), and a second largest that does not exist (one non-NaN score) stays NaN, never >= thr, where -inf would
    pass thr = -inf and count a lone -inf score as repeated."""
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1, propagate_nan=tl.PropagateNan.ALL), tl.maximum(a2, b2))

@triton.jit
def _fwd_inner(acc, l_i, m_i, raw_max, fired, pmax, l_raw, p1, s_ahead, q, k_base, v_base, skt, svt, offs_m, offs_n,
               row_ok, lo, hi, T, scale, beta, eps, o_fp32, kp, bm1, tb, ntw, sr_key, sr_qt, sr_row, c_log2,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, ROUND: tl.constexpr,
               INPUT_F32: tl.constexpr, FLOOR: tl.constexpr,
               GEMM_DT: tl.constexpr, STABILIZED: tl.constexpr, NEED_REP: tl.constexpr, PROBE: tl.constexpr,
               HAS_OFP32: tl.constexpr, ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr, F32_DOT: tl.constexpr,
               COUNTERS: tl.constexpr, KEYPAD: tl.constexpr, GUARDED: tl.constexpr, CLAMP: tl.constexpr,
               SR: tl.constexpr, FOLD: tl.constexpr, FTZ: tl.constexpr, TOP2: tl.constexpr, RAWMAX: tl.constexpr,
               P1MAX: tl.constexpr, AHEAD: tl.constexpr):
    """The forward over key tiles [lo, hi): online softmax (or, ONE_BLOCK, a fixed row max) and P̄V.
    l_raw (COUNTERS, online path): the row sum before paper_bf16's floor and the BF16 rounding of l, in FP32: what
    tells a row whose every P̄ underflowed (AttnStats.underflow_rows, as the emulator counts it).
    p1 (COUNTERS with a stabilized softmax): the (row, tile) pairs where the shift fired but a P̄ fed to P̄V is still
    1 (AttnStats.sfa_p1_rows); ONE_BLOCK: whether any such P̄ is (the row's fire decides at the end).
    GUARDED, CLAMP, SR: softmax=stabilized_guarded, pbar_clamp, stochastic_round (the section above).
    FOLD (exp_form=exp2_folded; the online path, no score / shift / stats rounding): FlashAttention-2's softmax on the
    unscaled scores S, m their running max, P̄ = exp2(fl(S c) - fl(m c)), alpha = exp2(fl((m_old - m_new) c)),
    c = c_log2 = fl(scale log2(e)): one multiply per score instead of the scale's and exp's two, and no separate
    subtract-then-multiply. The counters read the scaled scores fl(S scale), whose maxima are fl(m scale) (rounding
    is monotone): the same counts and max logit as exp_form=exp."""
    PV_ON: tl.constexpr = (_PV_OUT & ROUND) != 0
    ACC_ON: tl.constexpr = (_ACC & ROUND) != 0
    # RAW (an unmasked tile of the online path, scores not stored in BF16, exp_form=exp): the tile's row max taken on
    # the unscaled scores S and scaled once, fl(max S scale) = max fl(S scale) (rounding is monotone and scale > 0;
    # the second largest likewise), and P̄'s argument S scale - m as before: no multiply per score for the max.
    # Compiled for sm_90 that argument is one FFMA either way (fl(S scale - m): LLVM contracts the multiply into the
    # subtract) beside, without RAW, a separate FMUL for the max; RAW drops that FMUL and leaves the FFMA, so every
    # bit should stay (the GPU test compares the two). RAWMAX off (the default): the max of the scaled scores. A
    # repeated-max test by counting needs every scaled score anyway, so RAW leaves it alone
    RAW: tl.constexpr = RAWMAX and not (FOLD or MASKED or KEYPAD or ONE_BLOCK) and (_SCORES & ROUND) == 0 and \
        (TOP2 or not NEED_REP)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        # stochastic_round's stream ids of this (query tile, key tile): ((qt << 16 | kt) << 2) | point
        sr_tile = (sr_qt << 18) | (tl.cast(start_n // BLOCK_N, tl.uint32) << 2)
        if AHEAD:  # this tile's QK^T came a tile ahead (the diagonal tile's from the unmasked loop's last one)
            s_qk = s_ahead
            if not MASKED:  # the next tile's, issued before this tile's softmax: the GEMM runs beside it
                nxt = tl.minimum(cols + BLOCK_N, T - 1)
                s_ahead = _qk(q, k_base + nxt[:, None] * skt, nxt, T, INPUT_F32, GEMM_DT, False, F32_DOT)
            s = _scored(s_qk, offs_m, cols, T, 1.0 if (FOLD or RAW) else scale, ROUND, MASKED, kp, KEYPAD)
        else:
            s = _scores(q, k_base + cols[:, None] * skt, offs_m, cols, T, 1.0 if (FOLD or RAW) else scale, ROUND,
                        INPUT_F32, GEMM_DT, MASKED, F32_DOT, kp, KEYPAD)
        if ONE_BLOCK:
            d_s = s - m_i[:, None]
            if (_SHIFT & ROUND) != 0:
                d_s = _rb(d_s)
            p = _exp(d_s, FTZ)
            l_i += tl.sum(p, 1)
            fire = fired > 0  # the row's repeated max (pass 2 of the kernel)
            if PROBE:
                pmax = tl.where(fired > 0, tl.maximum(pmax, tl.max(p, 1)), pmax)
        else:
            # TOP2 on a tile where every entry is valid: the row's two largest scores in one reduction, and "more
            # than one score reaches max - eps" is "the second largest does" (s >= thr is monotone in s; FOLD's
            # fl(s scale) too): no per-entry compare, convert and add. Masked tiles count entries, as before
            BY_TOP2: tl.constexpr = NEED_REP and TOP2 and not (MASKED or KEYPAD)
            if BY_TOP2:
                rm, r2 = tl.reduce((s, tl.full([BLOCK_M, BLOCK_N], float("nan"), tl.float32)), 1, _top2)
                if RAW:
                    r2 = _mul_rn(r2, scale)
            else:
                rm = tl.max(s, 1)
            if RAW:
                rm = _mul_rn(rm, scale)
            raw_max = tl.maximum(raw_max, rm)  # FOLD: unscaled (scaled once, at the end)
            if NEED_REP:  # Algorithm 3 on this key tile (masked entries never count)
                if FOLD:  # on the scaled scores, as exp_form=exp counts
                    thr = _mul_rn(rm, scale) - eps
                else:
                    thr = rm - eps
                    if (_SCORES & ROUND) != 0:
                        thr = _rb(thr)
                if BY_TOP2:
                    if FOLD:
                        fire = (_mul_rn(r2, scale) >= thr) & row_ok
                    else:
                        fire = (r2 >= thr) & row_ok
                else:
                    if FOLD:
                        near = s * scale >= thr[:, None]
                    else:
                        near = s >= thr[:, None]
                    if MASKED or KEYPAD:  # elsewhere every entry is valid: no per-entry test (the counters' cost)
                        near = near & _valid(offs_m, cols, T, MASKED, kp, KEYPAD)
                    # an int32 count: an FP32 one (exact too) ran fa2's forward with counters 5% faster on an H100,
                    # but paper_bf16's 4% and SFA's 23% slower, across two machines (gpu-h100-2026-12-06d)
                    fire = (tl.sum(near.to(tl.int32), 1) > 1) & row_ok
                fired += fire.to(tl.int32)
                sfa = fire  # rows where the stabilized shift is meant to act (sfa_p1_rows)
                if STABILIZED:
                    rm_s = rm * beta
                    if (_SCORES & ROUND) != 0:
                        rm_s = _rb(rm_s)
                    rm = tl.where(fire & (rm > 0), rm_s, rm)
                    rm = tl.where(fire & (rm < 0), 0.0, rm)
                if GUARDED:  # only where the repeated max reaches the running max; never past GUARD_HI
                    rm, sfa = _guarded(rm, m_i, fire, bm1, ROUND)
            m_new = tl.maximum(m_i, rm)
            if (_STATS & ROUND) != 0:  # m stored in BF16 (a no-op when the scores are BF16 already)
                m_new = _rb(m_new)
            d_m = m_i - m_new
            if RAW:
                d_s = s * scale - m_new[:, None]  # one FFMA, as before RAW (see RAW above)
            else:
                d_s = s - m_new[:, None]
            if (_SHIFT & ROUND) != 0:  # the arguments of exp stored in BF16, exp and row sum in FP32
                d_m = _rb(d_m)
                d_s = _rb(d_s)
            if FOLD:
                alpha = tl.math.exp2(d_m * c_log2)
                p = tl.math.exp2(_mul_rn(s, c_log2) - _mul_rn(m_new, c_log2)[:, None])
            else:
                alpha = _exp(d_m, FTZ)
                p = _exp(d_s, FTZ)
            rs = tl.sum(p, 1)
            if COUNTERS:
                l_raw = alpha * l_raw + rs
            if FLOOR:
                rs = tl.maximum(rs, 1e-10)
            l_i = alpha * l_i + rs
            if (_STATS & ROUND) != 0:
                l_i = _rb(l_i)
            if PROBE:
                pmax = tl.where(fire, tl.maximum(pmax, tl.max(p, 1)), pmax)
            acc = _rs(acc * alpha[:, None], o_fp32, sr_key, sr_tile | 1, sr_row, ACC_ON, SR, HAS_OFP32,
                      HEAD_DIM).to(acc.dtype)
            m_i = m_new
        if CLAMP:  # P̄ = 1 at a repeated max fed to P̄V as PBAR_CLAMP (l above: the unclamped P̄)
            tie = fire[:, None] & (p == 1.0)
            p = tl.where(tie, PBAR_CLAMP, p)
            _tie_store(tb, tie, offs_m, start_n, row_ok, ntw, BLOCK_M, BLOCK_N)
        if MASKED:
            v = tl.load(v_base + cols[:, None] * svt, mask=(cols < T)[:, None], other=0.0).to(GEMM_DT)
        else:
            v = tl.load(v_base + cols[:, None] * svt).to(GEMM_DT)
        if HAS_OFP32 and (_PBAR & ROUND) != 0:  # heads with FP32 O skip P̄'s rounding: FP32 GEMM
            p_in = tl.where(o_fp32, p, _rb(p))
            pv = _dot_pt(p_in, v, False, INPUT_F32, F32_DOT)
            p_top = tl.max(p_in, 1)  # the largest P̄ the GEMM reads (COUNTERS with a stabilized softmax)
        else:
            pv = _dot_pt(p, v, (_PBAR & ROUND) != 0, INPUT_F32, F32_DOT)
            # the largest P̄ the GEMM reads, as it reads it. P1MAX (triton_launch.p1_form): r(max P̄) = max r(P̄)
            # (round to nearest is monotone), one rounding a row; else every P̄ rounded again, a conversion a score
            # (the GEMM's own conversion is not shared)
            if P1MAX or (_PBAR & ROUND) == 0:
                p_top = tl.max(p, 1)
                if (_PBAR & ROUND) != 0:
                    p_top = _rb(p_top)
            else:
                p_top = tl.max(_rb(p), 1)
        if COUNTERS and (STABILIZED or GUARDED):  # a P̄ fed to P̄V still 1 where the shift fired
            hit = p_top >= 1.0
            if ONE_BLOCK:
                p1 = p1 | hit.to(tl.int32)
            else:
                p1 += (sfa & hit).to(tl.int32)
        if ONE_BLOCK:  # stored once, after the last tile
            acc += pv
        else:  # O_acc = r(r(O_acc * alpha) + r(P̄V))
            acc = _rs(acc + _rs(pv, o_fp32, sr_key, sr_tile, sr_row, PV_ON, SR, HAS_OFP32, HEAD_DIM), o_fp32, sr_key,
                      sr_tile | 2, sr_row, ACC_ON, SR, HAS_OFP32, HEAD_DIM).to(acc.dtype)
    return acc, l_i, m_i, raw_max, fired, pmax, l_raw, p1, s_ahead

@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, REP, MAXL, UNDER, P1, OFP32, PMAX, FIRED, KP, FIRST, TIES, SRKEY,
                sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod, skpb,
                H, T, scale, beta, eps, bm1, ntw, sr_bq, c_log2,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                ROUND: tl.constexpr, INPUT_F32: tl.constexpr, FLOOR: tl.constexpr, STABILIZED: tl.constexpr,
                COUNTERS: tl.constexpr, HAS_OFP32: tl.constexpr, ONE_BLOCK: tl.constexpr,
                PROBE: tl.constexpr, F32_DOT: tl.constexpr, KEYPAD: tl.constexpr, GUARDED: tl.constexpr,
                CLAMP: tl.constexpr, SR: tl.constexpr, FOLD: tl.constexpr, LPT: tl.constexpr,
                FTZ: tl.constexpr, TOP2: tl.constexpr, RELAXED: tl.constexpr, ACC16: tl.constexpr,
                RAWMAX: tl.constexpr, P1MAX: tl.constexpr, AHEAD: tl.constexpr):
    """P1 (H,) int64: sfa_p1_rows (COUNTERS with a stabilized softmax). TIES (B*H, T, ntw) uint8: pbar_clamp's tie
    bits (CLAMP). SRKEY () int64: stochastic_round's call key (SR; kernels/stochastic.py call_key), sr_bq the
    emulator's query tile (its stream ids and element indices). bm1: beta - 1 in FP32 (GUARDED). FOLD, c_log2:
    exp_form=exp2_folded (_fwd_inner); lse = fl(m scale) + log(l) then, as the emulator's (an FMA there).
    LPT: the launch order (_program). FTZ: exp's instruction (_exp; every kernel has it). TOP2: the repeated-max
    test of an unmasked tile by its two largest scores (_fwd_inner), else by counting. RELAXED: the counters'
    atomics without memory fences (integer sums and maxima: any order gives the same counts; the host reads them
    after the stream's later copy); else acq_rel, Triton's default (a GPU-wide fence and an L1 invalidation around
    each). ACC16 (every kernel with an accumulator): O_acc / dK, dV, dQ kept in BF16 where the recipe stores them so
    after every tile (triton_launch.accumulator_form). RAWMAX: an unmasked tile's row max on the unscaled scores
    (_fwd_inner's RAW; triton_launch.score_max_form). P1MAX: sfa_p1_rows' test on the rounded row max
    (triton_launch.p1_form)."""
    start_m, off_bh = _program(LPT, True)
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
    kp = KP + off_b * skpb  # KEYPAD: this batch element's key-keep row
    lo = 0  # KEYPAD: key tiles before the first kept key are masked for every row: skipped
    if KEYPAD:
        first = tl.load(FIRST + off_b)
        lo = first // BLOCK_N * BLOCK_N

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 3.3895313892515355e38
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # O_acc stored in BF16 after every tile (acc, every head): kept in BF16, the same values in half the registers
    # (the interpreter's cast truncates: FP32 there)
    ACC_DT: tl.constexpr = tl.bfloat16 if ACC16 and (_ACC & ROUND) != 0 and not HAS_OFP32 and not ONE_BLOCK and \
        not INTERP_DOT else tl.float32
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DT)
    raw_max = tl.zeros([BLOCK_M], dtype=tl.float32) - 3.3895313892515355e38
    fired = tl.zeros([BLOCK_M], dtype=tl.int32)
    pmax = tl.zeros([BLOCK_M], dtype=tl.float32)  # PROBE: largest P̄ in a tile where the SFA condition fired
    l_raw = tl.zeros([BLOCK_M], dtype=tl.float32)  # COUNTERS: the unfloored row sum (online path)
    p1 = tl.zeros([BLOCK_M], dtype=tl.int32)  # COUNTERS, stabilized: sfa_p1_rows
    NEED_REP: tl.constexpr = STABILIZED or COUNTERS or PROBE or GUARDED or CLAMP
    tb = TIES + off_bh.to(tl.int64) * T * ntw  # CLAMP: this head's tie bits
    sr_key = tl.load(SRKEY).to(tl.uint32)  # SR: the call's key (a dummy otherwise)
    # SR: each row's query tile qt of the emulator (block_q rows, the last one shorter) and its flat index in that
    # tile's (B, H, rows, D) tensor at d = 0: what the emulator's uniform16 numbers its elements by
    qt = offs_m // sr_bq
    sr_rows = tl.minimum(sr_bq, T - qt * sr_bq)
    sr_qt = qt.to(tl.uint32)
    sr_row = (off_bh.to(tl.uint32) * sr_rows.to(tl.uint32) + (offs_m - qt * sr_bq).to(tl.uint32)) * HEAD_DIM

    if ONE_BLOCK:
        # pass 1: the row max over the whole (causal) row, as one block would see it
        for start_n in range(lo, hi, BLOCK_N):
            s = _scores(q, k_base + (start_n + offs_n)[:, None] * skt, offs_m, start_n + offs_n, T,
                        scale, ROUND, INPUT_F32, GEMM_DT, True, F32_DOT, kp, KEYPAD)
            m_i = tl.maximum(m_i, tl.max(s, 1))
        raw_max = m_i
        if NEED_REP:
            # pass 2: how many scores of the row reach its max - eps (threshold stored like the scores)
            thr = m_i - eps
            if (_SCORES & ROUND) != 0:
                thr = _rb(thr)
            cnt = tl.zeros([BLOCK_M], dtype=tl.int32)
            for start_n in range(lo, hi, BLOCK_N):
                s = _scores(q, k_base + (start_n + offs_n)[:, None] * skt, offs_m, start_n + offs_n, T,
                            scale, ROUND, INPUT_F32, GEMM_DT, True, F32_DOT, kp, KEYPAD)
                near = _valid(offs_m, start_n + offs_n, T, True, kp, KEYPAD) & (s >= thr[:, None])
                cnt += tl.sum(near.to(tl.int32), 1)
            fire = (cnt > 1) & row_ok
            fired = fire.to(tl.int32)
            if STABILIZED:
                m_s = m_i * beta
                if (_SCORES & ROUND) != 0:
                    m_s = _rb(m_s)
                m_i = tl.where(fire & (m_i > 0), m_s, m_i)
                m_i = tl.where(fire & (m_i < 0), 0.0, m_i)
            if GUARDED:  # one tile: against the initial running max, which every row's max reaches
                m_i, _ = _guarded(m_i, tl.zeros([BLOCK_M], dtype=tl.float32) - 3.3895313892515355e38, fire, bm1,
                                  ROUND)
        if (_STATS & ROUND) != 0:
            m_i = _rb(m_i)

    # key tiles wholly below this query block's diagonal need no mask; the rest do
    mid = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N
    lo1 = 0
    lo2 = mid
    if KEYPAD:
        lo1 = tl.minimum(lo, mid)
        lo2 = tl.maximum(lo, mid)
    # AHEAD (triton_launch.score_gemm_form): each key tile's QK^T issued one tile ahead, the first here. With square
    # tiles the masked range is the one diagonal tile, whose QK^T the unmasked loop's last iteration issues
    AHEAD_ON: tl.constexpr = AHEAD and not ONE_BLOCK and BLOCK_M == BLOCK_N
    s_ahead = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if AHEAD_ON:
        first_n = tl.minimum(lo1 + offs_n, T - 1)
        s_ahead = _qk(q, k_base + first_n[:, None] * skt, first_n, T, INPUT_F32, GEMM_DT, False, F32_DOT)
    acc, l_i, m_i, raw_max, fired, pmax, l_raw, p1, s_ahead = _fwd_inner(
        acc, l_i, m_i, raw_max, fired, pmax, l_raw, p1, s_ahead, q, k_base, v_base, skt, svt, offs_m, offs_n, row_ok,
        lo1, mid, T, scale, beta, eps, o_fp32, kp, bm1, tb, ntw, sr_key, sr_qt, sr_row, c_log2, BLOCK_M, BLOCK_N,
        HEAD_DIM, ROUND, INPUT_F32, FLOOR, GEMM_DT, STABILIZED, NEED_REP, PROBE, HAS_OFP32, ONE_BLOCK, False, F32_DOT,
        COUNTERS, KEYPAD, GUARDED, CLAMP, SR, FOLD, FTZ, TOP2, RAWMAX, P1MAX, AHEAD_ON)
    acc, l_i, m_i, raw_max, fired, pmax, l_raw, p1, s_ahead = _fwd_inner(
        acc, l_i, m_i, raw_max, fired, pmax, l_raw, p1, s_ahead, q, k_base, v_base, skt, svt, offs_m, offs_n, row_ok,
        lo2, hi, T, scale, beta, eps, o_fp32, kp, bm1, tb, ntw, sr_key, sr_qt, sr_row, c_log2, BLOCK_M, BLOCK_N,
        HEAD_DIM, ROUND, INPUT_F32, FLOOR, GEMM_DT, STABILIZED, NEED_REP, PROBE, HAS_OFP32, ONE_BLOCK, True, F32_DOT,
        COUNTERS, KEYPAD, GUARDED, CLAMP, SR, FOLD, FTZ, TOP2, RAWMAX, P1MAX, AHEAD_ON)

    if ONE_BLOCK:  # one tile: l and the P̄V product stored once
        if COUNTERS:
            l_raw = l_i  # the whole row's sum, not yet floored or rounded
        if FLOOR:
            l_i = tl.maximum(l_i, 1e-10)
        if (_STATS & ROUND) != 0:
            l_i = _rb(l_i)
        if SR and (_PV_OUT & ROUND) != 0:  # the emulator's one tile: SR(P̄V) at stream 0, its acc store a no-op
            acc = _rs(acc, o_fp32, sr_key, sr_qt << 18, sr_row, True, True, HAS_OFP32, HEAD_DIM)
        elif SR and (_ACC & ROUND) != 0:  # an FP32 P̄V: acc = SR(0 + P̄V) at stream 2
            acc = _rs(acc, o_fp32, sr_key, (sr_qt << 18) | 2, sr_row, True, True, HAS_OFP32, HEAD_DIM)
        else:
            acc = _r(acc, o_fp32, ((_PV_OUT | _ACC) & ROUND) != 0, HAS_OFP32)
    if KEYPAD:  # rows with no key (before the first kept one): O = 0, lse = +inf (P = 0 in the backward)
        live = offs_m >= first
        l_i = tl.where(live, l_i, 1.0)  # (their l may be 0: every key tile skipped)
    o = _r(acc / l_i[:, None], o_fp32, (_O_STORE & ROUND) != 0, HAS_OFP32)  # O stored (for delta)
    if FOLD:
        m_i = _mul_rn(m_i, scale)  # the scaled running max (FOLD kept it unscaled)
        raw_max = raw_max * scale
    lse = m_i + tl.log(l_i)
    if KEYPAD:
        o = tl.where(live[:, None], o, 0.0)
        lse = tl.where(live, lse, float("inf"))
    tl.store(O + off_b * sob + off_h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
             o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + off_bh * T + offs_m, lse, mask=row_ok)
    if PROBE:
        tl.store(PMAX + off_bh * T + offs_m, pmax, mask=row_ok)
        tl.store(FIRED + off_bh * T + offs_m, fired, mask=row_ok)
    if COUNTERS:
        SEM: tl.constexpr = "relaxed" if RELAXED else "acq_rel"
        tl.atomic_add(REP + off_h, tl.sum(fired, 0).to(tl.int64), sem=SEM)
        tl.atomic_max(MAXL, tl.max(tl.where(row_ok, raw_max, -3.3895313892515355e38), 0), sem=SEM)
        # rows whose every P̄ underflowed (row sum under paper_bf16's 1e-10 floor or FP32's smallest normal, or
        # NaN): Algorithm 3's shift beta * rowmax at huge logits; their O is 0 (floored) or NaN, never silent
        under = ((l_raw < (1e-10 if FLOOR else 1.1754943508222875e-38)) | (l_raw != l_raw)) & row_ok
        if KEYPAD:  # a row with no key at all is no underflow (it has no P̄ to lose)
            under = under & live
        tl.atomic_add(UNDER + off_h, tl.sum(under.to(tl.int32), 0).to(tl.int64), sem=SEM)
        if STABILIZED or GUARDED:  # (row, tile) pairs where the shift fired and a P̄ fed to P̄V is still 1
            if ONE_BLOCK:
                p1 = p1 & fired
            tl.atomic_add(P1 + off_h, tl.sum(p1, 0).to(tl.int64), sem=SEM)

@triton.jit
def _delta_rows(do_base, o_base, ofp32_ptr, offs_m, offs_d, row_ok, sdt, sdd, sot, sod, GEMM_DT: tl.constexpr,
                ROUND: tl.constexpr, HAS_OFP32: tl.constexpr):
    """delta = rowsum(r(dO*O)) of rows offs_m (delta=dO_O): the delta kernel's, and the dQ kernel's own where the
    launcher fuses it there (FUSE_DELTA; same tile, same warps, so the same layout and summation order)."""
    do = tl.load(do_base + offs_m[:, None] * sdt + offs_d[None, :] * sdd, mask=row_ok[:, None], other=0.0).to(GEMM_DT)
    o = tl.load(o_base + offs_m[:, None] * sot + offs_d[None, :] * sod, mask=row_ok[:, None], other=0.0)
    # the product stored at delta_prod (FP32 for heads whose stored O is FP32)
    prod = _r(do.to(tl.float32) * o.to(tl.float32), tl.load(ofp32_ptr) != 0, (_DELTA_PROD & ROUND) != 0, HAS_OFP32)
    return tl.sum(prod, 1)

@triton.jit
def _bwd_delta_kernel(Q, K, V, O, DO, LSE, DELTA, OFP32, KP, FIRST, TIES,
                      sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                      sob, soh, sot, sod, sdb, sdh, sdt, sdd, skpb,
                      H, T, scale, ntw,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      ROUND: tl.constexpr, INPUT_F32: tl.constexpr, DELTA_MODE: tl.constexpr,
                      HAS_OFP32: tl.constexpr, F32_DOT: tl.constexpr, KEYPAD: tl.constexpr, CLAMP: tl.constexpr,
                      LPT: tl.constexpr, FTZ: tl.constexpr):
    """delta = rowsum(r(dO*O)) | sum_j rowsum(dP_j*P_j) | rowsum(dO*(sum_j P_j V_j in FP32)); CLAMP: P_j there is
    c o P_j, c = PBAR_CLAMP at the forward's ties (TIES). LPT: the launch order (_program)."""
    start_m, off_bh = _program(LPT, True)
    off_b = off_bh // H
    off_h = off_bh % H
    GEMM_DT: tl.constexpr = tl.float32 if INPUT_F32 else tl.bfloat16
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    if DELTA_MODE == 0:
        delta = _delta_rows(DO + off_b * sdb + off_h * sdh, O + off_b * sob + off_h * soh, OFP32 + off_h, offs_m,
                            offs_d, row_ok, sdt, sdd, sot, sod, GEMM_DT, ROUND, HAS_OFP32)
    else:
        do = tl.load(DO + off_b * sdb + off_h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd,
                     mask=row_ok[:, None], other=0.0).to(GEMM_DT)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(Q + off_b * sqb + off_h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                    mask=row_ok[:, None], other=0.0).to(GEMM_DT)
        lse = tl.load(LSE + off_bh * T + offs_m, mask=row_ok, other=0.0)
        k_base = K + off_b * skb + off_h * skh + offs_d[None, :] * skd
        v_base = V + off_b * svb + off_h * svh + offs_d[None, :] * svd
        hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        dsum = tl.zeros([BLOCK_M], dtype=tl.float32)
        kp = KP + off_b * skpb
        lo = 0
        if KEYPAD:  # key tiles before the first kept key: P = 0 there for every row
            lo = tl.load(FIRST + off_b) // BLOCK_N * BLOCK_N
        for start_n in range(lo, hi, BLOCK_N):
            s = _scores(q, k_base + (start_n + offs_n)[:, None] * skt, offs_m, start_n + offs_n, T,
                        scale, ROUND, INPUT_F32, GEMM_DT, True, F32_DOT, kp, KEYPAD)
            p = tl.where(_valid(offs_m, start_n + offs_n, T, True, kp, KEYPAD), _exp(s - lse[:, None], FTZ), 0.0)
            if CLAMP:
                cols = start_n + offs_n
                tie = _tie_load(TIES + off_bh.to(tl.int64) * T * ntw, offs_m[:, None], cols[None, :], ntw,
                                row_ok[:, None] & (cols < T)[None, :])
                p = tl.where(tie, p * PBAR_CLAMP, p)
            v = tl.load(v_base + (start_n + offs_n)[:, None] * svt,
                        mask=((start_n + offs_n) < T)[:, None], other=0.0).to(GEMM_DT)
            if DELTA_MODE == 1:  # dP as the backward computes it (stored like its GEMM outputs)
                dp = _dot_in(do, tl.trans(v), INPUT_F32, F32_DOT)
                if (_BWD_OUT & ROUND) != 0:
                    dp = _rb(dp)
                dsum += tl.sum(dp * p, 1)
            else:  # O recomputed as P V with nothing rounded
                acc += tl.dot(p, v.to(tl.float32), input_precision=F32_DOT)
        if DELTA_MODE == 1:
            delta = dsum
        else:
            delta = tl.sum(do.to(tl.float32) * acc, 1)
    tl.store(DELTA + off_bh * T + offs_m, delta, mask=row_ok)

@triton.jit
def _grad_add(g, c, ROUND: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """g + c with the chunk c stored at bwd_out and the sum at grad_acc (ONE_BLOCK: once, after the loop). A BF16 g
    (ACC_DT: where grad_acc stores every sum in BF16, its values are BF16's anyway, so the accumulator takes half the
    registers for the same bits): the sum in FP32, then stored."""
    if ONE_BLOCK:
        return g + c
    else:
        if (_BWD_OUT & ROUND) != 0:
            c = _rb(c)
        s = g.to(tl.float32) + c
        if (_GRAD_ACC & ROUND) != 0:
            s = _rb(s)
        return s.to(g.dtype)

@triton.jit
def _grad_end(g, ROUND: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """ONE_BLOCK: the one chunk stored at bwd_out, then at grad_acc (one rounding: both BF16 or not)."""
    if ONE_BLOCK and ((_BWD_OUT | _GRAD_ACC) & ROUND) != 0:
        return _rb(g)
    else:
        return g

@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, sqt, sdt, LSE, DELTA, off_bh, offs_n, offs_m0, lo, hi, T, scale,
                kcol, tb, ntw, BLOCK_M: tl.constexpr, ROUND: tl.constexpr, INPUT_F32: tl.constexpr,
                GEMM_DT: tl.constexpr, ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr, F32_DOT: tl.constexpr,
                KEYPAD: tl.constexpr, CLAMP: tl.constexpr, FTZ: tl.constexpr):
    """dK, dV of one key block over query tiles [lo, hi) (chunks at bwd_out, accumulators at grad_acc); CLAMP:
    dV = (c o P)^T dO, dS = P o (c o dP - delta), c = PBAR_CLAMP at the forward's ties (tb, this head's bits)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        m_ok = offs_m < T  # rows past T load as zeros and contribute nothing
        q = tl.load(q_base + offs_m[:, None] * sqt, mask=m_ok[:, None], other=0.0).to(GEMM_DT)
        do = tl.load(do_base + offs_m[:, None] * sdt, mask=m_ok[:, None], other=0.0).to(GEMM_DT)
        lse = tl.load(LSE + off_bh * T + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(DELTA + off_bh * T + offs_m, mask=m_ok, other=0.0)
        sT = _dot_in(k, tl.trans(q), INPUT_F32, F32_DOT)
        if (_SCORES & ROUND) != 0:
            sT = _rb(_rb(sT) * scale)
        else:
            sT = sT * scale
        pT = _exp(sT - lse[None, :], FTZ)
        if MASKED:
            pT = tl.where((offs_n[:, None] <= offs_m[None, :]) & m_ok[None, :], pT, 0.0)
        if KEYPAD:  # this block's masked keys (kcol: their keep flags)
            pT = tl.where(kcol[:, None], pT, 0.0)
        if CLAMP:
            tieT = _tie_load(tb, offs_m[None, :], offs_n[:, None], ntw, m_ok[None, :] & (offs_n < T)[:, None])
            dv_c = _dot_pt(tl.where(tieT, pT * PBAR_CLAMP, pT), do, (_BWD_GEMM_IN & ROUND) != 0, INPUT_F32, F32_DOT)
        else:
            dv_c = _dot_pt(pT, do, (_BWD_GEMM_IN & ROUND) != 0, INPUT_F32, F32_DOT)
        dpT = _dot_in(v, tl.trans(do), INPUT_F32, F32_DOT)
        if (_BWD_OUT & ROUND) != 0:
            dpT = _rb(dpT)
        if CLAMP:
            dpT = tl.where(tieT, dpT * PBAR_CLAMP, dpT)
        dsT = (pT * scale) * (dpT - delta[None, :])
        dk_c = _dot_pt(dsT, q, (_BWD_GEMM_IN & ROUND) != 0, INPUT_F32, F32_DOT)
        dv = _grad_add(dv, dv_c, ROUND, ONE_BLOCK)
        dk = _grad_add(dk, dk_c, ROUND, ONE_BLOCK)
    return dk, dv

@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, KP, FIRST, TIES,
                     sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
                     sgb, sgh, sgt, sgd, skpb,
                     H, T, scale, ntw,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     ROUND: tl.constexpr, INPUT_F32: tl.constexpr, ONE_BLOCK: tl.constexpr,
                     F32_DOT: tl.constexpr, KEYPAD: tl.constexpr, CLAMP: tl.constexpr, LPT: tl.constexpr,
                     FTZ: tl.constexpr, ACC16: tl.constexpr):
    """dK, dV for BLOCK_N keys, looping over query tiles of BLOCK_M (= block_q where rounding is emulated). LPT: the
    launch order (_program; key block 0, which sees every query tile, is the longest)."""
    start_n, off_bh = _program(LPT, False)
    off_b = off_bh // H
    off_h = off_bh % H
    GEMM_DT: tl.constexpr = tl.float32 if INPUT_F32 else tl.bfloat16
    # grad_acc in BF16 after every chunk: the accumulators in BF16 (_grad_add; the interpreter's cast truncates)
    ACC_DT: tl.constexpr = tl.bfloat16 if ACC16 and (_GRAD_ACC & ROUND) != 0 and not ONE_BLOCK and \
        not INTERP_DOT else tl.float32
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < T
    k = tl.load(K + off_b * skb + off_h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd,
                mask=col_ok[:, None], other=0.0).to(GEMM_DT)
    v = tl.load(V + off_b * svb + off_h * svh + offs_n[:, None] * svt + offs_d[None, :] * svd,
                mask=col_ok[:, None], other=0.0).to(GEMM_DT)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DT)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DT)
    q_base = Q + off_b * sqb + off_h * sqh + offs_d[None, :] * sqd
    do_base = DO + off_b * sdb + off_h * sdh + offs_d[None, :] * sdd
    lo = (start_n * BLOCK_N) // BLOCK_M * BLOCK_M  # first query tile touching this key block
    # query tiles starting at or past this block's last key see every key of it: no mask there
    mid = tl.minimum(tl.cdiv((start_n + 1) * BLOCK_N - 1, BLOCK_M) * BLOCK_M, T)
    kcol = col_ok  # KEYPAD: the keep flags of this block's keys
    lo2 = mid
    if KEYPAD:  # query tiles before the first kept key have no key at all (P = 0): skipped
        kcol = _key_ok(KP + off_b * skpb, offs_n, T)
        lo = tl.maximum(lo, tl.load(FIRST + off_b) // BLOCK_M * BLOCK_M)
        lo2 = tl.maximum(mid, lo)
    tb = TIES + off_bh.to(tl.int64) * T * ntw  # CLAMP: this head's tie bits
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, sqt, sdt, LSE, DELTA, off_bh, offs_n, offs_m0, lo, mid, T,
                         scale, kcol, tb, ntw, BLOCK_M, ROUND, INPUT_F32, GEMM_DT, ONE_BLOCK, True, F32_DOT, KEYPAD,
                         CLAMP, FTZ)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, sqt, sdt, LSE, DELTA, off_bh, offs_n, offs_m0, lo2, T, T,
                         scale, kcol, tb, ntw, BLOCK_M, ROUND, INPUT_F32, GEMM_DT, ONE_BLOCK, False, F32_DOT, KEYPAD,
                         CLAMP, FTZ)
    dk = _grad_end(dk, ROUND, ONE_BLOCK)
    dv = _grad_end(dv, ROUND, ONE_BLOCK)
    g = off_b * sgb + off_h * sgh + offs_n[:, None] * sgt + offs_d[None, :] * sgd
    tl.store(DK + g, _cast_out(dk, DK), mask=col_ok[:, None])
    tl.store(DV + g, _cast_out(dv, DV), mask=col_ok[:, None])

@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, skt, svt, offs_m, offs_n0, lo, hi, T, scale, kp, tb, ntw,
              BLOCK_N: tl.constexpr, ROUND: tl.constexpr, INPUT_F32: tl.constexpr, GEMM_DT: tl.constexpr,
              ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr, F32_DOT: tl.constexpr, KEYPAD: tl.constexpr,
              CLAMP: tl.constexpr, FTZ: tl.constexpr):
    """dQ of one query block over key tiles [lo, hi) (chunks at bwd_out, the accumulator at grad_acc); CLAMP:
    dS = P o (c o dP - delta), c = PBAR_CLAMP at the forward's ties."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        s = _scores(q, k_base + offs_n[:, None] * skt, offs_m, offs_n, T, scale, ROUND, INPUT_F32, GEMM_DT,
                    MASKED, F32_DOT, kp, KEYPAD)
        p = _exp(s - lse[:, None], FTZ)
        if MASKED:
            p = tl.where(_valid(offs_m, offs_n, T, True, kp, KEYPAD), p, 0.0)
            v = tl.load(v_base + offs_n[:, None] * svt, mask=(offs_n < T)[:, None], other=0.0).to(GEMM_DT)
            k = tl.load(k_base + offs_n[:, None] * skt, mask=(offs_n < T)[:, None], other=0.0).to(GEMM_DT)
        else:
            if KEYPAD:  # a tile below the diagonal: only the keys KP masks
                p = tl.where(_key_ok(kp, offs_n, T)[None, :], p, 0.0)
            v = tl.load(v_base + offs_n[:, None] * svt).to(GEMM_DT)
            k = tl.load(k_base + offs_n[:, None] * skt).to(GEMM_DT)
        dp = _dot_in(do, tl.trans(v), INPUT_F32, F32_DOT)
        if (_BWD_OUT & ROUND) != 0:
            dp = _rb(dp)
        if CLAMP:
            tie = _tie_load(tb, offs_m[:, None], offs_n[None, :], ntw, (offs_m < T)[:, None] & (offs_n < T)[None, :])
            dp = tl.where(tie, dp * PBAR_CLAMP, dp)
        ds = (p * scale) * (dp - delta[:, None])
        dq = _grad_add(dq, _dot_pt(ds, k, (_BWD_GEMM_IN & ROUND) != 0, INPUT_F32, F32_DOT), ROUND, ONE_BLOCK)
    return dq

@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, KP, FIRST, TIES, O, OFP32,
                   sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
                   sgb, sgh, sgt, sgd, sob, soh, sot, sod, skpb,
                   H, T, scale, ntw,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   ROUND: tl.constexpr, INPUT_F32: tl.constexpr, ONE_BLOCK: tl.constexpr,
                   F32_DOT: tl.constexpr, KEYPAD: tl.constexpr, CLAMP: tl.constexpr, LPT: tl.constexpr,
                   FTZ: tl.constexpr, ACC16: tl.constexpr, FUSE_DELTA: tl.constexpr, HAS_OFP32: tl.constexpr):
    """dQ for BLOCK_M queries, looping over key tiles of BLOCK_N (= block_k where rounding is emulated); LPT:
    the launch order (_program). FUSE_DELTA (delta=dO_O; triton_launch.delta_form): this program computes its rows'
    delta itself, as the delta kernel would (_delta_rows, which loads its dO tile again), and stores
    it for the dK/dV kernel launched after it: the delta kernel's launch and pass over dO and O go. Else it reads
    DELTA."""
    start_m, off_bh = _program(LPT, True)
    off_b = off_bh // H
    off_h = off_bh % H
    GEMM_DT: tl.constexpr = tl.float32 if INPUT_F32 else tl.bfloat16
    # grad_acc in BF16 after every chunk: the accumulators in BF16 (_grad_add; the interpreter's cast truncates)
    ACC_DT: tl.constexpr = tl.bfloat16 if ACC16 and (_GRAD_ACC & ROUND) != 0 and not ONE_BLOCK and \
        not INTERP_DOT else tl.float32
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    q = tl.load(Q + off_b * sqb + off_h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None], other=0.0).to(GEMM_DT)
    do = tl.load(DO + off_b * sdb + off_h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd,
                 mask=row_ok[:, None], other=0.0).to(GEMM_DT)
    lse = tl.load(LSE + off_bh * T + offs_m, mask=row_ok, other=0.0)
    if FUSE_DELTA:
        delta = _delta_rows(DO + off_b * sdb + off_h * sdh, O + off_b * sob + off_h * soh, OFP32 + off_h, offs_m,
                            offs_d, row_ok, sdt, sdd, sot, sod, GEMM_DT, ROUND, HAS_OFP32)
        tl.store(DELTA + off_bh * T + offs_m, delta, mask=row_ok)
    else:
        delta = tl.load(DELTA + off_bh * T + offs_m, mask=row_ok, other=0.0)
    k_base = K + off_b * skb + off_h * skh + offs_d[None, :] * skd
    v_base = V + off_b * svb + off_h * svh + offs_d[None, :] * svd
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DT)
    hi = tl.minimum((start_m + 1) * BLOCK_M, T)
    mid = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N  # key tiles before mid lie wholly below the diagonal
    kp = KP + off_b * skpb
    lo1 = 0
    lo2 = mid
    if KEYPAD:  # key tiles before the first kept key: P = 0 for every row, skipped
        lo = tl.load(FIRST + off_b) // BLOCK_N * BLOCK_N
        lo1 = tl.minimum(lo, mid)
        lo2 = tl.maximum(lo, mid)
    tb = TIES + off_bh.to(tl.int64) * T * ntw  # CLAMP: this head's tie bits
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, skt, svt, offs_m, offs_n0, lo1, mid, T, scale, kp, tb, ntw,
                   BLOCK_N, ROUND, INPUT_F32, GEMM_DT, ONE_BLOCK, False, F32_DOT, KEYPAD, CLAMP, FTZ)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, skt, svt, offs_m, offs_n0, lo2, hi, T, scale, kp, tb, ntw,
                   BLOCK_N, ROUND, INPUT_F32, GEMM_DT, ONE_BLOCK, True, F32_DOT, KEYPAD, CLAMP, FTZ)
    dq = _grad_end(dq, ROUND, ONE_BLOCK)
    tl.store(DQ + off_b * sgb + off_h * sgh + offs_m[:, None] * sgt + offs_d[None, :] * sgd,
             _cast_out(dq, DQ), mask=row_ok[:, None])
