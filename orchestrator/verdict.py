"""Per-run verdict: did the training loss diverge, and at which step?

A run has diverged at step k when its loss is NaN/Inf at k, or when the loss stays above its running minimum by
more than `margin` for `window` consecutive steps starting at k (the paper's failures are sudden loss explosions
after a long stable stretch, Fig. 1). The detector is streaming and host-only: it sees the host losses that the
monitors hand back at each flush, so it costs the train loop nothing.

Whether a run's verdict agrees with the paper is `matches_paper(expected, observed)` (orchestrator/record.py, the one
formula; re-exported here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

FORK_BASELINES = ("fresh", "source")


@dataclass
class VerdictConfig:
    margin: float = 1.0  # nats above the running minimum that count as "up"
    window: int = 20  # consecutive "up" steps that make a divergence
    early_stop_after: int = 20  # with train.early_stop: steps still recorded after the divergence step
    # a fork's detector: "fresh" (its running minimum starts at the fork step) or "source" (it continues the source
    # run's detector at the checkpoint: the verdict a run gets that switched the intervention on at the fork step;
    # a fork from a checkpoint taken after the loss began to rise is then not judged against the raised loss)
    fork_baseline: str = "fresh"

    def validate(self, key: str = "verdict") -> "VerdictConfig":
        if self.fork_baseline not in FORK_BASELINES:
            raise ValueError(f"{key}.fork_baseline={self.fork_baseline!r} is not allowed: expected one of "
                             f"{', '.join(FORK_BASELINES)}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not self.margin > 0:
            raise ValueError(f"{key}.margin={self.margin!r} is not allowed: expected a number > 0")
        for name, low in (("window", 1), ("early_stop_after", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{key}.{name}={v!r} is not allowed: expected an integer >= {low}")
        return self


class DivergenceDetector:
    """Streaming divergence test over (step, loss) pairs; steps must increase (older ones are ignored)."""

    def __init__(self, cfg: VerdictConfig):
        self.cfg = cfg
        self.divergence_step: Optional[int] = None
        self.reason: Optional[str] = None  # 'non-finite' | 'spike'
        self.min_loss = math.inf
        self.min_loss_step: Optional[int] = None  # where training was at its best before any divergence
        self.final_loss: Optional[float] = None
        self.last_step: Optional[int] = None
        self._up_start: Optional[int] = None  # first step of the current run of "up" steps
        self._up_count = 0

    @property
    def observed(self) -> str:
        return "stable" if self.divergence_step is None else "diverged"

    @property
    def diverged(self) -> bool:
        return self.divergence_step is not None

    def update(self, steps_and_losses: Iterable[Tuple[int, float]]) -> bool:
        """Feed new points; True once the run has diverged (the verdict is latched)."""
        for step, loss in steps_and_losses:
            step, loss = int(step), float(loss)
            if self.last_step is not None and step <= self.last_step:
                continue  # replayed after a resume
            self.last_step = step
            self.final_loss = loss
            if self.diverged:
                continue
            if not math.isfinite(loss):
                self.divergence_step, self.reason = step, "non-finite"
                continue
            if loss > self.min_loss + self.cfg.margin:
                if self._up_count == 0:
                    self._up_start = step
                self._up_count += 1
                if self._up_count >= self.cfg.window:
                    self.divergence_step, self.reason = self._up_start, "spike"
            else:
                self._up_count, self._up_start = 0, None
                if loss < self.min_loss:
                    self.min_loss, self.min_loss_step = loss, step
        return self.diverged

    def should_stop(self, step: int) -> bool:
        """Early stop: the run diverged and `early_stop_after` more steps have been recorded."""
        return self.diverged and step >= self.divergence_step + self.cfg.early_stop_after

    def state_dict(self) -> dict:
        return {"divergence_step": self.divergence_step, "reason": self.reason, "min_loss": self.min_loss,
                "min_loss_step": self.min_loss_step,
                "final_loss": self.final_loss, "last_step": self.last_step, "up_start": self._up_start,
                "up_count": self._up_count}

    def load_state_dict(self, state: dict) -> None:
        self.divergence_step = state["divergence_step"]
        self.reason = state["reason"]
        self.min_loss = float(state["min_loss"])
        self.min_loss_step = state.get("min_loss_step")  # absent in checkpoints written before it existed
        self.final_loss = state["final_loss"]
        self.last_step = state["last_step"]
        self._up_start = state["up_start"]
        self._up_count = int(state["up_count"])


__all__ = ["VerdictConfig", "DivergenceDetector"]
