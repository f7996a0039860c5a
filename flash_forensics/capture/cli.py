"""`flash-forensics analyze FILE` (also `python -m flash_forensics.capture FILE`): the offline report of a capture.

Writes <out>/<file stem>.md, .html (plots inline) and .json (default: beside the file) and prints the Markdown.
A file that is not a readable capture is refused with one line naming what is wrong (exit 2).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from flash_forensics.capture.analysis import AnalysisError, analyze
from flash_forensics.capture.inputs import InputError, check_file, check_mlflow, check_out
from flash_forensics.capture.report import log_mlflow, markdown, write_all
from flash_forensics.capture.snapshot import SnapshotError


def _heads(s: str) -> List[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads={s!r} is not allowed: expected comma-separated head numbers, "
                                         "e.g. 0,3") from None
    if not out or any(h < 0 for h in out):
        raise argparse.ArgumentTypeError(f"--heads={s!r} is not allowed: expected head numbers >= 0")
    if len(set(out)) < len(out):
        raise argparse.ArgumentTypeError(f"--heads={s!r} is not allowed: expected each head once")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="flash-forensics analyze",
                                 description="Analyze an attention capture offline: ties, delta error vs FP64, "
                                             "attribution per rounding point, the kernel's fingerprint.")
    ap.add_argument("file", help="a .safetensors capture (flash_forensics.capture / monitor.capture)")
    ap.add_argument("--heads", type=_heads, default=None, help="head numbers to analyse (default: the worst by "
                                                               "tie rows)")
    ap.add_argument("--top", type=int, default=None,
                    help="how many worst heads when --heads is not given (default 2)")
    ap.add_argument("--out", default=None, help="folder for the .md/.html/.json (default: beside the file)")
    ap.add_argument("--blind", action="store_true", help="ignore the recipe the file names: the fingerprint alone "
                                                        "says what computed it (and the rest uses its best match)")
    ap.add_argument("--no-fingerprint", action="store_true", help="skip the fingerprint")
    ap.add_argument("--fingerprint-heads", choices=("auto", "all", "chosen"), default=None,
                    help="heads the fingerprint checks: all, the analysed ones, or auto (all when cheap; default)")
    ap.add_argument("--no-attribution", action="store_true", help="skip the attribution per rounding point")
    ap.add_argument("--mlflow", default=None, metavar="URI", help="also log a run to this MLflow tracking URI")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch (default 1: on a shared machine two spinning OpenMP threads made "
                         "one emulator forward 60x slower than one thread; raise it on an idle machine)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar, no Markdown on stdout")
    args = ap.parse_args(argv)
    # a flag the run would not use is refused, not ignored: the report would not be what it asked for
    if args.top is not None and args.heads is not None:
        ap.error(f"--top={args.top} with --heads is not allowed: --top picks the worst heads when --heads does not "
                 "name them; give one of them")
    if args.fingerprint_heads is not None and args.no_fingerprint:
        ap.error(f"--fingerprint-heads={args.fingerprint_heads} with --no-fingerprint is not allowed: it chooses the "
                 "heads of the fingerprint that --no-fingerprint skips")
    args.top = 2 if args.top is None else args.top
    args.fingerprint_heads = args.fingerprint_heads or "auto"
    if args.top < 1:
        ap.error(f"--top={args.top} is not allowed: expected an integer >= 1")
    if args.threads < 1:
        ap.error(f"--threads={args.threads} is not allowed: expected an integer >= 1")
    if args.blind and args.no_fingerprint:
        ap.error("--blind with --no-fingerprint is not allowed: --blind ignores the recipe the file names so that "
                 "the fingerprint alone decides it; without a fingerprint nothing would")
    try:  # before the analysis (minutes): a bad path or store is said now, not after the work
        check_file(args.file)
        check_out(args.out or str(Path(args.file).parent))
        args.store = check_mlflow(args.mlflow)
    except InputError as e:
        print(f"flash-forensics analyze: {e}", file=sys.stderr)
        return 2
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)  # main() may run inside a caller's process (tests, `flash-forensics`)


def _run(args) -> int:
    try:
        res = analyze(args.file, heads=args.heads, top=args.top, fingerprint=not args.no_fingerprint,
                      attribute=not args.no_attribution, progress=not args.quiet, blind=args.blind,
                      fingerprint_heads_mode=args.fingerprint_heads)
    except (SnapshotError, AnalysisError) as e:
        print(f"flash-forensics analyze: {e}", file=sys.stderr)
        return 2
    if res.get("conflict"):  # said on stderr as well: a --quiet run must not read the contradiction as agreement
        print(f"flash-forensics analyze: warning: {res['conflict']}", file=sys.stderr)
    path = Path(args.file)
    paths = write_all(res, args.out or path.parent, path.stem)
    if not args.quiet:
        print(markdown(res))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    if args.store:
        run_id = log_mlflow(res, *args.store, paths)
        print(f"MLflow run {run_id} at {args.mlflow}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
