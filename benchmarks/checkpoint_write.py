"""What a periodic checkpoint costs the step loop: written in the loop (train.ckpt_async=false) against written by a
thread (true), on the paper regime's state (GPT-2S weights and AdamW moments, 1.5 GB), side by side in one process.

    python benchmarks/checkpoint_write.py [--device cuda] [--rounds 3] [--dir /tmp/ckpt-bench] [--out FILE]

Round-robin, each round: `idle` runs a stand-in for training (matmuls on the device, a host sync every 8) for
--work-seconds and counts its rate; `sync` times checkpoint.save_step (torch.save, sha256, fsync, the last.pt copy,
pruning: what the loop waited for before); `async` times CheckpointWriter.submit (what the loop waits for now: the
copy into host buffers, queued on CUDA; the time until the thread starts writing is `host_copy_s`), then runs the
stand-in while the thread writes, until the file is on disk (`to_disk_s`): `work_ratio` is its rate then against
idle's, and `lost_s` = stall + (1 - work_ratio) x the time it ran beside the write, the work the write cost. The
model is experiment=paper_1gpu's, after one AdamW step (its moments allocated); tied weights counted once. The
files go to --dir (deleted at the end): put it on the disk the runs use.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402


def paper_state(device: str):
    """experiment=paper_1gpu's model and AdamW (fused on CUDA, as the preset), one step taken: the state a
    checkpoint holds, less the small parts (RNG, detector, config)."""
    from benchmarks.stabilizers import composed
    from flash_forensics.models.hf import build_model
    from flash_forensics.orchestrator.job.optim import build_optimizer
    obj, attention = composed(["experiment=paper_1gpu", f"train.device={device}"])
    dev = torch.device(device)
    model = build_model(obj.model, attention).to(dev)
    opt = build_optimizer(model, obj.optimizer, dev)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def stand_in(dev, seconds=None, until=None) -> float:
    """Matmuls at training's pace (a host sync every 8, as the monitors' flushes bound how far the host runs ahead):
    iterations per second over `seconds`, or while until() is true."""
    n = 2048 if dev.type == "cuda" else 384
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    it, t0 = 0, time.perf_counter()
    while True:
        a @ b
        it += 1
        if it % 8 == 0:
            sync(dev)
            if (seconds is not None and time.perf_counter() - t0 >= seconds) or (until is not None and not until()):
                break
    sync(dev)
    return it / (time.perf_counter() - t0)


def state_bytes(tensors) -> int:
    """Bytes of distinct tensor memory (a tied weight is two state_dict entries over one storage)."""
    seen = {}
    for t in tensors:
        if torch.is_tensor(t):
            seen[(t.device, t.data_ptr())] = t.numel() * t.element_size()
    return sum(seen.values())


def main(argv=None) -> int:
    from benchmarks.attention import _write
    from flash_forensics.orchestrator.job import checkpoint
    from flash_forensics.orchestrator.job.ckpt_writer import CheckpointWriter
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the files are written (default: a temp folder under /tmp)")
    ap.add_argument("--out", default=None, help="JSON (default results/bench/checkpoint-write-<device>.json)")
    ap.add_argument("--work-seconds", type=float, default=3.0, help="the idle stand-in's duration per round")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds} is not allowed: expected 1 or more")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device={args.device} is not allowed here: CUDA is not available; expected --device cpu")
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    model, opt = paper_state(args.device)
    n_bytes = state_bytes([*model.state_dict().values(),
                           *(t for st in opt.state_dict()["state"].values() for t in st.values())])
    base = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    folder = os.path.join(base, "checkpoints")
    os.makedirs(folder, exist_ok=True)
    writer = CheckpointWriter()
    rows = {"idle": [], "sync": [], "async": []}
    step = 0
    print(f"[checkpoint_write] {n_bytes / 2 ** 30:.2f} GiB of tensors on {name}; files in {folder}", flush=True)
    try:
        for r in range(args.rounds):
            for method in ("idle", "sync", "async"):
                if method == "idle":
                    rows[method].append(dict(work_rate=stand_in(dev, seconds=args.work_seconds)))
                    print(f"[checkpoint_write] round {r + 1} idle: {rows[method][-1]['work_rate']:.1f} it/s",
                          flush=True)
                    continue
                step += 1
                state = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
                sync(dev)
                t0 = time.perf_counter()
                if method == "sync":
                    checkpoint.save_step(folder, step, state, keep=2)
                    rows[method].append(dict(stall_s=time.perf_counter() - t0))
                else:
                    times = {}

                    def write(s, times=times, step=step):
                        times["copied"] = time.perf_counter()
                        checkpoint.save_step(folder, step, s, keep=2)
                        times["written"] = time.perf_counter()

                    writer.submit(write, state)
                    stall = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    rate = stand_in(dev, until=lambda: writer.busy)
                    beside = time.perf_counter() - t1
                    writer.wait()
                    ratio = rate / rows["idle"][-1]["work_rate"]
                    rows[method].append(dict(stall_s=stall, host_copy_s=times["copied"] - t0,
                                             to_disk_s=times["written"] - t0, work_ratio=ratio,
                                             lost_s=stall + max(0.0, 1 - ratio) * beside))
                print(f"[checkpoint_write] round {r + 1} {method}: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in rows[method][-1].items()), flush=True)
    finally:
        writer.settle()
        shutil.rmtree(folder, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in rows.items()}
    out = dict(command="python " + " ".join(["benchmarks/checkpoint_write.py", *(argv or sys.argv[1:])]),
               device=name, torch=torch.__version__, python=platform.python_version(),
               time=time.strftime("%Y-%m-%dT%H:%M:%S"), state_bytes=n_bytes, rounds=args.rounds, rows=rows,
               median=med, stall_ratio_async_vs_sync=med["async"]["stall_s"] / med["sync"]["stall_s"],
               lost_ratio_async_vs_sync=med["async"]["lost_s"] / med["sync"]["stall_s"])
    path = args.out or os.path.join(ROOT, "results", "bench",
                                    f"checkpoint-write-{'cpu' if dev.type == 'cpu' else name.lower().replace(' ', '-')}"
                                    ".json")
    _write(out, path)
    print(f"[checkpoint_write] the loop waits {med['sync']['stall_s']:.3f} s (sync) vs {med['async']['stall_s']:.3f} s "
          f"(async; on disk {med['async']['to_disk_s']:.3f} s later, the work beside it at "
          f"{med['async']['work_ratio']:.2f} of its idle rate: {med['async']['lost_s']:.3f} s of work lost); {path}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
