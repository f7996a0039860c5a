"""Sweep plots: loss curves overlaid, W_Q spectral norm per head, repeated-maxima counts (PAPER.md Figs. 1-3).

Input everywhere: `runs` = list of (label, history) where history maps a metric name to [(step, value), ...].
Each function returns the PNG path it wrote, or None when no run has the metric.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")  # headless: jobs and callbacks run without a display
import matplotlib.pyplot as plt  # noqa: E402

History = Dict[str, List[Tuple[int, float]]]
_HEAD = re.compile(r"L(\d+)\.H(\d+)$")


def _grid(n: int):
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loss_curves(runs: Sequence[Tuple[str, History]], path: Path,
                divergence: Optional[Dict[str, Optional[int]]] = None) -> Optional[Path]:
    """Train loss of every run on one log-y axis; a dot marks each run's divergence step."""
    runs = [(label, h) for label, h in runs if h.get("train/loss")]
    if not runs:
        return None
    many = len(runs) > 6  # a tangle of noisy per-step curves otherwise: smooth, distinct colours, legend outside
    fig, ax = plt.subplots(figsize=(11, 5.4) if many else (8, 4.8))
    colors = plt.get_cmap("tab20").colors
    for i, (label, h) in enumerate(runs):
        pts = [(s, v) for s, v in h["train/loss"] if math.isfinite(v) and v > 0]
        if not pts:
            continue
        if many:
            pts = _moving_average(pts, SMOOTH)
        d = (divergence or {}).get(label)
        line, = ax.plot([s for s, _ in pts], [v for _, v in pts], lw=1.3, label=label,
                        color=colors[i % len(colors)], ls="--" if many and d is not None else "-")
        if d is not None:
            near = min(pts, key=lambda p: abs(p[0] - d))
            ax.plot([near[0]], [near[1]], "o", color=line.get_color(), ms=6)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (log)")
    ax.set_title("Training loss (dot: divergence step)" + (f"; moving average of {SMOOTH} steps, dashed: diverged"
                                                           if many else ""))
    ax.grid(alpha=0.3, which="both")
    if many:
        ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8)
    return _save(fig, Path(path))


SMOOTH = 25  # steps in the loss plot's moving average when it overlays many runs


def _moving_average(pts: List[Tuple[int, float]], n: int) -> List[Tuple[int, float]]:
    """Trailing mean over the last n points (fewer at the start): the step axis is unchanged."""
    out, acc = [], 0.0
    for i, (s, v) in enumerate(pts):
        acc += v
        if i >= n:
            acc -= pts[i - n][1]
        out.append((s, acc / min(i + 1, n)))
    return out


def _per_head(h: History, prefix: str) -> Dict[Tuple[int, int], List[Tuple[int, float]]]:
    out = {}
    for key, pts in h.items():
        if key.startswith(prefix):
            m = _HEAD.search(key)
            if m and pts:
                out[(int(m.group(1)), int(m.group(2)))] = sorted(pts)
    return out


def _per_head_runs(runs: Sequence[Tuple[str, History]], prefix: str):
    """(label, {(layer, head): points}) for the runs that logged `prefix` metrics."""
    out = [(label, _per_head(h, prefix)) for label, h in runs]
    return [(label, heads) for label, heads in out if heads]


def wq_spectral_norms(runs: Sequence[Tuple[str, History]], path: Path) -> Optional[Path]:
    """One panel per run: sigma_max(W_Q) of every (layer, head); the head with the largest peak is highlighted."""
    runs = _per_head_runs(runs, "wq_sigma/")
    if not runs:
        return None
    fig, axes = _grid(len(runs))
    for ax, (label, heads) in zip(axes, runs):
        top = max(heads, key=lambda k: max(v for _, v in heads[k]))
        for key, pts in heads.items():
            if key != top:
                ax.plot([s for s, _ in pts], [v for _, v in pts], color="0.75", lw=0.7)
        pts = heads[top]
        ax.plot([s for s, _ in pts], [v for _, v in pts], color="C3", lw=1.8, label=f"L{top[0]}.H{top[1]} (max)")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("σ_max(W_Q)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, Path(path))


def repeated_maxima(runs: Sequence[Tuple[str, History]], path: Path) -> Optional[Path]:
    """One panel per run: rows with repeated maxima per logging interval, summed over heads per layer;
    the busiest head is drawn dashed."""
    runs = _per_head_runs(runs, "rmax_rows/")
    if not runs:
        return None
    fig, axes = _grid(len(runs))
    for ax, (label, heads) in zip(axes, runs):
        layers: Dict[int, Dict[int, float]] = {}
        for (layer, _), pts in heads.items():
            acc = layers.setdefault(layer, {})
            for s, v in pts:
                acc[s] = acc.get(s, 0.0) + v
        for layer in sorted(layers):
            steps = sorted(layers[layer])
            ax.plot(steps, [layers[layer][s] for s in steps], lw=1.0, label=f"L{layer}")
        top = max(heads, key=lambda k: sum(v for _, v in heads[k]))
        pts = heads[top]
        ax.plot([s for s, _ in pts], [v for _, v in pts], "k--", lw=1.0, label=f"L{top[0]}.H{top[1]} (busiest)")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("rows with repeated maxima")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    return _save(fig, Path(path))


__all__ = ["loss_curves", "wq_spectral_norms", "repeated_maxima"]
