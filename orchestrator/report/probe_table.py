"""The mechanism probes of one diverged run as a table per layer, over the steps before its divergence: what the
paper's three claims predict, read from the probes (orchestrator/monitor/probes/).

- claim 1, delta = rowsum(dO o O_lp) is biased: the mean delta error (against FP64) is positive at most probes, its
  t statistic is large, and its cumulative sum rises monotonically (the paper's Fig. 5a);
- claim 3, the bias comes from P̄ = 1 ties: the share of |delta error| from tie rows is large, and the tie rows are
  BF16's doing (many rows tie in BF16, few in FP32);
- claim 2, the W_Q gradient error accumulates: the (PK)ᵀX rank-1 terms point the same way (their cosine), and
  successive W_Q gradient errors point the same way (wq_err_cos).

The run summarized is the diverged run with the most probes in its window (fork step, or 0, to its divergence):
usually the baseline's fork with `monitor.probes.every=10` (sweeps/paper_1gpu_mechanism). Written as probes.md and
probes.json beside the report's verdicts.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from flash_forensics.orchestrator.record import parse_probe_metric

Points = List[Tuple[int, float]]


def _series(history: Dict[str, Points], start: int, stop: Optional[int]) -> Dict[str, Dict[int, Points]]:
    """{kind: {layer: points in [start, stop)}}; per-head kinds pooled per layer."""
    out: Dict[str, Dict[int, Points]] = {}
    for name, pts in history.items():
        parsed = parse_probe_metric(name)
        if parsed is None:
            continue
        kind, layer, _ = parsed
        keep = [(int(s), float(v)) for s, v in pts if s >= start and (stop is None or s < stop)
                and v is not None and math.isfinite(float(v))]
        out.setdefault(kind, {}).setdefault(layer, []).extend(keep)
    return out


def _median(pts: Points) -> Optional[float]:
    return statistics.median(v for _, v in pts) if pts else None


def summarize(history: Dict[str, Points], start: int = 0, stop: Optional[int] = None) -> List[Dict]:
    """One dict per layer that has delta-error probes in [start, stop)."""
    k = _series(history, start, stop)
    rows = []
    for layer in sorted(k.get("delta_err_mean", {})):
        mean = sorted(k["delta_err_mean"][layer])
        if not mean:
            continue
        t = k.get("delta_err_t", {}).get(layer, [])
        cum = sorted(k.get("delta_err_cumsum", {}).get(layer, []))
        get = lambda kind, layer=layer: k.get(kind, {}).get(layer, [])  # noqa: E731
        rows.append(dict(
            layer=layer, probes=len(mean), positive=sum(v > 0 for _, v in mean),
            t_median=_median(t), t_above_2=sum(v > 2 for _, v in t) if t else None,
            cumsum_last=cum[-1][1] if cum else None,
            cumsum_monotone=all(b >= a for (_, a), (_, b) in zip(cum, cum[1:])) if len(cum) > 1 else None,
            tie_share=_median(get("tie_share_abs")),
            tie_rows_exact=sum(v for _, v in get("tie_rows_exact")) if get("tie_rows_exact") else None,
            tie_rows_bf16=sum(v for _, v in get("tie_rows_bf16")) if get("tie_rows_bf16") else None,
            pkx_cos=_median(get("pkx_cos")), wq_err_cos=_median(get("wq_err_cos"))))
    return rows


NEAR = 500  # steps before the divergence in which the runs' probes are counted to pick one


def pick(rows: Sequence[Dict], histories: Dict[str, Dict]) -> Optional[Tuple[Dict, int, int]]:
    """(row, start, stop): the diverged run with the most delta-error probes in the NEAR steps before its divergence
    (the dense mechanism fork over a baseline probed every 250 steps from 0), its window from its fork step (or 0)
    to its divergence; None when no diverged run has probes there."""
    best = None
    for row in rows:
        if row.get("observed") != "diverged" or not isinstance(row.get("divergence_step"), int):
            continue
        start, stop = int(row.get("fork_step") or 0), int(row["divergence_step"])
        hist = histories.get(row.get("mlflow_run_id") or "") or {}
        n = sum(1 for name, pts in hist.items() if name.startswith("probe/delta_err_mean/")
                for s, _ in pts if max(start, stop - NEAR) <= s < stop)
        if n and (best is None or n > best[0]):
            best = (n, row, start, stop)
    return None if best is None else best[1:]


def _f(x, spec) -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: List[Dict], label: str, start: int, stop: int) -> str:
    head = ["layer", "mean delta error > 0", "median t (probes with t > 2)", "cumulative delta error (last)",
            "share of \\|delta error\\| from P̄ = 1 rows", "tie rows exact / BF16", "median cos of (PK)ᵀX",
            "median cos of successive W_Q gradient errors"]
    lines = [f"# Mechanism probes: {label}, steps {start}-{stop - 1} (before its divergence at {stop})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mono = {True: ", rising monotonically", False: "", None: ""}[r["cumsum_monotone"]]
        ties = ("-" if r["tie_rows_exact"] is None else
                f"{r['tie_rows_exact']:,.0f} / {r['tie_rows_bf16']:,.0f}")
        lines.append("| " + " | ".join([
            str(r["layer"]), f"{r['positive']} of {r['probes']}",
            f"{_f(r['t_median'], '+.2f')} ({_f(r['t_above_2'], 'd')})", _f(r["cumsum_last"], "+.2e") + mono,
            _f(r["tie_share"], ".2f"), ties, _f(r["pkx_cos"], ".2f"), _f(r["wq_err_cos"], "+.2f")]) + " |")
    lines += ["", "Layers are 0-based (the paper's layer 2 is layer 1). Claim 1: delta error positive at most probes, "
              "large t, a monotone cumulative sum; claim 3: a large share from P̄ = 1 rows, ties made by BF16; "
              "claim 2: aligned (PK)ᵀX terms and successive W_Q gradient errors. Tie rows are summed over the "
              "probes; the other columns are medians over them."]
    return "\n".join(lines) + "\n"


def write(rows: Sequence[Dict], histories: Dict[str, Dict], out_dir: Path) -> Optional[Path]:
    """probes.md and probes.json for the picked run; None (nothing written) when no diverged run has probes."""
    picked = pick(rows, histories)
    if picked is None:
        return None
    row, start, stop = picked
    table = summarize(histories[row["mlflow_run_id"]], start, stop)
    label = str(row.get("job") or row.get("mlflow_run_id"))
    md = Path(out_dir) / "probes.md"
    md.write_text(markdown(table, label, start, stop))
    (Path(out_dir) / "probes.json").write_text(json.dumps(
        {"run": label, "mlflow_run_id": row.get("mlflow_run_id"), "start": start, "stop": stop, "layers": table},
        indent=2))
    return md


__all__ = ["summarize", "pick", "markdown", "write", "NEAR"]
