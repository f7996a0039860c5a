"""The job: train one GPT with one attention recipe and record everything the verdict and the report need.

AMP as in the paper (FP32 master weights, BF16 autocast; attention picks its own dtypes per recipe), cosine lr with
warmup, global grad clipping, gradient accumulation (global count, split over DDP ranks), seeded everything, a
recorded (or replayed) batch order, checkpoints every `train.ckpt_every` steps and at the end, resume, and forks
(from_checkpoint: another run's state and batches, this config's attention, a new MLflow run; orchestrator/fork.py).
The hot path never syncs the host: losses, grad norms and kernel counters stay on the device until the monitors
flush them.

Steps are 0-based: metrics of optimizer step s are logged at step s; a checkpoint holds `step` = steps done, i.e.
the step a resumed run starts with.
"""
from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from orchestrator import checkpoint
from orchestrator.optim import build_optimizer, lr_factor, set_lr

CKPT_DIR = "checkpoints"
ORDER_FILE = "batch_order.bin"


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


def _autocast(device: torch.device, precision: str):
    if precision == "bf16":  # FP32 master weights, BF16 matmuls; attention casts q/k/v itself per recipe
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, batches, device, precision) -> torch.Tensor:
    """Mean val loss over fixed batches, as a device scalar. Kernel counters are saved and restored around it so
    the monitors only ever count training rows."""
    stats = model.attention_stats()
    saved = [(s.repeated_max_rows.clone(), s.rows_seen.clone(), s.max_logit.clone()) for s in stats]
    model.eval()
    losses = []
    for x, y in batches:
        with _autocast(device, precision):
            _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        losses.append(loss.float())
    model.train()
    for s, (rows, seen, logit) in zip(stats, saved):
        s.repeated_max_rows.copy_(rows)
        s.rows_seen.copy_(seen)
        s.max_logit.copy_(logit)
    return torch.stack(losses).mean()


def _finite_params(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())  # crash path only: syncing is fine here


_NOT_IN_NAME = ("intervention=", "tracking.", "results_dir=", "hydra", "experiment=", "name=", "sweep_name=", "+sweep=",
                "from_checkpoint=", "+from_checkpoint=", "++from_checkpoint=")


def _run_name(iv_name: str, overrides: List[str]) -> str:
    """The intervention plus the overrides that tell jobs apart (not where they log or which preset they use)."""
    extra = [o for o in overrides if not o.startswith(_NOT_IN_NAME)]
    return (iv_name + (" " + " ".join(extra) if extra else ""))[:250]


class Job:
    """One training run. `run()` returns the result dict (the contract's result.json) and fills `self.result` as
    it goes, so the caller can still write what is known when something fails."""

    def __init__(self, cfg, attention, job_dir: Path, overrides: List[str]):
        self.cfg, self.attention, self.job_dir, self.overrides = cfg, attention, Path(job_dir), list(overrides)
        iv = cfg.intervention
        self.result: Dict[str, Any] = {
            "intervention": iv.name, "overrides": self.overrides, "expected": iv.expect, "observed": "failed",
            "divergence_step": None, "final_loss": None, "min_loss": None, "val_loss": None, "peak_wq_norm": None,
            "peak_wq_where": None, "mlflow_run_id": None, "steps_done": 0, "early_stopped": False, "error": None,
            "wall_s": None, "attention_routes": None, "resumed_from": None, "checkpoint": None,
            "forked_from": None, "fork_step": None, "source_run_id": None}
        self.fork: Optional[Dict[str, Any]] = None  # fork_info() when this run is (or resumes) a fork
        self.forking = False  # this process starts the fork (new MLflow run, fresh detector/monitors)
        self.order_path: Optional[Path] = None
        self.tracker = None
        self.monitors = None
        self.detector = None
        self.dist = None
        self.is_main = True

    # ---------------------------------------------------------------------------------------------- setup
    def _init_dist(self):
        from orchestrator.distributed import init_distributed

        self.dist = init_distributed(self.cfg.dist, device=self.cfg.train.device, slot=_job_slot())
        self.is_main = self.dist.is_main
        return self.dist.device

    def _resume_state(self) -> Optional[Dict[str, Any]]:
        cfg = self.cfg
        path = cfg.resume
        if cfg.train.auto_resume and checkpoint.latest(self.job_dir) is not None:
            path = checkpoint.latest(self.job_dir)  # a requeued job continues where it stopped (even after resume=)
        if path is None and cfg.from_checkpoint is not None:
            from orchestrator.fork import fork_info, resolve_order, source_decay
            state = checkpoint.check_compatible(cfg.from_checkpoint, cfg.model, key="from_checkpoint")
            self.forking = True
            info = fork_info(cfg.from_checkpoint, state, cfg.optimizer.decay_steps or source_decay(state))
            info["batch_order"] = str(resolve_order(cfg.from_checkpoint, state, cfg.data.replay))
            self._set_fork(info)
            return state
        if path is None:
            return None
        state = checkpoint.check_compatible(path, cfg.model)
        self.result["resumed_from"] = str(path)
        if state.get("fork"):  # a requeued fork resumes its own run and still knows where it came from
            self._set_fork(state["fork"])
        return state

    def _set_fork(self, info: Dict[str, Any]) -> None:
        self.fork = dict(info)
        self.result.update({k: info.get(k) for k in ("forked_from", "fork_step", "source_run_id")})
        if self.cfg.optimizer.decay_steps is None and info.get("decay_steps"):
            self.cfg.optimizer.decay_steps = int(info["decay_steps"])  # the source's lr schedule

    def _stream(self, data_dir: Path, start: int):
        from orchestrator.data import BatchStream

        cfg, world = self.cfg, self.dist.world_size
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
                             grad_accum=cfg.train.grad_accum, start_step=start)
        stream.check_covers(cfg.train.max_steps)
        self.order_path = stream.paths[0] if stream.paths else None
        return stream

    def _batches(self, stream, step: int):
        world, rank = self.dist.world_size, self.dist.rank
        mine = [m for m in range(self.cfg.train.grad_accum) if m % world == rank]
        if stream.writer is not None and world > 1:  # the recorder must see every micro-batch, in order
            return [b for m, b in ((m, stream.get(step, m)) for m in range(self.cfg.train.grad_accum))
                    if m % world == rank]
        return [stream.get(step, m) for m in mine]

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> Dict[str, Any]:
        t_start = time.perf_counter()
        try:
            return self._run()
        finally:
            self.result["wall_s"] = round(time.perf_counter() - t_start, 3)

    def _run(self) -> Dict[str, Any]:
        from models import GPT
        from orchestrator.data import ensure_prepared, val_batches
        from orchestrator.monitors import Monitors
        from orchestrator.tracking import Tracker, describe_run
        from orchestrator.verdict import DivergenceDetector

        cfg, tc = self.cfg, self.cfg.train
        device = self._init_dist()
        world = self.dist.world_size
        if tc.grad_accum % world:
            from orchestrator.validate import ConfigError
            raise ConfigError(f"train.grad_accum={tc.grad_accum} is not allowed with {world} ranks: expected a "
                              f"multiple of the world size")
        seed_everything(tc.seed)
        model = GPT(cfg.model, self.attention).to(device)
        self.result["attention_routes"] = model.attention_routes()
        optimizer = build_optimizer(model, cfg.optimizer, device)
        state = self._resume_state()
        start = int(state["step"]) if state else 0
        resuming = bool(state) and not self.forking  # a fork starts a new run: fresh MLflow run, detector, monitors
        if state:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        train_model = model
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP
            train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

        data_dir = ensure_prepared(cfg.data, cfg.model.vocab_size)
        stream = self._stream(data_dir, start)
        val = val_batches(data_dir / "val.bin", cfg.model.block_size, tc.batch_size, tc.eval_batches, seed=0)

        iv = cfg.intervention
        if self.fork:
            fork_tags = {"forked_from": self.fork["forked_from"], "fork_step": self.fork["fork_step"]}
            if self.fork.get("source_run_id"):
                fork_tags["forked_from_run"] = self.fork["source_run_id"]
        else:
            fork_tags = {}
        sweep_tags = {**fork_tags, "intervention": iv.name, "expect": iv.expect, "paper": iv.paper,
                      "sweep": cfg.sweep_name, "experiment": cfg.name, "job_dir": str(self.job_dir),
                      "overrides": " ".join(self.overrides), "attention_routes": ",".join(
                          self.result["attention_routes"])}
        run_name = _run_name(iv.name, self.overrides) + (f" fork@{self.fork['fork_step']}" if self.fork else "")
        self.tracker = Tracker(cfg.tracking, run_name[:250],
                               experiment=cfg.tracking.experiment or cfg.sweep_name,
                               run_id=state.get("mlflow_run_id") if resuming else None, enabled=self.is_main,
                               tags=sweep_tags, description=describe_run(iv.name, iv.expect, iv.paper))
        self.result["mlflow_run_id"] = self.tracker.run_id
        if self.is_main:
            resolved = self.job_dir / "config_resolved.yaml"
            resolved.parent.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(OmegaConf.structured(cfg), resolved)
            if not resuming:
                self.tracker.log_params({**OmegaConf.to_container(OmegaConf.structured(cfg)),
                                         "attention_effective": OmegaConf.to_container(
                                             OmegaConf.structured(self.attention)),
                                         # which code computes each layer (triton | emulator | standard | sdpa)
                                         "attention_route": {f"L{i}": r for i, r in
                                                             enumerate(self.result["attention_routes"])}})
                self.tracker.log_artifact(resolved)
            self.tracker.set_tags({**sweep_tags, "verdict": "running"})

        self.monitors = Monitors(model, cfg.monitor, self.tracker)
        self.detector = DivergenceDetector(cfg.verdict)
        if resuming or (self.forking and cfg.verdict.fork_baseline == "source"):  # checked by fork.check_fork
            self.detector.load_state_dict(state["detector"])
            mon = state.get("monitor", {})
            if mon.get("peak_wq") is not None:
                self.monitors.peak_wq, self.monitors.peak_wq_where = mon["peak_wq"], mon["peak_wq_where"]
        if state:
            checkpoint.set_rng_state(state["rng"])  # last: model building above consumed the RNG

        guard = self._guard()
        autocast = _autocast(device, tc.precision)
        accum_local = tc.grad_accum // world
        tokens_per_step = tc.batch_size * cfg.model.block_size * tc.grad_accum
        decay = cfg.optimizer.decay_steps or tc.max_steps
        min_ratio = cfg.optimizer.min_lr / cfg.optimizer.lr
        clip = tc.grad_clip if tc.grad_clip > 0 else math.inf
        nan = torch.tensor(float("nan"), device=device)
        done = start
        val_done_at = None
        bar = tqdm(total=tc.max_steps, initial=start, disable=not self.is_main, desc=iv.name, dynamic_ncols=True,
                   mininterval=1.0)
        self.monitors.reset_clock()
        try:
            for step in range(start, tc.max_steps):
                if cfg.debug.raise_at_step == step:
                    raise RuntimeError(f"debug.raise_at_step={step}: forced failure")
                lr_f = lr_factor(step, tc.warmup_steps, decay, min_ratio)
                set_lr(optimizer, lr_f)
                loss_sum = torch.zeros((), device=device)
                for i, (x, y) in enumerate(self._batches(stream, step)):
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    sync = (train_model.no_sync() if world > 1 and i < accum_local - 1 else contextlib.nullcontext())
                    with sync:
                        with autocast:
                            _, loss = train_model(x, y)
                        loss = loss / accum_local
                        if cfg.debug.nan_at_step == step:
                            loss = loss * nan  # poisons the grads too, as a real overflow would
                        loss.backward()
                    loss_sum += loss.detach()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done = step + 1
                if world > 1:  # the logged loss is the global batch's, like the single-process run
                    import torch.distributed as tdist
                    tdist.all_reduce(loss_sum, op=tdist.ReduceOp.AVG)
                host = self.monitors.step_end(step, loss_sum, grad_norm, cfg.optimizer.lr * lr_f, tokens_per_step)
                if host:
                    self.detector.update(host)
                    tps = self.monitors.last_tokens_per_s
                    bar.set_postfix(loss=f"{host[-1][1]:.4f}", tok_s=f"{tps:,.0f}" if tps else "-", refresh=False)
                bar.update(1)
                last = done == tc.max_steps
                if (tc.eval_every and done % tc.eval_every == 0) or last:
                    self._log_val(model, val, device, step)
                    val_done_at = step
                if (tc.ckpt_every and done % tc.ckpt_every == 0) or last:
                    self._save(model, optimizer, done, "last.pt", keep_step=True)
                if tc.early_stop and self.detector.should_stop(step):
                    self.result["early_stopped"] = True
                    break
                if guard is not None and guard.should_stop(step):
                    self._save(model, optimizer, done, "last.pt")
                    self.tracker.flush()
                    guard.exit_for_requeue(f"step {done}")
            if self.result["early_stopped"]:
                if val_done_at != done - 1:
                    self._log_val(model, val, device, done - 1)
                self._save(model, optimizer, done, "last.pt", keep_step=True)
            self._finish(stream, done, status="FINISHED")
        except Exception as e:
            self.result["error"] = f"{type(e).__name__}: {e}"
            self._crash(model, optimizer, done, stream)
            raise
        except BaseException:  # preemption (SystemExit) or ^C: the checkpoint is saved; leave the run open
            self._close_quietly(stream, "KILLED")
            raise
        finally:
            bar.close()
            if guard is not None:
                guard.uninstall()
        return self.result

    # -------------------------------------------------------------------------------------------- pieces
    def _guard(self):
        try:
            from orchestrator.preemption import PreemptionGuard
        except ImportError:
            return None
        return PreemptionGuard(dist_info=self.dist, check_every=self.cfg.dist.preempt_check_every).install()

    def _log_val(self, model, val, device, step: int) -> None:
        v = float(evaluate(model, val, device, self.cfg.train.precision))  # one sync per eval, not per step
        self.result["val_loss"] = v
        self.monitors.log_val(step, v)

    def _sync_monitors(self) -> None:
        host = self.monitors.flush()
        if host:
            self.detector.update(host)

    def _save(self, model, optimizer, done: int, name: str, keep_step: bool = False) -> Optional[Path]:
        """Flush the monitors first so the checkpoint's detector state and MLflow agree on the last step.
        keep_step: also keep it as step_<done>.pt (periodic and final checkpoints: what a fork starts from)."""
        self._sync_monitors()
        if not self.is_main:
            return None
        path = self.job_dir / CKPT_DIR / name
        state = {
            "step": done, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": checkpoint.rng_state(), "detector": self.detector.state_dict(),
            "monitor": {"peak_wq": self.monitors.peak_wq if math.isfinite(self.monitors.peak_wq) else None,
                        "peak_wq_where": self.monitors.peak_wq_where},
            "mlflow_run_id": self.tracker.run_id if self.tracker else None,
            "model_shape": checkpoint.model_shape(self.cfg.model),
            "config": OmegaConf.to_container(OmegaConf.structured(self.cfg)),
            "batch_order": str(self.order_path) if self.order_path else None, "job_dir": str(self.job_dir),
            "fork": self.fork}
        if keep_step:
            checkpoint.save_step(path.parent, done, state, keep=self.cfg.train.keep_checkpoints,
                                 protect_before=self.detector.divergence_step, last=name)
        else:
            checkpoint.save(path, state)
        self.result["checkpoint"] = str(path)
        return path

    def _fill_verdict(self, done: int) -> None:
        d, m = self.detector, self.monitors
        self.result.update(observed=d.observed, divergence_step=d.divergence_step, final_loss=d.final_loss,
                           min_loss=d.min_loss if math.isfinite(d.min_loss) else None,
                           min_loss_step=d.min_loss_step, steps_done=done,
                           peak_wq_norm=m.peak_wq if math.isfinite(m.peak_wq) else None,
                           peak_wq_where=m.peak_wq_where)

    def _finish(self, stream, done: int, status: str) -> None:
        self._sync_monitors()
        self._fill_verdict(done)
        stream.close()
        if self.is_main:
            r = self.result
            self.tracker.set_tags({"verdict": r["observed"], "divergence_step": r["divergence_step"],
                                   "matches_expect": (r["observed"] == "diverged") == (r["expected"] == "diverges"),
                                   "early_stopped": r["early_stopped"]})
            for p in stream.paths:
                if p.exists():
                    self.tracker.log_artifact(p)
        self.tracker.close(status)

    def _crash(self, model, optimizer, done: int, stream) -> None:
        """Record what is known: monitors flushed, verdict 'failed', a crash checkpoint when the weights are sane."""
        if self.monitors is not None:
            try:
                self._sync_monitors()
                self._fill_verdict(done)
            except Exception:
                pass
        self.result["observed"] = "failed"
        try:
            if self.detector is not None and done > 0 and _finite_params(model):
                self._save(model, optimizer, done, "crash.pt")
        except Exception:
            pass
        if self.tracker is not None:
            try:
                self.tracker.set_tags({"verdict": "failed", "error": self.result["error"]})
            except Exception:
                pass
        self._close_quietly(stream, "FAILED")

    def _close_quietly(self, stream, status: str) -> None:
        try:
            stream.close()
        except Exception:
            pass
        if self.tracker is not None:
            try:
                self.tracker.close(status)
            except Exception:
                pass


def train(cfg, attention, job_dir: Path, overrides: List[str]) -> Dict[str, Any]:
    return Job(cfg, attention, job_dir, overrides).run()


__all__ = ["Job", "train", "evaluate", "seed_everything", "CKPT_DIR", "ORDER_FILE"]
