"""Training tokens/s of each stabilizer against the baseline, side by side in one process, round-robin.

    python benchmarks/stabilizers.py [--shapes mini,gpt2s] [--rounds 2] [--steps 5] [--emulator-steps 2]
                                     [--variants baseline,qk_clip,...] [--max-seconds S] [--skip-emulator]
                                     [--out results/bench/stabilizers-<gpu>.json]
    python benchmarks/stabilizers.py --shapes mini --rounds 1      # the short run (well under 2 minutes)
    python benchmarks/stabilizers.py --shapes gpt2s --max-seconds 200   # the paper's shape in a budget

Each variant is what a run of `intervention=<name>` trains: its config composed by Hydra and validated by the
orchestrator (experiment=mini_repro; shape gpt2s adds model.block_size=1024 train.batch_size=16), so the model patch
(qk_norm, attn_gate, z_loss), the attention knobs (and so the route: Triton, or the emulator where Triton lacks a
knob) and the train hooks (qk_clip) are the run's. One training step is flash_forensics.orchestrator.job.step.TrainStep
(BF16 autocast, grad clip, AdamW, the hooks), eager as mini_repro runs. Monitors are off: they cost every variant alike.
Every variant gets the same initialisation (train.seed, its model made on the device) and the same random token
batches; each row says where its build's time went (build_parts: Hydra's compose, the model).

Timing: CUDA events around each step (host clock on a CPU), after one warmup step per variant (its first call:
allocation, Triton's autotuning), taken just before the variant's first timed steps. Rounds go round-robin over the
variants, so drift of clocks and temperature spreads over all of them; a row's step time is the median over all its
timed steps. Each row records the route every layer actually took (GPT.attention_routes), its route kind ('emulator'
where Triton cannot compute the variant: a knob it lacks, or on CUDA an input it does not support; else 'triton')
and whether the variant changes the model's parameters (it then cannot fork from a baseline checkpoint).
Emulator-kind variants (seconds per step at the GPT-2S shape) time `--emulator-steps` steps per round and come last
in every round, so the Triton-kind ones are measured first; `--skip-emulator` leaves them out.

Cut-short runs keep what they measured: a progress line per variant set up and per variant per round (flushed, with
or without PYTHONUNBUFFERED); the JSON (command, GPU, versions, rows, summary) is rewritten atomically after every
set-up and every variant's timed steps, with `partial: true` until the run ends. `--max-seconds S` (counted from the
start of the process) starts no build, warmup or step that its estimate says would end past S (the estimate: the
variant's own step wall time, else its warmup's, else the slowest warmup of its kind so far; a first warmup has no
estimate and starts while time is left, so leave a hard timeout a margin of one emulator step); a SIGTERM (e.g.
`timeout`) or Ctrl-C writes what was measured, too. The file then says `partial`, `stopped`, `rounds_completed` and,
under `missing`, which variants and rounds were not measured. `--device cpu --overrides ...` is a smoke check only.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # --max-seconds counts from here when run as a script (imports included)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

VARIANTS = (
    "baseline",
    "fp32",
    "qk_norm",
    "qk_clip",
    "gated_attn",
    "pbar_clamp",
    "sfa",
    "sfa_guarded",
    "stoch_round",
    "z_loss",
)
SHAPES = {  # name -> overrides on top of experiment=mini_repro
    "mini": [],  # B32 T256, GPT-2S width and depth
    "gpt2s": ["model.block_size=1024", "train.batch_size=16"],  # GPT-2S at the paper's B16 T1024
}
clock = time.perf_counter  # the budget's clock (a test swaps it)


def log(msg: str) -> None:
    print(msg, flush=True)  # stdout may be a file: every line lands at once, PYTHONUNBUFFERED or not


class Stop(BaseException):
    """A signal asked the run to end (BaseException: a variant's `except Exception` does not swallow it)."""


def environment(argv, device: torch.device) -> dict:
    env = dict(
        command="python " + " ".join([os.path.relpath(os.path.abspath(__file__), ROOT)] + list(argv)),
        torch=torch.__version__,
        python=platform.python_version(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
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
    return composed(["experiment=mini_repro", f"intervention={variant}", *shape_overrides, *extra])


def composed(overrides):
    """(validated schema.Config, effective AttentionConfig) of conf/config.yaml with `overrides`, as a run composes
    it (benchmarks/checkpoint_write.py builds the paper regime's model with it too)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
    from flash_forensics.orchestrator.config.validate import validate_config

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


def route_kind(routes, device: torch.device) -> str:
    """'emulator' where Triton cannot compute the variant (a knob it lacks, on any device; on CUDA also an input it
    does not support), else 'triton' (on a CPU every layer still runs on the emulator)."""
    lacks = any("triton lacks" in r for r in routes)
    emulated = any("/emulator" in r for r in routes)
    return "emulator" if lacks or (device.type == "cuda" and emulated) else "triton"


class Variant:
    """One stabilizer's model, optimizer, hooks and train step, built as orchestrator/job/train.py builds them."""

    def __init__(self, name, shape_overrides, extra, device):
        from flash_forensics.models.gpt import GPT
        from flash_forensics.orchestrator.interventions import build_hooks
        from flash_forensics.orchestrator.job.optim import build_optimizer
        from flash_forensics.orchestrator.job.step import TrainStep
        from flash_forensics.orchestrator.job.train import seed_everything

        self.name = name
        t = clock()
        obj, att = compose(name, shape_overrides, extra)
        self.obj = obj
        seed_everything(obj.train.seed)
        t_model = clock()
        # made on its device, not initialised on the host and copied (1.4 of a 2.7 s build on a 2-core CPU box);
        # build_parts showed the H200's 8 s builds of 2026-12-06 were the compose (a pip download per validation, gone
        # since 8b791e7), not the model
        with torch.device(device):
            self.model = GPT(obj.model, att)
        self.build_parts = dict(compose_s=round(t_model - t, 3), model_s=round(clock() - t_model, 3))
        self.routes = self.model.attention_routes()
        self.emulated = any("/emulator" in r for r in self.routes)
        self.kind = route_kind(self.routes, device)
        hooks = build_hooks(obj.intervention.hooks)
        hooks.attach(self.model)
        self.optimizer = build_optimizer(self.model, obj.optimizer, device)
        self.step = TrainStep(obj, self.model, self.model, self.optimizer, device, 1, hooks)
        t = obj.train
        self.B, self.T, self.accum = t.batch_size, obj.model.block_size, t.grad_accum
        self.k = 0
        self.times_ms, self.losses = [], []
        self.wall_s = []  # the budget's clock around each timed step (host overhead included)
        self.build_s = self.warmup_s = None
        self.rounds_completed = 0

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
    return dict(
        shape=shape,
        variant=v.name,
        model=f"{m.n_layer}x{m.n_head}x{m.n_embd}",
        batch=v.B,
        T=v.T,
        grad_accum=v.accum,
        steps_timed=len(v.times_ms),
        step_ms=med,
        tokens_per_s=tokens / (med / 1e3) if med else None,
        step_ms_all=v.times_ms,
        losses=v.losses,
        routes=v.routes,
        route_set=sorted(set(v.routes)),
        emulated=v.emulated,
        route_kind=v.kind,
        rounds_completed=v.rounds_completed,
        build_s=v.build_s,
        build_parts=v.build_parts,
        warmup_s=v.warmup_s,
        changes_model=changes_model(v.obj),
        expect=v.obj.intervention.expect,
    )


def summarize(rows) -> dict:
    """Per shape: tokens/s of each variant and its ratio to the baseline's (the throughput cost is 1 - ratio)."""
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = {r["variant"]: r for r in rows if r["shape"] == shape and r.get("tokens_per_s")}
        if not rs:  # nothing of this shape was timed: no entry, as for a shape never reached
            continue
        base = rs.get("baseline")
        out[shape] = {
            name: dict(
                tokens_per_s=r["tokens_per_s"],
                vs_baseline=r["tokens_per_s"] / base["tokens_per_s"] if base else None,
                route=r["route_set"],
            )
            for name, r in rs.items()
        }
    return out


def _write(out, path):
    """Atomically: a reader (or a kill mid-write) sees the previous file or this one, never half of one."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a signal between the two
            os.remove(tmp)


class Budget:
    """--max-seconds: whether a piece of work estimated to take `est` seconds still ends in time."""

    def __init__(self, seconds, t0):
        self.seconds, self.t0 = seconds, t0
        self.hit = False  # something was left out for it

    def elapsed(self) -> float:
        return clock() - self.t0

    def fits(self, est: float) -> bool:
        ok = self.seconds is None or self.elapsed() + est <= self.seconds
        self.hit |= not ok
        return ok


class Bench:
    """The run's state: every shape's variants, what they measured, and the JSON written from it."""

    def __init__(self, a, argv, device, t0):
        self.a, self.device = a, device
        self.budget = Budget(a.max_seconds, t0)
        self.timer = make_timer(device)
        self.out = dict(
            environment(argv, device),
            precision="bf16 autocast",
            note="eager, monitors off, hooks on; step = flash_forensics.orchestrator.job.step.TrainStep",
            rows=[],
        )
        self.path = a.out or os.path.join(
            ROOT, "results", "bench", f"stabilizers-{self.out['gpu'].split()[-1].lower()}.json"
        )
        self.shapes = [s for s in a.shapes.split(",") if s]
        self.variants = list(dict.fromkeys(v for v in a.variants.split(",") if v))
        self.extra = a.overrides.split()
        self.errors = []  # rows {shape, variant, error}
        self.skipped = []  # {shape, variant, route_kind, route_set, why}
        self.done = {}  # shape -> [Variant] of finished shapes (rows only: models freed)
        self.live = []  # (Variant, batches) of the shape being timed, in timing order
        self.shape = None
        self.stopped = None

    # ------------------------------------------------------------------------------------------ the record
    def rows(self):
        rows = list(self.errors)
        for shape, vs in self.done.items():
            rows += [row_of(v, shape) for v in vs]
        if self.shape is not None:
            rows += [row_of(v, self.shape) for v, _ in self.live]
        order = {s: i for i, s in enumerate(self.shapes)}
        return sorted(rows, key=lambda r: order.get(r["shape"], len(order)))  # stable: shape by shape

    def missing(self):
        """Per (shape, variant) asked for and neither measured in full, failed nor skipped: what was left out."""
        a, out = self.a, []
        measured = {(s, v.name): v for s, vs in self.done.items() for v in vs}
        measured.update({(self.shape, v.name): v for v, _ in self.live})
        failed = {(r["shape"], r["variant"]) for r in self.errors}
        skipped = {(r["shape"], r["variant"]) for r in self.skipped}
        for shape in self.shapes:
            for name in self.variants:
                if (shape, name) in failed or (shape, name) in skipped:
                    continue
                v = measured.get((shape, name))
                done = v.rounds_completed if v else 0
                if done >= a.rounds:
                    continue
                per_round = (a.emulator_steps if v.emulated else a.steps) if v else None
                out.append(
                    dict(
                        shape=shape,
                        variant=name,
                        route_kind=v.kind if v else None,
                        set_up=bool(v and v.warmup_s is not None),
                        steps_timed=len(v.times_ms) if v else 0,
                        steps_missing=per_round * a.rounds - len(v.times_ms) if v else None,
                        rounds_missing=list(range(done + 1, a.rounds + 1)),
                    )
                )
        return out

    def document(self, final: bool) -> dict:
        rows, missing = self.rows(), self.missing()
        counts = [r["rounds_completed"] for r in rows if "error" not in r]
        counts += [self.a.rounds - len(m["rounds_missing"]) for m in missing]  # those never built, too
        return dict(
            self.out,
            partial=not final or bool(missing) or self.stopped is not None,
            stopped=self.stopped,
            max_seconds=self.a.max_seconds,
            elapsed_s=round(self.budget.elapsed(), 3),
            rounds=self.a.rounds,
            rounds_completed=min(counts) if counts else 0,
            missing=missing,
            skipped=self.skipped,
            order={s: [v.name for v in vs] for s, vs in self.done.items()}
            | ({self.shape: [v.name for v, _ in self.live]} if self.shape else {}),
            rows=rows,
            summary=summarize(rows),
        )

    def write(self, final: bool = False) -> dict:
        doc = self.document(final)
        _write(doc, self.path)
        return doc

    # ------------------------------------------------------------------------------------------ the work
    def say(self, msg: str) -> None:
        log(f"[{self.shape}] {msg} (elapsed {self.budget.elapsed():.1f} s)")

    def left_out(self, what: str, est: float) -> None:
        self.say(
            f"budget: {what} left out (needs ~{est:.1f} s, "
            f"{self.a.max_seconds - self.budget.elapsed():.1f} s left of --max-seconds {self.a.max_seconds:g})"
        )

    def fail(self, name: str, e: Exception) -> None:
        self.errors.append(dict(shape=self.shape, variant=name, error=f"{type(e).__name__}: {e}"[:800]))
        self.live = [(v, d) for v, d in self.live if v.name != name]
        self.say(f"{name}: {self.errors[-1]['error']}")
        self.write()

    def build(self):
        """Every variant of the shape (model, optimizer: cheap), then the Triton kind first."""
        built = []
        for name in self.variants:
            est = built[-1].build_s if built else 0.0  # the first build also pays Hydra's imports and CUDA's start
            if not self.budget.fits(est):
                self.left_out(f"building {name}", est)
                continue
            t = clock()
            try:
                v = Variant(name, SHAPES[self.shape], self.extra, self.device)
            except Exception as e:  # recorded; the other variants still run
                self.fail(name, e)
                continue
            v.build_s = round(clock() - t, 3)
            if self.a.skip_emulator and v.kind == "emulator":
                self.skipped.append(
                    dict(
                        shape=self.shape,
                        variant=name,
                        route_kind=v.kind,
                        route_set=sorted(set(v.routes)),
                        why="--skip-emulator",
                    )
                )
                self.say(f"setup {name}: route {', '.join(sorted(set(v.routes)))}: skipped (--skip-emulator)")
                del v
                continue
            built.append(v)
            parts = ", ".join(f"{k[:-2]} {x:.1f}" for k, x in v.build_parts.items())
            self.say(f"setup {name} ({v.kind}): built in {v.build_s:.1f} s ({parts}), "
                     f"route {', '.join(sorted(set(v.routes)))}")
        built.sort(key=lambda v: v.kind == "emulator")  # stable: the given order within each kind
        self.live = [(v, batches_for(v, self.device)) for v in built]
        self.write()

    def warmup_estimate(self, v: Variant) -> float:
        warm = [(u.kind, u.warmup_s) for u, _ in self.live if u.warmup_s is not None]
        same = [s for k, s in warm if k == v.kind]
        return max(same or [s for _, s in warm] or [0.0])

    def step_estimate(self, v: Variant) -> float:
        """Its own steps' median wall time, else that of the steps of its kind so far, else its warmup's."""
        if v.wall_s:
            return statistics.median(v.wall_s)
        same = [w for u, _ in self.live if u.kind == v.kind for w in u.wall_s]
        return statistics.median(same) if same else v.warmup_s

    def time_round(self, v: Variant, data, r: int) -> None:
        a = self.a
        if v.warmup_s is None:
            est = self.warmup_estimate(v)
            if not self.budget.fits(est):
                self.left_out(f"{v.name} warmup (round {r + 1})", est)
                return
            t = clock()
            v.run(data, self.timer, record=False)  # first-call allocation, Triton's autotuning
            v.warmup_s = round(clock() - t, 3)
            self.say(f"setup {v.name} ({v.kind}): warmup step {v.warmup_s:.1f} s")
        n = a.emulator_steps if v.emulated else a.steps
        done = 0
        t_round = clock()
        for _ in range(n):
            est = self.step_estimate(v)
            if not self.budget.fits(est):
                self.left_out(f"{v.name} round {r + 1} steps {done + 1}..{n}", est)
                break
            t = clock()
            v.run(data, self.timer, record=True)
            v.wall_s.append(clock() - t)
            done += 1
        if done == n:
            v.rounds_completed += 1
        if done:
            med = statistics.median(v.times_ms)
            self.say(
                f"round {r + 1}/{a.rounds} {v.name} ({v.kind}): {done}/{n} steps in {clock() - t_round:.1f} s, "
                f"median {med:.1f} ms/step so far ({len(v.times_ms)} steps)"
            )
        self.write()

    def run_shape(self, shape: str) -> None:
        self.shape = shape
        self.say(f"shape {shape}: {len(self.variants)} variants, {self.a.rounds} rounds")
        self.build()
        for r in range(self.a.rounds):
            for v, data in list(self.live):
                try:
                    self.time_round(v, data, r)
                except Exception as e:  # recorded; the other variants still run
                    self.fail(v.name, e)
            med = [f"{v.name} {statistics.median(v.times_ms):.0f} ms" for v, _ in self.live if v.times_ms]
            self.say(f"round {r + 1}/{self.a.rounds}: " + (", ".join(med) or "nothing timed"))
        self.done[shape] = [v for v, _ in self.live]
        for v in self.done[shape]:  # the rows keep what they need; the models go
            v.model = v.optimizer = v.step = None
        self.live, self.shape = [], None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _on_signal(signum, frame):
    raise Stop(signal.Signals(signum).name)


def main(argv=None, t0=None):
    t0 = clock() if t0 is None else t0
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="mini,gpt2s", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of intervention names")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round (Triton routes)")
    ap.add_argument("--emulator-steps", type=int, default=2, help="timed steps per round for emulator routes")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no build, warmup or step expected to end past S seconds from the start; write what was measured",
    )
    ap.add_argument(
        "--skip-emulator", action="store_true", help="leave out the variants Triton cannot compute (the emulator kind)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--overrides",
        default="",
        help="extra Hydra overrides for every variant, space separated "
        "(e.g. a CPU smoke check: 'train.device=cpu model.n_layer=2')",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "benchmarks/stabilizers.py: no CUDA GPU (use --device cpu --overrides 'train.device=cpu ...' for "
            "a smoke check)"
        )
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes={a.shapes!r} is not allowed: expected names from {', '.join(SHAPES)}")
    for key in ("rounds", "steps", "emulator_steps"):
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')}={getattr(a, key)} is not allowed: expected an integer >= 1")
    if a.max_seconds is not None and not a.max_seconds > 0:
        ap.error(f"--max-seconds={a.max_seconds:g} is not allowed: expected a number of seconds > 0")
    bench = Bench(a, argv, device, t0)
    old = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            old[sig] = signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread: no handler, the per-variant writes remain
            pass
    try:
        log(
            f"stabilizers: {bench.out['gpu']}, shapes {','.join(bench.shapes)}, {len(bench.variants)} variants, "
            f"{a.rounds} rounds, budget {'none' if a.max_seconds is None else f'{a.max_seconds:g} s'}, "
            f"writing {bench.path}"
        )
        bench.write()
        for shape in bench.shapes:
            bench.run_shape(shape)
    except Stop as e:
        bench.stopped = str(e)
        log(f"stopped by {e}: writing what was measured")
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    if bench.stopped is None and bench.budget.hit:
        bench.stopped = "max_seconds"
    doc = bench.write(final=True)
    log(json.dumps(doc["summary"], indent=1))
    for m in doc["missing"]:
        log(
            f"missing: {m['shape']} {m['variant']} rounds {','.join(map(str, m['rounds_missing']))} "
            f"({m['steps_timed']} steps timed)"
        )
    state = "partial" if doc["partial"] else "complete"
    log(f"wrote {bench.path} ({state}: {doc['rounds_completed']}/{a.rounds} rounds, stopped: {doc['stopped']})")
    return doc


if __name__ == "__main__":
    main(t0=T_START)
