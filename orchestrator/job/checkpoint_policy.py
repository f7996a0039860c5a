"""The job's checkpointing: which state a job starts from (resume, requeue, fork), what it writes into a checkpoint
and how it puts that state back.
The file format (atomic writes, step_<k>.pt, last.pt) is orchestrator/job/checkpoint.py.

A checkpoint holds `step` = steps done, i.e. the step a resumed run starts with.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.job.fork import fork_info, resolve_order, source_decay
from flash_forensics.orchestrator.job.preemption import sigint_deferred
from flash_forensics.orchestrator.record import CKPT_DIR  # one definition: the run record's file names


def start_state(job) -> Optional[Dict[str, Any]]:
    """The checkpoint state `job` starts from, or None for a fresh run. A requeued job continues from its own
    last.pt (even after resume=); a fork loads from_checkpoint and records where it came from (job.fork)."""
    cfg = job.cfg
    path = cfg.resume
    found = checkpoint.latest(job.job_dir) if cfg.train.auto_resume else None  # the newest intact one, said so
    if found is not None:
        path = found
    if path is None and cfg.from_checkpoint is not None:
        state = checkpoint.check_compatible(cfg.from_checkpoint, cfg.model, key="from_checkpoint")
        job.forking = True
        info = fork_info(cfg.from_checkpoint, state, cfg.optimizer.decay_steps or source_decay(state))
        info["batch_order"] = str(resolve_order(cfg.from_checkpoint, state, cfg.data.replay))
        set_fork(job, info)
        return state
    if path is None:
        return None
    state = checkpoint.check_compatible(path, cfg.model)
    if cfg.from_checkpoint is not None and found is not None and not state.get("fork"):
        # this folder holds the checkpoints of a run that is not a fork (e.g. the source's own folder): resuming them
        # would reopen that run in MLflow and rewrite its verdict
        raise checkpoint.CheckpointError(
            f"from_checkpoint={str(cfg.from_checkpoint)!r}: the job folder {job.job_dir} already holds the checkpoints "
            f"of another run ({path}, MLflow run {state.get('mlflow_run_id')}); a fork never writes to another run: "
            f"give the fork its own folder (hydra.run.dir=...)")
    fork = state.get("fork") or {}
    if fork.get("source_run_id") and fork.get("source_run_id") == state.get("mlflow_run_id"):
        raise checkpoint.CheckpointError(f"resume={str(path)!r}: this fork checkpoint names its source's MLflow run "
                                         f"{state['mlflow_run_id']}; a fork never writes to its source's run")
    job.result["resumed_from"] = str(path)
    if job.is_main:  # one line: a silent resume looks like a fresh run that started late
        how = "auto-resume: the newest intact checkpoint of this job folder" if found is not None else "resume="
        print(f"[job] resuming from {path} at step {state.get('step')} ({how}; MLflow run "
              f"{state.get('mlflow_run_id')})", flush=True)
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
        job.probes.load_state_dict(state.get("probes"))
        if getattr(job, "alarm", None) is not None:  # fired before the checkpoint: said once, not again later
            job.alarm.load_state_dict(state.get("alarm"))
            if job.alarm.fired is not None:
                job.result["alarm"] = job.alarm.fired
                if job.capture is not None and not job.alarm.pending:  # its at_alarm capture was taken then
                    job.capture._alarm_done = True
    if resuming or (job.forking and job.cfg.verdict.fork_baseline == "source"):
        job.detector.load_state_dict(state["detector"])
        mon = state.get("monitor", {})
        if mon.get("peak_wq") is not None:
            job.monitors.peak_wq, job.monitors.peak_wq_where = mon["peak_wq"], mon["peak_wq_where"]
        job.monitors.numerics.update(mon.get("numerics") or {})


def job_state(job, model, optimizer, done: int) -> Dict[str, Any]:
    """Everything a job needs to continue bit-for-bit (CPU) from step `done`."""
    mon = job.monitors
    return {
        "step": done, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "rng": checkpoint.rng_state(), "detector": job.detector.state_dict(),
        "monitor": {"peak_wq": mon.peak_wq if math.isfinite(mon.peak_wq) else None,
                    "peak_wq_where": mon.peak_wq_where, "numerics": dict(mon.numerics)},
        "mlflow_run_id": job.tracker.run_id if job.tracker else None,
        "model_shape": checkpoint.model_shape(job.cfg.model),
        "config": OmegaConf.to_container(OmegaConf.structured(job.cfg)),
        "batch_order": str(job.order_path) if job.order_path else None, "job_dir": str(job.job_dir),
        "fork": job.fork, "hooks": job.hooks.state_dict(),
        "probes": job.probes.state_dict() if job.probes is not None else None,
        "alarm": job.alarm.state_dict() if getattr(job, "alarm", None) is not None else None}


def save(job, model, optimizer, done: int, name: str, keep_step: bool = False,
         kill_mid_write: bool = False, background: bool = False) -> Optional[Path]:
    """Flush the monitors and the tracker first: a checkpoint is committed only once every metric point of the
    steps it covers is in the store or the spool (a kill -9 right after it loses none), and its detector state and
    MLflow agree on the last step. keep_step: also keep it as step_<done>.pt (periodic and final checkpoints: what a
    fork starts from). background: the state is copied to host memory and written by job.ckpt_writer's thread
    (orchestrator/job/ckpt_writer.py) while training goes on; every save first waits for the write before it.
    kill_mid_write: debug (fault tests), SIGKILL once 1 MiB of the file is written."""
    job.sync_monitors()
    if not job.is_main:
        return None
    job.tracker.flush()
    writer = getattr(job, "ckpt_writer", None)
    if writer is not None:
        writer.wait()  # one write at a time, in order; a background write that failed raises here
    path = job.job_dir / CKPT_DIR / name
    state = job_state(job, model, optimizer, done)
    protect = job.detector.divergence_step  # as of this step: the detector moves on while a thread writes

    def write(s: Dict[str, Any]) -> None:
        if keep_step:
            checkpoint.save_step(path.parent, done, s, keep=job.cfg.train.keep_checkpoints, protect_before=protect,
                                 last=name)
        else:
            checkpoint.save(path, s)
        job.result["checkpoint"] = str(path)
        job.saved_step = done  # what an interrupted run says a rerun resumes from (run_end.interrupted)

    if kill_mid_write:
        checkpoint.KILL_AFTER_BYTES = 1 << 20
    if background and writer is not None:
        writer.submit(write, state)
        return path
    with sigint_deferred():  # a ^C inside torch.save's zip writer left a RuntimeError, not the interrupt
        write(state)
    return path


__all__ = ["CKPT_DIR", "start_state", "set_fork", "restore_run_state", "job_state", "save"]
