"""The Hydra task function: validate, train, write result.json - always, also when the job fails.

Every exception is caught and recorded (observed 'failed' + error) so one failing job never takes the sweep down;
SystemExit / KeyboardInterrupt pass through (preemption requeue, ^C). A single (non-multirun) run that failed
makes run.py exit with status 1 (`exit_status`).

A job that dies without a result (kill -9, OOM, node loss) cannot write one itself. At its start it writes
job.json (intervention, overrides, pid, later its MLflow run id); `close_dead_jobs`, run by the launching side
when a multirun ends (callbacks.CloseDeadJobs), marks such a job's MLflow run KILLED with the reason and writes
its result.json (observed failed, its intervention and overrides), so the report row keeps them.
"""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.config.folders import check_capture_dir
from flash_forensics.orchestrator.config.validate import selected_interventions, validate_config
from flash_forensics.orchestrator.errors import WriteError
from flash_forensics.orchestrator.interventions import effective_model
from flash_forensics.orchestrator.job import checkpoint, folder_lock
from flash_forensics.orchestrator.job.distributed import detect_env
from flash_forensics.orchestrator.job.folder import (  # noqa: F401  (re-exported)
    START_FILE,
    alive_here,
    read_job_start,
    write_job_start,
    write_result,
)
from flash_forensics.orchestrator.job.train import Job
from flash_forensics.orchestrator.launch import job_log
from flash_forensics.orchestrator.record import ERROR_FILE, RESULT_FILE
from flash_forensics.orchestrator.report.sweep import write_run_report
from flash_forensics.orchestrator.tracking.tracker import (
    log_job_artifacts,
    make_client,
    mark_terminated,
    record_outcome,
    resolve_uri,
    retry,
)


def _hydra_context() -> tuple[Path, List[str], bool]:
    """(job output dir, task overrides, multirun?) from HydraConfig; a plain call gets ./results/runs/manual."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        hc = HydraConfig.get()
        return Path(hc.runtime.output_dir), list(hc.overrides.task), hc.mode == RunMode.MULTIRUN
    except ValueError:
        return Path("results/runs/manual"), [], False


def close_dead_jobs(root: Path, reason: str = "the job died without writing a result (killed, out of memory or "
                                              "node lost)") -> List[Path]:
    """For every job folder under root (root itself included) with job.json but no result.json whose process is
    gone: mark its MLflow run KILLED (tag verdict=failed, error=reason) and write its result.json. Returns them."""
    import os
    closed = []
    root = Path(root)
    for start in sorted([root / START_FILE, *root.glob(f"*/{START_FILE}")]):
        job_dir = start.parent
        info = read_job_start(job_dir)
        if info is None or (job_dir / RESULT_FILE).exists():
            continue
        if alive_here(info) and info["pid"] != os.getpid():
            continue  # still running (this machine)
        result = {"intervention": info.get("intervention"), "overrides": info.get("overrides", []),
                  "expected": info.get("expected"), "observed": "failed", "divergence_step": None,
                  "final_loss": None, "min_loss": None, "peak_wq_norm": None, "peak_wq_where": None,
                  "mlflow_run_id": info.get("mlflow_run_id"), "steps_done": _steps_logged(info),
                  "error": reason, "wall_s": None, "attention_routes": None}
        if info.get("mlflow_run_id") and info.get("tracking_uri"):
            mark_terminated(info["tracking_uri"], info["mlflow_run_id"], "KILLED", reason)
        write_result(job_dir, result)
        print(f"[job] {job_dir}: {reason}; marked failed (MLflow run KILLED)")
        closed.append(job_dir)
    return closed


def _foreign_folder(cfg, job_dir: Path) -> Optional[str]:
    """A fork (from_checkpoint) whose job folder already holds the checkpoints of a run that is not a fork (e.g.
    the source's own folder): auto-resume would reopen that run and rewrite its verdict. The sentence, or None."""
    if cfg.get("from_checkpoint") is None or not cfg.train.get("auto_resume", True):
        return None
    d = Path(job_dir) / "checkpoints"
    files = ([d / "last.pt"] if (d / "last.pt").is_file() else []) + list(checkpoint.step_files(d).values())[::-1]
    for p in files:
        try:
            head = checkpoint.read_header(p, key="auto-resume")
        except checkpoint.CheckpointError:
            continue
        if head.get("fork"):
            return None  # this fork's own checkpoint: a requeued fork resumes it
        return (f"from_checkpoint={str(cfg.from_checkpoint)!r}: the job folder {job_dir} holds the checkpoints of "
                f"another run ({p}, MLflow run {head.get('mlflow_run_id')}); a fork never writes to another run: "
                f"give the fork its own folder (hydra.run.dir=...)")
    return None


def _other_run_folder(cfg, job_dir: Path) -> Optional[str]:
    """A run (not a fork) whose job folder holds a checkpoint it cannot resume: another model shape, or more steps
    than train.max_steps (another run's folder, e.g. a finished one given again with hydra.run.dir). Resuming would
    fail or mislabel it, and the failure would overwrite that run's result.json. The sentence, or None."""
    if cfg.get("from_checkpoint") is not None or cfg.get("resume") is not None \
            or not cfg.train.get("auto_resume", True):
        return None
    try:
        path = checkpoint.latest(job_dir)
        head = checkpoint.read_header(path, key="auto-resume") if path is not None else None
    except checkpoint.CheckpointError:
        return None  # the job says so itself when it loads it
    if head is None:
        return None
    try:
        want = checkpoint.model_shape(effective_model(OmegaConf.to_object(cfg.model), OmegaConf.to_object(
            cfg.intervention)))
    except Exception:  # a config validation refuses on its own terms
        return None
    got = head.get("model_shape") or {}
    diff = [f"{k}: checkpoint {got.get(k)} vs this run {v}" for k, v in want.items() if got.get(k) != v]
    step = int(head.get("step") or 0)
    why = (f"it holds a checkpoint of another model shape ({'; '.join(diff)})" if diff else
           f"it holds a checkpoint at step {step}, past this run's train.max_steps={cfg.train.max_steps}"
           if step > int(cfg.train.max_steps) else None)
    if why is None:
        return None
    return (f"the job folder {job_dir} belongs to another run: {why} ({path}); nothing was written there: give this "
            f"run its own folder (drop hydra.run.dir, or another one)")


def _typed_run_dir() -> bool:
    """Whether the user gave hydra.run.dir (then auto-resume already looks in the folder they meant)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        return any(o.lstrip("+").startswith("hydra.run.dir=") for o in HydraConfig.get().overrides.hydra)
    except ValueError:
        return True  # not under Hydra: the caller chose the folder


def unfinished_twins(job_dir: Path, overrides: List[str]) -> List[Path]:
    """Sibling job folders of a fresh single run (results/runs/<time>/) started with the same overrides, whose job
    died on this machine without a result but left a checkpoint: what "the same command again" would have resumed
    had it been given that folder (hydra.run.dir). Newest first."""
    import os
    if (Path(job_dir) / "checkpoints").is_dir() or not Path(job_dir).parent.is_dir():
        return []
    out = []
    for start in Path(job_dir).parent.glob(f"*/{START_FILE}"):
        d = start.parent
        info = read_job_start(d) or {}
        if d == Path(job_dir) or (d / RESULT_FILE).exists() or info.get("overrides") != list(overrides):
            continue
        if info.get("host") != _host() or (alive_here(info) and info["pid"] != os.getpid()):
            continue  # another machine's, or still running
        if (d / "checkpoints" / "last.pt").is_file() or checkpoint.step_files(d / "checkpoints"):
            out.append(d)
    return sorted(out, key=lambda d: d.stat().st_mtime, reverse=True)


def _steps_logged(info) -> int:
    """Steps of a dead job: those its MLflow run holds (0 when unknown)."""
    try:
        hist = retry(make_client(info["tracking_uri"]).get_metric_history, info["mlflow_run_id"], "train/loss")
        return max((int(m.step) + 1 for m in hist), default=0)
    except Exception:
        return 0


def _host() -> str:
    import socket
    return socket.gethostname()


def exit_status(result: Dict[str, Any], multirun: bool) -> int:
    """run.py's exit status: 1 for a failed single run (a multirun records failures per job and exits 0)."""
    return 1 if (not multirun and result.get("observed") == "failed") else 0


def sweep_status(results: List[Dict[str, Any]]) -> int:
    """run.py's exit status after a multirun: 1 when every job it ran failed (nothing to report but errors), else 0
    (some failures among results are recorded per job). Jobs run elsewhere (submitit) are not counted here."""
    return 1 if len(results) > 1 and all(r.get("observed") == "failed" for r in results) else 0


def run_job(cfg: DictConfig, job_dir: Optional[Path] = None, overrides: Optional[List[str]] = None) -> Dict[str, Any]:
    """One job, everything it prints also in <job dir>/run.log (job_log.tee; DDP: rank 0's)."""
    job_dir = Path(job_dir) if job_dir is not None else _hydra_context()[0]
    if detect_env()["rank"] != 0:  # the ranks of one DDP job share its folder: rank 0 holds the lock and the log
        return _run_job(cfg, job_dir, overrides)
    try:
        lock = folder_lock.acquire(job_dir)
    except folder_lock.FolderBusy as e:  # another live job owns the folder: write nothing there
        print(f"[job] refused: {e}")
        return record.RunRecord(intervention=str(cfg.intervention.get("name")), error=str(e)).to_dict()
    except OSError:  # an unwritable folder: the job says so itself when it writes there
        lock = None
    try:
        try:
            log = job_log.tee(job_dir)
            log.__enter__()
        except OSError as e:
            print(f"[job] no {job_dir / job_log.LOG_FILE}: {e}")
            return _run_job(cfg, job_dir, overrides)
        try:
            return _run_job(cfg, job_dir, overrides)
        finally:
            log.__exit__(None, None, None)
    finally:
        if lock is not None:
            folder_lock.release(lock)


def _run_job(cfg: DictConfig, job_dir: Path, overrides: Optional[List[str]] = None) -> Dict[str, Any]:
    hydra_dir, hydra_overrides, multirun = _hydra_context()
    overrides = list(overrides) if overrides is not None else hydra_overrides
    name = "+".join(selected_interventions(overrides)) or str(cfg.intervention.name)
    result: Dict[str, Any] = record.RunRecord(intervention=name, overrides=overrides,
                                              expected=cfg.intervention.get("expect"),
                                              job_dir=str(job_dir)).to_dict()
    job = None
    foreign = _foreign_folder(cfg, job_dir) or _other_run_folder(cfg, job_dir)
    if foreign:  # write nothing into another run's folder (its result.json, job.json, MLflow run stay as they are)
        print(f"[job] {name} refused: {foreign}")
        result["error"] = foreign
        return result
    if not multirun and not _typed_run_dir():
        twins = unfinished_twins(job_dir, overrides)
        if twins:  # a new timestamped folder: auto-resume looks only in its own; say where the killed one is
            print(f"[job] {len(twins)} unfinished run(s) of this same command died with a checkpoint, newest "
                  f"{twins[0]}: to continue it instead, stop this one and run the command again with "
                  f"hydra.run.dir={twins[0]} (this run starts afresh in {job_dir})", flush=True)
    try:
        import os
        write_job_start(job_dir, intervention=name, overrides=overrides, expected=result["expected"],
                        pid=os.getpid(), host=_host(), started=__import__("time").time())
        obj, attention = validate_config(cfg, overrides)
        check_capture_dir(obj.monitor.capture, job_dir)  # other entry points than run.py (isolate, fork, tests)
        obj.intervention.name = name
        job = Job(obj, attention, job_dir, overrides)
        result = job.result
        job.run()
    except Exception as e:
        if job is not None:
            result = job.result
        result["observed"] = "failed"
        result["error"] = result.get("error") or f"{type(e).__name__}: {e}"
        if isinstance(e, WriteError):  # the plain sentence says it all
            result["error"] = str(e)
        try:
            (job_dir / ERROR_FILE).parent.mkdir(parents=True, exist_ok=True)
            (job_dir / ERROR_FILE).write_text(traceback.format_exc())
            where = f" (traceback in {job_dir / ERROR_FILE})"
            job_log.log_only(traceback.format_exc())
        except OSError:
            where = ""
        print(f"[job] {name} failed: {result['error']}{where}")
    except BaseException as e:  # preempted (requeue) or interrupted: the requeued job rewrites result.json
        result = job.result if job is not None else result
        result["error"] = result.get("error") or (f"interrupted ({type(e).__name__}); a requeued job resumes from "
                                                  f"its last checkpoint")
        raise
    finally:
        if job is None or job.is_main:
            try:
                write_result(job_dir, result)
            except OSError as e:  # a read-only / full folder: the one sentence, not a traceback
                print(f"[job] {e}")
                result["observed"], result["error"] = "failed", result.get("error") or str(e)
            _record_run(cfg, result, job_dir)
    if not multirun and (job is None or job.is_main):
        _single_run_report(cfg, result, job_dir)
    return result


def _record_run(cfg, result, job_dir: Path) -> None:
    """The run's MLflow record once the job is over: description with the verdict, divergence marker, and the job
    folder (log, result.json, .hydra/, traceback) as artifacts. A failure here is said, and the run stays recorded."""
    if not result.get("mlflow_run_id"):
        return
    try:
        uri = resolve_uri(cfg.tracking.uri)
        record_outcome(uri, result["mlflow_run_id"], result, paper=cfg.intervention.get("paper"))
        log_job_artifacts(uri, result["mlflow_run_id"], job_dir)
    except Exception as e:
        print(f"[job] MLflow record of run {result['mlflow_run_id']} incomplete: {type(e).__name__}: {e}")


def _single_run_report(cfg, result, job_dir: Path) -> None:
    """A single (non-multirun) run still gets a report: <job dir>/report/verdicts.{md,json}."""
    try:
        write_run_report(result, str(cfg.sweep_name), resolve_uri(cfg.tracking.uri), job_dir=job_dir,
                         out_dir=Path(job_dir) / record.REPORT_DIR)  # its own folder: never a sweep's report
    except Exception as e:  # the run itself is recorded; a report failure must not hide that
        print(f"[job] report not written: {type(e).__name__}: {e}")


def is_multirun() -> bool:
    return _hydra_context()[2]


__all__ = ["run_job", "write_result", "RESULT_FILE", "START_FILE", "write_job_start", "read_job_start",
           "close_dead_jobs", "exit_status", "is_multirun", "sweep_status"]
