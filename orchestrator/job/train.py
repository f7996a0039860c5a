"""The job: train one GPT with one attention recipe and record everything the verdict and the report need.

AMP as in the paper (FP32 master weights, BF16 autocast; attention picks its own dtypes per recipe), cosine lr with
warmup, global grad clipping, gradient accumulation (global count, split over DDP ranks), seeded everything, a
recorded (or replayed) batch order, checkpoints every `train.ckpt_every` steps and at the end, resume, and forks
(from_checkpoint: another run's state and batches, this config's attention, a new MLflow run; orchestrator/job/fork.py).
The hot path never syncs the host: losses, grad norms and kernel counters stay on the device until the monitors
flush them.

Steps are 0-based: metrics of optimizer step s are logged at step s; a checkpoint holds `step` = steps done, i.e.
the step a resumed run starts with.

This module is the Job's setup and step loop; one optimizer step is orchestrator/job/step.py, checkpointing
orchestrator/job/checkpoint_policy.py, the end-of-run bookkeeping orchestrator/job/run_end.py.
Over 400 lines because Job is the one place that orders setup, the step loop and the run's end; each piece it
calls lives in its own module of job/, monitor/ and tracking/.
"""
from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from flash_forensics.models.hf import build_model
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.data import BatchStream, ensure_prepared, val_batches
from flash_forensics.orchestrator.errors import ConfigError, remove_stale_temps
from flash_forensics.orchestrator.interventions import build_hooks
from flash_forensics.orchestrator.job import checkpoint, run_end
from flash_forensics.orchestrator.job import checkpoint_policy as snapshot
from flash_forensics.orchestrator.job.ckpt_writer import CheckpointWriter
from flash_forensics.orchestrator.job.determinism import deterministic_algorithms
from flash_forensics.orchestrator.job.distributed import cleanup, init_distributed
from flash_forensics.orchestrator.job.folder import read_job_start, write_job_start
from flash_forensics.orchestrator.job.optim import build_optimizer
from flash_forensics.orchestrator.job.preemption import PreemptionGuard
from flash_forensics.orchestrator.job.step import TrainStep, autocast, precision_line
from flash_forensics.orchestrator.monitor import alarm
from flash_forensics.orchestrator.monitor import capture as capture_job
from flash_forensics.orchestrator.monitor.monitors import Monitors
from flash_forensics.orchestrator.monitor.probes import runner as probes
from flash_forensics.orchestrator.record import CKPT_DIR, ORDER_FILE, RESOLVED_CONFIG
from flash_forensics.orchestrator.tracking.tracker import Tracker, describe_run, flatten_config
from flash_forensics.orchestrator.verdict import DivergenceDetector

SPOOL_FILE = "mlflow_spool.jsonl"  # metric points waiting for a failed MLflow store (orchestrator/tracking/tracker.py)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _job_slot() -> int:
    """This job's number in a Hydra multirun (0 otherwise): concurrent local jobs take GPUs round-robin."""
    try:
        from hydra.core.hydra_config import HydraConfig
        return int(HydraConfig.get().job.num or 0)
    except Exception:  # not under Hydra, or a single run whose job.num is unset
        return 0


def compile_enabled(setting, device: torch.device, routes=()) -> bool:
    """train.compile: true | false | cudagraphs, or auto: on CUDA when no layer runs the emulator (inductor on a
    2-core CPU costs more than it saves, and the emulator's Python tile loops unroll into a graph that takes minutes
    to compile)."""
    setting = str(setting).lower()
    if setting == "auto":
        return device.type == "cuda" and not any("/emulator/" in r for r in routes)
    return setting in ("true", "cudagraphs")


def compile_mode(setting, device: torch.device, world: int = 1):
    """torch.compile's mode for train.compile: "reduce-overhead" (CUDA graphs) for cudagraphs, else None (the
    default). cudagraphs on a device that is not CUDA, or across DDP ranks (not measured under graphs), is refused
    naming the key."""
    if str(setting).lower() != "cudagraphs":
        return None
    if device.type != "cuda":
        raise ValueError(f"train.compile='cudagraphs' is not allowed on device {device}: CUDA graphs need a CUDA "
                         "device (use true, false or auto)")
    if world > 1:
        raise ValueError(f"train.compile='cudagraphs' is not allowed with {world} DDP ranks: CUDA graphs run one "
                         "process per job here (use true)")
    return "reduce-overhead"


def compile_casts(setting, routes=()) -> bool:
    """train.compile_casts: true | false, or auto: on where a layer's attention is torch code the compiler traces (the
    emulator, impl=standard), whose BF16 rounding points inductor would otherwise keep in FP32; off where every layer
    is one opaque kernel (Triton, SDPA), as nanoGPT compiles. Off, a GPT-2S step's LayerNorm backward fusion ran
    0.33 ms faster (one H100, results/bench/gpu-h100-2026-12-07c); compiled and eager differ in the last bits
    either way."""
    setting = str(setting).lower()
    if setting == "auto":
        return any("/emulator" in r or "standard/" in r for r in routes)  # "llama:standard/fa2" too
    return setting == "true"


def compile_model(model, mode=None, casts: bool = True):
    """torch.compile (`mode`: compile_mode's) with inductor's emulate_precision_casts set to `casts` (compile_casts'):
    set either way, so a job never inherits an earlier job's setting in the same process."""
    import torch._inductor.config as inductor_config
    if hasattr(inductor_config, "emulate_precision_casts"):
        inductor_config.emulate_precision_casts = casts
    return torch.compile(model, mode=mode)


@torch.no_grad()
def evaluate(model, batches, device, precision) -> torch.Tensor:
    """Mean val loss over fixed batches, as a device scalar. Kernel counters are saved and restored around it so
    the monitors only ever count training rows."""
    stats = [s for s in model.attention_stats() if s is not None]
    saved = [s.snapshot() for s in stats]
    model.eval()
    losses = []
    for x, y in batches:
        with autocast(device, precision):
            _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        losses.append(loss.float())
    model.train()
    for s, snap in zip(stats, saved):
        s.restore(snap)
    return torch.stack(losses).mean()


_NOT_IN_NAME = ("intervention=", "tracking.", "results_dir=", "hydra", "experiment=", "name=", "sweep_name=", "+sweep=",
                "from_checkpoint=", "+from_checkpoint=", "++from_checkpoint=")


def _run_name(iv_name: str, overrides: List[str]) -> str:
    """The intervention plus the overrides that tell jobs apart (not where they log or which preset they use)."""
    extra = [o for o in overrides if not o.startswith(_NOT_IN_NAME)]
    return (iv_name + (" " + " ".join(extra) if extra else ""))[:250]


class Job:
    """One training run. `run()` returns the result dict (the contract's result.json) and fills `self.result` as
    it goes, so the caller can still write what is known when something fails.

    The pieces, one job each: `_setup` builds the model, optimizer, start state, data and the MLflow run; `_loop`
    runs the steps (orchestrator/job/step.py is one optimizer step); orchestrator/job/checkpoint_policy.py writes and
    restores checkpoints; orchestrator/job/run_end.py does the end-of-run bookkeeping (verdict, tags, crash path)."""

    def __init__(self, cfg, attention, job_dir: Path, overrides: List[str]):
        self.cfg, self.attention, self.job_dir, self.overrides = cfg, attention, Path(job_dir), list(overrides)
        self.result: Dict[str, Any] = run_end.new_result(cfg.intervention, self.overrides, self.job_dir,
                                                         cfg.verdict)
        # what an FP32 control must share with this run (seed, data order, lr, ...): the report's control rule
        self.result["setup"] = record.setup_of(flatten_config(cfg))
        self.hooks = build_hooks(cfg.intervention.hooks)  # the intervention's train hooks (checked by validation)
        self.fork: Optional[Dict[str, Any]] = None  # fork_info() when this run is (or resumes) a fork
        self.forking = False  # this process starts the fork (new MLflow run, fresh detector/monitors)
        self.order_path: Optional[Path] = None
        self.tracker = None
        self.monitors = None
        self.alarm = None
        self.probes = None
        self.capture = None
        self.detector = None
        self.dist = None
        self.is_main = True
        self._done = 0  # steps done so far (the crash path records them)
        self.saved_step: Optional[int] = None  # the newest checkpoint on disk (run_end.interrupted says it)
        self.ckpt_writer = CheckpointWriter()  # train.ckpt_async: periodic checkpoints written behind the loop
        self.nondeterministic_ops: List[str] = []  # train.deterministic: ops that ran without a deterministic form

    # ---------------------------------------------------------------------------------------------- setup
    def _init_dist(self):

        self.dist = init_distributed(self.cfg.dist, device=self.cfg.train.device, slot=_job_slot())
        self.is_main = self.dist.is_main
        if self.cfg.train.grad_accum % self.dist.world_size:
            raise ConfigError(f"train.grad_accum={self.cfg.train.grad_accum} is not allowed with "
                              f"{self.dist.world_size} ranks: expected a multiple of the world size")
        return self.dist.device

    def _build_model(self, device):
        """Model and optimizer, then the start state's weights and optimizer state (resume or fork)."""

        seed_everything(self.cfg.train.seed)
        self.result["setup"]["device.name"] = record.device_name(device)  # a seed repeats on one GPU model only
        model = build_model(self.cfg.model, self.attention).to(device)
        self.result["attention_routes"] = model.attention_routes()
        if self.is_main:
            print(f"[job] {precision_line(self.cfg.train.precision, self.result['attention_routes'])}")
        self.hooks.attach(model)
        optimizer = build_optimizer(model, self.cfg.optimizer, device)
        if self.is_main:  # what a kill -9 mid-write left behind
            for folder in (self.job_dir / CKPT_DIR, self.job_dir):
                for p in remove_stale_temps(folder):
                    print(f"[job] removed {p}, a temp file of a killed job")
        state = snapshot.start_state(self)
        if state:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        # the compiled module shares its parameters with `model` (checkpoints, eval and monitors use `model`); the
        # Triton attention is an opaque torch.library op there (kernels/ops.py): same kernels, same bits
        compiled = compile_enabled(self.cfg.train.compile, device, self.result["attention_routes"])
        mode = compile_mode(self.cfg.train.compile, device, self.dist.world_size)
        casts = compile_casts(self.cfg.train.compile_casts, self.result["attention_routes"]) if compiled else None
        train_model = compile_model(model, mode, casts) if compiled else model
        self.result["compiled"] = compiled  # in the record: compiling moves a BF16 run's divergence step
        self.result["compile_mode"] = mode
        self.result["compile_casts"] = casts
        # train.deterministic (compiled jobs): the embedding's sorted backward unless false, and with true torch's
        # deterministic algorithms, set before the first compiled call lowers the graph, until the job ends
        det = str(self.cfg.train.deterministic).lower()
        self.result["deterministic"] = det if compiled else None
        model.sorted_embedding_grad = compiled and det != "false"  # eager: either gives the same bits
        if compiled and det == "true":  # ops that still ran without a deterministic form: in the record
            self._scopes.enter_context(deterministic_algorithms(seen=self.nondeterministic_ops))
        if compiled and self.is_main:  # what decides a compiled run's bits, said once
            print(f"[job] torch.compile (mode {mode or 'default'}): eager-style casts {'on' if casts else 'off'} "
                  f"(train.compile_casts={self.cfg.train.compile_casts}); embedding backward "
                  f"{'inductor' if det == 'false' else 'sorted'}, deterministic algorithms "
                  f"{'on' if det == 'true' else 'off'} (train.deterministic={det})")
        if self.dist.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP
            train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None)
        return model, train_model, optimizer, state

    def _stream(self, data_dir: Path, start: int):

        cfg = self.cfg
        replay = cfg.data.replay
        mine = self.job_dir / ORDER_FILE
        if self.fork:  # a fork (or its resume) replays the source's batches ...
            replay = self.fork["batch_order"]
        # ... and records them too (the steps before the fork are filled from the replayed file), so the fork's
        # batch_order.bin equals the source's and a fork can be forked again
        record = mine if (cfg.train.record_batches and self.is_main and (cfg.data.replay is None or self.fork) and
                          (replay is None or Path(replay).resolve() != mine.resolve())) else None
        # one world-size-independent order (rank 0's stream over the global micro-batches): DDP ranks take their
        # share, so an N-GPU run sees the batches of the 1-GPU run with the same global batch, and a recorded
        # order replays on any number of ranks
        stream = BatchStream(data_dir / "train.bin", cfg.model.block_size, cfg.train.batch_size, cfg.data.seed,
                             rank=0, world_size=1, record_path=record, replay_path=replay,
                             grad_accum=cfg.train.grad_accum, start_step=start,
                             replay_past_end=cfg.data.replay_past_end)
        stream.check_covers(cfg.train.max_steps)
        reader = stream.reader
        if reader is not None and reader.regenerates(cfg.train.max_steps) and self.is_main:
            print(f"[job] batch order: {reader.path} holds {reader.n_steps} steps; steps {reader.n_steps}.."
                  f"{cfg.train.max_steps - 1} continue its seeded order (seed {reader.header.seed}), which reproduces "
                  f"all {reader.n_steps} recorded steps (data.replay_past_end=regenerate)", flush=True)
        self.order_path = stream.paths[0] if stream.paths else None
        return stream

    def _batches(self, stream, step: int):
        world, rank = self.dist.world_size, self.dist.rank
        mine = [m for m in range(self.cfg.train.grad_accum) if m % world == rank]
        if stream.writer is not None and world > 1:  # the recorder must see every micro-batch, in order
            return [b for m, b in ((m, stream.get(step, m)) for m in range(self.cfg.train.grad_accum))
                    if m % world == rank]
        return [stream.get(step, m) for m in mine]

    def _open_run(self, state, resuming: bool) -> None:
        """The MLflow run (the same one on resume, a new one for a fork), its params, tags and resolved config."""

        cfg, iv = self.cfg, self.cfg.intervention
        fork_tags = {}
        if self.fork:
            fork_tags = {"forked_from": self.fork["forked_from"], "fork_step": self.fork["fork_step"]}
            if self.fork.get("source_run_id"):
                fork_tags["forked_from_run"] = self.fork["source_run_id"]
        sweep_tags = {**fork_tags, "intervention": iv.name, record.TAG_EXPECT: iv.expect, "paper": iv.paper,
                      "sweep": cfg.sweep_name, "experiment": cfg.name, "job_dir": str(self.job_dir),
                      "job": self.job_dir.name,
                      "overrides": " ".join(record.user_overrides(self.overrides)), "attention_routes": ",".join(
                          self.result["attention_routes"])}
        run_name = _run_name(iv.name, self.overrides) + (f" fork@{self.fork['fork_step']}" if self.fork else "")
        self.tracker = Tracker(cfg.tracking, run_name[:250],
                               experiment=cfg.tracking.experiment or cfg.sweep_name,
                               run_id=state.get("mlflow_run_id") if resuming else None, enabled=self.is_main,
                               tags=sweep_tags, spool=self.job_dir / SPOOL_FILE,
                               description=describe_run(iv.name, iv.expect, iv.paper))
        self.result["mlflow_run_id"] = self.tracker.run_id
        if not self.is_main:
            return
        # what the launcher needs to close this run if the job dies without a result (orchestrator/launch/task.py)
        old = (read_job_start(self.job_dir) or {}).get("mlflow_run_id")
        if old and old != self.tracker.run_id:  # this folder's earlier run died before any checkpoint
            self.tracker.close_other(old, "KILLED", "the job died before its first checkpoint and was started again "
                                                    f"from step 0 (new MLflow run {self.tracker.run_id})")
        write_job_start(self.job_dir, mlflow_run_id=self.tracker.run_id, tracking_uri=self.tracker.uri)
        resolved = self.job_dir / RESOLVED_CONFIG  # the whole config, plumbing included, as an artifact
        resolved.parent.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.structured(cfg), resolved)
        if not resuming:
            self.tracker.log_params({**record.run_params(cfg, self.attention, self.result["attention_routes"]),
                                     "device": {"name": self.result["setup"].get("device.name")}})
            self.tracker.log_artifact(resolved)
        self.tracker.set_tags({**sweep_tags, record.TAG_VERDICT: "running",
                               record.TAG_VERSION: str(record.RECORD_VERSION)})

    def _setup(self):

        cfg, tc = self.cfg, self.cfg.train
        device = self._init_dist()
        model, train_model, optimizer, state = self._build_model(device)
        start = int(state["step"]) if state else 0
        resuming = bool(state) and not self.forking  # a fork starts a new run: fresh MLflow run, detector, monitors
        data_dir = ensure_prepared(cfg.data, cfg.model.vocab_size)
        stream = self._stream(data_dir, start)
        val = val_batches(data_dir / "val.bin", cfg.model.block_size, tc.batch_size, tc.eval_batches, seed=0)
        self._open_run(state, resuming)
        self.alarm = alarm.attach(self, start)  # monitor.alarm listens to what the monitors log (None when off)
        self.monitors = Monitors(model, cfg.monitor, self.tracker)
        self.probes = probes.build(cfg, model, data_dir, device, self.tracker, self.is_main)
        self.capture = capture_job.build(self, model)  # monitor.capture: attention snapshots at chosen steps
        self.detector = DivergenceDetector(cfg.verdict)
        if resuming:  # the checkpoint it resumed is on disk: an interrupted rerun starts there again
            self.saved_step = start
        if state:
            snapshot.restore_run_state(self, state, resuming)
            checkpoint.set_rng_state(state["rng"])  # last: model building above consumed the RNG
        step_fn = TrainStep(cfg, model, train_model, optimizer, device, self.dist.world_size, self.hooks)
        return model, optimizer, step_fn, stream, val, start, device

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> Dict[str, Any]:
        self._t_start = t_start = time.perf_counter()
        with contextlib.ExitStack() as self._scopes:  # process-wide settings the job makes, undone when it ends
            try:
                return self._run()
            finally:
                if self.result.get("wall_s") is None:  # set by run_end.log_record when the run got that far
                    self.result["wall_s"] = round(time.perf_counter() - t_start, 3)
                if self.dist is not None:
                    cleanup(self.dist)  # every rank, every ending: see cleanup

    def _run(self) -> Dict[str, Any]:
        model, optimizer, step_fn, stream, val, start, device = self._setup()
        guard = self._guard()
        self._done = start
        bar = tqdm(total=self.cfg.train.max_steps, initial=start, disable=not self.is_main,
                   desc=self.cfg.intervention.name, dynamic_ncols=True, mininterval=1.0)
        self.monitors.reset_clock()
        try:
            done = self._loop(model, optimizer, step_fn, stream, val, start, device, guard, bar)
            self.ckpt_writer.wait()
            run_end.finish(self, stream, done, status="FINISHED")
            final = checkpoint.step_path(self.job_dir / CKPT_DIR, done)
            if not self.cfg.train.keep_last and self.is_main and final.is_file():  # auto-resume finds step_<k>.pt
                (self.job_dir / CKPT_DIR / "last.pt").unlink(missing_ok=True)
                self.result["checkpoint"] = str(final)
        except Exception as e:
            self.result["error"] = f"{type(e).__name__}: {e}"
            run_end.crash(self, model, optimizer, self._done, stream, save=not isinstance(e, TimeBudgetError))
            raise
        except BaseException as e:  # preemption (SystemExit) or ^C: the checkpoint is saved
            run_end.interrupted(self, stream, self._done, guard_signal(guard) or type(e).__name__)
            raise
        finally:
            bar.close()
            if guard is not None:
                guard.uninstall()
        return self.result

    def _loop(self, model, optimizer, step_fn, stream, val, start: int, device, guard, bar) -> int:
        """Steps start .. train.max_steps: eval, checkpoints, early stop and preemption at step boundaries.
        Returns the steps done (also kept in self._done for the crash path)."""
        cfg, tc = self.cfg, self.cfg.train
        tokens_per_step = tc.batch_size * cfg.model.block_size * tc.grad_accum
        self._done = done = start
        val_done_at = None
        # sdpa layers have no free max logit: they pay an extra QK^T pass, only on the steps the monitors flush
        probe_sdpa = cfg.monitor.max_logit and any(k.impl == "sdpa" for k in model.layer_knobs())
        for step in range(start, tc.max_steps):
            if cfg.debug.raise_at_step == step:
                raise RuntimeError(f"debug.raise_at_step={step}: forced failure")
            self._maybe_kill(step, "step_start")
            self.ckpt_writer.check()  # a background checkpoint write that failed (disk full, ...) ends the run here
            if probe_sdpa:
                model.probe = (step + 1) % cfg.monitor.log_every == 0
            with self.capture.during(step, step_fn):
                loss_sum, grad_norm, lr = step_fn(step, self._batches(stream, step))
            self._maybe_kill(step, "step")  # mid-step: the update is done, its metrics are not logged yet
            self._done = done = step + 1
            host = self.monitors.step_end(step, loss_sum, grad_norm, lr, tokens_per_step)
            if host:
                self.detector.update(host)
                tps = self.monitors.last_tokens_per_s
                # once, what the rest of the run will take, from an interval past the warm-up (the first ones hold
                # the kernels' compilation and the allocator's growth: an estimate there was 18x too long)
                warm = done - start >= 3 * max(1, cfg.monitor.log_every)
                if tps and warm and not getattr(self, "_said_eta", False) and self.is_main:
                    self._said_eta = True
                    left = (tc.max_steps - done) * tokens_per_step / tps
                    print(f"[job] {tps:,.0f} tokens/s: the {tc.max_steps - done:,} steps left take ~{_duration(left)}",
                          flush=True)
                    check_hours(tc, done, left, tokens_per_step / tps, self.dist.world_size)
                bar.set_postfix(loss=f"{host[-1][1]:.4f}", tok_s=f"{tps:,.0f}" if tps else "-", refresh=False)
            bar.update(1)
            last = done == tc.max_steps
            ckpt = bool(tc.ckpt_every and done % tc.ckpt_every == 0 and done >= tc.ckpt_start) or last
            self.probes.step_end(step, checkpoint=ckpt)  # mechanism probes: every N steps and at checkpoints
            if (tc.eval_every and done % tc.eval_every == 0) or last:
                self._log_val(model, val, device, step)
                val_done_at = step
            # the alarm acts before this boundary's checkpoint, which then holds it done: a resume never acts twice
            if self.alarm is not None and self.alarm.pending and self.alarm.act(self, model, optimizer, done, stream):
                self.result["early_stopped"] = True  # action=stop: a clean end, its reason in result.json's alarm
                break
            if ckpt:
                snapshot.save(self, model, optimizer, done, "last.pt", keep_step=True,
                              kill_mid_write=cfg.debug.kill_at_step == step and
                              cfg.debug.kill_where == "checkpoint_write", background=tc.ckpt_async and not last)
                self._maybe_kill(step, "after_checkpoint")
            if tc.early_stop and self.detector.should_stop(step):
                self.result["early_stopped"] = True
                break
            if guard is not None and guard.should_stop(step):
                snapshot.save(self, model, optimizer, done, "last.pt")
                self.tracker.flush()
                guard.exit_for_requeue(f"step {done}")
        if self.result["early_stopped"]:
            if val_done_at != done - 1:
                self._log_val(model, val, device, done - 1)
            snapshot.save(self, model, optimizer, done, "last.pt", keep_step=True)
        return done

    # -------------------------------------------------------------------------------------------- pieces
    def _guard(self):
        return PreemptionGuard(dist_info=self.dist, check_every=self.cfg.dist.preempt_check_every).install()

    def _maybe_kill(self, step: int, where: str) -> None:
        """debug.kill_at_step / kill_where: SIGKILL this process there (the fault-injection tests)."""
        d = self.cfg.debug
        if d.kill_at_step == step and d.kill_where == where:
            if where == "after_checkpoint":  # after it is on disk, not while a thread writes it
                self.ckpt_writer.wait()
            import os
            import signal
            os.kill(os.getpid(), signal.SIGKILL)

    def _log_val(self, model, val, device, step: int) -> None:
        v = float(evaluate(model, val, device, self.cfg.train.precision))  # one sync per eval, not per step
        self.result["val_loss"] = v
        self.monitors.log_val(step, v)
        if self.is_main:  # the progress summary run.log keeps (the bar's refreshes are the terminal's)
            d = self.detector
            state = f"diverged at step {d.divergence_step}" if d is not None and d.diverged else "not diverged"
            loss = f"{d.final_loss:.4f}" if d is not None and d.final_loss is not None else "-"
            print(f"[job] step {step + 1}/{self.cfg.train.max_steps}: train loss {loss}, val loss {v:.4f}, {state}",
                  flush=True)

    def sync_monitors(self) -> None:
        """Flush the monitors' buffered steps into MLflow and the detector."""
        host = self.monitors.flush()
        if host:
            self.detector.update(host)


class TimeBudgetError(ValueError):
    """The steps left would take longer than train.max_hours at the speed measured."""


def check_hours(tc, done: int, left_s: float, step_s: float, world_size: int) -> None:
    """Stop (TimeBudgetError naming train.max_steps, the estimate and what fits) when the steps left would take
    more than train.max_hours. One process only: a lone rank that stopped would hang the others' all-reduce."""
    if tc.max_hours is None or left_s <= tc.max_hours * 3600:
        return
    fits = done + int(tc.max_hours * 3600 / step_s)
    msg = (f"train.max_steps={tc.max_steps} is not allowed at this speed: the {tc.max_steps - done:,} steps left "
           f"take ~{_duration(left_s)}, over train.max_hours={tc.max_hours:g}; expected train.max_steps <= ~{fits:,}, "
           f"or a larger train.max_hours (null: no limit)")
    if world_size > 1:
        print(f"[job] warning: {msg}", flush=True)
        return
    raise TimeBudgetError(msg)


def _duration(seconds: float) -> str:
    for unit, n in (("years", 365 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.3g} {unit}"
    return f"{seconds:.0f} s"


def guard_signal(guard) -> Optional[str]:
    """The name of the signal the preemption guard caught, if any."""
    import signal
    if guard is None or guard.signum is None:
        return None
    return signal.Signals(guard.signum).name


def train(cfg, attention, job_dir: Path, overrides: List[str]) -> Dict[str, Any]:
    return Job(cfg, attention, job_dir, overrides).run()


__all__ = ["Job", "train", "evaluate", "seed_everything", "compile_enabled", "compile_mode", "compile_casts",
           "compile_model", "CKPT_DIR", "ORDER_FILE", "SPOOL_FILE"]
