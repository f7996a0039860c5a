"""Where localization's input comes from: a baseline job dir (its run record), a sweep dir (its baseline job) or
an MLflow run id; its metric histories through the one loader (orchestrator/report/readback.py)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.analysis.localize.algorithm import PREFIXES, History
from flash_forensics.orchestrator.report import readback as store
from flash_forensics.orchestrator.report.rows import collect_rows


def load_history(run_id: str, tracking_uri: Optional[str] = None, prefixes=PREFIXES) -> History:
    """{metric: [(step, value)]} of an MLflow run, for the metrics localization reads."""
    return store.history(store.client_for(tracking_uri), run_id, prefixes, progress="localize: metric histories")


def resolve_source(source: str, tracking_uri: Optional[str] = None, job: Optional[str] = None) -> Dict:
    """{run_id, tracking_uri, divergence_step, job_dir} for a run id, a job dir (result.json) or a sweep dir
    (its baseline job; `job` names another job folder)."""
    path = Path(source)
    if path.is_dir():
        if not record.result_path(path).is_file():
            rows = [r for r in collect_rows(path) if r.get("mlflow_run_id")]
            if job is not None:
                rows = [r for r in rows if r.get("job") == job]
            else:
                rows = [r for r in rows if r.get("intervention") == "baseline"] or rows
                rows.sort(key=lambda r: r.get("observed") != "diverged")  # a diverged baseline first
            if not rows:
                bad = [r["job"] for r in collect_rows(path) if "unreadable" in str(r.get("error") or "")]
                raise ValueError(f"{source}: no job with result.json and an MLflow run id"
                                 + (f" named {job!r}" if job else "") + " (is it a job or sweep dir?)"
                                 + (f"; unreadable result.json in {', '.join(map(str, bad[:5]))}" if bad else ""))
            path = Path(rows[0]["job_dir"])
        elif job is not None:
            raise ValueError(f"--job {job!r} is not allowed with a job folder ({source} holds result.json): --job "
                             "picks a job of a sweep folder")
        rec = record.read_named(path)  # json's words alone named no file
        if not rec.mlflow_run_id:
            raise ValueError(f"{record.result_path(path)}: no mlflow_run_id (the job died before tracking started)")
        return {"run_id": rec.mlflow_run_id, "tracking_uri": tracking_uri or store.job_store(path),
                "divergence_step": rec.divergence_step, "job_dir": str(path), "intervention": rec.intervention}
    if path.exists() or "/" in source:
        raise ValueError(f"{source}: not a job dir, sweep dir or MLflow run id")
    if not re.fullmatch(r"[0-9a-f]{32}", source):  # a mistyped folder, not a run id to look for in a store
        raise ValueError(f"source {source!r} is not allowed: no such folder, and not an MLflow run id (32 hex "
                         "digits); expected a baseline job dir, a sweep dir or a run id")
    client = store.client_for(tracking_uri)
    run = store.get_run(client, source)  # a run id not in the store: named with the store, not MlflowException
    rec = record.from_mlflow_run(run, store.history(client, run, (record.LOSS,)))
    return {"run_id": source, "tracking_uri": tracking_uri, "divergence_step": rec.divergence_step, "job_dir": None,
            "intervention": rec.intervention}

