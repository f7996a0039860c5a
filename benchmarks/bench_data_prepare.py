"""Tokenizing speed of `prepare` on the default corpus, per tokenizer thread count; prints a table and writes
results/bench/data_prepare.json.   python benchmarks/bench_data_prepare.py [--threads 1 2] [--repeats 3]"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flash_forensics.orchestrator.data import DataConfig, ensure_prepared  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ensure_prepared(DataConfig(root=tempfile.mkdtemp(prefix="ff-bench-warm-")), 50304)  # fill the cache first
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = []
    for threads in args.threads:
        best = None
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="ff-bench-") as root:
                t0 = time.perf_counter()
                folder = ensure_prepared(DataConfig(root=root, num_proc=threads), 50304)
                wall = time.perf_counter() - t0
                m = json.loads((folder / "manifest.json").read_text())
            tokens = m["tokens"]["train"] + m["tokens"]["val"]
            row = {"threads": threads, "tokens": tokens, "tokenize_s": m["prepare_seconds"],
                   "tokenize_tokens_per_s": m["tokens_per_s"], "ensure_prepared_s": round(wall, 3),
                   "end_to_end_tokens_per_s": round(tokens / wall)}
            if best is None or row["tokenize_s"] < best["tokenize_s"]:
                best = row
        rows.append(best)
    print(f"{'threads':>7} {'tokens':>10} {'tokenize s':>10} {'tok/s':>12} {'ensure_prepared s':>18} {'e2e tok/s':>12}")
    for r in rows:
        print(f"{r['threads']:>7} {r['tokens']:>10,} {r['tokenize_s']:>10.3f} {r['tokenize_tokens_per_s']:>12,} "
              f"{r['ensure_prepared_s']:>18.3f} {r['end_to_end_tokens_per_s']:>12,}")
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"1-min load average before/after: {load_before} / {load_after} on {os.cpu_count()} cores "
          "(other work on the machine slows and blurs these numbers)")
    out = Path(__file__).resolve().parents[1] / "results" / "bench" / "data_prepare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python benchmarks/bench_data_prepare.py " + " ".join(sys.argv[1:]),
                               "corpus": "default (KJV)", "cpu_count": os.cpu_count(),
                               "machine": platform.platform(), "best_of": args.repeats,
                               "load_average_1min": [load_before, load_after], "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
