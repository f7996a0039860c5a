"""The end of a job's run: the verdict into the result, MLflow tags and artifacts, and the crash path (record what
is known, a crash checkpoint when the weights are sane, the MLflow run closed as FAILED)."""
from __future__ import annotations

import math
import time

import torch

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.job import checkpoint_policy as snapshot


def new_result(iv, overrides, job_dir=None, verdict=None) -> dict:
    """The result dict (the run record's fields, orchestrator/record.py; folder.write_result types it) before anything
    ran: observed 'failed' until the run says otherwise; the detector's inputs recorded with it."""
    return record.RunRecord(
        intervention=iv.name, overrides=list(overrides), expected=iv.expect,
        job_dir=str(job_dir) if job_dir is not None else None,
        verdict_margin=verdict.margin if verdict is not None else None,
        verdict_window=verdict.window if verdict is not None else None,
        fork_baseline=verdict.fork_baseline if verdict is not None else None).to_dict()


def fill_verdict(job, done: int) -> None:
    d, m = job.detector, job.monitors
    job.result.update(observed=d.observed, divergence_step=d.divergence_step, final_loss=d.final_loss,
                      divergence_reason=d.reason, min_loss=d.min_loss if math.isfinite(d.min_loss) else None,
                      min_loss_step=d.min_loss_step, steps_done=done,
                      peak_wq_norm=m.peak_wq if math.isfinite(m.peak_wq) else None,
                      peak_wq_where=m.peak_wq_where)


def finish(job, stream, done: int, status: str = "FINISHED") -> None:
    job.sync_monitors()
    fill_verdict(job, done)
    stream.close()
    if job.is_main:
        r = job.result
        warning = job.monitors.numerics_warning()
        # the failure counters' run totals, zeros too: their metrics are logged only from a first non-zero count
        job.tracker.set_tags({f"numerics.{k}": v for k, v in job.monitors.numerics.items()})
        if warning:  # counted numerical failures: a tag on the run and a line in result.json, never silent
            r["warnings"] = [*r.get("warnings", []), warning]
            job.tracker.set_tags({"warning": warning})
            print(f"[job] warning: {warning}")
        ops = getattr(job, "nondeterministic_ops", None)
        if ops:  # train.deterministic could not hold everywhere: said, as the numerics are
            said = (f"train.deterministic: {len(ops)} op(s) ran without a deterministic implementation, so this "
                    f"run may not reproduce its bits: {', '.join(ops)}")
            r["warnings"] = [*r.get("warnings", []), said]
            job.tracker.set_tags({"nondeterministic_ops": ", ".join(ops)[:500]})
            print(f"[job] warning: {said}")
        log_record(job, done)
        hook_metrics = job.hooks.final_metrics() if getattr(job, "hooks", None) else {}
        if hook_metrics:  # e.g. how often QK-clip fired: counted, never silent
            job.tracker.log_metrics(hook_metrics, step=max(done - 1, 0))
        for p in stream.paths:
            if p.exists():
                job.tracker.log_artifact(p)
    job.tracker.close(status)
    if job.is_main and job.tracker.store_error:  # training went on; the points wait in the spool
        job.result["warnings"] = [*job.result.get("warnings", []), job.tracker.store_error]


def _settle_writer(job) -> None:
    """On a failing path: the background checkpoint write finished first (the checkpoint a rerun resumes from is then
    on disk, or its failure is in the result), before anything else is written."""
    writer = getattr(job, "ckpt_writer", None)
    err = writer.settle() if writer is not None else None
    if err is not None:
        job.result["warnings"] = [*job.result.get("warnings", []),
                                  f"the last periodic checkpoint was not written: {type(err).__name__}: {err}"]


def _settle_quietly(job, done: int) -> None:
    """On a failing path: flush the monitors and fill the verdict as far as they go; the run is marked failed."""
    try:
        job.sync_monitors()
        fill_verdict(job, done)
    except Exception:
        pass
    job.result["observed"] = "failed"


def interrupted(job, stream, done: int, by: str) -> None:
    """Preemption signal (SystemExit after the checkpoint) or ^C (mid-step, no checkpoint of its own): result.json
    counts the steps done and says which checkpoint a rerun resumes from, if any; the verdict tag leaves 'running'."""
    _settle_writer(job)
    _settle_quietly(job, done)
    saved = getattr(job, "saved_step", None)  # the newest checkpoint on disk: saved or resumed by this process
    path = job.result.get("checkpoint") or job.job_dir / snapshot.CKPT_DIR / "last.pt"
    if saved is not None and saved == done:
        then = f"the checkpoint at step {done} is saved ({path}): rerun the same job (auto-resume) or resume={path}"
    elif saved is not None:
        then = (f"the newest checkpoint is step {saved} ({path}): a rerun of the same job resumes there and "
                f"trains the {done - saved} steps after it again")
    else:
        then = (f"no checkpoint was saved (train.ckpt_every={job.cfg.train.ckpt_every}): a rerun starts from step 0")
    job.result["error"] = f"stopped by {by} after {done} steps; {then}"
    if job.tracker is not None and job.is_main:
        try:  # verdict=failed and the error on the run, as on the crash path (not the 'running' set at start)
            log_record(job, done)
        except Exception:
            pass
    close_quietly(job, stream, "KILLED")


def log_record(job, done: int) -> None:
    """The record's typed MLflow fields: verdict tags, sortable run metrics (orchestrator/record.py); wall_s the
    same in MLflow and result.json."""
    t0 = getattr(job, "_t_start", None)
    if t0 is not None:
        job.result["wall_s"] = round(time.perf_counter() - t0, 3)
    r = record.RunRecord.from_dict(job.result)
    tags = {**record.record_tags(r), "early_stopped": str(r.early_stopped).lower()}
    if r.divergence_step is not None:  # absent for a stable run, never the string "None"
        tags["divergence_step"] = r.divergence_step
    job.tracker.set_tags(tags)
    metrics = record.record_metrics(r)
    if "divergence_step" in metrics:  # at the divergence step itself: the marker on the run's charts
        job.tracker.log_metrics({"divergence_step": metrics.pop("divergence_step")}, step=int(r.divergence_step))
    job.tracker.log_metrics(metrics, step=max(done - 1, 0))


def _finite_params(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())  # crash path only: syncing is fine here


def crash(job, model, optimizer, done: int, stream, save: bool = True) -> None:
    """Record what is known: monitors flushed, verdict 'failed', a crash checkpoint when the weights are sane (and
    `save`: not for a run refused for its length, whose weights nobody will resume)."""
    _settle_writer(job)
    if job.monitors is not None:
        _settle_quietly(job, done)
    job.result["observed"] = "failed"
    try:
        if save and job.detector is not None and done > 0 and _finite_params(model):
            snapshot.save(job, model, optimizer, done, "crash.pt")
    except Exception:
        pass
    if job.tracker is not None and job.is_main:
        try:
            log_record(job, done)
        except Exception:
            pass
    close_quietly(job, stream, "FAILED")


def close_quietly(job, stream, status: str) -> None:
    try:
        if stream is not None:
            stream.close()
    except Exception:
        pass
    if job.tracker is not None:
        try:
            job.tracker.close(status)
        except Exception:
            pass


__all__ = ["new_result", "fill_verdict", "finish", "crash", "close_quietly", "interrupted", "log_record"]
