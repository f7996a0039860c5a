"""What a fork's stable/diverged verdict alone does not say, read from its loss history (report rows + histories).

- `fork_jump`: the fork's loss at its first step minus its baseline's at that step. Both see the same weights and
  the same batch there, so the difference is the intervention's change to the trained model's function. A fork
  that starts more than JUMP_NATS away is not a like-for-like continuation: e.g. the stabilized softmax (SFA)
  switched on at a checkpoint whose max logits are ~1e5 shifts rows by beta * rowmax and underflows them, and its
  "stable" is a recovery from a damaged model, not a prevented divergence.
- `loss_rise`: the mean loss over the fork's last RISE_STEPS steps minus over its first RISE_STEPS. A fork the
  verdict calls stable whose loss rose by more than RISE_NATS more than the fp32 reference's did was degrading when
  it ended: a later divergence is not ruled out (the verdict is censored at the fork's last step).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

JUMP_NATS = 0.5  # |first-step loss - baseline's| beyond this: the intervention changed the model's function
RISE_NATS = 0.25  # loss rise beyond the fp32 reference's: degrading at the fork's end
RISE_STEPS = 100  # the window at each end of the fork (a quarter of the fork when shorter than 4 windows)

Points = List[Tuple[int, float]]


def _loss(histories: Dict[str, Dict], row: Optional[Dict]) -> Points:
    if row is None:
        return []
    pts = (histories.get(row.get("mlflow_run_id") or "") or {}).get("train/loss") or []
    return [(int(s), float(v)) for s, v in pts if v is not None and math.isfinite(float(v))]


def loss_at(points: Points, step: int) -> Optional[float]:
    return next((v for s, v in points if s == step), None)


def loss_rise(points: Points, start: int, window: int = RISE_STEPS) -> Optional[float]:
    """mean(last window) - mean(first window) of the points from `start` on; None with fewer than 8 points."""
    pts = sorted(p for p in points if p[0] >= start)
    if len(pts) < 8:
        return None
    n = max(2, min(window, len(pts) // 4))
    first, last = [v for _, v in pts[:n]], [v for _, v in pts[-n:]]
    return sum(last) / n - sum(first) / n


def annotate(rows: Sequence[Dict], histories: Dict[str, Dict], baseline_of, reference_of) -> List[Dict]:
    """Fill each fork row's `fork_jump` and `loss_rise` and append their notes to `vs_baseline` (after
    rows.compare). baseline_of / reference_of(row): its baseline and fp32 rows (rows._peer)."""
    for row in rows:
        fs = row.get("fork_step")
        if not isinstance(fs, int) or row.get("observed") == "failed":
            continue
        mine = _loss(histories, row)
        if not mine:
            continue
        notes = []
        base = baseline_of(row)
        b0, m0 = loss_at(_loss(histories, base), fs), loss_at(mine, fs)
        if b0 is not None and m0 is not None and base is not row:
            row["fork_jump"] = m0 - b0
            if abs(m0 - b0) > JUMP_NATS:
                notes.append(f"its loss at the fork step is {m0 - b0:+.2f} nats from the baseline's on the same "
                             f"weights and batch ({m0:.2f} vs {b0:.2f}): the intervention changes the trained "
                             f"model's function, so this fork is not a like-for-like continuation")
        rise = loss_rise(mine, fs)
        row["loss_rise"] = rise
        if rise is not None and row.get("observed") == "stable":
            ref = reference_of(row)
            ref_rise = loss_rise(_loss(histories, ref), fs) if ref is not None and ref is not row else None
            if rise > RISE_NATS + (ref_rise if ref_rise is not None and ref_rise > 0 else 0.0):
                vs = f" (fp32: {ref_rise:+.2f})" if ref_rise is not None else ""
                last = max(s for s, _ in mine)
                notes.append(f"stable to step {last}, but its loss rose {rise:+.2f} nats from the fork's first to "
                             f"its last steps{vs}: degrading when it ended, a later divergence is not ruled out")
        if notes:
            row["fork_notes"] = notes  # also the run's `fork_health` tag and its MLflow description (verdict_view)
            row["vs_baseline"] = "; ".join(x for x in (row.get("vs_baseline"), *notes) if x)
    return list(rows)


__all__ = ["annotate", "loss_rise", "loss_at", "JUMP_NATS", "RISE_NATS", "RISE_STEPS"]
