"""Offline analysis of one snapshot (CPU is enough): ties, the delta error, the dQ/dK error it causes, the attribution
per rounding point and the kernel's fingerprint. The math is the in-job mechanism probes' (kernels/probes.py); this
module only schedules it over the captured heads and the rounding points.

Per head (the heads named, else the `top` worst by tie count):
- ties: rows whose max repeats within a key tile in the recipe's scores (kernels.probes.tie_rows), `exact` when the
  tied entries are equal in FP32 scores too, else created by rounding; and rows where two or more P̄ entries of one
  tile round to 1 in the P̄ fed to P̄V (the paper's P̄ = 1 ties).
- delta error e = delta_recipe - delta_FP64 per row, delta_recipe from the captured O and dO (kernels.probes
  delta_recipe / error_stats): mean, t and the share of sum(e), sum|e| from tie rows.
- dQ/dK error: the recipe's backward (kernels.emulator.backward, from the captured O) against FP64 attention of the
  same values; and the part delta alone causes (the FP64 backward with the recipe's delta). With the layer's input x
  and W_Q in the file: the W_Q gradient error's projection on W_Q's top singular pair (flash_forensics.kernels.probes).
- attribution: the recipe with each rounding point lifted alone to FP32, and the fp32 recipe with each point rounded
  alone to BF16; for each, the delta error's mean and t over the analysed heads (and per head, Holm-corrected) and
  the dQ error. A lift that brings |t| under REMOVED_T and the mean back near the fp32 recipe's removes the bias; a
  lone rounding with |t| >= SIGNIFICANT_T that moves the mean by at least SIZE_SHARE of the base's excess over fp32,
  same sign, reproduces it (`verdict`).
- fingerprint: on every head of the file when that is cheap (FINGERPRINT_ALL_ELEMENTS), else on the analysed ones,
  the others listed as unchecked.
The recipe analysed is the file's knobs (a flash layer of ours), else the fingerprint's best match (torch SDPA, a
transformers model), said in the output.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from flash_forensics.capture import fingerprint as fp
from flash_forensics.capture import snapshot as snap_io
from flash_forensics.capture.recorder import knobs_of
from flash_forensics.capture.report import pct
from flash_forensics.kernels import emulator
from flash_forensics.kernels import probes as P
from flash_forensics.kernels.recipes import ROUNDING_POINTS, for_knobs, points_problem, resolve, round_to

F64 = torch.float64
SIGNIFICANT_T = 3.0
REMOVED_T = 2.0
BWD_POINTS = ("bwd_gemm_in", "bwd_out", "grad_acc")  # delta (dO_O) never reads them: they move dQ/dK only
FINGERPRINT_ALL_ELEMENTS = 2 ** 24  # B * heads * T * T up to which every head is fingerprinted (seconds on a CPU)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class AnalysisError(ValueError):
    """A capture this analysis cannot read as causal flash attention (the message says why)."""


def _f(t) -> float:
    return float(t.item() if torch.is_tensor(t) else t)


def _check_analyzable(snap: snap_io.Snapshot, where: str) -> None:
    m = snap.meta
    if not m.get("is_causal", True):
        raise AnalysisError(f"{where}: the captured call was not causal (is_causal=false, no causal mask): the "
                            "emulator computes causal self-attention only")
    if not m.get("scale_default", True):
        D = snap.q.shape[-1]
        raise AnalysisError(f"{where}: the captured call used scale={m.get('scale')}, not 1/sqrt(D)={D ** -0.5:g}: "
                            "the emulator computes the default scale only")
    impl = m.get("implementation") or ""
    if "dropout_p=" in impl and "dropout_p=0.0)" not in impl and "dropout_p=0)" not in impl:
        raise AnalysisError(f"{where}: the captured call used dropout ({m.get('implementation')}): its O is not a "
                            "function of q, k, v alone")


# ------------------------------------------------------------------------------------------------ ties
def pbar1_rows(q, k, v, knobs) -> torch.Tensor:
    """(B, h, T) bool: rows where two or more entries of one key tile's P̄, as fed to P̄V, are exactly 1."""
    cap = emulator.capture_forward(q, k, v, replace(knobs, counters=False))
    rc = for_knobs(knobs, q.dtype)
    B, H, T, _ = q.shape
    out = torch.zeros(B, H, T, dtype=torch.bool)
    for tile in cap["tiles"]:
        pb = round_to(tile["p_bar_pv"], rc.pbar)
        n = (pb == 1).sum(dim=-1)
        qs = tile["qs"]
        out[:, :, qs:qs + n.shape[-1]] |= n >= 2
    return out


def _as_read(snap: snap_io.Snapshot, knobs) -> snap_io.Snapshot:
    """The snapshot with q, k in the dtype the recipe's GEMMs read (BF16 for paper_bf16 / fa2)."""
    read = for_knobs(knobs, snap.q.dtype).inputs
    if snap.q.dtype == read:
        return snap
    return snap_io.Snapshot({**snap.tensors, "q": snap.q.to(read), "k": snap.k.to(read)}, snap.meta)


def head_choice(snap: snap_io.Snapshot, knobs, heads: Optional[Sequence[int]], top: int):
    """(indices into the file's heads, the file's head numbers, tie rows per file head, how they were chosen)."""
    file_heads = snap.heads
    tie = P.tie_rows(snap.q, snap.k, knobs)[0].sum(dim=(0, 2))
    counts = {int(h): int(tie[j]) for j, h in enumerate(file_heads)}
    if heads:
        missing = [h for h in heads if h not in file_heads]
        if missing:
            raise AnalysisError(f"--heads {','.join(map(str, heads))}: head {missing[0]} is not in the file (it "
                                f"holds heads {','.join(map(str, file_heads))})")
        idx = [file_heads.index(h) for h in heads]
        how = "named"
    else:
        idx = sorted(range(len(file_heads)), key=lambda j: (-counts[file_heads[j]], j))[:max(1, top)]
        idx.sort()
        how = f"the {len(idx)} worst by tie rows"
    return idx, [file_heads[j] for j in idx], counts, how


# ------------------------------------------------------------------------------------------------ FP64
def fp64_reference(q, k, v, do):
    """Per head (loops over heads: one T x T FP64 matrix at a time): delta64 (B, h, T), dq64, dk64 (B, h, T, D)."""
    deltas, dqs, dks = [], [], []
    scale = q.shape[-1] ** -0.5
    for j in range(q.shape[1]):
        sl = slice(j, j + 1)
        o64, p64, _ = P.fp64_attention(q[:, sl], k[:, sl], v[:, sl])
        d64 = (do[:, sl].to(F64) * o64).sum(dim=-1)
        ds = p64 * (do[:, sl].to(F64) @ v[:, sl].to(F64).transpose(-1, -2) - d64.unsqueeze(-1))
        dqs.append((ds @ k[:, sl].to(F64)) * scale)
        dks.append((ds.transpose(-1, -2) @ q[:, sl].to(F64)) * scale)
        deltas.append(d64)
        del o64, p64, ds
    return torch.cat(deltas, 1), torch.cat(dqs, 1), torch.cat(dks, 1)


def dq_from_delta(q, k, v, do, delta) -> torch.Tensor:
    """dQ of FP64 attention with the given delta (B, h, T): what the recipe's delta alone does to dQ."""
    out = []
    for j in range(q.shape[1]):
        sl = slice(j, j + 1)
        _, p64, _ = P.fp64_attention(q[:, sl], k[:, sl], v[:, sl])
        out.append(P.fp64_dq(p64, k[:, sl], v[:, sl], do[:, sl], delta[:, sl].to(F64)))
    return torch.cat(out, 1)


def _rel(err: torch.Tensor, ref: torch.Tensor) -> List[float]:
    """Per head |err|_F / |ref|_F."""
    dims = tuple(d for d in range(err.dim()) if d != 1)
    return [float(x) for x in (err.double().pow(2).sum(dims).sqrt() / ref.double().pow(2).sum(dims).sqrt())]


def _mean_t(e: torch.Tensor) -> Dict[str, float]:
    n = e.numel()
    mean = e.mean()
    std = e.std(unbiased=True) if n > 1 else torch.zeros_like(mean)
    t = mean / (std / math.sqrt(n)) if float(std) > 0 else torch.tensor(0.0 if float(mean) == 0 else math.inf)
    return {"mean": _f(mean), "t": _f(t)}


# ------------------------------------------------------------------------------------------------ attribution
def _variant(base, kind: str, point: str, n_head: int):
    """(knobs, None) for `point` lifted alone (kind 'lift', on the base recipe) or rounded alone (kind 'round', on
    the fp32 recipe); (None, why) where the recipe already stores the point so."""
    if kind == "lift":
        keep = list(base.keep_fp32) + [point]
        if points_problem(base.recipe, keep, base.round_bf16, bool(base.pv_fp32)) or point in set(
                base.keep_fp32) or (base.pv_fp32 and point in ("pbar", "pv_out", "acc")):
            return None, f"{base.recipe} keeps it in FP32 already"
        kn = replace(base, keep_fp32=keep)
    else:
        kn = replace(base, recipe="fp32", keep_fp32=[], round_bf16=[point], pv_fp32=False, o_fp32=False,
                     o_fp32_heads=[], stochastic_round=False)
    try:
        kn.validate(n_head=n_head)
    except ValueError as e:
        return None, str(e)
    return kn, None


def _run_config(q, k, v, do, kn, delta64, dq64, captured_o=None):
    """(delta error e (B, h, T), dq) of knobs `kn`; captured_o: use that O for delta (the base, as captured)."""
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        o, o_saved, lse = emulator.forward(q, k, v, kn)
        if captured_o is not None and kn.delta == "dO_O" and not kn.fp32_o_heads(q.shape[1]):
            o_saved = captured_o.to(o_saved.dtype)
        delta = emulator.row_delta(q, k, v, o_saved, lse, do, kn).squeeze(-1).to(F64)
        dq = emulator.backward(q, k, v, o_saved, lse, do, kn)[0]
    return delta - delta64, dq


def attribution(q, k, v, o, do, base, delta64, dq64, tick: Callable = lambda n=1: None,
                heads: Optional[Sequence[int]] = None) -> dict:
    """The delta error's mean and t (over the analysed heads, and per head) and the dQ error, for the base as
    captured, the fp32 recipe, and each point lifted alone / rounded alone; with the verdict sentence."""
    H = q.shape[1]

    def summary(e, dq):
        per = [_mean_t(e[:, j]) for j in range(H)]
        return {**_mean_t(e), "per_head": per, "dq_rel_err": _rel(dq.double() - dq64, dq64)}

    e0, dq0 = _run_config(q, k, v, do, base, delta64, dq64, captured_o=o)
    tick()
    fp32 = replace(base, recipe="fp32", keep_fp32=[], round_bf16=[], pv_fp32=False, o_fp32=False, o_fp32_heads=[],
                   stochastic_round=False, counters=False)
    e32, dq32 = _run_config(q, k, v, do, fp32, delta64, dq64)
    tick()
    out = {"base": {"label": fp.label(base), **summary(e0, dq0)}, "fp32": summary(e32, dq32), "points": [],
           "heads": list(heads) if heads is not None else list(range(H))}
    for pt in ROUNDING_POINTS:
        row = {"point": pt, "backward_only": pt in BWD_POINTS}
        for kind in ("lift", "round"):
            kn, why = _variant(base, kind, pt, H)
            if kn is None:
                row[kind] = {"state": "n/a", "why": why}
            else:
                e, dq = _run_config(q, k, v, do, kn, delta64, dq64)
                row[kind] = {"state": "run", "label": fp.label(kn), **summary(e, dq)}
            tick()
        out["points"].append(row)
    out.update(verdict(out))
    return out


def holm(pvalues: Sequence[float]) -> List[float]:
    """Holm-Bonferroni adjusted p-values (same order): the family-wise error of len(pvalues) tests held at alpha."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out, run = [1.0] * m, 0.0
    for rank, i in enumerate(order):
        run = max(run, min(1.0, (m - rank) * pvalues[i]))
        out[i] = run
    return out


def p_two_sided(t: float) -> float:
    """Two-sided p of a t statistic (normal: the rows number thousands); NaN t reads as no evidence."""
    return 1.0 if math.isnan(t) else math.erfc(abs(t) / math.sqrt(2.0))


ALPHA = p_two_sided(SIGNIFICANT_T)  # one test at |t| >= 3; Holm keeps the family of per-head tests at this level
# Sizes against the base's excess over the fp32 recipe's mean: a lone rounding reproduces the bias only with at
# least REPRO_SHARE of it (the share is printed: fa2's P̄ alone gives a quarter, P̄ with the stored O all of it);
# a lift removes it only leaving less than LEFT_SHARE. A point delta never reads moves nothing: share 0.
REPRO_SHARE = 0.1
LEFT_SHARE = 0.5


def per_head_tests(per_head: Sequence[dict], heads: Sequence[int]) -> List[dict]:
    """Per head: mean, t, p and the Holm-adjusted p over the heads tested, and whether it is significant."""
    ps = [p_two_sided(r["t"]) for r in per_head]
    adj = holm(ps)
    return [{"head": h, "mean": r["mean"], "t": r["t"], "p": p, "p_holm": a, "significant": a <= ALPHA}
            for h, r, p, a in zip(heads, per_head, ps, adj, strict=True)]


def _moves(r: dict, ref: float, excess: float) -> float:
    """How far a variant's mean moves from the reference, in units of the base's excess over it (signed)."""
    return (r["mean"] - ref) / excess if excess else 0.0


def verdict(att: dict) -> dict:
    """Which single change removes the bias and which reproduces it alone; one sentence.

    Biased: the pooled |t| >= SIGNIFICANT_T, or one head's test significant after Holm's correction over the heads
    (a pooled t can hide one head's bias). Sizes are measured against the fp32 recipe's mean (0 without it): the
    base's excess over it. Removes: lifted alone, |t| < REMOVED_T and less than LEFT_SHARE of the excess left.
    Reproduces: rounded alone, |t| >= SIGNIFICANT_T and at least REPRO_SHARE of the excess, same sign. A point delta
    never reads (backward only) leaves the fp32 mean as it is and so reproduces nothing, however large its t."""
    b = att["base"]
    ref = att.get("fp32", {}).get("mean", 0.0)
    heads = per_head_tests(b["per_head"], att.get("heads") or list(range(len(b["per_head"])))) \
        if b.get("per_head") else []
    hot = [h for h in heads if h["significant"]]
    pooled = abs(b["t"]) >= SIGNIFICANT_T
    head_words = ("; per head (Holm over " + str(len(heads)) + "): "
                  + ", ".join(f"head {h['head']} t = {h['t']:.1f}{' *' if h['significant'] else ''}"
                              for h in heads)) if heads else ""
    if not pooled and not hot:
        return {"biased": False, "removes": [], "reproduces": [], "head_tests": heads,
                "sentence": f"no significant delta bias to attribute (t = {b['t']:.2f}, |t| < {SIGNIFICANT_T:g})"
                            + head_words}
    excess = b["mean"] - ref
    if not pooled:  # the bias sits in some heads: attribute on the worst one's size
        worst = max(hot, key=lambda h: abs(h["t"]))
        excess = worst["mean"] - ref
    removes = [r["point"] for r in att["points"] if r["lift"].get("state") == "run"
               and abs(r["lift"]["t"]) < REMOVED_T and abs(_moves(r["lift"], ref, excess)) < LEFT_SHARE]
    repro = [r["point"] for r in att["points"] if r["round"].get("state") == "run"
             and abs(r["round"]["t"]) >= SIGNIFICANT_T and _moves(r["round"], ref, excess) >= REPRO_SHARE]
    by = {r["point"]: r for r in att["points"]}
    parts = []
    both = [p for p in removes if p in repro]
    for p in both:
        parts.append(f"the bias needs BF16 at `{p}`: lifting it alone removes it (t {b['t']:.1f} -> "
                     f"{by[p]['lift']['t']:.1f}) and rounding it alone to BF16 (the rest FP32) reproduces "
                     f"{100 * _moves(by[p]['round'], ref, excess):.0f}% of it (t = {by[p]['round']['t']:.1f})")
    for p in removes:
        if p not in both:
            parts.append(f"lifting `{p}` alone removes it (t {b['t']:.1f} -> {by[p]['lift']['t']:.1f})")
    for p in repro:
        if p not in both:
            parts.append(f"rounding `{p}` alone to BF16 (the rest FP32) reproduces "
                         f"{100 * _moves(by[p]['round'], ref, excess):.0f}% of it (t = {by[p]['round']['t']:.1f})")
    if not parts:
        parts.append("no single rounding point explains it (no lift alone removes it, no rounding alone "
                     "reproduces it)")
    where = "" if pooled else f" in head{'s' if len(hot) > 1 else ''} {', '.join(str(h['head']) for h in hot)}"
    return {"biased": True, "removes": removes, "reproduces": repro, "head_tests": heads,
            "sentence": f"delta error mean {b['mean']:.3g}, t = {b['t']:.1f}{where}: " + "; ".join(parts)
                        + head_words}


def named_vs_found(ranked: List[dict]) -> Optional[str]:
    """The sentence when the recipe the file names reproduces less of O than the fingerprint's best (another
    recipe or variant); None when the named one is best or ties it."""
    base = next((r for r in ranked if r["is_base"]), None)
    best = ranked[0] if ranked else None
    if base is None or best is base or best.get("o_differ", 0) >= base.get("o_differ", 0):
        return None  # integer counts of differing elements (fingerprint rows): a tie is no contradiction
    return (f"the file names {base['label']} ({100 * base['o_identical']:.2f}% of O identical), but the fingerprint "
            f"finds {best['label']} ({100 * best['o_identical']:.2f}%): analysed as named; --blind analyses it as "
            f"{best['label']}")


# ------------------------------------------------------------------------------------------------ per head
def head_stats(q, k, v, o, do, knobs, delta64, dq64, dk64, x=None, w_q=None) -> dict:
    """Per analysed head: ties, P̄ = 1 rows, the delta error's statistics, dQ/dK errors and (x, w_q) projections."""
    H = q.shape[1]
    tie, exact = P.tie_rows(q, k, knobs)
    p1 = pbar1_rows(q, k, v, knobs)
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        e = P.delta_recipe(q, k, v, o, do, knobs) - delta64
        o_saved, lse = emulator.forward(q, k, v, knobs)[1:]
        if knobs.delta == "dO_O" and not knobs.fp32_o_heads(H):
            o_saved = o.to(o_saved.dtype)
        dq, dk, _ = emulator.backward(q, k, v, o_saved, lse, do, knobs)
    dq_delta = dq_from_delta(q, k, v, do, delta64 + e)
    proj = proj_delta = None
    if x is not None and w_q is not None:
        xin = x.to(q.dtype) if x.dtype != q.dtype and q.dtype == torch.bfloat16 else x  # what the GEMM saw
        proj = P.top_pair_projection(w_q, P.wq_grad_error(xin, dq, dq64))
        proj_delta = P.top_pair_projection(w_q, P.wq_grad_error(xin, dq_delta, dq64))
    out = []
    for j in range(H):
        st = {kk: _f(vv) for kk, vv in P.error_stats(e[:, j], tie[:, j], exact[:, j]).items()}
        dq_err, dqd_err = dq.double()[:, j] - dq64[:, j], dq_delta[:, j] - dq64[:, j]
        cos = float(P.cosine(dqd_err, dq_err))
        out.append({
            "rows": int(tie[:, j].numel()), "tie_rows": int(tie[:, j].sum()), "tie_exact": int(exact[:, j].sum()),
            "tie_bf16": int((tie[:, j] & ~exact[:, j]).sum()), "pbar1_rows": int(p1[:, j].sum()),
            "delta": {"mean": st["delta_err_mean"], "t": st["delta_err_t"],
                      "tie_share_signed": st["tie_share_signed"], "tie_share_abs": st["tie_share_abs"]},
            "dq_rel_err": _rel(dq_err[:, None], dq64[:, j:j + 1])[0],
            "dk_rel_err": _rel(dk.double()[:, j:j + 1] - dk64[:, j:j + 1], dk64[:, j:j + 1])[0],
            "dq_rel_err_from_delta": _rel(dqd_err[:, None], dq64[:, j:j + 1])[0],
            "dq_err_cos_delta": cos,
            "wq_err_proj": None if proj is None else _f(proj[j]),
            "wq_err_proj_from_delta": None if proj_delta is None else _f(proj_delta[j]),
        })
    return {"per_head": out, "e": e, "tie": tie}


# ------------------------------------------------------------------------------------------------ the whole
def fingerprint_heads(snap: snap_io.Snapshot, chosen_idx: Sequence[int], which: str) -> List[int]:
    """Indices of the file's heads to fingerprint: `all`, `chosen` (the analysed ones), or `auto` (all when
    B * heads * T^2 <= FINGERPRINT_ALL_ELEMENTS, else the chosen)."""
    if which not in ("auto", "all", "chosen"):
        raise AnalysisError(f"fingerprint_heads={which!r} is not allowed: expected auto, all or chosen")
    B, H, T, _ = snap.q.shape
    if which == "all" or (which == "auto" and B * H * T * T <= FINGERPRINT_ALL_ELEMENTS):
        return list(range(H))
    return list(chosen_idx)


def _upcast_fp8(snap: snap_io.Snapshot, notes: List[str]) -> snap_io.Snapshot:
    """FP8 tensors as FP32 (exact): the emulator's arithmetic and the FP64 reference read FP32 values."""
    fp8 = [n for n, t in snap.tensors.items() if t.dtype in FP8]
    if not fp8:
        return snap
    notes.append(f"{', '.join(fp8)} are FP8 ({str(snap.tensors[fp8[0]].dtype).replace('torch.', '')}) in the file: "
                 "read as their exact FP32 values")
    return snap_io.Snapshot({n: (t.float() if t.dtype in FP8 else t) for n, t in snap.tensors.items()}, snap.meta)


def analyze(path, heads: Optional[Sequence[int]] = None, top: int = 2, fingerprint: bool = True,
            attribute: bool = True, progress: bool = True, blind: bool = False,
            fingerprint_heads_mode: str = "auto") -> dict:
    """The analysis of the capture at `path` (or a Snapshot) as a JSON-able dict (flash_forensics.capture.report
    renders it). heads: the file's head numbers to analyse (default: the `top` worst by tie rows). blind: ignore
    the recipe and knobs the file names (the fingerprint alone says what computed it). fingerprint_heads_mode:
    auto | all | chosen (`fingerprint_heads`); heads not fingerprinted are listed in the result and the report."""
    from tqdm import tqdm
    t0 = time.perf_counter()
    snap = path if isinstance(path, snap_io.Snapshot) else snap_io.read(path)
    where = str(path) if not isinstance(path, snap_io.Snapshot) else "snapshot"
    _check_analyzable(snap, where)
    meta = snap.meta
    file_knobs = None if blind else knobs_of(meta.get("knobs"))
    flash_knobs = file_knobs if file_knobs is not None and file_knobs.impl == "flash" else None
    notes: List[str] = []
    snap = _upcast_fp8(snap, notes)
    q, k, v, o = snap.q, snap.k, snap.v, snap.o
    sel_knobs = flash_knobs or knobs_of({"recipe": "paper_bf16"})
    idx, chosen, counts, how = head_choice(_as_read(snap, sel_knobs), sel_knobs, heads, top)
    if flash_knobs is None:
        how += " (ties counted as paper_bf16 rounds S, the file naming no flash recipe)"
    fp_idx = fingerprint_heads(snap, idx, fingerprint_heads_mode) if fingerprint else []
    fp_sel = torch.tensor(fp_idx, dtype=torch.long)
    fq, fk, fv, fo = (t.index_select(1, fp_sel) for t in (snap.q, snap.k, snap.v, snap.o))
    flse = snap.lse.index_select(1, fp_sel) if snap.lse is not None else None
    sel = torch.tensor(idx)
    q, k, v, o = (t.index_select(1, sel) for t in (snap.q, snap.k, snap.v, snap.o))
    do = snap.do.index_select(1, sel) if snap.do is not None else None
    n_cand = len(fp.candidates(fq.shape[1], fq.shape[2], fq.dtype, flash_knobs, shape=tuple(fq.shape))) \
        if fingerprint else 0
    n_att = (2 + 2 * len(ROUNDING_POINTS)) if attribute and do is not None else 0
    bar = tqdm(total=n_cand + n_att + 2, desc="analyze", disable=not progress, dynamic_ncols=True)
    timing = {}
    res = {"file": where, "meta": meta, "heads": {"chosen": chosen, "how": how, "tie_rows": counts},
           "notes": notes}
    t = time.perf_counter()
    ranked = fp.run(fq, fk, fv, fo, flse, flash_knobs, progress=bar.update) if fingerprint else []
    timing["fingerprint_s"] = time.perf_counter() - t
    file_heads = snap.heads
    unchecked = [file_heads[j] for j in range(len(file_heads)) if j not in fp_idx] if fingerprint else []
    res["fingerprint"] = {"heads": [file_heads[j] for j in fp_idx], "unchecked_heads": unchecked,
                          "candidates": ranked, "best": ranked[0]["label"] if ranked else None,
                          "exact": bool(ranked) and fp.is_exact(ranked[0])}
    grads = {n: snap.tensors[n].index_select(1, fp_sel) for n in ("dq", "dk", "dv") if n in snap.tensors}
    if ranked and grads and snap.do is not None:  # the kernel's own backward, under the best forward candidate
        res["fingerprint"]["backward"] = fp.backward_shares(fq, fk, fv, fo, snap.do.index_select(1, fp_sel), grads,
                                                            knobs_of(ranked[0]["knobs"]))
    if unchecked:
        notes.append(f"the fingerprint checked heads {res['fingerprint']['heads']} only: heads {unchecked} of the "
                     "file were not checked (a difference there goes unseen; fingerprint_heads_mode='all' or "
                     "--fingerprint-heads all checks them)")
    conflict = named_vs_found(ranked) if flash_knobs is not None else None
    if conflict:
        notes.append(conflict)
        res["conflict"] = conflict
    knobs = flash_knobs
    if knobs is None:
        if ranked:
            knobs = knobs_of(ranked[0]["knobs"])
            why = "--blind" if blind else "the file names no flash recipe"
            notes.append(f"{why} ({meta.get('implementation') or meta.get('family')}): "
                         f"ties, delta and attribution use the fingerprint's best match, {ranked[0]['label']} "
                         f"({pct(ranked[0]['o_identical'])} of O identical)")
        else:
            knobs = sel_knobs
            notes.append("the file names no flash recipe and no fingerprint ran: analysed as paper_bf16")
    read = for_knobs(knobs, q.dtype).inputs
    if q.dtype != read:  # as the probes do: the recipe's GEMMs read these values (FP64 is of the same ones)
        notes.append(f"q, k, v are {str(q.dtype).replace('torch.', '')} in the file: ties, delta and dQ are "
                     f"computed from the {str(read).replace('torch.', '')} values the recipe's GEMMs read (the FP64 "
                     "reference of those same values), as the in-job probes do")
        q, k, v = q.to(read), k.to(read), v.to(read)
    res["knobs"] = knobs.knob_values()
    res["recipe"] = fp.label(knobs)
    res["recipe_dtypes"] = resolve(knobs.recipe, q.dtype).describe() if knobs else None
    if do is None:
        notes.append("no dO in the file (no backward ran while capturing): delta error, dQ/dK and attribution "
                     "need it and are skipped")
        tie, exact = P.tie_rows(q, k, knobs)
        p1 = pbar1_rows(q, k, v, knobs)
        res["per_head"] = [{"head": h, "rows": int(tie[:, j].numel()), "tie_rows": int(tie[:, j].sum()),
                            "tie_exact": int(exact[:, j].sum()), "tie_bf16": int((tie[:, j] & ~exact[:, j]).sum()),
                            "pbar1_rows": int(p1[:, j].sum())} for j, h in enumerate(chosen)]
        bar.update(2)
    else:
        t = time.perf_counter()
        delta64, dq64, dk64 = fp64_reference(q, k, v, do)
        x = snap.x
        w_q = snap.w_q.index_select(0, sel) if snap.w_q is not None else None
        if x is None or w_q is None:
            notes.append("no layer input x / W_Q in the file: the W_Q gradient-error projection is skipped")
        hs = head_stats(q, k, v, o, do, knobs, delta64, dq64, dk64, x, w_q)
        res["per_head"] = [{"head": h, **r} for h, r in zip(chosen, hs["per_head"], strict=True)]
        res["_e"], res["_tie"] = hs["e"], hs["tie"]  # for the plots; dropped from the JSON
        timing["heads_s"] = time.perf_counter() - t
        bar.update(2)
        if attribute:
            t = time.perf_counter()
            res["attribution"] = attribution(q, k, v, o, do, knobs, delta64, dq64, tick=bar.update, heads=chosen)
            timing["attribution_s"] = time.perf_counter() - t
    bar.close()
    timing["total_s"] = time.perf_counter() - t0
    res["timing"] = timing
    res["shape"] = {"B": q.shape[0], "heads": len(chosen), "T": q.shape[2], "D": q.shape[3]}
    res["file_bytes"] = Path(path).stat().st_size if not isinstance(path, snap_io.Snapshot) else None
    return res


__all__ = ["analyze", "attribution", "verdict", "head_stats", "head_choice", "pbar1_rows", "fp64_reference",
           "AnalysisError", "SIGNIFICANT_T", "REMOVED_T", "holm", "per_head_tests", "ALPHA", "REPRO_SHARE",
           "LEFT_SHARE"]
