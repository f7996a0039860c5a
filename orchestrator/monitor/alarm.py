"""monitor.alarm: an early warning inside a run. Off by default.

It listens to the points the monitors hand to the tracker (the job's tracker is wrapped, `attach`), so it sees host
floats at flush steps only: no new device syncs, and exactly what MLflow stores, which is what
`flash-forensics early-warning` replays to choose a signal and threshold (orchestrator/monitor/signals.py computes
the signal both times). The first time the signal passes the threshold it fires, once:
- MLflow tags ff.alarm.step, ff.alarm.signal, ff.alarm.value (and .threshold, .action) on the run;
- a checkpoint at the step boundary right after the flush that fired, `checkpoints/alarm_<k>.pt` (k = steps done;
  not a step_<k>.pt, so pruning and auto-resume leave it alone), written by the job's checkpoint code;
- action stop: the run ends cleanly (early_stopped, verdict as far as it got, `alarm.stopped` and its reason in
  result.json); not a failure;
- action fork: a detached child job `python run.py from_checkpoint=<that checkpoint> intervention=<fork_intervention>
  data.replay=<a full copy of this run's batch order> hydra.run.dir=<job dir>/alarm_fork ...` (this run's other
  overrides, the alarm off), launched with its own session; this run goes on. The command, pid and log are in
  result.json and the tag ff.alarm.fork_command; when the launch fails, the command is recorded with the error.
Every action records `alarm` in result.json. Its state (the firing, the signals' windows) is in the job's checkpoints:
a resumed run neither fires a second time nor acts twice; one that the alarm stopped, rerun, stops again.
"""
from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from flash_forensics.orchestrator.data import BatchStream
from flash_forensics.orchestrator.errors import ConfigError
from flash_forensics.orchestrator.interventions import spec
from flash_forensics.orchestrator.job import checkpoint_policy as snapshot
from flash_forensics.orchestrator.monitor.signals import PROBE_SIGNALS, SIGNALS, SignalState, crossed

ACTIONS = ("tag", "checkpoint", "stop", "fork")
ROOT = Path(__file__).resolve().parents[2]
FORK_DIR = "alarm_fork"  # the fork child's job folder, inside this job's
FORK_ORDER = "alarm_batch_order.bin"  # this run's batch order over all train.max_steps, for the child to replay
# overrides that the fork child sets itself (or that name this run's place, launcher or alarm), never copied
_NOT_COPIED = ("intervention", "from_checkpoint", "resume", "data.replay", "hydra", "sweep", "monitor.alarm")


@dataclass
class AlarmConfig:
    enabled: bool = False
    # orchestrator/monitor/signals.py: rmax_rate max_logit max_logit_head entropy wq_sigma wq_growth delta_cumsum
    # val_rise grad_spike loss_spike
    signal: str = "max_logit"
    threshold: float = 1000.0  # fires when the signal is strictly above it (entropy: below)
    action: str = "tag"  # tag | checkpoint | stop | fork (each also tags; all but tag write a checkpoint)
    fork_intervention: str = "sfa"  # action=fork: the intervention the child job runs from the alarm checkpoint
    growth_window: int = 100  # steps over which wq_growth measures d ln sigma / d step
    spike_window: int = 100  # logged values whose median grad_spike and loss_spike compare against

    def validate(self, key: str = "monitor.alarm", monitor=None) -> "AlarmConfig":
        def bad(name, v, allowed):
            return ValueError(f"{key}.{name}={v!r} is not allowed: expected {allowed}")
        if not isinstance(self.enabled, bool):
            raise bad("enabled", self.enabled, "true or false")
        if self.signal not in SIGNALS:
            raise bad("signal", self.signal, "one of " + ", ".join(SIGNALS))
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or \
                not math.isfinite(self.threshold):
            raise bad("threshold", self.threshold, "a finite number")
        if self.action not in ACTIONS:
            raise bad("action", self.action, "one of " + ", ".join(ACTIONS))
        if isinstance(self.growth_window, bool) or not isinstance(self.growth_window, int) or self.growth_window <= 0:
            raise bad("growth_window", self.growth_window, "an integer > 0 (steps)")
        if isinstance(self.spike_window, bool) or not isinstance(self.spike_window, int) or self.spike_window <= 0:
            raise bad("spike_window", self.spike_window, "an integer > 0 (logged values)")
        if self.enabled and self.action == "fork":
            allowed = spec.names()
            if self.fork_intervention not in allowed:
                raise bad("fork_intervention", self.fork_intervention, "one of " + ", ".join(allowed))
            from omegaconf import OmegaConf
            if OmegaConf.load(spec.path(self.fork_intervention)).get("model"):
                raise bad("fork_intervention", self.fork_intervention,
                          "an intervention without a model patch (a fork loads this run's weights, so it cannot "
                          "change the model)")
        if self.enabled and monitor is not None:
            self._check_produced(key, monitor)
        return self

    def _check_produced(self, key: str, monitor) -> None:
        """The signal's metrics are logged at all (an alarm that can never fire is refused)."""
        off = {"rmax_rate": not monitor.counters, "max_logit": not monitor.max_logit}
        if self.signal in PROBE_SIGNALS:
            probes = getattr(monitor, "probes", None)
            off[self.signal] = not (probes is not None and getattr(probes, "enabled", False))
        if off.get(self.signal):
            raise ValueError(f"{key}.signal={self.signal!r} is not allowed with {SIGNALS[self.signal].needs} off: "
                             f"its metrics are not logged, so the alarm could never fire")


class Alarm:
    """The online check. `observe(step, metrics)` at each logged batch of host floats; `pending` once it fired;
    the train loop then calls `act(...)` at the step boundary (True: stop the run)."""

    def __init__(self, cfg: AlarmConfig, start_step: int = 0):
        self.cfg = cfg
        self.signal = SIGNALS[cfg.signal]
        self.state = SignalState(cfg.growth_window, start_step, cfg.spike_window)
        self.fired: Optional[Dict[str, Any]] = None
        self.pending = False

    def observe(self, step: int, metrics) -> None:
        if self.fired is not None:
            return
        v = self.state.update(int(step), metrics).get(self.cfg.signal)
        if v is not None and crossed(self.signal.direction, v, self.cfg.threshold):
            self.fired = {"step": int(step), "signal": self.cfg.signal, "value": v, "threshold": self.cfg.threshold,
                          "direction": self.signal.direction, "action": self.cfg.action}
            self.pending = True
            print(f"[alarm] {self.cfg.signal}={v:.6g} at step {step} ({self.signal.direction} "
                  f"{self.cfg.threshold:g}): {self.cfg.action}", flush=True)

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs to neither fire a second time nor forget its firing (checkpoints hold it)."""
        return {"fired": self.fired, "pending": self.pending, "signals": self.state.state_dict()}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        if not state:  # a checkpoint of a run without the alarm, or from before it was saved: start fresh
            return
        self.fired, self.pending = state.get("fired"), bool(state.get("pending"))
        if self.fired and self.fired.get("stopped"):  # a run it stopped, rerun: stops again at its next boundary
            self.pending = True
        self.state.load_state_dict(state.get("signals") or {})

    def act(self, job, model, optimizer, done: int, stream) -> bool:
        """Tag, checkpoint, then stop or fork; the record's `alarm` says what was done. True: end the run."""
        self.pending = False
        f = self.fired
        job.result["alarm"] = f
        job.tracker.set_tags({f"ff.alarm.{k}": f[k] for k in ("step", "signal", "value", "threshold", "action")})
        if self.cfg.action == "tag":
            return False
        path = snapshot.save(job, model, optimizer, done, f"alarm_{done}.pt")
        if path is not None:
            f["checkpoint"] = str(path)
        if self.cfg.action == "stop":
            f["stopped"] = True
            f["reason"] = (f"stopped by monitor.alarm after {done} steps: {f['signal']}={f['value']:.6g} "
                           f"{f['direction']} {f['threshold']:g} at step {f['step']}")
            return True
        if self.cfg.action == "fork" and job.is_main and path is not None:
            f.update(launch_fork(job, path, stream, self.cfg.fork_intervention))
            job.tracker.set_tags({"ff.alarm.fork_command": f["fork_command"]})
        return False


class _Listening:
    """The job's tracker, with every logged batch of metrics also shown to the alarm (after it is queued)."""

    def __init__(self, tracker, alarm: Alarm):
        self._tracker, self._alarm = tracker, alarm

    def log_metrics(self, metrics, step: int) -> None:
        self._tracker.log_metrics(metrics, step=step)
        self._alarm.observe(step, metrics)

    def __getattr__(self, name):
        return getattr(self._tracker, name)


def attach(job, start_step: int) -> Optional[Alarm]:
    """The job's alarm (None when monitor.alarm is off), listening on job.tracker from here on."""
    cfg = job.cfg.monitor.alarm
    if not cfg.enabled:
        return None
    if cfg.action == "stop" and job.dist is not None and job.dist.world_size > 1:
        raise ConfigError(f"monitor.alarm.action='stop' is not allowed with {job.dist.world_size} DDP ranks: "
                          f"expected tag, checkpoint or fork (each rank counts its own repeated maxima, so the "
                          f"ranks would not stop at the same step)")
    alarm = Alarm(cfg, start_step)
    job.tracker = _Listening(job.tracker, alarm)
    # armed, not fired (step None): the report counts a quiet alarm too (a miss, or a stable run it rightly spared)
    job.result["alarm"] = {"step": None, "signal": cfg.signal, "threshold": cfg.threshold,
                           "direction": alarm.signal.direction, "action": cfg.action}
    why = cannot_fire(cfg.signal, job.result.get("attention_routes") or [])
    if why:  # allowed (a sweep's SDPA control beside flash runs), but said: a quiet alarm here means nothing
        print(f"[job] warning: monitor.alarm.signal={cfg.signal} can never fire in this run: {why}", flush=True)
        job.result["alarm"]["inactive"] = why
        job.tracker.set_tags({INACTIVE_TAG: why})
    return alarm


INACTIVE_TAG = "ff.alarm.inactive"


def cannot_fire(signal: str, routes) -> Optional[str]:
    """Why the signal is never logged with these attention routes (None: it can be). rmax_rate reads the kernels'
    repeated-maxima counters, which SDPA never computes and attention.counters=false turns off; every route then
    says no-counters. (monitor.counters=false is refused before launch: orchestrator/monitor/alarm.py validate.)"""
    if signal == "rmax_rate" and routes and all("no-counters" in r for r in routes):
        return f"no layer counts repeated maxima (attention routes: {', '.join(dict.fromkeys(routes))})"
    return None


# ------------------------------------------------------------------------------------------------ the fork
def fork_overrides(overrides: List[str], ckpt: Path, order: Path, intervention: str, job_dir: Path) -> List[str]:
    """The child's overrides: this run's own, less what the fork sets itself, plus the fork's."""
    def key(o):
        return o.split("=", 1)[0].lstrip("+~")
    def copied(o):
        return not any(key(o) == k or key(o).startswith((k + ".", k + "/")) for k in _NOT_COPIED)
    kept = [o for o in overrides if copied(o)]
    return [*kept, f"from_checkpoint={ckpt}", f"intervention={intervention}", f"data.replay={order}",
            "monitor.alarm.enabled=false", f"hydra.run.dir={job_dir / FORK_DIR}"]


def write_full_order(stream, path: Path, n_steps: int) -> Path:
    """This run's batch order for steps 0..n_steps-1 in one file (the recording so far only covers the steps done):
    the order is a pure function of the seed, or the replayed file's, so the rest is written as the run will see
    it."""
    replay = stream.reader.path if stream.reader is not None else None
    BatchStream(stream.bin_path, stream.block_size, stream.batch_size, stream.seed, record_path=path,
                replay_path=replay, grad_accum=stream.grad_accum, start_step=n_steps).close()
    return path


def launch_fork(job, ckpt: Path, stream, intervention: str) -> Dict[str, Any]:
    """Start the child job detached (own session, log in its folder); the command is recorded either way."""
    order = write_full_order(stream, job.job_dir / FORK_ORDER, job.cfg.train.max_steps)
    cmd = [sys.executable, str(ROOT / "run.py"),
           *fork_overrides(job.overrides, ckpt, order, intervention, job.job_dir)]
    out = {"fork_command": " ".join(shlex.quote(c) for c in cmd), "fork_dir": str(job.job_dir / FORK_DIR)}
    log = job.job_dir / FORK_DIR / "launch.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as fh:
            p = subprocess.Popen(cmd, cwd=str(ROOT), stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                 start_new_session=True, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
        out.update(fork_pid=p.pid, fork_log=str(log))
        print(f"[alarm] forked {intervention} (pid {p.pid}, log {log}): {out['fork_command']}", flush=True)
    except OSError as e:
        out["fork_error"] = f"not launched ({e}): run the command by hand"
        print(f"[alarm] fork not launched ({e}); the command: {out['fork_command']}", flush=True)
    return out


__all__ = ["AlarmConfig", "Alarm", "ACTIONS", "attach", "fork_overrides", "write_full_order", "launch_fork"]
