"""Redraw the plots a committed report can give without its MLflow store: the delay chart from verdicts.json and
the localization plot from localize.json (the per-head curves need the store's histories; without them the left
panel shows each head's W_Q sigma at the window's start and end).

    python scripts/replot_from_json.py OUT_DIR [--verdicts results/paper_isolation/verdicts.json]
                                               [--localize results/paper_isolation/localize.json]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flash_forensics.orchestrator.report import plots  # noqa: E402
from flash_forensics.orchestrator.report.render import make_plots  # noqa: E402


def localization_from_json(d):
    from flash_forensics.orchestrator.analysis.localize import HeadStats, LayerStats, Localization
    keep = {k: d[k] for k in ("start", "end", "divergence_step", "layer", "outlier_heads", "reason", "head_reason",
                              "config", "source") if k in d}
    return Localization(layers=[LayerStats(**x) for x in d.get("layers", [])],
                        heads=[HeadStats(**x) for x in d.get("heads", [])], **keep)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--verdicts", type=Path)
    ap.add_argument("--localize", type=Path)
    a = ap.parse_args(argv)
    if a.verdicts:
        rows = json.loads(a.verdicts.read_text())["runs"]
        for _name, p in make_plots(rows, {}, a.out).items():
            print(f"wrote {p}")
    if a.localize:
        loc = localization_from_json(json.loads(a.localize.read_text()))
        print(f"wrote {plots.localization(loc, {}, a.out / 'localize.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
