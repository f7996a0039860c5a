"""Forward+backward time of the plain-PyTorch emulator (paper_bf16 / fa2 / fp32) next to torch SDPA.

    python benchmarks/emulator.py                       # GPT-2S attention shape B=8, H=12, T=1024, D=64
    python benchmarks/emulator.py --shape 2 12 256 64 --reps 5

Runs on CUDA when there is one, else the CPU. Prints a table and writes results/bench/emulator-<device>.json with the
command, hardware and versions. Times are medians over --reps runs after --warmup untimed ones (CUDA: synchronised).
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
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402
from flash_forensics.kernels.emulator import flash_attention  # noqa: E402
from flash_forensics.kernels.stats import AttnStats  # noqa: E402


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def hardware(dev: torch.device) -> dict:
    hw = dict(cpu=cpu_name(), cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads())
    if hasattr(os, "getloadavg"):  # other work on the machine skews CPU timings: record it
        hw["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    if dev.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(dev)
    return hw


def time_fwd_bwd(fn, inputs, do, reps: int, dev: torch.device, warmup: int = 1) -> list[float]:
    """Milliseconds per forward+backward, `reps` times after `warmup` untimed runs."""
    out = []
    for i in range(reps + warmup):
        for x in inputs:
            x.grad = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        o = fn(*inputs)
        o.backward(do.to(o.dtype))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def methods(H: int, dev: torch.device, block: int):
    def emu(recipe):
        cfg = AttentionKnobs(recipe=recipe, backend="emulator", block_q=block, block_k=block, counters=True)
        stats = AttnStats(H, dev)
        return lambda q, k, v: flash_attention(q, k, v, cfg, stats)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return [  # (name, input dtype, fn)
        ("sdpa_fp32", torch.float32, sdpa),
        ("sdpa_bf16", torch.bfloat16, sdpa),
        ("emulator_paper_bf16", torch.bfloat16, emu("paper_bf16")),
        ("emulator_fa2", torch.bfloat16, emu("fa2")),
        ("emulator_fp32", torch.float32, emu("fp32")),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 12, 1024, 64], metavar=("B", "H", "T", "D"))
    ap.add_argument("--block", type=int, default=64, help="emulator block_q = block_k (default 64)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per method after one warm-up (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench/emulator-<device>.json)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    B, H, T, D = args.shape
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(B, H, T, D, generator=g) for _ in range(3)]
    do = torch.randn(B, H, T, D, generator=g).to(dev)
    rows = []
    for name, dtype, fn in tqdm(methods(H, dev, args.block), desc="methods", unit="method"):
        inputs = [x.to(dev, dtype).requires_grad_() for x in base]
        ms = time_fwd_bwd(fn, inputs, do, args.reps, dev, args.warmup)
        rows.append(dict(method=name, dtype=str(dtype).replace("torch.", ""), ms_median=statistics.median(ms),
                         ms=[round(m, 2) for m in ms]))
    ref = {r["method"]: r["ms_median"] for r in rows}
    for r in rows:
        r["x_sdpa_same_dtype"] = r["ms_median"] / ref["sdpa_bf16" if r["dtype"] == "bfloat16" else "sdpa_fp32"]
    print(f"\nfwd+bwd, causal, B={B} H={H} T={T} D={D}, device {dev}, emulator block {args.block}")
    print(f"{'method':22s}{'dtype':>10s}{'median ms':>12s}{'x SDPA':>9s}")
    for r in rows:
        print(f"{r['method']:22s}{r['dtype']:>10s}{r['ms_median']:>12.1f}{r['x_sdpa_same_dtype']:>9.2f}")
    out = args.out or os.path.join(ROOT, "results", "bench", f"emulator-{dev.type}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    record = dict(command="python benchmarks/emulator.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  shape=dict(B=B, H=H, T=T, D=D), block=args.block, reps=args.reps, warmup=args.warmup, device=str(dev),
                  hardware=hardware(dev), versions=dict(python=platform.python_version(), torch=torch.__version__),
                  time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rows=rows)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
