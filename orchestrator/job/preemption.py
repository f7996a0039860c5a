"""Preemption and timeouts: stop at a step boundary with a checkpoint, then let SLURM requeue the job.

How the guard and submitit cooperate. submitit installs its handler for the preemption signal (USR2, sent by SLURM
`--signal=USR2@signal_delay_s` before a timeout, or by `scancel --signal=USR2`) before the task starts; that
handler pickles the task again (hydra-submitit-launcher's `checkpoint()` resubmits the same job), runs
`scontrol requeue` and exits - wherever the train loop happens to be. The guard takes the signal over, chaining to
submitit's handler instead of replacing it:

    signal arrives  -> guard handler: `requested = True` (a Python bool: the loop reads it without a device sync)
    step boundary   -> train loop: `if guard.should_stop(step)`: save checkpoint (model, optimizer, RNG, data
                       position, detector, MLflow run id) -> `guard.exit_for_requeue()`
    exit_for_requeue-> submitit's own handler, called synchronously: requeue + SystemExit
    requeued job    -> same job dir (same hydra sweep dir and job number) -> auto-resume from
                       <job dir>/checkpoints/last.pt, same MLflow run id, same batch order

Without submitit (plain sbatch, torchrun, the basic launcher) the guard requeues through `scontrol requeue` when
SLURM_JOB_ID is set, else it just exits with the checkpoint saved (resume it with `resume=` or rerun the job).
In DDP every rank gets the signal, but not necessarily at the same step: `should_stop` all-reduces the flag over
a gloo group every `check_every` steps so all ranks stop at the same step boundary.

The job wrapper must let SystemExit through (it is how submitit leaves without writing a result pickle).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterable, Optional

from flash_forensics.orchestrator.job.distributed import any_rank, barrier

log = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 3  # exit status when no scheduler can requeue us (checkpoint saved, job not finished)


def preempt_signal() -> signal.Signals:
    """The signal submitit treats as 'checkpoint and requeue' (SUBMITIT_PREEMPT_SIGNAL, default USR2)."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return getattr(signal, name if name.startswith("SIG") else "SIG" + name)


def under_submitit() -> bool:
    return bool(os.environ.get("SUBMITIT_FOLDER"))


@contextlib.contextmanager
def sigint_deferred():
    """Hold a ^C (SIGINT) until the block (a checkpoint write and its bookkeeping) is complete, then deliver it
    through the handler that was there (KeyboardInterrupt by default): the run stops with that checkpoint saved."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    previous = previous if previous is not None else signal.SIG_DFL  # None: installed outside Python
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, caught[0])
    elif caught and previous == signal.SIG_DFL:
        raise KeyboardInterrupt


class PreemptionGuard:
    """Turns the preemption signal into a flag the train loop polls once per step.

    Use as a context manager (or call install()/uninstall()); handlers are restored on exit.
    """

    def __init__(self, signals: Optional[Iterable[int]] = None, dist_info=None, check_every: int = 1) -> None:
        if signals is None:
            signals = [preempt_signal()]
            if not under_submitit():  # submitit deliberately ignores SIGTERM (SLURM sends it before the kill)
                signals.append(signal.SIGTERM)
        self.signals = list(signals)
        self.dist_info = dist_info
        self.check_every = max(1, int(check_every))
        self.requested = False  # set by the handler; a plain bool so polling it costs nothing
        self.signum: Optional[int] = None
        self._previous: dict = {}
        self._installed = False

    # -- installation -------------------------------------------------------------------------------------------
    def install(self) -> "PreemptionGuard":
        if self._installed:
            return self
        if threading.current_thread() is not threading.main_thread():
            log.warning("PreemptionGuard: not on the main thread, signals cannot be caught; preemption loses "
                        "the work since the last periodic checkpoint")
            return self
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        self._installed = True
        return self

    def uninstall(self) -> None:
        if not self._installed:
            return
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        self._installed = False

    def __enter__(self) -> "PreemptionGuard":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum, frame) -> None:
        # only set flags here: the train loop reaches a step boundary soon and does the real work
        if not self.requested:
            self.requested, self.signum = True, signum
            try:
                sys.stderr.write(f"[preemption] caught {signal.Signals(signum).name}: checkpoint at the next step "
                                 f"boundary, then requeue\n")
            except Exception:
                pass

    # -- polling ------------------------------------------------------------------------------------------------
    def should_stop(self, step: int) -> bool:
        """Called once per step by the train loop. Single process: the flag. DDP: the ranks agree (gloo
        all-reduce every check_every steps) so they all checkpoint at the same step."""
        info = self.dist_info
        if info is None or not getattr(info, "distributed", False):
            return self.requested
        if step % self.check_every:
            return False

        agreed = any_rank(self.requested, info)
        if agreed and not self.requested:
            self.requested, self.signum = True, int(self.signals[0])
        return agreed

    # -- leaving ------------------------------------------------------------------------------------------------
    def exit_for_requeue(self, reason: str = "") -> None:
        """After the checkpoint is on disk: requeue the job and leave (raises SystemExit; never returns)."""
        info = self.dist_info
        if info is not None and getattr(info, "distributed", False):

            barrier(info)  # rank 0's checkpoint is written before anyone leaves
            if not info.is_main:
                # rank 0 requeues the whole job, which kills us; do not exit first (srun would fail the step)
                self.uninstall()
                time.sleep(120)
                raise SystemExit(REQUEUE_EXIT_CODE)
        signum = self.signum if self.signum is not None else int(preempt_signal())
        prev = self._previous.get(signum)
        if prev is None:
            prev = self._previous.get(preempt_signal())
        self.uninstall()
        log.warning("preemption: checkpoint saved%s; requeueing", f" ({reason})" if reason else "")
        if callable(prev) and under_submitit():
            # submitit's SignalHandler.checkpoint_and_try_requeue: resubmits the task pickle, scontrol requeue,
            # sys.exit(-1). It raises UncompletedJobError when it may not requeue (timed out too many times).
            prev(signum, None)
            raise SystemExit(REQUEUE_EXIT_CODE)  # not reached when submitit exits itself
        job_id = os.environ.get("SLURM_JOB_ID")
        if job_id:
            try:
                subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
                log.warning("preemption: requeued SLURM job %s", job_id)
            except (OSError, subprocess.SubprocessError) as e:
                log.error("preemption: scontrol requeue %s failed: %s", job_id, e)
        raise SystemExit(REQUEUE_EXIT_CODE)

