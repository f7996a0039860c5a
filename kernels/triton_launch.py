"""Launching the Triton kernels (kernels/triton_kernels.py): the ROUND bitmask per recipe and knobs, block sizes,
grids and arguments, and the forward and backward passes as plain functions (kernels/ops.py wraps them as
torch.library operators; kernels/triton_flash.py is the public face). Recipe semantics: kernels/triton_flash.py."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os

import torch

from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.launch_cache import Kernels, launch_mode
from flash_forensics.kernels.recipes import PV_POINTS, RECIPES, ROUNDING_POINTS, resolve
from flash_forensics.kernels.stochastic import call_key

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read at import: the kernels were built for it
KERNELS = ("_fwd_kernel", "_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")

try:  # Triton is optional: the emulator serves machines without it (kernels/triton_flash.py's supports() says so)
    from flash_forensics.kernels import triton_kernels as _jit
except ImportError:  # pragma: no cover - exercised only where triton is missing
    _jit = _k = None
else:  # the launches past Triton's per-call binding (kernels/launch_cache.py); the interpreter: Triton's own
    _k = Kernels(_jit, KERNELS, "jit" if _INTERPRET else launch_mode())


LAUNCH_ORDERS = ("by_kernel", "longest_first", "linear")
# the kernels' launch order (kernels/triton_kernels.py _program): longest first within sections of heads whose K
# and V take at most section_bytes together (FlashAttention-3 sizes its sections to 32 MB of L2 the same way), or
# linear: tile-major per head, as before. by_kernel (the default): longest first, but linear for the (kernel, recipe,
# head dim) launches of LINEAR_LAUNCHES
_order = {"lpt": True, "by_kernel": True, "section_bytes": 32 << 20}
# where linear beat longest first, on an H100 side by side: the D128 dK/dV kernel (B8 H16 T2048) took 643.3 us linear
# against 717.0 longest first (results/bench/gpu-h100-2026-12-06f/; 655 against 721 in gpu-h100-2026-12-06e), while
# at D64 longest first is ahead (T4096: 489.6 against 521.1 us) and so is every other D128 kernel. fa2's only: the
# other recipes' D128 dK/dV was not timed linear
LINEAR_LAUNCHES = frozenset({("dkdv", "fa2", 128)})


@contextlib.contextmanager
def launch_order(order: str, section_bytes: int = None):
    """The kernels launched in `order` within the scope: by_kernel (the default: longest first, linear where
    LINEAR_LAUNCHES says), longest_first (every kernel) or linear (tile 0 first, head by head, as before);
    section_bytes: longest first's section size. Speed only, every bit the same: the benchmarks time one against
    the other side by side, in one process."""
    if order not in LAUNCH_ORDERS:
        raise ValueError(f"order={order!r} is not allowed: expected one of {', '.join(LAUNCH_ORDERS)}")
    if section_bytes is not None and (not isinstance(section_bytes, int) or section_bytes < 1):
        raise ValueError(f"section_bytes={section_bytes!r} is not allowed: expected a positive int")
    saved = dict(_order)
    _order["lpt"] = order != "linear"
    _order["by_kernel"] = order == "by_kernel"
    if section_bytes is not None:
        _order["section_bytes"] = section_bytes
    try:
        yield
    finally:
        _order.update(saved)


REPEAT_TESTS = ("by_recipe", "top2", "count")
COUNTER_ATOMICS = ("relaxed", "acq_rel")
# how the forward's counters run (every count and bit the same either way: speed only). test: an unmasked key tile's
# repeated-max test by the row's two largest scores (top2) or by counting the scores that reach max - eps (count, as
# before); by_recipe (the default): count for COUNT_RECIPES, top2 for the rest. atomics: the end-of-program counter
# atomics without fences (relaxed, the default) or with Triton's acq_rel (before: a MEMBAR.ALL.GPU and a CCTL.IVALL
# around each of the four in sm_90 SASS). On an H100 side by side in one process (results/bench/gpu-h100-2026-12-06g/
# attention.json, the forward's kernel time): top2 took fa2's from 120.7 to 116.6 us at B16 T1024 and from 391.2 to
# 354.8 at B4 T4096, SFA's from 142.1 to 137.8 at T1024, but paper_bf16's from 150.9 to 166.2 at T1024 and from 482.5
# to 562.7 at T4096; relaxed atomics took fa2's from 122.6 to 116.6 at T1024 and from 477.5 to 444.3 at D128
# (B8 H16 T2048). A second process (b-attention.json, no D128) ranked every pair it timed the same way
COUNT_RECIPES = frozenset({"paper_bf16"})
_counter_form = {"test": "by_recipe", "relaxed": True}


@contextlib.contextmanager
def counter_form(test: str = "by_recipe", atomics: str = "relaxed"):
    """The forward's counters computed with `test` (REPEAT_TESTS) and `atomics` (COUNTER_ATOMICS) within the scope:
    the benchmarks time one form against another side by side, in one process."""
    if test not in REPEAT_TESTS:
        raise ValueError(f"counter test {test!r} is not allowed: expected one of {', '.join(REPEAT_TESTS)}")
    if atomics not in COUNTER_ATOMICS:
        raise ValueError(f"counter atomics {atomics!r} are not allowed: expected one of {', '.join(COUNTER_ATOMICS)}")
    saved = dict(_counter_form)
    _counter_form.update(test=test, relaxed=atomics == "relaxed")
    try:
        yield
    finally:
        _counter_form.update(saved)


ACCUMULATOR_FORMS = ("bf16", "fp32")
# Where a recipe stores O_acc, or dK / dV / dQ's running sums, in BF16 after every tile (paper_bf16's acc and
# grad_acc points), the kernels keep those accumulators as BF16 (bf16, the default): the same values in half the
# registers (compiled for sm_90, paper_bf16's dK/dV kernel went from 88 spilled bytes to none). fp32: as before.
# Speed only: every bit the same (the GPU tests compare the two forms). On an H100 side by side in one process
# (results/bench/gpu-h100-2026-12-06h/attention.json, kernel time): paper_bf16's fwd+bwd at B16 H12 T1024 D64 went
# from 680.6 to 531.0 us (dK/dV 299.6 -> 199.8, dQ 207.6 -> 161.8), at B4 T4096 from 2319.1 to 1730.8
_acc16 = [True]


def _form(kind: str, form: str, forms: tuple) -> str:
    """form, checked against forms: a wrong one names the kind, the value and what is allowed."""
    if form not in forms:
        raise ValueError(f"{kind} form {form!r} is not allowed: expected one of {', '.join(forms)}")
    return form


@contextlib.contextmanager
def _switch(flag: list, on: bool):
    """flag[0] = on within the scope (a one-element list the launchers read on every launch), restored after."""
    saved = flag[0]
    flag[0] = on
    try:
        yield
    finally:
        flag[0] = saved


def accumulator_form(form: str = "bf16"):
    """The kernels' accumulators within the scope: ACCUMULATOR_FORMS (bf16: BF16 where the recipe stores them so)."""
    return _switch(_acc16, _form("accumulator", form, ACCUMULATOR_FORMS) == "bf16")


SCORE_MAX_FORMS = ("scaled", "raw")
# how the forward takes an unmasked key tile's row max (kernels/triton_kernels.py _fwd_inner's RAW; every bit the
# same either way: speed only): scaled (the default, as always), the max of the scaled scores; raw, the max of the
# unscaled scores, scaled once per row, which drops a multiply per score where the scores are not stored in BF16 and
# the repeated-max test is not a count (fa2 and fp32, with or without the counters' top2 test). Compiled for sm_90 on
# a CPU (scripts/kernel_sass.py, B16 H12 T1024 D64) raw took fa2's forward from 1,920 to 1,824 instructions and the
# counters' from 2,360 to 2,320 (Triton 3.9, results/bench/kernel-sass-sm90-triton3.9-score-max.json; 1,888 -> 1,792
# and 2,392 -> 2,320 with Triton 3.6, the GPU image's), with as many FFMAs, but it also moves registers (fa2's
# 120 -> 128 with Triton 3.6) and spills (the counters' 8 -> 24 B). On an H100 its bits held (11 of 11 GPU cases)
# and it gained no time (results/bench/gpu-h100-2026-12-07b: fa2's kernels within 0.2%, 1.8% slower at D128): opt-in
_raw_max = [False]


def score_max_form(form: str = "raw"):
    """The forward's row max within the scope: SCORE_MAX_FORMS (raw: on the unscaled scores of an unmasked tile;
    scaled: the default's)."""
    return _switch(_raw_max, _form("score max", form, SCORE_MAX_FORMS) == "raw")


P1_FORMS = ("max", "scores")
# how the forward with counters and a stabilized softmax tests for a P̄ still 1 where the shift fired (sfa_p1_rows,
# _fwd_inner): max (the default), the row's largest P̄ rounded as P̄V reads it, r(max P̄) = max r(P̄) since round to
# nearest is monotone: one rounding a row; scores, every P̄ rounded again and their max taken (before 2026-12-07: a
# conversion a score beside the GEMM's own). Every count and bit the same either way (the interpreter's tests compare
# the two forms, and the default with the emulator; fa2 stabilized at beta 1.0001 fails both if the rounding is
# dropped; on the GPU, test_gpu_the_p1_forms_keep_every_bit). Compiled for sm_90
# on a CPU (scripts/kernel_sass.py, Triton 3.9, B16 H12 T1024 D64) max took fa2's stabilized forward with counters
# from 2,576 to 2,504 instructions, F2FP 80 -> 48, and its 32 B of spilled registers to none. Not timed yet
_p1_max = [True]


def p1_form(form: str = "max"):
    """The stabilized forward's test for a P̄ still 1 within the scope: P1_FORMS (max: the rounded row max, the
    default; scores: every P̄ rounded, as before)."""
    return _switch(_p1_max, _form("p1", form, P1_FORMS) == "max")


SCORE_GEMM_FORMS = ("inline", "ahead")
# where the forward issues a key tile's QK^T GEMM (kernels/triton_kernels.py _fwd_inner's AHEAD): inline (the default,
# as always), at the top of the tile's own iteration, so the tensor cores wait while the softmax runs; ahead, one
# tile early: the next tile's QK^T is issued before this tile's softmax, so the GEMM runs beside it (FlashAttention-3's
# intra-warpgroup overlap), at the cost of a second S tile's registers. The same GEMMs on the same operands, the same
# softmax after them: every bit the same either way. Square tiles only (the masked range is then the one diagonal
# tile, whose QK^T the unmasked loop's last iteration issues); other tiles launch inline. The next tile's keys are
# read without a mask, rows past T clamped to the last key (their scores are masked after, as before), so the loop's
# loads stay unpredicated. Compiled for sm_90 with Triton 3.6 (scripts/
# kernel_sass.py, results/bench/kernel-sass-sm90-triton3.6-score-gemm.json) fa2's forward runs 26 of a tile's exps
# under the GEMM at 142 registers (3 programs an SM, 4 inline); not yet timed on a GPU: opt-in
_qk_ahead = [False]


def score_gemm_form(form: str = "ahead"):
    """Where the forward issues each key tile's QK^T within the scope: SCORE_GEMM_FORMS (inline: the default)."""
    return _switch(_qk_ahead, _form("score gemm", form, SCORE_GEMM_FORMS) == "ahead")


def score_gemm_ahead(knobs: AttentionKnobs, block_m: int, block_n: int) -> bool:
    """Whether a forward launched in the scope with these tiles issues its QK^T GEMMs ahead (the kernel's AHEAD_ON:
    the form, the online path and square tiles)."""
    return _qk_ahead[0] and bool(knobs.tiling) and block_m == block_n


DELTA_FORMS = ("fused", "kernel")
# where the backward computes delta = rowsum(r(dO*O)) (delta=dO_O): fused (the default), in the dQ kernel, which then
# launches before the dK/dV kernel and stores delta for it (reading O beside the dO it reads anyway), or kernel: its
# own launch first, as before (one launch more, with its own pass over dO and O). Fused only where the dQ kernel's
# query tile and warps are the delta kernel's, so that its rows are summed in the same layout and order
# (_delta_rows; compiled for sm_90 the two reductions have one layout, tests/unit/test_kernel_sass.py); delta=dP_P /
# recompute_fp32 keep the delta kernel. On an H100 side by side (results/bench/gpu-h100-2026-12-07f/attention.json,
# kernel time) the delta kernel's 20.6 us went and the dQ kernel took 6.4 more: fa2's fwd+bwd 388.0 -> 376.5 us at
# B16 H12 T1024 D64, 1129.2 -> 1112.9 at B4 T4096, 1528.1 -> 1507.7 at D128 T2048; paper_bf16's 540.0 -> 524.9 at
# T1024; every bit the same (its GPU test, 20 cases, and the 17 kernel-bits cases against the record made before it)
_delta_fused = [True]


def delta_form(form: str = "fused"):
    """Where the backward computes delta within the scope: DELTA_FORMS (fused: in the dQ kernel where it can)."""
    return _switch(_delta_fused, _form("delta", form, DELTA_FORMS) == "fused")


def repeat_test(recipe: str) -> str:
    """The repeated-max test a launch of `recipe` uses in the scope: top2 or count."""
    test = _counter_form["test"]
    if test == "by_recipe":
        return "count" if recipe in COUNT_RECIPES else "top2"
    return test


EXP_INSTRUCTIONS = ("ex2_approx", "ex2_approx_ftz")


def exp_instruction_env() -> str:
    """FF_TRITON_EXP (default ex2_approx), validated: a wrong value names the variable, the value and what is
    allowed."""
    name = os.environ.get("FF_TRITON_EXP", "ex2_approx")
    if name not in EXP_INSTRUCTIONS:
        raise ValueError(f"FF_TRITON_EXP={name!r} is not allowed: expected one of {', '.join(EXP_INSTRUCTIONS)}")
    return name


# exp's instruction in every kernel (kernels/triton_kernels.py _exp): ex2_approx, tl.exp's (with its denormal
# fix-up), or ex2_approx_ftz (no fix-up; results below 2^-126 flushed to 0): 5-7% off fa2's kernels on an H100, but
# where logits reach exp's denormals it moves gradient bits (scripts/kernel_bits.py --exp; results/bench/
# gpu-h100-2026-12-06e/), so it is opt-in. FF_TRITON_EXP sets the process's, exp_instruction() a scope's. A list:
# the launchers read _exp_ftz[0] on every launch
_exp_ftz = [exp_instruction_env() == "ex2_approx_ftz"]


def exp_instruction(name: str):
    """Every kernel launched in the scope evaluates exp with `name` (EXP_INSTRUCTIONS): the benchmarks time
    ex2_approx_ftz against tl.exp's ex2_approx side by side, in one process."""
    if name not in EXP_INSTRUCTIONS:
        raise ValueError(f"exp instruction {name!r} is not allowed: expected one of {', '.join(EXP_INSTRUCTIONS)}")
    return _switch(_exp_ftz, name == "ex2_approx_ftz")


REGISTER_KERNELS = ("fwd", "dkdv", "dq")
# caps on a kernel's registers per thread (Triton's maxnreg) where one more program then fits on an SM and an H100
# measured it faster, side by side (results/bench/gpu-h100-2026-12-06f/, B16 H12 T1024 and B4 H12 T4096, D64):
#   the counters' forward (fa2, fa2 + stabilized softmax, paper_bf16): 145-167 registers, 3 programs per SM; at 128
#   (4 programs, 8-56 spilled bytes) 142.2 -> 128.0 us (fa2), 173.0 -> 151.8 (SFA), 167.4 -> 155.6 (paper_bf16)
#   at T1024, 410.1 -> 382.5, 520.2 -> 460.0, 520.2 -> 485.8 at T4096;
#   paper_bf16's dK/dV: 216 -> 168 registers (2 -> 3 programs): 306.1 -> 296.8 us, 1107.7 -> 1082.4;
#   with the counters' top2 test (gpu-h100-2026-12-06g) fa2's capped forward still led: 116.6 against 125.9 us;
#   experiment=paper_1gpu's forward (128x128 tiles, launched (64, 128, 4, 2)): 214 registers, 2 programs per SM; at
#   168 (3 programs, 80 spilled bytes) 214.5 -> 174.4 and 214.8 -> 173.8 us a call in two GPT-2S training runs
#   (gpu-h100-2026-12-06i, B16 T1024, every loss bit for bit).
# Not capped: fa2's dK/dV (157 -> 128 was 1.6% and 5% slower), and every D128 kernel (a cap there spills hundreds
# of bytes: dK/dV 5x slower). A cap should move registers, never an operation: compiled for sm_90 each has the same
# floating-point instructions as no cap, counted with their modifiers (tests/unit/test_kernel_sass.py), and on an H100
# the kernel-bits cases with the caps were bit for bit the record without them (results/bench/gpu-h100-2026-12-06g/).
# Keyed on the launch as measured: (kernel, recipe, softmax, head dim, launch config), the knobs otherwise their
# defaults with the counters on, no probe, no key padding (the tiles block_q / block_k aside: the launch config holds
# the ones a launch sees)
REGISTER_TABLE = {
    ("fwd", "fa2", "safe", 64, (64, 64, 4, 3)): 128,
    ("fwd", "fa2", "stabilized", 64, (64, 64, 4, 3)): 128,
    ("fwd", "paper_bf16", "safe", 64, (64, 64, 4, 3)): 128,
    ("fwd", "paper_bf16", "safe", 64, (64, 128, 4, 2)): 168,  # experiment=paper_1gpu's
    ("dkdv", "paper_bf16", "safe", 64, ((64, 64), (64, 64), 4, 3)): 168,
    # its 2-stage launch (SHAPE_TABLE's paper_bf16_64x64 backward at T > 256): compiled for sm_90 (Triton 3.9), 172
    # registers and 2 programs per SM, at 168 3 (8 spilled bytes, as the 3-stage launch under its cap); timed only
    # with the cap (tune.py --regs)
    ("dkdv", "paper_bf16", "safe", 64, ((64, 64), (64, 64), 4, 2)): 168,
}
# register_limit's caps for the scope (a kernel mapped to None: no cap, ptxas's own choice)
_maxnreg: dict = {}
_CAP_OF: dict = {}  # (id(knobs), kernel) -> (knobs, whether REGISTER_TABLE's measured knobs are these)


@contextlib.contextmanager
def register_limit(**caps):
    """Every launch in the scope of a kernel named in `caps` (REGISTER_KERNELS: fwd, dkdv, dq) compiled with at most
    that many registers per thread (an int from 24 to 255), or, for None, with as many as ptxas chooses (no
    REGISTER_TABLE cap): the benchmarks time a cap against ptxas's own choice side by side, in one process."""
    for name, n in caps.items():
        if name not in REGISTER_KERNELS:
            raise ValueError(f"register_limit kernel {name!r} is not allowed: expected one of "
                             f"{', '.join(REGISTER_KERNELS)}")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 24 <= n <= 255):
            raise ValueError(f"register_limit {name}={n!r} is not allowed: expected an int from 24 to 255, or None")
    saved = dict(_maxnreg)
    _maxnreg.update(caps)
    try:
        yield
    finally:
        _maxnreg.clear()
        _maxnreg.update(saved)


def register_cap(kernel: str, knobs: AttentionKnobs, D: int, config, plain: bool):
    """The launch's cap on registers per thread: register_limit's for the scope, else REGISTER_TABLE's where this
    launch is one it measured (`plain`: the forward with its counters on and no probe, or a backward; either without
    key padding), else None."""
    if kernel in _maxnreg:
        return _maxnreg[kernel]
    n = REGISTER_TABLE.get((kernel, knobs.recipe, knobs.softmax, D, config))
    if n is None or not plain:
        return None
    # whether these knobs are the measured ones: 30 fields compared (6 us) once per knobs object, not per launch.
    # The cache holds the knobs, so their id is not reused; knobs changed in place after a launch could keep a stale
    # cap, which moves speed only
    hit = _CAP_OF.get((id(knobs), kernel))
    if hit is None or hit[0] is not knobs:
        like = AttentionKnobs(recipe=knobs.recipe, softmax=knobs.softmax, backend="triton", counters=True)
        same = dataclasses.replace(knobs, beta=like.beta, eps=like.eps, backend="triton", counters=True,
                                   block_q=like.block_q, block_k=like.block_k) == like
        # (beta and eps are runtime arguments; the backward has no counters; the config holds the tiles)
        hit = (knobs, same)
        if len(_CAP_OF) < 4096:
            _CAP_OF[(id(knobs), kernel)] = hit
    return n if hit[1] else None


def _regs(n) -> dict:
    """The launch's maxnreg keyword for cap n (none for None: Triton's default)."""
    return {} if n is None else {"maxnreg": n}


@functools.lru_cache(maxsize=256)
def section_heads(BH: int, most: int) -> int:
    """The largest divisor of BH that is at most `most` (at least 1): a section's heads, so that every section is
    whole and the grid needs no program that does nothing."""
    return max(d for d in range(1, min(BH, max(1, most)) + 1) if BH % d == 0)


def _linear(kernel: str, recipe: str, D: int) -> bool:
    """Whether the scope launches this kernel linearly: launch_order("linear"), or by_kernel's LINEAR_LAUNCHES."""
    return not _order["lpt"] or (_order["by_kernel"] and (kernel, recipe, D) in LINEAR_LAUNCHES)


def _grid(n_tiles: int, BH: int, kv, kernel: str = None, recipe: str = None):
    """(grid, LPT) of `kernel` of `recipe` over n_tiles tiles of B*H heads in the scope's launch order; kv: a K or V
    tensor (its length, head dim and element size give a head's K and V bytes, which bound a section's heads).
    longest_first: (heads of a section, tiles, sections), kernels/triton_kernels.py _program; linear: (tiles, heads),
    as before; by_kernel: linear for LINEAR_LAUNCHES' (kernel, recipe, head dim) launches."""
    T, D = kv.shape[-2], kv.shape[-1]
    if _linear(kernel, recipe, D):
        return (n_tiles, BH), False
    g = section_heads(BH, _order["section_bytes"] // (2 * T * D * kv.element_size()))
    return (g, n_tiles, BH // g), True


@contextlib.contextmanager
def triton_own_launch():
    """Every kernel launched in the scope goes through Triton's own `fn[grid]` (FF_TRITON_LAUNCH=jit), whatever the
    process's mode: the benchmarks time the launch cache against it side by side, in one process."""
    global _k
    saved = _k
    if _k is not None:  # (no triton: nothing launches)
        _k = Kernels(_jit, KERNELS, "jit")
    try:
        yield
    finally:
        _k = saved

RECIPE_IDS = {"fp32": 0, "fa2": 1, "paper_bf16": 2}
DELTA_IDS = {"dO_O": 0, "dP_P": 1, "recompute_fp32": 2}
HEAD_DIMS = (16, 32, 64, 128)
TILE_SIZES = (16, 32, 64, 128)


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


# exp_form=exp2_folded runs on unscaled scores and an unscaled running max: the kernels fold it only where neither is
# stored in BF16 (the emulator rounds the unscaled values there), and on the online path (tiling)
_FOLD_REFUSED = _bits("scores", "shift", "stats")


def fold_supported(knobs: AttentionKnobs) -> bool:
    """Whether the forward computes exp_form=exp2_folded for these knobs (else the emulator does)."""
    return bool(knobs.tiling) and not round_mask(knobs) & _FOLD_REFUSED


_RECIPE_MASK = {name: _bits(*resolve(name).rounded()) for name in RECIPES}
_PV_MASK = _bits(*PV_POINTS)


def round_mask(knobs: AttentionKnobs) -> int:
    """The kernels' ROUND constexpr: bit i set = ROUNDING_POINTS[i] stored in BF16, i.e.
    flash_forensics.kernels.recipes.for_knobs(knobs).rounded() as bits (tests check the two agree). Plain integer work,
    so that torch.compile traces it without a graph break (it runs per call, building the ops' arguments)."""
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
    # fp32 with fp32_gemm=tf32x3: tensor-core dots on FP32 tiles (twice BF16's shared memory per tile): not tuned
    # yet; benchmarks/fp32_reference.py times it beside paper_bf16
    "fp32_tc": {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 64, 8, 2)},
}
BWD_TABLE = {
    "fa2": {16: (32, 64, 64, 32, 4, 3), 32: (32, 64, 64, 32, 4, 3), 64: (32, 64, 64, 32, 4, 3),
            128: (64, 64, 64, 64, 4, 2)},
    "paper_bf16": {16: (32, 64, 64, 32, 4, 3), 32: (32, 64, 64, 32, 4, 3), 64: (64, 64, 64, 64, 4, 3),
                   128: (64, 64, 64, 64, 4, 2)},
    "fp32": {16: (32, 32, 32, 32, 4, 2), 32: (32, 32, 32, 32, 4, 2), 64: (32, 32, 32, 32, 4, 2),
             128: (32, 32, 32, 32, 8, 2)},
    "fp32_tc": {16: (32, 64, 64, 32, 4, 2), 32: (32, 64, 64, 32, 4, 2), 64: (32, 64, 64, 32, 4, 2),
                128: (32, 64, 64, 32, 8, 2)},
}
SHAPE_TABLE: dict = {  # ("fwd" | "bwd", family, D, length class) -> config tuple, as above
    ("fwd", "fp32", 64, "short"): (16, 32, 4, 2),
    # experiment=paper_1gpu's tiles (table_family): 2 pipeline stages instead of 3. On an H100 (2026-12-06, two tune
    # runs on CUDA graphs, results/bench/gpu-h100-2026-12-06c/) the backward took 0.555-0.560 ms instead of
    # 0.696-0.697 and the forward 0.229 instead of 0.230-0.233; the kernel-bits cases and the preset's first steps
    # stayed bit for bit, and a GPT-2S step ran 2.9-3.3% more tokens/s with the same losses.
    ("fwd", "paper_bf16_128x128", 64, "long"): (64, 128, 4, 2),
    ("bwd", "paper_bf16_128x128", 64, "long"): (128, 64, 64, 128, 4, 2),
    # paper_bf16 at its default 64x64 tiles: the backward with 2 stages too. Its dQ kernel then takes 48 KB of shared
    # memory instead of 64, so 4 programs fit on an SM instead of 3; its dK/dV kernel keeps 3 under REGISTER_TABLE's
    # 168. On an H100 (2026-12-07, results/bench/gpu-h100-2026-12-07e/tune-paper_bf16-*.json, benchmarks/tune.py
    # --regs fwd=128,dkdv=168, CUDA graphs, two runs) delta + dK/dV + dQ took 387.7 and 384.2 us at B16 H12 T1024
    # against 390.8 and 391.6 with 3 stages, 1233.1 against 1269.5 at B4 T4096; the outputs bit for bit the 3-stage
    # launch's, and the 17 kernel-bits cases with it bit for bit the H100 record (kernel_bits_vs_ref-stages2.log).
    # T <= 256 ("short") was not timed: 3 stages there
    ("bwd", "paper_bf16_64x64", 64, "long"): (64, 64, 64, 64, 4, 2),
    ("bwd", "paper_bf16_64x64", 64, "xlong"): (64, 64, 64, 64, 4, 2),
}


def length_class(T: int) -> str:
    """Short sequences (mini_repro's 256) fill the GPU with fewer, smaller programs: tuned apart from long ones; from
    T = 4096 the GPU, not the host, sets the time at every batch size benchmarked: tuned apart again ("xlong")."""
    return "short" if T <= 256 else "xlong" if T >= 4096 else "long"


def key_tile_knobs(knobs: AttentionKnobs) -> bool:
    """Whether a set knob acts per key tile of block_k: either stabilized softmax (the tile whose max repeats),
    the counters, pbar_clamp (the same tile) and stochastic_round (its stream ids name the tile)."""
    return knobs.softmax != "safe" or bool(knobs.counters or knobs.pbar_clamp or knobs.stochastic_round)


def fwd_family(knobs: AttentionKnobs) -> str:
    if knobs.recipe == "fp32":
        return "fp32_tc" if knobs.fp32_gemm == "tf32x3" else "fp32"
    if knobs.recipe == "paper_bf16":
        return knobs.recipe
    exact_n = knobs.tiling and key_tile_knobs(knobs)
    return "fa2_exact" if exact_n else "fa2"


def bwd_family(knobs: AttentionKnobs) -> str:
    return "fp32_tc" if knobs.recipe == "fp32" and knobs.fp32_gemm == "tf32x3" else knobs.recipe


def table_family(fam: str, knobs: AttentionKnobs) -> str:
    """The SHAPE_TABLE family of a launch. paper_bf16 with tiling fixes the forward's key tile and the backward's
    dK/dV query tile and dQ key tile to block_q / block_k, so the rest of its configuration is tuned per tile size:
    the tiles are in the name (paper_bf16_128x128: experiment=paper_1gpu's), and a choice made at one tile size
    never moves another's launch."""
    if fam == "paper_bf16" and knobs.tiling:
        return f"paper_bf16_{knobs.block_q}x{knobs.block_k}"
    return fam


def _table(kind: str, fam: str, knobs: AttentionKnobs, D: int, T: int):
    """SHAPE_TABLE's entry for this launch: the tile-size family's, else the family's, else None."""
    lc = length_class(T)
    return SHAPE_TABLE.get((kind, table_family(fam, knobs), D, lc)) or SHAPE_TABLE.get((kind, fam, D, lc))


def load_shape_table(path) -> dict:
    """Put a tune JSON's chosen configs (benchmarks/tune.py, or an attention JSON made with --tune) into
    SHAPE_TABLE. They are speed-only: the launcher still sets every block size a recipe's meaning fixes."""
    import json
    try:
        with open(path) as f:
            data = json.load(f)
        table = data["shape_table"] if "shape_table" in data else data["tuning"]["shape_table"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"launch table {path!r} is not allowed: expected a tune JSON with a shape_table "
                         f"(benchmarks/tune.py --out): {type(e).__name__}: {e}") from None
    _add_entries(table)
    return table


def _add_entries(table: dict) -> None:
    """A tune JSON's shape_table ("kind/family/D/length" -> config list) into SHAPE_TABLE."""
    for key, cfg in table.items():
        kind, fam, D, length = key.split("/")
        SHAPE_TABLE[(kind, fam, int(D), length)] = tuple(cfg)


@contextlib.contextmanager
def shape_table_scope(table: dict):
    """SHAPE_TABLE with `table`'s entries (tune JSON keys, "kind/family/D/length") added for the duration: a
    benchmark times a tuned launch beside the default one in one process."""
    saved = dict(SHAPE_TABLE)
    _add_entries(table)
    try:
        yield
    finally:
        SHAPE_TABLE.clear()
        SHAPE_TABLE.update(saved)


if os.environ.get("FF_LAUNCH_TABLE"):  # a tune JSON's choices for this process (checked by the lease's bit tests)
    load_shape_table(os.environ["FF_LAUNCH_TABLE"])


def _fwd_blocks(knobs: AttentionKnobs, D: int, T: int = 1024):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward."""
    fam = fwd_family(knobs)
    block_m, free_n, warps, stages = _table("fwd", fam, knobs, D, T) or FWD_TABLE[fam][D]
    # the key tile is the unit Algorithm 3, the counters and BF16 rescaling roundings (paper_bf16's) see
    exact_n = knobs.tiling and (fam in ("fa2_exact", "paper_bf16") or key_tile_knobs(knobs)
                                or bool(round_mask(knobs) & _FWD_TILED))
    block_n = knobs.block_k if exact_n else free_n
    if _interpret():
        block_m, block_n = 16, (block_n if exact_n else 16)
    return block_m, block_n, warps, stages


def _bwd_blocks(knobs: AttentionKnobs, D: int, T: int = 1024):
    """((dkdv BLOCK_M, BLOCK_N), (dq BLOCK_M, BLOCK_N), num_warps, num_stages) of the backward passes."""
    fam = bwd_family(knobs)
    m1, n1, m2, n2, warps, stages = _table("bwd", fam, knobs, D, T) or BWD_TABLE[fam][D]
    if knobs.tiling and round_mask(knobs) & _BWD_TILED:  # BF16 chunks / accumulators rounded per emulator tile
        m1, n2 = knobs.block_q, knobs.block_k
    elif _interpret():
        m1, n2 = 16, 16
    if _interpret():
        n1, m2 = 16, 16
    return (m1, n1), (m2, n2), warps, stages


def _delta_blocks(knobs: AttentionKnobs):
    """(BLOCK_M, BLOCK_N) of the delta kernel (4 warps)."""
    if _interpret():
        return 16, 16
    return (32, 32) if knobs.recipe == "fp32" and knobs.fp32_gemm == "ieee" else (64, 64)


def fuses_delta(knobs: AttentionKnobs, D: int, T: int) -> bool:
    """Whether the dQ kernel computes delta in the scope's delta_form: delta=dO_O, and its query tile and warps are
    the delta kernel's (the same rows summed in the same layout)."""
    (_, (m2, _), warps, _) = _bwd_blocks(knobs, D, T)
    return _fuses(knobs, m2, warps, _delta_blocks(knobs)[0])


def _fuses(knobs: AttentionKnobs, m2: int, warps: int, dbm: int) -> bool:
    """fuses_delta for a launch whose dQ tile (m2), warps and delta tile (dbm) are known (the backward's own)."""
    return _delta_fused[0] and knobs.delta == "dO_O" and m2 == dbm and warps == 4


def launch_config(knobs: AttentionKnobs, D: int, T: int) -> dict:
    """What the kernels launch for these knobs at head dim D, length T (benchmarks record it), in the scope's launch
    order and register caps (maxnreg: None where ptxas chooses; the forward's as a call without probe or key padding
    launches it)."""
    bm, bn, fw, fs = _fwd_blocks(knobs, D, T)
    (m1, n1), (m2, n2), bw, bs = _bwd_blocks(knobs, D, T)
    cfg = ((m1, n1), (m2, n2), bw, bs)

    def order(kernel):
        return "linear" if _linear(kernel, knobs.recipe, D) else "longest_first"
    form = dict(test=repeat_test(knobs.recipe),
                atomics="relaxed" if _counter_form["relaxed"] else "acq_rel") if knobs.counters else None
    acc = ACCUMULATOR_FORMS[0] if _acc16[0] else ACCUMULATOR_FORMS[1]
    return dict(fwd=dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=fw, num_stages=fs, order=order("fwd"),
                         maxnreg=register_cap("fwd", knobs, D, (bm, bn, fw, fs), bool(knobs.counters)),
                         counters=form, accumulators=acc, score_max="raw" if _raw_max[0] else "scaled",
                         p1=("max" if _p1_max[0] else "scores") if knobs.counters and
                         knobs.softmax in ("stabilized", "stabilized_guarded") else None,
                         score_gemm="ahead" if score_gemm_ahead(knobs, bm, bn) else "inline"),
                bwd=dict(dkdv=[m1, n1], dq=[m2, n2], num_warps=bw, num_stages=bs, accumulators=acc,
                         delta="fused" if fuses_delta(knobs, D, T) else "kernel",
                         order=dict(dkdv=order("dkdv"), dq=order("dq")),
                         maxnreg=dict(dkdv=register_cap("dkdv", knobs, D, cfg, True),
                                      dq=register_cap("dq", knobs, D, cfg, True))))


def _strides(x):
    return tuple(x.stride())


_DEVICE_CACHE: dict = {}


def _cdiv(a: int, b: int) -> int:
    """Host-side ceil division (triton.cdiv is a jit function: ~10 us a call through its dispatch on the host)."""
    return -(-a // b)


# the launchers' dummy pointers (an argument a launch does not read still needs a tensor): (shape, dtype) by name
CONSTANTS = {"kp": ((1,), torch.uint8), "first": ((1,), torch.int32), "rep": ((1,), torch.int64),
             "maxl": ((1,), torch.float32), "scratch": ((1,), torch.int64), "ties": ((1,), torch.uint8),
             "srkey": ((), torch.int64)}


def _const(name: str, dev) -> torch.Tensor:
    """CONSTANTS[name] on `dev`, made once per device: no allocation per call."""
    t = _DEVICE_CACHE.get((name, dev))
    if t is None:
        shape, dtype = CONSTANTS[name]
        t = _DEVICE_CACHE[(name, dev)] = torch.zeros(shape, device=dev, dtype=dtype)
    return t


def prepare_device(dev) -> None:
    """Every CONSTANTS tensor made on `dev` now (a GPT layer moved to `dev` calls it: models/attention.py
    prepare_device), outside any CUDA graph: made by a compiled step's first run under mode="reduce-overhead", they
    would live in that graph's memory pool."""
    for name in CONSTANTS:
        _const(name, torch.device(dev))


def _rows_per_head(T: int, knobs: AttentionKnobs) -> int:
    """(query row, key tile) pairs one head visits per batch element, as AttnStats.rows_seen counts them. Eager: a
    cached loop over tiles, once per shape; traced (dynamo would warn on the cache wrapper): computed, a constant."""
    key = (int(T), bool(knobs.tiling), int(knobs.block_q), int(knobs.block_k))
    return _rows_per_head_of(*key) if torch.compiler.is_compiling() else _rows_cached(*key)


def _rows_per_head_of(T: int, tiling: bool, block_q: int, block_k: int) -> int:
    if not tiling:
        return T
    bq, bk = min(block_q, T), min(block_k, T)
    return sum((min(qs + bq, T) - qs) * -(-min(qs + bq, T) // bk) for qs in range(0, T, bq))


_rows_cached = functools.lru_cache(maxsize=1024)(_rows_per_head_of)


def key_padding(key_keep, B: int, T: int, dev):
    """(KP, FIRST, KEYPAD) for the kernels: key_keep (1 or B, T) bool / int8 / uint8 (nonzero = attend), or None.

    KP (B, T) uint8, FIRST (B,) int32 the first kept key of each batch element (T where none is kept: every row
    has no key). Device ops only (no sync). None: dummies and KEYPAD=False (the kernels without key masks)."""
    if key_keep is None:
        return _const("kp", dev), _const("first", dev), False
    if not isinstance(key_keep, torch.Tensor) or key_keep.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise ValueError(f"key_keep={getattr(key_keep, 'dtype', type(key_keep).__name__)} is not allowed: expected a "
                         "bool, int8 or uint8 tensor (B, T) or None")
    if key_keep.dim() != 2 or key_keep.shape[0] not in (1, B) or key_keep.shape[1] != T:
        raise ValueError(f"key_keep.shape={tuple(key_keep.shape)} is not allowed: expected (1 or {B}, {T})")
    if key_keep.device != dev:
        raise ValueError(f"key_keep.device={key_keep.device} is not allowed: expected q's device {dev}")
    keep = key_keep != 0
    kp = keep.expand(B, T).contiguous().view(torch.uint8)
    idx = torch.arange(T, device=dev, dtype=torch.int32)
    first = torch.where(keep, idx, torch.full((), T, device=dev, dtype=torch.int32)).amin(dim=1)
    return kp, first.expand(B).contiguous(), True


def empty_like_order(like: torch.Tensor, shape, dtype) -> torch.Tensor:
    """An empty (B, H, T, D) tensor in `like`'s memory order, as SDPA allocates its outputs: (B, T, H, D)-ordered
    when `like` is (the view of a fused QKV projection, `qkv.view(B, T, H, D).transpose(1, 2)`), contiguous otherwise.
    In (B, T, H, D) order the model's `O.transpose(1, 2)` to (B, T, H*D) and autograd's dQ/dK/dV back to the
    projection are views, not the strided copies (2 ms of a GPT-2S B16 T1024 step on an H200) they were when the
    kernels wrote (B, H, T, D). The kernels take strides, so only the address of each element changes. The ops' fake
    implementations call this too: compiled graphs must see the strides the kernels write."""
    B, H, T, D = shape
    if like.stride(1) < like.stride(2):
        return like.new_empty((B, T, H, D), dtype=dtype).transpose(1, 2)
    return like.new_empty((B, H, T, D), dtype=dtype)


def tie_words(T: int) -> int:
    """Bytes per query row of pbar_clamp's tie bits: 8 keys a byte, rows padded to whole 128-key tiles (every tile
    size divides 128, so a forward tile never writes past its row)."""
    return _cdiv(T, 128) * 16


def tie_buffer(knobs: AttentionKnobs, q) -> torch.Tensor:
    """pbar_clamp's tie bits (B, H, T, tie_words(T)) uint8, zeroed (tiles the forward skips have no tie), or an empty
    tensor when the knob is off (the ops' third output: what the backward reads)."""
    B, H, T, _ = q.shape
    if not knobs.pbar_clamp:
        return torch.empty(0, device=q.device, dtype=torch.uint8)
    return torch.zeros((B, H, T, tie_words(T)), device=q.device, dtype=torch.uint8)


def sr_key(knobs: AttentionKnobs, q, k, v) -> torch.Tensor:
    """stochastic_round's call key, () int64 on the device: kernels/stochastic.py call_key of the seed and of q, k, v
    as the emulator's kernel stores them (BF16 for the BF16 recipes), so both draw the same bits. No host sync."""
    xs = (q, k, v) if knobs.recipe == "fp32" else tuple(x.to(torch.bfloat16) for x in (q, k, v))
    return call_key(int(knobs.sr_seed), *xs)


def _forward(q, k, v, knobs: AttentionKnobs, rep=None, maxl=None, probe: bool = False, under=None, key_keep=None,
             p1=None, ties=None):
    """Launch the forward: (O stored for delta, lse, pmax, fired); pmax/fired only if probe.

    rep (H,) int64 / maxl () float32: the counters the kernel adds into (atomics, one per program); None: off.
    under (H,) int64: rows whose row sum underflowed (AttnStats.underflow_rows), counted with rep; None: a scratch
    counter (callers that predate it). p1 (H,) int64: AttnStats.sfa_p1_rows, the same way.
    key_keep (1 or B, T): keys masked on top of causality (key_padding); rows with no key get O = 0, lse = +inf.
    ties: pbar_clamp's tie bits (tie_buffer), written for the backward; None: a scratch buffer."""
    B, H, T, D = q.shape
    dev = q.device
    kp, first, keypad = key_padding(key_keep, B, T, dev)
    mask = round_mask(knobs)
    ofp32, has_ofp32 = _ofp32_flags(knobs, H, dev)
    o = empty_like_order(q, (B, H, T, D), saved_o_dtype(mask, knobs.fp32_o_heads(H)))
    lse = torch.empty((B, H, T), device=dev, dtype=torch.float32)
    counters = rep is not None
    if not counters:  # unused pointers still need a tensor
        rep, maxl = _const("rep", dev), _const("maxl", dev)
    if under is None:  # counters off: never written; on without one: a scratch the kernel adds into
        under = torch.zeros(H, device=dev, dtype=torch.int64) if counters else _const("scratch", dev)
    if p1 is None:
        p1 = torch.zeros(H, device=dev, dtype=torch.int64) if counters else _const("scratch", dev)
    clamp = bool(knobs.pbar_clamp)
    if clamp and ties is None:
        ties = tie_buffer(knobs, q)
    if not clamp:
        ties = _const("ties", dev)
    key = sr_key(knobs, q, k, v) if knobs.stochastic_round else _const("srkey", dev)
    if probe:
        pmax = torch.zeros((B, H, T), device=dev, dtype=torch.float32)
        fired = torch.zeros((B, H, T), device=dev, dtype=torch.int32)
    else:
        pmax = fired = lse
    bm, bn, warps, stages = _fwd_blocks(knobs, D, T)
    grid, lpt = _grid(_cdiv(T, bm), B * H, k, "fwd", knobs.recipe)
    cap = register_cap("fwd", knobs, D, (bm, bn, warps, stages), counters and not probe and not keypad)
    sr_bq = min(knobs.block_q, T) if knobs.tiling else T  # the emulator's query tile (stochastic_round's streams)
    _k._fwd_kernel[grid](q, k, v, o, lse, rep, maxl, under, p1, ofp32, pmax, fired, kp, first, ties, key,
                      *_strides(q), *_strides(k), *_strides(v), *_strides(o), kp.stride(0),
                      H, T, 1.0 / math.sqrt(D), float(knobs.beta), float(knobs.eps), float(knobs.beta) - 1.0,
                      tie_words(T), sr_bq, float(1.0 / math.sqrt(D) * 1.4426950408889634),
                      HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, ROUND=mask, INPUT_F32=knobs.recipe == "fp32",
                      FLOOR=knobs.recipe == "paper_bf16", STABILIZED=knobs.softmax == "stabilized",
                      COUNTERS=counters, HAS_OFP32=has_ofp32, ONE_BLOCK=not knobs.tiling,
                      PROBE=probe, F32_DOT=knobs.fp32_gemm, KEYPAD=keypad,
                      GUARDED=knobs.softmax == "stabilized_guarded", CLAMP=clamp, SR=bool(knobs.stochastic_round),
                      FOLD=knobs.exp_form == "exp2_folded", LPT=lpt, FTZ=_exp_ftz[0],
                      TOP2=repeat_test(knobs.recipe) == "top2", RELAXED=_counter_form["relaxed"], ACC16=_acc16[0],
                      RAWMAX=_raw_max[0], P1MAX=_p1_max[0], AHEAD=_qk_ahead[0], num_warps=warps,
                      num_stages=stages, **_regs(cap))
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


def _backward(do, q, k, v, o, lse, knobs: AttentionKnobs, key_keep=None, ties=None):
    """Launch the backward (delta, dK/dV, dQ): (dq, dk, dv) in the inputs' dtypes; key_keep as the forward's; ties:
    the forward's tie bits (pbar_clamp; required then)."""
    B, H, T, D = q.shape
    kp, first, keypad = key_padding(key_keep, B, T, q.device)
    clamp = bool(knobs.pbar_clamp)
    if clamp and (ties is None or tuple(ties.shape) != (B, H, T, tie_words(T))):
        raise ValueError(f"ties={None if ties is None else tuple(ties.shape)} is not allowed: expected the forward's "
                         f"tie bits of shape {(B, H, T, tie_words(T))} (pbar_clamp)")
    if not clamp:
        ties = _const("ties", q.device)
    ntw = tie_words(T)
    mask, f32_in = round_mask(knobs), knobs.recipe == "fp32"
    scale = 1.0 / math.sqrt(D)
    ofp32, has_ofp32 = _ofp32_flags(knobs, H, q.device)
    (m1, n1), (m2, n2), warps, stages = _bwd_blocks(knobs, D, T)
    delta = torch.empty_like(lse)
    dq = empty_like_order(q, (B, H, T, D), q.dtype)  # gradients in the inputs' dtypes and memory orders
    dk = empty_like_order(k, (B, H, T, D), k.dtype)
    dv = empty_like_order(k, (B, H, T, D), v.dtype)  # k's order: the dK/dV kernel writes both with dK's strides
    dbm, dbn = _delta_blocks(knobs)
    fused = _fuses(knobs, m2, warps, dbm)  # (the blocks above: not looked up again per call)
    if not fused:
        grid, lpt = _grid(_cdiv(T, dbm), B * H, k)
        _k._bwd_delta_kernel[grid](
            q, k, v, o, do, lse, delta, ofp32, kp, first, ties,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do), kp.stride(0),
            H, T, scale, ntw, HEAD_DIM=D, BLOCK_M=dbm, BLOCK_N=dbn, ROUND=mask, INPUT_F32=f32_in,
            DELTA_MODE=DELTA_IDS[knobs.delta], HAS_OFP32=has_ofp32, F32_DOT=knobs.fp32_gemm, KEYPAD=keypad,
            CLAMP=clamp, LPT=lpt, FTZ=_exp_ftz[0], num_warps=4)
    cfg = ((m1, n1), (m2, n2), warps, stages)
    # dQ first: fused, it stores the delta the dK/dV kernel reads (the stream orders the two)
    grid, lpt = _grid(_cdiv(T, m2), B * H, k, "dq", knobs.recipe)
    _k._bwd_dq_kernel[grid](
        q, k, v, do, lse, delta, dq, kp, first, ties, o, ofp32,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), *_strides(o), kp.stride(0),
        H, T, scale, ntw, HEAD_DIM=D, BLOCK_M=m2, BLOCK_N=n2, ROUND=mask, INPUT_F32=f32_in,
        ONE_BLOCK=not knobs.tiling, F32_DOT=knobs.fp32_gemm, KEYPAD=keypad, CLAMP=clamp, LPT=lpt, FTZ=_exp_ftz[0],
        ACC16=_acc16[0], FUSE_DELTA=fused, HAS_OFP32=has_ofp32, num_warps=warps, num_stages=stages,
        **_regs(register_cap("dq", knobs, D, cfg, not keypad)))
    grid, lpt = _grid(_cdiv(T, n1), B * H, k, "dkdv", knobs.recipe)
    _k._bwd_dkdv_kernel[grid](
        q, k, v, do, lse, delta, dk, dv, kp, first, ties,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), kp.stride(0), H, T, scale, ntw,
        HEAD_DIM=D, BLOCK_M=m1, BLOCK_N=n1, ROUND=mask, INPUT_F32=f32_in,
        ONE_BLOCK=not knobs.tiling, F32_DOT=knobs.fp32_gemm, KEYPAD=keypad, CLAMP=clamp, LPT=lpt, FTZ=_exp_ftz[0],
        ACC16=_acc16[0], num_warps=warps, num_stages=stages, **_regs(register_cap("dkdv", knobs, D, cfg, not keypad)))
    return dq, dk, dv


def rows_seen_padded(key_keep, B: int, T: int, knobs: AttentionKnobs) -> torch.Tensor:
    """() int64 on the device: (query row, key tile) pairs per head over the batch that have a key, as the emulator
    counts AttnStats.rows_seen under Masking(keep=causal & key_keep): row i sees tile t when a kept key j <= i lies
    in it, i.e. for i >= the tile's first kept key f, T - f rows (key tiles of block_k; one tile untiled)."""
    keep = (key_keep != 0).expand(B, T)
    bk = min(knobs.block_k, T) if knobs.tiling else T
    nt = _cdiv(T, bk)
    idx = torch.arange(nt * bk, device=keep.device).view(nt, bk)
    pad = torch.nn.functional.pad(keep, (0, nt * bk - T)).view(B, nt, bk)
    f = torch.where(pad, idx, torch.full((), T, device=keep.device)).amin(dim=-1)
    return (T - f).sum()


def fired_pbar_max(q, k, v, knobs: AttentionKnobs):
    """Probe for tests: per row (B, H, T), the largest FP32 P̄ in key tiles where the SFA condition fired, and
    whether it fired in any tile. Safe softmax gives P̄ = 1 there; the stabilized softmax must not."""
    with torch.no_grad():
        _, _, pmax, fired = _forward(q, k, v, knobs, probe=True)
    return pmax, fired.bool()
