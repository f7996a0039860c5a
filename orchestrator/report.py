"""The sweep report: one row per run, compared with the sweep's baseline, its fp32 reference and the paper.

`SweepReport` is a Hydra callback. At multirun start it opens the MLflow parent run and writes
<sweep dir>/mlflow_parent.json (each job's Tracker nests under it). At multirun end it reads every job's
result.json (a job that died without one is reported as failed), pulls metric histories from MLflow, and writes
results/<sweep>/verdicts.md, verdicts.json and plots/, logs them to the parent run and prints the table.
`write_report(rows, out_dir, tracking_uri)` and `write_run_report(result, sweep, ...)` do the same without Hydra.
"""
from __future__ import annotations

import atexit
import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.experimental.callback import Callback

from orchestrator.report_render import _fmt, _fork_lines, _markdown, _table, format_table, write_report  # noqa: F401
from orchestrator.tracking import (PARENT_FILE, RESULTS_DIR, _retry, find_parent, get_or_create_experiment,
                                   git_info, make_client, resolve_uri, write_parent_file)

BASELINE, REFERENCE = "baseline", "fp32"
HISTORY_PREFIXES = ("train/loss", "val/loss", "wq_sigma/", "rmax_rows/", "max_logit/")
ROW_KEYS = ("job", "intervention", "overrides", "expected", "observed", "matches_paper", "divergence_step",
            "final_loss", "min_loss", "peak_wq_norm", "peak_wq_where", "steps_done", "wall_s", "vs_baseline",
            "mlflow_run_id", "error", "job_dir", "fork_step", "forked_from")


# ---------------------------------------------------------------------------------------------------- rows
def _num(x) -> Optional[float]:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x


def row_from_result(result: Dict[str, Any], job: Optional[str] = None, job_dir: Optional[Path] = None) -> Dict:
    """A report row from a job's result.json (see the orchestrator contract)."""
    observed = result.get("observed") or "failed"
    expected = result.get("expected")
    row = {k: result.get(k) for k in ROW_KEYS if k in result}
    row.update(job=job, intervention=result.get("intervention"), overrides=list(result.get("overrides") or []),
               expected=expected, observed=observed, error=result.get("error"),
               job_dir=str(job_dir) if job_dir else result.get("job_dir"))
    row["matches_paper"] = matches_paper(expected, observed)
    for k in ROW_KEYS:
        row.setdefault(k, None)
    return row


def matches_paper(expected: Optional[str], observed: str) -> bool:
    return (expected, observed) in (("diverges", "diverged"), ("stable", "stable"))


def collect_rows(sweep_dir: Path) -> List[Dict]:
    """Rows for every job folder of a sweep (those holding result.json or Hydra's .hydra/), in job order."""
    sweep_dir = Path(sweep_dir)
    jobs = {p.parent for p in sweep_dir.rglob("result.json")} | {p.parent for p in sweep_dir.rglob(".hydra")}
    jobs.discard(sweep_dir)

    def order(p: Path):  # natural order: job 2 before job 10, paper_isolation-2 before paper_isolation-10
        rel = p.relative_to(sweep_dir).parts
        return [[(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", x) if t] for x in rel]

    rows = []
    for job_dir in sorted(jobs, key=order):
        name = str(job_dir.relative_to(sweep_dir))
        rfile = job_dir / "result.json"
        if rfile.is_file():
            try:
                rows.append(row_from_result(json.loads(rfile.read_text()), name, job_dir))
                continue
            except (OSError, ValueError) as e:
                err = f"unreadable result.json: {e}"
        else:
            err = "no result.json: the job was killed before it could write one (timeout, OOM, preemption?)"
        overrides = _hydra_overrides(job_dir)
        intervention = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~")
                             == "intervention"), None)
        rows.append(row_from_result({"intervention": intervention, "overrides": overrides, "observed": "failed",
                                     "error": err}, name, job_dir))
    return rows


def _hydra_overrides(job_dir: Path) -> List[str]:
    f = job_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return []
    try:
        import yaml
        return [str(o) for o in (yaml.safe_load(f.read_text()) or [])]
    except Exception:
        return []


def _other_overrides(row) -> set:
    return {o for o in row.get("overrides") or [] if o.split("=", 1)[0].lstrip("+~") != "intervention"}


def _peer(row: Dict, rows: Sequence[Dict], name: str) -> Optional[Dict]:
    """The `name` run closest to `row`: same other overrides (e.g. same seed) first, else the first one."""
    cands = [r for r in rows if r.get("intervention") == name and r is not row]
    if not cands:
        return None
    mine = _other_overrides(row)
    return max(cands, key=lambda r: len(_other_overrides(r) & mine) - len(_other_overrides(r) ^ mine))


def compare(rows: List[Dict]) -> List[Dict]:
    """Fill matches_paper and a `vs_baseline` note (vs the baseline's divergence and the fp32 final loss)."""
    for row in rows:
        notes = []
        name, obs = row.get("intervention"), row["observed"]
        if obs == "failed":
            notes.append("failed: " + (str(row.get("error") or "unknown error").splitlines() or ["?"])[0][:160])
        base = _peer(row, rows, BASELINE) if name != BASELINE else None
        ref = _peer(row, rows, REFERENCE) if name != REFERENCE else None
        if name == BASELINE:
            notes.append("the baseline" + ("" if obs != "stable" else " did not diverge: run longer or check "
                                           "the recipe; comparisons with it are void"))
        elif name == REFERENCE:
            notes.append("the fp32 reference")
        if base is not None and obs != "failed":
            bd = base.get("divergence_step")
            if base["observed"] == "diverged" and obs == "stable":
                notes.append(f"stable where the baseline diverged at step {bd}")
            elif base["observed"] == "diverged" and obs == "diverged":
                d = row.get("divergence_step")
                delta = f" ({d - bd:+d} steps)" if d is not None and bd is not None else ""
                notes.append(f"diverged at step {d}; baseline at {bd}{delta}")
            elif base["observed"] == "stable" and obs == "diverged":
                notes.append(f"diverged at step {row.get('divergence_step')} while the baseline did not")
        fl, rl = _num(row.get("final_loss")), _num(ref.get("final_loss")) if ref else None
        if fl is not None and rl is not None and math.isfinite(fl) and math.isfinite(rl) and obs == "stable":
            notes.append(f"final loss {fl - rl:+.3f} vs fp32")
        row["vs_baseline"] = "; ".join(notes)
        row["matches_paper"] = matches_paper(row.get("expected"), obs)
    return rows


# --------------------------------------------------------------------------------------------- histories
def load_histories(tracking_uri: str, rows: Sequence[Dict], prefixes=HISTORY_PREFIXES) -> Dict[str, Dict]:
    """{mlflow_run_id: {metric: [(step, value)]}} for the report's plots (runs MLflow no longer has are skipped)."""
    out: Dict[str, Dict] = {}
    ids = [r["mlflow_run_id"] for r in rows if r.get("mlflow_run_id")]
    if not ids:
        return out
    client = make_client(resolve_uri(tracking_uri))
    from tqdm import tqdm
    for rid in tqdm(ids, desc="report: metric histories", disable=len(ids) < 4, leave=False):
        try:
            run = _retry(client.get_run, rid)
        except Exception as e:
            print(f"[report] MLflow run {rid} not readable: {e}")
            continue
        hist = {}
        for key in run.data.metrics:
            if key.startswith(prefixes):
                pts = _retry(client.get_metric_history, rid, key)
                hist[key] = sorted((int(m.step), float(m.value)) for m in pts)
        out[rid] = hist
    return out


def _common_overrides(rows: Sequence[Dict]) -> set:
    """Overrides every run shares (experiment=..., tracking.uri=...): left out of tables and legends."""
    if len(rows) < 2:
        return set()
    return set.intersection(*(_other_overrides(r) for r in rows))


# overrides that say where and how long a run ran, not what it computes: left out of plot legends
_PLUMBING = ("from_checkpoint=", "sweep_name=", "hydra.", "tracking.", "train.ckpt_every=", "train.max_steps=",
             "train.keep_checkpoints=", "train.early_stop=", "results_dir=", "+sweep=")


def _label(row: Dict, common: set = frozenset()) -> str:
    extra = sorted(o for o in _other_overrides(row) - common if not o.lstrip("+~").startswith(_PLUMBING)
                   and not o.startswith("+sweep="))
    tail = (" " + " ".join(extra)) if extra else ""
    return f"{row.get('job') or ''}:{row.get('intervention')}{tail}"[:70]


# ------------------------------------------------------------------------------------------------ writing
def run_meta(tracking_uri: Optional[str] = None, **extra) -> Dict[str, Any]:
    """Command, commit, hardware, versions and time: what a reader needs to reproduce the table."""
    import torch
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("mlflow", "hydra", "omegaconf"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "git": git_info(), "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "hardware": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                         "cpu_count": os.cpu_count(), "gpus": gpus},
            "versions": versions, "tracking_uri": tracking_uri, **extra}


def _summary_tags(summary):
    from mlflow.entities import RunTag
    return [RunTag(f"sweep.{k}", str(v)) for k, v in summary.items()]


def _finite(x):
    """NaN/Inf (a diverged run's final loss) become null: verdicts.json stays strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_run_report(result: Dict[str, Any], sweep: str, tracking_uri: Optional[str] = None,
                     job_dir: Optional[os.PathLike] = None, out_dir: Optional[os.PathLike] = None,
                     echo: bool = True) -> Dict[str, Path]:
    """The report of a single (non-multirun) run: results/<sweep>/verdicts.{md,json} with one row."""
    row = row_from_result(result, job=Path(job_dir).name if job_dir else "run", job_dir=job_dir)
    return write_report([row], out_dir or RESULTS_DIR / sweep, tracking_uri, sweep=sweep, echo=echo)


# ------------------------------------------------------------------------------------------ Hydra callback
def _sweep_name(config) -> str:
    for key in ("sweep_name", "name"):
        v = config.get(key) if hasattr(config, "get") else None
        if v:
            return str(v)
    return "sweep"


def _task_overrides(config) -> List[str]:
    """The command line's overrides (e.g. intervention=baseline,fp32) plus a sweep file's sweeper params."""
    from omegaconf import OmegaConf
    task = OmegaConf.select(config, "hydra.overrides.task", default=None) or []
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    return [str(o) for o in task] + [f"{k}={v}" for k, v in dict(params).items()]


def _tracking_cfg(config):
    t = config.get("tracking") if hasattr(config, "get") else None
    uri = t.get("uri") if t is not None else None
    exp = t.get("experiment") if t is not None else None
    return resolve_uri(uri), exp


class SweepReport(Callback):
    """Hydra callback: MLflow parent run at multirun start, verdict report at multirun end.

    out_dir: where verdicts.{md,json} and plots/ go (default results/<sweep>); a copy of the md/json also lands
    in the timestamped sweep dir so older sweeps keep their own table.
    """

    def __init__(self, out_dir: Optional[str] = None, tracking: bool = True):
        self.out_dir = out_dir
        self.tracking = tracking
        self.parent: Optional[Dict[str, str]] = None

    def on_multirun_start(self, config, **kwargs) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        # Hydra skips on_multirun_end when a job raises out of the sweep: still write the report at exit
        self._pending = config
        atexit.register(self._at_exit)
        if not self.tracking:
            return
        uri, exp_name = _tracking_cfg(config)
        sweep = _sweep_name(config)
        client = make_client(uri)
        exp_id = get_or_create_experiment(client, exp_name or sweep, uri)
        tags = {**git_info(), "sweep": sweep, "sweep_dir": str(sweep_dir), "role": "sweep",
                "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                "sweep.overrides": " ".join(_task_overrides(config))}
        run = _retry(client.create_run, exp_id, run_name=f"{sweep}@{sweep_dir.name}", tags=tags)
        write_parent_file(sweep_dir, uri, exp_id, run.info.run_id)
        self.parent = {"tracking_uri": uri, "experiment_id": exp_id, "run_id": run.info.run_id}
        print(f"[report] MLflow parent run {run.info.run_id} (experiment {exp_name or sweep}) in {uri}")

    def _at_exit(self) -> None:
        config, self._pending = getattr(self, "_pending", None), None
        if config is not None and not (Path(str(config.hydra.sweep.dir)) / "verdicts.json").exists():
            print("[report] the sweep ended without on_multirun_end (a job raised?): writing the report anyway")
            self._write(config, status="FAILED")

    def on_multirun_end(self, config, **kwargs) -> None:
        self._write(config, status="FINISHED")

    def _write(self, config, status: str) -> None:
        self._pending = None
        try:
            atexit.unregister(self._at_exit)
        except Exception:
            pass
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep = _sweep_name(config)
        parent = self.parent or find_parent(sweep_dir)
        uri = parent["tracking_uri"] if parent else (_tracking_cfg(config)[0] if self.tracking else None)
        root = config.get("results_dir") if hasattr(config, "get") else None
        out_dir = Path(self.out_dir) if self.out_dir else (Path(str(root)).resolve() if root else RESULTS_DIR) / sweep
        rows = collect_rows(sweep_dir)
        try:
            paths = write_report(rows, out_dir, uri, sweep=sweep,
                                 meta={"sweep_dir": str(sweep_dir),
                                       "experiment_id": parent["experiment_id"] if parent else None},
                                 parent_run_id=parent["run_id"] if parent else None)
            for key in ("md", "json"):  # history per sweep beside its jobs
                (sweep_dir / paths[key].name).write_text(paths[key].read_text())
        except BaseException:
            status = "FAILED"
            raise
        finally:
            if parent:
                _retry(make_client(parent["tracking_uri"]).set_terminated, parent["run_id"], status=status)


# ------------------------------------------------------------------------------------------------------ CLI
def rows_from_dirs(dirs: Sequence[os.PathLike]) -> List[Dict]:
    """Rows from several places at once: a job dir (holding result.json) gives its row, a sweep dir its jobs'."""
    rows: List[Dict] = []
    for d in (Path(x).resolve() for x in dirs):  # resolved: "." gets its folder's name
        if (d / "result.json").is_file():
            try:
                rows.append(row_from_result(json.loads((d / "result.json").read_text()), d.name, d))
            except (OSError, ValueError) as e:  # a job killed while writing it: a failed row, not a lost table
                rows.append(row_from_result({"observed": "failed", "error": f"unreadable {d / 'result.json'}: {e}",
                                             "overrides": _hydra_overrides(d)}, d.name, d))
        elif d.is_dir():
            found = collect_rows(d)
            if not found:
                raise ValueError(f"{d}: no job folders (result.json or .hydra/) under it")
            rows.extend(dict(r, job=f"{d.name}/{r['job']}") for r in found)
        else:
            raise ValueError(f"{d}: not a directory")
    return rows


def rows_from_mlflow(tracking_uri: str, experiment: str, source_run: Optional[str] = None
                     ) -> Tuple[List[Dict], Dict[str, Dict]]:
    """(rows, histories) rebuilt from an MLflow experiment's runs alone (their tags and metric histories), for when
    the job folders are gone (a lost machine, a copy of the store only). A run without a final verdict tag is a
    failed row that says where it stopped. source_run: only that run and the forks of it (an experiment that holds
    several runs of scripts/paper_isolation.sh); without it, more than one source run is an error."""
    from tqdm import tqdm

    from orchestrator.verdict import DivergenceDetector, VerdictConfig
    uri = resolve_uri(tracking_uri)
    client = make_client(uri)
    exp = _retry(client.get_experiment_by_name, experiment)
    if exp is None:
        raise ValueError(f"--from-mlflow {experiment!r}: no such experiment in {uri}")
    runs = [r for r in _retry(client.search_runs, [exp.experiment_id], max_results=5000)
            if r.data.tags.get("role") != "sweep"]  # sweep parent runs hold no training
    sources = [r.info.run_id for r in runs if "fork_step" not in r.data.tags]
    if source_run is not None:
        if source_run not in sources:
            raise ValueError(f"--source-run {source_run!r}: not a source run of experiment {experiment!r}; "
                             f"allowed: {', '.join(sources) or 'none'}")
        runs = [r for r in runs if source_run in (r.info.run_id, r.data.tags.get("forked_from_run"))]
    elif len(sources) > 1:
        raise ValueError(f"--from-mlflow {experiment!r} holds {len(sources)} source runs ({', '.join(sources)}): "
                         f"one table per source; give --source-run RUN_ID")
    rows, histories = [], {}
    for run in tqdm(runs, desc="report: runs from MLflow", disable=len(runs) < 4, leave=False):
        t, rid = run.data.tags, run.info.run_id
        hist = {k: sorted((int(m.step), float(m.value)) for m in _retry(client.get_metric_history, rid, k))
                for k in run.data.metrics if k.startswith(HISTORY_PREFIXES)}
        histories[rid] = hist
        losses = hist.get("train/loss", [])
        wq = [(v, k.split("/", 1)[1]) for k, pts in hist.items() if k.startswith("wq_sigma/") for _, v in pts]
        verdict = t.get("verdict")
        last = losses[-1][0] if losses else None
        p = run.data.params  # min_loss as the run's own detector saw it: before any divergence, up-steps excluded
        det = DivergenceDetector(VerdictConfig(margin=float(p.get("verdict.margin", 1.0)),
                                               window=int(p.get("verdict.window", 20))))
        det.update(losses)
        result = {"intervention": t.get("intervention"), "expected": t.get("expect"),
                  "overrides": (t.get("overrides") or "").split(), "mlflow_run_id": rid, "job_dir": t.get("job_dir"),
                  "observed": verdict if verdict in ("stable", "diverged") else "failed",
                  "divergence_step": int(t["divergence_step"]) if str(t.get("divergence_step", "")).isdigit()
                  else None,
                  "final_loss": losses[-1][1] if losses else None,
                  "min_loss": det.min_loss if math.isfinite(det.min_loss) else None,
                  "steps_done": last + 1 if last is not None else 0,
                  "peak_wq_norm": max(wq)[0] if wq else None, "peak_wq_where": max(wq)[1] if wq else None,
                  "fork_step": int(t["fork_step"]) if str(t.get("fork_step", "")).isdigit() else None,
                  "forked_from": t.get("forked_from"),
                  "error": t.get("error") or (None if verdict in ("stable", "diverged") else
                                              f"no final verdict in MLflow (tag verdict={verdict!r}): the run stopped "
                                              f"at step {last} (killed, timed out or still running)")}
        name = (t.get("sweep") or "").rsplit("/", 1)[-1] or run.info.run_name
        rows.append((run.info.start_time or 0, row_from_result(result, name)))
    # sources before forks; job groups ("paper_isolation-3" -> "paper_isolation") in launch order, jobs by number
    group = lambda r: re.sub(r"-?\d+$", "", r.get("job") or "")  # noqa: E731
    first = {}
    for t0, r in sorted(rows, key=lambda tr: tr[0]):
        first.setdefault(group(r), t0)
    num = lambda r: int(m.group(1)) if (m := re.search(r"(\d+)$", r.get("job") or "")) else -1  # noqa: E731
    rows.sort(key=lambda tr: (tr[1].get("fork_step") is not None, first[group(tr[1])], num(tr[1]), tr[0]))
    return [r for _, r in rows], histories


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m orchestrator.report --out DIR [--sweep NAME] [--tracking-uri URI] JOB_OR_SWEEP_DIR...`: one
    table over runs from several sweeps (e.g. a baseline run, its forked isolation sweep and a beta sweep)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m orchestrator.report", description=main.__doc__.split(":")[0])
    ap.add_argument("dirs", nargs="*", help="job dirs (with result.json) and/or sweep dirs")
    ap.add_argument("--from-mlflow", metavar="EXPERIMENT", default=None,
                    help="rows from this MLflow experiment's runs (tags + histories) in --tracking-uri, for when "
                         "the job folders are gone")
    ap.add_argument("--out", required=True, help="where verdicts.{md,json} and plots/ go")
    ap.add_argument("--sweep", default=None, help="the report's name (default: the --out folder's name)")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store with the runs' histories (plots)")
    ap.add_argument("--source-run", default=None, metavar="RUN_ID",
                    help="with --from-mlflow: only this source run and its forks")
    ap.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                    help="extra lines for the report's meta block (e.g. command=..., repeatable)")
    args = ap.parse_args(argv)
    try:
        if not args.dirs and not args.from_mlflow:
            raise ValueError("nothing to report: give job/sweep dirs and/or --from-mlflow EXPERIMENT")
        if args.from_mlflow and not args.tracking_uri:
            raise ValueError("--from-mlflow needs --tracking-uri (the store that holds the experiment)")
        rows, histories = (rows_from_mlflow(args.tracking_uri, args.from_mlflow, args.source_run)
                           if args.from_mlflow else ([], None))
        rows += rows_from_dirs(args.dirs)
        meta = dict(m.split("=", 1) for m in args.meta if "=" in m)
        meta["sources"] = [str(Path(d)) for d in args.dirs] + ([f"mlflow experiment {args.from_mlflow}"]
                                                              if args.from_mlflow else [])
        if histories is not None and args.dirs:
            histories = None  # mixed sources: load every run's histories the usual way
        write_report(rows, args.out, args.tracking_uri, meta=meta, sweep=args.sweep, histories=histories)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["SweepReport", "write_report", "write_run_report", "collect_rows", "row_from_result", "compare",
           "load_histories", "format_table", "run_meta", "matches_paper", "rows_from_dirs", "rows_from_mlflow", "main"]
