"""Emulator cost of the other formats: fp8_fa3 and fp16 forward+backward next to paper_bf16, in one process.

    python benchmarks/formats.py                          # B=2, H=4, T=256, D=64 (the CPU default's scale)
    python benchmarks/formats.py --shape 2 4 512 64 --rounds 5

The methods run round-robin (one timed forward+backward of each per round, after one untimed warm-up round),
so load that drifts across the run hits every method alike; the ratio to paper_bf16 (with the same `counters`
setting) is taken per round and its median reported. Writes results/bench/formats-<device>.json (command,
hardware, versions) in benchmarks/emulator.py's style.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.emulator import hardware  # noqa: E402
from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402
from flash_forensics.kernels.emulator import flash_attention  # noqa: E402
from flash_forensics.kernels.stats import AttnStats  # noqa: E402

METHODS = (("paper_bf16", {}), ("fp16", {}), ("fp8_fa3", {}), ("fp8_fa3", dict(incoherent=True)),
           ("fp8_fa3", dict(input_scaling="block")), ("fp8_te", {}),  # counters on, as training runs them
           ("paper_bf16", dict(counters=False)), ("fp16", dict(counters=False)), ("fp8_fa3", dict(counters=False)))


def _name(recipe: str, extra: dict) -> str:
    return recipe + "".join(f"+{k}={v}" for k, v in extra.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[2, 4, 256, 64], metavar=("B", "H", "T", "D"))
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench/formats-<device>.json)")
    args = ap.parse_args(argv)
    dev = torch.device("cpu")
    B, H, T, D = args.shape
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(B, H, T, D, generator=g) for _ in range(3)]
    do = torch.randn(B, H, T, D, generator=g)
    runs = []
    for recipe, extra in METHODS:
        knobs = AttentionKnobs(recipe=recipe, backend="emulator", **extra).validate(n_head=H)
        runs.append((_name(recipe, extra), knobs, AttnStats(H, dev)))
    ms = {name: [] for name, _, _ in runs}
    for r in range(args.rounds + 1):
        for name, knobs, stats in runs:
            q, k, v = (x.clone().requires_grad_() for x in base)
            t0 = time.perf_counter()
            o = flash_attention(q, k, v, knobs, stats)
            o.backward(do.to(o.dtype))
            if r:  # round 0 warms up
                ms[name].append((time.perf_counter() - t0) * 1e3)
    rows = []
    for name, t in ms.items():  # each against paper_bf16 with the same counters setting, round by round
        ref = ms["paper_bf16+counters=False" if "counters=False" in name else "paper_bf16"]
        rows.append(dict(method=name, ms_median=statistics.median(t), ms=[round(x, 2) for x in t],
                         x_paper_bf16=statistics.median(a / b for a, b in zip(t, ref, strict=True))))
    print(f"\nfwd+bwd, causal, B={B} H={H} T={T} D={D}, CPU, emulator block 64, {args.rounds} round-robin rounds")
    print(f"{'method':34s}{'median ms':>12s}{'x paper_bf16':>14s}")
    for r in rows:
        print(f"{r['method']:34s}{r['ms_median']:>12.1f}{r['x_paper_bf16']:>14.2f}")
    out = args.out or os.path.join(ROOT, "results", "bench", f"formats-{dev.type}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    record = dict(command="python benchmarks/formats.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  shape=dict(B=B, H=H, T=T, D=D), rounds=args.rounds, order="round-robin, one warm-up round",
                  device=str(dev), hardware=hardware(dev),
                  versions=dict(python=platform.python_version(), torch=torch.__version__),
                  time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rows=rows)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
