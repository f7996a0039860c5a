"""A transformers Llama through the flash-forensics backend: the emulator route vs the Triton route vs transformers'
own SDPA and eager attention, one training step each, side by side in one process (issue 31: "the GPU speed of a
transformers Llama through the backend").

    python benchmarks/hf_llama.py [--batch 8 --seq 1024 --layers 12] [--recipe paper_bf16] [--rounds 3]
                                  [--out results/bench/hf-llama-<gpu>.json]

Methods, one model each with the same weights (BF16 parameters, CUDA):
- sdpa: `attn_implementation="sdpa"` (transformers' default; the SDPA backend that ran is read from the profiler);
- eager: `attn_implementation="eager"` (transformers' own matmul-softmax-matmul attention);
- triton: `attn_implementation="forensics"` + `use(model, recipe)`; plain causal batches take the Triton route
  (flash_forensics/fast_path.py);
- emulator: the same model with the fast path's tests answering "no", so every call takes the emulator.
`--left-pad N` pads every other sequence on the left (an attention_mask): the key-padded route.
Each call's route is recorded from the backend's own hooks (flash_forensics/hooks.py), so a method that silently
fell back would show it. The step is zero_grad + forward + loss + backward; it is timed with
triton.testing.do_bench, the methods in turn in every round; a row's figure is the median over rounds. The loss of
each method on the same batch and weights is recorded beside it (emulator and Triton compute the same recipe; they
are not bit-identical: tests/integration/test_hf_fast_path.py). `--device cpu` is a smoke run of the plumbing
(sdpa and emulator only, wall-clock medians, tiny shapes): its timings are not speeds.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.attention import _write  # noqa: E402

SPREAD_WARN = 1.10  # slowest round / fastest round above which the run says its rounds disagree


def build(args, device):
    import transformers

    from flash_forensics.hf_backend import NAME, use
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                   max_position_embeddings=args.seq)
    # a config object per model: transformers writes the attention choice into it (issue 31, "a shared config")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    sdpa.load_state_dict(ours.state_dict())
    eager.load_state_dict(ours.state_dict())
    ours, sdpa, eager = (m.to(device, torch.bfloat16) for m in (ours, sdpa, eager))
    use(ours, recipe=args.recipe)
    return ours, sdpa, eager


class _EmulatorOnly:
    """The fast path's tests answer "no" inside the block: every call takes the emulator route."""

    def __enter__(self):
        from flash_forensics import fast_path
        self.saved = fast_path.causal_only, fast_path.key_padding
        fast_path.causal_only = lambda *a, **k: False
        fast_path.key_padding = lambda *a, **k: None

    def __exit__(self, *exc):
        from flash_forensics import fast_path
        fast_path.causal_only, fast_path.key_padding = self.saved


def _batch(ids, am):
    labels = ids if am is None else ids.masked_fill(am == 0, -100)  # padded positions carry no loss
    return dict(input_ids=ids, labels=labels, **({} if am is None else {"attention_mask": am}))


def step_fn(model, ids, am=None, emulator: bool = False):
    from contextlib import nullcontext

    def step():
        model.zero_grad(set_to_none=True)
        with _EmulatorOnly() if emulator else nullcontext():
            model(**_batch(ids, am)).loss.backward()
    return step


def routes(model, ids, am=None, emulator: bool = False):
    """The implementation each attention call of one forward ran on (the backend's hooks); sdpa has none."""
    from contextlib import nullcontext

    from flash_forensics import hooks
    calls = []
    with _EmulatorOnly() if emulator else nullcontext(), hooks.observing(calls.append), torch.no_grad():
        loss = model(**_batch(ids, am)).loss
    return sorted({str(getattr(c, "implementation", "?")) for c in calls}), float(loss)


def sdpa_backend(step) -> str:
    """Which SDPA kernels one step of the sdpa model ran (the profiler's CUDA kernel names; no guessing)."""
    from benchmarks.fp32_reference import cuda_kernel_names
    names = cuda_kernel_names(step)
    found = [b for w, b in (("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "efficient"),
                            ("mem_eff", "efficient")) if w in names]
    return ",".join(sorted(set(found))) or "math or unknown"


def timed(step, device, warmup_ms: int, rep_ms: int) -> float:
    if device == "cuda":
        import triton
        return float(triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms))
    step()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def environment(argv, device) -> dict:
    import transformers
    env = dict(command="python benchmarks/hf_llama.py " + " ".join(argv), torch=torch.__version__,
               transformers=transformers.__version__, python=platform.python_version(),
               time=time.strftime("%Y-%m-%dT%H:%M:%S"), device=device)
    if device == "cuda":
        import triton
        env.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    return env


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--recipe", default="paper_bf16", choices=("paper_bf16", "fa2", "fp32"))
    ap.add_argument("--left-pad", type=int, default=0,
                    help="left-pad every other sequence by this many tokens (attention_mask): the key-padded route")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-ms", type=int, default=200)
    ap.add_argument("--rep-ms", type=int, default=1000)
    ap.add_argument("--out", default=None, help="JSON path (default results/bench/hf-llama-<gpu>.json)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu for a smoke run of the plumbing)")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        ap.error(f"--hidden {a.hidden} / --heads {a.heads} / --kv-heads {a.kv_heads}: heads must divide hidden and "
                 f"kv-heads must divide heads")
    out_path = a.out or os.path.join(ROOT, "results", "bench", "hf-llama-" + (
        torch.cuda.get_device_name().split()[-1].lower() if a.device == "cuda" else "cpu-smoke") + ".json")
    ours, sdpa, eager = build(a, a.device)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(a.device)
    if not 0 <= a.left_pad < a.seq:
        ap.error(f"--left-pad {a.left_pad} is not allowed: expected 0 <= it < --seq {a.seq}")
    am = None
    if a.left_pad:
        am = torch.ones(a.batch, a.seq, dtype=torch.long, device=a.device)
        am[1::2, :a.left_pad] = 0
    methods = {"sdpa": step_fn(sdpa, ids, am), "eager": step_fn(eager, ids, am),
               "emulator": step_fn(ours, ids, am, emulator=True)}
    if a.device == "cuda":
        methods["triton"] = step_fn(ours, ids, am)
    with torch.no_grad():
        info = {"sdpa": {"routes": ["transformers sdpa"], "loss": float(sdpa(**_batch(ids, am)).loss)},
                "eager": {"routes": ["transformers eager"], "loss": float(eager(**_batch(ids, am)).loss)}}
    for m in methods:
        if m not in info:
            r, loss = routes(ours, ids, am, emulator=(m == "emulator"))
            info[m] = {"routes": r, "loss": loss}
    if a.device == "cuda":
        info["sdpa"]["sdpa_backend"] = sdpa_backend(methods["sdpa"])
    ms = {m: [] for m in methods}
    for r in range(a.rounds):
        for m, step in methods.items():
            ms[m].append(timed(step, a.device, a.warmup_ms, a.rep_ms))
            print(f"[hf_llama] round {r + 1}/{a.rounds} {m}: {ms[m][-1]:.2f} ms", flush=True)
    tokens = a.batch * a.seq
    rows = {m: dict(info[m], ms_rounds=ms[m], ms=statistics.median(ms[m]),
                    tokens_per_s=tokens / (statistics.median(ms[m]) / 1e3)) for m in methods}
    for row in rows.values():  # rounds that disagree (a busy or throttled GPU) are said, not averaged away
        row["spread"] = max(row["ms_rounds"]) / min(row["ms_rounds"])
    summary = {f"{m}_vs_sdpa": rows["sdpa"]["ms"] / rows[m]["ms"] for m in methods if m != "sdpa"}
    if "triton" in rows:
        summary["triton_vs_emulator"] = rows["emulator"]["ms"] / rows["triton"]["ms"]
    out = dict(environment(argv, a.device), shape=dict(batch=a.batch, seq=a.seq, layers=a.layers, hidden=a.hidden,
                                                       heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab,
                                                       left_pad=a.left_pad),
               recipe=a.recipe, step="zero_grad + forward + loss + backward, BF16 parameters", methods=rows,
               summary=summary, smoke=a.device == "cpu")
    _write(out, out_path)
    for m, row in rows.items():
        print(f"{m:9s} {row['ms']:9.2f} ms  {row['tokens_per_s']:12,.0f} tokens/s  routes {row['routes']}  "
              f"loss {row['loss']:.4f}")
    print("summary:", {k: round(v, 3) for k, v in summary.items()}, "->", out_path)
    wide = {m: round(row["spread"], 2) for m, row in rows.items() if row["spread"] > SPREAD_WARN}
    if wide and a.device == "cuda":
        print(f"[hf_llama] WARNING: rounds disagree by more than {SPREAD_WARN - 1:.0%} (slowest / fastest: {wide}): "
              "another process on the GPU, or clocks? The medians above are less sure than they look", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
