"""Mechanism probes in the job: when to probe, how to capture a layer's own Q, K, V, O, dO and dQ without touching
training, and what goes to MLflow. The math is kernels/probes.py.

A probe (every `monitor.probes.every` steps from step 0, and at each checkpoint) is one extra forward+backward of a
fixed batch of `batch` validation sequences through the eager model (never the compiled or DDP wrapper) in eval mode
(no dropout, no train hooks' observers), under the run's autocast. `CausalSelfAttention.probe_capture` keeps each
probed layer's input x and its (q, k, v, O); `torch.autograd.grad(loss, O's + q's)` returns dO and the run's dQ
without accumulating into any parameter's .grad. The RNG is forked around it (torch.random.fork_rng) and the kernel
counters are snapshotted and restored, so grads, RNG, optimizer state, counters and the batch stream are as if no
probe ran (tests/integration/test_probes.py checks bit-identical losses). Only probe steps read values back to the host
(one transfer); other steps cost one integer test.

State kept across probes, saved in checkpoints and restored on resume: the cumulative sum of the delta-error mean
per layer (Fig. 5a) and the previous probe's W_Q gradient error E per layer (for the cosine of successive E).
Layers that are not `flash` (standard, sdpa) get the FP64 probes only (max logit, entropy, PK-X similarity,
coherence): their delta is autograd's, not a flash recipe's. With model.qk_norm the map X -> q is not linear, so the
W_Q coherence probes are skipped.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional

import torch

from flash_forensics.kernels import probes as P
from flash_forensics.models.attention import compute_dtype
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.data import val_batches
from flash_forensics.orchestrator.job.step import autocast
from flash_forensics.orchestrator.monitor.probes.config import ProbesConfig

PROBE_SEED = 0x9B0E  # the probe batch's draw from the validation split (distinct from the eval batches' seed 0)


def probe_batch(val_bin, block_size: int, batch: int):
    """The fixed probe batch (x, y): `batch` sequences of the validation split, the same for every run and step."""
    return val_batches(val_bin, block_size, batch, 1, seed=PROBE_SEED)[0]


class Probes:
    """`step_end(step, checkpoint)` after each optimizer step; `state_dict` / `load_state_dict` for checkpoints."""

    def __init__(self, model, cfg: ProbesConfig, batch=None, device=None, precision: str = "bf16", tracker=None):
        self.model = getattr(model, "module", model)
        self.cfg, self.tracker = cfg, tracker
        self.failures = 0  # probes that raised (logged as probe/failures; training goes on)
        self.enabled = bool(cfg.enabled)
        self.device = torch.device(device) if device is not None else self.model.lm_head.weight.device
        self.precision = precision
        self.layers: List[int] = cfg.layer_list(self.model.config.n_layer) if self.enabled else []
        self.batch = batch
        self.cumsum: Dict[int, float] = {i: 0.0 for i in self.layers}
        self.prev_e: Dict[int, torch.Tensor] = {}
        self.last: Dict[str, float] = {}  # the latest probe's metrics (name -> value), for tests and the bench
        self.count = 0

    def due(self, step: int, checkpoint: bool = False) -> bool:
        return self.enabled and (step % self.cfg.every == 0 or checkpoint)

    def step_end(self, step: int, checkpoint: bool = False) -> Optional[Dict[str, float]]:
        """Probe after optimizer step `step` when due; returns the logged metrics then, else None (no work)."""
        if not self.due(step, checkpoint):
            return None
        try:
            return self.run(step)
        except (RuntimeError, ValueError) as e:  # a probe that cannot be computed never stops training: counted,
            self.failures += 1                   # logged (probe/failures) and said once on stderr
            if self.failures == 1:
                print(f"[probes] step {step}: probe failed ({type(e).__name__}: {str(e)[:200]}); training goes on, "
                      "failures are logged as probe/failures", file=sys.stderr, flush=True)
            if self.tracker is not None:
                self.tracker.log_metrics({"probe/failures": float(self.failures)}, step=int(step))
            return None

    # ------------------------------------------------------------------------------------------ capture
    def _capture(self):
        """One forward+backward of the probe batch: per probed layer (x, q, k, v, o, do, dq), all detached."""
        model, blocks = self.model, self.model.transformer.h
        caps: Dict[int, tuple] = {}

        def hook(i):
            return lambda x, q, k, v, o: caps.__setitem__(i, (x, q, k, v, o))

        stats = [s for s in model.attention_stats() if s is not None]
        saved = [s.snapshot() for s in stats]
        training = model.training
        x_ids, y_ids = (t.to(self.device) for t in self.batch)
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            for i in self.layers:
                blocks[i].attn.probe_capture = hook(i)
            model.eval()
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                with autocast(self.device, self.precision):
                    _, loss = model(x_ids, y_ids)
                outs = [caps[i][4] for i in self.layers] + [caps[i][1] for i in self.layers]
                grads = torch.autograd.grad(loss, outs)
        finally:
            for i in self.layers:
                blocks[i].attn.probe_capture = None
            model.train(training)
            for s, snap in zip(stats, saved):
                s.restore(snap)
        n = len(self.layers)
        return {i: tuple(t.detach() for t in caps[i]) + (grads[j].detach(), grads[n + j].detach())
                for j, i in enumerate(self.layers)}

    # ------------------------------------------------------------------------------------------ probe
    @torch.no_grad()
    def compute(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """Every probe of every probed layer on the probe batch, as device tensors (no host transfer)."""
        caps = self._capture()
        cfg = self.model.config
        H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
        out = {}
        for i, (x, q, k, v, o, do, dq) in caps.items():
            attn = self.model.transformer.h[i].attn
            knobs = attn.knobs
            dt = compute_dtype(knobs)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
            w_q = attn.c_attn.weight[:C].detach().view(H, D, C)
            x_in = x.to(q.dtype) if x.dtype != q.dtype and q.dtype == torch.bfloat16 else x  # what the GEMM saw
            res = P.layer_probe(x_in, q, k, v, o, do.to(o.dtype), dq, w_q, knobs, flash=knobs.impl == "flash",
                                coherence=not cfg.qk_norm)
            if "E" in res:
                e = res.pop("E").float()
                prev = self.prev_e.get(i)
                if prev is not None:
                    res["wq_err_cos"] = P.cosine(e, prev.to(e.device))
                self.prev_e[i] = e
            out[i] = res
        return out

    def run(self, step: int) -> Dict[str, float]:
        """Probe now, move everything to the host in one transfer, update the cumulative sums, log to MLflow."""
        res = self.compute()
        names, parts = [], []
        for i, r in res.items():
            for kind, t in r.items():
                t = t.reshape(-1).to(torch.float64)
                if kind in record.PROBE_HEAD_KINDS:
                    names += [record.probe_name(kind, i, h) for h in range(t.numel())]
                else:
                    names.append(record.probe_name(kind, i))
                parts.append(t)
        host = torch.cat(parts).cpu().tolist() if parts else []  # the probe step's one sync
        metrics = dict(zip(names, host))
        for i in self.layers:
            mean = metrics.get(record.probe_name("delta_err_mean", i))
            if mean is not None:
                self.cumsum[i] += mean
                metrics[record.probe_name("delta_err_cumsum", i)] = self.cumsum[i]
        self.count += 1
        self.last = metrics
        if self.tracker is not None and metrics:
            self.tracker.log_metrics(metrics, step=int(step))
        return metrics

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"cumsum": {int(k): float(v) for k, v in self.cumsum.items()}, "count": self.count,
                "prev_e": {int(k): v.detach().cpu() for k, v in self.prev_e.items()}}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:
            return
        self.cumsum.update({int(k): float(v) for k, v in state.get("cumsum", {}).items()})
        self.count = int(state.get("count", 0))
        self.prev_e = {int(k): v.to(self.device) for k, v in (state.get("prev_e") or {}).items()}


def build(cfg, model, data_dir, device, tracker=None, is_main: bool = True) -> Probes:
    """The job's Probes from the whole config (disabled, or a DDP rank other than 0: nothing drawn, step_end
    returns at once)."""
    from dataclasses import replace
    pc = cfg.monitor.probes if is_main else replace(cfg.monitor.probes, enabled=False)
    batch = None
    if pc.enabled:
        from pathlib import Path
        batch = probe_batch(Path(data_dir) / "val.bin", cfg.model.block_size, pc.batch)
    return Probes(model, pc, batch, device, cfg.train.precision, tracker)


__all__ = ["Probes", "build", "probe_batch", "PROBE_SEED"]
