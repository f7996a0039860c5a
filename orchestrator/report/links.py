"""Where a reader opens what a run or sweep recorded: the MLflow UI's runs table, run pages and artifacts.

The UI of an http(s) tracking store is the server itself; a database store (sqlite) is opened with
`mlflow ui --backend-store-uri <uri>`, which serves http://127.0.0.1:5000 (pass ui_url for another address).
Routes are MLflow 3's, each with workflowType=machine_learning (its model-training UI, not GenAI):
`#/experiments/<id>/runs` opens the runs table (an experiment's bare route opens the GenAI overview instead),
`#/experiments/<id>/runs/<run id>` a run page.
"""
from __future__ import annotations

import json
import os
import urllib.parse
from typing import List, Optional, Sequence

MLFLOW_UI_DEFAULT = "http://127.0.0.1:5000"  # `mlflow ui`'s default host and port
TRAINING_MODE = "workflowType=machine_learning"  # MLflow 3's model-training UI (its default is the GenAI one)
UI_URL_ENV = "FF_MLFLOW_UI_URL"  # where the user's UI serves (e.g. http://127.0.0.1:5050): the links use it


def ui_base(tracking_uri: Optional[str], ui_url: Optional[str] = None) -> str:
    """The UI's address: ui_url if given, else $FF_MLFLOW_UI_URL, else the server of an http(s) store, else what
    `mlflow ui` serves."""
    ui_url = ui_url or os.environ.get(UI_URL_ENV)
    if ui_url:
        return ui_url.rstrip("/")
    if tracking_uri and tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return MLFLOW_UI_DEFAULT


def _training(route: str) -> str:
    """route in MLflow 3's model-training UI: the page reads `workflowType` from its URL, else from the browser's
    localStorage (mlflow.workflowType, GenAI until the user picks), so a printed link carries it."""
    return f"{route}{'&' if '?' in route else '?'}{TRAINING_MODE}"


def experiment_route(experiment_id: str) -> str:
    return _training(f"#/experiments/{experiment_id}/runs")


def run_route(experiment_id: str, run_id: str) -> str:
    return _training(f"#/experiments/{experiment_id}/runs/{run_id}")


def artifact_view_route(experiment_id: str, run_id: str, path: str) -> str:
    """A run's artifact, opened in the UI's artifact viewer."""
    return _training(f"#/experiments/{experiment_id}/runs/{run_id}/artifacts/{path}")


def view_route(experiment_id: str, share_key: str) -> str:
    """The runs table in a stored view (an experiment tag mlflow.sharedViewState.<key>, verdict_view.py): MLflow
    3.x and 2.x since shared views; an older UI opens the plain runs table."""
    return _training(f"#/experiments/{experiment_id}/runs?viewStateShareKey={share_key}")


def compare_route(experiment_id: str, run_ids: Sequence[str]) -> str:
    """MLflow's compare page for these runs (params, metrics, 'show diff only'): one click."""
    runs = urllib.parse.quote(json.dumps(list(run_ids), separators=(",", ":")))
    exps = urllib.parse.quote(json.dumps([str(experiment_id)], separators=(",", ":")))
    return f"#/compare-runs?runs={runs}&experiments={exps}&{TRAINING_MODE}"


def mlflow_ui_command(tracking_uri: str, base: Optional[str] = None) -> Optional[str]:
    """The command that serves a database store's UI at `base` (the address the links use: its --port, and its
    --host unless local), so that run as printed every link opens; None for a server (it is its own UI)."""
    if tracking_uri.startswith(("http://", "https://")):
        return None
    cmd = f"mlflow ui --backend-store-uri {tracking_uri}"
    if not base or base.rstrip("/") == MLFLOW_UI_DEFAULT:
        return cmd
    url = urllib.parse.urlsplit(base)
    if url.hostname and url.hostname not in ("127.0.0.1", "localhost"):
        cmd += f" --host {url.hostname}"
    port = url.port or (443 if url.scheme == "https" else 80)
    return cmd + (f" --port {port}" if port != 5000 else "")


def link_lines(tracking_uri: str, experiment_id: Optional[str], run_id: Optional[str] = None,
               run_label: str = "parent run", ui_url: Optional[str] = None, share_key: Optional[str] = None,
               compare_ids: Sequence[str] = ()) -> List[str]:
    """The lines printed at the end of a run or sweep: how to open the UI, the runs table (in the verdicts view
    when share_key is given), the (parent) run, the compare page of compare_ids."""
    base = ui_base(tracking_uri, ui_url)
    cmd = mlflow_ui_command(tracking_uri, base)
    port = f"; another port: --port N and {UI_URL_ENV}=http://127.0.0.1:N" if cmd and not ui_url and not \
        os.environ.get(UI_URL_ENV) else ""
    out = [f"MLflow: {cmd}   (serves {base}{port})" if cmd else f"MLflow: {base}"]
    if experiment_id is not None:
        if share_key:  # the runs table itself, flat, on the verdict columns (the plain table folds the runs)
            out.append(f"  verdicts: {base}/{view_route(experiment_id, share_key)}")
        else:
            out.append(f"  runs table: {base}/{experiment_route(experiment_id)}")
        if run_id:
            out.append(f"  {run_label}: {base}/{run_route(experiment_id, run_id)}")
        if len(compare_ids) > 1:
            out.append(f"  compare: {base}/{compare_route(experiment_id, compare_ids)}")
    return out


__all__ = ["ui_base", "experiment_route", "run_route", "view_route", "compare_route", "UI_URL_ENV",
           "artifact_view_route", "mlflow_ui_command", "link_lines",
           "MLFLOW_UI_DEFAULT"]
