"""Does 2-GPU DDP train like 1 GPU with the same global batch (gradient accumulation)? And how much faster is it?

Runs the real job (run.py) twice with identical configs: once in one process on one GPU (grad_accum micro-batches
per step), once under torchrun with --nproc N (each rank runs grad_accum / N of the same micro-batches, gradients
averaged by DDP). Reads both loss curves and tokens/s from the MLflow store they wrote, prints a table, writes
results/bench/ddp-<tag>.json.

    python benchmarks/ddp.py                                   # 2 GPUs: the DDP check (writes ddp-h200x2.json
                                                               # when the GPUs are H200s)
    python benchmarks/ddp.py --device cpu --model tiny --steps 6 --block 64 --batch 4   # a CPU dry run (gloo)

The prepared corpus must be there (data/, made by any earlier run on a machine with the default corpus cached).
Expect the curves to agree to BF16 noise: identical data and math, but the all-reduce sums gradients in another
order than the accumulation does, so differences start at ~1e-6 and grow slowly with training.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="DDP ranks (GPUs) for the second run")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default="mini", help="mini (6x384, the mini_repro model) | tiny | gpt2_s | gpt2_m")
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=4, help="global micro-batches per step (both runs)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--attention", default="sdpa", help="attention group (sdpa | paper_bf16 | fa2 | fp32)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tag", default=None, help="output name: results/bench/ddp-<tag>.json (default from hardware)")
    p.add_argument("--workdir", default=None, help="where the runs write (default: a temp dir)")
    p.add_argument("--no-write", action="store_true", help="print only; no results/bench file (tests)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs")
    return p.parse_args(argv)


def hardware(device: str, nproc: int) -> tuple[str, str]:
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
        short = "h200" if "H200" in name else name.lower().replace("nvidia ", "").replace(" ", "-")
        return f"{nproc} x {name}", f"{short}x{nproc}"
    return f"{nproc} CPU processes ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", \
        f"cpux{nproc}"


def overrides(a, workdir: Path, db: Path) -> list[str]:
    model = ["model=tiny", "model.name=mini", "model.n_layer=6", "model.n_head=6", "model.n_embd=384"] \
        if a.model == "mini" else [f"model={a.model}"]
    return ["experiment=smoke", "intervention=baseline", f"attention={a.attention}", *model,
            f"model.block_size={a.block}",
            f"train.batch_size={a.batch}", f"train.grad_accum={a.grad_accum}", f"train.max_steps={a.steps}",
            f"train.warmup_steps={max(1, a.steps // 10)}", f"train.precision={a.precision}",
            f"train.device={a.device}", "train.eval_every=0", "train.ckpt_every=0", "train.early_stop=false",
            "monitor.log_every=10", f"monitor.wq_every={max(10, a.steps)}", "name=ddp_bench",
            f"results_dir={workdir}", f"tracking.uri=sqlite:///{db}", *a.overrides]


def run(cmd: list[str], env: dict, label: str) -> float:
    print(f"[{label}] {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env)
    if res.returncode != 0:
        raise SystemExit(f"[{label}] failed with exit status {res.returncode}")
    return time.perf_counter() - t0


def curves(db: Path, run_id: str) -> dict:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        out = {}
        for key in ("train/loss", "perf/tokens_per_s"):
            out[key] = con.execute("SELECT step, value FROM metrics WHERE run_uuid = ? AND key = ? ORDER BY step",
                                   (run_id, key)).fetchall()
        return out
    finally:
        con.close()


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.grad_accum % a.nproc:
        raise SystemExit(f"--grad-accum {a.grad_accum} must be a multiple of --nproc {a.nproc}")
    desc, tag = hardware(a.device, a.nproc)
    tag = a.tag or tag
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="ddp-bench-"))
    db = workdir / "mlflow.db"
    common = overrides(a, workdir, db)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1" if a.device == "cpu" else "4")
    one_env = dict(env, CUDA_VISIBLE_DEVICES="0") if a.device == "cuda" else env
    wall1 = run([sys.executable, "run.py", *common, f"hydra.run.dir={workdir}/one"], one_env, "1 rank")
    wall2 = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.nproc),
                 "run.py", *common, f"hydra.run.dir={workdir}/ddp"], env, f"{a.nproc} ranks")
    r1 = json.loads((workdir / "one" / "result.json").read_text())
    r2 = json.loads((workdir / "ddp" / "result.json").read_text())
    for r, name in ((r1, "1 rank"), (r2, "ddp")):
        if r.get("error"):
            raise SystemExit(f"[{name}] job failed: {r['error']}")
    c1, c2 = curves(db, r1["mlflow_run_id"]), curves(db, r2["mlflow_run_id"])
    l1, l2 = dict(c1["train/loss"]), dict(c2["train/loss"])
    steps = sorted(set(l1) & set(l2))
    diffs = [abs(l1[s] - l2[s]) for s in steps]
    first = diffs[: max(1, len(diffs) // 10)]

    def tps(c):  # steady state: skip the first tenth (compilation, warm-up)
        vals = [v for s, v in c["perf/tokens_per_s"] if s >= a.steps // 10] or [v for _, v in c["perf/tokens_per_s"]]
        return statistics.median(vals) if vals else float("nan")

    t1, t2 = tps(c1), tps(c2)
    tokens_per_step = a.batch * a.block * a.grad_accum
    result = {
        "benchmark": "ddp", "hardware": desc, "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
        "config": {"model": a.model, "block_size": a.block, "micro_batch": a.batch, "grad_accum": a.grad_accum,
                   "global_batch_tokens": tokens_per_step, "steps": a.steps, "precision": a.precision,
                   "attention": a.attention, "overrides": common},
        "steps_compared": len(steps), "steps_missing": sorted(set(l1) ^ set(l2)),
        "max_abs_loss_diff": max(diffs) if diffs else None,
        "mean_abs_loss_diff": statistics.fmean(diffs) if diffs else None,
        "max_abs_loss_diff_first_10pct": max(first) if diffs else None,
        "final_loss": {"1": l1.get(steps[-1]) if steps else None, str(a.nproc): l2.get(steps[-1]) if steps else None},
        "tokens_per_s": {"1": t1, str(a.nproc): t2}, "speedup": t2 / t1 if t1 else None,
        "scaling_efficiency": t2 / t1 / a.nproc if t1 else None,
        "wall_s": {"1": round(wall1, 1), str(a.nproc): round(wall2, 1)},
        "mlflow": {"uri": f"sqlite:///{db}", "runs": [r1["mlflow_run_id"], r2["mlflow_run_id"]]},
    }
    print()
    print(f"{'run':<14}{'ranks':>6}{'tokens/s':>14}{'final loss':>12}{'wall s':>9}")
    print(f"{'grad-accum':<14}{1:>6}{t1:>14,.0f}{result['final_loss']['1']:>12.4f}{wall1:>9.1f}")
    print(f"{'DDP':<14}{a.nproc:>6}{t2:>14,.0f}{result['final_loss'][str(a.nproc)]:>12.4f}{wall2:>9.1f}")
    print(f"max |loss diff| over {len(steps)} steps: {result['max_abs_loss_diff']:.3g} (first 10%: "
          f"{result['max_abs_loss_diff_first_10pct']:.3g}, mean {result['mean_abs_loss_diff']:.3g}); "
          f"speedup {result['speedup']:.2f}x ({result['scaling_efficiency']:.0%} of linear)")
    if not a.no_write:
        out = ROOT / "results" / "bench" / f"ddp-{tag}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
