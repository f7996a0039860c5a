"""One training step of the GPT presets per attention route (forward, backward, AdamW; BF16 autocast on the CPU or
CUDA); prints a table and writes results/bench/models_step.json.

    python benchmarks/bench_models.py [--preset tiny] [--batch 8] [--impls sdpa standard flash] [--steps 10]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flash_forensics.kernels.config import AttentionConfig  # noqa: E402
from flash_forensics.models.gpt import GPT, ModelConfig  # noqa: E402


def step_times(model, idx, targets, steps: int, warmup: int, device) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in tqdm(range(warmup + steps), desc="steps", leave=False):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--impls", nargs="+", default=["sdpa", "standard", "flash"])
    ap.add_argument("--block", type=int, default=64, help="flash block_q = block_k")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench" / "models_step.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig.preset(args.preset)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 50257, (args.batch, cfg.block_size), generator=g).to(device)
    targets = torch.randint(0, 50257, (args.batch, cfg.block_size), generator=g).to(device)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = []
    for impl in args.impls:
        torch.manual_seed(0)
        model = GPT(cfg, AttentionConfig(impl=impl, block_q=args.block, block_k=args.block)).to(device)
        t = step_times(model, idx, targets, args.steps, args.warmup, device)
        rows.append({"impl": impl, "route": model.attention_routes()[0], "median_s": round(statistics.median(t), 4),
                     "min_s": round(min(t), 4), "tokens_per_s": round(idx.numel() / statistics.median(t))})
    print(f"{args.preset} ({cfg.n_layer}L/{cfg.n_head}H/{cfg.n_embd}, ctx {cfg.block_size}), batch {args.batch}, "
          f"{device}, torch threads {torch.get_num_threads()}, params {model.num_params():,}")
    print(f"{'route':<40} {'median s':>9} {'min s':>8} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['route']:<40} {r['median_s']:>9.4f} {r['min_s']:>8.4f} {r['tokens_per_s']:>10,}")
    out = {"command": "python benchmarks/bench_models.py " + " ".join(sys.argv[1:]), "preset": args.preset,
           "batch": args.batch, "seq_len": cfg.block_size, "device": str(device), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
           "loadavg_1m_before": load_before,
           "loadavg_1m_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
