"""Training monitors: the paper's signals, gathered on the device and moved to the host in one transfer.

Per step: train loss, grad norm, lr (kept as 0-d device tensors / floats). Every `wq_every` steps: the top singular
value of W_Q per (layer, head) (the paper's Fig. 2 signal). At each flush (every `log_every` steps): the kernels'
repeated-maxima row counts per (layer, head), the numerical-failure counts per (layer, head) (rows whose softmax
row sum underflowed, rows where the stabilized softmax fired but P̄ still rounded to 1; kernels/stats.py) and the max
attention logit per layer, accumulated since the last flush and then reset. The failure counts are also summed over
the run on the host (`numerics`, checkpointed) so the job can turn them into a warning tag. Everything is stacked into
one device tensor and copied to the host once, so the hot path never waits on the GPU except at that single copy.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.monitor.alarm import AlarmConfig
from flash_forensics.orchestrator.monitor.capture_config import CaptureConfig
from flash_forensics.orchestrator.monitor.probes.config import ProbesConfig


@dataclass
class MonitorConfig:
    log_every: int = 10  # steps between host transfers (and MLflow posts)
    wq_every: int = 50  # steps between W_Q spectral norm probes (an SVD per head: not free)
    counters: bool = True  # log the kernels' repeated-maxima row counts per (layer, head)
    max_logit: bool = True  # log the max scaled attention score per layer
    # early warning (orchestrator/monitor/alarm.py), off by default
    alarm: AlarmConfig = field(default_factory=AlarmConfig)
    probes: ProbesConfig = field(default_factory=ProbesConfig)  # mechanism probes (orchestrator/monitor/probes/)
    capture: CaptureConfig = field(default_factory=CaptureConfig)  # attention snapshots (flash_forensics/capture/)

    def validate(self, key: str = "monitor", n_layer: Optional[int] = None, n_head: Optional[int] = None,
                 forking: Optional[bool] = None) -> "MonitorConfig":
        for name in ("log_every", "wq_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{key}.{name}={v!r} is not allowed: expected an integer > 0")
        self.alarm.validate(key=f"{key}.alarm", monitor=self)
        self.probes.validate(key=f"{key}.probes", n_layer=n_layer)
        self.capture.validate(key=f"{key}.capture", n_layer=n_layer, n_head=n_head,
                              alarm_enabled=self.alarm.enabled, forking=forking, alarm_action=self.alarm.action)
        return self


NUMERICS = ("underflow_rows", "sfa_p1_rows", "fp16_overflow", "fp8_saturated", "pbar_flushed")  # AttnStats
# counters of numerical failures, logged per (layer, head); the last three (kernels/formats.py) also warn once each


def _unwrap(model):
    return getattr(model, "module", model)  # DDP / compiled wrappers keep the GPT in .module


class Monitors:
    """Buffers per-step signals on the device; `step_end` returns host losses only when it flushed."""

    def __init__(self, model, cfg: MonitorConfig, tracker=None):
        self.model = _unwrap(model)
        self.cfg = cfg
        self.tracker = tracker
        self._steps: List[int] = []
        self._losses: List[torch.Tensor] = []
        self._grad_norms: List[torch.Tensor] = []
        self._lrs: List[float] = []
        self._wq: List[Tuple[int, torch.Tensor]] = []
        self._tokens = 0
        self._t0 = time.perf_counter()
        self.last_tokens_per_s: Optional[float] = None
        self.peak_wq: float = -math.inf  # largest W_Q sigma seen, and where (for result.json)
        self.peak_wq_where: Optional[str] = None
        self.numerics = {name: 0 for name in NUMERICS}  # run totals of the failure counters (host ints)
        self._counting: set = set()  # failure-counter metrics logged so far (each since its first non-zero count)
        self._warned: set = set()  # format counters already warned about

    def reset_clock(self) -> None:
        """Call right before the first step (after compile/warm-up) so tokens/s measures training only."""
        self._t0 = time.perf_counter()
        self._tokens = 0

    def step_end(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float,
                 tokens: int) -> List[Tuple[int, float]]:
        """Record one optimizer step; every log_every steps flush and return [(step, loss)] on the host."""
        self._steps.append(int(step))
        self._losses.append(loss.detach().reshape(()) if torch.is_tensor(loss) else torch.tensor(float(loss)))
        self._grad_norms.append(grad_norm.detach().reshape(()) if torch.is_tensor(grad_norm)
                                else torch.tensor(float(grad_norm)))
        self._lrs.append(float(lr))
        self._tokens += int(tokens)
        if step % self.cfg.wq_every == 0 and hasattr(self.model, "wq_spectral_norms"):
            with torch.no_grad():
                wq = self.model.wq_spectral_norms().detach().float()  # (n_layer, n_head)
            self._wq_heads = wq.shape[-1]
            self._wq.append((int(step), wq))
        # steps are 0-based: flushing after step log_every-1, 2*log_every-1, ... lines up with checkpoints taken
        # when (step + 1) % ckpt_every == 0; W_Q is probed at step 0 (the initial weights) and every wq_every
        if (step + 1) % self.cfg.log_every == 0 or len(self._steps) >= self.cfg.log_every:
            return self.flush()
        return []

    def log_val(self, step: int, val_loss) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics({record.VAL_LOSS: float(val_loss)}, step=int(step))

    def _layer_stats(self):
        stats = self.model.attention_stats() if hasattr(self.model, "attention_stats") else []
        return [s for s in stats if s is not None]

    def flush(self) -> List[Tuple[int, float]]:
        """One device->host copy of everything buffered; log it; reset the kernel counters."""
        if not self._steps and not self._wq:
            return []
        parts, layout = [], []  # layout: (name, count, shape) to cut the host vector apart again

        def add(name, t):
            t = t.reshape(-1)
            parts.append(t.to(torch.float64) if t.device.type != "mps" else t.float())
            layout.append((name, t.numel()))

        n = len(self._steps)
        if n:
            add("loss", torch.stack([x.to(self._losses[0].device) for x in self._losses]))
            add("grad_norm", torch.stack([x.to(self._losses[0].device) for x in self._grad_norms]))
        for step, wq in self._wq:
            add(f"wq@{step}", wq)
        stats = self._layer_stats() if n else []
        if self.cfg.counters:
            for layer, s in enumerate(stats):
                add(f"rmax@{layer}", s.repeated_max_rows)
                for name in NUMERICS:
                    add(f"{name}@{layer}", getattr(s, name))
        if self.cfg.max_logit:
            for layer, s in enumerate(stats):
                add(f"logit@{layer}", s.max_logit)
        device = parts[0].device
        host = torch.cat([p.to(device) for p in parts]).cpu().tolist()  # the one sync
        for s in stats:  # stream-ordered after the copy above: counts restart for the next interval
            s.reset()
        now = time.perf_counter()
        elapsed, tokens = now - self._t0, self._tokens
        self._t0, self._tokens = now, 0

        values, i = {}, 0
        for name, count in layout:
            values[name] = host[i:i + count]
            i += count
        steps, lrs = self._steps, self._lrs
        self._steps, self._losses, self._grad_norms, self._lrs = [], [], [], []
        wq_steps = [s for s, _ in self._wq]
        self._wq = []

        losses = list(zip(steps, values["loss"])) if n else []
        if n and elapsed > 0:
            self.last_tokens_per_s = tokens / elapsed
        for wstep in wq_steps:
            self._track_peak_wq(values[f"wq@{wstep}"])
        if self.cfg.counters:
            for layer in range(len(stats)):
                for name in NUMERICS:
                    self.numerics[name] += int(sum(values[f"{name}@{layer}"]))
                    self._warn_format(name, layer, values[f"{name}@{layer}"])
        if self.tracker is None:
            return losses
        for k, step in enumerate(steps):
            point = {record.LOSS: values["loss"][k], record.LR: lrs[k]}
            g = values["grad_norm"][k]
            if math.isfinite(g):
                point[record.GRAD_NORM] = g
            else:  # a flag, not MLflow's float maximum on the chart's axis
                point[record.GRAD_NORM + record.NONFINITE_SUFFIX] = 1.0
            if not math.isfinite(values["loss"][k]):  # the NaN/Inf point stays in train/loss (train/loss_finite)
                point[record.LOSS + record.NONFINITE_SUFFIX] = 1.0
            self.tracker.log_metrics(point, step=step)
        if n:
            last = steps[-1]
            flushed = {}
            if self.last_tokens_per_s is not None:
                flushed[record.TOKENS_PER_S] = self.last_tokens_per_s
            for layer in range(len(stats)):
                if self.cfg.counters:
                    for h, c in enumerate(values[f"rmax@{layer}"]):
                        flushed[record.rmax_rows_name(layer, h)] = c
                    for name in NUMERICS:  # a failure counter's series starts at its first non-zero count:
                        for h, c in enumerate(values[f"{name}@{layer}"]):  # 40 zero charts hid the loss
                            key = f"{name}/L{layer}.H{h}"
                            if c or key in self._counting:
                                self._counting.add(key)
                                flushed[key] = c
                logit = values[f"logit@{layer}"][0] if self.cfg.max_logit else -math.inf
                if logit != -math.inf:  # -inf: nothing measured this interval (sdpa without probe)
                    flushed[record.max_logit_name(layer)] = logit
            self.tracker.log_metrics(flushed, step=last)
        for wstep in wq_steps:
            self.tracker.log_metrics(self._wq_metrics(values[f"wq@{wstep}"]), step=wstep)
        return losses

    def _warn_format(self, name: str, layer: int, per_head: List[float]) -> None:
        """The first non-zero count of a format counter (FP16 overflow, FP8 saturation, P̄ flushed), warned once."""
        if name not in NUMERICS[2:] or name in self._warned or not any(per_head):
            return
        self._warned.add(name)
        h = max(range(len(per_head)), key=lambda i: per_head[i])
        warnings.warn(f"attention {name}: layer {layer} head {h} counted {int(per_head[h])} (metric "
                      f"{name}/L{layer}.H{h}; kernels/formats.py); warned once per run", RuntimeWarning, stacklevel=2)

    def numerics_warning(self) -> Optional[str]:
        """One sentence when a numerical failure was counted during the run, else None."""
        uf, p1 = self.numerics["underflow_rows"], self.numerics["sfa_p1_rows"]
        parts = []
        if uf:
            try:
                routes = self.model.attention_routes() if hasattr(self.model, "attention_routes") else []
            except Exception:
                routes = []
            sfa = any("+sfa" in r for r in routes)
            why = ("the exact Algorithm 3 shift is too large, use softmax=stabilized_guarded or a smaller beta" if sfa
                   else "with the safe softmax this means non-finite (NaN or inf) scores reached attention, e.g. "
                        "after the loss diverged, or every key of a row was masked")
            parts.append(f"{uf} attention rows whose softmax row sum underflowed (NaN or zero rows; metric "
                         f"underflow_rows/L*.H*): {why}")
        if p1:
            parts.append(f"{p1} (row, tile) pairs where the stabilized softmax fired but P̄ still rounded to 1 "
                         f"(metric sfa_p1_rows/L*.H*)")
        parts += [f"{self.numerics[n]} {n} (metric {n}/L*.H*)" for n in NUMERICS[2:] if self.numerics[n]]
        return "; ".join(parts) or None

    def _n_head(self) -> int:
        if getattr(self, "_wq_heads", None):
            return int(self._wq_heads)
        cfg = getattr(self.model, "config", None) or getattr(self.model, "cfg", None)
        return int(getattr(cfg, "n_head", 0) or 0)

    def _wq_metrics(self, flat: List[float]) -> dict:
        n_head = self._n_head() or len(flat)
        return {record.wq_sigma_name(i // n_head, i % n_head): v for i, v in enumerate(flat)}

    def _track_peak_wq(self, flat: List[float]) -> None:
        n_head = self._n_head() or len(flat)
        for i, v in enumerate(flat):
            if v > self.peak_wq:
                self.peak_wq, self.peak_wq_where = v, record.head_where(i // n_head, i % n_head)


__all__ = ["MonitorConfig", "Monitors"]
