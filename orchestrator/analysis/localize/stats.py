"""Localization's config and its result: per-head and per-layer stats, the chosen layer and heads, and the
Hydra overrides that point an isolation sweep at them (the rules: orchestrator/analysis/localize/algorithm.py)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.interventions import scoped


def scoped_interventions() -> Tuple[List[str], List[str]]:
    """(names whose scope is a layer only, names whose scope also takes heads), read from the intervention files."""
    heads = scoped("heads")
    return [n for n in scoped("layer") if n not in heads], heads


@dataclass
class LocalizeConfig:
    samples: int = 10  # W_Q samples in the default window (the last ones at or before the end step)
    window: Optional[int] = None  # steps before the end step; overrides `samples`
    k_rate: float = 3.0  # first_fast: robust standard deviations above all heads' median rate
    rate_threshold: Optional[float] = None  # first_fast: a fixed growth rate (ln sigma per step) instead
    tie_tol: float = 0.05  # layers whose growth is within 5% of the leader's tie (broken by repeated maxima)
    margin: float = 1.5  # the chosen layer stands out by this factor over every other layer
    min_growth: float = 0.01  # below 1% W_Q growth in the window the data is flat
    head_metric: str = "sigma_end"  # "sigma_end" (the paper's absolute norms) or "growth"
    k_head: float = 3.0  # outlier heads: robust standard deviations above the other heads' median

    def validate(self, key: str = "localize") -> "LocalizeConfig":
        if not (isinstance(self.samples, int) and self.samples >= 2):
            raise ValueError(f"{key}.samples={self.samples!r} is not allowed: expected an int >= 2")
        if self.window is not None and not (isinstance(self.window, int) and self.window > 0):
            raise ValueError(f"{key}.window={self.window!r} is not allowed: expected an int > 0 (steps) or None")
        if self.head_metric not in ("sigma_end", "growth"):
            raise ValueError(f"{key}.head_metric={self.head_metric!r} is not allowed: expected sigma_end or growth")
        for name in ("k_rate", "tie_tol", "margin", "min_growth", "k_head"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{key}.{name}={v!r} is not allowed: expected a finite number >= 0")
        if self.margin < 1:
            raise ValueError(f"{key}.margin={self.margin!r} is not allowed: expected >= 1")
        return self


@dataclass
class HeadStats:
    layer: int
    head: int
    sigma_start: Optional[float] = None
    sigma_end: Optional[float] = None
    growth: Optional[float] = None  # sigma_end / sigma_start
    growth_abs: Optional[float] = None  # sigma_end - sigma_start
    first_fast: Optional[int] = None  # first step in the window its growth rate stood out
    rmax_total: Optional[float] = None  # repeated-maxima rows in the window (None: not logged)
    rmax_trend: Optional[float] = None  # share of rmax_total in the window's later half
    outlier: bool = False


@dataclass
class LayerStats:
    layer: int
    growth: Optional[float] = None  # largest end/start among its heads
    growth_head: Optional[int] = None
    sigma_end_max: Optional[float] = None
    first_fast: Optional[int] = None  # earliest first_fast among its heads
    rmax_total: Optional[float] = None
    rmax_trend: Optional[float] = None
    max_logit_start: Optional[float] = None
    max_logit_end: Optional[float] = None
    max_logit_peak: Optional[float] = None
    rank: int = 0


@dataclass
class Localization:
    start: Optional[int]
    end: Optional[int]
    divergence_step: Optional[int]
    layers: List[LayerStats]
    heads: List[HeadStats]
    layer: Optional[int] = None  # the layer the data points at; None when none stands out
    outlier_heads: List[int] = field(default_factory=list)
    reason: str = ""
    head_reason: str = ""
    config: Dict = field(default_factory=dict)
    source: Dict = field(default_factory=dict)

    def overrides(self) -> Dict[str, str]:
        """Ready-to-paste Hydra overrides per intervention (empty when no layer stands out)."""
        if self.layer is None:
            return {}
        layer_only, with_heads = scoped_interventions()
        out = {name: f"intervention={name} intervention.layer={self.layer}" for name in layer_only}
        if self.outlier_heads:
            heads = ",".join(str(h) for h in self.outlier_heads)
            for name in with_heads:
                out[name] = f"intervention={name} intervention.layer={self.layer} 'intervention.heads=[{heads}]'"
        return out

    def target(self) -> Tuple[Optional[int], List[int], str]:
        """(layer, heads, why) for a sweep that must name a layer: the one that stands out, else the top-ranked
        candidate; its outlier heads, else the upper half of its heads by the end-of-window W_Q sigma."""
        if not self.layers:
            return None, [], "nothing to localize"
        layer = self.layer if self.layer is not None else self.layers[0].layer
        why = "stands out" if self.layer is not None else "best guess: no layer stands out, the top-ranked one"
        heads = list(self.outlier_heads) if self.layer is not None else []
        if not heads:  # the upper half by W_Q sigma, else (no W_Q metrics) by repeated-maxima rows
            for attr, what in (("sigma_end", "end-of-window W_Q sigma"), ("rmax_total", "repeated-maxima rows")):
                hs = sorted((h for h in self.heads if h.layer == layer and getattr(h, attr) is not None),
                            key=lambda h: -getattr(h, attr))
                if hs:
                    heads = sorted(h.head for h in hs[:max(1, len(hs) // 2)])
                    why += f"; heads: no outliers, the upper half by {what}"
                    break
            else:
                why += "; heads: none (no per-head metrics)"
        return layer, heads, why

    def sweep_overrides(self) -> List[str]:
        """Hydra overrides that point a whole isolation sweep's layer/head interventions at target()."""
        layer, heads, _ = self.target()
        if layer is None:
            return []
        return [f"intervention.layer={layer}"] + (["intervention.heads=[" + ",".join(map(str, heads)) + "]"]
                                                  if heads else [])

    def to_dict(self) -> Dict:
        d = asdict(self)
        d["overrides"] = self.overrides()
        d["target"] = dict(zip(("layer", "heads", "why"), self.target()))
        d["sweep_overrides"] = self.sweep_overrides()
        return record.encode(d)

