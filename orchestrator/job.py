"""The Hydra task function: validate, train, write result.json - always, also when the job fails.

Every exception is caught and recorded (observed 'failed' + error) so one failing job never takes the sweep down;
SystemExit / KeyboardInterrupt pass through (preemption requeue, ^C).
"""
from __future__ import annotations

import json
import math
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig

RESULT_FILE = "result.json"


def _hydra_context() -> tuple[Path, List[str], bool]:
    """(job output dir, task overrides, multirun?) from HydraConfig; a plain call gets ./results/runs/manual."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        hc = HydraConfig.get()
        return Path(hc.runtime.output_dir), list(hc.overrides.task), hc.mode == RunMode.MULTIRUN
    except ValueError:
        return Path("results/runs/manual"), [], False


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # NaN/Inf are not JSON
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_result(job_dir: Path, result: Dict[str, Any]) -> Path:
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / RESULT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(result), indent=2))
    tmp.replace(path)
    return path


def run_job(cfg: DictConfig, job_dir: Optional[Path] = None, overrides: Optional[List[str]] = None) -> Dict[str, Any]:
    from orchestrator.train import Job
    from orchestrator.validate import selected_interventions, validate_config

    hydra_dir, hydra_overrides, multirun = _hydra_context()
    job_dir = Path(job_dir) if job_dir is not None else hydra_dir
    overrides = list(overrides) if overrides is not None else hydra_overrides
    name = "+".join(selected_interventions(overrides)) or str(cfg.intervention.name)
    result: Dict[str, Any] = {"intervention": name, "overrides": overrides,
                              "expected": cfg.intervention.get("expect"), "observed": "failed",
                              "divergence_step": None, "final_loss": None, "min_loss": None, "peak_wq_norm": None,
                              "peak_wq_where": None, "mlflow_run_id": None, "steps_done": 0, "error": None,
                              "wall_s": None, "attention_routes": None}
    job = None
    try:
        obj, attention = validate_config(cfg, overrides)
        obj.intervention.name = name
        job = Job(obj, attention, job_dir, overrides)
        result = job.result
        job.run()
    except Exception as e:
        if job is not None:
            result = job.result
        result["observed"] = "failed"
        result["error"] = result.get("error") or f"{type(e).__name__}: {e}"
        (job_dir / "error.txt").parent.mkdir(parents=True, exist_ok=True)
        (job_dir / "error.txt").write_text(traceback.format_exc())
        print(f"[job] {name} failed: {result['error']} (traceback in {job_dir / 'error.txt'})")
    except BaseException as e:  # preempted (requeue) or interrupted: the requeued job rewrites result.json
        result = job.result if job is not None else result
        result["error"] = f"interrupted ({type(e).__name__}); a requeued job resumes from its last checkpoint"
        raise
    finally:
        if job is None or job.is_main:
            write_result(job_dir, result)
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
        from orchestrator.tracking import log_job_artifacts, record_outcome, resolve_uri
        uri = resolve_uri(cfg.tracking.uri)
        record_outcome(uri, result["mlflow_run_id"], result, paper=cfg.intervention.get("paper"))
        log_job_artifacts(uri, result["mlflow_run_id"], job_dir)
    except Exception as e:
        print(f"[job] MLflow record of run {result['mlflow_run_id']} incomplete: {type(e).__name__}: {e}")


def _single_run_report(cfg, result, job_dir: Path) -> None:
    """A single (non-multirun) run still gets results/<sweep>/verdicts.{md,json}."""
    try:
        from orchestrator.report import write_run_report
        from orchestrator.tracking import resolve_uri
        write_run_report(result, str(cfg.sweep_name), resolve_uri(cfg.tracking.uri), job_dir=job_dir,
                         out_dir=Path(str(cfg.results_dir)) / str(cfg.sweep_name))
    except Exception as e:  # the run itself is recorded; a report failure must not hide that
        print(f"[job] report not written: {type(e).__name__}: {e}")


__all__ = ["run_job", "write_result", "RESULT_FILE"]
