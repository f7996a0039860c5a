"""Localization's third stage: layer -> heads -> rounding point.

The rounding-point forks are ordinary interventions, named by the point they move (ROUNDING_POINTS, kernels/recipes.py):
  lift_<point>       the run's recipe with only <point> kept in FP32 (attention.keep_fp32=[point]);
  bf16_only_<point>  the fp32 recipe with only <point> rounded to BF16 (attention.round_bf16=[point]).
Each fork is judged against its peer (orchestrator/report/rows.py _peer: the run of that name with the most overrides
in common, e.g. the same seed and checkpoint): a lift against the `baseline`, a lowering against the `fp32` reference.

  lift:      prevents (stable to at least the baseline's divergence step, where the baseline diverged) | delays by N
             steps (diverged N >= min_delay steps later) | hastens | no effect | inconclusive | failed | not run
  bf16_only: reproduces at step N (diverged where fp32 is stable) | no effect (stable) | inconclusive | failed | not run

A point the divergence *needs* BF16 at is one whose lift prevents it and whose lowering alone reproduces it. When
no lift prevents and no lowering reproduces, the verdict says "no single rounding point explains it"; forks that
failed, were not run, or cannot be judged (no diverged baseline, no stable fp32, stopped too early) are named.
Input: report rows (orchestrator/report/rows.py; verdicts.json's "runs"); reading, writing and MLflow: rounding_io.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from flash_forensics.kernels import recipes
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.report.rows import BASELINE, REFERENCE, _peer

SWEEP = "rounding_points"  # the sweep file (sweeps/rounding_points.yaml) whose forks this stage reads
LIFT, BF16_ONLY = "lift", "bf16_only"
_PREFIX = {BF16_ONLY: "bf16_only_", LIFT: "lift_"}


def parse_point(intervention: Optional[str]) -> Optional[Tuple[str, str]]:
    """(LIFT | BF16_ONLY, point) of an intervention named lift_<point> or bf16_only_<point>; None otherwise."""
    name = intervention or ""
    for kind, prefix in _PREFIX.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return kind, name[len(prefix):]
    return None


def intervention_name(kind: str, point: str) -> str:
    return _PREFIX[kind] + point


def known_points() -> Tuple[str, ...]:
    """kernels.recipes.ROUNDING_POINTS, in the recipe's order."""
    return tuple(recipes.ROUNDING_POINTS)


@dataclass
class ForkRun:
    """One fork and how it compares with its peer (the baseline for a lift, fp32 for a lowering)."""
    job: Optional[str]
    intervention: str
    observed: str
    divergence_step: Optional[int]
    last_step: Optional[int]
    outcome: str
    steps: Optional[int] = None  # delays/hastens: divergence step minus the baseline's; reproduces: its step
    against: Optional[str] = None  # the peer's job
    note: str = ""
    mlflow_run_id: Optional[str] = None


@dataclass
class Side:
    """All forks of one point and kind (several with several seeds): the outcome they share, else 'mixed'."""
    outcome: str = "not run"
    steps: Optional[int] = None  # the smallest delay / the earliest reproduced step over the runs
    runs: List[ForkRun] = field(default_factory=list)


@dataclass
class PointResult:
    point: str
    lift: Side = field(default_factory=Side)
    bf16_only: Side = field(default_factory=Side)
    known: bool = True  # False: not in kernels/recipes.py's ROUNDING_POINTS (a typo in an intervention name?)


def _last_step(row: Dict) -> Optional[int]:
    n = row.get("steps_done")
    return n - 1 if isinstance(n, int) and n > 0 else None


def _error(row: Dict) -> str:
    return (str(row.get("error") or "unknown error").strip().splitlines() or ["?"])[0][:200]


def _judge(row: Dict, kind: str, rows: Sequence[Dict], min_delay: int) -> ForkRun:
    obs, d, last = row.get("observed"), row.get("divergence_step"), _last_step(row)
    run = ForkRun(row.get("job"), row.get("intervention"), obs, d, last, "inconclusive",
                  mlflow_run_id=row.get("mlflow_run_id"))
    if obs == "failed":
        run.outcome, run.note = "failed", _error(row)
        return run
    base = _peer(row, rows, BASELINE)
    bd = base.get("divergence_step") if base is not None and base.get("observed") == "diverged" else None
    if kind == LIFT:
        if base is None:
            run.note = "no baseline run to compare with"
        elif bd is None:
            run.note = f"the baseline ({base.get('job')}) {base.get('observed')}: nothing to prevent"
        else:
            run.against = base.get("job")
            if obs == "stable" and last is not None and last < bd:
                run.note = f"stable, but stopped at step {last}, before the baseline's divergence at step {bd}"
            elif obs == "stable":
                run.outcome = "prevents"
            elif d is not None:
                run.steps = d - bd
                run.outcome = ("delays" if run.steps >= min_delay else "hastens" if run.steps <= -min_delay
                               else "no effect")
        return run
    ref = _peer(row, rows, REFERENCE)
    run.against = ref.get("job") if ref is not None else None
    if obs == "stable":
        if bd is not None and last is not None and last < bd:
            run.note = f"stable, but stopped at step {last}, before the baseline's divergence at step {bd}"
        else:
            run.outcome = "no effect"
    elif ref is None:
        run.note = f"diverged at step {d}, but no fp32 reference run to compare with (add intervention=fp32)"
    elif ref.get("observed") != "stable":
        run.note = f"diverged at step {d}, but the fp32 reference ({ref.get('job')}) {ref.get('observed')} too"
    else:
        run.outcome, run.steps = "reproduces", d
    return run


def _side(runs: List[ForkRun]) -> Side:
    if not runs:
        return Side()
    judged = [r for r in runs if r.outcome not in ("failed", "inconclusive")]
    if not judged:
        return Side("failed" if any(r.outcome == "failed" for r in runs) else "inconclusive", None, runs)
    outcomes = {r.outcome for r in judged}
    if len(outcomes) > 1:
        return Side("mixed", None, runs)
    outcome = outcomes.pop()
    steps = [r.steps for r in judged if r.steps is not None]
    return Side(outcome, (min(steps) if outcome in ("delays", "reproduces") else max(steps)) if steps else None,
                runs)


@dataclass
class RoundingResult:
    points: List[PointResult]
    baseline: Dict = field(default_factory=dict)  # job, observed, divergence_step, mlflow_run_id of each baseline
    reference: Dict = field(default_factory=dict)
    localization: Optional[Dict] = None  # the layer/heads stage's target (localize.json's "target"), when present
    source: Optional[str] = None
    min_delay: int = 1

    # --------------------------------------------------------------------------------------------- the answer
    def _with(self, kind: str, outcome: str) -> List[PointResult]:
        return [p for p in self.points if getattr(p, kind).outcome == outcome]

    @property
    def needs_bf16(self) -> List[str]:
        """Points whose lift prevents the divergence and whose lowering alone reproduces it."""
        return [p.point for p in self.points if p.lift.outcome == "prevents" and p.bf16_only.outcome == "reproduces"]

    @property
    def prevents(self) -> List[str]:
        return [p.point for p in self._with(LIFT, "prevents")]

    @property
    def reproduces(self) -> List[str]:
        return [p.point for p in self._with(BF16_ONLY, "reproduces")]

    @property
    def delays(self) -> Dict[str, int]:
        return {p.point: p.lift.steps for p in self._with(LIFT, "delays")}

    @property
    def cause_points(self) -> List[str]:
        """The points the answer names: those it needs BF16 at, else any whose lift prevents or lowering reproduces."""
        return self.needs_bf16 or [p for p in self.prevents + self.reproduces if p not in self.needs_bf16]

    def unexplained(self) -> List[str]:
        """Forks the answer could not use: not run, failed, inconclusive, mixed, unknown points (one line each)."""
        out, not_run, neither = [], [], []
        for p in self.points:
            if not p.known:
                out.append(f"`{p.point}` is not a rounding point of flash_forensics.kernels.recipes "
                           f"(allowed: {', '.join(known_points())})")
            if p.lift.outcome == p.bf16_only.outcome == "not run":
                neither.append(p.point)
                continue
            for kind in (LIFT, BF16_ONLY):
                side, name = getattr(p, kind), intervention_name(kind, p.point)
                if side.outcome == "not run":
                    not_run.append(name)
                for r in side.runs:
                    if r.outcome in ("failed", "inconclusive"):
                        out.append(f"{name} ({r.job}): {r.outcome}: {r.note}")
                if side.outcome == "mixed":
                    out.append(f"{name}: mixed over {len(side.runs)} runs ("
                               + ", ".join(f"{r.job}: {r.outcome}" for r in side.runs) + ")")
        return (out + ([f"not run: {', '.join(not_run)}"] if not_run else [])
                + ([f"no fork of {', '.join(neither)}"] if neither else []))

    def where(self) -> Optional[str]:
        """The layer/heads stage's answer as a phrase, when it ran."""
        t = self.localization or {}
        if t.get("layer") is None:
            return None
        heads = t.get("heads") or []
        return (f"layer {t['layer']}" + (f", heads {','.join(map(str, heads))}" if heads else "")
                + (f" ({t['why']})" if t.get("why") else ""))

    def what(self) -> str:
        """The rounding stage's answer in one sentence."""
        if not any(p.lift.runs or p.bf16_only.runs for p in self.points):
            return "no rounding-point forks (lift_<point> / bf16_only_<point>) to read"
        by = {p.point: p for p in self.points}
        base = self.baseline.get("runs") or []
        if base and not any(r.get("observed") == "diverged" for r in base):
            return "the baseline did not diverge: there is no divergence to explain"
        if not any(s.outcome not in ("failed", "inconclusive", "mixed", "not run")
                   for p in self.points for s in (p.lift, p.bf16_only)):
            return "no rounding-point fork could be judged"
        parts = []
        for pt in self.needs_bf16:
            parts.append(f"divergence needs BF16 at `{pt}` (lifting it alone prevents it; rounding it alone to BF16, "
                         f"the rest FP32, reproduces it at step {by[pt].bf16_only.steps})")
        for pt in self.prevents:
            if pt not in self.needs_bf16:
                parts.append(f"lifting `{pt}` alone prevents it (rounding it alone to BF16, the rest FP32: "
                             f"{_phrase(by[pt].bf16_only)})")
        for pt in self.reproduces:
            if pt not in self.needs_bf16:
                parts.append(f"rounding `{pt}` alone to BF16 (the rest FP32) reproduces it at step "
                             f"{by[pt].bf16_only.steps} (lifting it alone: {_phrase(by[pt].lift)})")
        if not parts:
            parts.append("no single rounding point explains it (no lift prevents it and no BF16-only rounding "
                         "reproduces it)")
        for pt, n in self.delays.items():
            parts.append(f"lifting `{pt}` alone delays it by {n} steps")
        for p in self._with(LIFT, "hastens"):
            parts.append(f"lifting `{p.point}` alone hastens it by {-p.lift.steps} steps")
        return "; ".join(parts)

    def verdict(self) -> str:
        """The user's answer: where (layer/heads, when localized) and what (the rounding point), with the forks it
        could not use."""
        w = self.where()
        out = (f"{w} -> " if w else "") + self.what()
        miss = self.unexplained()
        return out + (f". Not used: {'; '.join(miss)}" if miss else "")

    # ---------------------------------------------------------------------------------------------- renderings
    def rows(self) -> List[Tuple[str, str, str]]:
        """(point, lift cell, bf16_only cell): the outcome table of verdicts.md and the terminal."""
        return [(p.point, _cell(p.lift, LIFT), _cell(p.bf16_only, BF16_ONLY)) for p in self.points]

    def format(self) -> str:
        w = max([len("point")] + [len(p.point) for p in self.points])
        lw = max([len("lift to FP32 alone")] + [len(r[1]) for r in self.rows()])
        lines = [f"{'point'.ljust(w)}  {'lift to FP32 alone'.ljust(lw)}  BF16 alone (rest FP32)"]
        lines.append("-" * len(lines[0]))
        lines += [f"{pt.ljust(w)}  {a.ljust(lw)}  {b}" for pt, a, b in self.rows()]
        return "\n".join(lines + ["", "Cause: " + self.verdict()])

    def markdown(self) -> List[str]:
        """The verdict and the outcome table, for verdicts.md's Cause section."""
        md = [self.verdict(), "", "| point | lift to FP32 alone | BF16 alone (rest FP32) |", "|---|---|---|"]
        return md + [f"| `{pt}` | {a} | {b} |" for pt, a, b in self.rows()]

    def to_dict(self) -> Dict:
        return record.encode({**asdict(self), "verdict": self.verdict(), "what": self.what(), "where": self.where(),
                              "needs_bf16": self.needs_bf16, "prevents": self.prevents,
                              "reproduces": self.reproduces, "delays": self.delays,
                              "cause_points": self.cause_points, "unexplained": self.unexplained()})


def _phrase(side: Side) -> str:
    return {"not run": "not run", "failed": "failed", "inconclusive": "inconclusive", "mixed": "mixed",
            "no effect": "no effect", "prevents": "prevents it", "reproduces": f"reproduces it at step {side.steps}",
            "delays": f"delays it by {side.steps} steps", "hastens": f"hastens it by {-(side.steps or 0)} steps",
            }[side.outcome]


def _cell(side: Side, kind: str) -> str:
    if side.outcome == "not run":
        return "not run"
    r = side.runs[0] if len(side.runs) == 1 else None
    if side.outcome == "prevents":
        return "stable: prevents" + (f" (to step {r.last_step})" if r and r.last_step is not None else "")
    if side.outcome in ("delays", "hastens", "no effect") and kind == LIFT and r is not None:
        return f"diverged at {r.divergence_step} ({r.steps:+d}): {side.outcome}"
    if side.outcome == "reproduces":
        return f"diverged at {side.steps}: reproduces"
    if side.outcome == "no effect" and kind == BF16_ONLY:
        return "stable: no effect"
    return side.outcome + (f" ({r.note})" if r is not None and r.note else "")


def analyze(rows: Sequence[Dict], localization: Optional[Dict] = None, source: Optional[str] = None,
            min_delay: int = 1) -> RoundingResult:
    """The rounding stage over report rows (run records' fields: intervention, observed, divergence_step,
    steps_done, error, overrides, job). localization: localize.json's dict (its "target" is used) or the target."""
    if isinstance(min_delay, bool) or not isinstance(min_delay, int) or min_delay < 1:
        raise ValueError(f"min_delay={min_delay!r} is not allowed: expected an integer >= 1 (steps)")
    rows = list(rows)
    known = known_points()
    found: Dict[str, Dict[str, List[ForkRun]]] = {}
    for row in rows:
        parsed = parse_point(row.get("intervention"))
        if parsed:
            kind, point = parsed
            found.setdefault(point, {LIFT: [], BF16_ONLY: []})[kind].append(_judge(row, kind, rows, min_delay))
    # with any fork at all, every point of the recipe is listed: those the sweep did not cover say "not run"
    order = (list(known) + sorted(p for p in found if p not in known)) if found else []
    points = [PointResult(p, _side(found.get(p, {}).get(LIFT, [])), _side(found.get(p, {}).get(BF16_ONLY, [])),
                          known=not known or p in known) for p in order]
    pick = lambda name: [{k: r.get(k) for k in ("job", "observed", "divergence_step", "mlflow_run_id")}  # noqa: E731
                         for r in rows if r.get("intervention") == name]
    target = (localization or {}).get("target", localization) if localization else None
    return RoundingResult(points, {"runs": pick(BASELINE)}, {"runs": pick(REFERENCE)}, target, source, min_delay)


__all__ = ["SWEEP", "LIFT", "BF16_ONLY", "parse_point", "intervention_name", "known_points", "analyze",
           "RoundingResult", "PointResult", "Side", "ForkRun"]
