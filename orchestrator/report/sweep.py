"""The sweep report: one table of verdicts over a sweep's runs, with plots, logged to the sweep's MLflow parent run.

`SweepReport` is a Hydra callback. At multirun start it opens the MLflow parent run and writes
<sweep dir>/mlflow_parent.json (each job's Tracker nests under it). At multirun end it reads every job's run record
(orchestrator/report/rows.py; a job that died without one is reported as failed), pulls metric histories from MLflow
(orchestrator/report/readback.py), writes <sweep dir>/report/verdicts.md, verdicts.json and plots/ (the dated sweep
folder: a sweep never overwrites another's report, nor results/<sweep>/ where the repo keeps committed reproductions),
logs them and the sweep's counts (record.sweep_metrics) to the parent run, and prints the table.
`write_report(rows, out_dir, tracking_uri)` and `write_run_report(result, sweep, ...)` do the same without Hydra;
`flash-forensics report` over job/sweep folders or an MLflow experiment.
"""
from __future__ import annotations

import atexit
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.experimental.callback import Callback

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.config.folders import check_folder
from flash_forensics.orchestrator.record import HISTORY_PREFIXES, REPORT_DIR, matches_paper  # noqa: F401  (re-exported)
from flash_forensics.orchestrator.report import readback
from flash_forensics.orchestrator.report.readback import load_histories, retry, rows_from_mlflow  # noqa: F401  (re-exported)
from flash_forensics.orchestrator.report.render import (  # noqa: F401  (re-exported)
    format_table,
    run_meta,
    write_report,
)

# the row builders, re-exported
from flash_forensics.orchestrator.report.rows import (  # noqa: F401
    BASELINE,
    REFERENCE,
    ROW_KEYS,
    _common_overrides,
    _label,
    _num,
    _other_overrides,
    _peer,
    collect_rows,
    compare,
    row_from_result,
    rows_from_dirs,
)
from flash_forensics.orchestrator.tracking.tracker import (
    find_parent,
    get_or_create_experiment,
    git_info,
    make_client,
    resolve_uri,
    write_parent_file,
)


def report_dir(sweep_dir: os.PathLike) -> Path:
    """Where a sweep's report lives: inside its dated sweep folder."""
    return Path(sweep_dir) / REPORT_DIR


# ------------------------------------------------------------------------------------------------ writing
def write_run_report(result: Dict[str, Any], sweep: str, tracking_uri: Optional[str] = None,
                     job_dir: Optional[os.PathLike] = None, out_dir: Optional[os.PathLike] = None,
                     echo: bool = True) -> Dict[str, Path]:
    """The report of a single (non-multirun) run, one row: <job dir>/report/ unless out_dir is given (never the
    folder of a sweep's report)."""
    if out_dir is None and job_dir is None:
        raise ValueError("write_run_report: give job_dir (the report goes to <job dir>/report) or out_dir")
    row = row_from_result(result, job=Path(job_dir).name if job_dir else "run", job_dir=job_dir)
    return write_report([row], out_dir or report_dir(job_dir), tracking_uri, sweep=sweep, echo=echo)


def log_sweep_metrics(tracking_uri: str, parent_run_id: str, rows: Sequence[Dict]) -> None:
    """The sweep's counts as metrics of its parent run (sortable in the runs table): record.sweep_metrics, over the
    rows judged with their controls (compare)."""
    import time
    rows = compare([dict(r) for r in rows])

    from mlflow.entities import Metric
    now = int(time.time() * 1000)
    retry(make_client(resolve_uri(tracking_uri)).log_batch, parent_run_id,
           metrics=[Metric(k, v, now, 0) for k, v in record.sweep_metrics(list(rows)).items()])


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

    out_dir: where verdicts.{md,json} and plots/ go (default <sweep dir>/report: each sweep keeps its own table,
    and no sweep writes over results/<sweep>/, where committed reproductions live).
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
        old = find_parent(sweep_dir)
        if old and old.get("tracking_uri") == uri:  # the same sweep folder again (a rerun after a kill): its run
            try:
                retry(client.update_run, old["run_id"], status="RUNNING")
                self.parent = old
                print(f"[report] MLflow parent run {old['run_id']} reopened: this sweep folder's, from an earlier "
                      f"start (its jobs resume under it) in {uri}")
                return
            except Exception as e:  # gone from the store: a new one below
                print(f"[report] the sweep folder's parent run {old['run_id']} is not in {uri} ({e}): a new one")
        exp_id = get_or_create_experiment(client, exp_name or sweep, uri)
        tags = {**git_info(), "sweep": sweep, "sweep_dir": str(sweep_dir), "role": "sweep",
                "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                "sweep.overrides": " ".join(_task_overrides(config))}
        run = retry(client.create_run, exp_id, run_name=f"{sweep}@{sweep_dir.name}", tags=tags)
        write_parent_file(sweep_dir, uri, exp_id, run.info.run_id)
        self.parent = {"tracking_uri": uri, "experiment_id": exp_id, "run_id": run.info.run_id}
        print(f"[report] MLflow parent run {run.info.run_id} (experiment {exp_name or sweep}) in {uri}")

    def _at_exit(self) -> None:
        config, self._pending = getattr(self, "_pending", None), None
        if config is not None and not (self._out_dir(config) / "verdicts.json").exists():
            print("[report] the sweep ended without on_multirun_end (a job raised?): writing the report anyway")
            self._write(config, status="FAILED")

    def _out_dir(self, config) -> Path:
        return Path(self.out_dir) if self.out_dir else report_dir(Path(str(config.hydra.sweep.dir)))

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
        rows = collect_rows(sweep_dir)
        try:
            write_report(rows, self._out_dir(config), uri, sweep=sweep,
                         meta={"sweep_dir": str(sweep_dir),
                               "experiment_id": parent["experiment_id"] if parent else None},
                         parent_run_id=parent["run_id"] if parent else None)
            if parent:
                log_sweep_metrics(parent["tracking_uri"], parent["run_id"], rows)
        except BaseException:
            status = "FAILED"
            raise
        finally:
            if parent:
                retry(make_client(parent["tracking_uri"]).set_terminated, parent["run_id"], status=status)


def _jobs_store(rows) -> Optional[str]:
    """The store the rows' jobs logged to (their job.json), said once; None where they name none."""
    from collections import Counter
    uris = Counter(u for u in (readback.job_store(Path(r["job_dir"])) for r in rows if r.get("job_dir")) if u)
    if not uris:
        return None
    uri, n = uris.most_common(1)[0]
    others = f"; {sum(uris.values()) - n} job(s) name other stores: give --tracking-uri" if len(uris) > 1 else ""
    print(f"[report] MLflow store: {uri} (where {n} of the jobs logged, from their job.json){others}")
    return uri


def _once(rows: List[Dict]) -> List[Dict]:
    """Each run once: a job reached twice (a sweep folder and a job folder in it, a folder and its copy, the store and
    the folder) would be two rows of one run, counted twice in the report's tallies."""
    out, seen = [], set()
    for r in rows:
        keys = {k for k in (r.get("mlflow_run_id"), r.get("job_dir") and str(Path(r["job_dir"]).resolve())) if k}
        if keys & seen:
            continue
        seen |= keys
        out.append(r)
    if len(out) < len(rows):
        print(f"[report] {len(rows) - len(out)} run(s) reached twice (e.g. a sweep folder and a job folder in it): "
              "read once")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`flash-forensics report --out DIR [--sweep NAME] [--tracking-uri URI] JOB_OR_SWEEP_DIR...`: one
    table over runs from several sweeps (e.g. a baseline run, its forked isolation sweep and a beta sweep)."""
    import argparse
    ap = argparse.ArgumentParser(prog="flash-forensics report", description=main.__doc__.split(":")[0])
    ap.add_argument("dirs", nargs="*", help="job dirs (with result.json) and/or sweep dirs")
    ap.add_argument("--from-mlflow", metavar="EXPERIMENT", default=None,
                    help="rows from this MLflow experiment's runs (tags + histories) in --tracking-uri, for when "
                         "the job folders are gone")
    ap.add_argument("--out", required=True, help="where verdicts.{md,json} and plots/ go")
    ap.add_argument("--sweep", default=None, help="the report's name (default: the --out folder's name)")
    ap.add_argument("--tracking-uri", default=None,
                    help="MLflow store with the runs' histories (plots); default: the store the jobs logged to "
                         "(their job.json)")
    ap.add_argument("--histories", default=None, metavar="EXPORT.json.gz",
                    help="the runs' metric histories from a compact export (scripts/mlflow_export.py) instead of a "
                         "store: with job dirs and no --tracking-uri, no MLflow store is opened")
    ap.add_argument("--source-run", default=None, metavar="RUN_ID",
                    help="with --from-mlflow: only this source run and its forks")
    ap.add_argument("--fork-baseline", choices=("recorded", "source"), default="recorded",
                    help="how forks are judged: as each run recorded it (default), or 'source': a fork that ran with "
                         "a fresh detector re-judged from the histories as verdict.fork_baseline=source (its "
                         "source's running minimum at the fork step), so a fork that repeats its source gets its "
                         "source's verdict")
    ap.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                    help="extra lines for the report's meta block (e.g. command=..., repeatable)")
    args = ap.parse_args(argv)
    try:
        if not args.dirs and not args.from_mlflow:
            raise ValueError("nothing to report: give job/sweep dirs and/or --from-mlflow EXPERIMENT")
        if args.from_mlflow and not args.tracking_uri:
            raise ValueError("--from-mlflow needs --tracking-uri (the store that holds the experiment)")
        if args.source_run and not args.from_mlflow:
            raise ValueError("--source-run is not allowed without --from-mlflow: it picks the source run of an "
                             "MLflow experiment's runs")
        check_folder("--out", args.out, "verdicts.{md,json} and plots/ go there")
        bad_meta = [m for m in args.meta if "=" not in m]
        if bad_meta:
            raise ValueError(f"--meta {bad_meta[0]!r} is not allowed: expected KEY=VALUE")
        if args.tracking_uri is not None and not args.from_mlflow:  # named by the user: read, or refused now
            try:  # (not a report without histories and links, said in passing)
                readback.client_for(args.tracking_uri)
            except ValueError as e:
                uri, why = resolve_uri(args.tracking_uri), str(e)
                for head in (f"tracking.uri={uri!r} is not allowed: ", f"tracking.uri={uri!r}: ",
                             f"tracking uri {uri}: "):
                    why = why.removeprefix(head)
                raise ValueError(f"--tracking-uri {args.tracking_uri!r} is not allowed: {why}") from None
        seen = set()
        dirs = [d for d in args.dirs if not (Path(d).resolve() in seen or seen.add(Path(d).resolve()))]
        if len(dirs) < len(args.dirs):
            print(f"[report] {len(args.dirs) - len(dirs)} folder(s) given twice: read once")
        args.dirs = dirs
        rows, histories = (rows_from_mlflow(args.tracking_uri, args.from_mlflow, args.source_run)
                           if args.from_mlflow else ([], None))
        rows += rows_from_dirs(args.dirs)
        rows = _once(rows)
        if args.tracking_uri is None and not args.histories and not args.from_mlflow:
            args.tracking_uri = _jobs_store(rows)
        meta = dict(m.split("=", 1) for m in args.meta if "=" in m)
        meta["sources"] = [str(Path(d)) for d in args.dirs] + ([f"mlflow experiment {args.from_mlflow}"]
                                                              if args.from_mlflow else [])
        if histories is not None and args.dirs:
            histories = None  # mixed sources: load every run's histories the usual way
        if args.histories:
            if args.from_mlflow:
                raise ValueError("--histories reads job dirs' histories from an export; --from-mlflow has its own")
            histories = readback.histories_from_export(args.histories)
            missing = [r.get("job") for r in rows if r.get("mlflow_run_id") and r["mlflow_run_id"] not in histories]
            if missing and len(missing) == sum(bool(r.get("mlflow_run_id")) for r in rows):  # another store's
                raise ValueError(f"--histories {args.histories!r} is not allowed: it holds none of the {len(missing)} "
                                 f"run(s) ({', '.join(map(str, missing[:3]))}, ...); expected the export of the store "
                                 "they logged to")
            if missing:
                print(f"[report] {len(missing)} run(s) not in {args.histories}: {', '.join(map(str, missing[:5]))}")
        write_report(rows, args.out, args.tracking_uri, meta=meta, sweep=args.sweep, histories=histories,
                     offline=bool(args.histories) and args.tracking_uri is None, fork_rule=args.fork_baseline)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["SweepReport", "write_report", "write_run_report", "collect_rows", "row_from_result", "compare",
           "load_histories", "format_table", "run_meta", "matches_paper", "rows_from_dirs", "rows_from_mlflow", "main"]
