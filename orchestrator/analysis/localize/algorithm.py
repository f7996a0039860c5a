"""Localization: which layer and which heads of a baseline run to intervene on, read from its own metrics.

The paper picked layer 2 / heads 1,7,8,9,11,12 from its run's W_Q spectral norms (the paper, Sec. 3.2, Fig. 3). In
another run the failing layer and heads differ, so the isolation sweep takes them from the data (the third step of
`flash-forensics isolate`):

    flash-forensics localize results/paper_isolation/<date>/0            # a baseline job dir
    flash-forensics localize results/paper_isolation/<date>              # a sweep dir (its baseline job)
    flash-forensics localize <mlflow run id> --tracking-uri sqlite:///results/mlflow.db --out loc.json --plot

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

import math
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence, Tuple

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.analysis.localize.stats import HeadStats, LayerStats, Localization, LocalizeConfig

History = Dict[str, List[Tuple[int, float]]]
PREFIXES = (record.WQ_SIGMA, record.RMAX_ROWS, record.MAX_LOGIT, record.LOSS)  # the metrics localization reads


# ------------------------------------------------------------------------------------------------- helpers
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
        head = record.parse_head_metric(name)
        if head:
            kind, layer, h = head
            (wq if kind == "wq_sigma" else rmax)[(layer, h)] = sorted(_finite(pts))
            continue
        layer = record.parse_layer_metric(name)
        if layer is not None:
            logit[layer] = sorted(_finite(pts))
    return wq, rmax, logit


def _window(wq, rmax, logit, history, divergence_step, cfg: LocalizeConfig) -> Tuple[Optional[int], Optional[int]]:
    """[start, end] in steps (see the module docstring)."""
    if divergence_step is not None:
        end = int(divergence_step)
    else:
        last = [s for series in (*wq.values(), *rmax.values(), *logit.values(), history.get(record.LOSS) or [])
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


