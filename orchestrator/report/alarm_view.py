"""The report's live-alarm section: what monitor.alarm did in each run it was on in, against the run's verdict.

A run's record holds `alarm` when monitor.alarm was on (orchestrator/monitor/alarm.py): its rule, and the step it
fired at (None: it never did). Per run: a hit (fired before the divergence: the lead in steps), late (at or after
it), a miss (a divergence it never fired before), a false alarm (fired in a stable run), quiet (a stable run it
spared), inactive (its signal was never logged, e.g. rmax_rate with SDPA: counted apart), or not judged (a failed or
unfinished run). `flash-forensics early-warning` chooses rules offline over many
runs; this says how a rule did live, in the runs of one report.
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

from flash_forensics.orchestrator.monitor.signals import rule_text

HEADING = "## Live alarm (monitor.alarm)"


def outcome(row: Dict) -> Dict:
    """{kind: hit | late | miss | false alarm | quiet | inactive | not judged, lead: steps (hits), line: one
    sentence}."""
    a, obs, div = row["alarm"], row.get("observed"), row.get("divergence_step")
    step = a.get("step")
    if a.get("inactive") and step is None:  # its signal was never logged: neither a miss nor a rightly quiet alarm
        return dict(kind="inactive", line=f"could never fire: {a['inactive']}")
    fired = (f"fired at step {step} ({a.get('signal')} = {a['value']:.6g})" if step is not None and
             isinstance(a.get("value"), (int, float)) else f"fired at step {step}")
    if obs == "diverged" and div is not None:
        if step is None:
            return dict(kind="miss", line=f"missed: no alarm before the divergence at step {div}")
        if step < div:
            return dict(kind="hit", lead=div - step, line=f"{fired}, {div - step} steps before the divergence "
                                                             f"at step {div}")
        return dict(kind="late", line=f"{fired}, not before the divergence at step {div}")
    if obs == "stable":
        if step is None:
            return dict(kind="quiet", line="quiet, and the run stayed stable")
        return dict(kind="false alarm", line=f"{fired}: a false alarm, the run stayed stable")
    end = row.get("steps_done")
    return dict(kind="not judged", line=(fired if step is not None else f"no alarm by step {end}")
                + " (the run has no verdict: failed or unfinished)")


def lines(rows: Sequence[Dict]) -> List[str]:
    """Markdown lines of the section (empty: monitor.alarm was on in no run)."""
    armed = [r for r in rows if isinstance(r.get("alarm"), dict)]
    if not armed:
        return []
    got = [(r, outcome(r)) for r in armed]
    n = lambda kind: sum(1 for _, o in got if o["kind"] == kind)  # noqa: E731
    leads = [o["lead"] for _, o in got if o["kind"] == "hit"]
    diverged = n("hit") + n("late") + n("miss")
    stable = n("false alarm") + n("quiet")
    rules = sorted({rule_text(r["alarm"].get("signal"), r["alarm"].get("threshold"), r["alarm"].get("direction"))
                    for r in armed})
    head = (f"monitor.alarm was on in {len(armed)} of {len(rows)} runs (rule{'s' if len(rules) > 1 else ''}: "
            + ", ".join(f"`{x}`" for x in rules) + f"). Diverged runs warned in time: {n('hit')} of {diverged}"
            + (f" (lead: median {statistics.median(leads):g}, min {min(leads)}, max {max(leads)} steps)" if leads
               else "") + f"; late {n('late')}, missed {n('miss')}. False alarms: {n('false alarm')} of {stable} "
            f"stable runs." + (f" Not judged: {n('not judged')}." if n("not judged") else "")
            + (f" Could never fire (its signal not logged): {n('inactive')}." if n("inactive") else ""))
    out = [HEADING, "", head, ""]
    out += [f"- {r.get('job')} ({r.get('intervention')}): {o['line']}" for r, o in got]
    return out + [""]


__all__ = ["HEADING", "lines", "outcome"]
