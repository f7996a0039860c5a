"""Training tokens/s of each stabilizer against the baseline, side by side in one process, round-robin.

    python benchmarks/stabilizers.py [--shapes mini,gpt2s] [--rounds 2] [--steps 5] [--emulator-steps 2]
                                     [--variants baseline,qk_clip,...] [--out results/bench/stabilizers-<gpu>.json]
    python benchmarks/stabilizers.py --shapes mini --rounds 1      # the short run (well under 2 minutes)

Each variant is what a run of `intervention=<name>` trains: its config composed by Hydra and validated by the
orchestrator (experiment=mini_repro; shape gpt2s adds model.block_size=1024 train.batch_size=16), so the model patch
(qk_norm, attn_gate, z_loss), the attention knobs (and so the route: Triton, or the emulator where Triton lacks a
knob) and the train hooks (qk_clip) are the run's. One training step is flash_forensics.orchestrator.job.step.TrainStep (BF16
autocast, grad clip, AdamW, the hooks), eager as mini_repro runs. Monitors are off: they cost every variant alike.
Every variant gets the same initialisation (train.seed) and the same random token batches.

Timing: CUDA events around each step (host clock on a CPU), after one warmup step per variant. Rounds go
round-robin over the variants, so drift of clocks and temperature spreads over all of them; a row's step time is
the median over all its timed steps. Variants whose layers run on the emulator time `--emulator-steps` steps per
round (seconds each at the GPT-2S shape). Each row records the route every layer actually took
(GPT.attention_routes) and whether the variant changes the model's parameters (it then cannot fork from a baseline
checkpoint). Writes results/bench/stabilizers-<gpu>.json (command, GPU, versions, rows, summary), rewritten after
every round so a cut-short run keeps what it measured. `--device cpu --model-overrides ...` is a smoke check only.
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

VARIANTS = ("baseline", "fp32", "qk_norm", "qk_clip", "gated_attn", "pbar_clamp", "sfa", "sfa_guarded", "stoch_round",
            "z_loss")
SHAPES = {  # name -> overrides on top of experiment=mini_repro
    "mini": [],  # B32 T256, GPT-2S width and depth
    "gpt2s": ["model.block_size=1024", "train.batch_size=16"],  # GPT-2S at the paper's B16 T1024
}


def environment(argv, device: torch.device) -> dict:
    env = dict(command="python " + " ".join([os.path.relpath(os.path.abspath(__file__), ROOT)] + list(argv)),
               torch=torch.__version__, python=platform.python_version(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    else:
        env.update(gpu="cpu")
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def compose(variant: str, shape_overrides, extra):
    """(validated schema.Config, effective AttentionConfig) of `intervention=<variant>`, as a run composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
    from flash_forensics.orchestrator.config.validate import validate_config
    overrides = ["experiment=mini_repro", f"intervention={variant}", *shape_overrides, *extra]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(os.path.join(ROOT, "conf"), version_base="1.3"):
            cfg = hydra_compose("config", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()
    return validate_config(cfg, overrides, check_resume=False, check_store=False)


def changes_model(obj) -> bool:
    """The intervention's model patch sets a field that decides the parameters (a fork from a baseline refuses)."""
    from flash_forensics.orchestrator.job.fork import MODEL_KEYS
    return bool(set(obj.intervention.model.set_fields()) & set(MODEL_KEYS))


class Variant:
    """One stabilizer's model, optimizer, hooks and train step, built as orchestrator/job/train.py builds them."""

    def __init__(self, name, shape_overrides, extra, device):
        from flash_forensics.models.gpt import GPT
        from flash_forensics.orchestrator.interventions import build_hooks
        from flash_forensics.orchestrator.job.optim import build_optimizer
        from flash_forensics.orchestrator.job.step import TrainStep
        from flash_forensics.orchestrator.job.train import seed_everything
        self.name = name
        obj, att = compose(name, shape_overrides, extra)
        self.obj = obj
        seed_everything(obj.train.seed)
        self.model = GPT(obj.model, att).to(device)
        self.routes = self.model.attention_routes()
        self.emulated = any("/emulator" in r for r in self.routes)
        hooks = build_hooks(obj.intervention.hooks)
        hooks.attach(self.model)
        self.optimizer = build_optimizer(self.model, obj.optimizer, device)
        self.step = TrainStep(obj, self.model, self.model, self.optimizer, device, 1, hooks)
        t = obj.train
        self.B, self.T, self.accum = t.batch_size, obj.model.block_size, t.grad_accum
        self.k = 0
        self.times_ms, self.losses = [], []

    def run(self, batches, timer, record: bool):
        ms, loss = timer(lambda: self.step(self.k, batches))
        self.k += 1
        if record:
            self.times_ms.append(ms)
            self.losses.append(loss)


def make_timer(device: torch.device):
    def cuda_timer(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss, _, _ = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), float(loss)

    def host_timer(fn):
        t0 = time.perf_counter()
        loss, _, _ = fn()
        loss = float(loss)
        return (time.perf_counter() - t0) * 1e3, loss
    return cuda_timer if device.type == "cuda" else host_timer


def batches_for(v: Variant, device, seed: int = 0):
    """The same random micro-batches (x, y) for every variant of a shape (GPT-2's vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(v.accum):
        x = torch.randint(0, 50257, (v.B, v.T + 1), generator=g)
        out.append((x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)))
    return out


def row_of(v: Variant, shape: str) -> dict:
    med = statistics.median(v.times_ms) if v.times_ms else None
    tokens = v.B * v.accum * v.T
    m = v.obj.model
    return dict(shape=shape, variant=v.name, model=f"{m.n_layer}x{m.n_head}x{m.n_embd}", batch=v.B, T=v.T,
                grad_accum=v.accum, steps_timed=len(v.times_ms),
                step_ms=med, tokens_per_s=tokens / (med / 1e3) if med else None, step_ms_all=v.times_ms,
                losses=v.losses, routes=v.routes, route_set=sorted(set(v.routes)), emulated=v.emulated,
                changes_model=changes_model(v.obj), expect=v.obj.intervention.expect)


def summarize(rows) -> dict:
    """Per shape: tokens/s of each variant and its ratio to the baseline's (the throughput cost is 1 - ratio)."""
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = {r["variant"]: r for r in rows if r["shape"] == shape and r.get("tokens_per_s")}
        base = rs.get("baseline")
        out[shape] = {name: dict(tokens_per_s=r["tokens_per_s"],
                                 vs_baseline=r["tokens_per_s"] / base["tokens_per_s"] if base else None,
                                 route=r["route_set"]) for name, r in rs.items()}
    return out


def _write(out, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="mini,gpt2s", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of intervention names")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round (Triton routes)")
    ap.add_argument("--emulator-steps", type=int, default=2, help="timed steps per round for emulator routes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--overrides", default="", help="extra Hydra overrides for every variant, space separated "
                                                    "(e.g. a CPU smoke check: 'train.device=cpu model.n_layer=2')")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/stabilizers.py: no CUDA GPU (use --device cpu --overrides 'train.device=cpu ...' for "
                 "a smoke check)")
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes={a.shapes!r} is not allowed: expected names from {', '.join(SHAPES)}")
    for key in ("rounds", "steps", "emulator_steps"):
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')}={getattr(a, key)} is not allowed: expected an integer >= 1")
    variants = [v for v in a.variants.split(",") if v]
    extra = a.overrides.split()
    out = dict(environment(argv, device), precision="bf16 autocast",
               note="eager, monitors off, hooks on; step = flash_forensics.orchestrator.job.step.TrainStep", rows=[])
    path = a.out or os.path.join(ROOT, "results", "bench", f"stabilizers-{out['gpu'].split()[-1].lower()}.json")
    timer = make_timer(device)
    for shape in shapes:
        built = []
        for name in variants:  # built up front, so that rounds alternate between them
            try:
                v = Variant(name, SHAPES[shape], extra, device)
                built.append((v, batches_for(v, device)))
                v.run(built[-1][1], timer, record=False)  # warmup: first-call allocation, Triton's autotuning
            except Exception as e:  # recorded; the other variants still run
                out["rows"].append(dict(shape=shape, variant=name, error=f"{type(e).__name__}: {e}"[:800]))
                print(f"[{shape}] {name}: {out['rows'][-1]['error']}", flush=True)
        for r in range(a.rounds):
            for v, data in built:
                for _ in range(a.emulator_steps if v.emulated else a.steps):
                    v.run(data, timer, record=True)
            rows = [r for r in out["rows"] if r["shape"] != shape or "error" in r] + [row_of(v, shape) for v, _ in built]
            _write(dict(out, rows=rows, summary=summarize(rows)), path)
            print(f"[{shape}] round {r + 1}/{a.rounds}: " + ", ".join(
                f"{v.name} {statistics.median(v.times_ms):.0f} ms" for v, _ in built), flush=True)
        out["rows"] = [r for r in out["rows"] if r["shape"] != shape or "error" in r] + \
            [row_of(v, shape) for v, _ in built]
        del built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["summary"] = summarize(out["rows"])
    _write(out, path)
    print(json.dumps(out["summary"], indent=1))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
