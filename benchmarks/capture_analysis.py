"""Offline analysis time of one attention capture on the CPU: one layer's two worst heads, all attributions.

    python benchmarks/capture_analysis.py                       # B=16, T=1024, D=64, 4 heads captured, 2 analysed
    python benchmarks/capture_analysis.py --shape 4 4 256 64 --recipe fa2

Makes a capture of repeated-maxima inputs (flash_forensics.capture.synthetic.tied_inputs) with the recipe's own
emulator output, then times `analyze` (fingerprint, ties, delta error, dQ/dK, the attribution of all 11 rounding points
lifted alone and rounded alone) on --threads CPU threads. The target: at most 180 s on two cores. Writes
results/bench/capture-analysis-<device>[-N].json (never over a committed one) with the command, machine (load
averages before and after: other work on a shared machine skews CPU timings), versions, the file size and the times.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.emulator import hardware  # noqa: E402
from flash_forensics.capture.analysis import analyze  # noqa: E402
from flash_forensics.capture.recorder import write_call  # noqa: E402
from flash_forensics.capture.snapshot import versions  # noqa: E402
from flash_forensics.capture.synthetic import tied_inputs  # noqa: E402
from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402
from flash_forensics.kernels.emulator import reference_attention  # noqa: E402

TARGET_S = 180.0


def free_path(stem: str) -> str:
    """results/bench/<stem>.json, or <stem>-2.json, -3, ...: a committed result is never overwritten."""
    base = os.path.join(ROOT, "results", "bench", stem)
    path, n = base + ".json", 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}.json"
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[16, 4, 1024, 64], metavar=("B", "H", "T", "D"),
                    help="the capture's shape (H heads in the file)")
    ap.add_argument("--top", type=int, default=2, help="heads analysed (the worst by tie rows)")
    ap.add_argument("--recipe", default="paper_bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, H, T, D = args.shape
    dev = torch.device("cpu")
    load_before = [round(x, 2) for x in os.getloadavg()]
    q, k, v, do = tied_inputs(B, H, T, D, seed=0)
    kn = AttentionKnobs(recipe=args.recipe)
    o, lse, *_ = reference_attention(q, k, v, kn)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = write_call(os.path.join(tmp, "bench.safetensors"), q, k, v, o, do, lse, recipe=args.recipe,
                          knobs=kn.knob_values(), family="bench", layer=0, say=print)
        write_s = time.perf_counter() - t
        size = os.path.getsize(path)
        t = time.perf_counter()
        res = analyze(path, top=args.top, progress=True)
        total = time.perf_counter() - t
    hw = hardware(dev)
    hw["load_avg_before"] = load_before
    att = res["attribution"]
    record = dict(command="python benchmarks/capture_analysis.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  shape=dict(B=B, H=H, T=T, D=D), heads_analysed=res["heads"]["chosen"], recipe=args.recipe,
                  threads=args.threads, device=str(dev), hardware=hw,
                  versions={**versions(), "python": platform.python_version()},
                  time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  capture_bytes=size, capture_mib=round(size / 2**20, 2), write_s=round(write_s, 2),
                  analyze_s=round(total, 1), target_s=TARGET_S, within_target=total <= TARGET_S,
                  stages_s={k: round(v, 1) for k, v in res["timing"].items()},
                  fingerprint_candidates=len(res["fingerprint"]["candidates"]),
                  fingerprint_best=res["fingerprint"]["best"], attribution_configs=2 + sum(
                      1 for r in att["points"] for kind in ("lift", "round") if r[kind].get("state") == "run"),
                  rows_subsampled=False, verdict=att["sentence"])
    print(f"\ncapture {record['capture_mib']} MiB; analyze {total:.1f} s on {args.threads} threads "
          f"(target {TARGET_S:.0f} s; load before {load_before}, after {hw['load_avg_1_5_15']}); "
          f"stages {record['stages_s']}")
    out = args.out or free_path(f"capture-analysis-{dev.type}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
