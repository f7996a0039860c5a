"""Localization as pictures: per-head W_Q of the chosen layer and the layer ranking with the chosen bar
highlighted (drawn by orchestrator/report/plots.py: localization, beside the report's other plots); the rounding stage's
outcome grid (one row per rounding point, lift vs BF16-only)."""
from __future__ import annotations

from pathlib import Path

from flash_forensics.orchestrator.analysis.localize.algorithm import History
from flash_forensics.orchestrator.analysis.localize.stats import Localization
from flash_forensics.orchestrator.report.plots import _save, localization, pyplot

# outcome -> colour: green fixes it, dark red reproduces, red hastens (as in the delay chart), orange delays, grey
# says nothing; no two outcomes share one (reproduces and hastens did: two identical swatches in the legend)
_COLOURS = {"prevents": "#008856", "reproduces": "#6B0F1A", "delays": "#F38400", "hastens": "#BE0032",
            "no effect": "#A1CAF1", "inconclusive": "#C2B280", "mixed": "#B3A2C7", "failed": "#848482",
            "not run": "#EEEEEE"}


def plot(loc: Localization, history: History, path: Path) -> Path:
    return localization(loc, history, path)


def rounding(result, path: Path) -> Path:
    """rounding.RoundingResult as a grid: a row per point, the lift and the BF16-only fork side by side, each cell
    coloured by its outcome and labelled with the divergence step or 'stable'; the verdict underneath."""
    import textwrap

    from matplotlib.patches import Patch, Rectangle

    plt = pyplot()  # headless (Agg), as every report plot

    rows = result.rows()
    sides = [(p.lift, p.bf16_only) for p in result.points]
    fig, ax = plt.subplots(figsize=(10.5, 0.42 * max(len(rows), 1) + 2.4))
    for y, ((_point, a, b), pair) in enumerate(zip(rows, sides)):
        for x, (text, side) in enumerate(zip((a, b), pair)):
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=_COLOURS.get(side.outcome, "white"), edgecolor="white",
                                   lw=2, alpha=0.85))
            dark = side.outcome in ("prevents", "reproduces", "hastens", "failed")
            ax.text(x + 0.5, y + 0.5, textwrap.shorten(text, 60, placeholder="..."), ha="center", va="center",
                    fontsize=7.5, color="white" if dark else "black")
    ax.set_xlim(0, 2)
    ax.set_ylim(max(len(rows), 1), 0)
    ax.set_xticks([0.5, 1.5])
    ax.set_xticklabels(["lift to FP32 alone (vs the BF16 baseline)", "BF16 alone, rest FP32 (vs the fp32 run)"],
                       fontsize=8.5)
    ax.xaxis.tick_top()
    ax.set_yticks([y + 0.5 for y in range(len(rows))])
    ax.set_yticklabels([r[0] for r in rows], fontsize=8.5, family="monospace")
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    bd = sorted({r.get("divergence_step") for r in result.baseline.get("runs", [])
                 if r.get("observed") == "diverged"})
    ax.set_title("Rounding points: which one the divergence needs in BF16"
                 + (f" (baseline diverged at step {', '.join(map(str, bd))})" if bd else " (no diverged baseline)"),
                 fontsize=10, pad=24)
    used = [o for o in _COLOURS if any(o in (s.outcome for s in pair) for pair in sides)]
    ax.legend(handles=[Patch(color=_COLOURS[o], label=o) for o in used], fontsize=7.5, ncol=min(len(used), 5) or 1,
              loc="upper left", bbox_to_anchor=(0.0, -0.02), frameon=False)
    fig.text(0.02, -0.02, "\n".join(textwrap.wrap("Cause: " + result.verdict(), 150)), fontsize=8, va="top")
    return _save(fig, path)
