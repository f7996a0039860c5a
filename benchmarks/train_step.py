"""Training tokens/s of GPT-2S (12 layers, 12 heads, 768 wide): torch SDPA + torch.compile (the nanoGPT way) vs the
Triton flash kernels, eager and compiled, counters and monitors on, in one process.

    python benchmarks/train_step.py [--shapes 16x1024,32x256] [--steps 20] [--out results/bench/train-step-<gpu>.json]

Each variant: flash_forensics.models.gpt.GPT, fused AdamW, BF16 autocast, grad clipping, the run's Monitors (W_Q norms
every 50 steps, one host transfer every 10, counters and max logit per layer); the same random token batches for every
variant. A step's time is the host clock between synchronisations after `--warmup` steps (compilation); the row is the
median. Every variant's per-step losses are kept, so an eager and a compiled variant of the same attention can be
compared step by step (`compiled_vs_eager`: the largest |loss difference| over the timed steps).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

ATTN = {
    "sdpa": dict(impl="sdpa", recipe="paper_bf16"),
    "triton_fa2": dict(impl="flash", backend="triton", recipe="fa2"),
    "triton_fa2_sfa": dict(impl="flash", backend="triton", recipe="fa2", softmax="stabilized"),
    "triton_paper_bf16": dict(impl="flash", backend="triton", recipe="paper_bf16"),
}
VARIANTS = ["sdpa+compile", "sdpa", "triton_fa2", "triton_fa2+compile", "triton_paper_bf16",
            "triton_paper_bf16+compile", "triton_fa2_sfa+compile"]


def run_variant(name, batch, T, steps, warmup, dev):
    from flash_forensics.kernels.config import AttentionConfig
    from flash_forensics.models.gpt import GPT, ModelConfig
    from flash_forensics.orchestrator.monitor.monitors import MonitorConfig, Monitors
    attn, compiled = name.split("+")[0], name.endswith("+compile")
    torch.manual_seed(0)
    cfg = ModelConfig.preset("gpt2_s", block_size=T)
    model = GPT(cfg, AttentionConfig(**ATTN[attn])).to(dev)
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    monitors = Monitors(model, MonitorConfig())
    g = torch.Generator(device=dev).manual_seed(0)
    data = [torch.randint(0, 50257, (batch, T + 1), device=dev, generator=g) for _ in range(warmup + steps)]
    times, losses = [], []
    for i, x in enumerate(data):
        if attn == "sdpa":  # as orchestrator/job/train.py: sdpa pays its max-logit pass on the monitors' flush steps
            model.probe = (i + 1) % monitors.cfg.log_every == 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = fwd(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        monitors.step_end(i, loss.detach(), gn, 3e-4, batch * T)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    med = statistics.median(times[warmup:])
    row = dict(variant=name, attention=ATTN[attn], compiled=compiled, batch=batch, T=T, step_ms=med * 1e3,
               tokens_per_s=batch * T / med, warmup_s=round(sum(times[:warmup]), 2),
               losses=[float(x) for x in torch.stack(losses).cpu()], routes=model.attention_routes()[:1])
    del model, fwd, opt, monitors
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="16x1024,32x256", help="comma list of BATCHxT")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--launch-table", default=None, help="tune JSON (benchmarks/tune.py) whose shape_table to use")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/train_step.py needs a CUDA GPU")
    from benchmarks.attention import environment
    dev = torch.device("cuda")
    if args.launch_table:
        from benchmarks.tune import load_shape_table
        load_shape_table(args.launch_table)
    out = dict(environment(argv), model="gpt2_s", optimizer="AdamW(fused)", precision="bf16 autocast", rows=[])
    path = args.out or os.path.join(ROOT, "results", "bench", f"train-step-{out['gpu'].split()[-1].lower()}.json")
    for shape in args.shapes.split(","):
        batch, T = (int(x) for x in shape.split("x"))
        for name in args.variants.split(","):
            try:
                row = run_variant(name, batch, T, args.steps, args.warmup, dev)
            except Exception as e:  # recorded, the other variants still run
                row = dict(variant=name, batch=batch, T=T, error=f"{type(e).__name__}: {e}"[:600])
            out["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
            with open(path, "w") as f:
                json.dump(out, f, indent=2)
    out["summary"] = summarize(out["rows"])
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out["summary"], indent=1))
    print(f"wrote {path}")


def summarize(rows) -> dict:
    """Per shape: tokens/s relative to sdpa+compile, and compiled-vs-eager loss agreement per attention."""
    out = {}
    ok = [r for r in rows if "tokens_per_s" in r]
    for key in sorted({(r["batch"], r["T"]) for r in ok}):
        rs = {r["variant"]: r for r in ok if (r["batch"], r["T"]) == key}
        base = rs.get("sdpa+compile")
        d = dict(tokens_per_s={v: r["tokens_per_s"] for v, r in rs.items()})
        if base:
            d["vs_sdpa_compile"] = {v: r["tokens_per_s"] / base["tokens_per_s"] for v, r in rs.items()}
        d["compiled_vs_eager_max_abs_loss_diff"] = {
            v: max(abs(a - b) for a, b in zip(rs[v]["losses"], rs[v + "+compile"]["losses"]))
            for v in rs if v + "+compile" in rs}
        out[f"B{key[0]}_T{key[1]}"] = d
    return out


if __name__ == "__main__":
    main()
