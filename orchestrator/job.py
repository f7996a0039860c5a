"""The Hydra task function: validate, train, write result.json - always, also when the job fails.

Every exception is caught and recorded (observed 'failed' + error) so one failing job never takes the sweep down;
SystemExit / KeyboardInterrupt pass through (preemption requeue, ^C).
"""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig

from orchestrator import record
from orchestrator.record import ERROR_FILE, RESULT_FILE


def _hydra_context() -> tuple[Path, List[str], bool]:
    """(job output dir, task overrides, multirun?) from HydraConfig; a plain call gets ./results/runs/manual."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        hc = HydraConfig.get()
        return Path(hc.runtime.output_dir), list(hc.overrides.task), hc.mode == RunMode.MULTIRUN
    except ValueError:
        return Path("results/runs/manual"), [], False


def write_result(job_dir: Path, result: Dict[str, Any]) -> Path:
    """<job dir>/result.json as the typed run record (orchestrator/record.py): one encoding, atomic."""
    return record.write(Path(job_dir), record.RunRecord.from_dict(result))


def run_job(cfg: DictConfig, job_dir: Optional[Path] = None, overrides: Optional[List[str]] = None) -> Dict[str, Any]:
    from orchestrator.train import Job
    from orchestrator.validate import selected_interventions, validate_config

    hydra_dir, hydra_overrides, multirun = _hydra_context()
    job_dir = Path(job_dir) if job_dir is not None else hydra_dir
    overrides = list(overrides) if overrides is not None else hydra_overrides
    name = "+".join(selected_interventions(overrides)) or str(cfg.intervention.name)
    result: Dict[str, Any] = record.RunRecord(intervention=name, overrides=overrides,
                                              expected=cfg.intervention.get("expect"),
                                              job_dir=str(job_dir)).to_dict()
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
        (job_dir / ERROR_FILE).parent.mkdir(parents=True, exist_ok=True)
        (job_dir / ERROR_FILE).write_text(traceback.format_exc())
        print(f"[job] {name} failed: {result['error']} (traceback in {job_dir / ERROR_FILE})")
    except BaseException as e:  # preempted (requeue) or interrupted: the requeued job rewrites result.json
        result = job.result if job is not None else result
        result["error"] = f"interrupted ({type(e).__name__}); a requeued job resumes from its last checkpoint"
        raise
    finally:
        if job is None or job.is_main:
            write_result(job_dir, result)
    if not multirun and (job is None or job.is_main):
        _single_run_report(cfg, result, job_dir)
    return result


def _single_run_report(cfg, result, job_dir: Path) -> None:
    """A single (non-multirun) run still gets a report: <job dir>/report/verdicts.{md,json}."""
    try:
        from orchestrator.report import write_run_report
        from orchestrator.tracking import resolve_uri
        write_run_report(result, str(cfg.sweep_name), resolve_uri(cfg.tracking.uri), job_dir=job_dir,
                         out_dir=Path(job_dir) / record.REPORT_DIR)  # its own folder: never a sweep's report
    except Exception as e:  # the run itself is recorded; a report failure must not hide that
        print(f"[job] report not written: {type(e).__name__}: {e}")


__all__ = ["run_job", "write_result", "RESULT_FILE"]
