"""Early-warning signals: one scalar per run and step, computed from the metrics the monitors log.

The same code turns metrics into signals online (monitor.alarm, orchestrator/monitor/alarm.py: fed the points the
monitors hand to the tracker at each flush) and offline (orchestrator/analysis/early_warning.py: fed the same points
read back from MLflow), so a threshold chosen offline means the same thing in a run.

Signals (the paper's vocabulary; each from one metric family, so points of one step may arrive in several calls):
- rmax_rate: repeated-maxima rows per step (rmax_rows/L*.H*, counted per log interval, summed over a layer's heads
  and divided by the steps of the interval), max over layers;
- max_logit: the max scaled attention score per layer on the training batches (max_logit/L*), max over layers;
- max_logit_head: the probes' max logit per head on the probe batch, max over heads and layers;
- entropy: the probes' attention entropy per head, min over heads and layers (alarms when it falls below);
- wq_sigma: the W_Q spectral norm per head (wq_sigma/L*.H*), max over heads and layers;
- wq_growth: d ln sigma / d step of each head's W_Q norm over the last `growth_window` steps (from the newest sample
  at or before step - growth_window to this one), max over heads;
- delta_cumsum: the probes' cumulative sum of the delta error per layer, max over layers of its absolute value;
- val_rise: the validation loss (val/loss, every train.eval_every steps) minus its lowest value so far in the run
  (a fork: since its fork step), in nats; 0 while it keeps falling;
- grad_spike, loss_spike: the generic monitors any trainer has, as the baseline the paper's signals must beat: the
  gradient norm before clipping (train/grad_norm) over the median of its previous `spike_window` logged values, and
  the training loss (train/loss) minus that median, in nats; from half a window of values on (a fork: after its fork
  step). An infinite gradient norm (the monitors log it as the flag train/grad_norm_nonfinite) is a spike (+inf);
  the median is of the finite values.
A probe signal is absent (never computed, never fires) in a run without monitor.probes.
"""
from __future__ import annotations

import math
import re
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from flash_forensics.orchestrator import record

ABOVE, BELOW = "above", "below"


@dataclass(frozen=True)
class Signal:
    name: str
    direction: str  # above: alarm when the value rises above the threshold; below: when it falls below
    what: str
    needs: str  # the monitor setting that produces its metrics


SIGNALS: Dict[str, Signal] = {s.name: s for s in (
    Signal("rmax_rate", ABOVE, "repeated-maxima rows per step, max over layers", "monitor.counters"),
    Signal("max_logit", ABOVE, "max attention logit per layer (training batches), max over layers",
           "monitor.max_logit"),
    Signal("max_logit_head", ABOVE, "max attention logit per head (probe batch), max over heads", "monitor.probes"),
    Signal("entropy", BELOW, "attention entropy per head (probe batch), min over heads", "monitor.probes"),
    Signal("wq_sigma", ABOVE, "W_Q spectral norm, max over heads", "monitor.wq_every"),
    Signal("wq_growth", ABOVE, "d ln sigma(W_Q) / d step over the growth window, max over heads",
           "monitor.wq_every"),
    Signal("delta_cumsum", ABOVE, "|delta-error cumulative sum|, max over layers", "monitor.probes"),
    Signal("val_rise", ABOVE, "validation loss above its lowest so far in the run (nats)", "train.eval_every"),
    Signal("grad_spike", ABOVE, "gradient norm over its median of the previous spike_window steps", "always logged"),
    Signal("loss_spike", ABOVE, "training loss above its median of the previous spike_window steps (nats)",
           "always logged"),
)}
SPIKES = {"grad": ("grad_spike", record.GRAD_NORM), "loss": ("loss_spike", record.LOSS)}  # family -> signal, metric
PROBE_SIGNALS = tuple(n for n, s in SIGNALS.items() if s.needs == "monitor.probes")

# the probes' metric kinds (monitor.probes, probe/<kind>/L<l>[.H<h>]) each signal reads
PROBE_KINDS = {"max_logit": "max_logit_head", "entropy": "entropy", "delta_err_cumsum": "delta_cumsum"}
_PROBE = re.compile(r"^probe/([a-z0-9_]+)/L(\d+)(?:\.H(\d+))?$")


def _parse_probe(name: str) -> Optional[Tuple[str, int, Optional[int]]]:
    """record.parse_probe_metric where the probes' names are in the record (the probes branch), else the same form."""
    parse = getattr(record, "parse_probe_metric", None)
    if parse is not None:
        return parse(name)
    m = _PROBE.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3)) if m.group(3) else None) if m else None


# what early_warning reads from MLflow
PREFIXES = (record.WQ_SIGMA, record.RMAX_ROWS, record.MAX_LOGIT, "probe/", record.VAL_LOSS, record.GRAD_NORM,
            record.LOSS)


def family(name: str) -> Optional[Tuple[str, int]]:
    """(family, layer) of a metric name the signals read, else None. Families: rmax, max_logit, wq, val (layer
    0: the model's), grad and loss (the spikes'), and the probe signals' names."""
    if name == record.VAL_LOSS:
        return "val", 0
    for fam, (_, metric) in SPIKES.items():
        if name in (metric, metric + record.NONFINITE_SUFFIX):  # the suffix: the monitors' flag of an inf/NaN
            return fam, 0
    head = record.parse_head_metric(name)
    if head:
        return ("wq" if head[0] == "wq_sigma" else "rmax"), head[1]
    layer = record.parse_layer_metric(name)
    if layer is not None:
        return "max_logit", layer
    probe = _parse_probe(name)
    if probe is not None and probe[0] in PROBE_KINDS:
        return PROBE_KINDS[probe[0]], probe[1]
    return None


def crossed(direction: str, value: float, threshold: float) -> bool:
    """The alarm condition: strictly above (or below) the threshold."""
    return value > threshold if direction == ABOVE else value < threshold


def rule_text(signal: str, threshold, direction: Optional[str] = None) -> str:
    """`signal > threshold` (or <), as tables and reports print a rule; direction: the signal's own when not given
    (a record read back from MLflow carries none)."""
    direction = direction or (SIGNALS[signal].direction if signal in SIGNALS else ABOVE)
    thr = f"{threshold:.6g}" if isinstance(threshold, (int, float)) else str(threshold)
    return f"{signal} {'<' if direction == BELOW else '>'} {thr}"


class SignalState:
    """Feed it each logged batch of metrics in step order (`update(step, metrics)`); it returns the signals those
    metrics determine at that step. Non-finite NaN points are skipped (the divergence detector owns them); +-inf
    count (a spike). start_step: the run's first step (a fork's fork step), where the first repeated-maxima interval
    starts. spike_window: the values grad_spike's and loss_spike's median is over."""

    def __init__(self, growth_window: int = 100, start_step: int = 0, spike_window: int = 100):
        self.growth_window = int(growth_window)
        self._recent = {fam: deque(maxlen=int(spike_window)) for fam in SPIKES}  # the previous finite values
        self._rmax_prev = int(start_step) - 1  # the last step of the previous repeated-maxima interval
        self._wq: Dict[str, List[Tuple[int, float]]] = {}  # head -> [(step, ln sigma)]
        self._val_min = math.inf  # the lowest validation loss so far (val_rise)

    def state_dict(self) -> Dict[str, Any]:
        """Plain values (a checkpoint's): the windows a resumed run's signals go on from."""
        return {"recent": {f: list(d) for f, d in self._recent.items()}, "rmax_prev": self._rmax_prev,
                "wq": {h: [list(p) for p in pts] for h, pts in self._wq.items()}, "val_min": self._val_min}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for f, values in (state.get("recent") or {}).items():
            if f in self._recent:
                self._recent[f].clear()
                self._recent[f].extend(values)
        self._rmax_prev = int(state.get("rmax_prev", self._rmax_prev))
        self._wq = {h: [(int(s), float(v)) for s, v in pts] for h, pts in (state.get("wq") or {}).items()}
        self._val_min = float(state.get("val_min", self._val_min))

    def update(self, step: int, metrics: Mapping[str, float]) -> Dict[str, float]:
        fams: Dict[str, Dict[str, float]] = {}
        for name, v in metrics.items():
            f = family(name)
            if f is not None and name.endswith(record.NONFINITE_SUFFIX):  # train/grad_norm was not finite
                if f[0] == "grad" and v:  # (a NaN/inf loss stays in train/loss: the detector's)
                    fams.setdefault(f[0], {})[record.GRAD_NORM] = math.inf
            elif f is not None and v is not None and not math.isnan(float(v)):
                fams.setdefault(f[0], {})[name] = float(v)
        out: Dict[str, float] = {}
        if "rmax" in fams:
            steps = max(step - self._rmax_prev, 1)
            self._rmax_prev = step
            per_layer: Dict[int, float] = {}
            for name, v in fams["rmax"].items():
                layer = family(name)[1]
                per_layer[layer] = per_layer.get(layer, 0.0) + v
            out["rmax_rate"] = max(per_layer.values()) / steps
        for fam in ("max_logit", "max_logit_head", "delta_cumsum"):
            if fam in fams:
                vals = fams[fam].values()
                out[fam] = max(abs(v) for v in vals) if fam == "delta_cumsum" else max(vals)
        if "entropy" in fams:
            out["entropy"] = min(fams["entropy"].values())
        if "wq" in fams:
            out["wq_sigma"] = max(fams["wq"].values())
            rates = [r for r in (self._wq_rate(name, step, v) for name, v in fams["wq"].items()) if r is not None]
            if rates:
                out["wq_growth"] = max(rates)
        if "val" in fams and not math.isinf(v := fams["val"][record.VAL_LOSS]):
            self._val_min = min(self._val_min, v)
            out["val_rise"] = v - self._val_min
        for fam, (sig, metric) in SPIKES.items():
            if fam in fams:
                v = self._spike(fam, fams[fam][metric])
                if v is not None:
                    out[sig] = v
        return out

    def _spike(self, fam: str, v: float) -> Optional[float]:
        """v against the median of the previous finite values (None until half a window of them is in)."""
        buf = self._recent[fam]
        out = None
        if 2 * len(buf) >= buf.maxlen:
            med = statistics.median(buf)
            if not math.isfinite(v):
                out = math.inf
            elif fam == "loss":
                out = v - med
            elif med > 0:
                out = v / med
        if math.isfinite(v):
            buf.append(v)
        return out

    def _wq_rate(self, name: str, step: int, sigma: float) -> Optional[float]:
        if not sigma > 0 or math.isinf(sigma):
            return None
        pts = self._wq.setdefault(name, [])
        pts.append((step, math.log(sigma)))
        old = [(s, ls) for s, ls in pts if s <= step - self.growth_window]
        if not old:
            return None
        s0, ls0 = old[-1]
        del pts[:len(old) - 1]  # older samples are never the reference again
        return (pts[-1][1] - ls0) / (step - s0)


def series(history: Mapping[str, List[Tuple[int, float]]], start_step: int = 0,
           growth_window: int = 100, spike_window: int = 100) -> Dict[str, List[Tuple[int, float]]]:
    """{signal: [(step, value)]} of one run's metric histories, from start_step on (a fork: its fork step), as the
    alarm would have seen them. A signal with no point is absent from the result."""
    by_step: Dict[int, Dict[str, float]] = {}
    for name, pts in history.items():
        if family(name) is None:
            continue
        for s, v in pts:
            if s >= start_step:
                by_step.setdefault(int(s), {})[name] = v
    state = SignalState(growth_window, start_step, spike_window)
    out: Dict[str, List[Tuple[int, float]]] = {}
    for s in sorted(by_step):
        for sig, v in state.update(s, by_step[s]).items():
            out.setdefault(sig, []).append((s, v))
    return out


def first_alarm(pts: List[Tuple[int, float]], direction: str, threshold: float) -> Optional[Tuple[int, float]]:
    """(step, value) of the first point past the threshold, else None."""
    return next(((s, v) for s, v in pts if crossed(direction, v, threshold)), None)


__all__ = ["ABOVE", "BELOW", "Signal", "SIGNALS", "PROBE_SIGNALS", "PREFIXES", "family", "crossed", "SignalState",
           "series", "first_alarm", "rule_text"]
