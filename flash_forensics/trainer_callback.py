"""flash_forensics' monitors in transformers' Trainer: `Trainer(..., callbacks=[flash_forensics.TrainerCallback()])`.

The values go into the Trainer's own logs: at each of its logging steps the callback's flushed values (the
Monitor's metric names) are added to the `logs` dict the Trainer passes to its callbacks and to the entry it
appended to `state.log_history`, so whatever `report_to` names (MLflow, TensorBoard, W&B) records them in the run
the Trainer made. For that the callback must see `logs` before the report_to integrations, which the Trainer adds
ahead of user callbacks: it moves itself to the front of the Trainer's callback list when the Trainer first calls
it (a UserWarning says so where it cannot: the values then reach state.log_history and
`cb.history` only).

Its own MLflow run (`mlflow=True`, with the Monitor's tracking_uri / experiment / run_name) only when asked, and
refused beside report_to=["mlflow"] (or "all"): one training, one run.
"""
from __future__ import annotations

import math
import sys
import warnings
from typing import Dict, Optional

from flash_forensics.kernels.checks import is_int
from flash_forensics.monitor import Monitor


def _reports_mlflow(args) -> bool:
    report_to = getattr(args, "report_to", None) or []
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    return "mlflow" in report_to or "all" in report_to


def _to_front(cb, depth: int = 4) -> bool:
    """Move `cb` to the front of the CallbackHandler that is calling it (found on the call stack). Safe while the
    handler iterates: the callbacks already called shift right, the ones after `cb` keep their places."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            break
        handler = frame.f_locals.get("self")
        callbacks = getattr(handler, "callbacks", None)
        if type(handler).__name__ == "CallbackHandler" and isinstance(callbacks, list) and cb in callbacks:
            callbacks.remove(cb)
            callbacks.insert(0, cb)
            return True
        frame = frame.f_back
    return False


def _callback_class():
    """transformers.TrainerCallback's subclass, built on first use (importing transformers costs seconds)."""
    from transformers import TrainerCallback as Base  # lazy: transformers is optional and slow to import

    class TrainerCallback(Base):
        """Adds flash_forensics' monitors to a Trainer (module docstring).

        log_every: None = args.logging_steps. into_logs: add the values to the Trainer's logs (default). mlflow:
        also the callback's own MLflow run (refused beside report_to=["mlflow"]). `history`: the flushed dicts;
        `monitor`: the Monitor (from on_train_begin)."""

        def __init__(self, log_every: Optional[int] = None, wq_every: int = 50, mlflow: bool = False,
                     into_logs: bool = True, **mlflow_kw):
            for key, value, ok in (("log_every", log_every, log_every is None or is_int(log_every, 1)),
                                   ("wq_every", wq_every, is_int(wq_every, 1))):
                if not ok:  # refused here, not when training starts
                    raise ValueError(f"TrainerCallback.{key}={value!r} is not allowed: expected an integer > 0"
                                     + (" or None (TrainingArguments.logging_steps)" if key == "log_every" else ""))
            self.log_every, self.wq_every, self.mlflow, self.mlflow_kw = log_every, wq_every, mlflow, mlflow_kw
            self.into_logs = into_logs
            self.monitor: Optional[Monitor] = None
            self._pending: Dict[str, float] = {}
            self._placed = False

        @property
        def history(self):
            return self.monitor.history if self.monitor is not None else []

        def _setup(self, args) -> None:
            if self.mlflow and _reports_mlflow(args):
                raise ValueError(f"TrainerCallback(mlflow=True) with TrainingArguments.report_to={args.report_to!r} "
                                 "is not allowed: expected mlflow=False (the callback's values go into the Trainer's "
                                 "logs, which report_to's MLflow run records: one training, one run)")
            if self.into_logs and not self._placed:
                self._placed = _to_front(self)
                if not self._placed:
                    warnings.warn("flash_forensics.TrainerCallback could not place itself before the report_to "
                                  "integrations: its values reach state.log_history and cb.history, not their runs "
                                  "(add it with trainer.callback_handler.callbacks.insert(0, cb))", stacklevel=3)

        def on_init_end(self, args, state, control, **kwargs):
            self._setup(args)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self._setup(args)
            # the state's logging_steps: a ratio of the run (args.logging_steps < 1) made a step count, as the Trainer
            # logs; args' own where a Trainer has no such field
            steps = getattr(state, "logging_steps", None) or args.logging_steps
            every = self.log_every or (int(steps) if steps >= 1 else math.ceil(state.max_steps * steps))
            self.monitor = Monitor(model, log_every=every, wq_every=self.wq_every, mlflow=self.mlflow,
                                   **self.mlflow_kw)

        def on_step_end(self, args, state, control, **kwargs):
            self._keep(self.monitor.step(step=state.global_step - 1))

        def _keep(self, out) -> None:
            """A flush's values, for the Trainer's next log (not the Trainer's own values sent back to it)."""
            self._pending.update({k: v for k, v in (out or {}).items() if not k.startswith("trainer/")})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is None:
                return
            if state.global_step >= state.max_steps and self.monitor.pending():
                self._keep(self.monitor.flush())  # the last, partial interval, before the summary log
            if logs:  # the Trainer's loss etc. in cb.history (and the callback's own run), with the next flush
                self.monitor.log_host(max(state.global_step - 1, 0),
                                      {f"trainer/{k}": v for k, v in logs.items() if isinstance(v, (int, float))})
            if self.into_logs and self._pending:
                logs.update(self._pending)
                last = state.log_history[-1] if state.log_history else None
                if last is not None and last.get("step") == state.global_step:
                    last.update(self._pending)  # the Trainer appended its copy before calling on_log
                self._pending = {}

        def on_train_end(self, args, state, control, **kwargs):
            self.monitor.close()

    return TrainerCallback


_CALLBACK = None


def __getattr__(name: str):
    global _CALLBACK
    if name == "TrainerCallback":
        if _CALLBACK is None:
            _CALLBACK = _callback_class()
        return _CALLBACK
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TrainerCallback"]  # noqa: F822  (built by __getattr__)
