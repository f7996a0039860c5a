"""`flash-forensics TOOL [ARGS]`: one command for the project's tools (each is also `python -m <module>`).

A tool is a module with `main(argv) -> int`; it is imported only when named, so `flash-forensics --help` stays fast.
`python run.py` stays the Hydra entry point for training and sweeps.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Dict, Optional, Sequence, Tuple

# tool -> (module, what it does)
TOOLS: Dict[str, Tuple[str, str]] = {
    "isolate": ("flash_forensics.orchestrator.analysis.isolate",
                "the paper's isolation method end to end: baseline, localization, forks, table"),
    "localize": ("flash_forensics.orchestrator.analysis.localize.cli",
                 "which layer and heads of a baseline to intervene on (`localize rounding DIR`: the rounding point)"),
    "report": ("flash_forensics.orchestrator.report.sweep", "the verdict table of a sweep, from job folders or MLflow"),
    "fork": ("flash_forensics.orchestrator.job.fork", "replay interventions from a checkpoint before the divergence"),
    "early-warning": ("flash_forensics.orchestrator.analysis.early_warning",
                      "each monitored signal as a predictor of divergence over a set of runs"),
    "stabilizers": ("flash_forensics.orchestrator.analysis.stabilizers", "the stabilizers table from report folders"),
    "data": ("flash_forensics.orchestrator.data.__main__", "prepare and fetch corpora, install the tokenizer"),
    "rounding-sweep": ("flash_forensics.orchestrator.config.rounding_sweep",
                       "generate the rounding-point interventions and sweeps from a recipe"),
    "analyze": ("flash_forensics.capture.cli",
                "offline report of an attention capture: ties, delta error, rounding points, the kernel's fingerprint"),
    "forensics": ("flash_forensics.kernels.forensics", "bit-level BF16 forensics: the paper's worked example, P̄V rows"),
    "sfa-matrix": ("flash_forensics.kernels.sfa_matrix", "the stabilized softmax's edge-case matrix"),
}


def usage() -> str:
    width = max(map(len, TOOLS))
    lines = ["usage: flash-forensics TOOL [ARGS ...]   (flash-forensics TOOL --help for a tool's arguments)", "",
             "tools:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in TOOLS.items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in TOOLS:
        print(f"flash-forensics: unknown tool {name!r}; expected one of {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(TOOLS[name][0])
    try:
        return int(module.main(rest) or 0)
    except Exception as e:  # a missing, empty or garbage input: one line, not a traceback (FF_TRACEBACK=1 shows it)
        if os.environ.get("FF_TRACEBACK"):
            traceback.print_exc()
        print(f"flash-forensics {name}: {one_line(e)}", file=sys.stderr)
        return 1


def one_line(e: BaseException) -> str:
    """An error as one sentence: its first line, a store that is not a database said in plain words."""
    text = str(e)
    if "file is not a database" in text or "not a database" in text:
        return ("the MLflow store is not a database (a sqlite:/// store is a file MLflow wrote; "
                "a server is http(s)://host:port)")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"[:500] if first else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
