"""The run record: what one job leaves behind, in one place. Written by the job (orchestrator/launch/task.py, train.py),
read by the report, fork, localize and the isolation pipeline.

- `RunRecord`: the fields of <job dir>/result.json (typed; `to_json` / `from_json` round-trip).
- File names of a job folder: RESULT_FILE, CKPT_DIR, ORDER_FILE, ERROR_FILE; REPORT_DIR (a sweep's report, inside
  its dated sweep folder, never results/<sweep>/ where the repo keeps committed reproductions).
- Metric names: functions and their parsers (`wq_sigma_name(layer, head)` <-> `parse_head_metric`), never
  f-strings elsewhere. Layers and heads are 0-based.
- Non-finite floats: written as the strings "NaN", "Infinity", "-Infinity" (strict JSON) and read back as floats
  (`encode` / `decode`); MLflow stores +-inf as +-max float (`from_mlflow_value` maps it back).
- The verdict against the paper: `matches_paper(expected, observed, cause)`, the one formula (tags, rows, reports):
  a divergence counts only with its cause 'precision', i.e. an FP32 control of the same setup stayed stable
  (`control_cause`, `verdict_line`; the report's rows find the control, orchestrator/report/rows.py).
- MLflow typing: the tags a reader filters by (TAG_*), the run metrics a reader sorts by (`record_metrics`), the
  aggregate metrics of a sweep's parent run (`sweep_metrics`), and `from_mlflow_run`, its inverse.
Over 400 lines because it is the one contract every stage reads and writes (the job, the report, the tags, the
verdict's control): split, the names and their parsers would drift apart.
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from flash_forensics.orchestrator.verdict import DivergenceDetector, VerdictConfig

RECORD_VERSION = 2  # 2: typed MLflow fields (metrics below, tag record_version); 1 or absent: older runs

# ------------------------------------------------------------------------------------------ file names
RESULT_FILE = "result.json"
CKPT_DIR = "checkpoints"
ORDER_FILE = "batch_order.bin"
ERROR_FILE = "error.txt"
RESOLVED_CONFIG = "config_resolved.yaml"
REPORT_DIR = "report"  # <sweep dir>/report/: verdicts.{md,json} and plots/ of that sweep

# ----------------------------------------------------------------------------------------- metric names
LOSS = "train/loss"
VAL_LOSS = "val/loss"
GRAD_NORM = "train/grad_norm"
LR = "train/lr"
TOKENS_PER_S = "perf/tokens_per_s"
NONFINITE_SUFFIX = "_nonfinite"  # train/grad_norm_nonfinite = 1 at a step whose value was NaN/Inf (not logged)
WQ_SIGMA, RMAX_ROWS, MAX_LOGIT = "wq_sigma/", "rmax_rows/", "max_logit/"
PROBE = "probe/"  # mechanism probes (orchestrator/monitor/probes/): probe/<kind>/L<l> per layer, probe/<kind>/L<l>.H<h>
PROBE_LAYER_KINDS = ("delta_err_mean", "delta_err_t", "delta_err_cumsum", "tie_share_signed", "tie_share_abs",
                     "tie_rows_exact", "tie_rows_bf16", "wq_err_cos")
PROBE_HEAD_KINDS = ("wq_err_proj", "pkx_cos", "max_logit", "entropy")
PROBE_PLOTTED = ("delta_err_mean", "delta_err_cumsum", "tie_share_signed", "tie_share_abs", "wq_err_cos")
# what reports and localization read (of the probes, the per-layer kinds the report plots, not the per-head ones)
# (+ the probe table's kinds: orchestrator/report/probe_table.py; only runs with probes have them)
PROBE_TABLED = PROBE_PLOTTED + ("delta_err_t", "tie_rows_exact", "tie_rows_bf16", "pkx_cos")
HISTORY_PREFIXES = (LOSS, VAL_LOSS, WQ_SIGMA, RMAX_ROWS, MAX_LOGIT) + tuple(f"{PROBE}{k}/" for k in PROBE_TABLED)
_PROBE = re.compile(r"^probe/([a-z0-9_]+)/L(\d+)(?:\.H(\d+))?$")
_HEAD = re.compile(r"^(wq_sigma|rmax_rows)/L(\d+)\.H(\d+)$")
_LAYER = re.compile(r"^max_logit/L(\d+)$")
_WHERE = re.compile(r"^L(\d+)\.H(\d+)$")


def head_where(layer: int, head: int) -> str:
    """'L1.H3': a head's place, as peak_wq_where and the per-head metric names write it."""
    return f"L{int(layer)}.H{int(head)}"


def parse_where(where: Optional[str]) -> Optional[Tuple[int, int]]:
    m = _WHERE.match(where or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def wq_sigma_name(layer: int, head: int) -> str:
    return WQ_SIGMA + head_where(layer, head)


def rmax_rows_name(layer: int, head: int) -> str:
    return RMAX_ROWS + head_where(layer, head)


def max_logit_name(layer: int) -> str:
    return f"{MAX_LOGIT}L{int(layer)}"


def probe_name(kind: str, layer: int, head: Optional[int] = None) -> str:
    """'probe/delta_err_mean/L2' (a per-layer kind) or 'probe/max_logit/L2.H7' (a per-head kind)."""
    if kind in PROBE_LAYER_KINDS and head is None:
        return f"{PROBE}{kind}/L{int(layer)}"
    if kind in PROBE_HEAD_KINDS and head is not None:
        return f"{PROBE}{kind}/{head_where(layer, head)}"
    raise ValueError(f"probe metric kind={kind!r} head={head!r} is not allowed: expected one of "
                     f"{', '.join(PROBE_LAYER_KINDS)} without a head or {', '.join(PROBE_HEAD_KINDS)} with one")


def parse_probe_metric(name: str) -> Optional[Tuple[str, int, Optional[int]]]:
    """(kind, layer, head or None) for a probe metric name, else None."""
    m = _PROBE.match(name)
    if not m or m.group(1) not in (PROBE_HEAD_KINDS if m.group(3) else PROBE_LAYER_KINDS):
        return None
    return m.group(1), int(m.group(2)), (int(m.group(3)) if m.group(3) else None)


def parse_head_metric(name: str) -> Optional[Tuple[str, int, int]]:
    """('wq_sigma' | 'rmax_rows', layer, head) for a per-head metric name, else None."""
    m = _HEAD.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def parse_layer_metric(name: str) -> Optional[int]:
    """The layer of a max_logit/L<l> name, else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------------------- non-finite
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf,
              "nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # lower case: result.json before the record
_MLFLOW_INF = sys.float_info.max  # what MLflow's SQL store keeps for +-inf


def encode(x):
    """JSON-safe copy: non-finite floats as "NaN" / "Infinity" / "-Infinity"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, Mapping):
        return {k: encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    return x


def decode_float(x) -> Optional[float]:
    """A float field as written by `encode` (or an older writer): None stays None."""
    if x is None or isinstance(x, bool):
        return None
    if isinstance(x, str):
        if x in _NONFINITE:
            return _NONFINITE[x]
        try:
            return float(x)
        except ValueError:
            return None
    return float(x)


def from_mlflow_value(v: float) -> float:
    return math.copysign(math.inf, v) if abs(v) >= _MLFLOW_INF else float(v)


def dumps(obj) -> str:
    return json.dumps(encode(obj), indent=2, allow_nan=False, default=str)


# ----------------------------------------------------------------------------------------- the verdict
REFERENCE = "fp32"  # the intervention whose run is a divergence's control: every attention intermediate in FP32
# Why a run diverged, judged against its control (an FP32 run of the same setup, `control_cause`):
CAUSE_PRECISION = "precision"  # the FP32 control stayed stable past the divergence step: attention precision did it
CAUSE_NOT_PRECISION = "not precision"  # the FP32 control diverged too: something else (lr, data, a bug) did it
CAUSE_NO_CONTROL = "no FP32 control"  # no conclusive FP32 run of the same setup: nothing can be said
CAUSES = (CAUSE_PRECISION, CAUSE_NOT_PRECISION, CAUSE_NO_CONTROL)
# effective config keys (flattened, as MLflow params name them) a run and its control must share: seed, data
# order, optimizer (learning rate), model and batch; keys either side lacks are not compared (older records).
# And the device model: the same seed repeats bit for bit on one GPU model, not across models (seed 1 of the
# paper regime diverged at step 2,288 on an H200 and not by 7,610 on an H100: results/paper_1gpu/h100-2026-12-05)
SETUP_PREFIXES = ("model.", "data.", "optimizer.", "train.seed", "train.batch_size", "train.grad_accum",
                  "train.warmup_steps", "train.grad_clip", "train.precision", "device.")
_SETUP_SKIP = ("data.num_proc", "data.root", "data.max_docs")  # how a corpus is prepared, not which batches


def setup_of(flat: Mapping[str, Any]) -> Dict[str, str]:
    """The part of a flattened config (dotted keys, e.g. MLflow params) that a run's FP32 control must share."""
    return {k: str(v) for k, v in sorted(flat.items())
            if k.startswith(SETUP_PREFIXES) and not k.startswith(_SETUP_SKIP) and v is not None}


def device_name(device) -> str:
    """The setup's `device.name`: the GPU model a run computed on (torch's name for it, e.g. 'NVIDIA H100 80GB
    HBM3'), else the device type ('cpu')."""
    import torch
    d = torch.device(device)
    if d.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(d)
    return d.type


def setup_differs(a: Optional[Mapping[str, str]], b: Optional[Mapping[str, str]]) -> List[str]:
    """The setup keys two runs both record with different values (empty: comparable)."""
    if not a or not b:
        return []
    return sorted(k for k in set(a) & set(b) if str(a[k]) != str(b[k]))


def control_cause(observed: Optional[str], divergence_step: Optional[int],
                  control: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The cause of a divergence, from its control's record (observed, divergence_step, steps_done, fork_step):
    precision only when the control stayed stable at least one step past the divergence (and, a fork, forked at
    or before it). None for a run that did not diverge."""
    if observed != "diverged":
        return None
    if not control or control.get("observed") not in ("stable", "diverged"):
        return CAUSE_NO_CONTROL
    if control["observed"] == "diverged":
        return CAUSE_NOT_PRECISION
    d = divergence_step if isinstance(divergence_step, int) else None
    done, forked = control.get("steps_done"), control.get("fork_step")
    if d is None or not isinstance(done, int) or done <= d or (isinstance(forked, int) and forked > d):
        return CAUSE_NO_CONTROL  # the control never got as far as the divergence: it vouches for nothing
    return CAUSE_PRECISION


def matches_paper(expected: Optional[str], observed: Optional[str], cause: Optional[str] = None) -> bool:
    """The run shows what the paper observed: it diverged where the paper's diverges AND its FP32 control stayed
    stable (cause 'precision'), or it stayed stable where the paper's is stable. A divergence without a control, or
    whose control diverged too, a failed run, or one without an expectation, matches nothing."""
    if (expected, observed) == ("diverges", "diverged"):
        return cause == CAUSE_PRECISION
    return (expected, observed) == ("stable", "stable")


def verdict_line(observed: Optional[str], divergence_step: Optional[int] = None, cause: Optional[str] = None,
                 control: Optional[str] = None, control_step: Optional[int] = None) -> str:
    """The verdict in one line, its control named: 'diverged at step 12; its FP32 control (job 1) stayed stable:
    precision' | 'diverged at step 1; no FP32 control' | 'diverged at step 1; its FP32 control (...) diverged too
    (step 1): the cause is not precision'."""
    if observed != "diverged":
        return str(observed or "running")
    at = f"diverged at step {divergence_step}" if divergence_step is not None else "diverged"
    named = f" ({control})" if control else ""
    if cause == CAUSE_PRECISION:
        return f"{at}; its FP32 control{named} stayed stable: precision"
    if cause == CAUSE_NOT_PRECISION:
        when = f" (step {control_step})" if control_step is not None else ""
        return f"{at}; its FP32 control{named} diverged too{when}: the cause is not precision"
    return f"{at}; no FP32 control"


# ---------------------------------------------------------------------------------------------- record
_INT_FIELDS = ("divergence_step", "min_loss_step", "steps_done", "fork_step", "verdict_window")
_FLOAT_FIELDS = ("final_loss", "min_loss", "val_loss", "peak_wq_norm", "wall_s", "verdict_margin")


@dataclass
class RunRecord:
    """One job's outcome: <job dir>/result.json. Steps are 0-based optimizer steps; `steps_done` counts them."""
    intervention: Optional[str] = None
    overrides: List[str] = field(default_factory=list)
    expected: Optional[str] = None  # the intervention file's `expect`: stable | diverges
    observed: str = "failed"  # stable | diverged | failed
    divergence_step: Optional[int] = None  # None: did not diverge (or failed before it could)
    divergence_reason: Optional[str] = None  # non-finite | spike
    final_loss: Optional[float] = None  # may be NaN / inf (a diverged run)
    min_loss: Optional[float] = None  # lowest loss before any divergence (the detector's running minimum)
    min_loss_step: Optional[int] = None
    val_loss: Optional[float] = None
    peak_wq_norm: Optional[float] = None  # largest W_Q spectral norm seen, and where (head_where)
    peak_wq_where: Optional[str] = None
    steps_done: int = 0
    early_stopped: bool = False
    wall_s: Optional[float] = None
    mlflow_run_id: Optional[str] = None
    attention_routes: Optional[List[str]] = None
    compiled: Optional[bool] = None  # train.compile as resolved (torch.compile around the model)
    compile_mode: Optional[str] = None  # torch.compile's mode: None (its default) | reduce-overhead (cudagraphs)
    compile_casts: Optional[bool] = None  # compiled: inductor's emulate_precision_casts as train.compile_casts set it
    deterministic: Optional[str] = None  # compiled: train.deterministic (auto | true | false)
    resumed_from: Optional[str] = None
    checkpoint: Optional[str] = None
    forked_from: Optional[str] = None  # a fork: the checkpoint it started from, its step, the source's run
    fork_step: Optional[int] = None
    source_run_id: Optional[str] = None
    verdict_margin: Optional[float] = None  # the detector's inputs, so a reader never re-derives them
    verdict_window: Optional[int] = None
    fork_baseline: Optional[str] = None
    error: Optional[str] = None
    warnings: List[str] = field(default_factory=list)  # counted numerical failures, a store that failed (spooled)
    # monitor.alarm when it was on: signal, threshold, direction, action, and the step (None until it fires), value,
    # checkpoint, ... of its firing
    alarm: Optional[Dict[str, Any]] = None
    job_dir: Optional[str] = None
    # the divergence's control: what must agree with an FP32 run (setup_of), the cause found against one (the sweep's
    # report fills cause/control; a lone run has none) and which run it was (its job or MLflow run id)
    setup: Optional[Dict[str, str]] = None
    cause: Optional[str] = None
    control: Optional[str] = None
    record_version: int = RECORD_VERSION

    @property
    def matches_paper(self) -> bool:
        return matches_paper(self.expected, self.observed, self.cause)

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "matches_paper": self.matches_paper}

    def to_json(self) -> str:
        return dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunRecord":
        """From result.json's dict (any version): unknown keys are ignored, numbers decoded."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        for k in _FLOAT_FIELDS:
            if k in kw:
                kw[k] = decode_float(kw[k])
        for k in _INT_FIELDS:
            if kw.get(k) is not None:
                v = decode_float(kw[k])
                kw[k] = int(v) if v is not None and math.isfinite(v) else None
        kw["overrides"] = [str(o) for o in (kw.get("overrides") or [])]
        kw["observed"] = kw.get("observed") or "failed"
        kw["record_version"] = int(d.get("record_version") or 1)
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> "RunRecord":
        return cls.from_dict(json.loads(text))


def write(job_dir: Path, record: RunRecord) -> Path:
    """<job dir>/result.json, atomically (a reader never sees half a file)."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / RESULT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(record.to_json())
    tmp.replace(path)
    return path


def read(job_dir: Path) -> RunRecord:
    """The record of a job folder; OSError / ValueError when it is missing or unreadable."""
    return RunRecord.from_json((Path(job_dir) / RESULT_FILE).read_text())


def result_path(job_dir: Path) -> Path:
    return Path(job_dir) / RESULT_FILE


def read_named(job_dir: Path) -> RunRecord:
    """read(), with a result.json that is not a record said as such, naming the file (json's own words, e.g.
    'Expecting value: line 1 column 1', named none): ValueError."""
    try:
        return read(job_dir)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # not JSON, or JSON but not an object
        raise ValueError(f"{result_path(job_dir)} is not a readable run record ({type(e).__name__}: "
                         f"{str(e)[:200]}); expected the result.json a job writes") from None


# ------------------------------------------------------------------------------------------ MLflow typing
TAG_VERDICT = "verdict"  # running | stable | diverged | failed
TAG_MATCHES = "matches_paper"  # "true" | "false"
TAG_INTERVENTION = "intervention"
TAG_EXPECT = "expected"  # what the paper expects: diverges | stable (older runs: tag "expect")
TAG_WHERE = "peak_wq_where"
TAG_REASON = "divergence_reason"
TAG_VERSION = "record_version"
TAG_ERROR = "error"
TAG_CAUSE = "cause"  # precision | not precision | no FP32 control (a diverged run only)
TAG_CONTROL = "control"  # the FP32 run the cause was judged against, short: "job 1" (its run id: TAG_CONTROL_RUN)
TAG_CONTROL_RUN = "control_run"
OLD_TAGS = {TAG_EXPECT: "expect", TAG_CAUSE: "verdict_cause", TAG_CONTROL: "verdict_control"}  # record_version 2
TAG_VERDICT_LINE = "verdict_line"  # verdict_line(): what a reader sees in one column
# run metrics (one value, at the run's last step); divergence_step is absent for a run that did not diverge
# (one name per number: the last val loss is val/loss's last point, not a second metric "val_loss"; older runs'
# "val_loss" and "diverged_at" are still read)
RUN_METRICS = ("divergence_step", "final_loss", "min_loss", "min_loss_step", "peak_wq_sigma", "steps_done", "wall_s")
_METRIC_FIELD = {"peak_wq_sigma": "peak_wq_norm"}  # metric name -> record field where they differ
SWEEP_METRICS = ("runs", "runs_matching_paper", "runs_diverged", "runs_stable", "runs_failed")


# where and how a run logs, not what it computes: left out of params (the resolved-config artifact keeps them)
PLUMBING_KEYS = ("results_dir", "tracking", "debug", "hydra", "sweep_name", "resume", "from_checkpoint")


_HYDRA_ESCAPE = re.compile(r"\\([\\()\[\]{}:=, '\"])")
_NOT_CHOSEN = ("results_dir=", "tracking.uri=", "hydra.", "tracking.experiment=")  # where it ran and logged


def user_overrides(overrides: Sequence[str]) -> List[str]:
    """The overrides as the user wrote them, for the `overrides` tag: without where the run was written and logged
    (results_dir, tracking.uri, hydra.*) and without the escapes Hydra's multirun adds (`sqlite\\:` -> `sqlite:`)."""
    out = []
    for o in overrides:
        if str(o).lstrip("+~").startswith(_NOT_CHOSEN):
            continue
        out.append(_HYDRA_ESCAPE.sub(r"\1", str(o)))
    return out


def _set_only(d: Mapping[str, Any]) -> Dict[str, Any]:
    """A settings dict without its unset entries (None, [], {}), nested dicts included."""
    out = {}
    for k, v in d.items():
        v = _set_only(v) if isinstance(v, Mapping) else v
        if v not in (None, [], {}):
            out[k] = v
    return out


def run_params(cfg, attention, routes: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """A run's MLflow params: the config without plumbing; for attention only what ran, per layer (the effective
    knobs: `attention_effective.<knob>` where every layer agrees, `attention_effective.L<i>.<knob>` where layers
    differ) and which code computed each layer (`attention_route.L<i>`); the intervention's own settings (unset
    knobs left out), not the pre-intervention attention config."""
    from omegaconf import OmegaConf
    plain = OmegaConf.to_container(OmegaConf.structured(cfg)) if not isinstance(cfg, dict) else dict(cfg)
    out = {k: v for k, v in plain.items() if k not in PLUMBING_KEYS + ("attention", "intervention")}
    out["intervention"] = _set_only(plain.get("intervention") or {})
    n_layer = int(plain["model"]["n_layer"])
    layers = [asdict(attention.for_layer(i)) for i in range(n_layer)]
    eff: Dict[str, Any] = {}
    for knob in layers[0] if layers else ():
        values = [lay[knob] for lay in layers]
        if all(v == values[0] for v in values):
            eff[knob] = values[0]
        else:
            for i, v in enumerate(values):
                eff[f"L{i}.{knob}"] = v
    out["attention_effective"] = eff
    if routes:
        out["attention_route"] = {f"L{i}": r for i, r in enumerate(routes)}
    return out


def record_tags(r: RunRecord) -> Dict[str, str]:
    """The final tags of a run: verdict, matches_paper, intervention (one name everywhere), and where."""
    tags = {TAG_VERDICT: r.observed, TAG_MATCHES: "true" if r.matches_paper else "false",
            TAG_INTERVENTION: r.intervention or "", TAG_VERSION: str(RECORD_VERSION)}
    if r.peak_wq_where:
        tags[TAG_WHERE] = r.peak_wq_where
    if r.divergence_reason:
        tags[TAG_REASON] = r.divergence_reason
    if r.error:
        tags[TAG_ERROR] = r.error
    if r.observed == "diverged":
        tags[TAG_CAUSE] = r.cause or CAUSE_NO_CONTROL
        if r.control:
            tags[TAG_CONTROL] = r.control
    tags[TAG_VERDICT_LINE] = verdict_line(r.observed, r.divergence_step, r.cause or None, r.control)
    return tags


def record_metrics(r: RunRecord) -> Dict[str, float]:
    """The run's sortable numbers (only those known: a stable run has no divergence_step)."""
    out = {}
    for name in RUN_METRICS:
        v = getattr(r, _METRIC_FIELD.get(name, name))
        if v is not None and not isinstance(v, bool):
            out[name] = float(v)
    return out


def sweep_metrics(records: Sequence[Any]) -> Dict[str, float]:
    """The parent run's aggregates over its rows (RunRecords or report rows with expected/observed)."""
    get = (lambda x, k: x.get(k)) if records and isinstance(records[0], Mapping) else getattr  # noqa: E731
    obs = [get(x, "observed") for x in records]
    # a report row's own matches_paper first: it knows the sweep (a stable run whose baseline never diverged is void)
    match = [bool(x["matches_paper"]) if isinstance(x, Mapping) and "matches_paper" in x else
             matches_paper(get(x, "expected"), o, get(x, "cause")) for x, o in zip(records, obs, strict=True)]
    return {"runs": float(len(records)), "runs_matching_paper": float(sum(match)),
            "runs_diverged": float(obs.count("diverged")), "runs_stable": float(obs.count("stable")),
            "runs_failed": float(sum(o not in ("stable", "diverged") for o in obs))}


def alarm_from_mlflow(tags: Mapping[str, str], params: Mapping[str, str]) -> Optional[Dict[str, Any]]:
    """The record's `alarm` from what a run logged: armed by the param monitor.alarm.enabled, fired by the tags
    ff.alarm.* (orchestrator/monitor/alarm.py)."""
    if str(params.get("monitor.alarm.enabled")).lower() != "true" and "ff.alarm.step" not in tags:
        return None
    fired = str(tags.get("ff.alarm.step", "")).isdigit()  # no tag carries the direction: the signal's own (report)
    signal = tags.get("ff.alarm.signal") or params.get("monitor.alarm.signal")
    return {"step": int(tags["ff.alarm.step"]) if fired else None, "signal": signal,
            "threshold": decode_float(tags.get("ff.alarm.threshold") or params.get("monitor.alarm.threshold")),
            "action": tags.get("ff.alarm.action") or params.get("monitor.alarm.action"),
            **({"value": decode_float(tags.get("ff.alarm.value"))} if fired else {}),
            **({"inactive": tags["ff.alarm.inactive"]} if tags.get("ff.alarm.inactive") else {})}


def from_mlflow_run(run, history: Mapping[str, Sequence[Tuple[int, float]]]) -> RunRecord:
    """A RunRecord from an MLflow run's tags, params and metrics as the job logged them (record_version 2). For
    older runs, or a run killed before its final metrics, the numbers come from its loss and W_Q histories; min_loss
    then needs the detector, run with the verdict inputs the run logged as params (record_version 1)."""
    t, p, m = run.data.tags, run.data.params, run.data.metrics
    verdict = t.get(TAG_VERDICT)
    observed = verdict if verdict in ("stable", "diverged") else "failed"
    final = lambda k: from_mlflow_value(m[k]) if k in m else None  # noqa: E731
    losses = list(history.get(LOSS) or [])
    last = losses[-1][0] if losses else None
    t = {**{new: t[old] for new, old in OLD_TAGS.items() if old in t and new not in t}, **t}  # older runs' names
    r = RunRecord(intervention=t.get(TAG_INTERVENTION), expected=t.get(TAG_EXPECT), observed=observed,
                  overrides=(t.get("overrides") or "").split(), mlflow_run_id=run.info.run_id,
                  job_dir=t.get("job_dir"), forked_from=t.get("forked_from"), source_run_id=t.get("forked_from_run"),
                  fork_step=int(t["fork_step"]) if str(t.get("fork_step", "")).isdigit() else None,
                  peak_wq_where=t.get(TAG_WHERE), divergence_reason=t.get(TAG_REASON),
                  verdict_margin=decode_float(p.get("verdict.margin")),
                  verdict_window=int(p["verdict.window"]) if str(p.get("verdict.window", "")).isdigit() else None,
                  fork_baseline=p.get("verdict.fork_baseline"), record_version=int(t.get(TAG_VERSION) or 1),
                  setup=setup_of(p) or None,
                  cause=t.get(TAG_CAUSE) if t.get(TAG_CAUSE) in CAUSES else None, control=t.get(TAG_CONTROL))
    if r.record_version >= 2 and "steps_done" in m:
        for name in RUN_METRICS:
            v = final(name)
            if v is not None:
                setattr(r, _METRIC_FIELD.get(name, name), int(v) if name in _INT_FIELDS else v)
        r.divergence_step = int(m["divergence_step"]) if "divergence_step" in m else None
        val = history.get(VAL_LOSS) or []
        r.val_loss = (from_mlflow_value(m["val_loss"]) if "val_loss" in m else  # written before one name per metric
                      val[-1][1] if val else (from_mlflow_value(m[VAL_LOSS]) if VAL_LOSS in m else None))
    else:  # older runs, or killed before the final record: from the histories
        r.divergence_step = int(t["divergence_step"]) if str(t.get("divergence_step", "")).isdigit() else None
        r.final_loss = losses[-1][1] if losses else None
        r.steps_done = last + 1 if last is not None else 0
        wq = [(v, k[len(WQ_SIGMA):]) for k, pts in history.items() if k.startswith(WQ_SIGMA) for _, v in pts]
        if wq:
            r.peak_wq_norm, r.peak_wq_where = max(wq)
        val = history.get(VAL_LOSS) or []
        r.val_loss = val[-1][1] if val else None
        cfg = VerdictConfig(**{k: v for k, v in (("margin", r.verdict_margin), ("window", r.verdict_window))
                               if v is not None})
        det = DivergenceDetector(cfg)
        det.update(losses)
        r.min_loss = det.min_loss if math.isfinite(det.min_loss) else None
        r.min_loss_step = det.min_loss_step
    r.alarm = alarm_from_mlflow(t, p)
    r.error = t.get(TAG_ERROR) or (None if observed != "failed" else
                                   f"no final verdict in MLflow (tag verdict={verdict!r}): the run stopped at step "
                                   f"{last} (killed, timed out or still running)")
    return r


__all__ = ["RunRecord", "RECORD_VERSION", "RESULT_FILE", "CKPT_DIR", "ORDER_FILE", "ERROR_FILE", "RESOLVED_CONFIG",
           "REPORT_DIR", "LOSS", "VAL_LOSS", "GRAD_NORM", "LR", "TOKENS_PER_S", "HISTORY_PREFIXES", "head_where",
           "PROBE", "PROBE_LAYER_KINDS", "PROBE_HEAD_KINDS", "PROBE_PLOTTED", "probe_name", "parse_probe_metric",
           "parse_where", "wq_sigma_name", "rmax_rows_name", "max_logit_name", "parse_head_metric",
           "parse_layer_metric", "encode", "decode_float", "from_mlflow_value", "dumps", "matches_paper", "write",
           "alarm_from_mlflow",
           "read", "read_named", "result_path", "record_tags", "record_metrics", "sweep_metrics", "from_mlflow_run",
           "RUN_METRICS", "SWEEP_METRICS", "TAG_VERDICT", "TAG_MATCHES", "TAG_INTERVENTION", "TAG_EXPECT",
           "REFERENCE", "NONFINITE_SUFFIX", "user_overrides", "CAUSES", "CAUSE_PRECISION", "CAUSE_NOT_PRECISION",
           "CAUSE_NO_CONTROL", "setup_of",
           "setup_differs", "control_cause", "verdict_line", "TAG_CAUSE", "TAG_CONTROL", "TAG_VERDICT_LINE",
           "TAG_CONTROL_RUN"]
