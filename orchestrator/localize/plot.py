"""Localization as a picture: W_Q sigma per head of the chosen layer over time, and the layer ranking."""
from __future__ import annotations

from pathlib import Path

from orchestrator.localize.algorithm import History, parse_history
from orchestrator.localize.stats import Localization


def plot(loc: Localization, history: History, path: Path) -> Path:
    """Left: W_Q sigma per head over time for the chosen (or best-guess) layer, window shaded; right: the ranking."""
    from orchestrator import plots  # noqa: F401  (sets the headless backend)
    import matplotlib.pyplot as plt

    wq, _, _ = parse_history(history)
    layer = loc.layer if loc.layer is not None else (loc.layers[0].layer if loc.layers else None)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4))
    for (l, h), pts in sorted(wq.items()):
        if l != layer or not pts:
            continue
        style = "-" if h in loc.outlier_heads else ":"
        a.plot([s for s, _ in pts], [v for _, v in pts], style, lw=1.6 if h in loc.outlier_heads else 1.0,
               label=f"H{h}" + (" *" if h in loc.outlier_heads else ""))
    if loc.start is not None:
        a.axvspan(loc.start, loc.end, color="0.85", zorder=0, label="window")
    if loc.divergence_step is not None:
        a.axvline(loc.divergence_step, color="r", lw=0.8, ls="--", label="divergence")
    a.set_xlabel("step")
    a.set_ylabel("sigma(W_Q) per head")
    a.set_title(f"W_Q spectral norm, layer {layer}" + ("" if loc.layer is not None else " (no layer stands out)"))
    a.grid(alpha=0.3)
    if a.get_legend_handles_labels()[0]:
        a.legend(fontsize=7, ncol=2)
    ls = sorted(loc.layers, key=lambda L: L.layer)
    xs = [L.layer for L in ls]
    if any(L.growth is not None for L in ls):
        b.bar(xs, [(L.growth or 1.0) - 1.0 for L in ls],
              color=["C3" if L.layer == loc.layer else "C0" for L in ls])
        b.set_ylabel("W_Q growth in the window (max head, end/start - 1)")
    else:
        b.bar(xs, [L.rmax_total or 0.0 for L in ls], color=["C3" if L.layer == loc.layer else "C0" for L in ls])
        b.set_ylabel("repeated-maxima rows in the window")
    if any(L.rmax_total for L in ls) and any(L.growth is not None for L in ls):
        b2 = b.twinx()
        b2.plot(xs, [L.rmax_total or 0.0 for L in ls], "ko-", ms=4, lw=0.8)
        b2.set_ylabel("repeated-maxima rows (dots)")
    b.set_xlabel("layer (0-based)")
    b.set_xticks(xs)
    b.set_title("Layer ranking (red: chosen)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

