"""Where the MLflow store lives and how to talk to it: URIs, reachability, the client, retries on a locked sqlite
store, MLflow's size limits, the sweep's parent-run file and closing a dead job's run."""
from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from flash_forensics.orchestrator.lockfile import exclusive

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "results"
PARENT_FILE = "mlflow_parent.json"

# MLflow's limits (mlflow.utils.validation); kept here so truncation happens before the request, not in an error.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250


class TrackingUnreachable(ValueError):
    """The configured tracking store cannot be used; raised before any job starts."""


# the database back ends MLflow's SQLAlchemy store takes (scheme[+driver]://...), besides sqlite
DB_SCHEMES = ("postgresql", "mysql", "mssql")

def default_tracking_uri() -> str:
    return f"sqlite:///{RESULTS_DIR / 'mlflow.db'}"


def resolve_uri(uri: Optional[str]) -> str:
    """None -> the embedded default; relative sqlite paths -> absolute (jobs may run in other folders)."""
    if not uri:
        return default_tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_absolute():
            return f"sqlite:///{(Path.cwd() / path).resolve()}"
    return uri


def sqlite_path(uri: str) -> Optional[Path]:
    if uri.startswith("sqlite:///"):
        return Path("/" + uri[len("sqlite:///"):].lstrip("/"))
    return None


def artifact_root_for(uri: str) -> Optional[str]:
    """Artifacts of a sqlite store live beside the db (MLflow would otherwise use ./mlruns of the cwd)."""
    db = sqlite_path(uri)
    if db is None:
        return None  # a server decides (mlflow server --serve-artifacts)
    return (db.parent / "mlartifacts").as_uri()


def check_tracking(uri: Optional[str], timeout_s: float = 3.0) -> str:
    """Fail fast, with a message saying what to do, when the store cannot be used. Returns the resolved uri."""
    uri = resolve_uri(uri)
    if uri.startswith(("http://", "https://")):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}")
        except (urllib.error.URLError, OSError, socket.timeout, ValueError) as e:
            raise TrackingUnreachable(
                f"tracking.uri={uri!r}: MLflow server unreachable ({getattr(e, 'reason', e)}; GET {url} failed "
                f"within {timeout_s:g}s). Start it with scripts/mlflow_server.sh, or point tracking.uri at a "
                f"running server, or drop tracking.uri to use the embedded sqlite store {default_tracking_uri()}"
            ) from None
        return uri
    db = sqlite_path(uri)
    if db is not None:
        folder = db.parent
        if db.is_dir():
            raise TrackingUnreachable(f"tracking.uri={uri!r}: {db} is a folder; expected the path of an sqlite "
                                      "file (sqlite:///<folder>/mlflow.db)")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingUnreachable(f"tracking.uri={uri!r}: cannot create folder {folder}: {e}") from None
        if not os.access(folder, os.W_OK) or (db.exists() and not os.access(db, os.W_OK)):
            raise TrackingUnreachable(f"tracking.uri={uri!r}: {db} is not writable")
        try:  # checked before launch too: else every job of a sweep started, failed on it and the report was written
            check_sqlite_file(db, f"tracking.uri={uri!r}")
        except ValueError as e:
            raise TrackingUnreachable(str(e)) from None
        return uri
    if uri.startswith(("file:", "/")) or "://" not in uri:
        raise TrackingUnreachable(
            f"tracking.uri={uri!r} is not allowed: MLflow 3.17 refuses the file store; use sqlite:///<path>.db "
            f"or http(s)://<server>")
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme not in DB_SCHEMES:
        raise TrackingUnreachable(
            f"tracking.uri={uri!r} is not allowed: expected sqlite:///<path>.db, http(s)://<server> or a database "
            f"URI ({', '.join(s + '://...' for s in DB_SCHEMES)})")
    return uri  # database URIs (postgresql://...): MLflow reports its own connection errors



def _truncate(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."



# ---------------------------------------------------------------------------------------------- parent run
def write_parent_file(sweep_dir: Path, tracking_uri: str, experiment_id: str, run_id: str) -> Path:
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / PARENT_FILE
    path.write_text(json.dumps({"tracking_uri": tracking_uri, "experiment_id": experiment_id, "run_id": run_id},
                               indent=2))
    return path


def find_parent(sweep_dir: Optional[os.PathLike] = None) -> Optional[Dict[str, str]]:
    """The sweep's parent run ({tracking_uri, experiment_id, run_id}) from <sweep dir>/mlflow_parent.json.
    Without sweep_dir, the sweep dir comes from HydraConfig when this process is a multirun job."""
    if sweep_dir is None:
        try:
            from hydra.core.hydra_config import HydraConfig
            from hydra.types import RunMode
            hc = HydraConfig.get()
            if hc.mode != RunMode.MULTIRUN:
                return None
            sweep_dir = hc.sweep.dir
        except (ImportError, ValueError):
            return None
    path = Path(sweep_dir) / PARENT_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------------- retries
def retry(fn, *args, attempts: int = 8, **kwargs):
    """Retry while a sqlite store is locked by another local job (MLflow retries deadlocks, not locks)."""
    delay = 0.05
    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # MlflowException wraps sqlalchemy's OperationalError
            if "locked" not in str(e).lower() or i == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}  # MLflow 3: the model-training UI, not GenAI


def get_or_create_experiment(client, name: str, tracking_uri: str) -> str:
    """The experiment's id (created, or restored when deleted), marked a model-training experiment (MLflow 3 would
    otherwise open an experiment without traces in its GenAI mode)."""
    exp = retry(client.get_experiment_by_name, name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            retry(client.restore_experiment, exp.experiment_id)
        if not exp.tags.get("mlflow.experimentKind"):
            retry(client.set_experiment_tag, exp.experiment_id, *next(iter(EXPERIMENT_KIND.items())))
        return exp.experiment_id
    root = artifact_root_for(tracking_uri)
    try:
        return retry(client.create_experiment, name,
                      artifact_location=f"{root}/{name}" if root else None, tags=EXPERIMENT_KIND)
    except Exception:  # another job created it first
        exp = retry(client.get_experiment_by_name, name)
        if exp is None:
            raise
        return exp.experiment_id


def _store_lock(db: Path):
    """An exclusive lock on <db>.lock: two processes that open a new sqlite store at once both run MLflow's table
    creation and schema migration, and one fails (alembic 'expected to match one row', '_alembic_tmp_* already
    exists'; seen with two runs started together on a fresh store)."""
    return exclusive(Path(db).with_name(Path(db).name + ".lock"))


def check_sqlite_file(db: Path, said: str) -> None:
    """A non-empty file at an sqlite store's path that is not an SQLite database is refused in one sentence that
    starts with `said` (how the caller names the store)."""
    if db.is_file() and db.stat().st_size:
        with open(db, "rb") as f:
            if f.read(16) != b"SQLite format 3\x00":
                raise ValueError(f"{said}: {db} is not an SQLite database (an MLflow sqlite store is a "
                                 f"file MLflow created; give a new path or the right file)")


def make_client(uri: str):
    from mlflow.tracking import MlflowClient
    db = sqlite_path(uri)
    if db is None:
        return retry(MlflowClient, tracking_uri=uri)
    check_sqlite_file(db, f"tracking uri {uri}")  # one sentence, before MLflow's traceback
    with _store_lock(db):
        client = retry(MlflowClient, tracking_uri=uri)
        retry(client.search_experiments, max_results=1)  # opens (creates, migrates) the store under the lock
    return client



def mark_terminated(uri: str, run_id: str, status: str, reason: str, client=None) -> bool:
    """A run left RUNNING by a dead job: tags verdict=failed and error=reason, then status (KILLED | FAILED).
    Returns whether it was marked; a store that cannot be reached is said, not raised."""
    try:
        c = client or make_client(uri)
        run = retry(c.get_run, run_id)
        if run.info.status != "RUNNING":
            return False
        retry(c.set_tag, run_id, "verdict", "failed")
        retry(c.set_tag, run_id, "error", _truncate(reason, MAX_TAG_VAL_LENGTH))
        retry(c.set_terminated, run_id, status=status)
        return True
    except Exception as e:
        print(f"[tracking] could not mark run {run_id} {status} in {uri}: {e}", flush=True)
        return False


@dataclass
class TrackingConfig:
    """Where runs are recorded. uri None -> sqlite:///<repo>/results/mlflow.db (absolute path)."""

    uri: Optional[str] = None
    experiment: Optional[str] = None  # None -> the sweep name
    queue_size: int = 100_000  # metrics waiting for the logging thread; a full queue applies back-pressure
    flush_interval_s: float = 2.0  # the thread posts what it has at least this often
    check_timeout_s: float = 3.0  # check_tracking's HTTP timeout
    writer: str = "thread"  # thread | process (MLflow's Python work off the training process's GIL)
    system_metrics: bool = True  # MLflow's system metrics (CPU, memory, disk, network; GPU with nvidia-ml-py)
    system_metrics_every_s: float = 10.0  # their sampling interval: one small batch per interval, off the hot path

    def validate(self, key: str = "tracking") -> "TrackingConfig":
        if self.uri is not None and not isinstance(self.uri, str):
            raise ValueError(f"{key}.uri={self.uri!r} is not allowed: expected a string or null")
        for name in ("queue_size",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{key}.{name}={v!r} is not allowed: expected an integer > 0")
        if self.writer not in ("thread", "process"):
            raise ValueError(f"{key}.writer={self.writer!r} is not allowed: expected one of thread, process")
        if not isinstance(self.system_metrics, bool):
            raise ValueError(f"{key}.system_metrics={self.system_metrics!r} is not allowed: expected true or false")
        for name in ("flush_interval_s", "check_timeout_s", "system_metrics_every_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{key}.{name}={v!r} is not allowed: expected a number > 0")
        return self
