"""Early warning: each monitored signal as a predictor of divergence, measured over a set of runs.

    flash-forensics early-warning results/seeds/<date> results/lr/<date> --out results/early_warning
    flash-forensics early-warning --tracking-uri sqlite:///results/mlflow.db --experiment mini_repro_seeds
    flash-forensics early-warning results/mini/<date> sqlite:///other/mlflow.db --include-unfinished

Input: report dirs (sweep or job folders, or a report folder's verdicts.json), MLflow store URIs (every run in it, or
of --experiment) or an MLflow experiment of --tracking-uri. Each run's

divergence step, fork step and verdict come from its record (result.json, or its MLflow fields); its metric
histories from MLflow (orchestrator/report/readback.py). Failed runs are left out, and said so.

For each signal (orchestrator/monitor/signals.py, computed exactly as monitor.alarm computes it online) and each
threshold of its grid, an alarm fires at the first logged step where the signal is strictly past the threshold. A run is
judged from its first step (a fork: its fork step) on; a diverged run up to its divergence step, a stable run to its
end. Per (signal, threshold):
- lead time of each diverged run = divergence step - first alarm step, and their mean (over the runs that alarmed);
- misses: diverged runs with no alarm before their divergence step;
- false alarms: stable runs that alarm at all;
- with --include-unfinished, runs that ended without a verdict (killed, or out of time) and whose loss history
  shows no divergence (the run's own detector, replayed) are "unfinished": not diverged by their last logged step,
  which is all that is known. An alarm on one is neither a false alarm nor a hit: the table lists it apart, with
  how many steps the run went on without diverging after it. They never enter the chosen rule's criteria.
The grid: every run's extreme value of the signal over its judged window (peak; minimum for entropy), so every
threshold at which some run stops or starts alarming is on it, plus `--thresholds SIGNAL=a,b,...`. A signal absent
from a run (e.g. the probe signals without monitor.probes) is not judged on it, and the table says in how many runs
it was present.

The chosen rule (`choose`): among signals present in every run (all signals when none is), the fewest misses, then
the fewest false alarms, then the longest mean lead, then the lowest threshold; i.e. no misses first when any rule
has none. Output in --out: early_warning.md, early_warning.json, early_warning.png (mean lead time vs false alarms
per signal), and the monitor.alarm overrides of the chosen rule.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.config.folders import check_folder
from flash_forensics.orchestrator.errors import ConfigError
from flash_forensics.orchestrator.monitor import signals
from flash_forensics.orchestrator.monitor.signals import ABOVE, SIGNALS
from flash_forensics.orchestrator.report import fork_health
from flash_forensics.orchestrator.report import readback as store
from flash_forensics.orchestrator.report.fork_health import JUMP_NATS
from flash_forensics.orchestrator.report.plots import _save, palette, pyplot
from flash_forensics.orchestrator.report.rows import rows_from_dirs
from flash_forensics.orchestrator.verdict import DivergenceDetector, VerdictConfig

Series = Dict[str, List[Tuple[int, float]]]


@dataclass
class Run:
    name: str
    observed: str  # stable | diverged | unfinished (no verdict; not diverged by its last logged step)
    start: int  # first judged step: the fork step of a fork, else 0
    divergence_step: Optional[int]
    series: Series  # signal -> [(step, value)]
    run_id: Optional[str] = None
    last_step: Optional[int] = None  # the last logged training step (unfinished runs: how far "not diverged" goes)
    group: Optional[str] = None  # where it came from (a seed's table, a store): --holdout leaves one out at a time
    live: Optional[Dict] = None  # the record's alarm: monitor.alarm's rule and its firing in the run (live_check)


@dataclass
class Row:
    signal: str
    threshold: float
    direction: str
    runs_present: int
    diverged: int
    stable: int
    mean_lead: Optional[float]
    false_alarms: int
    misses: int
    leads: Dict[str, Optional[int]] = field(default_factory=dict)  # diverged run -> lead (None: missed)
    false_alarm_runs: List[str] = field(default_factory=list)
    unfinished: int = 0
    # unfinished run -> steps it went on, not diverged, after the alarm (absent: no alarm)
    unfinished_alarms: Dict[str, int] = field(default_factory=dict)


def judged(run: Run, pts: List[Tuple[int, float]]) -> List[Tuple[int, float]]:
    """The points a run is judged on: from its start, and for a diverged run before its divergence step."""
    end = run.divergence_step if run.observed == "diverged" else None
    return [(s, v) for s, v in pts if s >= run.start and (end is None or s < end)]


def grid(runs: Sequence[Run], signal: str, extra: Sequence[float] = ()) -> List[float]:
    """Each run's extreme of the signal over its judged window, plus extra thresholds, sorted."""
    pick = max if SIGNALS[signal].direction == ABOVE else min
    vals = {pick(v for _, v in pts) for r in runs if (pts := judged(r, r.series.get(signal, [])))}
    return sorted({float(v) for v in vals if math.isfinite(v)} | {float(x) for x in extra})


def evaluate(runs: Sequence[Run], signal: str, threshold: float) -> Row:
    direction = SIGNALS[signal].direction
    present = [r for r in runs if r.series.get(signal)]
    leads, fa, open_alarms = {}, [], {}
    for r in present:
        hit = signals.first_alarm(judged(r, r.series[signal]), direction, threshold)
        if r.observed == "diverged":
            leads[r.name] = r.divergence_step - hit[0] if hit else None
        elif r.observed == "unfinished":
            if hit:
                open_alarms[r.name] = int(r.last_step if r.last_step is not None else hit[0]) - hit[0]
        elif hit:
            fa.append(r.name)
    got = [x for x in leads.values() if x is not None]
    n_open = sum(r.observed == "unfinished" for r in present)
    return Row(signal, threshold, direction, len(present), len(leads), len(present) - len(leads) - n_open,
               sum(got) / len(got) if got else None, len(fa), sum(x is None for x in leads.values()), leads, fa,
               n_open, open_alarms)


def table(runs: Sequence[Run], extra: Optional[Dict[str, Sequence[float]]] = None) -> List[Row]:
    return [evaluate(runs, sig, t) for sig in SIGNALS for t in grid(runs, sig, (extra or {}).get(sig, ()))]


def _key(r: Row):
    return (r.misses, r.false_alarms, -(r.mean_lead or 0.0), r.threshold if r.direction == ABOVE else -r.threshold)


def choose(rows: Sequence[Row], n_runs: int) -> Optional[Row]:
    """The rule: fewest misses, then fewest false alarms, then longest mean lead (then the lowest threshold), among
    signals present in every run (all rows when none is)."""
    full = [r for r in rows if r.runs_present == n_runs and r.diverged] or [r for r in rows if r.diverged]
    # (unfinished runs count towards runs_present, so a signal must be in them too; their alarms are not criteria)
    if not full:
        return None
    return min(full, key=_key)


@dataclass
class Fold:
    """One source judged by rules chosen on the others: the overall rule, and each signal's best threshold."""
    held_out: str
    runs: int
    diverged: int
    stable: int
    chosen: Optional[Row]  # chosen on the other sources (their runs), then...
    test: Optional[Row]  # ...evaluated on this source's runs
    per_signal: Dict[str, Tuple[Row, Row]] = field(default_factory=dict)  # signal -> (on the others, on this one)


def holdout(runs: Sequence[Run], extra: Optional[Dict[str, Sequence[float]]] = None) -> List[Fold]:
    """Leave one source out: a rule (and each signal's threshold) chosen without a source's runs, judged on them.
    The in-sample table chooses its threshold on the runs it is scored on; this says how far that flatters it."""
    groups = list(dict.fromkeys(r.group for r in runs if r.group is not None))
    if len(groups) < 2 or any(r.group is None for r in runs):
        return []
    folds = []
    for g in groups:
        train = [r for r in runs if r.group != g]
        test = [r for r in runs if r.group == g]
        rows = table(train, extra)
        chosen = choose(rows, len(train))
        per = {}
        for sig in SIGNALS:
            mine = [r for r in rows if r.signal == sig and r.diverged]
            if mine and any(r.series.get(sig) for r in test):
                best = min(mine, key=_key)
                per[sig] = (best, evaluate(test, sig, best.threshold))
        n_div = sum(r.observed == "diverged" for r in test)
        n_open = sum(r.observed == "unfinished" for r in test)
        folds.append(Fold(g, len(test), n_div, len(test) - n_div - n_open, chosen,
                          evaluate(test, chosen.signal, chosen.threshold) if chosen else None, per))
    return folds


def pooled(folds: Sequence[Fold], signal: Optional[str] = None) -> Dict:
    """Over the folds: held-out misses, false alarms and leads of the overall rule (signal None) or of one signal."""
    pairs = [(f, f.chosen, f.test) if signal is None else (f, *f.per_signal[signal])
             for f in folds if (f.test if signal is None else f.per_signal.get(signal))]
    leads = {k: v for _, _, t in pairs for k, v in t.leads.items()}
    got = [v for v in leads.values() if v is not None]
    return dict(folds=len(pairs), diverged=sum(t.diverged for *_, t in pairs),
                stable=sum(t.stable for *_, t in pairs), misses=sum(t.misses for *_, t in pairs),
                false_alarms=sum(t.false_alarms for *_, t in pairs),
                mean_lead=sum(got) / len(got) if got else None, leads=leads,
                thresholds={f.held_out: c.threshold for f, c, _ in pairs},
                signals={f.held_out: c.signal for f, c, _ in pairs})


# ---------------------------------------------------------------------------------------------- loading
def _usable(rec_rows: Sequence[Dict], skipped: List[str], unfinished: bool = False) -> List[Dict]:
    """The rows that can be judged. With `unfinished`, a run without a verdict whose record shows no divergence
    becomes observed="unfinished": load() judges it by its loss history (none logged: left out), since a job killed
    before its result (known by its job.json) records no steps."""
    out = []
    for r in rec_rows:
        name = r.get("job") or r.get("mlflow_run_id")
        if (unfinished and r.get("observed") not in ("stable", "diverged") and r.get("divergence_step") is None
                and r.get("mlflow_run_id")):
            out.append(dict(r, observed="unfinished"))
        elif r.get("observed") not in ("stable", "diverged"):
            skipped.append(f"{name}: {r.get('observed')} ({r.get('error') or 'no verdict'})")
        elif not r.get("mlflow_run_id"):
            skipped.append(f"{name}: no MLflow run id")
        else:
            out.append(r)
    return out


def _rows_of(source: str) -> List[Dict]:
    p = Path(source)
    report = p if p.suffix == ".json" else p / "verdicts.json"
    if report.is_file() and not (p / record.RESULT_FILE).is_file():
        try:
            doc = json.loads(report.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{report}: not valid JSON ({e}); expected a report's verdicts.json") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("runs", []), list) \
                or not all(isinstance(r, dict) for r in doc.get("runs") or []):
            raise ValueError(f"{report}: not a report's verdicts.json (expected an object with a list of runs, each "
                             "an object)")
        return list(doc.get("runs") or [])
    return rows_from_dirs([p])


def _label(source: str) -> str:
    """A source's short name: <folder>/report*/verdicts.json (report, report_source, report_partial, ...) ->
    <folder>; a job or sweep folder -> its name."""
    p = Path(source)
    if p.suffix == ".json":
        p = p.parent
    return p.parent.name if p.name.startswith("report") else p.name


def _qualified(row: Dict) -> str:
    """A run's name prefixed with its source's, once (a job folder given as a source already starts with it)."""
    name, label = str(row.get("job") or row["mlflow_run_id"]), row["source_label"]
    return name if name.startswith(f"{label}/") else f"{label}/{name}"


def _is_store(source: str) -> bool:
    return "://" in source  # sqlite:///..., http://host:port, ...


def _store_rows(uri: str, experiment: Optional[str], skipped: List[str], unfinished: bool
                ) -> List[Tuple[Dict, Optional[str]]]:
    """Every job run of `uri` (of `experiment` when given), as records; the sweeps' parent runs are not jobs."""
    client = store.client_for(uri)
    if experiment is not None:
        exp = store.retry(client.get_experiment_by_name, experiment)
        if exp is None:
            raise ValueError(f"--experiment {experiment!r}: no such experiment in {uri}")
        exps = [exp]
    else:
        exps = store.retry(client.search_experiments)
    runs = [run for exp in exps for run in store.retry(client.search_runs, [exp.experiment_id], max_results=5000)
            if run.data.tags.get("role") != "sweep"]
    # names: "<store's folder>/<first word of the run name>" (a run name is "<intervention> <overrides>"), plus
    # the run id's head where that is not unique in the store
    label = Path(uri.split("://", 1)[1]).parent.name if uri.startswith("sqlite:") else uri
    short = [((run.info.run_name or run.info.run_id).split() or [run.info.run_id])[0] for run in runs]
    out = []
    for run, word in zip(runs, short):
        name = f"{label}/{word}" + (f"-{run.info.run_id[:8]}" if short.count(word) > 1 else "")
        rec = record.from_mlflow_run(run, store.history(client, run, (record.LOSS,)))
        d = dict(rec.to_dict(), job=name)
        out.extend((r, uri) for r in _usable([d], skipped, unfinished))
    return out


def _replayed_divergence(history: Dict, r: Dict) -> Optional[int]:
    """An unfinished run's divergence step by its own detector over its loss history (None: not diverged)."""
    cfg = VerdictConfig(**{k: v for k, v in (("margin", r.get("verdict_margin")), ("window", r.get("verdict_window")))
                           if v is not None})
    det = DivergenceDetector(cfg)
    det.update(history.get(record.LOSS) or [])
    return det.divergence_step if det.diverged else None


def _fill_fork_jumps(rows: List[Tuple[Dict, Optional[str]]], histories: Optional[Dict[str, Dict]],
                     client_of) -> None:
    """Forks read from job folders carry no fork_jump (a report computes it): computed here as the report does
    (orchestrator/report/fork_health.py), the fork's loss at its fork step against its source run's."""
    cache: Dict[Tuple[str, Optional[str]], list] = {}

    def loss(rid: str, uri: Optional[str]):
        if (rid, uri) not in cache:
            try:
                h = (histories or {}).get(rid) if histories is not None else store.history(
                    client_of(uri), rid, (record.LOSS,))
            except Exception:  # the store or run is gone: the jump stays unknown
                h = None
            cache[(rid, uri)] = fork_health._loss({rid: h or {}}, {"mlflow_run_id": rid})
        return cache[(rid, uri)]

    for r, uri in rows:
        fs, src = r.get("fork_step"), r.get("source_run_id")
        if not isinstance(fs, int) or r.get("fork_jump") is not None or not src or not r.get("mlflow_run_id"):
            continue
        m0, b0 = fork_health.loss_at(loss(r["mlflow_run_id"], uri), fs), fork_health.loss_at(loss(src, uri), fs)
        if m0 is not None and b0 is not None:
            r["fork_jump"] = m0 - b0


def load(sources: Sequence[str] = (), tracking_uri: Optional[str] = None, experiment: Optional[str] = None,
         growth_window: int = 100, unfinished: bool = False,
         histories: Optional[Dict[str, Dict]] = None, keep_jumped: bool = False,
         spike_window: int = 100) -> Tuple[List[Run], List[str]]:
    """(runs, skipped): the judged runs with their signal series, and a line per run left out. histories:
    {run id: history} from a compact export (--histories) instead of the runs' MLflow stores."""
    skipped: List[str] = []
    rows: List[Tuple[Dict, Optional[str]]] = []
    origin: Dict[str, str] = {}  # run id -> the source that gave it

    def add(got: List[Tuple[Dict, Optional[str]]], src: str) -> None:
        for r, _ in got:  # a run counted twice would weigh twice in every lead, miss and false alarm
            if r["mlflow_run_id"] in origin:
                raise ValueError(f"source {src!r} gives MLflow run {r['mlflow_run_id']} ({r.get('job')}), which "
                                 f"{origin[r['mlflow_run_id']]!r} gave already: expected each run once (a source "
                                 "given twice, or a report beside its own job folders?)")
            origin[r["mlflow_run_id"]] = src
        rows.extend(got)

    for src in sources:
        if _is_store(src):
            add(_store_rows(src, experiment, skipped, unfinished), src)
            continue
        add([(dict(r, source_label=_label(src)),
              tracking_uri or (store.job_store(Path(r["job_dir"])) if r.get("job_dir") else None))
             for r in _usable(_rows_of(src), skipped, unfinished)], src)
    names = [str(r.get("job") or r.get("mlflow_run_id")) for r, _ in rows]
    if len(set(names)) < len(names):  # several seeds' tables: 'baseline' in each, told apart by where they came from
        rows = [(dict(r, job=_qualified(r)) if "source_label" in r else r, uri) for r, uri in rows]
    if experiment is not None and not any(_is_store(s) for s in sources):
        add(_store_rows(tracking_uri, experiment, skipped, unfinished), f"--experiment {experiment}")
    clients: Dict[Optional[str], object] = {}

    def client_of(uri: Optional[str]):  # one per store: client_for checks it (a server's health GET) once
        if uri not in clients:
            clients[uri] = store.client_for(uri)
        return clients[uri]

    _fill_fork_jumps(rows, histories, client_of)
    runs = []
    for r, uri in rows:
        name = str(r.get("job") or r["mlflow_run_id"])
        jump = r.get("fork_jump")
        if not keep_jumped and isinstance(jump, (int, float)) and abs(jump) > JUMP_NATS:
            # the intervention changed the model's function at the fork (report's fork_jump): its verdict is that
            # damage, which no signal can precede, and its signals start from a different model
            skipped.append(f"{name}: its first loss is {jump:+.2f} nats from its baseline's (fork_jump): not judged")
            continue
        keys = signals.PREFIXES + ((record.LOSS,) if r["observed"] == "unfinished" else ())
        if histories is not None:
            if r["mlflow_run_id"] not in histories:
                skipped.append(f"{name}: MLflow run {r['mlflow_run_id']} is not in the export")
                continue
            hist = {k: v for k, v in histories[r["mlflow_run_id"]].items() if k.startswith(keys)}
        else:
            try:
                hist = store.history(client_of(uri), r["mlflow_run_id"], keys)
            except ValueError as e:  # its store is gone or lacks it: left out, said, the others still judged
                skipped.append(f"{name}: {e}")
                continue
        if r["observed"] == "unfinished" and not hist.get(record.LOSS):
            skipped.append(f"{name}: unfinished, with no logged loss: nothing to judge")
            continue
        if r["observed"] == "unfinished" and (div := _replayed_divergence(hist, r)) is not None:
            skipped.append(f"{name}: unfinished, and its loss diverged at step {div} by its detector: no verdict")
            continue
        start = int(r.get("fork_step") or 0)
        last = max((s for s, _ in hist.get(record.LOSS) or []), default=None)
        if last is None and r.get("steps_done"):
            last = int(r["steps_done"]) - 1
        group = r.get("source_label") or (name.split("/", 1)[0] if "/" in name else None)
        runs.append(Run(name, r["observed"], start, r.get("divergence_step"),
                        signals.series(hist, start, growth_window, spike_window), r["mlflow_run_id"], last,
                        group, r.get("alarm") if isinstance(r.get("alarm"), dict) else None))
    return runs, skipped


# ---------------------------------------------------------------------------------------------- output
def live_check(runs: Sequence[Run]) -> List[Dict]:
    """Per run that had monitor.alarm on: the step it fired at in the run (online) against the step this table's
    computation gives for the same rule on the run's logged history (offline, from its start; not cut at the
    divergence: the run's alarm is not either). They agree when the online signal is the offline one."""
    out = []
    for r in runs:
        a = r.live or {}
        sig = a.get("signal")
        if sig not in SIGNALS or not isinstance(a.get("threshold"), (int, float)):
            continue
        hit = signals.first_alarm([(s, v) for s, v in r.series.get(sig, []) if s >= r.start],
                                  SIGNALS[sig].direction, float(a["threshold"]))
        offline = hit[0] if hit else None
        out.append({"run": r.name, "signal": sig, "threshold": a["threshold"], "online_step": a.get("step"),
                    "online_value": a.get("value"), "offline_step": offline,
                    "offline_value": hit[1] if hit else None, "agree": offline == a.get("step")})
    return out


def _live_md(checks: Sequence[Dict], growth_window: int, spike_window: int) -> List[str]:
    if not checks:
        return []
    n = sum(c["agree"] for c in checks)
    out = ["", "## Live alarms: the run's firing against this table's", "",
           f"{n} of {len(checks)} runs with monitor.alarm on fired where this table's computation of the same rule "
           f"fires on their logged history (offline: wq_growth over {growth_window} steps, spikes against "
           f"{spike_window} values; a run that used other windows can differ for those signals).", "",
           "| run | rule | fired in the run | offline | agree |", "|---|---|---|---|---|"]
    for c in checks:
        rule = signals.rule_text(c["signal"], c["threshold"])
        on = "never" if c["online_step"] is None else f"step {c['online_step']} ({_fmt(c['online_value'], 6)})"
        off = "never" if c["offline_step"] is None else f"step {c['offline_step']} ({_fmt(c['offline_value'], 6)})"
        out.append(f"| {c['run']} | {rule} | {on} | {off} | {'yes' if c['agree'] else '**NO**'} |")
    return out


def _fmt(x, nd=4):
    return "-" if x is None else (f"{x:.{nd}g}" if isinstance(x, float) else str(x))


def _rule(r: Row) -> str:
    return f"`{signals.rule_text(r.signal, r.threshold, r.direction)}`"


def _holdout_md(folds: Sequence[Fold]) -> List[str]:
    lines = ["", "## Held out: each source judged by a rule chosen on the others", "",
             "The table above picks each threshold on the runs it then scores, which flatters it. Here every source "
             "in turn is left out, the rule is chosen on the rest by the same criteria, and the left-out runs are "
             "judged by it.", "",
             "| held out | its runs (diverged/stable) | rule chosen on the others | on the others: misses, false "
             "alarms | on the held-out: misses | false alarms | leads |", "|---|---|---|---|---|---|---|"]
    for f in folds:
        if f.chosen is None:
            lines.append(f"| {f.held_out} | {f.diverged}/{f.stable} | none (no diverged run left) | - | - | - | - |")
            continue
        c, t = f.chosen, f.test
        leads = ", ".join(f"{k.split('/', 1)[-1]} {_fmt(v)}" for k, v in t.leads.items()) or "-"
        lines.append(f"| {f.held_out} | {f.diverged}/{f.stable} | {_rule(c)} | {c.misses}/{c.diverged}, "
                     f"{c.false_alarms}/{c.stable} | {t.misses}/{t.diverged} | {t.false_alarms}/{t.stable} | "
                     f"{leads} |")
    p = pooled(folds)
    lines += ["", f"**Pooled over the held-out sources:** {p['misses']} misses of {p['diverged']}, "
              f"{p['false_alarms']} false alarms of {p['stable']}, mean lead {_fmt(p['mean_lead'])} steps.", "",
              "Each signal alone, its threshold chosen on the others (fewest misses, then false alarms), pooled over "
              "the held-out sources:", "",
              "| signal | thresholds chosen (per held-out source) | held-out misses | held-out false alarms | "
              "mean lead |", "|---|---|---|---|---|"]
    for sig in SIGNALS:
        q = pooled(folds, sig)
        if q["folds"]:
            th = ", ".join(f"{g}: {v:.4g}" for g, v in q["thresholds"].items())
            lines.append(f"| {sig} | {th} | {q['misses']}/{q['diverged']} | {q['false_alarms']}/{q['stable']} | "
                         f"{_fmt(q['mean_lead'])} |")
    return lines


def markdown(rows: Sequence[Row], runs: Sequence[Run], chosen: Optional[Row], skipped: Sequence[str],
             growth_window: int, folds: Sequence[Fold] = (), spike_window: int = 100) -> str:
    n_div = sum(r.observed == "diverged" for r in runs)
    n_open = sum(r.observed == "unfinished" for r in runs)
    opened = f", {n_open} unfinished" if n_open else ""
    lines = ["# Early warning: signals as predictors of divergence", "",
             f"{len(runs)} runs ({n_div} diverged, {len(runs) - n_div - n_open} stable{opened}); wq_growth over "
             f"{growth_window} steps, grad_spike and loss_spike against the median of the previous {spike_window} "
             "values. An alarm fires at the first logged step strictly past the threshold (entropy: below); a "
             "diverged run is judged before its divergence step, a fork from its fork step.", ""]
    if n_open:
        lines += ["Unfinished runs ended without a verdict and had not diverged by their last logged step. An alarm "
                  "on one is neither a hit nor a false alarm (it may diverge later); the last column says on how "
                  "many of them the rule alarmed and the fewest steps one went on without diverging after its "
                  "alarm. They take no part in choosing the rule.", ""]
    if chosen is None:
        lines += ["**Chosen rule:** none (no diverged run carries any signal).", ""]
    else:
        lines += [f"**Chosen rule** (fewest misses, then fewest false alarms, then longest mean lead, among signals "
                  f"present in every run): `{chosen.signal}` {chosen.direction} {chosen.threshold:.6g}: mean lead "
                  f"{_fmt(chosen.mean_lead)} steps, {chosen.false_alarms} false alarms of {chosen.stable} stable "
                  f"runs, {chosen.misses} misses of {chosen.diverged} diverged runs.", "",
                  f"`monitor.alarm.enabled=true monitor.alarm.signal={chosen.signal} "
                  f"monitor.alarm.threshold={chosen.threshold:.6g}`", ""]
    head = "| signal | threshold | runs with it | mean lead (steps) | false alarms | misses |"
    lines += [head + (" alarms on unfinished (min steps on after) |" if n_open else ""),
              "|---|---|---|---|---|---|" + ("---|" if n_open else "")]
    for r in rows:
        mark = " **(chosen)**" if r is chosen else ""
        cell = ""
        if n_open:
            after = min(r.unfinished_alarms.values()) if r.unfinished_alarms else None
            cell = f" {len(r.unfinished_alarms)}/{r.unfinished}" + (f" ({after})" if after is not None else "") + " |"
        lines.append(f"| {r.signal}{mark} | {'>' if r.direction == ABOVE else '<'} {r.threshold:.6g} | "
                     f"{r.runs_present} | {_fmt(r.mean_lead)} | {r.false_alarms}/{r.stable} | "
                     f"{r.misses}/{r.diverged} |" + cell)
    if folds:
        lines += _holdout_md(folds)
    absent = {s: [r.name for r in runs if not r.series.get(s)] for s in SIGNALS}
    lines += ["", "## Signals absent from runs", ""]
    lines += [f"- {s}: absent in {len(a)} of {len(runs)} runs" + (f" ({', '.join(a)})" if len(a) <= 8 else "")
              for s, a in absent.items() if a] or ["- none"]
    lines += ["", "## Runs", "", "| run | verdict | divergence step | judged from step | last logged step |",
              "|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.observed} | {_fmt(r.divergence_step)} | {r.start} | {_fmt(r.last_step)} |"
              for r in runs]
    lines += _live_md(live_check(runs), growth_window, spike_window)
    if skipped:
        lines += ["", "## Left out", ""] + [f"- {s}" for s in skipped]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], chosen: Optional[Row], path: Path) -> Optional[Path]:
    """Mean lead time vs false alarms, one line per signal over its thresholds; hollow markers: rules with misses."""
    sigs = [s for s in SIGNALS if any(r.signal == s and r.mean_lead is not None for r in rows)]
    if not sigs:
        return None
    fig, ax = pyplot().subplots(figsize=(7.5, 4.5))
    for sig, color in zip(sigs, palette(len(sigs))):
        pts = sorted((r.false_alarms, r.mean_lead, r.misses) for r in rows
                     if r.signal == sig and r.mean_lead is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=color, alpha=0.6, label=sig)
        for fa, lead, miss in pts:
            ax.plot(fa, lead, "o", color=color, mfc=color if miss == 0 else "none")
    if chosen is not None and chosen.mean_lead is not None:
        ax.plot(chosen.false_alarms, chosen.mean_lead, "*", ms=16, color="black",
                label=f"chosen: {chosen.signal} {'>' if chosen.direction == ABOVE else '<'} {chosen.threshold:.4g}")
    ax.set_xlabel("false alarms (stable runs that alarm)")
    ax.set_ylabel("mean lead time before divergence (steps)")
    ax.set_title("Early warning: lead time vs false alarms per signal\n(filled: no misses; hollow: misses)")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    return _save(fig, path)


def write(out: Path, runs: Sequence[Run], rows: Sequence[Row], chosen: Optional[Row], skipped: Sequence[str],
          growth_window: int, folds: Sequence[Fold] = (), spike_window: int = 100) -> Dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"rule": "fewest misses, then fewest false alarms, then longest mean lead, then lowest threshold; among "
                   "signals present in every run",
           "growth_window": growth_window, "spike_window": spike_window, "chosen": asdict(chosen) if chosen else None,
           "rows": [asdict(r) for r in rows], "skipped": list(skipped),
           "runs": [{"name": r.name, "observed": r.observed, "divergence_step": r.divergence_step, "start": r.start,
                     "last_step": r.last_step, "mlflow_run_id": r.run_id, "signals": sorted(r.series),
                     "group": r.group} for r in runs], "live_check": live_check(runs)}
    if folds:
        per = {s: pooled(folds, s) for s in SIGNALS}
        doc["holdout"] = {"folds": [asdict(f) for f in folds], "pooled": pooled(folds),
                          "per_signal": {s: p for s, p in per.items() if p["folds"]}}
    paths = {"md": out / "early_warning.md", "json": out / "early_warning.json"}
    paths["md"].write_text(markdown(rows, runs, chosen, skipped, growth_window, folds, spike_window))
    paths["json"].write_text(record.dumps(doc))
    png = plot(rows, chosen, out / "early_warning.png")
    if png:
        paths["png"] = png
    return paths


def _extra(specs: Sequence[str]) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {}
    for spec in specs:
        sig, _, vals = spec.partition("=")
        if sig not in SIGNALS or not vals:
            raise SystemExit(f"--thresholds {spec!r} is not allowed: expected SIGNAL=a,b,... with SIGNAL one of "
                             f"{', '.join(SIGNALS)}")
        try:
            nums = [float(v) for v in vals.split(",")]
        except ValueError:
            nums = [math.nan]
        if not all(math.isfinite(v) for v in nums):
            raise SystemExit(f"--thresholds {spec!r} is not allowed: expected finite numbers a,b,... after "
                             f"{sig}=")
        out.setdefault(sig, []).extend(nums)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="flash-forensics early-warning", description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="*", help="sweep or job folders, a report's verdicts.json, or MLflow store "
                    "URIs (sqlite:///...: every job run in it, or of --experiment)")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store (default: each job's own)")
    ap.add_argument("--experiment", default=None, help="read every run of this MLflow experiment")
    ap.add_argument("--out", default="results/early_warning",
                    help="folder for early_warning.{md,json,png} (default: results/early_warning, under the current "
                         "folder)")
    ap.add_argument("--growth-window", type=int, default=100,
                    help="steps of wq_growth's d ln sigma / d step (default: 100)")
    ap.add_argument("--spike-window", type=int, default=100, help="logged values whose median grad_spike and "
                    "loss_spike compare against (default: 100)")
    ap.add_argument("--thresholds", action="append", default=[], help="SIGNAL=a,b,...: extra thresholds")
    ap.add_argument("--histories", action="append", default=[], metavar="EXPORT.json.gz",
                    help="the runs' metric histories from a compact export (scripts/mlflow_export.py) instead of "
                         "their MLflow stores (job folders or reports as sources); repeat it for several exports "
                         "(e.g. one per seed)")
    ap.add_argument("--keep-jumped", action="store_true", help="judge forks whose first loss is more than "
                    f"{JUMP_NATS} nats from their baseline's (a report's fork_jump) too; left out by default")
    ap.add_argument("--include-unfinished", action="store_true", help="judge runs without a verdict whose loss "
                    "did not diverge as 'unfinished': alarms on them are listed apart, not counted as false alarms")
    ap.add_argument("--holdout", action="store_true", help="also judge each source (a seed's table, a store) by "
                    "the rule chosen on the others: how well the chosen threshold carries to runs it never saw")
    a = ap.parse_args(argv)
    if not a.sources and a.experiment is None:
        ap.error("give report dirs or --experiment (with --tracking-uri)")
    if a.experiment is not None and a.tracking_uri is None and not any(_is_store(x) for x in a.sources):
        ap.error("--experiment needs the store that holds it: --tracking-uri URI (or a store URI as a source)")
    if a.growth_window <= 0:
        ap.error(f"--growth-window={a.growth_window} is not allowed: expected an integer > 0")
    if a.spike_window <= 0:
        ap.error(f"--spike-window={a.spike_window} is not allowed: expected an integer > 0")
    if a.histories and (a.experiment is not None or any(_is_store(x) for x in a.sources)):
        ap.error("--histories reads job folders' runs from an export: give job or sweep folders, not a store")
    if a.histories and a.tracking_uri is not None:  # every history then comes from the export: the store is unread
        ap.error(f"--tracking-uri {a.tracking_uri!r} with --histories is not allowed: the histories come from the "
                 "export alone, no store is read; give one of them")
    try:
        hist = None
        for path in a.histories:
            hist = {**(hist or {}), **store.histories_from_export(path, signals.PREFIXES + (record.LOSS,))}
    except ValueError as e:
        ap.error(str(e))
    extra = _extra(a.thresholds)  # before any run is read
    try:  # --out too: a file there failed only after every run was read
        check_folder("--out", a.out, "early_warning.{md,json,png} go there")
    except ConfigError as e:
        ap.error(str(e))
    try:
        runs, skipped = load(a.sources, a.tracking_uri, a.experiment, a.growth_window, a.include_unfinished, hist,
                             a.keep_jumped, a.spike_window)
    except ValueError as e:  # a source that is not what it should be: one line naming it
        print(f"Error: {e}", file=sys.stderr)
        return 1
    if not runs:  # nothing judged: an empty table would read as a result
        why = "; ".join(skipped[:5]) + (f"; ... ({len(skipped)} in all)" if len(skipped) > 5 else "")
        print(f"Error: no run to judge in {', '.join(a.sources) or a.experiment}: "
              + (f"every run was left out: {why}" if skipped else "no runs found (expected sweep or job folders, "
                 "a report's verdicts.json with runs, or a store with job runs)"), file=sys.stderr)
        return 1
    rows = table(runs, extra)
    chosen = choose(rows, len(runs))
    folds = holdout(runs, extra) if a.holdout else []
    if a.holdout and not folds:
        groups = sorted({str(r.group) for r in runs})
        ap.error(f"--holdout needs runs from at least two sources, each known: got {', '.join(groups) or 'none'}")
    paths = write(Path(a.out), runs, rows, chosen, skipped, a.growth_window, folds, a.spike_window)
    print(paths["md"].read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
