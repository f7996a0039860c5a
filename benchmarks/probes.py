"""What do the mechanism probes (monitor.probes, orchestrator/monitor/probes/) cost a mini_repro training step?

One process, one model, one optimizer. Round-robin over `--rounds` rounds: a chunk of `--every` training steps
without probes, then a chunk of `--every` steps with one probe (what monitor.probes.every=N costs: one probe per N
steps; mini_repro's checkpoints every 100 steps coincide with its probes). Overhead = median over rounds of
(probe chunk time / plain chunk time) - 1. Each chunk ends with a device synchronize. Then, with
triton.testing.do_bench where Triton is importable (else a timed loop), the milliseconds of one training step and
of one probe, and the interval at which the probe would cost 2%.

    python benchmarks/probes.py                       # on a GPU: the mini_repro shape (GPT-2S width, T=256, B=32)
    python benchmarks/probes.py --every 100 --rounds 5
    python benchmarks/probes.py --device cpu --tiny   # a CPU smoke run of the benchmark itself (tiny model)

Writes results/bench/probes-<gpu>.json (command, GPU, versions, per-round times, overhead, ms per step and probe).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flash_forensics.models.gpt import GPT, ModelConfig  # noqa: E402
from flash_forensics.orchestrator.monitor.probes.config import ProbesConfig  # noqa: E402
from flash_forensics.orchestrator.monitor.probes.runner import Probes  # noqa: E402

MINI = dict(name="mini", n_layer=12, n_head=12, n_embd=768, block_size=256)  # conf/experiment/mini_repro.yaml


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="the tiny model (CPU smoke run), not the mini_repro shape")
    p.add_argument("--batch", type=int, default=None, help="training micro-batch (default 32 GPU, 4 CPU)")
    p.add_argument("--probe-batch", type=int, default=ProbesConfig.batch)
    p.add_argument("--every", type=int, default=ProbesConfig.every, help="steps per chunk (one probe per chunk)")
    p.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 5 GPU, 2 CPU)")
    p.add_argument("--backend", default="auto", help="flash backend: auto (triton on CUDA) | emulator")
    p.add_argument("--no-tracking", action="store_true", help="probes not logged (default: MLflow, process writer)")
    p.add_argument("--out", default=None, help="default: results/bench/probes-<device>.json")
    return p.parse_args(argv)


def device_slug(device: torch.device) -> str:
    return torch.cuda.get_device_name(device).lower().replace(" ", "-") if device.type == "cuda" else device.type


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ms(fn, device, n: int = 5) -> float:
    """Median ms of fn(): triton.testing.do_bench on CUDA, else a timed loop."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
            return float(do_bench(fn, warmup=1, rep=max(1, n) * 50, return_mode="median"))
        except ImportError:
            pass
    ts = []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    gpu = device.type == "cuda"
    batch = args.batch or (32 if gpu else 4)
    rounds = args.rounds or (5 if gpu else 2)
    mcfg = ModelConfig.preset("tiny") if args.tiny else ModelConfig(**MINI)
    load0 = os.getloadavg()[0]
    torch.manual_seed(0)
    model = GPT(mcfg, {"impl": "flash", "backend": args.backend, "recipe": "paper_bf16"}).to(device)
    routes = model.attention_routes()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=gpu)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)  # the job's precision=bf16 autocast
    gen = torch.Generator(device="cpu").manual_seed(1)
    seq = mcfg.block_size
    x = torch.randint(0, mcfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
    idx, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    probe_b = (idx[:args.probe_batch].clone(), targets[:args.probe_batch].clone())

    tracker, tmp = None, None
    if not args.no_tracking:
        from flash_forensics.orchestrator.tracking.tracker import Tracker, TrackingConfig
        tmp = tempfile.TemporaryDirectory(prefix="bench-probes-")
        tracker = Tracker(TrackingConfig(uri=f"sqlite:///{tmp.name}/mlflow.db", writer="process"), "bench-probes",
                          experiment="bench-probes", discover_parent=False)
    probes = Probes(model, ProbesConfig(enabled=True, every=args.every, batch=args.probe_batch), probe_b, device,
                    "bf16", tracker)

    def train_step():
        with amp:
            _, loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step = [0]

    def chunk(with_probe: bool) -> float:
        sync(device)
        t0 = time.perf_counter()
        for i in range(args.every):
            train_step()
            if with_probe and i == 0:
                probes.run(step[0])  # one probe per chunk of `every` steps
        sync(device)
        step[0] += args.every
        return time.perf_counter() - t0

    from tqdm import tqdm
    train_step()
    probes.run(0)  # warm-up: kernels compiled, allocator sized
    plain, probed = [], []
    for _ in tqdm(range(rounds), desc=f"probes bench ({mcfg.name}, {device.type})"):
        plain.append(chunk(False))
        probed.append(chunk(True))
    ratios = [b / a for a, b in zip(plain, probed)]
    step_ms = bench_ms(train_step, device)
    probe_ms = bench_ms(lambda: probes.run(0), device)
    if tracker is not None:
        tracker.close()
    overhead = statistics.median(ratios) - 1.0
    result = {"every": args.every, "overhead_fraction": overhead, "overhead_min": min(ratios) - 1.0,
              "overhead_max": max(ratios) - 1.0, "plain_chunk_s": plain, "probe_chunk_s": probed,
              "step_ms": step_ms, "probe_ms": probe_ms, "probe_in_steps": probe_ms / step_ms,
              "every_for_2pct": probe_ms / (0.02 * step_ms)}
    print(f"\nstep {step_ms:.2f} ms, probe {probe_ms:.2f} ms (= {probe_ms / step_ms:.2f} steps); every={args.every}: "
          f"overhead {100 * overhead:.2f}% (min {100 * (min(ratios) - 1):.2f}%, max {100 * (max(ratios) - 1):.2f}%); "
          f"2% needs every >= {result['every_for_2pct']:.0f}")
    slug = device_slug(device)
    out = Path(args.out) if args.out else ROOT / "results" / "bench" / f"probes-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from flash_forensics.orchestrator.tracking.tracker import git_info
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    doc = {"benchmark": "probes", "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
           "git": git_info(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "hardware": {"device": slug, "platform": platform.platform(), "torch": torch.__version__,
                        "triton": triton_version, "cuda": torch.version.cuda if gpu else None,
                        "cpus": os.cpu_count(), "load_avg_1m_before_after": [load0, os.getloadavg()[0]]},
           "config": {"model": {k: getattr(mcfg, k) for k in ("n_layer", "n_head", "n_embd", "block_size")},
                      "batch": batch, "probe_batch": args.probe_batch, "rounds": rounds, "routes": sorted(set(routes)),
                      "tracking": None if args.no_tracking else "sqlite (temp), writer=process"},
           "result": result}
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return doc


if __name__ == "__main__":
    main()
