"""monitor.capture: which training steps, layers and heads a job writes attention snapshots of (typed, validated
before launch like the other monitor settings). Off by default (no steps, no alarm, no fork trigger).

    monitor.capture: {steps: [100, 200], layers: [2], heads: [0, 3], at_alarm: true, dir: captures}

steps: 0-based optimizer steps whose forward+backward is captured (the first micro-batch); at_alarm: also the step
after monitor.alarm fires; before_divergence: in a fork (from_checkpoint=...), the step before the source run's
divergence step (its result.json). dir: relative to the job folder. max_mib: the per-file cap. batch: the first N
sequences of the micro-batch only (attention is per sequence: exact for those).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

ALL = "all"


@dataclass
class CaptureConfig:
    steps: List[int] = field(default_factory=list)
    layers: Any = ALL  # "all" or a list of 0-based layer indices
    heads: Any = ALL  # "all" or a list of 0-based head indices
    worst: Optional[int] = None  # instead of heads: the N heads with the most tie rows at that call
    at_alarm: bool = False
    before_divergence: bool = False
    dir: str = "captures"
    max_mib: float = 64.0
    batch: Optional[int] = None  # keep the first N sequences of the micro-batch (null: all): smaller files

    @property
    def enabled(self) -> bool:
        return bool(self.steps) or self.at_alarm or self.before_divergence

    def validate(self, key: str = "monitor.capture", n_layer: Optional[int] = None, n_head: Optional[int] = None,
                 alarm_enabled: Optional[bool] = None, forking: Optional[bool] = None,
                 alarm_action: Optional[str] = None) -> "CaptureConfig":
        def bad(name, v, allowed):
            return ValueError(f"{key}.{name}={v!r} is not allowed: expected {allowed}")
        steps = _list(self.steps)
        if steps is None or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
            raise bad("steps", self.steps, "a list of 0-based optimizer steps (integers >= 0)")
        for name, top in (("layers", n_layer), ("heads", n_head)):
            v = getattr(self, name)
            items = _list(v)
            hi = f" < {top}" if top is not None else ""
            if isinstance(v, str) and v == ALL:
                continue
            if not items or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 or (top is not None and
                                                                                             i >= top) for i in items):
                raise bad(name, v, f"'all' or a non-empty list of integers >= 0{hi}")
        if self.worst is not None:
            if isinstance(self.worst, bool) or not isinstance(self.worst, int) or self.worst < 1 or (
                    n_head is not None and self.worst > n_head):
                raise bad("worst", self.worst, f"null or an integer in 1..{n_head or 'n_head'}")
            if self.heads != ALL:
                raise bad("worst", self.worst, "null when heads is a list (name the heads, or ask for the worst N)")
        for name in ("at_alarm", "before_divergence"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "true or false")
        if not isinstance(self.dir, str) or not self.dir:
            raise bad("dir", self.dir, "a folder (relative to the job folder, or absolute)")
        if isinstance(self.max_mib, bool) or not isinstance(self.max_mib, (int, float)) or not (
                math.isfinite(self.max_mib) and self.max_mib > 0):
            raise bad("max_mib", self.max_mib, "a number > 0 (MiB per file)")
        if self.batch is not None and (isinstance(self.batch, bool) or not isinstance(self.batch, int)
                                       or self.batch < 1):
            raise bad("batch", self.batch, "null (every sequence) or an integer >= 1")
        if self.at_alarm and alarm_enabled is False:
            raise bad("at_alarm", True, "false while monitor.alarm.enabled=false (the alarm can never fire)")
        if self.at_alarm and alarm_enabled and alarm_action == "stop":
            raise bad("at_alarm", True, "false with monitor.alarm.action=stop (the run ends at the alarm: there is "
                                        "no next step to capture; use action tag, checkpoint or fork)")
        if self.before_divergence and forking is False:
            raise bad("before_divergence", True, "false outside a fork: it needs from_checkpoint=<a checkpoint of "
                                                 "a run that diverged>")
        return self

    def layer_list(self, n_layer: int) -> List[int]:
        return list(range(n_layer)) if self.layers == ALL else sorted(set(_list(self.layers)))

    def head_list(self) -> Optional[List[int]]:
        return None if self.heads == ALL else sorted(set(_list(self.heads)))


def _list(v) -> Optional[list]:
    if isinstance(v, (str, bytes, dict)):
        return None
    try:
        return list(v)
    except TypeError:
        return None


__all__ = ["CaptureConfig"]
