"""The knob table: every attention knob declared once, with where it is computed.

A row (`Knob`) gives a knob's name, type, default, allowed values, a one-line meaning, the implementations that
compute it and the value that means "off". Everything else reads the rows: kernels/config.py builds AttentionKnobs,
KnobPatch, LayerOverride and AttentionConfig from them (and validates values by them), kernels/triton_flash.py's
`supports()`, orchestrator/config/validate.py's route checks and the route labels of models/attention.py.

Implementations: `emulator` and `triton` compute impl=flash (kernels/emulator.py, kernels/triton_flash.py; chosen by
`backend`), `standard` and `sdpa` are models/attention.py's other two.

It fails closed. `computed_by` and `off` have no default, so a new row must say where it runs. A knob is *set* when
its value is not `off`. A set knob is refused before launch on an implementation that does not compute it, unless
the row lists that implementation in `ignored_by` and says why it means nothing there. A knob with `choices` says,
per implementation, which values it computes: a new choice is computed nowhere until listed. backend=auto sends a
layer to the emulator when Triton does not compute one of its set knobs, and the route label says so.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from flash_forensics.kernels.checks import is_int, is_num
from flash_forensics.kernels.formats import FORMATS, PBAR_SCALES
from flash_forensics.kernels.recipes import FP8_POINTS, INPUT_SCALINGS, RECIPES, ROUNDING_POINTS

IMPLEMENTATIONS = ("emulator", "triton", "standard", "sdpa")
FLASH = ("emulator", "triton")  # the tiled kernels (impl=flash)
IMPLS = ("flash", "standard", "sdpa")  # flash: tiled kernels; standard: materialised softmax; sdpa: torch
BACKENDS = ("auto", "emulator", "triton")  # auto: triton on CUDA when it computes every set knob, else the emulator
SOFTMAXES = ("safe", "stabilized", "stabilized_guarded")  # guarded: bounded shift
DELTAS = ("dO_O", "dP_P", "recompute_fp32")
FP32_GEMMS = ("ieee", "tf32x3")  # how a GEMM with FP32 operands runs: FMA units, or three TF32 tensor-core passes
EXP_FORMS = ("exp", "exp2_folded", "exp2_mul")  # how exp(S - m) is evaluated (real kernels' forms)
KEY_ORDERS = ("forward", "reverse")
NORMALIZES = ("divide", "reciprocal")
TENSOR_CORES = ("exact", "sm90", "sm90_fast_fp8")  # kernels/tensor_core.py
ROWSUM_ORDERS = ("torch", "fa2_threads")
BLOCK = 64  # default block_q = block_k (the route label names other sizes)
EPS = 1e-3
PBAR_CLAMP = 0.99609375  # the largest BF16 value below 1 (1 - 2**-8): what pbar_clamp puts where P̄ = 1

Check = Callable[[Any, Optional[int]], Optional[str]]  # (value, n_head) -> None, or what is allowed
Label = Callable[[Any], Optional[str]]  # (the layer's knobs as its implementation computes them) -> route fragment


@dataclass(frozen=True)
class Knob:
    """One row of the table. `check` returns None or what is allowed (words); without it the type and `choices`
    are checked. `label(knobs)` is the knob's part of the route name; without it: `name` (True), `no-name`
    (False) or `name=value` when the value is not the default."""

    name: str
    type: Any
    default: Any
    meaning: str
    _: KW_ONLY
    # required: where it is computed: implementations (every value), or {implementation: the set values it computes}
    computed_by: Union[Tuple[str, ...], Dict[str, Tuple]]
    off: Any  # required: the value that asks nothing of an implementation
    ignored_by: Tuple[str, ...] = ()  # implementations where it means nothing (the meaning says why)
    choices: Tuple[str, ...] = ()
    check: Optional[Check] = None
    label: Optional[Label] = None

    def __post_init__(self):
        for what, impls in (("computed_by", self.computed_by), ("ignored_by", self.ignored_by)):
            unknown = set(impls) - set(IMPLEMENTATIONS)
            if unknown:
                raise ValueError(f"knob {self.name}: {what}={impls!r} is not allowed: expected names from "
                                 f"{', '.join(IMPLEMENTATIONS)}")
        if set(self.computed_by) & set(self.ignored_by):
            raise ValueError(f"knob {self.name}: an implementation cannot both compute and ignore it")
        if self.choices and not isinstance(self.computed_by, Mapping):
            raise ValueError(f"knob {self.name}: a knob with choices gives computed_by as {{implementation: values}}, "
                             "so that a new choice is computed nowhere until listed")
        for what, value in (("default", self.default), ("off", self.off)):
            why = self.problem(value)
            if why:
                raise ValueError(f"knob {self.name}: {what}={value!r} is not allowed: expected {why}")
        for impl, values in (self.computed_by.items() if isinstance(self.computed_by, Mapping) else ()):
            bad_values = [v for v in values if self.problem(v)]
            if bad_values:
                raise ValueError(f"knob {self.name}: computed_by[{impl!r}] lists {bad_values!r}, not allowed values")

    def problem(self, value, n_head: Optional[int] = None) -> Optional[str]:
        """None when `value` is allowed, else what is allowed, in words."""
        if self.check is not None:
            return self.check(value, n_head)
        if self.choices:
            return None if isinstance(value, str) and value in self.choices else "one of " + ", ".join(self.choices)
        if self.type is bool:
            return None if isinstance(value, bool) else "true or false"
        raise TypeError(f"knob {self.name}: a {self.type} knob needs `choices` or a `check`")

    def is_set(self, value) -> bool:
        return _plain(value) != _plain(self.off)

    def computes(self, impl: str, value) -> bool:
        """Whether `impl` computes this knob at `value` (off asks nothing: every implementation computes it)."""
        if not self.is_set(value):
            return True
        if isinstance(self.computed_by, Mapping):
            return any(_plain(value) == _plain(v) for v in self.computed_by.get(impl, ()))
        return impl in self.computed_by

    def computed_where(self, value) -> List[str]:
        """The implementations that compute this knob at `value`."""
        return [impl for impl in IMPLEMENTATIONS if self.computes(impl, value)]

    def route_label(self, knobs) -> Optional[str]:
        if self.label is not None:
            return self.label(knobs)
        value = getattr(knobs, self.name)
        if _plain(value) == _plain(self.default):
            return None
        if isinstance(value, bool):
            return self.name if value else f"no-{self.name}"
        return f"{self.name}={value}"


def _plain(value):
    # list/tuple, not collections.abc.Sequence: routing calls this per forward, and torch.compile traces plain checks
    return list(value) if isinstance(value, (list, tuple)) else value


def _elsewhere(_knobs) -> None:
    """Label of a knob another knob's label (or the route's base) already shows."""
    return None


def _positive_int(value, _n_head) -> Optional[str]:
    return None if is_int(value, 1) else "an integer > 0"


def _beta(value, _n_head) -> Optional[str]:
    return None if is_num(value, 1) else "a number > 1 (beta = 1 is the safe softmax)"


def _positive(value, _n_head) -> Optional[str]:
    return None if is_num(value, 0) else "a number > 0"


def _seed(value, _n_head) -> Optional[str]:
    return None if is_int(value, 0, 2 ** 31 - 1) else "an integer in 0..2147483647"


def _heads(value, n_head) -> Optional[str]:
    top = None if n_head is None else n_head - 1
    ok = not isinstance(value, (str, Mapping)) and hasattr(value, "__iter__") and all(is_int(h, 0, top) for h in value)
    return None if ok else f"head indices in {'>= 0' if top is None else f'0..{top}'}"


def _points(value, _n_head) -> Optional[str]:
    ok = (not isinstance(value, (str, Mapping)) and hasattr(value, "__iter__")
          and all(isinstance(pt, str) and pt in ROUNDING_POINTS for pt in value) and len(set(value)) == len(value))
    return None if ok else f"a list of distinct rounding points from {', '.join(ROUNDING_POINTS)}"


def _split(value, _n_head) -> Optional[str]:
    return None if is_int(value, 0) else "an integer >= 0 (keys per split-KV part; 0: no split)"


def _formats(value, _n_head) -> Optional[str]:
    ok = (isinstance(value, Mapping) and all(isinstance(pt, str) and pt in ROUNDING_POINTS for pt in value)
          and all(isinstance(f, str) and f in FORMATS for f in value.values()))
    return None if ok else (f"a mapping {{rounding point: format}} with points from {', '.join(ROUNDING_POINTS)} "
                            f"and formats from {', '.join(FORMATS)} (FP8 only at {', '.join(FP8_POINTS)})")


def _formats_label(k) -> Optional[str]:
    forms = dict(k.formats or {})
    return "formats=" + ",".join(f"{pt}:{forms[pt]}" for pt in ROUNDING_POINTS if pt in forms) if forms else None


def _points_label(name: str) -> Label:
    return lambda k: f"{name}=" + ",".join(getattr(k, name)) if list(getattr(k, name)) else None


def _heads_label(k) -> Optional[str]:
    if k.o_fp32 or not k.o_fp32_heads:  # o_fp32 (every head) says it already
        return None
    return "o_fp32_heads=" + ",".join(str(h) for h in sorted(set(k.o_fp32_heads)))


_BQ = "no tiles there: they compute each row whole, which is what any block size computes"
# The table. Its order is the field order of AttentionKnobs and the order of the route label's parts.
KNOBS: Tuple[Knob, ...] = (
    Knob("impl", str, "flash", "what computes the layer: tiled flash kernels, materialised softmax or torch SDPA",
         computed_by={"emulator": ("flash",), "triton": ("flash",), "standard": ("standard",), "sdpa": ("sdpa",)},
         off="flash", choices=IMPLS, label=_elsewhere),
    Knob("backend", str, "auto", "which code computes impl=flash; standard and sdpa are no flash kernel",
         computed_by={"emulator": ("emulator",), "triton": ("triton",)}, off="auto", ignored_by=("standard", "sdpa"),
         choices=BACKENDS, label=_elsewhere),
    Knob("recipe", str, "paper_bf16", "the dtype of every attention intermediate (kernels/recipes.py)",
         computed_by={"emulator": ("fa2", "fp32", "fp16", "fp8_fa3", "fp8_te"), "triton": ("fa2", "fp32"),
                      "standard": ("fa2", "fp32"),
                      "sdpa": ("fa2", "fp32")}, off="paper_bf16", choices=RECIPES, label=_elsewhere),
    Knob("tiling", bool, True, "False: one block spans the whole sequence (block size = T)",
         computed_by=FLASH, off=True, label=lambda k: None if k.tiling else "untiled"),
    Knob("block_q", int, BLOCK, f"query tile size; {_BQ}", computed_by=FLASH, off=BLOCK,
         ignored_by=("standard", "sdpa"), check=_positive_int,
         label=lambda k: f"blocks{k.block_q}x{k.block_k}" if k.tiling and (k.block_q, k.block_k) != (BLOCK, BLOCK)
         else None),
    Knob("block_k", int, BLOCK, f"key tile size (the tile whose max Algorithm 3 and the counters see); {_BQ}",
         computed_by=FLASH, off=BLOCK, ignored_by=("standard", "sdpa"), check=_positive_int, label=_elsewhere),
    Knob("softmax", str, "safe", "stabilized: Algorithm 3 (shift by beta * rowmax where the row max repeats); "
         "stabilized_guarded: its shift bounded so P̄ < 1 without underflow (kernels/emulator.py)",
         computed_by={"emulator": ("stabilized", "stabilized_guarded"), "triton": ("stabilized", "stabilized_guarded")},
         off="safe",
         choices=SOFTMAXES,
         label=lambda k: {"stabilized": f"sfa(beta={k.beta:g})",
                          "stabilized_guarded": f"sfa_guarded(beta={k.beta:g})"}.get(k.softmax)),
    Knob("beta", float, 2.0, "Algorithm 3's shift factor; read only by softmax=stabilized, which standard and "
         "sdpa refuse", computed_by=FLASH, off=2.0, ignored_by=("standard", "sdpa"), check=_beta, label=_elsewhere),
    Knob("eps", float, EPS, "tolerance of 'repeated' for Algorithm 3 and the counters; sdpa has neither",
         computed_by=("emulator", "triton", "standard"), off=EPS, ignored_by=("sdpa",), check=_positive),
    Knob("delta", str, "dO_O", "delta = rowsum(dO*O) | rowsum(dP*P) | rowsum(dO*O) with O recomputed as PV in FP32",
         computed_by={"emulator": ("dP_P", "recompute_fp32"), "triton": ("dP_P", "recompute_fp32")}, off="dO_O",
         choices=DELTAS),
    Knob("pv_fp32", bool, False, "the P̄V product (and the O accumulator it feeds) in FP32",
         computed_by=("emulator", "triton", "standard"), off=False),
    Knob("o_fp32", bool, False, "O in FP32 in the forward for every head",
         computed_by=("emulator", "triton", "standard"), off=False),
    Knob("o_fp32_heads", List[int], [], "... or only for these heads (0-based)",
         computed_by=("emulator", "triton", "standard"), off=[], check=_heads, label=_heads_label),
    # Rounding points (kernels/recipes.py ROUNDING_POINTS) one by one; whether they fit the recipe (not already in
    # that dtype, not in both lists) is flash_forensics.kernels.recipes.points_problem, checked with the other knobs.
    Knob("keep_fp32", List[str], [], "rounding points lifted to FP32 (e.g. [scores, stats]); pv_fp32 is "
         "[pbar, pv_out, acc]", computed_by=FLASH, off=[], check=_points, label=_points_label("keep_fp32")),
    Knob("round_bf16", List[str], [], "rounding points rounded to BF16 (e.g. recipe=fp32 with [pv_out])",
         computed_by=FLASH, off=[], check=_points, label=_points_label("round_bf16")),
    # How the tiled kernels run a GEMM whose operands are FP32 (the fp32 recipe's every GEMM; a lifted pbar, P or dS
    # of the others). ieee: CUDA-core FMAs, every product exact and summed in FP32 (the reference unless this is set).
    # tf32x3: x = hi + lo with hi = tf32(x), lo = tf32(x - hi), and hi*hi + hi*lo + lo*hi on the tensor cores (Triton's
    # input_precision="tf32x3"; the emulator models it in kernels/emulator.py): FP32-accurate to a few units in the
    # last place (error measured in benchmarks/fp32_reference.py, results/bench/fp32-reference-*.json), several
    # times faster. Operands that are BF16 already (BF16 is a subset of TF32) split exactly: nothing changes there.
    Knob("fp32_gemm", str, "ieee", "how a GEMM with FP32 operands runs: ieee (FMA, exact products) or tf32x3 (three "
         "TF32 tensor-core passes, FP32-accurate to a few ulp, several times faster); standard and sdpa run torch's "
         "matmul, whose FP32 mode is torch's own setting", computed_by={"emulator": ("tf32x3",), "triton": ("tf32x3",)},
         off="ieee", ignored_by=("standard", "sdpa"), choices=FP32_GEMMS),
    # Formats per point (kernels/formats.py) and the FP8 recipes' accuracy tricks: the emulator only (Triton's kernels
    # store BF16 or FP32; kernels/recipes.py formats_problem checks the fit to the recipe)
    Knob("formats", Dict[str, str], {}, "rounding point -> format (fp32, bf16, fp16, e4m3, e5m2), e.g. "
         "{pbar: e4m3}; keep_fp32 / round_bf16 are its fp32 / bf16 shorthands", computed_by=("emulator",), off={},
         check=_formats, label=_formats_label),
    Knob("input_scaling", str, "recipe", "scale of FP8 Q, K, V, dO: tensor (one amax), head (FA3's per-(batch, "
         "head) descales), block (one scale per tile: FA3's block quantization); recipe: the recipe's own",
         computed_by={"emulator": INPUT_SCALINGS}, off="recipe", choices=("recipe",) + INPUT_SCALINGS,
         label=lambda k: None if k.input_scaling == "recipe" else f"scaling={k.input_scaling}"),
    Knob("pbar_scale", str, "recipe", "P̄'s fixed scale before an FP8 cast: fa3 (2^8), sage (448), none (1); "
         "recipe: the recipe's own", computed_by={"emulator": tuple(PBAR_SCALES)}, off="recipe",
         choices=("recipe",) + tuple(PBAR_SCALES),
         label=lambda k: None if k.pbar_scale == "recipe" else f"pbar_scale={k.pbar_scale}"),
    Knob("incoherent", bool, False, "FA3's incoherent processing: Q and K rotated by a random-sign Hadamard matrix "
         "along the head dimension before their cast (QK^T unchanged in exact arithmetic)",
         computed_by=("emulator",), off=False),
    Knob("pbar_clamp", bool, False, f"where a tile's row max repeats, P̄ = 1 becomes {PBAR_CLAMP} before P̄V "
         "(m and l unchanged): the clamp-only ablation", computed_by=("emulator", "triton"), off=False),
    # How real kernels evaluate the same recipe (issue 30; emulator only: kernels/emulator.py, kernels/tensor_core.py;
    # results/real_kernels/ measures each against torch SDPA's backends on an H200).
    # exp2_folded: FlashAttention-2's softmax (csrc/flash_attn/src/softmax.h scale_apply_exp2, Dao-AILab/
    # flash-attention): the row max of the *unscaled* S, P̄ = exp2(S * c - m * c) with c = scale * log2(e) in FP32
    # (the two products rounded apart: measured, 99.7% vs 94.7% of O with one FMA on repeated maxima), the rescale
    # exp2((m_old - m_new) * c). exp2_mul: Triton's tl.exp (exp2 of x * log2(e), x rounded first). exp2 is exact then
    # rounded: the GPU's ex2.approx.f32 is not specified bit for bit (the one term the table leaves open).
    # Triton computes exp2_folded in its forward where the scores and statistics stay FP32 (fa2, fp32) and tiling is on
    # (kernels/triton_launch.py fold_supported; else the emulator): a multiply, a subtract and an ftz exp2 per score,
    # where exp_form=exp spends the scale's multiply, the subtract, exp's multiply by log2(e) and ex2's denormal
    # fix-up (a compare, two multiplies: scripts/kernel_sass.py). A probe of the one-FMA variant ran fa2's forward 21%
    # faster on an H100; this two-rounding form is not timed yet (results/bench/gpu-h100-2026-12-06d/).
    Knob("exp_form", str, "exp", "how P̄ = exp(S - m) is evaluated: exp, exp2_folded (FlashAttention-2: scale and "
         "log2(e) folded into one multiply of the unscaled scores, exp2), exp2_mul (Triton's tl.exp)",
         computed_by={"emulator": ("exp2_folded", "exp2_mul"), "triton": ("exp2_folded",)}, off="exp",
         choices=EXP_FORMS,
         label=lambda k: None if k.exp_form == "exp" else k.exp_form),
    # FlashAttention-2's forward visits key blocks from the last to the first (flash_fwd_kernel.h
    # compute_attn_1rowblock: n_block from n_block_max - 1 down), so the online softmax rescales in that order.
    Knob("key_order", str, "forward", "order of a query tile's key tiles in the forward: forward (first to last) "
         "or reverse (FlashAttention-2's, last to first)", computed_by={"emulator": ("reverse",)}, off="forward",
         choices=KEY_ORDERS, label=lambda k: None if k.key_order == "forward" else "keys_reversed"),
    # FlashAttention-2's normalize_softmax_lse: inv_sum = 1 / l, acc_o *= inv_sum (softmax.h)
    Knob("normalize", str, "divide", "O = acc / l (divide) or acc * (1 / l) (reciprocal, FlashAttention-2's)",
         computed_by={"emulator": ("reciprocal",)}, off="divide", choices=NORMALIZES,
         label=lambda k: None if k.normalize == "divide" else "rcp"),
    # FlashAttention-2's split-KV path (flash_fwd_kernel.h compute_attn_splitkv + combine_attn_seqk_parallel): torch
    # takes it when the grid is small (flash_api.cpp num_splits_heuristic); each part an online softmax of its own keys,
    # O_i = acc_i / l_i and lse_i, then lse = log(sum exp(lse_i - max)) + max, O = sum exp(lse_i - lse) O_i.
    Knob("kv_split", int, 0, "keys per split-KV part (0: none): each part's online softmax apart, then "
         "FlashAttention-2's combine of the parts' O and lse", computed_by=("emulator",), off=0, check=_split,
         label=lambda k: f"kvsplit{k.kv_split}" if k.kv_split else None),
    # FlashAttention-2's row sum: each of the 4 threads holding a row of the mma.sync accumulator sums its own columns
    # across the tiles (softmax.h reduce_sum<zero_init=false, warp_reduce=false>), the 4 partials added at the end
    # by the quad all-reduce ((t0 + t2) + (t1 + t3), shfl_xor 2 then 1). Measured: 99.84% -> 100% of O (D 64).
    Knob("rowsum_order", str, "torch", "the FP32 summation order of the running row sum l: torch (one sum per "
         "tile) or fa2_threads (FlashAttention-2's four per-thread partial sums)",
         computed_by={"emulator": ("fa2_threads",)}, off="torch", choices=ROWSUM_ORDERS,
         label=lambda k: None if k.rowsum_order == "torch" else "fa2_rowsum"),
    # Hopper tensor-core accumulation (kernels/tensor_core.py: block FMA with alignment truncation; parameters
    # measured on an H200, results/real_kernels/): every GEMM whose operands are stored in 16 bits or fewer.
    Knob("tensor_core", str, "exact", "GEMMs with BF16/FP16/FP8 operands as Hopper's tensor cores accumulate them "
         "(sm90: 16-product blocks truncated to 25 bits, FP8 32-product blocks to 13 bits promoted to FP32 every 128 "
         "as cuBLAS does; sm90_fast_fp8: FP8 never promoted, as FlashAttention-3 and use_fast_accum) or exact",
         computed_by={"emulator": ("sm90", "sm90_fast_fp8")}, off="exact", choices=TENSOR_CORES,
         label=lambda k: None if k.tensor_core == "exact" else f"tc={k.tensor_core}"),
    # stochastic rounding (kernels/stochastic.py; kernels/emulator.py `r_sr`, the Triton forward draws the same bits):
    # its own rows, read by nothing else
    Knob("stochastic_round", bool, False, "the BF16 stores of the P̄V product and of the O accumulator round "
         "stochastically (unbiased) instead of to nearest; a recipe that keeps them in FP32 has nothing to round",
         computed_by=("emulator", "triton"), off=False,
         label=lambda k: f"stoch_round(seed={k.sr_seed})" if k.stochastic_round else None),
    Knob("sr_seed", int, 0, "stochastic_round's seed; read only by stochastic_round, which the flash kernels "
         "compute (standard and sdpa refuse it)", computed_by=("emulator", "triton"), off=0,
         ignored_by=("standard", "sdpa"), check=_seed, label=_elsewhere),
    Knob("counters", bool, True, "count repeated-maxima rows per head on the device; sdpa has none (its route says "
         "no-counters)", computed_by=("emulator", "triton", "standard"), off=False, ignored_by=("sdpa",)),
)


# --------------------------------------------------------------------------------------------------- queries
def rows(knobs) -> Tuple[Knob, ...]:
    """The rows a knobs object was built from (kernels/config.py attaches them to its classes)."""
    return getattr(knobs, "KNOB_ROWS", KNOBS)


def implementation(knobs, backend: Optional[str] = None) -> str:
    """The implementation computing a layer: impl for standard/sdpa; for flash the resolved `backend`, else the
    chosen one, with auto counted as the emulator (auto can always fall back to it: no CUDA, a shape Triton lacks)."""
    if knobs.impl != "flash":
        return knobs.impl
    backend = backend or knobs.backend
    return "emulator" if backend == "auto" else backend


def unsupported(knobs, impl: str) -> List[Knob]:
    """The set knobs that `impl` neither computes nor declares meaningless: a route through it would drop them."""
    return [r for r in rows(knobs) if impl not in r.ignored_by and not r.computes(impl, getattr(knobs, r.name))]


def as_computed(knobs, impl: str):
    """The knobs as `impl` computes them: a knob it does not compute (at that value) reads as off."""
    off = {r.name: _plain(r.off) for r in rows(knobs) if not r.computes(impl, getattr(knobs, r.name))}
    return replace(knobs, **off) if off else knobs


def route_labels(knobs, impl: str) -> List[str]:
    """The parts of the route name the knobs add on `impl`, in table order."""
    k = as_computed(knobs, impl)
    return [lab for lab in (r.route_label(k) for r in rows(knobs)) if lab]


def computed_by_words(row: Knob, value) -> str:
    """Where `row` at `value` is computed, in words."""
    return ", ".join(row.computed_where(value)) or "no implementation"


__all__ = ["Knob", "KNOBS", "IMPLEMENTATIONS", "IMPLS", "BACKENDS", "RECIPES", "ROUNDING_POINTS", "SOFTMAXES", "DELTAS",
           "FP32_GEMMS", "EXP_FORMS", "KEY_ORDERS", "NORMALIZES", "TENSOR_CORES", "ROWSUM_ORDERS",
           "PBAR_CLAMP", "rows", "implementation", "unsupported", "as_computed", "route_labels", "computed_by_words"]
