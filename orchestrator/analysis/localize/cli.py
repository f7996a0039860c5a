"""`flash-forensics localize SOURCE [--out loc.json] [--plot] [--sweep-overrides]`: the report on the terminal,
the localization as JSON and a PNG (usage: orchestrator/analysis/localize/algorithm.py).
`flash-forensics localize rounding REPORT_DIR ...`: the rounding-point stage (localize/rounding_io.py).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from flash_forensics.kernels.checks import file_in_the_way
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.analysis.localize import algorithm, rounding_io
from flash_forensics.orchestrator.analysis.localize.algorithm import localize
from flash_forensics.orchestrator.analysis.localize.plot import plot
from flash_forensics.orchestrator.analysis.localize.source import load_history, resolve_source
from flash_forensics.orchestrator.analysis.localize.stats import LocalizeConfig
from flash_forensics.orchestrator.analysis.localize.text import format_localization

PLOT_SUFFIXES = (".png", ".pdf", ".svg")  # what --plot writes (matplotlib takes its format from the suffix)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rounding"]:
        return rounding_io.main(argv[1:])
    d = LocalizeConfig()
    p = argparse.ArgumentParser(prog="flash-forensics localize", description=algorithm.__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a baseline job dir (result.json), a sweep dir, or an MLflow run id")
    p.add_argument("--tracking-uri", help="MLflow store (default: the job's own, else results/mlflow.db)")
    p.add_argument("--job", help="in a sweep dir: the job folder to read (default: the baseline)")
    p.add_argument("--divergence-step", type=int, help="end of the window (default: from result.json / run tag)")
    p.add_argument("--window", type=int, help="window length in steps before the end (default: --samples)")
    p.add_argument("--samples", type=int, default=d.samples,
                   help="W_Q samples in the default window (default: %(default)s)")
    p.add_argument("--rate-threshold", type=float, help="fixed growth rate (ln sigma per step) for 'first fast'")
    p.add_argument("--margin", type=float, default=d.margin,
                   help="factor by which the layer must stand out (default: %(default)s)")
    p.add_argument("--tie-tol", type=float, default=d.tie_tol,
                   help="relative W_Q growth within which layers tie (default: %(default)s)")
    p.add_argument("--min-growth", type=float, default=d.min_growth,
                   help="W_Q growth below which data is flat (default: %(default)s)")
    p.add_argument("--head-metric", choices=("sigma_end", "growth"), default=d.head_metric,
                   help="what ranks the heads: W_Q sigma at the window's end, or its growth (default: %(default)s)")
    p.add_argument("--k-head", type=float, default=d.k_head,
                   help="robust SDs that make a head an outlier (default: %(default)s)")
    p.add_argument("--out", type=Path, help="write the localization as JSON here")
    p.add_argument("--plot", type=Path, nargs="?", const=True,
                   help="write a PNG (default: beside --out, else localize.png)")
    p.add_argument("--sweep-overrides", action="store_true",
                   help="print only the overrides that point an isolation sweep at the target layer/heads on stdout "
                        "(the report goes to stderr), for scripts")
    a = p.parse_args(argv)
    if a.divergence_step is not None and a.divergence_step < 1:
        p.error(f"--divergence-step={a.divergence_step} is not allowed: expected a step >= 1 (the window ends there)")
    if a.rate_threshold is not None and not (math.isfinite(a.rate_threshold) and a.rate_threshold > 0):
        p.error(f"--rate-threshold={a.rate_threshold} is not allowed: expected a finite number > 0 (ln sigma per step)")
    # the output paths before any work: a folder as --out failed after the report (IsADirectoryError), and a folder
    # or a bare name as --plot was written by matplotlib as <name>.png while "wrote <name>" was printed
    png = (a.plot if a.plot is not True else (a.out.with_suffix(".png") if a.out else Path("localize.png"))) \
        if a.plot else None
    for flag, path, ok in (("--out", a.out, None), ("--plot", png, PLOT_SUFFIXES)):
        if path is None:
            continue
        under = file_in_the_way(path)
        if path.is_dir() or under is not None or (ok and path.suffix.lower() not in ok):
            why = ("it is a folder" if path.is_dir() else f"{under} is a file" if under is not None
                   else f"its suffix is {path.suffix!r}")
            p.error(f"{flag}={str(path)!r} is not allowed: {why}; expected a file path"
                    + (f" ending in {', '.join(ok)}" if ok else " (the localization as JSON)"))
    try:
        LocalizeConfig(window=a.window, samples=a.samples, rate_threshold=a.rate_threshold, margin=a.margin,
                       tie_tol=a.tie_tol, min_growth=a.min_growth, head_metric=a.head_metric,
                       k_head=a.k_head).validate()  # the flags first, before any store is read
        src = resolve_source(a.source, a.tracking_uri, a.job)
        history = load_history(src["run_id"], src["tracking_uri"])
        last = max((s for pts in history.values() for s, _ in pts), default=None)
        if a.divergence_step is not None and last is not None and a.divergence_step > last + 1:
            raise ValueError(f"--divergence-step={a.divergence_step} is not allowed: the run's metrics end at step "
                             f"{last}; expected a step <= {last + 1}")
        div = a.divergence_step if a.divergence_step is not None else src["divergence_step"]
        loc = localize(history, window=a.window, divergence_step=div, samples=a.samples,
                       rate_threshold=a.rate_threshold, margin=a.margin, tie_tol=a.tie_tol,
                       min_growth=a.min_growth, head_metric=a.head_metric, k_head=a.k_head)
    except (ValueError, OSError) as e:  # LocalizeConfig names its fields localize.<field>: the flags here
        msg = re.sub(r"localize[.](\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))
        print(f"localize: {msg}", file=sys.stderr)
        return 2
    loc.source = src
    if not any(h.sigma_end is not None or h.rmax_total for h in loc.heads):
        print(f"localize: nothing measured in the window (steps {loc.start}..{loc.end}): "
              f"{loc.reason or 'no wq_sigma/ or rmax_rows/ sample falls in it'}; no layer or heads to point a sweep at",
              file=sys.stderr)
        return 2
    say = (lambda *m: print(*m, file=sys.stderr)) if a.sweep_overrides else print
    say(f"run {src['run_id']}" + (f" ({src['intervention']})" if src.get("intervention") else "")
        + (f", job {src['job_dir']}" if src.get("job_dir") else ""))
    say(format_localization(loc))
    layer, heads, why = loc.target()
    say(f"\nsweep target: layer {layer}, heads {heads} ({why})")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(record.dumps(loc.to_dict()))
        say(f"\nwrote {a.out}")
    if png:
        say(f"wrote {plot(loc, history, png)}")
    if a.sweep_overrides:
        print(" ".join(loc.sweep_overrides()))
    return 0
