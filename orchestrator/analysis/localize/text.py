"""Localization as text: the ranked layers, the chosen layer's heads, the reason and the Hydra overrides."""
from __future__ import annotations

import math
from typing import List

from flash_forensics.orchestrator.analysis.localize.stats import Localization, scoped_interventions


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
            layer_only, with_heads = scoped_interventions()
            out += [f"  ({', '.join(with_heads)}: no outlier heads; list heads yourself or use "
                    f"{' / '.join(layer_only)})"]
    return "\n".join(out)

