"""End-to-end tokens/s of a GPT-2S training step: attention by torch SDPA vs the Triton flash kernels, one run.

    python benchmarks/train_step.py [--batch 16] [--steps 20] [--out results/bench/train-step-h200.json]

Each variant: models.GPT (gpt2_s, T=1024), AdamW (fused), BF16 autocast, loss.backward, optimizer step; random
tokens. Median step time over --steps after warm-up steps (compilation), synchronised per step.
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

VARIANTS = {
    "sdpa": dict(impl="sdpa", recipe="paper_bf16"),
    "triton_fa2": dict(impl="flash", backend="triton", recipe="fa2"),
    "triton_fa2_sfa": dict(impl="flash", backend="triton", recipe="fa2", softmax="stabilized"),
    "triton_paper_bf16": dict(impl="flash", backend="triton", recipe="paper_bf16"),
}


def run_variant(name, knobs, batch, steps, warmup, dev):
    from kernels.config import AttentionConfig
    from models import GPT, ModelConfig
    torch.manual_seed(0)
    cfg = ModelConfig.preset("gpt2_s")
    model = GPT(cfg, AttentionConfig(**knobs)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    T = cfg.block_size
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randint(0, 50257, (batch, T + 1), device=dev, generator=g)
    idx, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    times, losses = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    routes = model.attention_routes() if hasattr(model, "attention_routes") else None
    med = statistics.median(times)
    del model, opt
    torch.cuda.empty_cache()
    return dict(variant=name, knobs=knobs, batch=batch, T=T, step_ms=med * 1e3, tokens_per_s=batch * T / med,
                loss_first=losses[0], loss_last=losses[-1], routes=routes[:1] if routes else None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench", "train-step-h200.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/train_step.py needs a CUDA GPU")
    from tqdm import tqdm
    dev = torch.device("cuda")
    out = dict(command="python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
               time=time.strftime("%Y-%m-%dT%H:%M:%S"), model="gpt2_s", rows=[])
    for name in tqdm(args.variants.split(","), desc="gpt2_s train step", file=sys.stdout):
        try:
            row = run_variant(name, VARIANTS[name], args.batch, args.steps, args.warmup, dev)
        except Exception as e:  # recorded, the other variants still run
            row = dict(variant=name, knobs=VARIANTS[name], error=f"{type(e).__name__}: {e}"[:400])
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in out["rows"] if r["variant"] == "sdpa" and "tokens_per_s" in r), None)
    if base:
        out["vs_sdpa"] = {r["variant"]: r["tokens_per_s"] / base["tokens_per_s"]
                          for r in out["rows"] if "tokens_per_s" in r}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out.get("vs_sdpa", {}), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
