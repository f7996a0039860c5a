"""What a user sees first in MLflow: the sweep's runs with their verdicts.

At a sweep's end (render.write_report) every run gets its verdict as judged against its FP32 control (the cause,
the control, matches_paper, its description) and a colour fixed by its verdict (`mlflow.runColor`: red when precision
did it, orange when its control diverged too, purple without a control, green when stable, grey when failed;
shades tell runs of one verdict apart). The experiment gets a stored view (the tag mlflow.sharedViewState.<key>,
which MLflow's runs table loads from `?viewStateShareKey=<key>`): the sweep's runs (the filter shows them flat, none
folded under the parent) with expected, verdict, matches_paper, cause, control, job, divergence step, final loss
and peak W_Q σ as columns; job numbers zero-padded (tags sort as text). The state is plain JSON, the form
MLflow 2.x wrote and 3.17 still reads; the experiment is marked model-training (mlflow.experimentKind), so MLflow 3
does not open it in GenAI mode.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.report import alarm_view
from flash_forensics.orchestrator.report.links import artifact_view_route
from flash_forensics.orchestrator.tracking.run_fields import RUN_LOG, describe_run
from flash_forensics.orchestrator.tracking.store import MAX_TAG_VAL_LENGTH, _truncate, retry

SHARED_VIEW_PREFIX = "mlflow.sharedViewState."
RUN_COLOR = "mlflow.runColor"
PARENT_COLOR = "#1f3b73"  # the sweep's own row: navy, no verdict's hue
SWEEP_RUN_TAG = "sweep_run"  # the parent's run id, on the parent and its runs: the view's filter
LIVE_ALARM = "live_alarm"  # monitor.alarm against the verdict: hit, N steps before | late | miss | false alarm | ...
# left to right as the verdict reads: what the paper expects, what happened, whether that matches, why (the cause,
# against which control), the job; then the numbers. No intervention column: the run name starts with it, and MLflow's
# Run Name, Created and Duration columns (always shown) plus its assistant panel (open on a first visit) leave
# 4 columns at 1600 px: the verdict's four come first (MLflow orders tag columns by first write, not by this list)
COLUMNS = (("tags", record.TAG_EXPECT), ("tags", record.TAG_VERDICT), ("tags", record.TAG_MATCHES),
           ("tags", record.TAG_CAUSE), ("tags", record.TAG_CONTROL), ("tags", "job"),
           ("metrics", "divergence_step"), ("metrics", "final_loss"), ("metrics", "peak_wq_sigma"),
           ("tags", "fork_health"), ("tags", LIVE_ALARM))
# verdict -> shades (darkest first): one hue per verdict, a new shade per run of that verdict
PALETTES = {record.CAUSE_PRECISION: ("#d62728", "#a11d1e", "#f06a6b", "#7a1516"),
            record.CAUSE_NOT_PRECISION: ("#ff7f0e", "#c25f05", "#ffab5e", "#8c4503"),
            record.CAUSE_NO_CONTROL: ("#9467bd", "#6c4494", "#b89bd6", "#4b2f68"),
            "stable": ("#2ca02c", "#1e6e1e", "#6fcf6f", "#134713", "#98df8a"),
            "failed": ("#7f7f7f", "#4d4d4d", "#b3b3b3"), "running": ("#17becf",)}


def column_key(kind: str, name: str) -> str:
    """A runs-table column as MLflow's UI names it (its canonical sort key)."""
    return f"{kind}.`{name}`"


def verdict_kind(row: Dict) -> str:
    obs = row.get("observed")
    if obs == "diverged":
        return row.get("cause") or record.CAUSE_NO_CONTROL
    return obs if obs in PALETTES else "failed"


def colors(rows: Sequence[Dict]) -> List[str]:
    """Each row's run colour: its verdict's hue, the next unused shade of it (distinct while shades last)."""
    used: Dict[str, int] = {}
    out = []
    for r in rows:
        kind = verdict_kind(r)
        i = used.get(kind, 0)
        used[kind] = i + 1
        out.append(PALETTES[kind][i % len(PALETTES[kind])])
    return out


def share_key(parent_run_id: str) -> str:
    return f"ff-verdicts-{parent_run_id[:12]}"


def view_state(parent_run_id: str) -> Dict:
    """The runs table's state: the sweep's runs, flat (a filter is set: MLflow nests children only without one),
    ordered by job, the verdict columns."""
    return {"searchFilter": f"tags.{SWEEP_RUN_TAG} = '{parent_run_id}'", "orderByKey": column_key("tags", "job"),
            "orderByAsc": True, "startTime": "ALL", "lifecycleFilter": "Active", "datasetsFilter": [],
            "modelVersionFilter": "All Runs", "selectedColumns": [column_key(k, n) for k, n in COLUMNS],
            "viewMaximized": False, "runListHidden": False}


def mark_training(client, experiment_id: str) -> None:
    """MLflow 3 picks its model-training UI (runs table, charts) over the GenAI one by this experiment tag."""
    exp = retry(client.get_experiment, experiment_id)
    if exp.tags.get("mlflow.experimentKind") in (None, "", "no_inferred_type", "genai_development_inferred"):
        retry(client.set_experiment_tag, experiment_id, "mlflow.experimentKind", "custom_model_development")


def publish(client, rows: Sequence[Dict], experiments: Dict[str, str],
            parent_run_id: Optional[str] = None) -> Optional[str]:
    """Tag every row's run with its judged verdict, colour and description; with a parent run, store the verdicts
    view and return its share key. Rows are compare()d report rows."""
    from mlflow.entities import RunTag
    jobs = [str(r.get("job") or "") for r in rows]
    job_width = max(map(len, jobs)) if jobs and all(j.isdigit() for j in jobs) else 0
    for r, color in zip(rows, colors(rows), strict=True):
        rid = r.get("mlflow_run_id")
        if not rid or rid not in experiments:
            continue
        paper = retry(client.get_run, rid).data.tags.get("paper")
        note = describe_run(r.get("intervention") or "?", r.get("expected"), paper, r.get("observed"),
                            r.get("divergence_step"), r.get("steps_done"), r.get("error"), r.get("cause"),
                            r.get("control"), r.get("control_step"),
                            log_route=artifact_view_route(experiments[rid], rid, RUN_LOG))
        if r.get("fork_notes"):  # what the verdict alone does not say (orchestrator/report/fork_health.py)
            note += "".join(f"\n\nCaveat: {n}." for n in r["fork_notes"])
        tags = {record.TAG_MATCHES: "true" if r.get("matches_paper") else "false", RUN_COLOR: color,
                record.TAG_VERDICT_LINE: r.get("verdict") or str(r.get("observed")), "mlflow.note.content": note}
        if r.get("fork_notes"):
            tags["fork_health"] = "; ".join(r["fork_notes"])
        if r.get("cause"):
            tags[record.TAG_CAUSE] = r["cause"]
        if isinstance(r.get("alarm"), dict):  # monitor.alarm was on: how it did against the verdict (report/alarm_view)
            o = alarm_view.outcome(r)
            tags[LIVE_ALARM] = o["kind"] + (f", {o['lead']} steps before" if o["kind"] == "hit" else "")
        if r.get("control"):  # short, so the column shows it whole; the run id in its own tag
            cj = str(r.get("control_job") or "")
            tags[record.TAG_CONTROL] = f"job {cj.zfill(job_width) if cj.isdigit() else cj}" if cj else r["control"]
            if r.get("control_run_id"):
                tags[record.TAG_CONTROL_RUN] = r["control_run_id"]
        if job_width and str(r.get("job") or "").isdigit():  # the job tag sorts as text: 00, 01, ..., 10
            # set anew: MLflow orders tag columns by when a tag was first written, and the job's tag (written at
            # its start) would push the verdict's columns right
            retry(client.delete_tag, rid, "job")
            tags["job"] = str(r["job"]).zfill(job_width)
        if parent_run_id:
            tags[SWEEP_RUN_TAG] = parent_run_id
        retry(client.log_batch, rid, tags=[RunTag(k, _truncate(str(v), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()])
    if not parent_run_id or parent_run_id not in experiments:
        return None
    exp = experiments[parent_run_id]
    mark_training(client, exp)
    retry(client.log_batch, parent_run_id,
          tags=[RunTag(SWEEP_RUN_TAG, parent_run_id), RunTag(RUN_COLOR, PARENT_COLOR)])
    key = share_key(parent_run_id)
    retry(client.set_experiment_tag, exp, SHARED_VIEW_PREFIX + key, json.dumps(view_state(parent_run_id)))
    return key


__all__ = ["publish", "colors", "view_state", "share_key", "mark_training", "COLUMNS", "PALETTES", "RUN_COLOR",
           "SHARED_VIEW_PREFIX", "SWEEP_RUN_TAG", "LIVE_ALARM"]
