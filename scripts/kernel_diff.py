"""Where one training step's GPU time differs between two variants of a benchmarks/train_step.py run, kernel by kernel.

    python scripts/kernel_diff.py results/bench/<run>/train_T1024.json sdpa+compile triton_fa2+compile
    python scripts/kernel_diff.py RUN.json A B --top 30 --json diff.json

Each variant's profile (train_step.py kernel_breakdown) lists its kernels with their time per step. Inductor names
its generated kernels with a running index (`triton_per_fused_..._5`) that depends on the graph around them, so the
same fusion can carry another index in the other variant: kernels are matched by their name without that index.
Each kernel also gets a family (GEMM, attention, Inductor's fusions, copies and casts, optimizer, other), so that
the step's difference reads as where it comes from: B - A per family, then the kernels whose time moved most.

Runs recorded before 2026-12-07 kept only each variant's 10 longest kernels: then the families cover only those,
and the line `not listed` is the rest of the step's kernel time (kernels_ms minus the listed ones), said as such.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.train_step import ATTN_KERNELS  # noqa: E402  (the attention kernels, as the step's profile counts them)

FAMILIES: List[Tuple[str, re.Pattern]] = [  # first match wins
    ("attention", ATTN_KERNELS),
    ("gemm", re.compile(r"(?i)nvjet|gemm|sm90_xmma|cutlass|cublas|wgmma")),
    ("optimizer", re.compile(r"(?i)optimizer|adam|multi_tensor_apply")),
    ("inductor", re.compile(r"^triton_(poi|per|red|tem)_")),
    ("copy/cast", re.compile(r"(?i)copy|memcpy|memset|to_copy|cast|cat_|CatArray")),
    ("other", re.compile(r".")),
]
_INDEX = re.compile(r"_\d+$")


def family(name: str) -> str:
    return next(f for f, p in FAMILIES if p.search(name))


def base_name(name: str) -> str:
    """An Inductor kernel's name without its running index; any other name as it is."""
    return _INDEX.sub("", name) if name.startswith("triton_") else name


def kernels_of(row: dict) -> Tuple[Dict[str, Tuple[float, int]], float, float]:
    """({base name: (ms per step, calls)}, the step's kernel ms, the listed kernels' ms) of one variant's row."""
    prof = row.get("profile") or {}
    if prof.get("device") != "cuda":
        raise ValueError(f"variant {row.get('variant')!r} has no GPU kernel profile (profile.device="
                         f"{prof.get('device')!r}): run train_step.py on a GPU with --profile")
    per: Dict[str, Tuple[float, int]] = {}
    for k in prof.get("top", []):
        t, n = per.get(base_name(k["name"]), (0.0, 0))
        per[base_name(k["name"])] = (t + float(k["ms"]), n + int(k["calls"]))
    return per, float(prof.get("kernels_ms", 0.0)), sum(t for t, _ in per.values())


def diff(run: dict, a: str, b: str) -> dict:
    rows = {r["variant"]: r for r in run.get("rows", [])}
    for v in (a, b):
        if v not in rows:
            raise ValueError(f"variant {v!r} is not in this run: it has {', '.join(rows) or 'no rows'}")
    (pa, ka, la), (pb, kb, lb) = kernels_of(rows[a]), kernels_of(rows[b])
    fam: Dict[str, List[float]] = {}
    for name in set(pa) | set(pb):
        f = fam.setdefault(family(name), [0.0, 0.0])
        f[0] += pa.get(name, (0.0, 0))[0]
        f[1] += pb.get(name, (0.0, 0))[0]
    families = [dict(family=f, a_ms=x, b_ms=y, delta_ms=y - x) for f, (x, y) in fam.items()]
    families.sort(key=lambda r: -abs(r["delta_ms"]))
    complete = abs(ka - la) < 1e-6 and abs(kb - lb) < 1e-6
    if not complete:
        families.append(dict(family="not listed", a_ms=ka - la, b_ms=kb - lb, delta_ms=(kb - lb) - (ka - la)))
    kern = []
    for name in set(pa) | set(pb):
        (x, nx), (y, ny) = pa.get(name, (0.0, 0)), pb.get(name, (0.0, 0))
        kern.append(dict(name=name, family=family(name), a_ms=x, a_calls=nx, b_ms=y, b_calls=ny, delta_ms=y - x))
    kern.sort(key=lambda r: -abs(r["delta_ms"]))
    step = {v: dict(step_ms=rows[v].get("step_ms"), kernels_ms=k, kernels=rows[v]["profile"].get("kernels"),
                    busy_ms=rows[v]["profile"].get("busy_ms")) for v, k in ((a, ka), (b, kb))}
    return dict(run=run.get("command"), gpu=run.get("gpu"), a=a, b=b, complete=complete, step=step,
                families=families, kernels=kern)


def render(d: dict, top: int) -> str:
    a, b = d["a"], d["b"]
    sa, sb = d["step"][a], d["step"][b]
    out = [f"A = {a}: step {sa['step_ms']:.2f} ms, kernels {sa['kernels_ms']:.2f} ms ({sa['kernels']} launches)",
           f"B = {b}: step {sb['step_ms']:.2f} ms, kernels {sb['kernels_ms']:.2f} ms ({sb['kernels']} launches)",
           f"B - A: step {sb['step_ms'] - sa['step_ms']:+.3f} ms, kernels {sb['kernels_ms'] - sa['kernels_ms']:+.3f} ms"
           + ("" if d["complete"] else "  (this run listed only the longest kernels: `not listed` is the rest)"),
           "", f"{'family':<12} {'A ms':>8} {'B ms':>8} {'B - A':>8}"]
    out += [f"{f['family']:<12} {f['a_ms']:8.3f} {f['b_ms']:8.3f} {f['delta_ms']:+8.3f}" for f in d["families"]]
    out += ["", f"{'B - A':>8} {'A ms (calls)':>15} {'B ms (calls)':>15}  kernel"]
    for k in d["kernels"][:top]:
        out.append(f"{k['delta_ms']:+8.3f} {k['a_ms']:8.3f} ({k['a_calls']:3d}) {k['b_ms']:8.3f} ({k['b_calls']:3d})"
                   f"  [{k['family']}] {k['name'][:100]}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a benchmarks/train_step.py JSON")
    ap.add_argument("a", help="the variant to compare against (e.g. sdpa+compile)")
    ap.add_argument("b", help="the variant compared (e.g. triton_fa2+compile)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed, largest |B - A| first")
    ap.add_argument("--json", help="also write the comparison here")
    a = ap.parse_args(argv)
    with open(a.run) as f:
        run = json.load(f)
    try:
        d = diff(run, a.a, a.b)
    except ValueError as e:
        print(f"kernel_diff: {e}", file=sys.stderr)
        return 2
    print(render(d, a.top))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(d, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
