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

Trainer: `Trainer(..., callbacks=[flash_forensics.TrainerCallback()])` (flash_forensics/trainer_callback.py).

Every attention module the backend routes is monitored (flash_forensics/sites.py): metric names carry its label,
L<layer> where layer numbers are unique (the names above), else its module path (encoder-decoder models:
rmax_rows/model.decoder.layers.0.encoder_attn.H3). A module that made no call since the last flush (its device
call counter is read with the rest) is named in a NotRoutedWarning with the cause (flash_forensics/watch.py).
Nothing unmeasured is logged as 0: a module with counters=False logs no counters (a warning says so), and a flush
between logging steps (close(), Trainer's last partial interval) no entropy.
"""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from flash_forensics import families, watch
from flash_forensics.hf_backend import NAME, layer_states, not_routed, sites, unrouted_unsaid
from flash_forensics.kernels.checks import is_int
from flash_forensics.kernels.stats import COUNTERS
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.tracking.store import check_tracking

ENTROPY = "attn_entropy/"


def _short(value) -> str:
    """A value for a message: a tensor by its shape, never its contents."""
    if torch.is_tensor(value):
        return f"tensor of shape {tuple(value.shape)}"
    return repr(value)[:60]


class Monitor:
    """Buffers a transformers model's attention signals on the device; `step` returns a dict when it flushed."""

    def __init__(self, model, *, log_every: int = 10, wq_every: int = 50, mlflow: bool = False,
                 tracking_uri: Optional[str] = None, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 params: Optional[dict] = None):
        for key, value in (("log_every", log_every), ("wq_every", wq_every)):
            if not is_int(value, 1):
                raise ValueError(f"Monitor.{key}={value!r} is not allowed: expected an integer > 0")
        self.model, self.log_every, self.wq_every = model, log_every, wq_every
        if not isinstance(model, torch.nn.Module):
            not_routed(model, who="Monitor")
        self.family = families.family(model)  # an unknown family is refused here, naming how to register it
        self.sites = sites(model)
        if not self.sites:  # nothing would ever be counted: refused here, not at the first flush
            not_routed(model, who="Monitor")
        unsaid = unrouted_unsaid(model, "Monitor")  # use() names them; without it they would go unmonitored unsaid
        if unsaid:
            warnings.warn(unsaid + " (not monitored)", watch.NotRoutedWarning, stacklevel=2)
        families.check_sites(model, self.sites)  # W_Q is read at step 0: a rule that does not fit is refused here
        self.states = layer_states(model)  # the sites' states, in the same order
        for st in self.states:  # counted from here: forwards before the Monitor (warm-up, eval) are no step of it
            st.reset()
        self.labels = [st.label for st in self.sites]
        self._said: set = set()
        self._closed = False
        self._step = 0  # the next step's index
        self._flushed = -1  # the last step a flush covered
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
        if self._closed:
            raise RuntimeError("Monitor.step() after close() is not allowed: its run has ended (make a new Monitor)")
        if step is not None and not is_int(step, self._step):
            raise ValueError(f"Monitor.step(step={step!r}) is not allowed: expected an integer >= {self._step} (steps "
                             "only go forward: the last one was " + (f"{self._step - 1})" if self._step else "none)"))
        s = self._step if step is None else step
        if loss is not None:
            if (loss.numel() != 1 if torch.is_tensor(loss) else
                    isinstance(loss, bool) or not isinstance(loss, numbers.Real)):
                raise ValueError(f"Monitor.step(loss={_short(loss)}) is not allowed: expected a scalar (a one-element "
                                 "tensor or a number)")
            self._losses.append((s, loss.detach().reshape(()).float() if torch.is_tensor(loss)
                                 else torch.tensor(float(loss))))
        if s % self.wq_every == 0:
            self._wq.append((s, torch.cat(families.site_sigmas(self.model, sites=self.sites))))
        self._step = s + 1
        out = self.flush(s) if (s + 1) % self.log_every == 0 else None
        self._arm(self._step)
        return out

    def pending(self) -> bool:
        """True when steps since the last flush are buffered (counters, losses or norms not yet read)."""
        return self._step - 1 > self._flushed or bool(self._losses or self._wq)

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
        off = [lab for lab, st in zip(self.labels, self.states) if not st.knobs.counters]
        for i, st in enumerate(self.states):
            if st.knobs.counters:  # with counters off nothing is counted: no zeros logged as if measured
                for name in COUNTERS:
                    add(f"{name}@{i}", getattr(st.stats, name))
            add(f"logit@{i}", st.stats.max_logit)
            if st.calls is not None:
                add(f"calls@{i}", st.calls)
            if st.entropy_sum is not None:  # rows too: a head with none was not measured in this interval
                add(f"ent@{i}", st.entropy_sum / st.entropy_rows.clamp_min(1))
                add(f"entrows@{i}", st.entropy_rows)
        dev = parts[0].device if parts else torch.device("cpu")
        host = torch.cat([p.to(dev) for p in parts]).cpu().tolist() if parts else []  # the one sync
        for st in self.states:
            st.reset()
        vals, i = {}, 0
        for name, n in layout:
            vals[name], i = host[i:i + n], i + n
        self._check_calls(vals)
        if off:
            self._say(f"Monitor: counters=False in {len(off)} of {len(self.states)} attention modules "
                      f"({', '.join(off[:4])}{', ...' if len(off) > 4 else ''}): their {', '.join(COUNTERS)} are not "
                      "counted, so not logged (use(..., counters=True) counts them)", UserWarning)
        out: Dict[str, float] = {}
        per_step: Dict[int, Dict[str, float]] = {s: dict(v) for s, v in self._host.items()}
        for s, _ in self._losses:
            per_step.setdefault(s, {})[record.LOSS] = vals[f"loss@{s}"][0]
            out[f"{record.LOSS}@{s}"] = vals[f"loss@{s}"][0]
        bad = [(s, vals[f"loss@{s}"][0]) for s, _ in self._losses if not math.isfinite(vals[f"loss@{s}"][0])]
        if bad:  # logged as they are, and said: a numerical failure is never silent
            warnings.warn(f"Monitor: the loss is not finite at {len(bad)} step(s) of this interval: "
                          + ", ".join(f"step {s}: {v}" for s, v in bad[:5]), RuntimeWarning, stacklevel=3)
        heads = [(lab, h) for lab, st in zip(self.labels, self.states) for h in range(st.stats.n_head)]
        for s, _ in self._wq:
            per_step.setdefault(s, {}).update({f"{record.WQ_SIGMA}{lab}.H{h}": v
                                               for (lab, h), v in zip(heads, vals[f"wq@{s}"], strict=True)})
        last = per_step.setdefault(step, {})
        for i, lab in enumerate(self.labels):
            for name in COUNTERS:
                prefix = record.RMAX_ROWS if name == "repeated_max_rows" else f"{name}/"
                for h, c in enumerate(vals.get(f"{name}@{i}", [])):
                    last[f"{prefix}{lab}.H{h}"] = c
            logit = vals[f"logit@{i}"][0]
            if logit != float("-inf"):  # nothing measured (counters off)
                last[f"{record.MAX_LOGIT}{lab}"] = logit
            for h, (e, n) in enumerate(zip(vals.get(f"ent@{i}", []), vals.get(f"entrows@{i}", []), strict=True)):
                if n > 0:  # measured on logging steps only: a flush between them (close, Trainer's end) has none
                    last[f"{ENTROPY}{lab}.H{h}"] = e
        for s in sorted(per_step):
            out.update(per_step[s])
        self._losses, self._wq, self._host = [], [], {}
        self._flushed = max(self._flushed, step)
        self.history.append(dict(out, step=step))
        if self._client is not None:
            self._log_mlflow(per_step)
        return out

    def _check_calls(self, vals) -> None:
        """A NotRoutedWarning (once per message) for the modules that made no call in this interval."""
        idle = [i for i in range(len(self.states)) if f"calls@{i}" in vals and vals[f"calls@{i}"][0] == 0]
        if not idle:
            return
        quiet = [self.sites[i] for i in idle]
        what = ("no attention call reached" if len(idle) == len(self.states) else
                f"{len(idle)} of {len(self.states)} attention modules ({', '.join(s.path for s in quiet[:4])}"
                f"{', ...' if len(idle) > 4 else ''}) made no call to")
        self._say(f"Monitor: {what} the {NAME} backend since the last flush: {watch.cause(quiet, NAME)}",
                  watch.NotRoutedWarning)

    def _say(self, msg: str, category) -> None:
        """A warning given once per Monitor and message."""
        if msg not in self._said:
            self._said.add(msg)
            warnings.warn(msg, category, stacklevel=4)

    # ------------------------------------------------------------------------------------------ MLflow
    def _open_mlflow(self, uri, experiment, run_name, params) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        try:  # one sentence naming the URI, before MLflow's own errors (and never a hang on a dead server)
            if uri:
                check_tracking(uri, timeout_s=10)
        except ValueError as e:
            raise ValueError(f"Monitor(mlflow=True): {e}") from None
        self._client = MlflowClient(tracking_uri=uri)
        name = experiment or "flash_forensics"
        exp = self._client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(name)
        run = self._client.create_run(exp_id, run_name=run_name, tags={"family": self.family})
        self.run_id = run.info.run_id
        knobs = self.states[0].knobs
        base = {"family": self.family, "recipe": knobs.recipe, "n_layer": len(self.states),
                "n_head": self.states[0].stats.n_head,
                **{f"{lab}.route": f"flash/emulator/{st.knobs.recipe}" for lab, st in zip(self.labels, self.states)}}
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
        self._closed = True
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id, status)
            self._client = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close("FAILED" if exc_type else "FINISHED")


__all__ = ["Monitor", "ENTROPY"]
