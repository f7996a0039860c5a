"""Precision recipes: the dtype of every attention intermediate, named once.

A recipe lists where a value is *stored* (rounded): its rounding points (ROUNDING_POINTS, below). The emulator keeps
every tensor in a working dtype (FP32, or FP64 for the fp32 recipe on FP64 inputs) and rounds at each storage point
with `round_to` (x.to(dtype).to(work)), which is what PyTorch's own BF16 ops do on CUDA: compute in FP32, round the
result once. GEMMs take inputs rounded to their point and accumulate in the working dtype (BF16 x BF16 products are
exact in FP32), then round their output. Q, K, V and dO enter every GEMM in `inputs` (BF16 for paper_bf16 / fa2,
the working dtype for fp32): the input's own precision, not a point.

The rounding points (each settable on its own: knobs `keep_fp32` lifts points to FP32, `round_bf16` rounds them to
BF16; `Recipe.rounded()` lists the points a recipe stores in BF16):
    scores       S = QK^T and S * scale (also beta * rm and rm - eps, Algorithm 3's values computed from them)
    shift        S - m and m_old - m_new: the arguments of exp in the forward
    stats        the running max m and the running sum l
    pbar         P̄ as fed to the P̄V GEMM
    pv_out       the P̄V GEMM's output
    acc          the O accumulator (after the rescale by alpha and after adding P̄V)
    o_store      O = O_acc / l: saved for the backward (what delta dO_O sees)
    delta_prod   dO * O before the row sum of delta (dO_O)
    bwd_gemm_in  P and dS as fed to the backward GEMMs (dV = P^T dO, dQ = dS K, dK = dS^T Q)
    bwd_out      backward GEMM outputs: dP and the dQ/dK/dV chunks of one tile
    grad_acc     the dQ/dK/dV accumulators
Not points: `math` (exp, row sums, log/lse, dS, backward P: the ops CUDA autocast runs in FP32) and `out` (the
returned O, in the recipe's output dtype).

Semantics of one forward tile (query tile i, key tile j; Algorithm 1 of FlashAttention-2), `r(x, f)` = round x to
the recipe's field f, P̄ the unnormalised probabilities, alpha the rescale of the running state:

    S      = r(r(Q_i K_j^T, scores) * scale, scores)         masked (causal) -> -max finite value of `scores`
    rm     = rowmax(S)                                       (exact: a max of stored values)
    Algorithm 3 (softmax="stabilized", and the counters; masked entries never count):
           rs = rowsum(S >= r(rm - eps, scores)); rep = rs > 1
           m' = where(rep & rm > 0, r(beta * rm, scores), rm); m_t = where(rep & m' < 0, 0, m')   (safe: m_t = rm)
    m_new  = r(max(m, m_t), stats)
    P̄      = exp(r(S - m_new, shift))        exp in `math` (FP32)
    alpha  = exp(r(m - m_new, shift))
    l      = r(alpha * l + max(rowsum(P̄), rowsum_floor), stats)      rowsum in `math`
    PV     = r(r(P̄, pbar) @ V_j, pv_out)
    O_acc  = r(r(O_acc * alpha, acc) + PV, acc)
  after the last key tile:  O = r(O_acc / l, o_store); lse = log(l) + m (in `math`); returned O = O.to(out).

Backward (Algorithm 2; loops: query tiles outer, key tiles inner, the paper's order, so BF16 accumulators round in
the same sequence), with D the row term delta:

    S as in the forward; P = exp(S - lse) in `math` (masked -> 0)
    dV_j += r(r(P, bwd_gemm_in)^T dO_i, bwd_out)        accumulated in `grad_acc`
    dP    = r(dO_i V_j^T, bwd_out)
    dS    = (P * scale) * (dP - D)                   in `math`
    dQ_i += r(r(dS, bwd_gemm_in) K_j, bwd_out); dK_j += r(r(dS, bwd_gemm_in)^T Q_i, bwd_out)   accumulated in `grad_acc`
    delta="dO_O":           D = rowsum(r(dO * O_stored, delta_prod))      sum in `math`
    delta="dP_P":           D = sum_j rowsum(dP_ij * P_ij)                in `math` (a first pass over key tiles)
    delta="recompute_fp32": D = rowsum(dO * (sum_j P_ij V_j))             P, V, product and sum in `math`

Knobs that override a recipe (kernels/config.py):
- keep_fp32 / round_bf16: lists of points lifted to FP32 (the working dtype) / rounded to BF16 (`for_knobs`). A point
  may not be in both, nor lifted where the recipe keeps it in FP32 already, nor rounded where it is BF16 already
  (`points_problem`): each such setting would change nothing, silently.
- pv_fp32: keep_fp32 = [pbar, pv_out, acc] (PV_POINTS): P̄ enters the P̄V GEMM unrounded, PV and O_acc stay in
  `math`; O is still rounded to `o_store` after the division, so delta still sees the BF16 O.
- o_fp32 / o_fp32_heads: for those heads, everything pv_fp32 lifts *and* O_stored stays in `math`, so delta
  (dO_O) uses the FP32 O (and the dO*O product is not rounded, as BF16 * FP32 promotes to FP32 in PyTorch). The
  returned O is still `out` (BF16): the next layer sees the same dtype. Other heads are bit-identical.
- formats: {point: fp32 | bf16 | fp16 | e4m3 | e5m2} (see "Formats" above; `formats_problem` validates it);
  input_scaling / pbar_scale: the FP8 scales (tensor | head | block; fa3 | sage | none); incoherent: FA3's Hadamard
  rotation of Q and K. Emulator only (the knob table refuses them for Triton, standard and sdpa).
- tiling=False: one tile spans the sequence (block_q = block_k = T).
- stochastic_round: the `pv_out` and `acc` roundings (BF16 in paper_bf16 only) are stochastic instead of nearest
  even (kernels/stochastic.py, seed `sr_seed`); every other point stays nearest even. Refused where both are FP32.

Formats (kernels/formats.py has the casts, their overflow/saturation rules and the scales): each point is stored in
one of fp32, bf16, fp16, e4m3, e5m2. The knob `formats` ({point: format}) sets any point to any format; keep_fp32 /
round_bf16 are its shorthands for fp32 / bf16 (bit-identical to before). FP8 is allowed only at FP8_POINTS (GEMM
operands and stores FP8 kernels quantise: pbar, o_store, bwd_gemm_in, bwd_out); accumulators, statistics and the
arguments of exp keep >= 16 bits. An FP8 store carries a scale (cast(x * s) / s):
    Q, K, V, dO (`inputs`, `bwd_inputs`, `do_in` in FP8): `input_scaling` tensor (one amax, current scaling) |
        head (FA3's per-(batch, KV-head) descales) | block (one scale per tile: FA3's block quantization)
    pbar and the backward's P (bwd_gemm_in): the fixed `pbar_scale` (FA3 2^8, SageAttention 448, or 1)
    o_store: per-tensor current scaling, applied once O is complete
    dP, dS and the dQ/dK/dV chunks: the tile's own amax per (batch, head) (tile current scaling: an optimistic
        stand-in for Transformer Engine's delayed per-tensor scales, whose amax history the emulator does not keep)
Operand fields (not points; None = the point's format): `bwd_inputs` (Q, K, V in the backward; None = `inputs`),
`do_in` (dO; None = the backward's inputs), `ds_in` (dS as fed to dQ/dK; None = bwd_gemm_in), `dp_out` (dP; None =
bwd_out). Setting a point's format moves its operands with it (formats={bwd_gemm_in: bf16} on fp8_te stores both P
and dS in BF16). `incoherent` (knob): Q and K rotated by a random-sign Hadamard matrix along the head dimension
before their input cast (kernels/formats.py), in both passes, and dQ, dK rotated back.

Recipes:
- paper_bf16: the paper's plain-PyTorch FA2 (ucker/why-low-precision-training-fails, attention.py) under CUDA
  autocast with BF16 q, k, v. Read op by op: einsum -> BF16 GEMM (FP32 accumulate, BF16 out); `* scale` on a BF16
  tensor -> BF16; m, l, O buffers are `zeros_like(q)`/BF16 and updated in place (`copy_`, `mul_`, `add_`, `div_`
  round into BF16); `exp`, `sum`, `log` are on autocast's FP32 list; `alpha * l + rowsum` promotes to FP32 and is
  rounded by `copy_` into the BF16 l. Its backward runs the same way: P = exp(S_bf16 - lse_fp32) promotes to FP32
  (the subtraction is FP32 there, BF16 in the forward); einsums round inputs to BF16 and return BF16; the
  dq/dk/dv buffers are `zeros_like` BF16 accumulated with `add_`; D = (dO * O).sum(-1): the product is a BF16 op
  (rounded), the sum runs in FP32.
  Differences between that code and the design sketch, and how the emulator resolves them:
    * The sketch says nothing about the product in delta; the code rounds dO*O to BF16 before the FP32 sum
      (`delta_prod` = BF16). Followed.
    * The code clamps each tile's row sum at 1e-10 (`rowsum_floor`). Followed (paper_bf16 only).
    * The code's eps test is `S >= rm - 1e-3` with `rm - 1e-3` a BF16 op: for |rm| >= 0.5 that rounds back to rm,
      so "within eps" means "equal". Followed (for every recipe the threshold is computed in `scores`).
    * The code does not skip causal tiles wholly above the diagonal: it fills them with -max BF16. Under safe
      softmax that adds exp(-huge) = 0 and a clamped row sum of 1e-10 (absorbed by l >= 1 in BF16). Under STABLE=1
      such a tile counts as "every entry equals the max, max < 0", sets its tile max to 0 and raises the running max
      of those rows to max(m, 0). The emulator skips those tiles (as the brief asks and as fused kernels do) and
      excludes masked entries from the repeated-max test, so stabilized rows whose max is negative keep m < 0.
      Equal in exact arithmetic; differs by BF16 rounding of the extra rescale.
    * The code's backward has no autocast decorator (custom_bwd). In eager mode the backward runs without autocast
      and its first mixed-dtype einsum (FP32 P with BF16 dO) raises; their train.py compiles the model
      (compile=True), where the backward is traced under the forward's autocast. We follow the autocast reading.
      Under torch.compile, inductor may also fuse element-wise chains and skip intermediate BF16 roundings
      (e.g. round bf16(O*alpha + PV) once); the emulator keeps eager-mode roundings, the ones the paper analyses.
    * Their public code hard-codes beta = 2 and eps = 1e-3; here they are knobs.
- fa2: fused CUDA kernels (FlashAttention-2): S, m, l, O accumulator in FP32; P̄ rounded to BF16 for P̄V (FP32
  accumulate); O rounded to BF16 once at the end (that BF16 O is also what delta sees). Backward in FP32 with BF16
  GEMM inputs and FP32 outputs and accumulators.
- fp32: everything in the working dtype = the inputs' precision if it is >= FP32 (FP64 inputs compute in FP64: the
  float64 tests and gradcheck), else FP32. Output in that dtype.
- fp16: fa2 with FP16 in place of BF16 (Q, K, V, dO, P̄, stored O, backward GEMM inputs, returned O): what
  FlashAttention-2 computes on FP16 inputs. FP16 overflows to inf beyond 65504 (counted: AttnStats.fp16_overflow).
- fp8_fa3: FlashAttention-3's FP8 forward (Shah et al. 2024, arXiv 2407.08608, Sec. 3.3; flash_attn_interface's
  q_descale / k_descale / v_descale of shape (batch, kv_heads)): Q, K, V in e4m3 with per-(batch, head) descales
  (current scaling, input_scaling=head), S, m, l and the O accumulator in FP32, P̄ multiplied by 2^8 (pbar_scale)
  before its e4m3 cast for the P̄V GEMM (FP32 accumulate), O returned and stored in BF16. FA3's FP8 kernel has no
  backward: the backward is fa2's on the BF16 Q, K, V (bwd_inputs=BF16) with the FP8 forward's O and lse (what a
  hybrid FP8-forward / BF16-backward training computes; P = exp(S_bf16 - lse_fp8) need not sum to exactly 1).
  FA3's accuracy tricks are knobs: incoherent=true, input_scaling=block.
- fp8_te: Transformer Engine's fp8_dpa with the DelayedScaling(fp8_format=HYBRID) recipe (cuDNN fused FP8
  attention; e4m3 forward, e5m2 backward): Q, K, V e4m3 (per-tensor scales), S = QK^T and the softmax statistics
  M and ZInv in FP32, the softmax output (P̄) e4m3 with scale 448 (TE's S quantizer: 448 / amax, amax = 1 as soon
  as one P̄ = 1 was seen, i.e. always), O stored in e4m3 with its per-tensor scale and returned in BF16 (fp8_dpa
  without fp8_mha casts O back at the boundary); backward: dO e5m2 (per-tensor), delta = rowsum(dO * O) in FP32
  from the FP8 O, dP = dO V^T stored e5m2, dS = P (dP - delta) in FP32 stored e5m2 for dQ/dK, P e4m3 (scale 448)
  for dV, FP32 accumulation. Not modelled: TE's delayed (amax-history) scales (current scaling here), the final
  FP8 cast of dQ/dK/dV where fp8_mha is on.
Gradients are returned in the inputs' dtypes.

`resolve(name, input_dtype)` gives the concrete Recipe; `reference_attention` in kernels/emulator.py is the pure
function other kernels test against.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, Optional, Tuple

import torch

from flash_forensics.kernels import formats as fmt

BF16 = torch.bfloat16
F32 = torch.float32
F16 = torch.float16
E4M3, E5M2 = fmt.E4M3, fmt.E5M2

RECIPES = ("paper_bf16", "fa2", "fp32", "fp16", "fp8_fa3", "fp8_te")
FP8_RECIPES = ("fp8_fa3", "fp8_te")
# Every storage point of a recipe, in the order of the computation (module docstring). Each one is a Recipe field.
ROUNDING_POINTS = ("scores", "shift", "stats", "pbar", "pv_out", "acc", "o_store", "delta_prod", "bwd_gemm_in",
                   "bwd_out", "grad_acc")
PV_POINTS = ("pbar", "pv_out", "acc")  # what pv_fp32 lifts (the P̄V path)
FP8_POINTS = ("pbar", "o_store", "bwd_gemm_in", "bwd_out")  # where FP8 is allowed (module docstring)
INPUT_SCALINGS = ("tensor", "head", "block")
_OPERANDS = {"bwd_gemm_in": "ds_in", "bwd_out": "dp_out"}  # a point's operand fields that follow its format
POINT_MEANINGS = {  # one line per point, for generated files and reports (the docstring above has the detail)
    "scores": "S = QK^T and S * scale",
    "shift": "S - m and m_old - m_new, the arguments of exp",
    "stats": "the running max m and running sum l",
    "pbar": "P̄ as fed to the P̄V GEMM",
    "pv_out": "the P̄V GEMM's output",
    "acc": "the O accumulator",
    "o_store": "O = O_acc / l as saved for the backward",
    "delta_prod": "dO * O before the row sum of delta",
    "bwd_gemm_in": "P and dS as fed to the backward GEMMs",
    "bwd_out": "the backward GEMM outputs (dP, the dQ/dK/dV chunks)",
    "grad_acc": "the dQ/dK/dV accumulators",
}


@dataclass(frozen=True)
class Recipe:
    """Storage dtype of each attention intermediate (see the module docstring for where each one applies)."""

    name: str
    work: torch.dtype  # the dtype every tensor lives in between roundings (FP32, or FP64 for fp32 on FP64 input)
    inputs: torch.dtype  # Q, K, V, dO as they enter a GEMM (the input's precision: not a rounding point)
    scores: torch.dtype  # S = QK^T and S * scale; also beta * rm and rm - eps
    shift: torch.dtype  # S - m and m_old - m_new, the arguments of exp in the forward
    stats: torch.dtype  # running max m and running sum l
    pbar: torch.dtype  # P̄ rounded to this before the P̄V GEMM
    pv_out: torch.dtype  # the P̄V GEMM output
    acc: torch.dtype  # the O accumulator
    o_store: torch.dtype  # O after the division by l: saved for the backward (delta)
    out: torch.dtype  # the returned O
    math: torch.dtype  # exp, row sums, log/lse, dS, backward P (the ops CUDA autocast runs in FP32)
    delta_prod: torch.dtype  # dO * O before the row sum of delta (dO_O)
    bwd_gemm_in: torch.dtype  # P and dS rounded to this before the backward GEMMs
    bwd_out: torch.dtype  # backward GEMM outputs (dP and the dQ/dK/dV chunks)
    grad_acc: torch.dtype  # dQ/dK/dV accumulators
    rowsum_floor: float = 0.0  # each tile's row sum is clamped at this (paper_bf16: 1e-10, as in its code)
    # operands and scales of the other formats (module docstring, "Formats"); the defaults change nothing
    bwd_inputs: Optional[torch.dtype] = None  # Q, K, V in the backward (None: `inputs`; fp8_fa3: BF16)
    do_in: Optional[torch.dtype] = None  # dO in the backward (None: the backward's inputs; fp8_te: e5m2)
    ds_in: Optional[torch.dtype] = None  # dS as fed to dQ/dK (None: bwd_gemm_in; fp8_te: e5m2)
    dp_out: Optional[torch.dtype] = None  # dP (None: bwd_out; fp8_te: e5m2)
    input_scaling: str = "tensor"  # scale of FP8 inputs: tensor | head | block (read only where an input is FP8)
    pbar_scale: float = 1.0  # P̄ (and the backward's P) multiplied by this before an FP8 cast

    def describe(self) -> dict:
        """Field -> dtype name, for MLflow params and reports."""
        return {f.name: (str(getattr(self, f.name)).replace("torch.", "") if f.name != "name" else self.name)
                for f in fields(self)}

    def rounded(self) -> tuple:
        """The points this recipe stores in BF16, in ROUNDING_POINTS order."""
        return tuple(pt for pt in ROUNDING_POINTS if getattr(self, pt) == BF16)

    def formats(self) -> Dict[str, str]:
        """{point: format name} for every rounding point (fp64 where the working dtype is FP64)."""
        return {pt: fmt.name_of(getattr(self, pt)) for pt in ROUNDING_POINTS}

    def operand(self, field: str) -> torch.dtype:
        """The dtype of an operand field, its None resolved (bwd_inputs -> inputs, do_in -> the backward's inputs,
        ds_in -> bwd_gemm_in, dp_out -> bwd_out)."""
        value = getattr(self, field)
        if value is not None:
            return value
        return {"bwd_inputs": lambda: self.inputs, "do_in": lambda: self.operand("bwd_inputs"),
                "ds_in": lambda: self.bwd_gemm_in, "dp_out": lambda: self.bwd_out}[field]()


def work_dtype(name: str, input_dtype: torch.dtype) -> torch.dtype:
    """FP64 for the fp32 recipe on FP64 inputs ("the input's precision if it is >= FP32"), else FP32."""
    return torch.float64 if (name == "fp32" and input_dtype == torch.float64) else F32


def resolve(name: str, input_dtype: torch.dtype = BF16, keep_fp32=(), round_bf16=(), formats=None,
            input_scaling: Optional[str] = None, pbar_scale: Optional[float] = None) -> Recipe:
    """The concrete Recipe for `name` and inputs of `input_dtype`, with the points in `keep_fp32` stored in the
    working dtype (FP32), those in `round_bf16` in BF16 and those in `formats` ({point: format name}) in theirs
    (validated by `points_problem` / `formats_problem` before launch); `input_scaling` / `pbar_scale` (None: the
    recipe's own) replace the FP8 scales."""
    if name not in RECIPES:
        raise ValueError(f"attention.recipe={name!r} is not allowed: expected one of {', '.join(RECIPES)}")
    w = work_dtype(name, input_dtype)
    if name == "paper_bf16":
        rc = Recipe(name, work=w, inputs=BF16, scores=BF16, shift=BF16, stats=BF16, pbar=BF16, pv_out=BF16,
                    acc=BF16, o_store=BF16, out=BF16, math=F32, delta_prod=BF16, bwd_gemm_in=BF16, bwd_out=BF16,
                    grad_acc=BF16, rowsum_floor=1e-10)
    elif name == "fa2":
        rc = Recipe(name, work=w, inputs=BF16, scores=F32, shift=F32, stats=F32, pbar=BF16, pv_out=F32, acc=F32,
                    o_store=BF16, out=BF16, math=F32, delta_prod=F32, bwd_gemm_in=BF16, bwd_out=F32, grad_acc=F32)
    elif name == "fp16":
        rc = Recipe(name, work=w, inputs=F16, scores=F32, shift=F32, stats=F32, pbar=F16, pv_out=F32, acc=F32,
                    o_store=F16, out=F16, math=F32, delta_prod=F32, bwd_gemm_in=F16, bwd_out=F32, grad_acc=F32)
    elif name == "fp8_fa3":
        rc = Recipe(name, work=w, inputs=E4M3, scores=F32, shift=F32, stats=F32, pbar=E4M3, pv_out=F32, acc=F32,
                    o_store=BF16, out=BF16, math=F32, delta_prod=F32, bwd_gemm_in=BF16, bwd_out=F32, grad_acc=F32,
                    bwd_inputs=BF16, input_scaling="head", pbar_scale=fmt.PBAR_SCALES["fa3"])
    elif name == "fp8_te":
        rc = Recipe(name, work=w, inputs=E4M3, scores=F32, shift=F32, stats=F32, pbar=E4M3, pv_out=F32, acc=F32,
                    o_store=E4M3, out=BF16, math=F32, delta_prod=F32, bwd_gemm_in=E4M3, bwd_out=F32, grad_acc=F32,
                    do_in=E5M2, ds_in=E5M2, dp_out=E5M2, input_scaling="tensor",
                    pbar_scale=fmt.PBAR_SCALES["sage"])
    else:
        rc = Recipe(name, work=w, inputs=w, scores=w, shift=w, stats=w, pbar=w, pv_out=w, acc=w, o_store=w, out=w,
                    math=w, delta_prod=w, bwd_gemm_in=w, bwd_out=w, grad_acc=w)
    moved = {**{pt: w for pt in keep_fp32}, **{pt: BF16 for pt in round_bf16},
             **{pt: (w if f == "fp32" else fmt.dtype_of(f)) for pt, f in dict(formats or {}).items()}}
    for pt in list(moved):  # a point's operands follow its format (module docstring)
        if pt in _OPERANDS:
            moved[_OPERANDS[pt]] = None
    if input_scaling is not None:
        moved["input_scaling"] = input_scaling
    if pbar_scale is not None:
        moved["pbar_scale"] = float(pbar_scale)
    return replace(rc, **moved) if moved else rc


def lifted_points(knobs) -> tuple:
    """The points a layer's knobs lift to FP32: keep_fp32 plus, with pv_fp32, PV_POINTS (in ROUNDING_POINTS order)."""
    lift = set(knobs.keep_fp32) | (set(PV_POINTS) if knobs.pv_fp32 else set())
    return tuple(pt for pt in ROUNDING_POINTS if pt in lift)


def for_knobs(knobs, input_dtype: torch.dtype = BF16) -> Recipe:
    """The Recipe a layer computes: its recipe with keep_fp32 / pv_fp32 lifted, round_bf16 rounded, `formats`
    applied and the FP8 scale knobs (input_scaling, pbar_scale; "recipe" = the recipe's own)."""
    forms = dict(getattr(knobs, "formats", None) or {})
    scaling = getattr(knobs, "input_scaling", "recipe")
    pscale = getattr(knobs, "pbar_scale", "recipe")
    return resolve(knobs.recipe, input_dtype, lifted_points(knobs), tuple(knobs.round_bf16), forms,
                   None if scaling == "recipe" else scaling,
                   None if pscale == "recipe" else fmt.PBAR_SCALES[pscale])


def points_problem(recipe: str, keep_fp32, round_bf16, pv_fp32: bool = False) -> Optional[Tuple[str, object, str]]:
    """None, or (which knob, its value, what is allowed) for point lists that do not fit `recipe`: an unknown point,
    a point twice or in both lists (pv_fp32 counts as keep_fp32 = PV_POINTS), a lift of a point the recipe keeps in
    FP32 or a rounding of one it stores in BF16 already (either would change nothing, silently)."""
    base = resolve(recipe if recipe in RECIPES else "paper_bf16")
    lists = (("keep_fp32", list(keep_fp32 or ())), ("round_bf16", list(round_bf16 or ())))
    for knob, pts in lists:
        unknown = [pt for pt in pts if not isinstance(pt, str) or pt not in ROUNDING_POINTS]
        if unknown:
            return knob, pts, f"rounding points from {', '.join(ROUNDING_POINTS)} ({unknown!r} unknown)"
        if len(set(pts)) != len(pts):
            return knob, pts, "each rounding point at most once"
    both = [pt for pt in lists[1][1] if pt in lists[0][1]]
    if both:
        return "round_bf16", lists[1][1], f"no point also in keep_fp32 ({', '.join(both)} is in both)"
    both = [pt for pt in lists[1][1] if pv_fp32 and pt in PV_POINTS]
    if both:
        return "round_bf16", lists[1][1], (f"no point that pv_fp32=true lifts ({', '.join(PV_POINTS)}; "
                                           f"{', '.join(both)} is in both)")
    for knob, pts, target, word in (("keep_fp32", lists[0][1], "fp32", "lift"), ("round_bf16", lists[1][1], "bf16",
                                                                               "round")):
        same = [pt for pt in pts if _format_of(base, pt) == target]
        if same:
            allowed = [pt for pt in ROUNDING_POINTS if _format_of(base, pt) != target]
            stored = (sorted({_format_of(base, pt) for pt in allowed}, key=_FORMAT_ORDER.index)
                      or ["bf16" if target == "fp32" else "fp32"])
            return knob, pts, (f"points that recipe {recipe} stores in {' or '.join(f.upper() for f in stored)}: "
                               f"recipe {recipe} keeps {', '.join(same)} in {target.upper()} already ({word} would "
                               f"change nothing); allowed: {', '.join(allowed) or 'none'}")
    return None


_FORMAT_ORDER = ("fp32", "bf16", "fp16", "e4m3", "e5m2")


def _format_of(rc: Recipe, pt: str) -> str:
    """A point's format name, the working dtype (FP32 or FP64) read as fp32."""
    dt = getattr(rc, pt)
    return "fp32" if dt in (F32, torch.float64) else fmt.name_of(dt)


def formats_problem(recipe: str, formats, keep_fp32=(), round_bf16=(), pv_fp32: bool = False
                    ) -> Optional[Tuple[str, object, str]]:
    """None, or (knob, value, what is allowed) for a `formats` mapping that does not fit `recipe`: an unknown point
    or format, FP8 outside FP8_POINTS, a point also set by keep_fp32 / round_bf16 / pv_fp32, or a point already in
    that format (it would change nothing)."""
    if not formats:
        return None
    forms = dict(formats)
    base = resolve(recipe if recipe in RECIPES else "paper_bf16")
    for pt, f in forms.items():
        if pt not in ROUNDING_POINTS:
            return "formats", forms, f"rounding points from {', '.join(ROUNDING_POINTS)} ({pt!r} unknown)"
        if f not in fmt.FORMATS:
            return "formats", forms, f"formats from {', '.join(fmt.FORMATS)} ({pt}: {f!r} unknown)"
        if fmt.is_fp8(fmt.dtype_of(f)) and pt not in FP8_POINTS:
            return "formats", forms, (f"FP8 ({f}) only at {', '.join(FP8_POINTS)} (GEMM operands and stores); {pt} "
                                      f"allows fp32, bf16, fp16")
        others = {"keep_fp32": list(keep_fp32 or ()), "round_bf16": list(round_bf16 or ()),
                  "pv_fp32": list(PV_POINTS) if pv_fp32 else []}
        for knob, pts in others.items():
            if pt in pts:
                return "formats", forms, f"no point also set by {knob} ({pt} is in both)"
        operand = _OPERANDS.get(pt)  # e.g. fp8_te's e5m2 dP under its FP32 bwd_out: {bwd_out: fp32} lifts dP
        if _format_of(base, pt) == f and (operand is None or getattr(base, operand) is None):
            return "formats", forms, (f"a format other than the recipe's: recipe {recipe} keeps {pt} in "
                                      f"{f.upper()} already (it would change nothing)")
    return None


def round_to(x: torch.Tensor, dtype: torch.dtype, keep: torch.Tensor | None = None, scale=None) -> torch.Tensor:
    """x rounded (nearest even) to `dtype` and returned in x's dtype; where `keep` is True, x unchanged.

    `keep` broadcasts against x (e.g. (1, H, 1, 1) for heads whose values stay in the working precision). FP8
    saturates and takes `scale` (kernels/formats.py: cast(x * scale) / scale); BF16 / FP16 casts are torch's.
    """
    if dtype == x.dtype or torch.finfo(dtype).bits >= torch.finfo(x.dtype).bits:
        return x
    y = fmt.quantize(x, dtype, scale)
    return y if keep is None else torch.where(keep, x, y)


__all__ = ["Recipe", "RECIPES", "FP8_RECIPES", "ROUNDING_POINTS", "PV_POINTS", "FP8_POINTS", "INPUT_SCALINGS",
           "POINT_MEANINGS", "resolve", "for_knobs", "lifted_points", "points_problem", "formats_problem", "round_to",
           "work_dtype"]
