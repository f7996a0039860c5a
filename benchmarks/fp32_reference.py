"""The FP32 reference, fast: fp32_gemm=tf32x3 against IEEE FP32 and paper_bf16, side by side in one process.

    python benchmarks/fp32_reference.py [--rounds 5] [--train-steps 8] [--out results/bench/fp32-reference-<gpu>.json]

Three parts, each round-robin over its methods (a row's figure is the median over rounds):
1. attention fwd+bwd at the paper_1gpu shape (B16 H12 T1024 D64, causal, block_q = block_k = 128, counters on):
   triton paper_bf16, triton fp32 (fp32_gemm=ieee), triton fp32 (fp32_gemm=tf32x3), torch SDPA (its default
   backend, recorded), with triton.testing.do_bench;
2. accuracy: O, dQ, dK, dV of fp32/ieee and fp32/tf32x3 against an FP64 softmax(QK^T)V (autograd) of the same FP32
   inputs, on random inputs and on inputs with repeated row maxima (flash_forensics.capture.synthetic); max |error|,
   max |error| / max |reference|, and tf32x3 against ieee;
3. training tokens/s of GPT-2S at the paper_1gpu shape (B16 T1024, BF16 autocast, fused AdamW, clip 1.0), one model
   per method, the methods' steps interleaved: paper_bf16, fp32/ieee, fp32/tf32x3, SDPA.
The JSON holds the command, GPU, versions, the launch configs and every timing; `summary` holds the ratios the
issue asks for (fp32 training throughput vs paper_bf16's, its max error vs IEEE FP32).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.attention import _write, bench, environment, flops  # noqa: E402
from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402

SHAPE = (16, 12, 1024, 64)
PAPER = dict(block_q=128, block_k=128, counters=True)  # experiment=paper_1gpu's attention
METHODS = {
    "paper_bf16": AttentionKnobs(recipe="paper_bf16", backend="triton", **PAPER),
    "fp32_ieee": AttentionKnobs(recipe="fp32", backend="triton", **PAPER),
    "fp32_tf32x3": AttentionKnobs(recipe="fp32", backend="triton", fp32_gemm="tf32x3", **PAPER),
}


def cuda_kernel_names(run) -> str:
    """The CUDA kernels one call of `run` launched (the profiler's names, lower case, space-separated)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return " ".join(e.key.lower() for e in prof.key_averages())


def sdpa_backend(q, k, v) -> str:
    """Which SDPA backend torch picks for these inputs (the profiler's kernel names; no guessing)."""
    names = cuda_kernel_names(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
    for word, backend in (("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "efficient"), ("mem_eff", "efficient")):
        if word in names:
            return backend
    return "math or unknown: " + names[:200]


def attention_fn(name, H, dev):
    from flash_forensics.kernels.stats import AttnStats
    from flash_forensics.kernels.triton_flash import flash_attention_triton
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    knobs = METHODS[name]
    stats = AttnStats(H, dev)
    if knobs.recipe == "fp32":  # as a run feeds it: the BF16 activations cast to FP32
        return lambda q, k, v: flash_attention_triton(q.float(), k.float(), v.float(), knobs, stats)
    return lambda q, k, v: flash_attention_triton(q, k, v, knobs, stats)


def part_kernels(dev, rounds, rep_ms, log) -> dict:
    B, H, T, D = SHAPE
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for _ in range(3))
    do = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    names = list(METHODS) + ["sdpa"]
    fns = {m: attention_fn(m, H, dev) for m in names}
    ms = {m: [] for m in names}
    for r in range(rounds):
        for m in names:
            def run(f=fns[m]):
                f(q, k, v).backward(do)
            ms[m].append(bench(run, (q, k, v), rep_ms))
            log(f"kernels round {r} {m:12s} {ms[m][-1]:8.3f} ms {flops(B, H, T, D) / ms[m][-1] / 1e9:7.1f} TFLOP/s")
    med = {m: statistics.median(v) for m, v in ms.items()}
    return dict(shape=list(SHAPE), sdpa_backend=sdpa_backend(q.detach().requires_grad_(), k.detach().requires_grad_(),
                                                               v.detach().requires_grad_()),
                rounds_ms=ms, ms=med, tflops={m: flops(B, H, T, D) / t / 1e9 for m, t in med.items()},
                vs_paper_bf16={m: med["paper_bf16"] / t for m, t in med.items()})


def _errors(out, ref) -> dict:
    err = (out.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    return dict(max_abs=err, max_rel=err / scale if scale else None)


def part_accuracy(dev, log) -> dict:
    from flash_forensics.capture.synthetic import random_inputs, tied_inputs
    from flash_forensics.kernels.triton_flash import flash_attention_triton
    B, H, T, D = 2, 12, 1024, 64
    res = {}
    for label, gen in (("random", random_inputs), ("repeated_maxima", tied_inputs)):
        q, k, v, do = (t.to(dev, torch.float32) for t in gen(B, H, T, D, seed=0))
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        o64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)  # FP64: the math backend
        o64.backward(do.double())
        ref = dict(O=o64.detach(), dQ=q64.grad, dK=k64.grad, dV=v64.grad)
        outs = {}
        for m in ("fp32_ieee", "fp32_tf32x3"):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            o = flash_attention_triton(qq, kk, vv, METHODS[m])
            o.backward(do)
            outs[m] = dict(O=o.detach(), dQ=qq.grad, dK=kk.grad, dV=vv.grad)
        row = {m: {t: _errors(outs[m][t], ref[t]) for t in ref} for m in outs}
        row["tf32x3_vs_ieee"] = {t: _errors(outs["fp32_tf32x3"][t], outs["fp32_ieee"][t].double()) for t in ref}
        res[label] = row
        for m, errs in row.items():
            log(f"accuracy {label:16s} {m:16s} " + " ".join(f"{t} {e['max_abs']:.2e}" for t, e in errs.items()))
    return res


def part_training(dev, steps, warmup, log) -> dict:
    from flash_forensics.kernels.config import AttentionConfig
    from flash_forensics.models.gpt import GPT, ModelConfig
    B, T = SHAPE[0], SHAPE[2]
    attn = {m: AttentionConfig(impl="flash", **{k: v for k, v in kn.knob_values().items() if k != "impl"})
            for m, kn in METHODS.items()}
    attn["sdpa"] = AttentionConfig(impl="sdpa", counters=False)
    models, opts = {}, {}
    for m, a in attn.items():
        torch.manual_seed(0)
        models[m] = GPT(ModelConfig.preset("gpt2_s", block_size=T, bias=False), a).to(dev)
        opts[m] = torch.optim.AdamW(models[m].parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    g = torch.Generator(device=dev).manual_seed(0)
    data = [torch.randint(0, 50257, (B, T + 1), device=dev, generator=g) for _ in range(warmup + steps)]
    times = {m: [] for m in attn}
    for i, x in enumerate(data):
        for m in attn:  # interleaved: each method's step i runs beside the others' step i
            model, opt = models[m], opts[m]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times[m].append(time.perf_counter() - t0)
        log(f"training step {i} " + " ".join(f"{m} {times[m][-1] * 1e3:.0f} ms" for m in attn))
    med = {m: statistics.median(t[warmup:]) for m, t in times.items()}
    tps = {m: B * T / s for m, s in med.items()}
    routes = {m: models[m].attention_routes()[:1] for m in models}
    return dict(batch=B, T=T, warmup=warmup, steps=steps, step_ms={m: s * 1e3 for m, s in med.items()},
                step_ms_all={m: [round(s * 1e3, 2) for s in t] for m, t in times.items()},
                tokens_per_s=tps, vs_paper_bf16={m: tps[m] / tps["paper_bf16"] for m in tps}, routes=routes)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--train-warmup", type=int, default=2)
    ap.add_argument("--parts", default="kernels,accuracy,training")
    ap.add_argument("--out", default=None, help="JSON (default results/bench/fp32-reference-<gpu>.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp32_reference.py needs a CUDA GPU")
    dev = torch.device("cuda")
    from flash_forensics.kernels import triton_flash as tf
    env = environment(argv)
    env["command"] = "python " + " ".join([os.path.relpath(__file__, ROOT)] + list(argv))  # this script
    out = dict(env, launch_configs={m: tf.launch_config(kn, SHAPE[3], SHAPE[2])
                                                  for m, kn in METHODS.items()})
    path = args.out or os.path.join(ROOT, "results", "bench", f"fp32-reference-{out['gpu'].split()[-1].lower()}.json")
    parts = args.parts.split(",")

    def log(msg):
        print(msg, flush=True)
    if "kernels" in parts:
        out["kernels"] = part_kernels(dev, args.rounds, args.rep_ms, log)
        _write(out, path)
    if "accuracy" in parts:
        out["accuracy"] = part_accuracy(dev, log)
        _write(out, path)
    if "training" in parts:
        out["training"] = part_training(dev, args.train_steps, args.train_warmup, log)
    summary = {}
    if "training" in out:
        summary["train_fp32_tf32x3_vs_paper_bf16"] = out["training"]["vs_paper_bf16"]["fp32_tf32x3"]
        summary["train_fp32_ieee_vs_paper_bf16"] = out["training"]["vs_paper_bf16"]["fp32_ieee"]
    if "kernels" in out:
        summary["attn_fp32_tf32x3_vs_paper_bf16"] = out["kernels"]["vs_paper_bf16"]["fp32_tf32x3"]
    if "accuracy" in out:
        summary["tf32x3_vs_ieee_max_rel"] = max(e["max_rel"] for row in out["accuracy"].values()
                                                for e in row["tf32x3_vs_ieee"].values())
        summary["ieee_vs_fp64_max_rel"] = max(e["max_rel"] for row in out["accuracy"].values()
                                              for e in row["fp32_ieee"].values())
        summary["tf32x3_vs_fp64_max_rel"] = max(e["max_rel"] for row in out["accuracy"].values()
                                                for e in row["fp32_tf32x3"].values())
    out["summary"] = summary
    _write(out, path)
    log(f"summary {summary}")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
