"""The job's checkpointing: which state a job starts from (resume, requeue, fork), what it writes into a checkpoint
and how it puts that state back. The file format (atomic writes, step_<k>.pt, last.pt) is orchestrator/checkpoint.py.

A checkpoint holds `step` = steps done, i.e. the step a resumed run starts with.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from orchestrator import checkpoint
from orchestrator.record import CKPT_DIR  # one definition: the run record's file names


def start_state(job) -> Optional[Dict[str, Any]]:
    """The checkpoint state `job` starts from, or None for a fresh run. A requeued job continues from its own
    last.pt (even after resume=); a fork loads from_checkpoint and records where it came from (job.fork)."""
    cfg = job.cfg
    path = cfg.resume
    if cfg.train.auto_resume and checkpoint.latest(job.job_dir) is not None:
        path = checkpoint.latest(job.job_dir)
    if path is None and cfg.from_checkpoint is not None:
        from orchestrator.fork import fork_info, resolve_order, source_decay
        state = checkpoint.check_compatible(cfg.from_checkpoint, cfg.model, key="from_checkpoint")
        job.forking = True
        info = fork_info(cfg.from_checkpoint, state, cfg.optimizer.decay_steps or source_decay(state))
        info["batch_order"] = str(resolve_order(cfg.from_checkpoint, state, cfg.data.replay))
        set_fork(job, info)
        return state
    if path is None:
        return None
    state = checkpoint.check_compatible(path, cfg.model)
    job.result["resumed_from"] = str(path)
    if state.get("fork"):  # a requeued fork resumes its own run and still knows where it came from
        set_fork(job, state["fork"])
    return state


def set_fork(job, info: Dict[str, Any]) -> None:
    job.fork = dict(info)
    job.result.update({k: info.get(k) for k in ("forked_from", "fork_step", "source_run_id")})
    if job.cfg.optimizer.decay_steps is None and info.get("decay_steps"):
        job.cfg.optimizer.decay_steps = int(info["decay_steps"])  # the source's lr schedule


def restore_run_state(job, state: Dict[str, Any], resuming: bool) -> None:
    """Detector and monitor peaks of the same run (a resume), or of the source when a fork continues its detector
    (verdict.fork_baseline=source, checked by fork.check_fork); the train hooks' state on a resume (a fork starts
    its own hooks fresh). Weights and optimizer are loaded by the job."""
    if resuming:
        job.hooks.load_state_dict(state.get("hooks") or [])
    if resuming or (job.forking and job.cfg.verdict.fork_baseline == "source"):
        job.detector.load_state_dict(state["detector"])
        mon = state.get("monitor", {})
        if mon.get("peak_wq") is not None:
            job.monitors.peak_wq, job.monitors.peak_wq_where = mon["peak_wq"], mon["peak_wq_where"]


def job_state(job, model, optimizer, done: int) -> Dict[str, Any]:
    """Everything a job needs to continue bit-for-bit (CPU) from step `done`."""
    mon = job.monitors
    return {
        "step": done, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "rng": checkpoint.rng_state(), "detector": job.detector.state_dict(),
        "monitor": {"peak_wq": mon.peak_wq if math.isfinite(mon.peak_wq) else None,
                    "peak_wq_where": mon.peak_wq_where},
        "mlflow_run_id": job.tracker.run_id if job.tracker else None,
        "model_shape": checkpoint.model_shape(job.cfg.model),
        "config": OmegaConf.to_container(OmegaConf.structured(job.cfg)),
        "batch_order": str(job.order_path) if job.order_path else None, "job_dir": str(job.job_dir),
        "fork": job.fork, "hooks": job.hooks.state_dict()}


def save(job, model, optimizer, done: int, name: str, keep_step: bool = False) -> Optional[Path]:
    """Flush the monitors first so the checkpoint's detector state and MLflow agree on the last step.
    keep_step: also keep it as step_<done>.pt (periodic and final checkpoints: what a fork starts from)."""
    job.sync_monitors()
    if not job.is_main:
        return None
    path = job.job_dir / CKPT_DIR / name
    state = job_state(job, model, optimizer, done)
    if keep_step:
        checkpoint.save_step(path.parent, done, state, keep=job.cfg.train.keep_checkpoints,
                             protect_before=job.detector.divergence_step, last=name)
    else:
        checkpoint.save(path, state)
    job.result["checkpoint"] = str(path)
    return path


__all__ = ["CKPT_DIR", "start_state", "set_fork", "restore_run_state", "job_state", "save"]
