"""What do the monitors and MLflow logging cost a training step?

One process, one model, one optimizer: chunks of `--chunk` steps run round-robin over the settings
(no monitors | monitors with log_every=1 | log_every=10, wq_every as configured), so drift in clock or load hits all
settings alike. Overhead of a setting = median over rounds of (its chunk time / the no-monitor chunk time) - 1.
Each chunk ends with a device synchronize, so the GPU work is counted, and the no-monitor loop never syncs inside.

    python benchmarks/monitors.py                       # CPU, tiny model (a smoke run of the benchmark)
    python benchmarks/monitors.py --model gpt2_s        # on a GPU: the <= 2% overhead target
    python benchmarks/monitors.py --model gpt2_s --impl flash   # fused kernels (triton on CUDA) with counters
    python benchmarks/monitors.py --host-only --model gpt2_s   # no training: host cost of monitors + logging

Prints a table and writes results/bench/monitors-<device>.json (overhead_fraction per setting, command, hardware).
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
from flash_forensics.orchestrator.monitor.monitors import MonitorConfig, Monitors  # noqa: E402
from flash_forensics.orchestrator.tracking.tracker import Tracker, TrackingConfig, git_info  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=["tiny", "gpt2_s", "gpt2_m"])
    p.add_argument("--impl", default="sdpa", choices=["sdpa", "flash"], help="attention impl (flash: emulator)")
    p.add_argument("--backend", default="auto", help="flash backend: auto (triton on CUDA) | emulator | triton")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=None, help="micro-batch (default: 8 on GPU, 4 on CPU)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's block_size)")
    p.add_argument("--log-every", default="1,10", help="monitor settings to compare (comma list)")
    p.add_argument("--writers", default="thread,process", help="tracking.writer values to compare (comma list)")
    p.add_argument("--wq-every", type=int, default=MonitorConfig.wq_every)
    p.add_argument("--chunk", type=int, default=None, help="steps per timed chunk (default: 20 GPU, 10 CPU)")
    p.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default: 8 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per setting first")
    p.add_argument("--tracking-uri", default=None, help="default: a fresh sqlite store in a temp dir")
    p.add_argument("--out", default=None, help="default: results/bench/monitors-<device>.json")
    p.add_argument("--host-only", action="store_true",
                   help="no training: the host-side cost of step_end/flush/logging at the model's metric volume")
    p.add_argument("--host-steps", type=int, default=500)
    return p.parse_args(argv)


class _ShapeOnly(torch.nn.Module):
    """The GPT monitoring interface at a model's shape, without the model: isolates the monitors' host cost."""

    def __init__(self, mcfg):
        super().__init__()
        from flash_forensics.kernels.stats import AttnStats
        self.stats = [AttnStats(mcfg.n_head) for _ in range(mcfg.n_layer)]
        self.w = torch.randn(mcfg.n_layer, mcfg.n_head)

    def attention_stats(self):
        return self.stats

    def wq_spectral_norms(self):
        return self.w.abs()


def host_cost(mcfg, log_everys, wq_every, steps, uri, writers=("thread",)):
    """Milliseconds per step spent in Monitors.step_end (incl. flushes and queueing for MLflow), CPU tensors."""
    rows = []
    for writer, le in [(w, le) for w in writers for le in log_everys]:
        tr = Tracker(TrackingConfig(uri=uri, writer=writer), f"host-log_every={le}-{writer}",
                     experiment="bench-monitors-host", discover_parent=False)
        mon = Monitors(_ShapeOnly(mcfg), MonitorConfig(log_every=le, wq_every=wq_every), tr)
        loss, gn = torch.tensor(3.0), torch.tensor(1.0)
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            mon.step_end(s, loss, gn, 3e-4, 1024)
        mon.flush()
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        tr.close()  # what the logging thread still had to post
        rows.append({"setting": f"log_every={le}/{writer}", "host_ms_per_step": 1e3 * dt / steps,
                     "drain_ms_per_step": 1e3 * (time.perf_counter() - t1) / steps,
                     "points_per_step": tr.points_logged / steps})
    return rows


def device_slug(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).lower().replace(" ", "-")
    return device.type


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    gpu = device.type == "cuda"
    batch = args.batch or (8 if gpu else 2)
    chunk = args.chunk or (20 if gpu else 5)
    rounds = args.rounds or (8 if gpu else 3)
    mcfg = ModelConfig.preset(args.model)
    load0 = os.getloadavg()[0]  # other work on the machine skews CPU timings: recorded with them
    if args.host_only:
        return main_host_only(args, mcfg)
    seq = args.seq or mcfg.block_size
    torch.manual_seed(0)
    model = GPT(mcfg, {"impl": args.impl, "backend": args.backend, "recipe": "paper_bf16"}).to(device)
    routes = model.attention_routes()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=gpu)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if gpu else torch.autocast("cpu", enabled=False)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, mcfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
    idx, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    tokens = batch * seq

    def train_step():  # AMP step as in the paper: FP32 master weights, BF16 compute, clipping
        with amp:
            _, loss = model(idx, targets)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), gn

    tmp = tempfile.TemporaryDirectory(prefix="bench-monitors-")
    uri = args.tracking_uri or f"sqlite:///{tmp.name}/mlflow.db"
    log_everys = [int(v) for v in args.log_every.split(",") if v]
    settings = {"none": None}
    trackers = []
    for writer in [w for w in args.writers.split(",") if w]:
        for le in log_everys:
            tr = Tracker(TrackingConfig(uri=uri, writer=writer), f"bench-log_every={le}-{writer}",
                         experiment="bench-monitors", discover_parent=False)
            trackers.append(tr)
            settings[f"log_every={le}/{writer}"] = Monitors(model, MonitorConfig(log_every=le,
                                                                                 wq_every=args.wq_every), tr)

    step = {name: 0 for name in settings}

    def run_chunk(name, n):
        mon = settings[name]
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            loss, gn = train_step()
            step[name] += 1
            if mon is not None:
                mon.step_end(step[name], loss, gn, 3e-4, tokens)
        if mon is not None:  # the chunk pays for its own last partial interval
            mon.flush()
        sync(device)
        return time.perf_counter() - t0

    from tqdm import tqdm
    for name in settings:
        run_chunk(name, args.warmup)
    times = {name: [] for name in settings}
    for _ in tqdm(range(rounds), desc=f"monitors bench ({args.model}, {device.type})"):
        for name in settings:
            times[name].append(run_chunk(name, chunk))
    for tr in trackers:
        tr.close()

    base = times["none"]
    rows = []
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        rows.append({"setting": name, "ms_per_step": 1e3 * statistics.median(ts) / chunk,
                     "overhead_fraction": statistics.median(ratios) - 1.0,
                     "overhead_min": min(ratios) - 1.0, "overhead_max": max(ratios) - 1.0,
                     "tokens_per_s": tokens * chunk / statistics.median(ts)})
    print(f"\n{'setting':<22} {'ms/step':>9} {'overhead':>9} {'(min..max over rounds)':>24} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['setting']:<22} {r['ms_per_step']:>9.2f} {100 * r['overhead_fraction']:>8.2f}% "
              f"{100 * r['overhead_min']:>10.2f}% ..{100 * r['overhead_max']:>8.2f}% {r['tokens_per_s']:>10.0f}")
    slug = device_slug(device)
    out = Path(args.out) if args.out else ROOT / "results" / "bench" / f"monitors-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "monitors", "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
           "git": git_info(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "hardware": {"device": slug, "platform": platform.platform(), "torch": torch.__version__,
                        "cuda": torch.version.cuda if gpu else None, "cpus": os.cpu_count(),
                        "load_avg_1m_before_after": [load0, os.getloadavg()[0]]},
           "config": {"model": args.model, "impl": args.impl, "routes": sorted(set(routes)), "batch": batch, "seq": seq, "chunk": chunk,
                      "rounds": rounds, "wq_every": args.wq_every, "tracking": "sqlite (temp)" if not
                      args.tracking_uri else args.tracking_uri, "n_layer": mcfg.n_layer, "n_head": mcfg.n_head},
           "target_overhead_fraction": 0.02,
           "overhead_fraction": {r["setting"]: r["overhead_fraction"] for r in rows if r["setting"] != "none"},
           "rows": rows}
    out.write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {out}")
    tmp.cleanup()
    return doc


def main_host_only(args, mcfg):
    with tempfile.TemporaryDirectory(prefix="bench-monitors-") as tmp:
        uri = args.tracking_uri or f"sqlite:///{tmp}/mlflow.db"
        log_everys = [int(v) for v in args.log_every.split(",") if v]
        rows = host_cost(mcfg, log_everys, args.wq_every, args.host_steps, uri,
                         [w for w in args.writers.split(",") if w])
    print(f"\nhost cost of the monitors at {args.model} shape ({mcfg.n_layer} layers x {mcfg.n_head} heads)")
    print(f"{'setting':<22} {'host ms/step':>12} {'drain ms/step':>14} {'points/step':>12}")
    for r in rows:
        print(f"{r['setting']:<22} {r['host_ms_per_step']:>12.3f} {r['drain_ms_per_step']:>14.3f} "
              f"{r['points_per_step']:>12.1f}")
    out = Path(args.out) if args.out else ROOT / "results" / "bench" / f"monitors-host-{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "monitors-host", "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
           "git": git_info(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "hardware": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                        "load_avg_1m_after": os.getloadavg()[0]},
           "config": {"model": args.model, "steps": args.host_steps, "wq_every": args.wq_every}, "rows": rows}
    out.write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {out}")
    return doc


if __name__ == "__main__":
    main()
