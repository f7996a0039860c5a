"""Sweep plots that answer "which intervention fixed the divergence and which only delayed it" (as the paper's
Secs. 3.1-3.2 read loss curves and per-head W_Q spectral norms, Figs. 2-3, and App. E the repeated maxima, Fig. 13).

Input of the history plots: `runs` = list of (label, history), history maps a metric name to [(step, value), ...].
Each function returns the PNG path it wrote, or None when there is nothing to draw.
- loss_curves: train loss on a linear axis around the fork window, one colour x line-style per run, full labels in
  a legend outside the axes, an X at each run's divergence step;
- wq_spectral_norms: per run, sigma_max(W_Q) of the top head of each layer (colour = layer), shared y axis;
- repeated_maxima: per run, repeated-maxima rows per layer (colour = layer), shared y axis;
- delays: divergence step minus the baseline's, per intervention (stable runs: "no divergence by step N");
- localization: orchestrator/analysis/localize/'s ranking with the chosen layer's bar highlighted;
- probes: the mechanism probes per run (delta-error mean and cumulative sum, P̄ = 1 tie share, W_Q coherence).
Colours: tab10, then Kelly's contrast colours, so no two of 20 layers or runs share one.
"""
from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from flash_forensics.orchestrator import record

History = Dict[str, List[Tuple[int, float]]]
_HEAD = re.compile(r"L(\d+)\.H(\d+)$")
SMOOTH = 25  # steps in the loss plot's moving average when it overlays many runs
MANY = 6  # more runs than this: smoothed curves and a wider axis
_LABEL_WIDTH = 58  # legend labels wrap (at spaces) past this many characters; never cut
_KELLY = ["#222222", "#F3C300", "#875692", "#F38400", "#A1CAF1", "#BE0032", "#C2B280", "#848482", "#008856",
          "#E68FAC", "#0067A5"]
_STYLES = ["-", "--", "-.", ":"]


def pyplot():
    """matplotlib.pyplot, imported by the first plot: every run.py process imports this module (through the sweep
    report), and those that draw nothing (a sweep's jobs on SLURM, DDP's other ranks, a refused config, --help) are
    spared its import (0.3-0.4 s a process on a CPU)."""
    import matplotlib
    matplotlib.use("Agg")  # headless: jobs and callbacks run without a display
    import matplotlib.pyplot as plt
    return plt


def palette(n: int) -> List:
    """n distinct colours: tab10 first, then Kelly's colours (21 in all, then they repeat)."""
    base = list(pyplot().get_cmap("tab10").colors) + _KELLY
    return [base[i % len(base)] for i in range(n)]


def _wrap(label: str, width: int = _LABEL_WIDTH) -> str:
    return "\n".join(textwrap.wrap(label, width, break_long_words=False, break_on_hyphens=False)) or label


def _chars(inches: float, fontsize: float) -> int:
    """About how many characters of a `fontsize` text fit in `inches` (a wrapped caption's width)."""
    return max(40, int(inches * 72 / (0.55 * fontsize)))


def _caption(ax, note: str, fontsize: float = 8.5) -> None:
    """What every run (or all but a few) shares, said once under the axes instead of in every legend label."""
    if note:
        width = ax.figure.get_figwidth() * ax.get_position().width
        ax.annotate(_wrap(note, _chars(width, fontsize)), (0, 0), xycoords="axes fraction", xytext=(0, -32),
                    textcoords="offset points", va="top", ha="left", fontsize=fontsize, color="0.25")


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # tight: a legend outside the axes is kept whole
    pyplot().close(fig)
    return path


def _finite(pts):
    return [(s, v) for s, v in pts if v is not None and math.isfinite(v)]


def _moving_average(pts: List[Tuple[int, float]], n: int) -> List[Tuple[int, float]]:
    """Trailing mean over the last n points (fewer at the start): the step axis is unchanged."""
    out, acc = [], 0.0
    for i, (s, v) in enumerate(pts):
        acc += v
        if i >= n:
            acc -= pts[i - n][1]
        out.append((s, acc / min(i + 1, n)))
    return out


# --------------------------------------------------------------------------------------------------- loss
def _same_curve(a, b, rtol: float = 1e-6) -> bool:
    """Two (step, value) curves equal to rtol (identical runs)."""
    return len(a) == len(b) and all(sa == sb and abs(va - vb) <= rtol * max(1.0, abs(va))
                                    for (sa, va), (sb, vb) in zip(a, b, strict=True))


DASH = 5.0  # points: the dash of a curve drawn on top of another
OVERLAP = 0.01  # of the y range: two curves closer than this everywhere are drawn on top of each other


def _gap(a, b) -> Optional[float]:
    """The largest |a - b| over the steps both curves have (None: fewer than half of a's steps in common)."""
    bv = dict(b)
    common = [(v, bv[s]) for s, v in a if s in bv]
    if len(common) < max(2, len(a) // 2):
        return None
    return max(abs(x - y) for x, y in common)


def _y_range(values: List[float]) -> Tuple[float, float]:
    """The loss axis' range: the lowest value to the 99.5th percentile (a spike to 1e3 would flatten the rest)."""
    if not values:
        return 0.0, 1.0
    values = sorted(values)
    return values[0], values[min(len(values) - 1, int(0.995 * len(values)))]


_LEGEND_FS = 8.0  # points: the loss legend's labels


def _legend_height(labels: Sequence[str], fontsize: float = _LEGEND_FS) -> float:
    """Inches a one-column legend of these (wrapped) labels takes: 1.2 lines per text line, 0.5 between entries."""
    lines = sum(lab.count("\n") + 1 for lab in labels)
    return (1.2 * lines + 0.5 * len(labels)) * fontsize / 72 + 0.3


def loss_curves(runs: Sequence[Tuple[str, History]], path: Path,
                divergence: Optional[Dict[str, Optional[int]]] = None, window: Optional[int] = None,
                note: str = "") -> Optional[Path]:
    """Train loss of every run on a linear axis from `window` (the fork step; None: the whole run, the y range
    set by the last 90% of it so step 0's loss does not squeeze the rest). An X marks each divergence step, at the
    run's last finite loss when the loss itself went NaN there. Every run its own colour (21 distinct, the
    line style changes every 10 runs); the figure is as tall as its legend, so the legend never outgrows the
    axes. note: what the runs share (orchestrator/report/rows.py shared_overrides), said once under the axes."""
    runs = [(label, h) for label, h in runs if _finite(h.get("train/loss", []))]
    if not runs:
        return None
    many = len(runs) > MANY
    fig, ax = pyplot().subplots(figsize=(9.5 if many else 7.0, 5.0))
    colors = palette(len(runs))
    seen: List[float] = []
    x_end = max(s for _, h in runs for s, _ in _finite(h["train/loss"]))
    x0 = window if window is not None else 0
    y_from = x0 if window is not None else x0 + 0.1 * (x_end - x0)
    curves = [_moving_average(_finite(h["train/loss"]), SMOOTH) if many else _finite(h["train/loss"])
              for _, h in runs]
    lo, hi = _y_range([v for pts in curves for s, v in pts if s >= y_from])
    # a curve on top of an earlier one (the same, or closer than a few pixels): grouped with it; the group's first
    # curve is drawn solid, each later one in dashes that leave the others' turns free, its markers offset from
    # theirs, and said in the legend, so that every run shows
    over: List[Optional[Tuple[int, str]]] = []
    for i, pts in enumerate(curves):
        hit = next(((j, "same") for j in range(i) if over[j] is None and _same_curve(pts, curves[j])), None)
        hit = hit or next(((j, f"{g:.2g}") for j in range(i) if over[j] is None and (g := _gap(pts, curves[j]))
                           is not None and g <= OVERLAP * (hi - lo)), None)
        over.append(hit)
    size = {j: 1 + sum(1 for o in over if o and o[0] == j) for j in range(len(curves))}
    for i, ((label, _), pts) in enumerate(zip(runs, curves)):
        d = (divergence or {}).get(label)
        color, style = colors[i], _STYLES[(i // 10) % len(_STYLES)]
        extra, said = {}, ""
        if over[i]:
            j, how = over[i]
            n = size[j]
            k = 1 + sum(1 for o in over[:i] if o and o[0] == j)  # its place in the group (the first one: 0)
            extra = dict(ls=((n - k) * DASH % (n * DASH), (DASH, (n - 1) * DASH)), marker="o^sv"[k % 4], ms=4,
                         markevery=(k % 4, 4) if len(pts) > 8 else None)
            said = (f"  (the same curve as {runs[j][0]})" if how == "same" else
                    f"  (within {how} of {runs[j][0]}: on top of it)")
        ax.plot([s for s, _ in pts], [v for _, v in pts], lw=1.4, **{"ls": style, **extra}, color=color,
                label=_wrap(label + (f"  (diverged at {d})" if d is not None else "") + said))
        seen += [v for s, v in pts if s >= y_from]
        if d is not None:
            before = [p for p in pts if p[0] <= d] or pts[:1]
            ax.plot([before[-1][0]], [before[-1][1]], "X", color=color, ms=9, mec="black", mew=0.8, zorder=5)
    if window is not None:
        ax.axvline(window, color="0.4", lw=0.8, ls=":")
        ax.text(window, 1.0, f" fork: step {window}", transform=ax.get_xaxis_transform(), va="bottom", fontsize=8)
    ax.set_xlim(x0, x_end)
    if seen:
        pad = 0.04 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss" + (f" (moving average of {SMOOTH} steps)" if many else ""))
    ax.set_title("Training loss" + (" after the fork" if window is not None else "") + "; X: divergence step")
    ax.grid(alpha=0.3)
    legend = ax.legend(fontsize=_LEGEND_FS, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    # the axes (77% of the figure's height) at least as tall as the legend beside them
    fig.set_figheight(min(max(5.0, _legend_height([t.get_text() for t in legend.get_texts()]) / 0.77), 16.0))
    _caption(ax, note)
    return _save(fig, path)


# --------------------------------------------------------------------------------------------- per head
def _per_head(h: History, prefix: str) -> Dict[Tuple[int, int], List[Tuple[int, float]]]:
    out = {}
    for key, pts in h.items():
        if key.startswith(prefix):
            m = _HEAD.search(key)
            pts = _finite(pts)
            if m and pts:
                out[(int(m.group(1)), int(m.group(2)))] = sorted(pts)
    return out


def _per_head_runs(runs: Sequence[Tuple[str, History]], prefix: str):
    """(label, {(layer, head): points}) for the runs that logged `prefix` metrics."""
    out = [(label, _per_head(h, prefix)) for label, h in runs]
    return [(label, heads) for label, heads in out if heads]


def _panels(n: int, sharey: bool = True):
    """Up to 4 panels a row; one run: one wide panel. Constrained layout: the titles and the layer legend below
    get their room without shrinking the panels to a strip."""
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    size = (7.0, 4.4) if n == 1 else (4.2 * cols, 3.1 * rows)
    fig, axes = pyplot().subplots(rows, cols, figsize=size, squeeze=False, sharey=sharey, layout="constrained")
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _layer_legend(fig, axes, layers: List[int], colors, what: str, where: str = "lower") -> None:
    """One row of layer colours (12 a row) under the panels (where="upper": over them, under the title): as wide
    as the figure allows, a line or two tall."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=colors[i], lw=2) for i in range(len(layers))]
    fig.legend(handles, [f"L{layer}" for layer in layers], title=what, loc=f"outside {where} center",
               ncol=min(len(layers), 12), fontsize=8.5, title_fontsize=9, frameon=False, handlelength=1.6,
               columnspacing=1.0)


def _suptitle(fig, title: str, note: str) -> None:
    """The figure's title and, under it, what the runs share (said once, not in every panel's title)."""
    width = _chars(fig.get_figwidth(), 9.5)
    fig.suptitle(title + ("\n" + _wrap(note, width) if note else ""), fontsize=10)


def wq_spectral_norms(runs: Sequence[Tuple[str, History]], path: Path, window: Optional[int] = None,
                      annotate: int = 3, named: Sequence[Tuple[int, int]] = (), note: str = "") -> Optional[Path]:
    """One panel per run: sigma_max(W_Q) of each layer's top head (largest peak), thin, and of every head in
    `named` (the heads the verdicts name, e.g. each run's peak_wq_where), bold and labelled in every panel, so a
    head a verdict names is read beside the same head of the other runs; the `annotate` largest other heads are
    named at their peak. Same y axis in every panel."""
    runs = _per_head_runs(runs, "wq_sigma/")
    if not runs:
        return None
    named = sorted(set(named))
    layers = sorted({layer for _, heads in runs for layer, _ in heads})
    colors = palette(len(layers))
    fig, axes = _panels(len(runs))
    for ax, (label, heads) in zip(axes, runs):
        tops = {}
        for (layer, head), pts in heads.items():
            if layer not in tops or max(v for _, v in pts) > max(v for _, v in heads[(layer, tops[layer])]):
                tops[layer] = head
        cut = lambda pts: [(s, v) for s, v in pts if window is None or s >= window]  # noqa: E731
        for layer, head in sorted(tops.items()):
            if (layer, head) not in named:
                pts = cut(heads[(layer, head)])
                ax.plot([s for s, _ in pts], [v for _, v in pts], color=colors[layers.index(layer)], lw=1.0,
                        alpha=0.75)
        for k, (layer, head) in enumerate(named):
            pts = cut(heads.get((layer, head), []))
            if not pts or layer not in layers:
                continue
            ax.plot([s for s, _ in pts], [v for _, v in pts], color=colors[layers.index(layer)], lw=2.4,
                    ls=_STYLES[k % len(_STYLES)])
            ax.annotate(f"L{layer}.H{head}", pts[-1], fontsize=7.5, fontweight="bold", xytext=(2, 0),
                        textcoords="offset points", color=colors[layers.index(layer)])
        ranked = sorted((lh for lh in tops.items() if lh not in named),
                        key=lambda lh: -max(v for _, v in heads[lh]))[:annotate]
        for layer, head in ranked:
            s, v = max(heads[(layer, head)], key=lambda p: p[1])
            ax.annotate(f"L{layer}.H{head}", (s, v), fontsize=7, xytext=(2, 2), textcoords="offset points",
                        color=colors[layers.index(layer)])
        ax.set_title(_wrap(label), fontsize=9)
    what = ("bold: " + ", ".join(f"L{lh[0]}.H{lh[1]}" for lh in named) + " (the verdicts' heads); thin: each "
            "layer's top head") if named else "the top head of each layer"
    return _finish_layer_panels(fig, axes, len(runs), layers, colors, path, ylabel="σ_max(W_Q)",
                                legend="layer (its top head)", title=f"W_Q spectral norm: {what}", note=note)


def _finish_layer_panels(fig, axes, n_runs: int, layers, colors, path: Path, ylabel: str, legend: str,
                         title: str, note: str = "") -> Path:
    """The per-run panels of a per-layer plot: step axis and grid, y label on each row's first panel, one layer
    legend under them, the title and the runs' shared overrides over them, saved."""
    for ax in axes:
        ax.set_xlabel("step", fontsize=8.5)
        ax.grid(alpha=0.3)
    for ax in axes[::min(n_runs, 4)]:
        ax.set_ylabel(ylabel)
    _layer_legend(fig, axes, layers, colors, legend)
    _suptitle(fig, title, note)
    return _save(fig, path)


def repeated_maxima(runs: Sequence[Tuple[str, History]], path: Path, window: Optional[int] = None,
                    note: str = "") -> Optional[Path]:
    """One panel per run: rows with repeated maxima per logging interval, summed over each layer's heads
    (colour = layer, the same in every panel); the busiest head is named in the title. Same y axis."""
    runs = _per_head_runs(runs, "rmax_rows/")
    if not runs:
        return None
    layers = sorted({layer for _, heads in runs for layer, _ in heads})
    colors = palette(len(layers))
    fig, axes = _panels(len(runs))
    for ax, (label, heads) in zip(axes, runs):
        per_layer: Dict[int, Dict[int, float]] = {}
        for (layer, _), pts in heads.items():
            acc = per_layer.setdefault(layer, {})
            for s, v in pts:
                if window is None or s >= window:
                    acc[s] = acc.get(s, 0.0) + v
        for layer in sorted(per_layer):
            steps = sorted(per_layer[layer])
            ax.plot(steps, [per_layer[layer][s] for s in steps], lw=1.0, color=colors[layers.index(layer)])
        top = max(heads, key=lambda k: sum(v for _, v in heads[k]))
        ax.set_title(_wrap(label + f"; busiest head L{top[0]}.H{top[1]}"), fontsize=9)
    return _finish_layer_panels(fig, axes, len(runs), layers, colors, path, ylabel="rows with repeated maxima",
                                legend="layer (sum of its heads)", title="Repeated-maxima rows per layer",
                                note=note)


# ------------------------------------------------------------------------------------------------ probes
_PROBE_PANELS = (("delta_err_mean", "mean delta error\n(delta_recipe - delta_FP64)", "delta error per row"),
                 ("delta_err_cumsum", "cumulative sum over probes\n(Fig. 5a: a monotone rise = a bias)",
                  "sum of per-probe means"),
                 ("tie_share_signed", "share of the delta error from P̄ = 1 tie rows\n(solid: signed, dashed: |e|)",
                  "share (1 = all)"),
                 ("wq_err_cos", "cosine of successive W_Q gradient errors\n(claim 2: ~1 = one direction)",
                  "cosine"))


def probes(runs: Sequence[Tuple[str, History]], path: Path, note: str = "") -> Optional[Path]:
    """One row of four panels per run that logged probes (orchestrator/monitor/probes/), colour = layer, x = training
    step: the mean delta error, its cumulative sum, the tie share (signed and absolute) and the W_Q gradient-error
    coherence. Runs without probe metrics are left out; None when no run has any."""

    def per_layer(h: History, kind: str) -> Dict[int, List[Tuple[int, float]]]:
        out = {}
        for key, pts in h.items():
            parsed = record.parse_probe_metric(key)
            if parsed and parsed[0] == kind and parsed[2] is None and _finite(pts):
                out[parsed[1]] = sorted(_finite(pts))
        return out

    rows = [(label, h) for label, h in runs if per_layer(h, "delta_err_mean") or per_layer(h, "wq_err_cos")]
    if not rows:
        return None
    layers = sorted({layer for _, h in rows for kind, _, _ in _PROBE_PANELS for layer in per_layer(h, kind)})
    colors = palette(len(layers))
    fig, axes = pyplot().subplots(len(rows), 4, figsize=(17, 3.3 * len(rows)), squeeze=False, layout="constrained")
    for r, (label, h) in enumerate(rows):
        for c, (kind, title, ylabel) in enumerate(_PROBE_PANELS):
            ax = axes[r][c]
            for layer, pts in per_layer(h, kind).items():
                ax.plot([s for s, _ in pts], [v for _, v in pts], "-", lw=1.2, color=colors[layers.index(layer)])
            if kind == "tie_share_signed":
                for layer, pts in per_layer(h, "tie_share_abs").items():
                    ax.plot([s for s, _ in pts], [v for _, v in pts], "--", lw=1.0,
                            color=colors[layers.index(layer)])
                # the signed share is a ratio of sums that can be ~0: a probe where sum(e) ~ 0 reads +-1000 and
                # would hide the rest, so the axis shows [-1.5, 1.5] and says how many points lie outside
                out = sum(1 for pts in per_layer(h, kind).values() for _, v in pts if abs(v) > 1.5)
                ax.set_ylim(-1.5, 1.5)
                if out:
                    ax.text(0.01, 0.02, f"{out} signed point(s) outside [-1.5, 1.5]", transform=ax.transAxes,
                            fontsize=7, color="0.3")
            if kind in ("delta_err_mean", "delta_err_cumsum"):
                ax.axhline(0.0, color="0.5", lw=0.8)
            ax.set_title((_wrap(label) + "\n" if c == 0 else "") + title, fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(alpha=0.3)
    _layer_legend(fig, list(axes.flat), layers, colors, "layer", "upper")  # a row a run: seen before the rows
    _suptitle(fig, "Mechanism probes on the fixed probe batch", note)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------------ delays
def delays(items: Sequence[Tuple[str, str, Optional[int], Optional[int], Optional[int]]], path: Path,
           note: str = "") -> Optional[Path]:
    """Horizontal bars, one per run: (label, observed, divergence step, last step, its baseline's divergence
    step). Diverged: divergence step minus the baseline's (red: earlier, orange: later). Stable: a hatched green
    bar to its last step, "no divergence by step N". None when no run has a diverged baseline to compare with, or
    when no run diverged besides the baselines (then the table alone says which runs stayed stable)."""
    items = [it for it in items if it[4] is not None and it[1] in ("diverged", "stable")]
    if not any(it[1] == "diverged" for it in items):
        return None
    fig, ax = pyplot().subplots(figsize=(8.0, 0.42 * len(items) + 1.6))
    labels = []
    widest = max(abs((last if last is not None else bd) - bd) if obs != "diverged" or d is None else abs(d - bd)
                 for _, obs, d, last, bd in items) or 1
    for y, (label, obs, d, last, bd) in enumerate(items):
        if obs == "diverged" and d is not None:
            delta = d - bd
            ax.barh(y, delta, color="#BE0032" if delta < 0 else "#F38400")
            ax.text(delta, y, f" {delta:+d} (step {d})", va="center", ha="left" if delta >= 0 else "right",
                    fontsize=7.5)
        else:
            span = (last if last is not None else bd) - bd
            ax.barh(y, span, color="#008856", alpha=0.35, hatch="//", edgecolor="#008856")
            inside = span >= 0.5 * widest  # a long bar holds its words (they ran past the axes' right edge)
            ax.text(span, y, f" stable: no divergence by step {last} ", va="center", ha="right" if inside else "left",
                    fontsize=7.5, bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1) if inside else None)
        labels.append(_wrap(label))
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("divergence step − the baseline's (steps)")
    ax.set_title("Which intervention fixed it (green) and which only delayed (orange) or hastened (red) it",
                 fontsize=10.5)
    ax.grid(alpha=0.3, axis="x")
    ax.margins(x=0.25)
    _caption(ax, note)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------ localization
def localization(loc, history: History, path: Path) -> Path:
    """orchestrator/analysis/localize/'s result. Left: W_Q sigma per head over time for the chosen layer (the one that
    stands out, else the best guess), window shaded, its target heads solid; without histories (a localize.json
    alone) each head's sigma at the window's start and end. Right: the layer ranking, the chosen bar in red
    (stands out) or hatched orange (best guess)."""
    from matplotlib.patches import Patch

    layer, target_heads, _ = loc.target()
    stands_out = loc.layer is not None
    wq = _per_head(history or {}, "wq_sigma/")
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(13, 4.6))
    heads = sorted(h for (l_, h) in wq if l_ == layer)
    colors = palette(max(len(heads), 1))
    for i, h in enumerate(heads):
        pts = wq[(layer, h)]
        on = h in target_heads
        a.plot([s for s, _ in pts], [v for _, v in pts], "-" if on else ":", color=colors[i], lw=1.8 if on else 1.0,
               label=f"H{h}" + (" (target)" if on else ""))
    if heads:
        if loc.start is not None:
            a.axvspan(loc.start, loc.end, color="0.88", zorder=0, label="window")
        if loc.divergence_step is not None:
            a.axvline(loc.divergence_step, color="#BE0032", lw=0.9, ls="--", label="divergence")
        a.set_xlabel("step")
        a.set_ylabel("σ_max(W_Q) per head")
    else:
        hs = sorted((h for h in loc.heads if h.layer == layer and h.sigma_end is not None), key=lambda h: h.head)
        xs = [h.head for h in hs]
        a.bar([x - 0.2 for x in xs], [h.sigma_start or 0.0 for h in hs], 0.4, color="0.7",
              label=f"step {loc.start} (window start)")
        a.bar([x + 0.2 for x in xs], [h.sigma_end for h in hs], 0.4,
              color=["#BE0032" if h.head in target_heads else "#0067A5" for h in hs],
              label=f"step {loc.end} (window end; red: target heads)")
        a.set_xticks(xs)
        a.set_xlabel("head (0-based)")
        a.set_ylabel("σ_max(W_Q)")
    a.set_title(f"W_Q spectral norm, layer {layer}" + ("" if stands_out else " (best guess)"), fontsize=10)
    a.grid(alpha=0.3)
    entries = len(a.get_legend_handles_labels()[0])
    if entries:  # two rows under the axes (was 2 columns: a list as tall as the axes)
        a.legend(fontsize=8, ncol=max(2, math.ceil(entries / 2)), loc="upper left", bbox_to_anchor=(0.0, -0.14),
                 frameon=False, handlelength=1.6, columnspacing=1.0)

    ls = sorted(loc.layers, key=lambda L: L.layer)
    xs = [L.layer for L in ls]
    use_growth = any(L.growth is not None for L in ls)
    vals = [((L.growth or 1.0) - 1.0) if use_growth else (L.rmax_total or 0.0) for L in ls]
    chosen = (dict(facecolor="#BE0032", edgecolor="black") if stands_out
              else dict(facecolor="#F38400", hatch="//", edgecolor="black"))
    bars = b.bar(xs, vals, color="#0067A5")
    for bar, L in zip(bars, ls):
        if L.layer == layer:
            bar.set(**chosen, linewidth=1.2)
    b.set_ylabel("W_Q growth in the window\n(top head, end/start − 1)" if use_growth  # 2 lines: as tall as the axes
                 else "repeated-maxima rows in the window")
    if use_growth and any(L.rmax_total for L in ls):
        b2 = b.twinx()
        b2.plot(xs, [L.rmax_total or 0.0 for L in ls], "ko-", ms=4, lw=0.8)
        b2.set_ylabel("repeated-maxima rows (dots)")
    b.set_xlabel("layer (0-based)")
    b.set_xticks(xs)
    what = "stands out" if stands_out else "best guess: no layer stands out"
    b.legend(handles=[Patch(**chosen, label=f"chosen: L{layer} ({what})"), Patch(color="#0067A5", label="other")],
             fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.14), frameon=False, ncol=2)
    b.set_title(f"Layer ranking, window steps {loc.start}..{loc.end}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


__all__ = ["loss_curves", "wq_spectral_norms", "repeated_maxima", "delays", "localization", "palette"]
