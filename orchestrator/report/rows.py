"""Report rows: one per run, from job folders (their run records), compared with the sweep's baseline, its fp32
reference and the paper. A row is a dict of ROW_KEYS, the run record's fields a report shows (orchestrator/record.py)
plus `job` (its folder, relative to what was read) and `vs_baseline` (a note).
Rows from MLflow: orchestrator/report/readback.py.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.job.folder import START_FILE, alive_here, read_job_start
from flash_forensics.orchestrator.record import RESULT_FILE, matches_paper

BASELINE, REFERENCE = "baseline", "fp32"
ROW_KEYS = ("job", "intervention", "overrides", "expected", "observed", "matches_paper", "divergence_step",
            "final_loss", "min_loss", "peak_wq_norm", "peak_wq_where", "steps_done", "wall_s", "vs_baseline",
            "mlflow_run_id", "error", "job_dir", "fork_step", "forked_from", "verdict", "cause", "control", "setup",
            "fork_jump", "loss_rise", "source_run_id", "fork_baseline", "verdict_margin", "verdict_window",
            "fork_rule", "alarm")


def _num(x) -> Optional[float]:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def row_from_record(rec: record.RunRecord, job: Optional[str] = None, job_dir: Optional[Path] = None) -> Dict:
    d = rec.to_dict()
    row = {k: d.get(k) for k in ROW_KEYS}
    row.update(job=job, vs_baseline=None, job_dir=str(job_dir) if job_dir else rec.job_dir,
               overrides=record.user_overrides(rec.overrides))  # as the user wrote them, as the MLflow tag holds
    return row


def row_from_result(result: Dict[str, Any], job: Optional[str] = None, job_dir: Optional[Path] = None) -> Dict:
    """A report row from a job's result.json dict (any record version)."""
    return row_from_record(record.RunRecord.from_dict(result), job, job_dir)


def _failed_row(job_dir: Path, name: str, err: str, start: Optional[Dict] = None) -> Dict:
    """A job without a readable record, named by its Hydra overrides or its job.json (start: as read already).
    job.json (written at start) also gives its MLflow run id: a killed run's metrics stay findable (early-warning
    --include-unfinished)."""
    start = (read_job_start(job_dir) or {}) if start is None else start
    overrides = _hydra_overrides(job_dir) or [str(o) for o in start.get("overrides") or []]
    intervention = start.get("intervention") or next(
        (o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == "intervention"), None)
    return row_from_result({"intervention": intervention, "overrides": overrides, "observed": "failed",
                            "error": err, "expected": start.get("expected"),
                            "mlflow_run_id": start.get("mlflow_run_id")}, name, job_dir)


def job_row(job_dir: Path, name: str) -> Dict:
    """The row of one job folder: its record, else a failed row that says why (named by its Hydra overrides)."""
    rfile = Path(job_dir) / RESULT_FILE
    if not rfile.is_file():  # still running (job.json's pid alive on this host), else killed
        start = read_job_start(job_dir) or {}
        why = (f"no result.json yet: the job is still running (pid {start['pid']})" if alive_here(start) else
               "no result.json: the job was killed before it could write one (timeout, OOM, preemption?)")
        return _failed_row(job_dir, name, why, start)
    try:
        row = row_from_record(record.read(job_dir), name, job_dir)
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:  # killed mid-write, or not a record
        return _failed_row(job_dir, name, f"unreadable {rfile}: {e}")
    bad = implausible(row)
    return _failed_row(job_dir, name, f"{rfile}: {bad}") if bad else row


def implausible(row: Dict) -> Optional[str]:
    """Why a record's values cannot be what a job wrote (a hand-edited or damaged result.json), else None."""
    for key in ("divergence_step", "fork_step", "steps_done"):
        v = row.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            return f"{key}={v!r} is not a step (expected an integer >= 0)"
    if row.get("observed") == "diverged" and row.get("divergence_step") is None:
        return "observed 'diverged' without a divergence_step"
    fl = row.get("final_loss")
    if row.get("observed") == "stable" and isinstance(fl, float) and not math.isfinite(fl):
        return f"observed 'stable' with final_loss={fl}"
    return None


def _natural(parts: Sequence[str]):
    """Natural order: job 2 before job 10, paper_isolation-2 before paper_isolation-10."""
    return [[(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", x) if t] for x in parts]


def collect_rows(sweep_dir: Path) -> List[Dict]:
    """Rows for every job folder of a sweep (those holding result.json, Hydra's .hydra/ or job.json: a job killed
    before its result), in job order."""
    sweep_dir = Path(sweep_dir)
    jobs = {p.parent for marker in (RESULT_FILE, ".hydra", START_FILE) for p in sweep_dir.rglob(marker)}
    jobs.discard(sweep_dir)
    jobs = {j for j in jobs if record.REPORT_DIR not in j.relative_to(sweep_dir).parts}
    return [job_row(j, str(j.relative_to(sweep_dir)))
            for j in sorted(jobs, key=lambda p: _natural(p.relative_to(sweep_dir).parts))]


def rows_from_dirs(dirs: Sequence) -> List[Dict]:
    """Rows from several places at once: a job dir (holding result.json) gives its row, a sweep dir its jobs'."""
    rows: List[Dict] = []
    for d in (Path(x).resolve() for x in dirs):  # resolved: "." gets its folder's name
        if (d / RESULT_FILE).is_file() or (d / START_FILE).is_file():
            rows.append(job_row(d, d.name))
        elif d.is_dir():
            found = collect_rows(d)
            if not found:
                raise ValueError(f"{d}: no job folders (result.json, .hydra/ or job.json) under it")
            rows.extend(dict(r, job=f"{d.name}/{r['job']}") for r in found)
        else:
            raise ValueError(f"{d}: not a directory")
    return rows


def _hydra_overrides(job_dir: Path) -> List[str]:
    f = Path(job_dir) / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return []
    try:
        import yaml
        return [str(o) for o in (yaml.safe_load(f.read_text()) or [])]
    except Exception:
        return []


# -------------------------------------------------------------------------------------------- comparing
def _other_overrides(row) -> set:
    return {o for o in row.get("overrides") or [] if o.split("=", 1)[0].lstrip("+~") != "intervention"}


def control_of(row: Dict) -> Optional[str]:
    """The control a run is (`+control=fa2`: fa2), else None. A control runs the baseline intervention on another
    attention (conf/control/): it is compared with the baseline, never taken for it."""
    return next((o.split("=", 1)[1] for o in row.get("overrides") or []
                 if "=" in o and o.split("=", 1)[0].lstrip("+~") == "control"), None)


def _peer(row: Dict, rows: Sequence[Dict], name: str) -> Optional[Dict]:
    """The `name` run closest to `row`: same other overrides (e.g. same seed) first, else the first one. A
    control is the baseline's peer only where no plain baseline ran."""
    cands = [r for r in rows if r.get("intervention") == name and r is not row]
    if name == BASELINE and any(control_of(r) is None for r in cands):
        cands = [r for r in cands if control_of(r) is None]
    if not cands:
        return None
    mine = _other_overrides(row)  # the same setup (seed, lr, ...) first, then the closest overrides
    return max(cands, key=lambda r: (_comparable(row, r),
                                     len(_other_overrides(r) & mine) - len(_other_overrides(r) ^ mine)))


def _control_name(row: Dict) -> str:
    """How a verdict names its control: the job (and MLflow run) it was."""
    rid = row.get("mlflow_run_id")
    job = row.get("job") or (Path(row["job_dir"]).name if row.get("job_dir") else None)
    return " ".join(x for x in (f"job {job}" if job else None, f"run {rid[:12]}" if rid else None) if x) or "?"


def _comparable(row: Dict, cand: Dict) -> bool:
    """cand could be row's control: same setup (seed, data order, optimizer, model, batch) where both record one,
    else the same other overrides (older records without a setup)."""
    a, b = row.get("setup"), cand.get("setup")
    if a and b:
        return not record.setup_differs(a, b)
    return _plain(_other_overrides(row)) == _plain(_other_overrides(cand))


def _plain(overrides: set) -> set:
    """The overrides that change the setup: not plumbing, not the intervention's own knobs (intervention.layer=...)."""
    return {o for o in overrides if not o.lstrip("+~").startswith(_PLUMBING + ("intervention.",))}


def control_for(row: Dict, rows: Sequence[Dict]) -> Optional[Dict]:
    """The FP32 run a divergence of `row` is judged against: an fp32 run of the same setup among rows (the sweep's
    own, or stored runs read with it), the same fork point first, then the one that ran longest; the fp32 run is its
    own control. None when there is none."""
    if row.get("intervention") == REFERENCE:
        return row
    cands = [r for r in rows if r is not row and r.get("intervention") == REFERENCE and _comparable(row, r)]
    if not cands:
        return None
    same_fork = lambda r: (r.get("forked_from"), r.get("fork_step")) == (row.get("forked_from"), row.get("fork_step"))  # noqa: E731
    done = lambda r: r.get("steps_done") if isinstance(r.get("steps_done"), int) else -1  # noqa: E731
    return max(cands, key=lambda r: (same_fork(r), r.get("observed") in ("stable", "diverged"), done(r)))


def judge(row: Dict, rows: Sequence[Dict]) -> Dict:
    """Fill row's cause, control, verdict (one line) and matches_paper: the control rule (record.control_cause)."""
    ctrl = control_for(row, rows) if row.get("observed") == "diverged" else None
    cause = record.control_cause(row.get("observed"), row.get("divergence_step"), ctrl)
    if ctrl is row:
        cause = record.CAUSE_NOT_PRECISION  # FP32 attention diverged: precision is ruled out by the run itself
    name = None if ctrl is None or ctrl is row else _control_name(ctrl)
    row.update(cause=cause, control=name, control_step=ctrl.get("divergence_step") if name else None,
               control_job=ctrl.get("job") if name else None,
               control_run_id=ctrl.get("mlflow_run_id") if name else None,
               matches_paper=matches_paper(row.get("expected"), row.get("observed"), cause))
    line = record.verdict_line(row.get("observed"), row.get("divergence_step"), cause, name,
                               ctrl.get("divergence_step") if ctrl is not None else None)
    if ctrl is row:
        line = f"diverged at step {row.get('divergence_step')} in FP32 attention: the cause is not precision"
    row["verdict"] = line
    return row


def _clip(text: str, n: int) -> str:
    """At most n characters, cut at a word and marked (the whole error is in the job's error file and result.json)."""
    if len(text) <= n:
        return text
    return text[:n].rsplit(" ", 1)[0].rstrip(",;:") + " [...]"


def compare(rows: List[Dict]) -> List[Dict]:
    """Fill the verdict with its control (judge), matches_paper and a `vs_baseline` note (vs the baseline's
    divergence and the fp32 final loss)."""
    for row in rows:
        judge(row, rows)
    for row in rows:
        notes = []
        name, obs = row.get("intervention"), row["observed"]
        if obs == "failed":
            notes.append("failed: " + _clip((str(row.get("error") or "unknown error").splitlines() or ["?"])[0], 200))
        ctrl = control_of(row) if name == BASELINE else None
        base = _peer(row, rows, BASELINE) if name != BASELINE or ctrl else None
        ref = _peer(row, rows, REFERENCE) if name != REFERENCE else None
        if ctrl:
            notes.append(f"control {ctrl}")
        elif name == BASELINE:
            notes.append("the baseline" + ("" if obs != "stable" else " did not diverge: run longer or check "
                                           "the recipe; comparisons with it are void"))
        elif name == REFERENCE:
            notes.append("the fp32 reference")
        if base is not None and obs != "failed":
            bd = base.get("divergence_step")
            if base["observed"] == "diverged" and obs == "stable":
                notes.append(f"stable where the baseline diverged at step {bd}")
            elif base["observed"] == "diverged" and obs == "diverged":
                d = row.get("divergence_step")
                delta = f" ({d - bd:+d} steps)" if d is not None and bd is not None else ""
                notes.append(f"diverged at step {d}; baseline at {bd}{delta}")
            elif base["observed"] == "stable" and obs == "diverged":
                notes.append(f"diverged at step {row.get('divergence_step')} while the baseline did not")
        if base is not None and base["observed"] == "stable" and (row.get("expected"), obs) == ("stable", "stable"):
            # stable as the paper expects, but so is its baseline: nothing was prevented, nothing matched
            row["matches_paper"], row["paper_void"] = False, True
            notes.append("void: its baseline did not diverge")
        fl, rl = _num(row.get("final_loss")), _num(ref.get("final_loss")) if ref else None
        if fl is not None and rl is not None and math.isfinite(fl) and math.isfinite(rl) and obs == "stable":
            notes.append(f"final loss {fl - rl:+.3f} vs fp32")
        if row.get("cause") and row["cause"] != record.CAUSE_PRECISION:
            notes.append(row["verdict"])
        row["vs_baseline"] = "; ".join(notes)
    return rows


def _common_overrides(rows: Sequence[Dict]) -> set:
    """Overrides every run shares (experiment=..., tracking.uri=...): left out of tables and legends."""
    if len(rows) < 2:
        return set()
    return set.intersection(*(_other_overrides(r) for r in rows))


# overrides that say where and how long a run ran, not what it computes: left out of plot legends
_PLUMBING = ("from_checkpoint=", "sweep_name=", "hydra.", "tracking.", "train.ckpt_every=", "train.max_steps=",
             "train.keep_checkpoints=", "train.early_stop=", "results_dir=", "+sweep=")


def _label(row: Dict, common: set = frozenset()) -> str:
    extra = sorted(o for o in _other_overrides(row) - common if not o.lstrip("+~").startswith(_PLUMBING)
                   and not o.startswith("+sweep="))
    tail = (" " + " ".join(extra)) if extra else ""
    return f"{row.get('job') or ''}:{row.get('intervention')}{tail}"


def shared_overrides(rows: Sequence[Dict]) -> Tuple[set, str]:
    """What plot legends leave out, and the note that says it once instead: the overrides every run shares, and
    those all runs but a few share (at most a quarter of them, e.g. `attention.fp32_gemm=tf32x3` on every fork
    but not on the baseline they forked from); one run: all of its overrides. Plumbing (_PLUMBING) is neither in
    the labels nor in the note. The note names the runs an override is not on by their job. Labels stay unique:
    where leaving the near-shared overrides out would make two alike, only those of every run are left out."""
    n = len(rows)
    per = [_other_overrides(r) for r in rows]
    if not n:
        return set(), ""
    every = set.intersection(*per)
    count = Counter(o for s in per for o in s)
    few = n // 4 if n >= 4 else 0
    shared = {o for o, c in count.items() if n - c <= few}
    if len({_label(r, shared) for r in rows}) < len({_label(r, every) for r in rows}):
        shared = set(every)
    said = lambda o: not o.lstrip("+~").startswith(_PLUMBING)  # noqa: E731
    groups: Dict[Tuple[str, ...], List[str]] = {}
    for o in sorted(o for o in shared if said(o)):
        without = tuple(str(r.get("job") or r.get("intervention")) for r, s in zip(rows, per) if o not in s)
        groups.setdefault(without, []).append(o)
    parts = [("every run" if not without else "every run but " + ", ".join(without)) + ": " + " ".join(os_)
             for without, os_ in sorted(groups.items(), key=lambda kv: len(kv[0]))]
    if n == 1 and parts:
        parts = ["overrides: " + " ".join(groups[()])]
    return shared, "; ".join(parts)


def counts(rows: Sequence[Dict]) -> str:
    """The sweep in one sentence: '3 runs; 0 match the paper (2 stable runs void: their baseline did not diverge);
    0 failed.' (the same words in verdicts.md, verdicts.html and the parent run's description)."""
    n_match = sum(1 for r in rows if r.get("matches_paper"))
    void = sum(1 for r in rows if r.get("paper_void"))
    failed = sum(1 for r in rows if r.get("observed") == "failed")
    why = (f" ({void} stable run{'s' if void > 1 else ''} void: {'their' if void > 1 else 'its'} baseline did not "
           f"diverge)") if void else ""
    return f"{len(rows)} runs; {n_match} match the paper{why}; {failed} failed."


def summary(rows: Sequence[Dict]) -> Dict[str, int]:
    """The sweep's counts, as verdicts.json and the parent run's metrics give them."""
    return {k: int(v) for k, v in record.sweep_metrics(list(rows)).items()}


__all__ = ["ROW_KEYS", "BASELINE", "REFERENCE", "control_for", "judge", "row_from_record",
           "row_from_result", "job_row", "collect_rows",
           "rows_from_dirs", "compare", "summary", "counts"]
