"""A fork's verdict as its source run's detector gives it (`verdict.fork_baseline=source`), rebuilt from histories.

A fork judged `fresh` starts its running minimum at the fork step. On noisy per-batch losses that moves the line a
divergence must cross: in the paper regime (seed 1) the baseline's own fork, bit for bit the source's losses at every
shared step, was called stable while the source diverged at step 2,288 (the source's minimum, 1.92 at step 1,754,
was before the fork; the fork's, 2.05, after it). Judged `source`, the detector first reads the source's losses up to
the fork step, then the fork's: a fork that repeats its source gets its source's verdict, and every intervention is
judged against the same line. This rebuilds that verdict for runs that ran `fresh`, from the loss histories alone
(`flash-forensics report --fork-baseline source`); the run's own verdict stays in `fresh_observed`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from flash_forensics.orchestrator.record import LOSS
from flash_forensics.orchestrator.verdict import DivergenceDetector, VerdictConfig

RULES = ("recorded", "source")


def _source_of(row: Dict, rows: Sequence[Dict]) -> Optional[Dict]:
    """The run a fork was forked from: by its MLflow run id, else by the checkpoint's job folder."""
    sid = row.get("source_run_id")
    if sid:
        hit = next((r for r in rows if r is not row and r.get("mlflow_run_id") == sid), None)
        if hit is not None:
            return hit
    ck = row.get("forked_from")
    if ck:
        job = Path(ck).parent.parent.resolve()  # <job>/checkpoints/step_K.pt
        return next((r for r in rows if r is not row and r.get("job_dir") and Path(r["job_dir"]).resolve() == job),
                    None)
    return None


def _points(histories: Dict[str, Dict], row: Dict) -> List:
    pts = (histories.get(row.get("mlflow_run_id") or "") or {}).get(LOSS) or []
    return [(int(s), math.nan if v is None else float(v)) for s, v in pts]


def source_verdicts(rows: List[Dict], histories: Dict[str, Dict]) -> List[Dict]:
    """Re-judge every fork that ran `fresh` as `source` would (before rows.compare). A fork whose source or histories
    are missing, or whose source had diverged before the fork step, keeps its verdict and says why in `fork_rule`."""
    for row in rows:
        fs = row.get("fork_step")
        if not isinstance(fs, int) or row.get("observed") not in ("stable", "diverged"):
            continue
        if row.get("fork_baseline") == "source":
            row["fork_rule"] = "source"
            continue
        src = _source_of(row, rows)
        before = [p for p in _points(histories, src) if p[0] < fs] if src is not None else []
        mine = [p for p in _points(histories, row) if p[0] >= fs]
        if not before or not mine:
            row["fork_rule"] = "fresh (no source history to re-judge from)"
            continue
        margin, window = row.get("verdict_margin"), row.get("verdict_window")
        det = DivergenceDetector(VerdictConfig(**{k: v for k, v in (("margin", margin), ("window", window))
                                                  if v is not None}))
        det.update(before)
        if det.diverged:
            row["fork_rule"] = f"fresh (the source had diverged at step {det.divergence_step}, before the fork)"
            continue
        det.update(mine)
        row["fresh_observed"], row["fresh_divergence_step"] = row["observed"], row.get("divergence_step")
        row["observed"], row["divergence_step"] = det.observed, det.divergence_step
        row["min_loss"] = det.min_loss if math.isfinite(det.min_loss) else None
        changed = (row["observed"], row["divergence_step"]) != (row["fresh_observed"], row["fresh_divergence_step"])
        row["fork_rule"] = "source" + (f" (fresh: {row['fresh_observed']}"
                                       + (f" at {row['fresh_divergence_step']}" if row["fresh_divergence_step"]
                                          is not None else "") + ")" if changed else "")
    return rows


def note(row: Dict) -> Optional[str]:
    """The table's words for a verdict the report changed (None where it kept the run's own)."""
    if "fresh_observed" not in row or row.get("fork_rule") == "source":
        return None
    low = f", running minimum {row['min_loss']:.3f}" if row.get("min_loss") is not None else ""
    where = f" at step {row['fresh_divergence_step']}" if row.get("fresh_divergence_step") is not None else ""
    return (f"judged from its source's detector at the fork step (verdict.fork_baseline=source{low}); "
            f"the fork's own detector, started at the fork, said {row['fresh_observed']}"
            f"{where}")


__all__ = ["RULES", "source_verdicts", "note"]
