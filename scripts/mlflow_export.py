"""A compact export of an MLflow sqlite store: every run's name, status, params, tags and metric histories, without
the system metrics (system/*), as one gzipped JSON: what comes back from a lent GPU machine instead of the raw store
(a 10K-step GPT-2S store with system metrics is 20-30 MB compressed).

    python scripts/mlflow_export.py sqlite:///path/mlflow.db OUT.json.gz [--keep-system]

It reads the store's tables with sqlite3 in one read transaction (one query per table: seconds for a store MLflow's
client would take minutes to walk run by run; runs still writing do not tear it) and checks the export against the
store's row count in that same snapshot before it writes.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path


def _path(uri: str) -> Path:
    if not uri.startswith("sqlite:///"):
        raise SystemExit(f"mlflow_export: {uri!r} is not allowed: expected a sqlite:///PATH store")
    p = Path(uri[len("sqlite:///"):])
    if not p.is_file():
        raise SystemExit(f"mlflow_export: {p} does not exist")
    return p


def export(uri: str, keep_system: bool = False) -> dict:
    con = sqlite3.connect(f"file:{_path(uri)}?mode=ro", uri=True, isolation_level=None)
    try:
        con.execute("BEGIN")  # one read transaction: every query sees the same snapshot of a store still being written
        exps = {r[0]: r[1] for r in con.execute("SELECT experiment_id, name FROM experiments")}
        runs = {}
        for run_id, name, status, start, end, exp in con.execute(
                "SELECT run_uuid, name, status, start_time, end_time, experiment_id FROM runs"):
            runs[run_id] = dict(run_id=run_id, name=name, status=status, start_time=start, end_time=end,
                                experiment=exps.get(exp), params={}, tags={}, metrics=defaultdict(list))
        for run_id, key, value in con.execute("SELECT run_uuid, key, value FROM params"):
            if run_id in runs:
                runs[run_id]["params"][key] = value
        for run_id, key, value in con.execute("SELECT run_uuid, key, value FROM tags"):
            if run_id in runs:
                runs[run_id]["tags"][key] = value
        where = "" if keep_system else " WHERE key NOT LIKE 'system/%'"
        n = 0
        for run_id, key, value, step, ts, nan in con.execute(
                f"SELECT run_uuid, key, value, step, timestamp, is_nan FROM metrics{where} ORDER BY step, timestamp"):
            if run_id in runs:
                runs[run_id]["metrics"][key].append([step, None if nan else value, ts])
                n += 1
        (total,) = con.execute(f"SELECT COUNT(*) FROM metrics{where}").fetchone()
    finally:
        con.close()
    if n != total:
        raise SystemExit(f"mlflow_export: read {n} metric rows of {total}: the store changed while it was read")
    return dict(store=str(_path(uri)), metric_rows=n, system_metrics=keep_system, runs=list(runs.values()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("uri")
    ap.add_argument("out")
    ap.add_argument("--keep-system", action="store_true", help="keep the system/* metrics too")
    a = ap.parse_args(argv)
    doc = export(a.uri, a.keep_system)
    with gzip.open(a.out, "wt") as f:
        json.dump(doc, f)
    print(f"mlflow_export: {len(doc['runs'])} runs, {doc['metric_rows']:,} metric points -> {a.out} "
          f"({Path(a.out).stat().st_size / 2 ** 20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
