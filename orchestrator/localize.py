"""Localization: which layer and which heads of a baseline run to intervene on, read from its own metrics.

The paper picked layer 2 / heads 1,7,8,9,11,12 from its run's W_Q spectral norms (PAPER.md). In another run the
failing layer and heads differ, so the isolation sweep should take them from the data (issue 7, item 3):

    python -m orchestrator.localize results/paper_isolation/<date>/0            # a baseline job dir
    python -m orchestrator.localize results/paper_isolation/<date>              # a sweep dir (its baseline job)
    python -m orchestrator.localize <mlflow run id> --tracking-uri sqlite:///results/mlflow.db --out loc.json --plot

Input: metric histories {name: [(step, value)]} as the monitors log them: `wq_sigma/L{l}.H{h}` (top singular
value of head h's W_Q block, every monitor.wq_every steps), `rmax_rows/L{l}.H{h}` (rows where the SFA
repeated-maxima condition fired, per log interval), `max_logit/L{l}`. Layers and heads are 0-based, as in
conf/intervention/*.yaml.

The window: [start, end], end = the divergence step (result.json / the run's tag; the last logged step when the
run did not diverge); start = the `samples`-th last W_Q sample at or before end (default 10 samples), or
end - window when `window` (steps) is given.

Per head: sigma at the window's start and end, growth (end/start and end - start), `first_fast`: the first step in
the window at which the head's growth rate ln(sigma_t / sigma_prev) / (t - prev) stood out from all heads' rates
over the same interval (> median + k_rate * 1.4826 * MAD across every head of every layer, and > 0), or exceeded
`rate_threshold` per step when that is given; repeated-maxima total in the window and its trend (share of the
total that falls in the window's later half: 0.5 flat, near 1 rising).

The layer score ("first and largest W_Q growth, repeated-maxima counts"):
  1. growth: the largest excess growth (end/start - 1) among the layer's heads;
  2. layers whose growth is within `tie_tol` (relative) of the leader's tie; ties are broken by the layer's
     repeated-maxima total in the window, then by the earliest first_fast step, then by the largest end sigma;
  3. the winner *stands out* when its growth is >= `margin` x every other layer's (and >= `min_growth`), or
     when it is in the top growth tier and its repeated-maxima total is >= `margin` x every other layer's (> 0).
     Otherwise no layer stands out and `layer` is None (the ranking still lists the candidates).
  Without W_Q metrics the score is the repeated-maxima total alone; without both there is nothing to localize.

The heads of the chosen layer ("outliers", mirroring the paper's 4.12..6.27 vs 1.74..2.68): sort the heads'
`head_metric` (default the end-of-window sigma, like the paper's absolute norms; "growth" for end/start), split at
the largest gap between neighbours; the upper group are the outliers when its smallest value is
>= `k_head` robust standard deviations (1.4826 * MAD) above the lower group's median and the lower group has at
least 2 heads. The paper's 12 norms split 6/6 this way. Without W_Q metrics the repeated-maxima totals are used.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

History = Dict[str, List[Tuple[int, float]]]
PREFIXES = ("wq_sigma/", "rmax_rows/", "max_logit/", "train/loss")
_HEAD = re.compile(r"^(wq_sigma|rmax_rows)/L(\d+)\.H(\d+)$")
_LAYER = re.compile(r"^max_logit/L(\d+)$")
# interventions whose scope is a layer (and heads): the overrides the CLI prints for them
LAYER_INTERVENTIONS = ("flash_only_layer", "standard_layer")
HEAD_INTERVENTIONS = ("head_upcast",)


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
        out = {name: f"intervention={name} intervention.layer={self.layer}" for name in LAYER_INTERVENTIONS}
        if self.outlier_heads:
            heads = ",".join(str(h) for h in self.outlier_heads)
            for name in HEAD_INTERVENTIONS:
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
        return _json_safe(d)

    def format(self) -> str:
        return format_localization(self)


# ------------------------------------------------------------------------------------------------- helpers
def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _robust_sd(xs: Sequence[float]) -> float:
    """1.4826 * MAD: the standard deviation of normal data, unmoved by the outliers we look for."""
    m = _median(xs)
    return 1.4826 * _median([abs(x - m) for x in xs])


def _finite(pts):
    return [(int(s), float(v)) for s, v in pts if v is not None and math.isfinite(float(v))]


def parse_history(history: History):
    """{(layer, head): pts} for wq_sigma and rmax_rows, {layer: pts} for max_logit (sorted, finite points)."""
    wq, rmax, logit = {}, {}, {}
    for name, pts in history.items():
        m = _HEAD.match(name)
        if m:
            (wq if m.group(1) == "wq_sigma" else rmax)[(int(m.group(2)), int(m.group(3)))] = sorted(_finite(pts))
            continue
        m = _LAYER.match(name)
        if m:
            logit[int(m.group(1))] = sorted(_finite(pts))
    return wq, rmax, logit


def _window(wq, rmax, logit, history, divergence_step, cfg: LocalizeConfig) -> Tuple[Optional[int], Optional[int]]:
    """[start, end] in steps (see the module docstring)."""
    if divergence_step is not None:
        end = int(divergence_step)
    else:
        last = [s for series in (*wq.values(), *rmax.values(), *logit.values(), history.get("train/loss") or [])
                for s, _ in series[-1:]]
        if not last:
            return None, None
        end = max(last)
    wq_steps = sorted({s for pts in wq.values() for s, _ in pts if s <= end})
    if cfg.window is not None:
        start = end - cfg.window
        inside = [s for s in wq_steps if s >= start]
        if len(inside) < 2:  # too narrow for a growth: reach back to the sample before it
            before = [s for s in wq_steps if s < start]
            if before:
                start = before[-1]
    elif wq_steps:
        start = wq_steps[-min(cfg.samples, len(wq_steps))]
    else:
        starts = [s for series in (*rmax.values(), *logit.values()) for s, _ in series[:1]]
        start = min(starts) if starts else end
    return start, end


def _in(pts, start, end):
    return [(s, v) for s, v in pts if start <= s <= end]


def _rmax_window(pts, start, end) -> Tuple[Optional[float], Optional[float]]:
    """Total in the window and its later-half share. Counts at step s cover the log interval ending at s."""
    inside = [(s, v) for s, v in pts if start < s <= end] or _in(pts, start, end)
    if not inside:
        return 0.0, None
    total = sum(v for _, v in inside)
    mid = 0.5 * (start + end)
    late = sum(v for s, v in inside if s > mid)
    return total, (late / total if total > 0 else None)


def _first_fast(wq, start, end, cfg: LocalizeConfig) -> Dict[Tuple[int, int], Optional[int]]:
    """Per head, the first sample step in the window whose growth rate stood out (see the module docstring)."""
    rates: Dict[int, Dict[Tuple[int, int], float]] = {}
    for key, pts in wq.items():
        inside = _in(pts, start, end)
        for (s0, v0), (s1, v1) in zip(inside, inside[1:]):
            if v0 > 0 and v1 > 0 and s1 > s0:
                rates.setdefault(s1, {})[key] = math.log(v1 / v0) / (s1 - s0)
    first: Dict[Tuple[int, int], Optional[int]] = {key: None for key in wq}
    for step in sorted(rates):
        r = rates[step]
        if cfg.rate_threshold is not None:
            thr = cfg.rate_threshold
        else:
            vals = list(r.values())
            # a floor so that float noise on flat data never counts as growth
            thr = _median(vals) + max(cfg.k_rate * _robust_sd(vals), 1e-9)
        for key, v in r.items():
            if first[key] is None and v > max(thr, 0.0):
                first[key] = step
    return first


def _split_outliers(values: Dict[int, float], k: float) -> Tuple[List[int], str]:
    """Heads above the largest gap, when that upper group stands k robust SDs above the rest (docstring)."""
    if len(values) < 3:
        return [], f"{len(values)} heads: too few to call outliers"
    order = sorted(values, key=lambda h: values[h])
    vs = [values[h] for h in order]
    gaps = [b - a for a, b in zip(vs, vs[1:])]
    best = None
    for i, g in enumerate(gaps):  # split after index i: lower = vs[:i+1], upper = vs[i+1:]
        if i + 1 < 2 or g <= 0:
            continue
        if best is None or g > gaps[best] or (g == gaps[best] and i > best):
            best = i
    if best is None:
        return [], "all heads alike: none stands out"
    lower, upper = vs[:best + 1], vs[best + 1:]
    med, sd = _median(lower), _robust_sd(lower)
    floor = 1e-6 * max(abs(med), 1e-12)
    z = (upper[0] - med) / max(sd, floor)
    if z < k:
        return [], (f"no head stands out: the largest gap ({vs[best]:.4g} -> {vs[best + 1]:.4g}) is {z:.1f} robust "
                    f"SDs above the other heads' median (need {k:g})")
    heads = sorted(order[best + 1:])
    return heads, (f"{len(heads)} of {len(vs)} heads at {upper[0]:.4g}..{upper[-1]:.4g} vs {lower[0]:.4g}.."
                   f"{lower[-1]:.4g} ({z:.1f} robust SDs above the others' median)")


# ---------------------------------------------------------------------------------------------- localize
def localize(history: History, window: Optional[int] = None, divergence_step: Optional[int] = None,
             cfg: Optional[LocalizeConfig] = None, **overrides) -> Localization:
    """The layer and heads the data points at. `history`: {metric: [(step, value)]}; `window`: steps before the
    end step (default: the last cfg.samples W_Q samples); keyword overrides set LocalizeConfig fields."""
    cfg = LocalizeConfig(**{**(asdict(cfg) if cfg else {}), **overrides,
                            **({"window": window} if window is not None else {})}).validate()
    wq, rmax, logit = parse_history(history)
    start, end = _window(wq, rmax, logit, history, divergence_step, cfg)
    loc = Localization(start=start, end=end, divergence_step=divergence_step, layers=[], heads=[],
                       config=asdict(cfg))
    if start is None or (not wq and not rmax):
        loc.reason = ("nothing to localize: the run has no wq_sigma/ or rmax_rows/ metrics "
                      "(monitor.wq_every / monitor.counters off, or the run logged nothing)")
        return loc

    first = _first_fast(wq, start, end, cfg) if wq else {}
    keys = sorted(set(wq) | set(rmax))
    for key in keys:
        h = HeadStats(layer=key[0], head=key[1])
        pts = wq.get(key) or []
        inside = _in(pts, start, end)
        if not inside:  # no sample in the window: the last one before its start, if any
            inside = [p for p in pts if p[0] <= end][-1:]
        if inside:
            h.sigma_start, h.sigma_end = inside[0][1], inside[-1][1]
            h.growth_abs = h.sigma_end - h.sigma_start
            h.growth = h.sigma_end / h.sigma_start if h.sigma_start > 0 else None
        h.first_fast = first.get(key)
        if key in rmax:
            h.rmax_total, h.rmax_trend = _rmax_window(rmax[key], start, end)
        loc.heads.append(h)

    for layer in sorted({k[0] for k in keys} | set(logit)):
        hs = [h for h in loc.heads if h.layer == layer]
        L = LayerStats(layer=layer)
        grown = [h for h in hs if h.growth is not None]
        if grown:
            top = max(grown, key=lambda h: h.growth)
            L.growth, L.growth_head = top.growth, top.head
            L.sigma_end_max = max(h.sigma_end for h in grown)
        ff = [h.first_fast for h in hs if h.first_fast is not None]
        L.first_fast = min(ff) if ff else None
        counted = [h for h in hs if h.rmax_total is not None]
        if counted:
            L.rmax_total = sum(h.rmax_total for h in counted)
            late = sum(h.rmax_total * h.rmax_trend for h in counted if h.rmax_trend is not None)
            L.rmax_trend = late / L.rmax_total if L.rmax_total > 0 else None
        lp = _in(logit.get(layer) or [], start, end)
        if lp:
            L.max_logit_start, L.max_logit_end, L.max_logit_peak = lp[0][1], lp[-1][1], max(v for _, v in lp)
        loc.layers.append(L)

    _rank_layers(loc, cfg)
    if loc.layer is not None:
        _pick_heads(loc, cfg)
    return loc


def _rank_layers(loc: Localization, cfg: LocalizeConfig) -> None:
    layers = loc.layers
    excess = {L.layer: (L.growth - 1.0) if L.growth is not None else None for L in layers}
    rm = {L.layer: L.rmax_total or 0.0 for L in layers}
    has_wq = any(v is not None for v in excess.values())
    has_rmax = any(L.rmax_total is not None for L in layers)
    if has_wq:
        lead = max(v for v in excess.values() if v is not None)
        tier = {l for l, v in excess.items() if v is not None and v >= lead - cfg.tie_tol * abs(lead)}
    else:
        tier = {L.layer for L in layers}

    def key(L: LayerStats):
        return (L.layer in tier, rm[L.layer], -(L.first_fast if L.first_fast is not None else math.inf),
                excess[L.layer] if excess[L.layer] is not None else -math.inf, L.sigma_end_max or 0.0, -L.layer)

    ranked = sorted(layers, key=key, reverse=True)
    # rank all layers by growth first (outside the top tier), the tier itself by the tie-breakers above
    rest = sorted([L for L in ranked if L.layer not in tier],
                  key=lambda L: (excess[L.layer] if excess[L.layer] is not None else -math.inf, rm[L.layer]),
                  reverse=True)
    ranked = [L for L in ranked if L.layer in tier] + rest
    for i, L in enumerate(ranked, 1):
        L.rank = i
    loc.layers = ranked
    best, others = ranked[0], ranked[1:]

    def fmt(L):
        g = f"W_Q x{L.growth:.3f}" if L.growth is not None else "no W_Q"
        r = f", {L.rmax_total:.0f} repeated-maxima rows" if L.rmax_total is not None else ""
        return f"L{L.layer} ({g}{r})"

    e_best = excess[best.layer]
    e_next = max((excess[L.layer] for L in others if excess[L.layer] is not None), default=None)
    r_next = max((rm[L.layer] for L in others), default=0.0)
    by_growth = (e_best is not None and e_best >= cfg.min_growth
                 and (e_next is None or e_best >= cfg.margin * max(e_next, 0.0)))
    by_rmax = has_rmax and rm[best.layer] > 0 and rm[best.layer] >= cfg.margin * r_next and best.layer in tier
    if by_growth:
        loc.layer = best.layer
        loc.reason = (f"L{best.layer}: largest W_Q growth (head {best.growth_head}: x{best.growth:.3f}; next "
                      f"{fmt(others[0]) if others else '-'})")
        if has_rmax and rm[best.layer] < r_next:
            loc.reason += "; note: another layer has more repeated-maxima rows"
    elif by_rmax:
        loc.layer = best.layer
        what = "no W_Q metrics" if not has_wq else f"W_Q growth ties within {cfg.tie_tol:.0%} or is flat"
        loc.reason = (f"L{best.layer}: {what}; most repeated-maxima rows ({rm[best.layer]:.0f} vs {r_next:.0f} "
                      f"in the next layer)")
    else:
        flat = has_wq and (e_best is None or e_best < cfg.min_growth) and not any(rm.values())
        top = ", ".join(fmt(L) for L in ranked[:3])
        loc.reason = ("no layer stands out: " + ("W_Q sigma is flat in the window (growth < "
                                                 f"{cfg.min_growth:.0%}) and no repeated maxima; "
                                                 if flat else "")
                      + f"top layers {top} (need x{cfg.margin:g} over the next layer in growth or repeated "
                        "maxima); widen the window (--window/--samples) or run longer")


def _pick_heads(loc: Localization, cfg: LocalizeConfig) -> None:
    hs = [h for h in loc.heads if h.layer == loc.layer]
    if any(h.sigma_end is not None for h in hs):
        attr = "sigma_end" if cfg.head_metric == "sigma_end" else "growth"
        what = "end-of-window W_Q sigma" if attr == "sigma_end" else "W_Q growth"
    else:
        attr, what = "rmax_total", "repeated-maxima rows"
    values = {h.head: getattr(h, attr) for h in hs if getattr(h, attr) is not None}
    heads, why = _split_outliers(values, cfg.k_head)
    loc.outlier_heads = heads
    loc.head_reason = f"by {what}: {why}"
    for h in hs:
        h.outlier = h.head in heads


# ------------------------------------------------------------------------------------------------ output
def _f(x, nd=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}" if math.isfinite(x) else str(x)
    return str(x)


def _grid(head: List[str], rows: List[List[str]]) -> List[str]:
    w = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return [line(head), "-" * len(line(head))] + [line(r) for r in rows]


def format_localization(loc: Localization) -> str:
    out = [f"window: steps {loc.start}..{loc.end}" + (f" (divergence at step {loc.divergence_step})"
                                                       if loc.divergence_step is not None else " (no divergence)")]
    if loc.layers:
        out += ["", "layers (ranked):"]
        out += _grid(["rank", "layer", "W_Q growth", "(head)", "max sigma", "first fast", "rmax rows", "rmax late",
                      "logit start", "logit end", "logit peak"],
                     [[str(L.rank), f"L{L.layer}", _f(L.growth), _f(L.growth_head), _f(L.sigma_end_max),
                       _f(L.first_fast), _f(L.rmax_total, 0), _f(L.rmax_trend, 2), _f(L.max_logit_start, 2),
                       _f(L.max_logit_end, 2), _f(L.max_logit_peak, 2)] for L in loc.layers])
    shown = [loc.layer] if loc.layer is not None else [L.layer for L in loc.layers[:1]]
    for layer in shown:
        hs = sorted((h for h in loc.heads if h.layer == layer), key=lambda h: h.head)
        out += ["", f"heads of L{layer}" + (" (best guess; no layer stands out)" if loc.layer is None else "") + ":"]
        out += _grid(["head", "sigma start", "sigma end", "growth", "growth abs", "first fast", "rmax rows",
                      "rmax late", "outlier"],
                     [[f"H{h.head}", _f(h.sigma_start), _f(h.sigma_end), _f(h.growth), _f(h.growth_abs),
                       _f(h.first_fast), _f(h.rmax_total, 0), _f(h.rmax_trend, 2), "*" if h.outlier else ""]
                      for h in hs])
    out += ["", "layer: " + loc.reason]
    if loc.layer is not None:
        out += ["heads: " + loc.head_reason, "", "Hydra overrides:"]
        out += [f"  {v}" for v in loc.overrides().values()]
        if not loc.outlier_heads:
            out += ["  (head_upcast: no outlier heads; list heads yourself or use standard_layer)"]
    return "\n".join(out)


def plot(loc: Localization, history: History, path: Path) -> Path:
    """The localization plot (orchestrator/plots.py: localization): per-head W_Q of the chosen layer and the
    layer ranking with the chosen bar highlighted."""
    from orchestrator.plots import localization
    return localization(loc, history, path)


# ----------------------------------------------------------------------------------------------- loading
def load_history(run_id: str, tracking_uri: Optional[str] = None, prefixes=PREFIXES) -> History:
    """{metric: [(step, value)]} of an MLflow run, for the metrics localization reads."""
    from orchestrator.tracking import _retry, make_client, resolve_uri
    client = make_client(resolve_uri(tracking_uri))
    run = _retry(client.get_run, run_id)
    hist: History = {}
    keys = [k for k in run.data.metrics if k.startswith(prefixes)]
    from tqdm import tqdm
    for key in tqdm(keys, desc="localize: metric histories", disable=len(keys) < 50, leave=False):
        pts = _retry(client.get_metric_history, run_id, key)
        hist[key] = sorted((int(m.step), float(m.value)) for m in pts)
    return hist


def _job_uri(job_dir: Path) -> Optional[str]:
    """The tracking uri a job used: its Hydra config, else the sweep's mlflow_parent.json."""
    cfg = job_dir / ".hydra" / "config.yaml"
    if cfg.is_file():
        try:
            import yaml
            uri = ((yaml.safe_load(cfg.read_text()) or {}).get("tracking") or {}).get("uri")
            if uri:
                return str(uri)
        except Exception:
            pass
    from orchestrator.tracking import find_parent
    for d in (job_dir, job_dir.parent):
        parent = find_parent(d)
        if parent and parent.get("tracking_uri"):
            return parent["tracking_uri"]
    return None


def resolve_source(source: str, tracking_uri: Optional[str] = None, job: Optional[str] = None) -> Dict:
    """{run_id, tracking_uri, divergence_step, job_dir} for a run id, a job dir (result.json) or a sweep dir
    (its baseline job; `job` names another job folder)."""
    path = Path(source)
    if path.is_dir():
        if not (path / "result.json").is_file():
            from orchestrator.report import collect_rows
            rows = [r for r in collect_rows(path) if r.get("mlflow_run_id")]
            if job is not None:
                rows = [r for r in rows if r.get("job") == job]
            else:
                rows = [r for r in rows if r.get("intervention") == "baseline"] or rows
                rows.sort(key=lambda r: r.get("observed") != "diverged")  # a diverged baseline first
            if not rows:
                raise ValueError(f"{source}: no job with result.json and an MLflow run id"
                                 + (f" named {job!r}" if job else "") + " (is it a job or sweep dir?)")
            path = Path(rows[0]["job_dir"])
        result = json.loads((path / "result.json").read_text())
        if not result.get("mlflow_run_id"):
            raise ValueError(f"{path / 'result.json'}: no mlflow_run_id (the job died before tracking started)")
        return {"run_id": result["mlflow_run_id"], "tracking_uri": tracking_uri or _job_uri(path),
                "divergence_step": result.get("divergence_step"), "job_dir": str(path),
                "intervention": result.get("intervention")}
    if path.exists() or "/" in source:
        raise ValueError(f"{source}: not a job dir, sweep dir or MLflow run id")
    from orchestrator.tracking import _retry, make_client, resolve_uri
    run = _retry(make_client(resolve_uri(tracking_uri)).get_run, source)
    div = run.data.tags.get("divergence_step")
    try:
        div = int(float(div)) if div not in (None, "", "None") else None
    except ValueError:
        div = None
    return {"run_id": source, "tracking_uri": tracking_uri, "divergence_step": div, "job_dir": None,
            "intervention": run.data.tags.get("intervention")}


# -------------------------------------------------------------------------------------------------- CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    d = LocalizeConfig()
    p = argparse.ArgumentParser(prog="python -m orchestrator.localize", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a baseline job dir (result.json), a sweep dir, or an MLflow run id")
    p.add_argument("--tracking-uri", help="MLflow store (default: the job's own, else results/mlflow.db)")
    p.add_argument("--job", help="in a sweep dir: the job folder to read (default: the baseline)")
    p.add_argument("--divergence-step", type=int, help="end of the window (default: from result.json / run tag)")
    p.add_argument("--window", type=int, help="window length in steps before the end (default: --samples)")
    p.add_argument("--samples", type=int, default=d.samples, help="W_Q samples in the default window")
    p.add_argument("--rate-threshold", type=float, help="fixed growth rate (ln sigma per step) for 'first fast'")
    p.add_argument("--margin", type=float, default=d.margin, help="factor by which the layer must stand out")
    p.add_argument("--tie-tol", type=float, default=d.tie_tol, help="relative W_Q growth within which layers tie")
    p.add_argument("--min-growth", type=float, default=d.min_growth, help="W_Q growth below which data is flat")
    p.add_argument("--head-metric", choices=("sigma_end", "growth"), default=d.head_metric)
    p.add_argument("--k-head", type=float, default=d.k_head, help="robust SDs that make a head an outlier")
    p.add_argument("--out", type=Path, help="write the localization as JSON here")
    p.add_argument("--plot", type=Path, nargs="?", const=True,
                   help="write a PNG (default: beside --out, else localize.png)")
    p.add_argument("--sweep-overrides", action="store_true",
                   help="print only the overrides that point an isolation sweep at the target layer/heads on stdout "
                        "(the report goes to stderr), for scripts")
    a = p.parse_args(argv)
    try:
        src = resolve_source(a.source, a.tracking_uri, a.job)
        history = load_history(src["run_id"], src["tracking_uri"])
        div = a.divergence_step if a.divergence_step is not None else src["divergence_step"]
        loc = localize(history, window=a.window, divergence_step=div, samples=a.samples,
                       rate_threshold=a.rate_threshold, margin=a.margin, tie_tol=a.tie_tol,
                       min_growth=a.min_growth, head_metric=a.head_metric, k_head=a.k_head)
    except (ValueError, OSError) as e:
        print(f"localize: {e}", file=sys.stderr)
        return 2
    loc.source = src
    say = (lambda *m: print(*m, file=sys.stderr)) if a.sweep_overrides else print
    say(f"run {src['run_id']}" + (f" ({src['intervention']})" if src.get("intervention") else "")
        + (f", job {src['job_dir']}" if src.get("job_dir") else ""))
    say(loc.format())
    layer, heads, why = loc.target()
    say(f"\nsweep target: layer {layer}, heads {heads} ({why})")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(loc.to_dict(), indent=2))
        say(f"\nwrote {a.out}")
    if a.plot:
        png = a.plot if a.plot is not True else (a.out.with_suffix(".png") if a.out else Path("localize.png"))
        say(f"wrote {plot(loc, history, png)}")
    if a.sweep_overrides:
        print(" ".join(loc.sweep_overrides()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
