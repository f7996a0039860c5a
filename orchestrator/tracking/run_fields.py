"""MLflow's standard run fields: source, user and git tags, the description, system metrics, the job folder as
artifacts, and the outcome written onto the run once the job is over."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.report.links import artifact_view_route
from flash_forensics.orchestrator.tracking.store import (
    MAX_METRICS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
    REPO_ROOT,
    TrackingConfig,
    _truncate,
    make_client,
    retry,
)


def git_info(cwd: Path = REPO_ROOT) -> Dict[str, str]:
    """Commit of the code that ran and whether the tree had uncommitted changes."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD") or "unknown"
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git.commit": "unknown", "git.dirty": "unknown"}
    return {"git.commit": commit, "git.dirty": str(dirty).lower(), "mlflow.source.git.commit": commit}



# ------------------------------------------------------------------------------------ standard run fields
def source_tags() -> Dict[str, str]:
    """MLflow's standard fields that mlflow.start_run fills and MlflowClient.create_run does not: source (the entry
    script; type JOB under SLURM, else LOCAL), user, git commit (+ whether the tree was dirty)."""
    import getpass
    import sys
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        user = os.environ.get("USER") or "unknown"
    entry = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "python"
    return {"mlflow.source.name": str(Path(entry).resolve()) if entry != "python" else entry,
            "mlflow.source.type": "JOB" if os.environ.get("SLURM_JOB_ID") else "LOCAL",
            "mlflow.user": user, **git_info()}


def describe_run(intervention: str, expect: Optional[str], paper: Optional[str], observed: Optional[str] = None,
                 divergence_step: Optional[int] = None, steps_done: Optional[int] = None,
                 error: Optional[str] = None, cause: Optional[str] = None, control: Optional[str] = None,
                 control_step: Optional[int] = None, log_route: Optional[str] = None) -> str:
    """The run's description (mlflow.note.content, markdown on the run page): the intervention, what the paper
    says of it and, once known, the verdict with its FP32 control (record.verdict_line: a divergence counts as the
    paper's only when its control stayed stable); with log_route, a link to the job's run.log (one click from the
    run page, not four through the artifact tree)."""
    said = {"diverges": "diverge", "stable": "stay stable"}
    lines = [f"**{intervention}**" + (f": the paper expects it to **{said.get(expect, expect)}**" if expect else "")]
    if paper:
        lines.append(f"Paper: {paper}")
    if observed in ("diverged", "stable"):
        match = record.matches_paper(expect, observed, cause) if expect else None
        what = (record.verdict_line(observed, divergence_step, cause or record.CAUSE_NO_CONTROL, control,
                                    control_step) if observed == "diverged"
                else "stable" + (f" to step {steps_done}" if steps_done else ""))
        lines.append(f"Verdict: **{what}**" + ("" if match is None else
                                                (" (matches the paper)" if match
                                                 else " (**does not match the paper**)")))
    elif observed == "failed":
        lines.append("Verdict: **failed**" + (f": `{str(error).splitlines()[0][:300]}`" if error else ""))
    else:
        lines.append("Verdict: running")
    if log_route:
        lines.append(f"[run.log]({log_route}): the job's log")
    return "\n\n".join(lines)


def start_system_metrics(run_id: str, uri: str, cfg: "TrackingConfig", resume: bool = False):
    """MLflow's own system-metrics monitor for a run made with MlflowClient (mlflow.start_run would start it):
    a daemon thread that logs system/* every cfg.system_metrics_every_s and stops when the run is terminated.
    Returns it, or None when off or unavailable (said, not silent)."""
    if not cfg.system_metrics:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        mon = SystemMetricsMonitor(run_id, sampling_interval=cfg.system_metrics_every_s, samples_before_logging=1,
                                   resume_logging=resume, tracking_uri=uri)
        mon.start()
        return mon
    except Exception as e:  # psutil missing, an odd platform: training goes on without them
        print(f"[tracking] system metrics off for run {run_id}: {type(e).__name__}: {e}")
        return None


RUN_LOG = "job/run.log"  # where log_job_artifacts puts the job's log (the run description links it)
JOB_ARTIFACTS = ("*.log", "result.json", "error.txt")  # Hydra's job log (run.log), the result, the traceback


def log_job_artifacts(uri: str, run_id: str, job_dir: os.PathLike) -> List[str]:
    """The job folder's record as artifacts of its run: Hydra's log, result.json, the traceback (error.txt, also
    as traceback.txt) under job/, and the resolved config .hydra/ under hydra/. Returns what it logged."""
    job_dir = Path(job_dir)
    client = make_client(uri)
    logged = []
    for pattern in JOB_ARTIFACTS:
        for f in sorted(job_dir.glob(pattern)):
            if f.is_file():
                retry(client.log_artifact, run_id, str(f), "job")
                logged.append(f"job/{f.name}")
    hydra_dir = job_dir / ".hydra"
    if hydra_dir.is_dir():
        retry(client.log_artifacts, run_id, str(hydra_dir), "hydra")
        logged += [f"hydra/{f.name}" for f in sorted(hydra_dir.iterdir()) if f.is_file()]
    return logged


FINITE_SUFFIX = "_finite"  # train/loss_finite: train/loss without its NaN/Inf points


def record_outcome(uri: str, run_id: str, result: Mapping[str, Any], paper: Optional[str] = None,
                   keys: Iterable[str] = ("train/loss",)) -> None:
    """After the job: the description with the verdict and, for each of `keys` whose history holds NaN/Inf, its finite
    points as `<key>_finite`: MLflow's run page draws no chart at all for a metric whose latest value is NaN, so a
    NaN-diverged run would show no loss curve. The NaN points stay in `<key>` (counted, never hidden)."""
    from mlflow.entities import Metric
    client = make_client(uri)
    exp = retry(client.get_run, run_id).info.experiment_id
    note = describe_run(result.get("intervention") or "?", result.get("expected"), paper, result.get("observed"),
                        result.get("divergence_step"), result.get("steps_done"), result.get("error"),
                        log_route=artifact_view_route(exp, run_id, RUN_LOG))
    metrics = []  # the divergence marker is the divergence_step metric itself, at that step (run_end.log_record)
    for key in keys:
        hist = retry(client.get_metric_history, run_id, key)
        finite = [m for m in hist if m.value == m.value and abs(m.value) != float("inf")]
        if finite and len(finite) < len(hist):
            metrics += [Metric(key + FINITE_SUFFIX, float(m.value), m.timestamp, m.step) for m in finite]
    retry(client.set_tag, run_id, "mlflow.note.content", _truncate(note, MAX_TAG_VAL_LENGTH))
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        retry(client.log_batch, run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])


