"""Reference tiled flash attention in plain PyTorch: FlashAttention-2 forward (Algorithm 1) and backward (Algorithm 2).

The source of truth for the recipes of kernels/recipes.py (read its docstring for the exact rounding points). Runs on
CPU and CUDA, causal, vectorised over batch and heads; the only Python loops are over tiles, and tiles wholly above
the diagonal are skipped. Autocast is disabled inside so that every intermediate's dtype comes from the recipe.
Nothing here reads a value back to the host: counters go to AttnStats as device tensors. `masking=` (kernels/masking.py)
adds what torch's SDPA allows beyond that (bool / additive masks, Tk != Tq, no causality, another scale); without it
the computation is the causal one, op for op.

Two stabilized softmaxes (the tile max m_t of a tile whose row max rm repeats within eps):
- `stabilized`: the paper's Algorithm 3 as written: m_t = beta * rm (rm > 0) or 0 (rm < 0). Kept for fidelity. It
  underflows: exp(rm - beta * rm) is 0 in FP32 from (beta - 1) * rm ~ 104 on (rm = 200, beta = 2), so l = 0 (NaN
  rows in fa2 / fp32) or the 1e-10 floor (zero rows in paper_bf16); a tile-local repeated max below the running max
  still raises m for the rest of the row; and beta = 1.0001 rounds back to P̄ = 1 in BF16.
- `stabilized_guarded`: m_t = rm + d with d = clamp((beta - 1) * |rm|, SFA_GUARD_LO, SFA_GUARD_HI), rounded to the
  stats dtype; when that rounding gives back rm (BF16 m near rm = 1000 has a spacing of 4), the next representable
  value above rm. exp(-d) is then strictly below 1 in BF16 (d >= 2^-6 > one BF16 ulp below 1) and never below
  exp(-8) (no underflow, far above the 1e-10 floor). It fires only when the tile's repeated max reaches the running
  max (rm + SFA_GUARD_LO > m): a repeated max below it already gives P̄ < 1 and must not raise m. Where even the next
  representable value lies more than SFA_GUARD_HI above rm (|rm| >= 2048 in BF16) it does not fire, and the row is
  counted (AttnStats.sfa_p1_rows) instead of underflowing.
Both are counted, not silent (with counters on): rows whose row sum fell under the floor (AttnStats.underflow_rows)
and (row, tile) pairs where the shift fired but P̄ still rounded to 1 (AttnStats.sfa_p1_rows).

stochastic_round: the BF16 stores of the P̄V product and of the O accumulator (paper_bf16's pv_out and acc) round
stochastically (kernels/stochastic.py), nothing else does: P̄, m, l, the stored O and the backward stay nearest-even.

Other formats (kernels/formats.py, kernels/recipes.py "Formats"): every store goes through `_Plan.r`, which casts to
the point's format (FP8 saturating, with its scale) and, with counters on, counts per head what the cast did
(AttnStats.fp16_overflow, fp8_saturated, pbar_flushed), in the forward and in the backward, on the device.
Over 400 lines because the forward and the backward share one plan of rounding points, formats, scales and masks
(_Plan): split, the two halves of a recipe could drift apart.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import torch

from flash_forensics.kernels import formats as fmt
from flash_forensics.kernels import tensor_core as tc
from flash_forensics.kernels import tf32x3
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.knobs import PBAR_CLAMP
from flash_forensics.kernels.masking import Masking
from flash_forensics.kernels.recipes import Recipe, for_knobs, round_to
from flash_forensics.kernels.stats import AttnStats
from flash_forensics.kernels.stochastic import call_key, stochastic_round, uniform16

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SFA_GUARD_LO = 2.0 ** -6  # smallest shift above rm: exp(-2^-6) = 0.9845 rounds to 0.984375 in BF16, not to 1
SFA_GUARD_HI = 8.0  # largest: exp(-8) = 3.4e-4, far from FP32/BF16 underflow and from paper_bf16's 1e-10 floor
LOG2E = float(torch.tensor(1.4426950408889634, dtype=torch.float32))  # log2(e) as an FP32 constant (kernels)
LN2 = float(torch.tensor(0.6931471805599453, dtype=torch.float32))


@dataclass
class _Plan:
    """Everything the tile loops need, decided once per call from the knobs and the input."""

    rc: Recipe
    bq: int
    bk: int
    scale: float
    stabilized: bool  # Algorithm 3, exact or guarded
    guarded: bool  # the guarded variant (module docstring)
    beta: float
    eps: float
    delta: str
    o_keep: Optional[torch.Tensor]  # (1, H, 1, 1) bool: heads (o_fp32) whose P̄V path and stored O stay in `math`
    clamp: bool  # pbar_clamp: see _clamped
    trace: Optional[dict] = None  # point -> [(value before, value stored)], when a caller asks (tests)
    sr_seed: Optional[int] = None  # stochastic_round: its seed (None: off)
    sr_key: Optional[torch.Tensor] = None  # stochastic_round: the call's key (kernels/stochastic.py), set by forward
    stats: Optional[AttnStats] = None  # where the format counters go (counters on), else None
    rot: Optional[torch.Tensor] = None  # incoherent: the (D, D) rotation of Q and K
    masking: Optional[Masking] = None  # None: causal self-attention (kernels/masking.py)
    tk: int = 0  # the number of keys
    tf32x3: bool = False  # fp32_gemm=tf32x3: every GEMM as three TF32 passes (kernels/tf32x3.py)
    exp_form: str = "exp"  # how P̄ = exp(S - m) is evaluated (knob exp_form; `expd`, `alpha`)
    c_log2: float = 0.0  # exp2_folded: scale * log2(e) rounded to FP32, as FlashAttention-2 passes it
    reverse: bool = False  # key_order=reverse: a query tile visits its key tiles last to first
    reciprocal: bool = False  # normalize=reciprocal: O = acc * (1 / l)
    kv_split: int = 0  # keys per split-KV part (0: none)
    tc: Optional[str] = None  # tensor_core knob (None: exact GEMMs)
    thread_sums: bool = False  # rowsum_order=fa2_threads: l as 4 per-thread partial sums (`_thread_sums`)

    def mm(self, a: torch.Tensor, b: torch.Tensor, acc: Optional[torch.Tensor] = None,
           narrow: bool = False) -> torch.Tensor:
        """A GEMM of the tile loops: acc + a @ b (acc None: a @ b), or its 3xTF32 model where fp32_gemm=tf32x3 (FP32
        work dtype only), or the tensor-core model (kernels/tensor_core.py) where the knob asks for it and the
        operands are `narrow` (stored in 16 bits or fewer): acc then enters the MMA as its C operand."""
        if self.tc is not None and narrow:
            fp8 = fmt.is_fp8(self.rc.inputs) or fmt.is_fp8(self.rc.pbar)
            return tc.matmul(a, b, acc, *tc.params(self.tc, fp8))
        out = tf32x3.matmul(a, b) if self.tf32x3 else a @ b
        return out if acc is None else acc + out

    def expd(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """P̄ = exp(x - m) for stored scores x and running max m, as exp_form evaluates it (the difference stored at
        `shift`). exp2_folded: x, m are the unscaled scores and exp2(fl(x * c) - fl(m * c)), c = fl(scale *
        log2(e)); exp2_mul: exp2(fl(d * log2(e))), Triton's tl.exp. exp2 is exact-then-rounded to FP32 (the GPUs'
        ex2.approx is not specified bit for bit: results/real_kernels/README.md)."""
        if self.exp_form == "exp":
            return torch.exp(self.r("shift", x - m))
        if self.exp_form == "exp2_folded":
            return _exp2(self.r("shift", _f32(x * self.c_log2) - _f32(m * self.c_log2)))
        return _exp2(_f32(self.r("shift", x - m) * LOG2E))

    def alpha(self, m_old: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
        """The rescale exp(m_old - m_new) of the running state (exp2_folded: exp2(fl((m_old - m_new) * c)))."""
        if self.exp_form == "exp":
            return torch.exp(self.r("shift", m_old - m_new))
        c = self.c_log2 if self.exp_form == "exp2_folded" else LOG2E
        return _exp2(_f32(self.r("shift", m_old - m_new) * c))

    def normalized(self, acc: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
        """O = acc / l, or acc * fl(1 / l) (normalize=reciprocal, FlashAttention-2's normalize_softmax_lse)."""
        return acc * _f32(1.0 / l) if self.reciprocal else acc / l

    def lse(self, l: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """log(l) + m in the scale of the scaled scores (exp2_folded keeps m unscaled: m * scale + log(l))."""
        if self.exp_form == "exp":
            return torch.log(l) + m
        mm = m * self.scale if self.exp_form == "exp2_folded" else m
        return _f32(mm.double() + _logf(l).double()).to(l.dtype)  # FMA: one rounding

    def key_stop(self, qe: int) -> int:
        """End of the key tiles a query tile ending at row qe visits: past the last query row (causal) all masked."""
        return min(qe, self.tk) if self.masking is None or self.masking.causal else self.tk

    def tile(self, qs: int, qe: int, ks: int, ke: int, dev):
        """(mask True = masked, or None; the additive bias of the tile, or None)."""
        if self.masking is None:
            return _causal_mask(qs, qe, ks, ke, dev), None
        mk = self.masking
        mask = _causal_mask(qs, qe, ks, ke, dev) if mk.causal else None
        if mk.keep is not None:
            drop = ~mk.keep[:, :, qs:qe, ks:ke]
            mask = drop if mask is None else (mask | drop)
        bias = None if mk.bias is None else mk.bias[:, :, qs:qe, ks:ke].to(self.rc.work)
        return mask, bias

    def r(self, point: str, x: torch.Tensor, keep: Optional[torch.Tensor] = None,
          dtype: Optional[torch.dtype] = None, scale=None) -> torch.Tensor:
        """x stored at rounding point `point` (kernels/recipes.py): rounded to the recipe's dtype there (lifted by
        keep_fp32 / pv_fp32, lowered by round_bf16, set by formats; `dtype`: an operand's own, e.g. dS), except
        where `keep` (o_fp32 heads). FP8 takes `scale` (None: the tile's own amax per (batch, head)). Every point
        goes through here, so a trace sees each stored value next to the value it was rounded from."""
        dtype = getattr(self.rc, point) if dtype is None else dtype
        if scale is None and fmt.is_fp8(dtype) and fmt.bits(dtype) < fmt.bits(x.dtype):
            scale = fmt.amax_scale(x, dtype, (2, 3))
        y = round_to(x, dtype, keep, scale)
        if self.stats is not None and y is not x:
            self.count(point, x, y, dtype, scale, keep)
        if self.trace is not None:
            self.trace.setdefault(point, []).append((x.detach().clone(), y.detach().clone()))
        return y

    def count(self, point: str, x, y, dtype, scale, keep) -> None:
        """The format counters of one store (device adds, no sync)."""
        st = self.stats
        if dtype == torch.float16:
            inf = float("inf")
            st.update_format("fp16_overflow", (y.abs() == inf) & (x.abs() != inf))  # NaN stays NaN: not counted
        elif fmt.is_fp8(dtype):
            sat = fmt.saturated(x, dtype, scale)
            st.update_format("fp8_saturated", sat if keep is None else sat & ~keep)
        if point == "pbar":
            st.update_format("pbar_flushed", (x > 0) & (y == 0))

    def inputs(self, xs, dtype: torch.dtype, blocks, rotate=()) -> list:
        """Q, K, V (or dO) in the working dtype as they enter the GEMMs: rotated where `rotate` (incoherent), then
        cast to `dtype` with the input scale (FP8: input_scaling; kernels/formats.py), counted as the stores are."""
        out = []
        for i, (x, block) in enumerate(zip(xs, blocks, strict=True)):
            x = x.to(self.rc.work)
            if self.rot is not None and i in rotate:
                x = x @ self.rot
            scale = fmt.input_scale(x, dtype, self.rc.input_scaling, block) if fmt.bits(dtype) < fmt.bits(x.dtype) \
                else None
            y = round_to(x, dtype, None, scale)
            if self.stats is not None and y is not x:
                self.count("inputs", x, y, dtype, scale, None)
            out.append(y)
        return out

    def r_sr(self, point: str, x: torch.Tensor, stream: int) -> torch.Tensor:
        """r(point, x, o_keep) for the two stochastic_round points (pv_out, acc): with the knob on, a BF16 store
        rounds stochastically (kernels/stochastic.py), `stream` naming the point and tile; else nearest, as r."""
        if self.sr_key is None or getattr(self.rc, point) != torch.bfloat16 or x.dtype != torch.float32:
            return self.r(point, x, self.o_keep)
        y = stochastic_round(x, uniform16(self.sr_key, stream, x.shape, x.device), self.o_keep)
        if self.trace is not None:
            self.trace.setdefault(point, []).append((x.detach().clone(), y.detach().clone()))
        return y


def _f32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to FP32 and back to its dtype (the FP32 ops of the working dtype; a no-op on FP32 x)."""
    return x.to(torch.float32).to(x.dtype)


def _exp2(x: torch.Tensor) -> torch.Tensor:
    """2^x computed in FP64 and rounded to x's dtype (correctly rounded but for rare double roundings)."""
    return torch.exp2(x.to(torch.float64)).to(x.dtype)


def _logf(x: torch.Tensor) -> torch.Tensor:
    """log(x) as fast-math __logf computes it: log2(x) (rounded) times ln 2 (rounded)."""
    return _f32(_f32(torch.log2(x.to(torch.float64)).to(x.dtype)) * LN2)


def _plan(knobs: AttentionKnobs, q: torch.Tensor, trace: Optional[dict] = None,
          stats: Optional[AttnStats] = None, masking: Optional[Masking] = None,
          tk: Optional[int] = None) -> _Plan:
    B, H, T, D = q.shape
    tk = T if tk is None else tk
    rc = for_knobs(knobs, q.dtype)  # the recipe with keep_fp32 / pv_fp32 / round_bf16 applied
    bq, bk = (knobs.block_q, knobs.block_k) if knobs.tiling else (T, tk)
    heads = knobs.fp32_o_heads(H)
    o_keep = None
    if heads:
        o_keep = torch.zeros(1, H, 1, 1, dtype=torch.bool, device=q.device)
        o_keep[0, heads] = True
    scale = D ** -0.5 if masking is None or masking.scale is None else float(masking.scale)
    return _Plan(rc=rc, bq=min(bq, T), bk=min(bk, tk), scale=scale,
                 stabilized=knobs.softmax in ("stabilized", "stabilized_guarded"),
                 guarded=knobs.softmax == "stabilized_guarded", beta=float(knobs.beta), eps=float(knobs.eps),
                 delta=knobs.delta, o_keep=o_keep, clamp=bool(knobs.pbar_clamp), trace=trace,
                 sr_seed=int(knobs.sr_seed) if knobs.stochastic_round else None,
                 stats=stats if (stats is not None and knobs.counters) else None,
                 rot=fmt.rotation(D, rc.work, q.device) if getattr(knobs, "incoherent", False) else None,
                 masking=masking, tk=tk,
                 tf32x3=getattr(knobs, "fp32_gemm", "ieee") == "tf32x3" and rc.work == torch.float32,
                 exp_form=getattr(knobs, "exp_form", "exp"),
                 c_log2=_as_f32(scale * 1.4426950408889634),
                 reverse=getattr(knobs, "key_order", "forward") == "reverse",
                 reciprocal=getattr(knobs, "normalize", "divide") == "reciprocal",
                 kv_split=int(getattr(knobs, "kv_split", 0)),
                 tc=None if getattr(knobs, "tensor_core", "exact") == "exact" else knobs.tensor_core,
                 thread_sums=getattr(knobs, "rowsum_order", "torch") == "fa2_threads")


def _as_f32(x: float) -> float:
    """x rounded to FP32, in plain Python: a tensor's .item() would break a torch.compile graph here."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _causal_mask(qs: int, qe: int, ks: int, ke: int, device) -> Optional[torch.Tensor]:
    """(rows, cols) True above the diagonal; None when the tile has no masked entry."""
    if ke - 1 <= qs:
        return None
    return torch.arange(ks, ke, device=device)[None, :] > torch.arange(qs, qe, device=device)[:, None]


def _narrow(*dtypes) -> bool:
    return all(fmt.bits(d) <= 16 for d in dtypes)


def _scores(p: _Plan, qi: torch.Tensor, kj: torch.Tensor, mask, fill: float, bias=None, raw: bool = False,
            operand: Optional[torch.dtype] = None) -> torch.Tensor:
    """S of one tile, scaled (raw: unscaled, exp_form=exp2_folded's forward), masked to `fill`. `operand`: the
    dtype Q, K entered in (the tensor-core model runs where it is narrow)."""
    s = p.r("scores", p.mm(qi, kj.transpose(-1, -2), narrow=_narrow(operand or p.rc.inputs)))
    if raw:
        return s if mask is None else s.masked_fill(mask, fill)
    s = p.r("scores", s * p.scale)
    if bias is not None:  # SDPA's additive mask: added to the scaled scores, a `scores` op
        s = p.r("scores", s + bias)
    return s if mask is None else s.masked_fill(mask, fill)


def _tile_max(p: _Plan, s: torch.Tensor, mask, count: bool):
    """Row max of a tile and Algorithm 3's shifted max; `rep` (rows where the max repeats) when needed."""
    rm = s.amax(dim=-1, keepdim=True)
    rep = None
    if p.stabilized or count:
        close = s >= p.r("scores", rm - p.eps)
        if mask is not None:
            close = close & ~mask
        rep = close.sum(dim=-1, keepdim=True) > 1
    if not p.stabilized or p.guarded:
        return rm, rm, rep
    # A repeated max of exactly 0 is left alone by Algorithm 3 (neither > 0 nor < 0): P̄ = exp(0) = 1 survives there.
    mt = torch.where(rep & (rm > 0), p.r("scores", rm * p.beta), rm)
    mt = torch.where(rep & (mt < 0), torch.zeros_like(mt), mt)
    return rm, mt, rep


def _new_max(p: _Plan, m: torch.Tensor, rm: torch.Tensor, mt: torch.Tensor, rep):
    """(running max after the tile, rows where the stabilized shift fired (None: safe softmax))."""
    rc = p.rc
    if not p.stabilized:
        return p.r("stats", torch.maximum(m, mt)), None
    # `fired`: rows where Algorithm 3 is meant to act (a repeated max; guarded: one that reaches the running max)
    if not p.guarded:
        return p.r("stats", torch.maximum(m, mt)), rep
    d = ((p.beta - 1.0) * rm.abs()).clamp(SFA_GUARD_LO, SFA_GUARD_HI)
    shifted = p.r("stats", rm + d)
    up = torch.nextafter(rm.to(rc.stats), torch.full_like(rm, float("inf"), dtype=rc.stats)).to(rm.dtype)
    shifted = torch.where(shifted > rm, shifted, up)
    fire = rep & (rm + SFA_GUARD_LO > m) & (shifted - rm <= SFA_GUARD_HI)
    return p.r("stats", torch.maximum(m, torch.where(fire, shifted, rm))), rep & (rm + SFA_GUARD_LO > m)


def _tile_shift(p: _Plan, s: torch.Tensor, m: torch.Tensor, mask, want_rep: bool):
    """(tile row max, `rep`, running max after the tile, rows where the stabilized shift fired): P̄ = exp(S - m) of
    the tile uses the running max. One function for the forward and for pbar_clamp's backward, which must rebuild
    the forward's m exactly."""
    rm, mt, rep = _tile_max(p, s, mask, want_rep)
    m_new, fired = _new_max(p, m, rm, mt, rep)
    return rm, rep, m_new, fired


def _clamped(p: _Plan, pbar: torch.Tensor, rep: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """pbar_clamp, the clamp-only ablation: where P̄ = 1 in a row whose tile max repeats (`rep`, the rows Algorithm 3
    and the counters call repeated), the P̄ fed to P̄V is PBAR_CLAMP, the largest BF16 value below 1. Returns that mask
    (None when the knob is off). m, l and lse are not changed: every other P̄ entry, and the softmax statistics the
    backward reads, are bit-identical to the unclamped run. l sums the unclamped P̄, so a row's weights sum to 1
    less (1 - PBAR_CLAMP) times the softmax weights of its clamped entries: only P̄V sees the clamp."""
    return (rep & (pbar == 1)) if p.clamp else None


def _key_schedule(p: _Plan, qe: int):
    """The key tiles a query tile ending at row qe visits, as lists of (ks, ke) per split-KV part (one part without
    kv_split), each in the knob's key order. Tiles past the last query row are wholly masked (causal): skipped."""
    starts = list(range(0, p.key_stop(qe), p.bk))
    if p.kv_split:
        groups = [[ks for ks in starts if ks // p.kv_split == g] for g in range(-(-p.tk // p.kv_split))]
        groups = [g for g in groups if g]
    else:
        groups = [starts]
    return [[(ks, min(ks + p.bk, p.tk)) for ks in (g[::-1] if p.reverse else g)] for g in groups]


def _online(p: _Plan, qi, kw, vw, qs: int, qe: int, tiles, fill: float, m_init: float, stats, capture, masking):
    """The online softmax of one query tile over `tiles`: (O accumulator, l, m, the unfloored row sum or None)."""
    rc, w = p.rc, p.rc.work
    B, H, _, D = qi.shape
    dev = qi.device
    count = stats is not None
    m = torch.full((B, H, qe - qs, 1), m_init, dtype=w, device=dev)
    l = torch.zeros_like(m)
    acc = torch.zeros(B, H, qe - qs, D, dtype=w, device=dev)
    l_raw = torch.zeros_like(m) if count else None
    fused = p.tc is not None and rc.pv_out == w and rc.acc == w  # P̄V accumulates into O_acc (the MMA's C)
    quad = torch.zeros(B, H, qe - qs, 4, dtype=w, device=dev) if p.thread_sums else None
    narrow = _narrow(rc.pbar, rc.inputs)
    for ks, ke in tiles:
        mask, bias = p.tile(qs, qe, ks, ke, dev)
        folded = p.exp_form == "exp2_folded"
        want_rep = count or capture is not None or p.clamp
        s = _scores(p, qi, kw[:, :, ks:ke], mask, fill, bias, raw=folded)
        rm, rep, m_new, fired = _tile_shift(p, s, m, mask, want_rep and not folded)
        if folded and want_rep:  # repeated maxima and the max logit on the scaled scores, as exp_form=exp has them
            s_sc = p.r("scores", s * p.scale)
            rm, _, rep = _tile_max(p, s_sc if mask is None else s_sc.masked_fill(mask, fill), mask, True)
        pbar = p.expd(s, m_new)
        alpha = p.alpha(m, m_new)
        rowsum = pbar.sum(dim=-1, keepdim=True)
        if count:  # the unfloored row sum: what tells an underflowed row from a small tile contribution
            l_raw = alpha * l_raw + rowsum
        if rc.rowsum_floor:
            rowsum = rowsum.clamp_min(rc.rowsum_floor)
        if quad is not None:
            quad = _thread_sums(quad * alpha, pbar)
            l = p.r("stats", (quad[..., 0:1] + quad[..., 2:3]) + (quad[..., 1:2] + quad[..., 3:4]))
        else:
            l = p.r("stats", alpha * l + rowsum)
        tie = _clamped(p, pbar, rep)
        pbar_pv = pbar if tie is None else torch.where(tie, PBAR_CLAMP, pbar)  # l above: the unclamped P̄
        pbar_in = p.r("pbar", pbar_pv, p.o_keep, scale=rc.pbar_scale)
        if count:
            p1 = None if fired is None else fired & (pbar_in >= 1).any(dim=-1, keepdim=True)
            # a mask other than causal: a (row, tile) pair counts where the row has a key in the tile, so
            # rows_seen matches the causal path, which skips the tiles wholly above the diagonal
            seen = (None if masking is None or mask is None else
                    (~mask).any(dim=-1, keepdim=True).expand(B, H, -1, 1))
            stats.update(rep, rm, sfa_p1=p1, seen=seen)
        tile = ((qs // p.bq) << 16 | (ks // p.bk)) << 2  # stream ids of this tile's stochastic_round points
        if fused:
            acc = p.mm(pbar_in, vw[:, :, ks:ke], acc * alpha, narrow=narrow)
        else:
            pv = p.r_sr("pv_out", p.mm(pbar_in, vw[:, :, ks:ke], narrow=narrow), tile)
            acc = p.r_sr("acc", p.r_sr("acc", acc * alpha, tile | 1) + pv, tile | 2)
        m = m_new
        if capture is not None:
            capture["tiles"].append(dict(qs=qs, ks=ks, p_bar=pbar.clone(), p_bar_pv=pbar_pv.clone(), rep=rep,
                                         mask=mask, rm=rm, m=m_new))
    return acc, l, m, l_raw


def _thread_sums(quad: torch.Tensor, pbar: torch.Tensor) -> torch.Tensor:
    """rowsum_order=fa2_threads: the 4 threads of an mma.sync row each add their own columns of the tile, in
    order, to their running partial sum (thread t: columns 8j + 2t, 8j + 2t + 1; FlashAttention-2's reduce_sum
    without warp_reduce); quad (B, H, rows, 4), already rescaled."""
    n = pbar.shape[-1]
    for j in range(0, n, 8):
        for half in (0, 1):
            cols = [j + 2 * t + half for t in range(4)]
            ok = [c < n for c in cols]
            vals = torch.stack([pbar[..., c] if c < n else torch.zeros_like(pbar[..., 0]) for c in cols], -1)
            quad = torch.where(torch.tensor(ok, device=quad.device), quad + vals, quad)
    return quad


def _combine(p: _Plan, parts):
    """FlashAttention-2's split-KV combine of the parts' (O, lse): lse = log(sum exp(lse_i - max)) + max, O = sum
    exp(lse_i - lse) O_i as FMAs in part order; exp and log as the exp_form computes them (fast-math expf/logf
    outside exp_form=exp). Parts with no key (lse -inf) weigh 0."""
    fast = p.exp_form != "exp"
    ex = (lambda x: _exp2(_f32(x * LOG2E))) if fast else torch.exp
    lg = _logf if fast else torch.log
    lses = [x[1] for x in parts]
    top = lses[0]
    for x in lses[1:]:
        top = torch.maximum(top, x)
    total = torch.zeros_like(top)
    for x in lses:
        total = total + ex(x - top)
    lse = lg(total) + top
    o = torch.zeros_like(parts[0][0])
    for o_i, x in parts:
        o = _f32(o.double() + ex(x - lse).double() * o_i.double())  # an FMA: one rounding
    return o, lse


def forward(q, k, v, knobs: AttentionKnobs, stats: Optional[AttnStats] = None, capture: Optional[dict] = None,
            trace: Optional[dict] = None, masking: Optional[Masking] = None):
    """One forward pass without autograd. Returns (O returned, O stored for delta, lse (B, H, T, 1) in the working
    dtype).

    `trace`, if a dict, receives for each rounding point the list of (value before, value stored) pairs, in order.

    `capture`, if a dict, receives debug copies: "tiles" = list of dicts (qs, ks, p_bar, p_bar_pv, rep, mask, rm, m)
    per tile, "o_bar" = the O accumulator before the division (B, H, T, D), "l", "m" (B, H, T, 1).
    """
    B, H, T, D = q.shape
    p = _plan(knobs, q, trace, stats, masking, k.shape[2])
    if p.exp_form == "exp2_folded" and masking is not None and masking.bias is not None:
        raise ValueError("attention.exp_form='exp2_folded' is not allowed with an additive attn_mask: expected "
                         "exp or exp2_mul (the folded form scales the scores inside exp2, after the bias)")
    rc, w = p.rc, p.rc.work
    dev = q.device
    count = stats is not None and knobs.counters
    qw, kw, vw = p.inputs((q, k, v), rc.inputs, (p.bq, p.bk, p.bk), rotate=(0, 1))
    o_fp8 = fmt.is_fp8(rc.o_store)  # an FP8 O takes its per-tensor scale once O is complete
    if p.sr_seed is not None:  # bits keyed by the seed and these inputs: a replay redraws them exactly
        p.sr_key = call_key(p.sr_seed, qw, kw, vw)
    fill = -torch.finfo(rc.scores).max
    m_init = -torch.finfo(rc.stats).max
    o_saved = torch.empty(B, H, T, D, dtype=w, device=dev)
    lse = torch.empty(B, H, T, 1, dtype=w, device=dev)
    if capture is not None:
        capture.update(tiles=[], o_bar=torch.empty_like(o_saved), l=torch.empty_like(lse), m=torch.empty_like(lse))
    for qs in range(0, T, p.bq):
        qe = min(qs + p.bq, T)
        parts = [_online(p, qw[:, :, qs:qe], kw, vw, qs, qe, tiles, fill, m_init, stats if count else None,
                         capture, masking) for tiles in _key_schedule(p, qe)]
        if len(parts) == 1:
            acc, l, m, l_raw = parts[0]
            o_i, lse_i = p.normalized(acc, l), p.lse(l, m)
        else:  # split-KV: each part's O and lse, combined (FlashAttention-2's combine kernel)
            acc, l, m, l_raw = parts[0]  # capture: the first part's
            o_i, lse_i = _combine(p, [(p.normalized(a_, l_), p.lse(l_, m_)) for a_, l_, m_, _ in parts])
            if count:  # the row underflowed when every part did
                l_raw = torch.stack([x[3] for x in parts]).amax(dim=0)
        if count:  # row sum under the floor (or NaN): the row's P̄ all underflowed (exact Algorithm 3)
            stats.update_underflow(~(l_raw >= (rc.rowsum_floor or torch.finfo(w).tiny)))
        o_saved[:, :, qs:qe] = o_i if o_fp8 else p.r("o_store", o_i, p.o_keep)
        lse[:, :, qs:qe] = lse_i
        if capture is not None:
            capture["o_bar"][:, :, qs:qe] = acc
            capture["l"][:, :, qs:qe] = l
            capture["m"][:, :, qs:qe] = m
    if o_fp8:  # per-tensor current scaling of the complete O; kept in the working dtype (FP8 has no arithmetic)
        o_saved = p.r("o_store", o_saved, p.o_keep, scale=fmt.amax_scale(o_saved, rc.o_store, (0, 1, 2, 3)))
        return o_saved.to(rc.out), o_saved, lse
    # Saved for the backward in its storage dtype (BF16 for paper_bf16 / fa2), unless some heads keep FP32.
    return o_saved.to(rc.out), (o_saved if p.o_keep is not None else o_saved.to(rc.o_store)), lse


def _key_tiles(p: _Plan, qi, kw, qs: int, qe: int, lse_i, dev):
    """The key tiles of one query tile, in the forward's order: (ks, ke, P, tie) with P = exp(S - lse) and `tie` the
    forward's pbar_clamp mask (None when off), rebuilt from the running max exactly as the forward computed it."""
    T = kw.shape[2]
    m = torch.full_like(lse_i, -torch.finfo(p.rc.stats).max) if p.clamp else None
    for ks in range(0, p.key_stop(qe), p.bk):
        ke = min(ks + p.bk, T)
        mask, bias = p.tile(qs, qe, ks, ke, dev)
        s = _scores(p, qi, kw[:, :, ks:ke], mask, float("-inf"), bias, operand=p.rc.operand("bwd_inputs"))
        tie = None
        if p.clamp:  # masked scores are -inf here (-max there): neither moves m, nor is P̄ = 1 at them
            _, rep, m, _ = _tile_shift(p, s, m, mask, True)
            tie = _clamped(p, torch.exp(p.r("shift", s - m)), rep)
        yield ks, ke, torch.exp(s - lse_i), tie  # masked: exp(-inf) = 0


def _tie_scaled(x, tie):
    """pbar_clamp's c o x: PBAR_CLAMP * x where the forward clamped P̄ (`tie`), x elsewhere (tie None: x)."""
    return x if tie is None else torch.where(tie, PBAR_CLAMP * x, x)


def _tile_delta(p: _Plan, qi, kw, vw, doi, o_saved, lse_i, qs: int, qe: int):
    """The row term delta (B, H, rows, 1) of one query tile, as the knobs' delta mode computes it (recipes.py):
    dO_O from the stored O; dP_P and recompute_fp32 by a first pass over the key tiles, before any gradient uses it."""
    w = p.rc.work
    if p.delta == "dO_O":
        o_i = o_saved[:, :, qs:qe].to(w)
        return p.r("delta_prod", doi * o_i, p.o_keep).sum(dim=-1, keepdim=True)
    delta = torch.zeros(*doi.shape[:-1], 1, dtype=w, device=doi.device)
    o_hp = torch.zeros_like(doi)
    for ks, ke, pt, tie in _key_tiles(p, qi, kw, qs, qe, lse_i, doi.device):
        if p.delta == "dP_P":
            dp = p.r("bwd_out", p.mm(doi, vw[:, :, ks:ke].transpose(-1, -2)), dtype=p.rc.operand("dp_out"))
            delta = delta + (dp * _tie_scaled(pt, tie)).sum(dim=-1, keepdim=True)
        else:  # recompute_fp32: O = P V with nothing rounded
            o_hp = o_hp + p.mm(_tie_scaled(pt, tie), vw[:, :, ks:ke])
    return delta if p.delta == "dP_P" else (doi * o_hp).sum(dim=-1, keepdim=True)


def row_delta(q, k, v, o_saved, lse, do, knobs: AttentionKnobs) -> torch.Tensor:
    """delta (B, H, T, 1) in the working dtype exactly as `backward` computes it for these knobs (the probes'
    delta_recipe, orchestrator/monitor/probes); o_saved and lse are `forward`'s."""
    p = _plan(knobs, q)
    qw, kw, vw, dow = _bwd_inputs(p, q, k, v, do)
    T = q.shape[2]
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        return torch.cat([_tile_delta(p, qw[:, :, qs:min(qs + p.bq, T)], kw, vw, dow[:, :, qs:min(qs + p.bq, T)],
                                      o_saved, lse[:, :, qs:min(qs + p.bq, T)], qs, min(qs + p.bq, T))
                          for qs in range(0, T, p.bq)], dim=2)


def _bwd_inputs(p: _Plan, q, k, v, do):
    """Q, K, V in the backward's input format (rotated if incoherent) and dO in its own (kernels/recipes.py)."""
    rc = p.rc
    qw, kw, vw = p.inputs((q, k, v), rc.operand("bwd_inputs"), (p.bq, p.bk, p.bk), rotate=(0, 1))
    (dow,) = p.inputs((do,), rc.operand("do_in"), (p.bq,))
    return qw, kw, vw, dow


def backward(q, k, v, o_saved, lse, do, knobs: AttentionKnobs, trace: Optional[dict] = None,
             stats: Optional[AttnStats] = None, masking: Optional[Masking] = None):
    """Gradients (dq, dk, dv) in the inputs' dtypes, from the forward's stored O and lse (`trace` as in forward).

    pbar_clamp: O = (c o P) V with c = PBAR_CLAMP where the forward clamped P̄ (`tie`) and 1 elsewhere, P the
    unclamped softmax (lse is unclamped). c is held constant (it is piecewise constant in S), so: dV = (c o P)^T dO,
    the clamped P̄ being what multiplied V; dP = dO V^T as usual; dS = P o (c o dP - delta) with
    delta = rowsum(dO o O) = rowsum(dP o c o P), which is what dP_P sums and what recompute_fp32's O = (c o P) V gives.
    """
    B, H, T, D = q.shape
    p = _plan(knobs, q, trace, stats, masking, k.shape[2])
    rc, w = p.rc, p.rc.work
    dev = q.device
    qw, kw, vw, dow = _bwd_inputs(p, q, k, v, do)
    ds_in, dp_out = rc.operand("ds_in"), rc.operand("dp_out")
    bwd_in, do_in = rc.operand("bwd_inputs"), rc.operand("do_in")  # where the tensor-core model applies
    nar_pv, nar_dp, nar_ds = _narrow(rc.bwd_gemm_in, do_in), _narrow(do_in, bwd_in), _narrow(ds_in, bwd_in)
    dq = torch.zeros(B, H, T, D, dtype=w, device=dev)
    dk = torch.zeros(B, H, p.tk, D, dtype=w, device=dev)
    dv = torch.zeros_like(dk)

    for qs in range(0, T, p.bq):
        qe = min(qs + p.bq, T)
        qi, doi, lse_i = qw[:, :, qs:qe], dow[:, :, qs:qe], lse[:, :, qs:qe]
        delta = _tile_delta(p, qi, kw, vw, doi, o_saved, lse_i, qs, qe)
        dq_i = torch.zeros(B, H, qe - qs, D, dtype=w, device=dev)
        for ks, ke, pt, tie in _key_tiles(p, qi, kw, qs, qe, lse_i, dev):
            kj, vj = kw[:, :, ks:ke], vw[:, :, ks:ke]
            p_in = p.r("bwd_gemm_in", _tie_scaled(pt, tie), scale=rc.pbar_scale)
            dv_c = p.r("bwd_out", p.mm(p_in.transpose(-1, -2), doi, narrow=nar_pv))
            dv[:, :, ks:ke] = p.r("grad_acc", dv[:, :, ks:ke] + dv_c)
            dp = p.r("bwd_out", p.mm(doi, vj.transpose(-1, -2), narrow=nar_dp), dtype=dp_out)
            ds = p.r("bwd_gemm_in", (pt * p.scale) * (_tie_scaled(dp, tie) - delta), dtype=ds_in)
            dq_i = p.r("grad_acc", dq_i + p.r("bwd_out", p.mm(ds, kj, narrow=nar_ds)))
            dk[:, :, ks:ke] = p.r("grad_acc", dk[:, :, ks:ke] + p.r("bwd_out", p.mm(ds.transpose(-1, -2), qi,
                                                                                     narrow=nar_ds)))
        dq[:, :, qs:qe] = dq_i
    if p.rot is not None:  # incoherent: the gradients of the rotated Q, K, rotated back (M orthogonal)
        dq, dk = dq @ p.rot.transpose(0, 1), dk @ p.rot.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, knobs, stats, masking=None):
        with torch.autocast(device_type=q.device.type, enabled=False):
            o, o_saved, lse = forward(q, k, v, knobs, stats, masking=masking)
        ctx.knobs, ctx.masking = knobs, masking
        ctx.stats = stats  # the backward's stores are counted too (format counters only)
        ctx.save_for_backward(q, k, v, o_saved, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o_saved, lse = ctx.saved_tensors
        with torch.autocast(device_type=q.device.type, enabled=False):
            dq, dk, dv = backward(q, k, v, o_saved, lse, do, ctx.knobs, stats=ctx.stats, masking=ctx.masking)
        return dq, dk, dv, None, None, None


def check_inputs(q, k, v, cfg, stats=None, masking: Optional[Masking] = None) -> AttentionKnobs:
    """Validate before computing: ValueError naming the argument or key, the value and what is allowed."""
    if not isinstance(cfg, AttentionKnobs):
        raise ValueError(f"cfg={type(cfg).__name__} is not allowed: expected "
                         "flash_forensics.kernels.config.AttentionKnobs or AttentionConfig")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}={type(x).__name__} is not allowed: expected a torch.Tensor")
        if x.dim() != 4:
            raise ValueError(f"{name}.shape={tuple(x.shape)} is not allowed: expected 4 dims (B, H, T, D)")
        if x.dtype not in _DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is not allowed: expected one of {_DTYPES}")
    if any(n == 0 for n in q.shape):
        raise ValueError(f"q.shape={tuple(q.shape)} is not allowed: expected every dim > 0")
    for name, x in (("k", k), ("v", v)):
        if masking is not None:  # keys of their own count (Tk), the rest as q's
            want = (*q.shape[:2], k.shape[2], q.shape[3])
            if x.shape != want or k.shape[2] == 0:
                raise ValueError(f"{name}.shape={tuple(x.shape)} is not allowed: expected (B, H, Tk, D) = "
                                 f"{(*q.shape[:2], 'Tk > 0', q.shape[3])} with k and v of one Tk")
        elif x.shape != q.shape:
            raise ValueError(f"{name}.shape={tuple(x.shape)} is not allowed: expected q's shape {tuple(q.shape)} "
                             "(causal self-attention)")
        if x.dtype != q.dtype:
            raise ValueError(f"{name}.dtype={x.dtype} is not allowed: expected q's dtype {q.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}.device={x.device} is not allowed: expected q's device {q.device}")
    cfg.validate(n_head=q.shape[1])
    D = q.shape[-1]
    if getattr(cfg, "incoherent", False) and (D & (D - 1)):
        raise ValueError(f"attention.incoherent=True is not allowed for head_dim {D}: expected a power-of-two head "
                         "dimension (Hadamard rotation)")
    if masking is not None:
        if not isinstance(masking, Masking):
            raise ValueError(f"masking={type(masking).__name__} is not allowed: expected kernels.masking.Masking "
                             "or None")
        why = masking.problem(q, k.shape[2])
        if why:
            raise ValueError(why)
    if stats is not None:
        if not isinstance(stats, AttnStats):
            raise ValueError(f"stats={type(stats).__name__} is not allowed: expected "
                             "flash_forensics.kernels.stats.AttnStats or None")
        if stats.n_head != q.shape[1] or stats.device != q.device:
            raise ValueError(f"stats=AttnStats(n_head={stats.n_head}, device={stats.device}) is not allowed: "
                             f"expected n_head={q.shape[1]} on {q.device}")
    return cfg


def flash_attention(q, k, v, cfg: AttentionKnobs, stats: Optional[AttnStats] = None,
                    masking: Optional[Masking] = None) -> torch.Tensor:
    """Causal flash attention O = softmax(QK^T / sqrt(D)) V with the recipe and knobs of `cfg`; differentiable.

    q, k, v: (B, H, T, D), same dtype and device. Returns O (B, H, T, D) in the recipe's output dtype (BF16 for
    paper_bf16 / fa2; the working dtype for fp32); gradients come back in the inputs' dtypes. `stats`, if given,
    accumulates repeated-maxima counts and the max logit on the device (when cfg.counters). This is always the
    tiled (flash) computation: cfg.impl and cfg.backend are routing decisions made by models/ before calling here.
    `masking` (kernels/masking.py): other masks, Tk != Tq keys (k, v: (B, H, Tk, D)), another scale; None: causal.
    """
    knobs = check_inputs(q, k, v, cfg, stats, masking)
    if masking is None:
        return _FlashAttention.apply(q, k, v, knobs, stats)
    return _FlashAttention.apply(q, k, v, knobs, stats, masking)


def reference_attention(q, k, v, cfg: AttentionKnobs, do: Optional[torch.Tensor] = None,
                        trace: Optional[dict] = None, masking: Optional[Masking] = None):
    """Pure function for testing other kernels against: (O, lse, dq, dk, dv); gradients None without `do`.

    O is the returned O (recipe's `out` dtype), lse (B, H, T) in the working dtype. `trace`, if a dict, receives
    each rounding point's (value before, value stored) pairs, forward then backward (see `forward`).
    """
    knobs = check_inputs(q, k, v, cfg, masking=masking)
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        o, o_saved, lse = forward(q, k, v, knobs, trace=trace, masking=masking)
        grads = (backward(q, k, v, o_saved, lse, do, knobs, trace, masking=masking) if do is not None
                 else (None, None, None))
    return (o, lse.squeeze(-1), *grads)


def capture_forward(q, k, v, cfg: AttentionKnobs, stats: Optional[AttnStats] = None) -> dict:
    """One forward with its internals captured (debug hook): a dict with "o", "o_saved", "lse" and the P̄ tiles.

    "tiles": list of dict(qs, ks, p_bar (B, H, rows, cols) in the working dtype, p_bar_pv the P̄ fed to P̄V (p_bar
    unless pbar_clamp), rep (B, H, rows, 1) bool (rows where the tile max repeats), mask (rows, cols) bool or None,
    rm the tile row max, m the running max after the tile); "o_bar": the O accumulator before the division by l; "l",
    "m".
    """
    knobs = check_inputs(q, k, v, cfg, stats)
    cap: dict = {}
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        o, o_saved, lse = forward(q, k, v, knobs, stats, capture=cap)
    cap.update(o=o, o_saved=o_saved.to(lse.dtype), lse=lse)
    return cap


__all__ = ["flash_attention", "reference_attention", "capture_forward", "forward", "backward", "row_delta",
           "check_inputs"]
