"""monitor.capture inside a training job: at the chosen steps, a Recorder observes our GPT's attention calls for one
optimizer step (the first micro-batch of each chosen layer), keeps each layer's input x and W_Q (forward pre-hooks
on the attention modules) and writes one snapshot per layer after the step; the paths go to result.json
(`captures`) and to the MLflow run as artifacts (captures/).

A capture step runs the eager model (a compiled one is swapped out for that step: hooks and tensor hooks on O are
eager-mode things; inductor may round element-wise chains differently, so that step's numerics are eager's). Only
the main rank captures. Other steps cost one set lookup.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

from flash_forensics.capture.recorder import Recorder
from flash_forensics.capture.snapshot import MiB, SnapshotError
from flash_forensics.hooks import observing
from flash_forensics.orchestrator.job import fork
from flash_forensics.orchestrator.monitor.capture_config import CaptureConfig


class JobCapture:
    def __init__(self, cfg: CaptureConfig, model, job_dir: Path, n_layer: int, steps: List[int], alarm=None,
                 tracker=None, enabled: bool = True, result: Optional[dict] = None):
        self.cfg, self.model, self.alarm, self.tracker = cfg, model, alarm, tracker
        self.enabled = enabled and cfg.enabled
        self.steps = set(steps)
        self.layers = cfg.layer_list(n_layer)
        self.dir = Path(cfg.dir) if Path(cfg.dir).is_absolute() else Path(job_dir) / cfg.dir
        self.result = result if result is not None else {}
        self._alarm_done = False
        self.paths: List[Path] = []

    def due(self, step: int) -> bool:
        if not self.enabled:
            return False
        if step in self.steps:
            return True
        return bool(self.cfg.at_alarm and not self._alarm_done and self.alarm is not None
                    and self.alarm.fired is not None)

    @contextmanager
    def during(self, step: int, step_fn=None):
        """Around one optimizer step: capture when due, else nothing."""
        if not self.due(step):
            yield
            return
        at_alarm = step not in self.steps
        self._alarm_done = self._alarm_done or at_alarm
        rec = Recorder(self.dir, layers=self.layers, heads=self.cfg.head_list(), worst=self.cfg.worst, step=step,
                       max_bytes=int(self.cfg.max_mib * MiB), tag="alarm" if at_alarm else "",
                       extra_meta={"at_alarm": at_alarm}, batch=self.cfg.batch)
        blocks = self.model.transformer.h
        C, H = self.model.config.n_embd, self.model.config.n_head
        handles = []
        for i in self.layers:
            attn = blocks[i].attn

            def pre(mod, args, i=i):
                if i not in rec.inputs:
                    rec.inputs[i] = (args[0].detach(), mod.c_attn.weight[:C].detach().view(H, C // H, C))
            handles.append(attn.register_forward_pre_hook(pre))
        swapped = step_fn is not None and getattr(step_fn, "train_model", None) is not None and \
            step_fn.train_model is not self.model and not hasattr(step_fn.train_model, "no_sync")
        eager = step_fn.train_model if swapped else None
        if swapped:
            step_fn.train_model = self.model
        try:
            with observing(rec):
                yield
        finally:
            for h in handles:
                h.remove()
            if swapped:
                step_fn.train_model = eager
        try:
            paths = rec.flush()
        except SnapshotError as e:  # a capture that cannot be written never stops training
            print(f"[capture] step {step}: not written: {e}", file=sys.stderr, flush=True)
            self.result.setdefault("capture_errors", []).append(str(e))
            return
        self.paths += paths
        self.result.setdefault("captures", []).extend(str(p) for p in paths)
        if self.tracker is not None:
            for p in paths:
                self.tracker.log_artifact(p, "captures")


def build(job, model) -> JobCapture:
    """The job's capture (disabled when monitor.capture asks nothing or on a DDP rank other than 0)."""
    cfg = job.cfg.monitor.capture
    steps = list(cfg.steps)
    if cfg.before_divergence and job.fork:
        src = Path(job.fork["forked_from"]).resolve().parent.parent
        d = fork.divergence_step(src)
        if d is None:
            print(f"[capture] monitor.capture.before_divergence: {src} has no divergence step in its result.json; "
                  "nothing captured for it", file=sys.stderr, flush=True)
        elif d - 1 < int(job.fork["fork_step"]):
            print(f"[capture] monitor.capture.before_divergence: the source diverged at step {d}, before this "
                  f"fork's first step {job.fork['fork_step']}; nothing captured for it", file=sys.stderr, flush=True)
        else:
            steps.append(d - 1)
            job.result["capture_before_divergence"] = {"source": str(src), "divergence_step": d, "step": d - 1}
    return JobCapture(cfg, model, job.job_dir, job.cfg.model.n_layer, steps, alarm=job.alarm, tracker=job.tracker,
                      enabled=job.is_main, result=job.result)


__all__ = ["JobCapture", "build"]
