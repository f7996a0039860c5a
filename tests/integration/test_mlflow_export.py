"""scripts/mlflow_export.py: a compact export of a sqlite store (params, tags, metric histories, no system/*)."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_export_keeps_histories_and_drops_system_metrics(tmp_path):
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    exp = c.create_experiment("e", artifact_location=str(tmp_path / "art"))
    run = c.create_run(exp, run_name="baseline", tags={"ff.verdict": "diverged"})
    rid = run.info.run_id
    c.log_param(rid, "train.seed", "1337")
    for step in range(5):
        c.log_metric(rid, "train/loss", 5.0 - step, step=step)
        c.log_metric(rid, "system/gpu_0_utilization_percentage", 99.0, step=step)
    c.log_metric(rid, "train/loss", float("nan"), step=5)
    out = tmp_path / "x.json.gz"
    r = subprocess.run([sys.executable, "scripts/mlflow_export.py", uri, str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.load(gzip.open(out, "rt"))
    (row,) = doc["runs"]
    assert row["name"] == "baseline" and row["params"] == {"train.seed": "1337"}
    assert row["tags"]["ff.verdict"] == "diverged" and row["experiment"] == "e"
    assert [p[:2] for p in row["metrics"]["train/loss"]] == [[s, 5.0 - s] for s in range(5)] + [[5, None]]
    assert not any(k.startswith("system/") for k in row["metrics"]) and doc["metric_rows"] == 6
    kept = subprocess.run([sys.executable, "scripts/mlflow_export.py", uri, str(out), "--keep-system"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert kept.returncode == 0 and json.load(gzip.open(out, "rt"))["metric_rows"] == 11


@pytest.mark.parametrize("uri,msg", [("http://x:5000", "expected a sqlite:///PATH store"),
                                     ("sqlite:////nonexistent/m.db", "does not exist")])
def test_bad_stores_are_refused(tmp_path, uri, msg):
    r = subprocess.run([sys.executable, "scripts/mlflow_export.py", uri, str(tmp_path / "o.json.gz")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and msg in r.stderr
