"""The paper's signals on your own transformers model: `Monitor` for your loop, `TrainerCallback` for Trainer.

Per layer and head: repeated-maxima counts (rows whose tile max repeats, the condition of Algorithm 3) with the rows
examined, numerical-failure counts (kernels/stats.py), the max attention logit per layer, the mean attention entropy
(nats; measured on logging steps only, by one extra softmax pass without grad) and W_Q's spectral norm per head
(every `wq_every` steps; flash_forensics/families.py says where each family keeps W_Q). The model must run
attn_implementation="forensics" (flash_forensics/hf_backend.py), whose layers keep those counters on the device.

No host sync between logs: losses, counters and norms stay device tensors until `flush` (every `log_every` steps)
copies them to the host in one transfer, logs them (MLflow when asked) and returns them as a dict. Metric names are
the orchestrator's (orchestrator/record.py): train/loss, rmax_rows/L<l>.H<h>, max_logit/L<l>, wq_sigma/L<l>.H<h>,
plus rows_seen/, underflow_rows/, sfa_p1_rows/ and attn_entropy/ per head.

    monitor = flash_forensics.Monitor(model, log_every=10, mlflow=True, experiment="my-run")
    for step, batch in enumerate(loader):
        loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()
        monitor.step(loss)            # a dict on logging steps, else None
    monitor.close()

Trainer: `Trainer(..., callbacks=[flash_forensics.TrainerCallback()])` (log_every defaults to args.logging_steps).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from flash_forensics import families
from flash_forensics.hf_backend import layer_states
from flash_forensics.kernels.checks import is_int
from flash_forensics.kernels.stats import COUNTERS
from flash_forensics.orchestrator import record

ENTROPY = "attn_entropy/"


class Monitor:
    """Buffers a transformers model's attention signals on the device; `step` returns a dict when it flushed."""

    def __init__(self, model, *, log_every: int = 10, wq_every: int = 50, mlflow: bool = False,
                 tracking_uri: Optional[str] = None, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 params: Optional[dict] = None):
        for key, value in (("log_every", log_every), ("wq_every", wq_every)):
            if not is_int(value, 1):
                raise ValueError(f"Monitor.{key}={value!r} is not allowed: expected an integer > 0")
        self.model, self.log_every, self.wq_every = model, log_every, wq_every
        self.family = families.family(model)  # an unknown family is refused here, naming how to register it
        self.states = layer_states(model)
        self.n_head = families.n_heads(model)
        self._step = 0  # the next step's index
        self._losses: List[Tuple[int, torch.Tensor]] = []
        self._wq: List[Tuple[int, torch.Tensor]] = []
        self._host: Dict[int, Dict[str, float]] = {}  # values already on the host (Trainer's logs)
        self.history: List[Dict[str, float]] = []
        self.run_id = None
        self._client = None
        if mlflow:
            self._open_mlflow(tracking_uri, experiment, run_name, params)
        self._arm(0)

    # ------------------------------------------------------------------------------------------ per step
    def _arm(self, step: int) -> None:
        """Entropy costs a pass: measured on the forward of each logging step only."""
        on = (step + 1) % self.log_every == 0
        for st in self.states:
            st.probe = on

    def step(self, loss: Optional[torch.Tensor] = None, step: Optional[int] = None) -> Optional[Dict[str, float]]:
        """After an optimizer step: record `loss` (a device tensor; never read here) and, every log_every steps,
        flush. `step` defaults to a running count from 0."""
        s = self._step if step is None else int(step)
        if loss is not None:
            self._losses.append((s, loss.detach().reshape(()).float() if torch.is_tensor(loss)
                                 else torch.tensor(float(loss))))
        if s % self.wq_every == 0:
            self._wq.append((s, families.wq_spectral_norms(self.model)))
        self._step = s + 1
        out = self.flush(s) if (s + 1) % self.log_every == 0 else None
        self._arm(self._step)
        return out

    def log_host(self, step: int, values: Dict[str, float]) -> None:
        """Host values (e.g. Trainer's logged loss) to send with the next flush."""
        self._host.setdefault(int(step), {}).update({k: float(v) for k, v in values.items()})

    # ------------------------------------------------------------------------------------------ flush
    def flush(self, step: Optional[int] = None) -> Dict[str, float]:
        """One device->host copy of everything buffered; logs it; resets the layers' counters. Returns
        {metric: value} of this interval (per-step losses as train/loss@<step> besides the last train/loss)."""
        step = self._step - 1 if step is None else step
        parts, layout = [], []

        def add(name, t):
            parts.append(t.detach().reshape(-1).to(torch.float64))
            layout.append((name, parts[-1].numel()))

        for s, loss in self._losses:
            add(f"loss@{s}", loss)
        for s, wq in self._wq:
            add(f"wq@{s}", wq)
        for layer, st in enumerate(self.states):
            for name in COUNTERS:
                add(f"{name}@{layer}", getattr(st.stats, name))
            add(f"logit@{layer}", st.stats.max_logit)
            if st.entropy_sum is not None:
                add(f"ent@{layer}", st.entropy_sum / st.entropy_rows.clamp_min(1))
        dev = parts[0].device if parts else torch.device("cpu")
        host = torch.cat([p.to(dev) for p in parts]).cpu().tolist() if parts else []  # the one sync
        for st in self.states:
            st.reset()
        vals, i = {}, 0
        for name, n in layout:
            vals[name], i = host[i:i + n], i + n
        out: Dict[str, float] = {}
        per_step: Dict[int, Dict[str, float]] = {s: dict(v) for s, v in self._host.items()}
        for s, _ in self._losses:
            per_step.setdefault(s, {})[record.LOSS] = vals[f"loss@{s}"][0]
            out[f"{record.LOSS}@{s}"] = vals[f"loss@{s}"][0]
        for s, _ in self._wq:
            flat = vals[f"wq@{s}"]
            per_step.setdefault(s, {}).update({record.wq_sigma_name(j // self.n_head, j % self.n_head): v
                                               for j, v in enumerate(flat)})
        last = per_step.setdefault(step, {})
        for layer in range(len(self.states)):
            for name in COUNTERS:
                for h, c in enumerate(vals[f"{name}@{layer}"]):
                    last[record.rmax_rows_name(layer, h) if name == "repeated_max_rows" else
                         f"{name}/{record.head_where(layer, h)}"] = c
            logit = vals[f"logit@{layer}"][0]
            if logit != float("-inf"):  # nothing measured (counters off)
                last[record.max_logit_name(layer)] = logit
            for h, e in enumerate(vals.get(f"ent@{layer}", [])):
                last[f"{ENTROPY}{record.head_where(layer, h)}"] = e
        for s in sorted(per_step):
            out.update(per_step[s])
        self._losses, self._wq, self._host = [], [], {}
        self.history.append(dict(out, step=step))
        if self._client is not None:
            self._log_mlflow(per_step)
        return out

    # ------------------------------------------------------------------------------------------ MLflow
    def _open_mlflow(self, uri, experiment, run_name, params) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        name = experiment or "flash_forensics"
        exp = self._client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(name)
        run = self._client.create_run(exp_id, run_name=run_name, tags={"family": self.family})
        self.run_id = run.info.run_id
        knobs = self.states[0].knobs
        base = {"family": self.family, "recipe": knobs.recipe, "n_layer": len(self.states), "n_head": self.n_head,
                **{f"layer{i}.route": f"flash/emulator/{st.knobs.recipe}" for i, st in enumerate(self.states)}}
        self._client.log_batch(self.run_id, params=[mlflow.entities.Param(k, str(v)[:500])
                                                    for k, v in {**base, **(params or {})}.items()])

    def _log_mlflow(self, per_step: Dict[int, Dict[str, float]]) -> None:
        import time

        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, s) for s, vals in per_step.items() for k, v in vals.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, status: str = "FINISHED") -> None:
        """Flush what is left and end the MLflow run."""
        if self._losses or self._wq:
            self.flush()
        elif self._host:  # host values only (Trainer's end-of-run summary): no device counters to read again
            if self.history:
                for vals in self._host.values():
                    self.history[-1].update(vals)
            if self._client is not None:
                self._log_mlflow(self._host)
            self._host = {}
        for st in self.states:
            st.probe = False
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id, status)
            self._client = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close("FAILED" if exc_type else "FINISHED")


def _callback_class():
    """transformers.TrainerCallback's subclass, built on first use (importing transformers costs seconds)."""
    from transformers import TrainerCallback as Base

    class TrainerCallback(Base):
        """Adds flash_forensics' monitors to a Trainer: `callbacks=[flash_forensics.TrainerCallback()]`.

        log_every: None = args.logging_steps. Trainer's logged loss goes out with the next flush. `history`: the
        flushed dicts; `monitor`: the Monitor (from on_train_begin)."""

        def __init__(self, log_every: Optional[int] = None, wq_every: int = 50, mlflow: bool = False, **mlflow_kw):
            self.log_every, self.wq_every, self.mlflow, self.mlflow_kw = log_every, wq_every, mlflow, mlflow_kw
            self.monitor: Optional[Monitor] = None

        @property
        def history(self):
            return self.monitor.history if self.monitor is not None else []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            every = self.log_every or (int(args.logging_steps) if args.logging_steps >= 1 else 10)
            self.monitor = Monitor(model, log_every=every, wq_every=self.wq_every, mlflow=self.mlflow,
                                   **self.mlflow_kw)

        def on_step_end(self, args, state, control, **kwargs):
            self.monitor.step(step=state.global_step - 1)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                self.monitor.log_host(max(state.global_step - 1, 0),
                                      {f"trainer/{k}": v for k, v in logs.items() if isinstance(v, (int, float))})

        def on_train_end(self, args, state, control, **kwargs):
            self.monitor.close()

    return TrainerCallback


_CALLBACK = None


def __getattr__(name: str):
    global _CALLBACK
    if name == "TrainerCallback":
        if _CALLBACK is None:
            _CALLBACK = _callback_class()
        return _CALLBACK
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Monitor", "TrainerCallback", "ENTROPY"]  # noqa: F822  (TrainerCallback: built by __getattr__)
