"""The SFA edge-case matrix: exact Algorithm 3 vs its guarded variant on the emulator.

Each cell (rm, beta, recipe, tiling) runs one causal attention call with two heads built so that the scaled scores
are known exactly (q = e_0, k_j = s_j * sqrt(D) e_0, so S_ij = s_j for every query row i):
- head 0 "repeated": the row max rm is attained twice (keys 5 and 9), the other keys lie 0.5..6 below it;
- head 1 "tile-local": a unique row max rm at key 3 and, in the second key tile, a repeated max rm - 1 below it
  (Algorithm 3 raises the running max to beta * (rm - 1) there for the rest of the row).
Scores and V are BF16 values (k = 4 s with D = 16: QK^T and the scaling are exact in every recipe), so the FP64
exact softmax of the same inputs (untiled, safe) is the reference and the error measures the softmax alone.
`flash-forensics sfa-matrix --out FILE` writes the table as Markdown; tests/unit/test_sfa_matrix.py asserts it.
"""
from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from typing import Dict, List

import torch

from flash_forensics.kernels.checks import file_in_the_way
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import SFA_GUARD_HI, SFA_GUARD_LO, flash_attention, reference_attention
from flash_forensics.kernels.stats import AttnStats

RMS = (10, 50, 100, 200, 1000, -200)
BETAS = (1.0001, 1.05, 2.0, 8.0)
RECIPES = ("paper_bf16", "fa2", "fp32")
VARIANTS = ("stabilized", "stabilized_guarded")
T, D, BLOCK = 48, 16, 16
TOL = {"paper_bf16": 3e-2, "fa2": 3e-2, "fp32": 1e-4}  # max |O - O_exact|, |V| <= ~3: a few BF16 ulps


def scores_qkv(rm: float, seed: int = 0):
    """(q, k, v) in FP32 (B=1, H=2, T, D) whose scaled scores per head are the rows described in the docstring."""
    g = torch.Generator().manual_seed(seed)
    rep = rm - (0.5 + 5.5 * torch.rand(T, generator=g, dtype=torch.float64))
    rep[5] = rep[9] = rm
    loc = rm - (2.0 + 4.0 * torch.rand(T, generator=g, dtype=torch.float64))
    loc[3] = rm
    loc[BLOCK + 2] = loc[BLOCK + 6] = rm - 1.0
    rep, loc = (x.to(torch.bfloat16).double() for x in (rep, loc))
    q = torch.zeros(1, 2, T, D, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros_like(q)
    k[0, 0, :, 0], k[0, 1, :, 0] = rep * math.sqrt(D), loc * math.sqrt(D)
    v = torch.randn(1, 2, T, D, generator=g, dtype=torch.float64).to(torch.bfloat16).double()
    return q.float(), k.float(), v.float()


def cell(rm: float, beta: float, recipe: str, tiling: bool, softmax: str) -> Dict:
    q, k, v = scores_qkv(rm)
    exact = reference_attention(q.double(), k.double(), v.double(), AttentionKnobs(recipe="fp32", tiling=False))[0]
    dtype = torch.float32 if recipe == "fp32" else torch.bfloat16
    st = AttnStats(2)
    knobs = AttentionKnobs(recipe=recipe, softmax=softmax, beta=beta, tiling=tiling, block_q=BLOCK, block_k=BLOCK)
    o = flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), knobs, st).double()
    finite = torch.isfinite(o)
    err = (o - exact).abs()
    return dict(rm=rm, beta=beta, recipe=recipe, tiling=tiling, softmax=softmax,
                nan=int((~finite).sum()), zero_rows=int((o.abs().amax(-1) == 0).sum()),
                max_err=float(err.max()) if bool(finite.all()) else float("nan"),
                underflow_rows=int(st.underflow_rows.sum()), sfa_p1_rows=int(st.sfa_p1_rows.sum()))


def matrix(variants=VARIANTS) -> List[Dict]:
    return [cell(rm, b, r, t, s) for rm, b, r, t, s in itertools.product(RMS, BETAS, RECIPES, (True, False), variants)]


def ok(row: Dict) -> bool:
    """No NaN, no zero row, error at BF16 tolerance."""
    return row["nan"] == 0 and row["zero_rows"] == 0 and row["max_err"] <= TOL[row["recipe"]]


def markdown(rows: List[Dict]) -> str:
    by = {(r["rm"], r["beta"], r["recipe"], r["tiling"], r["softmax"]): r for r in rows}
    lines = [
        "# SFA edge-case matrix (emulator, CPU)", "",
        "Made by `flash-forensics sfa-matrix --out results/bench/sfa_edge_matrix.md` (kernels/sfa_matrix.py says "
        "how the scores are built; tests/unit/test_sfa_matrix.py asserts it).",
        f"Guard: shift d = clamp((beta - 1)|rm|, {SFA_GUARD_LO:g}, {SFA_GUARD_HI:g}) above a repeated max that reaches "
        "the running max. Tolerance on max |O - O_exact|: " + ", ".join(f"{k} {v:g}" for k, v in TOL.items()) + ".",
        "Each cell: `ok` or what failed; `uf` = rows counted by AttnStats.underflow_rows, `p1` = rows counted by "
        "AttnStats.sfa_p1_rows (failures are counted, not silent).", "",
        "| rm | beta | recipe | tiling | exact Algorithm 3 | guarded |", "|---|---|---|---|---|---|"]

    def show(r):
        if ok(r):
            text = f"ok (err {r['max_err']:.2g})"
        else:
            bad = []
            if r["nan"]:
                bad.append(f"{r['nan']} NaN")
            if r["zero_rows"]:
                bad.append(f"{r['zero_rows']} zero rows")
            if not (r["max_err"] <= TOL[r["recipe"]]) and not r["nan"]:
                bad.append(f"err {r['max_err']:.3g}")
            text = "FAIL: " + ", ".join(bad)
        counted = [f"{n} {r[k]}" for n, k in (("uf", "underflow_rows"), ("p1", "sfa_p1_rows")) if r[k]]
        return text + (f"; counted {', '.join(counted)}" if counted else "")

    for rm, b, rc, t in itertools.product(RMS, BETAS, RECIPES, (True, False)):
        cells = [by.get((rm, b, rc, t, s)) for s in VARIANTS]
        lines.append(f"| {rm} | {b:g} | {rc} | {'on' if t else 'off'} | " +
                     " | ".join(show(c) if c else "-" for c in cells) + " |")
    n_ok = {s: sum(ok(r) for r in rows if r["softmax"] == s) for s in VARIANTS}
    n_all = {s: sum(r["softmax"] == s for r in rows) for s in VARIANTS}
    silent = sum(1 for r in rows if r["softmax"] == "stabilized" and not ok(r) and not
                 (r["underflow_rows"] or r["sfa_p1_rows"]))
    lines += ["", f"Cells ok: exact {n_ok['stabilized']}/{n_all['stabilized']}, guarded "
                  f"{n_ok['stabilized_guarded']}/{n_all['stabilized_guarded']}; failed exact cells with no counter: "
                  f"{silent}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flash-forensics sfa-matrix", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the Markdown table to this file (else print it)")
    args = ap.parse_args(argv)
    if args.out is not None and args.out.is_dir():
        ap.error(f"--out={str(args.out)!r} is not allowed: it is a folder; expected a file path (e.g. "
                 f"{args.out / 'sfa_edge_matrix.md'})")
    under = file_in_the_way(args.out) if args.out is not None else None
    if under is not None:  # else mkdir's FileExistsError, naming no flag, after the matrix
        ap.error(f"--out={str(args.out)!r} is not allowed: {under} is a file; expected a file path in a folder")
    text = markdown(matrix())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
