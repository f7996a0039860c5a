"""Reading runs back from an MLflow store: the one metric-history loader (report plots, localization, rows) and
report rows rebuilt from a store alone (`rows_from_mlflow`), from what each job logged (orchestrator/record.py).
"""
from __future__ import annotations

import math
import re
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.job.folder import read_job_start
from flash_forensics.orchestrator.report.rows import row_from_record

# the one retry policy for a sqlite store locked by another local job (MLflow retries deadlocks, not locks)
from flash_forensics.orchestrator.tracking.tracker import (
    check_tracking,
    find_parent,
    make_client,
    resolve_uri,
    retry,
    sqlite_path,
)

History = Dict[str, List[Tuple[int, float]]]


def client_for(tracking_uri: Optional[str]):
    """A client to read runs from: the store must exist (a reader never creates one) and a server must answer
    within seconds (never a hang on an unreachable host)."""
    uri = resolve_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise ValueError(f"no MLflow store at {db} (tracking uri {uri}): nothing to read there; give the store the "
                         "runs were logged to (--tracking-uri), or an export of it where the tool takes one "
                         "(--histories)")
    if db is None:  # a server answers within seconds; a bare path (MLflow's file store) or unknown scheme is refused
        check_tracking(uri, timeout_s=10)
    return make_client(uri)


def job_store(job_dir: Path) -> Optional[str]:
    """The store a job logged to: its job.json (written at job start), else its Hydra config, else its sweep's
    mlflow_parent.json."""
    uri = (read_job_start(job_dir) or {}).get("tracking_uri")
    if uri:
        return str(uri)
    cfg = job_dir / ".hydra" / "config.yaml"
    if cfg.is_file():
        try:
            import yaml
            uri = ((yaml.safe_load(cfg.read_text()) or {}).get("tracking") or {}).get("uri")
            if uri:
                return str(uri)
        except Exception:
            pass
    for d in (job_dir, job_dir.parent):
        parent = find_parent(d)
        if parent and parent.get("tracking_uri"):
            return parent["tracking_uri"]
    return None


def get_run(client, run_id: str):
    """The MLflow run; one that is not in the store is a ValueError naming the store and what to do."""
    try:
        return retry(client.get_run, run_id)
    except Exception as e:  # MLflow's RESOURCE_DOES_NOT_EXIST names neither the store nor what to do
        if "not found" not in str(e) and "RESOURCE_DOES_NOT_EXIST" not in str(e):
            raise
        raise ValueError(f"MLflow run {run_id} is not in {getattr(client, 'tracking_uri', 'this store')}: give the "
                         "store it was logged to (--tracking-uri), or an export of it where the tool takes one "
                         "(--histories)") from None


def history(client, run, prefixes: Sequence[str] = record.HISTORY_PREFIXES, progress: str = "") -> History:
    """{metric: [(step, value)]} of one run (an MLflow Run or its id), for the metrics starting with `prefixes`;
    +-inf come back as floats (record.from_mlflow_value), sorted by step."""
    if isinstance(run, str):
        run = get_run(client, run)
    rid = run.info.run_id
    keys = [k for k in run.data.metrics if k.startswith(tuple(prefixes))]
    from tqdm import tqdm
    out: History = {}
    for key in tqdm(keys, desc=progress or "metric histories", disable=not progress or len(keys) < 50,
                    leave=False):
        out[key] = sorted((int(m.step), record.from_mlflow_value(m.value))
                          for m in retry(client.get_metric_history, rid, key))
    return out


def load_histories(tracking_uri: Optional[str], rows: Sequence[Dict],
                   prefixes: Sequence[str] = record.HISTORY_PREFIXES) -> Dict[str, History]:
    """{mlflow_run_id: history} for report rows (runs MLflow no longer has are skipped, with a line saying so)."""
    ids = [r["mlflow_run_id"] for r in rows if r.get("mlflow_run_id")]
    if not ids:
        return {}
    client = client_for(tracking_uri)
    from tqdm import tqdm
    out: Dict[str, History] = {}
    for rid in tqdm(ids, desc="report: metric histories", disable=len(ids) < 4, leave=False):
        try:
            run = retry(client.get_run, rid)
        except Exception as e:
            print(f"[report] MLflow run {rid} not readable: {e}")
            continue
        out[rid] = history(client, run, prefixes)
    return out


def rows_from_mlflow(tracking_uri: str, experiment: str, source_run: Optional[str] = None
                     ) -> Tuple[List[Dict], Dict[str, History]]:
    """(rows, histories) rebuilt from an MLflow experiment's runs alone (what each job logged: the record's tags,
    metrics and params, and the metric histories), for when the job folders are gone (a lost machine, a copy of the
    store only). A run without a final verdict is a failed row that says where it stopped. source_run: only that
    run and the forks of it (an experiment that holds several isolation pipelines); without it, more than one
    source run is an error."""
    from tqdm import tqdm

    uri = resolve_uri(tracking_uri)
    client = client_for(uri)
    exp = retry(client.get_experiment_by_name, experiment)
    if exp is None:
        raise ValueError(f"--from-mlflow {experiment!r}: no such experiment in {uri}")
    runs = [r for r in retry(client.search_runs, [exp.experiment_id], max_results=5000)
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
        histories[rid] = history(client, run)
        name = t.get("job") or (t.get("sweep") or "").rsplit("/", 1)[-1] or run.info.run_name
        rows.append((run.info.start_time or 0, row_from_record(record.from_mlflow_run(run, histories[rid]), name)))
    # sources before forks; job groups ("paper_isolation-3" -> "paper_isolation") in launch order, jobs by number
    group = lambda r: re.sub(r"-?\d+$", "", r.get("job") or "")  # noqa: E731
    first = {}
    for t0, r in sorted(rows, key=lambda tr: tr[0]):
        first.setdefault(group(r), t0)
    num = lambda r: int(m.group(1)) if (m := re.search(r"(\d+)$", r.get("job") or "")) else -1  # noqa: E731
    rows.sort(key=lambda tr: (tr[1].get("fork_step") is not None, first[group(tr[1])], num(tr[1]), tr[0]))
    return [r for _, r in rows], histories


def histories_from_export(path, prefixes: Sequence[str] = record.HISTORY_PREFIXES) -> Dict[str, History]:
    """{mlflow_run_id: history} from a compact export (scripts/mlflow_export.py: gzipped JSON whose runs hold
    {metric: [[step, value(, timestamp)]...]}), for a report when only the export came back from a machine."""
    import gzip
    import json
    from pathlib import Path
    p = Path(path)
    try:
        with gzip.open(p, "rt") as f:
            doc = json.load(f)
        runs = doc["runs"]
    except (OSError, ValueError, KeyError, TypeError, EOFError, zlib.error) as e:  # EOFError: a truncated .gz
        raise ValueError(f"--histories {str(p)!r}: not an export of scripts/mlflow_export.py "
                         f"({type(e).__name__}: {e})") from e
    out: Dict[str, History] = {}
    value = lambda v: math.nan if v is None else record.from_mlflow_value(v)  # noqa: E731  (NaN: null)
    try:  # runs that are not a list of {run_id, metrics} objects: named, not a bare TypeError ('int' not iterable)
        for run in runs:
            out[run["run_id"]] = {k: sorted((int(pt[0]), value(pt[1])) for pt in pts)
                                  for k, pts in (run.get("metrics") or {}).items() if k.startswith(tuple(prefixes))}
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ValueError(f"--histories {str(p)!r}: not an export of scripts/mlflow_export.py (its runs: "
                         f"{type(e).__name__}: {e}; expected a list of objects with run_id and metrics)") from e
    return out


__all__ = ["retry", "client_for", "get_run", "history", "load_histories", "rows_from_mlflow", "histories_from_export"]
