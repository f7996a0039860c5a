"""MLflow tracking that never blocks training.

A `Tracker` owns one MLflow run. Metrics go into a bounded queue; one background thread drains it into
`MlflowClient.log_batch` calls (at most 1000 metrics each), so the train loop only pays for a `queue.put`.
Errors raised in that thread are kept and re-raised at `flush()`/`close()`, never swallowed.

The default store is a sqlite file under <repo>/results/ (MLflow 3.17 refuses the plain file store). Several local
jobs may write to the same sqlite file: writes are retried while the database is locked. A shared MLflow server
(scripts/mlflow_server.sh) is the recommended store for SLURM jobs.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "results"
PARENT_FILE = "mlflow_parent.json"

# MLflow's limits (mlflow.utils.validation); kept here so truncation happens before the request, not in an error.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250


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


class TrackingUnreachable(ValueError):
    """The configured tracking store cannot be used; raised before any job starts."""


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
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingUnreachable(f"tracking.uri={uri!r}: cannot create folder {folder}: {e}") from None
        if not os.access(folder, os.W_OK) or (db.exists() and not os.access(db, os.W_OK)):
            raise TrackingUnreachable(f"tracking.uri={uri!r}: {db} is not writable")
        return uri
    if uri.startswith(("file:", "/")) or "://" not in uri:
        raise TrackingUnreachable(
            f"tracking.uri={uri!r} is not allowed: MLflow 3.17 refuses the file store; use sqlite:///<path>.db "
            f"or http(s)://<server>")
    return uri  # other database URIs (postgresql://...): MLflow reports its own connection errors


# ----------------------------------------------------------------------------------------------- config helpers
def flatten_config(cfg: Any, prefix: str = "") -> Dict[str, str]:
    """Dotted keys -> string values (OmegaConf nodes, dataclasses, dicts and lists), truncated to MLflow's limits.
    The `hydra` node is left out: it describes the launcher, not the experiment."""
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(cfg):
            cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except ImportError:
        pass
    if hasattr(cfg, "__dataclass_fields__"):
        from dataclasses import asdict
        cfg = asdict(cfg)
    out: Dict[str, str] = {}

    def walk(node, key):
        if isinstance(node, Mapping):
            if not node and key:
                out[key] = "{}"
            for k, v in node.items():
                if not key and k == "hydra":
                    continue
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in node):
            if not node:
                out[key] = "[]"
            for i, v in enumerate(node):
                walk(v, f"{key}.{i}")
        else:
            out[key] = _truncate(json.dumps(node) if isinstance(node, (list, tuple)) else str(node),
                                 MAX_PARAM_VAL_LENGTH)

    walk(cfg, prefix)
    return {k[:MAX_KEY_LENGTH]: v for k, v in out.items()}


def _truncate(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def git_info(cwd: Path = REPO_ROOT) -> Dict[str, str]:
    """Commit of the code that ran and whether the tree had uncommitted changes."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD") or "unknown"
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git.commit": "unknown", "git.dirty": "unknown"}
    return {"git.commit": commit, "git.dirty": str(dirty).lower(), "mlflow.source.git.commit": commit}


# ------------------------------------------------------------------------------------ standard run fields
def source_tags() -> Dict[str, str]:
    """MLflow's standard fields that mlflow.start_run fills and MlflowClient.create_run does not: source (the entry
    script; type JOB under SLURM, else LOCAL), user, git commit (+ whether the tree was dirty)."""
    import getpass
    import sys
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        user = os.environ.get("USER") or "unknown"
    entry = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "python"
    return {"mlflow.source.name": str(Path(entry).resolve()) if entry != "python" else entry,
            "mlflow.source.type": "JOB" if os.environ.get("SLURM_JOB_ID") else "LOCAL",
            "mlflow.user": user, **git_info()}


def describe_run(intervention: str, expect: Optional[str], paper: Optional[str], observed: Optional[str] = None,
                 divergence_step: Optional[int] = None, steps_done: Optional[int] = None,
                 error: Optional[str] = None) -> str:
    """The run's description (mlflow.note.content, markdown on the run page): the intervention, what the paper
    says of it and, once known, the verdict."""
    lines = [f"**{intervention}**" + (f": the paper expects it to **{expect.replace('diverges', 'diverge')}**"
                                      if expect else "")]
    if paper:
        lines.append(f"Paper: {paper}")
    if observed in ("diverged", "stable"):
        match = (observed == "diverged") == (expect == "diverges") if expect else None
        what = (f"diverged at step {divergence_step}" if observed == "diverged"
                else "stable" + (f" to step {steps_done}" if steps_done else ""))
        lines.append(f"Verdict: **{what}**" + ("" if match is None else
                                                (" (matches the paper)" if match else " (**does not match the paper**)")))
    elif observed == "failed":
        lines.append(f"Verdict: **failed**" + (f": `{str(error).splitlines()[0][:300]}`" if error else ""))
    else:
        lines.append("Verdict: running")
    return "\n\n".join(lines)


def start_system_metrics(run_id: str, uri: str, cfg: "TrackingConfig", resume: bool = False):
    """MLflow's own system-metrics monitor for a run made with MlflowClient (mlflow.start_run would start it):
    a daemon thread that logs system/* every cfg.system_metrics_every_s and stops when the run is terminated.
    Returns it, or None when off or unavailable (said, not silent)."""
    if not cfg.system_metrics:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        mon = SystemMetricsMonitor(run_id, sampling_interval=cfg.system_metrics_every_s, samples_before_logging=1,
                                   resume_logging=resume, tracking_uri=uri)
        mon.start()
        return mon
    except Exception as e:  # psutil missing, an odd platform: training goes on without them
        print(f"[tracking] system metrics off for run {run_id}: {type(e).__name__}: {e}")
        return None


JOB_ARTIFACTS = ("*.log", "result.json", "error.txt")  # Hydra's job log (run.log), the result, the traceback


def log_job_artifacts(uri: str, run_id: str, job_dir: os.PathLike) -> List[str]:
    """The job folder's record as artifacts of its run: Hydra's log, result.json, the traceback (error.txt, also
    as traceback.txt) under job/, and the resolved config .hydra/ under hydra/. Returns what it logged."""
    job_dir = Path(job_dir)
    client = make_client(uri)
    logged = []
    for pattern in JOB_ARTIFACTS:
        for f in sorted(job_dir.glob(pattern)):
            if f.is_file():
                retry(client.log_artifact, run_id, str(f), "job")
                logged.append(f"job/{f.name}")
    hydra_dir = job_dir / ".hydra"
    if hydra_dir.is_dir():
        retry(client.log_artifacts, run_id, str(hydra_dir), "hydra")
        logged += [f"hydra/{f.name}" for f in sorted(hydra_dir.iterdir()) if f.is_file()]
    return logged


FINITE_SUFFIX = "_finite"  # train/loss_finite: train/loss without its NaN/Inf points


def record_outcome(uri: str, run_id: str, result: Mapping[str, Any], paper: Optional[str] = None,
                   keys: Iterable[str] = ("train/loss",)) -> None:
    """After the job: the description with the verdict; for a diverged run the `diverged_at` metric (one point at
    the divergence step: a marker in MLflow's charts) and, for each of `keys` whose history holds NaN/Inf, its finite
    points as `<key>_finite`: MLflow's run page draws no chart at all for a metric whose latest value is NaN, so a
    NaN-diverged run would show no loss curve. The NaN points stay in `<key>` (counted, never hidden)."""
    from mlflow.entities import Metric
    client = make_client(uri)
    note = describe_run(result.get("intervention") or "?", result.get("expected"), paper, result.get("observed"),
                        result.get("divergence_step"), result.get("steps_done"), result.get("error"))
    metrics = []
    d = result.get("divergence_step")
    if result.get("observed") == "diverged" and isinstance(d, int):
        metrics.append(Metric("diverged_at", float(d), int(time.time() * 1000), d))
    for key in keys:
        hist = retry(client.get_metric_history, run_id, key)
        finite = [m for m in hist if m.value == m.value and abs(m.value) != float("inf")]
        if finite and len(finite) < len(hist):
            metrics += [Metric(key + FINITE_SUFFIX, float(m.value), m.timestamp, m.step) for m in finite]
    retry(client.set_tag, run_id, "mlflow.note.content", _truncate(note, MAX_TAG_VAL_LENGTH))
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        retry(client.log_batch, run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])


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


def get_or_create_experiment(client, name: str, tracking_uri: str) -> str:
    exp = retry(client.get_experiment_by_name, name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            retry(client.restore_experiment, exp.experiment_id)
        return exp.experiment_id
    root = artifact_root_for(tracking_uri)
    try:
        return retry(client.create_experiment, name,
                      artifact_location=f"{root}/{name}" if root else None)
    except Exception:  # another job created it first
        exp = retry(client.get_experiment_by_name, name)
        if exp is None:
            raise
        return exp.experiment_id


@contextlib.contextmanager
def _store_lock(db: Path):
    """An exclusive lock on <db>.lock: two processes that open a new sqlite store at once both run MLflow's table
    creation and schema migration, and one fails (alembic 'expected to match one row', '_alembic_tmp_* already
    exists'; seen with two runs started together on a fresh store)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): unserialized, as MLflow itself
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def make_client(uri: str):
    from mlflow.tracking import MlflowClient
    db = sqlite_path(uri)
    if db is None:
        return retry(MlflowClient, tracking_uri=uri)
    with _store_lock(db):
        client = retry(MlflowClient, tracking_uri=uri)
        retry(client.search_experiments, max_results=1)  # opens (creates, migrates) the store under the lock
    return client


# ---------------------------------------------------------------------------------------------- the writer
_FLUSH, _STOP = "__flush__", "__stop__"  # control items: (_FLUSH | _STOP, token); data items: (step, ts, values)


class _Sink:
    """Turns queued points into MLflow Metric batches for one run; drops steps recorded before a resume.

    With a spool file (the job's mlflow_spool.jsonl): when the store fails (deleted sqlite file, server down, disk
    full there), the points are appended to the spool (fsynced) instead, training goes on, and every later point
    follows them there until a replay moves the spool into the store (retried every `retry_s`, at each flush and at
    close; a resumed job replays it first). The store therefore always holds a prefix of each curve, so a replay
    that filters by the store's last step per key never duplicates a point. Only a spool that cannot be written
    (points that cannot be kept) is an error."""

    def __init__(self, client, run_id: str, last_step: Dict[str, int], spool: Optional[os.PathLike] = None,
                 uri: str = "", retry_s: float = 10.0):
        self.client, self.run_id, self.last_step = client, run_id, dict(last_step)
        self.points_logged = 0
        self.dropped = 0
        self.spool = Path(spool) if spool else None
        self.uri, self.retry_s = uri, retry_s
        self.store_error: Optional[str] = None  # the plain sentence of the last store failure (a warning)
        self._next_try = 0.0
        self.spooled = 0

    def to_metrics(self, step: int, ts: int, values: Mapping[str, Any]) -> List:
        from mlflow.entities import Metric
        out = []
        for key, value in values.items():
            last = self.last_step.get(key)  # only steps recorded before this resume are filtered
            if last is not None and step <= last:
                self.dropped += 1
                continue
            out.append(Metric(str(key)[:MAX_KEY_LENGTH], float(value), ts, step))
        return out

    @property
    def pending(self) -> bool:
        """Points wait in the spool."""
        return self.spool is not None and self.spool.is_file() and self.spool.stat().st_size > 0

    def post(self, batch: List, force: bool = False) -> None:
        if self.pending and not self.replay(force):
            self._append(batch)
            return
        for i in range(0, len(batch), MAX_METRICS_PER_BATCH):
            chunk = batch[i:i + MAX_METRICS_PER_BATCH]
            try:
                retry(self.client.log_batch, self.run_id, metrics=chunk)
            except Exception as e:
                if self.spool is None:
                    raise
                self._store_failed(e)
                self._append(batch[i:])
                return
            self.points_logged += len(chunk)

    def _store_failed(self, e: BaseException) -> None:
        first = self.store_error is None
        self.store_cause = store_cause(self.uri, e)
        self.store_error = (f"the MLflow store {self.uri} cannot be written ({self.store_cause}); the metric "
                            f"points are kept in {self.spool} and logged when the store is back")
        self._next_try = time.monotonic() + self.retry_s
        if first:
            print(f"[tracking] {self.store_error}", flush=True)

    def _append(self, batch: List) -> None:
        lines = "".join(json.dumps({"k": m.key, "v": m.value, "t": m.timestamp, "s": m.step}) + "\n" for m in batch)
        try:
            with open(self.spool, "a") as f:
                f.write(lines)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            from orchestrator.faults import WriteError, sentence
            raise WriteError(e.errno, sentence("the metric spool", self.spool, e) + f", and the MLflow store {self.uri} "
                             f"cannot be written ({getattr(self, 'store_cause', '?')}): the points cannot be kept") \
                from e
        self.spooled += len(batch)

    def replay(self, force: bool = False) -> bool:
        """Move the spool into the store; True when it is empty afterwards."""
        if not self.pending:
            return True
        if not force and time.monotonic() < self._next_try:
            return False
        from mlflow.entities import Metric
        try:
            run = retry(self.client.get_run, self.run_id)
            have = {m.key: int(m.step) for m in getattr(run.data, "_metric_objs", [])}
            todo = []
            for line in self.spool.read_text().splitlines():
                if not line.strip():
                    continue
                d = json.loads(line)
                if d["s"] > have.get(d["k"], -1):
                    todo.append(Metric(d["k"], float(d["v"]), int(d["t"]), int(d["s"])))
            for i in range(0, len(todo), MAX_METRICS_PER_BATCH):
                retry(self.client.log_batch, self.run_id, metrics=todo[i:i + MAX_METRICS_PER_BATCH])
                self.points_logged += len(todo[i:i + MAX_METRICS_PER_BATCH])
        except json.JSONDecodeError:
            raise
        except Exception as e:
            self._store_failed(e)
            return False
        self.spool.unlink()
        if self.store_error:
            print(f"[tracking] the MLflow store {self.uri} is back: {len(todo)} spooled points logged", flush=True)
        self.store_error = None
        return True


def spooled_last_steps(spool: Optional[os.PathLike]) -> Dict[str, int]:
    """Last step per key in a spool file (a resumed job must not log those steps again)."""
    out: Dict[str, int] = {}
    if spool and Path(spool).is_file():
        for line in Path(spool).read_text().splitlines():
            if line.strip():
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill -9: its points were never acknowledged
                    continue
                out[d["k"]] = max(out.get(d["k"], -1), int(d["s"]))
    return out


def store_cause(uri: str, e: BaseException) -> str:
    """Why the store failed, in words (a deleted sqlite file shows up as 'attempt to write a readonly database')."""
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        return f"the database file {db} was deleted or moved"
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "readonly" in text.lower() or "read-only" in text.lower():
        return f"{db or uri} is read-only"
    if "disk" in text.lower() and "full" in text.lower():
        return f"the disk of {db or uri} is full"
    return text[:300]


def _drain(get, sink: _Sink, interval: float, ack, fail) -> None:
    """The writer loop (thread or process): batch points, post at most every `interval` s or per 1000 points,
    post everything on a flush/stop and acknowledge it. After an error, points are discarded (not retried) and
    the error is reported through `fail`, once."""
    pending: List = []
    last_post = time.monotonic()
    failed = False
    while True:
        try:
            item = get(interval)
        except queue.Empty:
            item = None
        try:
            if item is not None and isinstance(item[0], str):  # flush or stop: in the store or in the spool
                if not failed:
                    if pending:
                        sink.post(pending, force=True)
                    else:
                        sink.replay(force=True)
                pending = []
                last_post = time.monotonic()
                ack(item[1])
                if item[0] == _STOP:
                    return
                continue
            if item is not None and not failed:
                pending.extend(sink.to_metrics(*item))
            due = time.monotonic() - last_post >= interval
            if pending and not failed and (len(pending) >= MAX_METRICS_PER_BATCH or due):
                sink.post(pending)
                pending = []
                last_post = time.monotonic()
        except BaseException as e:  # surfaced at flush/close
            if not failed:
                fail(e)
            failed, pending = True, []
            if item is not None and isinstance(item[0], str):
                ack(item[1])
                if item[0] == _STOP:
                    return


def _writer_process(uri: str, run_id: str, last_step: Dict[str, int], interval: float, q, acks,
                    spool: Optional[str] = None) -> None:
    """Entry point of writer='process': MLflow's Python work runs here, off the training process's GIL."""
    try:
        sink = _Sink(make_client(uri), run_id, last_step, spool, uri)
    except BaseException as e:
        acks.put(("error", f"{type(e).__name__}: {e}"))
        return
    _drain(lambda t: q.get(timeout=t), sink, interval,
           ack=lambda token: acks.put(("ack", token, sink.points_logged, sink.dropped, sink.store_error)),
           fail=lambda e: acks.put(("error", f"{type(e).__name__}: {e}")))


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


class Tracker:
    """One MLflow run, with metrics logged from a background thread.

    run_id given: continue that run (resume); metric points at a step <= the last step already logged for the
    same key are dropped, so a resumed run's curves stay contiguous and never hold a step twice.
    parent_run_id None and a <sweep dir>/mlflow_parent.json present (multirun): the run is nested under it.
    enabled False: every method is a no-op (e.g. non-zero DDP ranks).
    A new run carries MLflow's standard fields (source_tags, `description` as mlflow.note.content) and, unless
    cfg.system_metrics is off, MLflow's system metrics.
    """

    def __init__(self, cfg: TrackingConfig, run_name: str, experiment: Optional[str] = None,
                 parent_run_id: Optional[str] = None, run_id: Optional[str] = None, enabled: bool = True,
                 tags: Optional[Mapping[str, Any]] = None, discover_parent: bool = True,
                 spool: Optional[os.PathLike] = None, description: Optional[str] = None):
        self.cfg = cfg
        self.spool = Path(spool) if spool else None
        self.enabled = enabled
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self.parent_run_id = parent_run_id
        self.uri = resolve_uri(cfg.uri)
        self._closed = not enabled
        self._error: Optional[BaseException] = None
        self._last_step: Dict[str, int] = {}
        if not enabled:
            return
        self.client = make_client(self.uri)
        parent = None
        if parent_run_id is None and run_id is None and discover_parent:
            parent = find_parent()
            if parent is not None and resolve_uri(parent.get("tracking_uri")) == self.uri:
                self.parent_run_id = parent["run_id"]
            else:
                parent = None
        if run_id is not None:
            run = retry(self.client.get_run, run_id)
            self.run_id, self.experiment_id = run_id, run.info.experiment_id
            self._last_step = self._last_steps(run)
            for k, v in spooled_last_steps(self.spool).items():  # spooled before a kill: logged by the replay
                self._last_step[k] = max(self._last_step.get(k, -1), v)
            self._params_logged = dict(run.data.params)
            self.parent_run_id = run.data.tags.get("mlflow.parentRunId", parent_run_id)
            retry(self.client.update_run, run_id, status="RUNNING")
        else:
            if parent is not None:
                self.experiment_id = parent["experiment_id"]
            else:
                self.experiment_id = get_or_create_experiment(self.client, experiment or "flash-forensics",
                                                              self.uri)
            run_tags = {**source_tags(), **({"mlflow.note.content": description} if description else {}),
                        **{k: _truncate(str(v), MAX_TAG_VAL_LENGTH) for k, v in (tags or {}).items()}}
            if self.parent_run_id:
                run_tags["mlflow.parentRunId"] = self.parent_run_id
            run = retry(self.client.create_run, self.experiment_id, run_name=run_name, tags=run_tags)
            self.run_id = run.info.run_id
            self._params_logged = {}
        self.system_metrics = start_system_metrics(self.run_id, self.uri, cfg, resume=run_id is not None)
        self._tokens = 0
        if cfg.writer == "process":
            import multiprocessing as mp
            ctx = mp.get_context("spawn")  # no fork of a CUDA process
            self._queue = ctx.Queue(maxsize=cfg.queue_size)
            self._acks = ctx.Queue()
            self._worker = ctx.Process(target=_writer_process, name=f"mlflow-log-{self.run_id[:8]}", daemon=True,
                                       args=(self.uri, self.run_id, self._last_step, cfg.flush_interval_s,
                                             self._queue, self._acks, str(self.spool) if self.spool else None))
        else:
            self._queue = queue.Queue(maxsize=cfg.queue_size)
            self._sink = _Sink(self.client, self.run_id, self._last_step, self.spool, self.uri)
            self._worker = threading.Thread(
                target=_drain, name=f"mlflow-log-{self.run_id[:8]}", daemon=True,
                args=(lambda t: self._queue.get(timeout=t), self._sink, cfg.flush_interval_s,
                      lambda event: event.set(), lambda e: setattr(self, "_error", e)))
        self._worker.start()
        atexit.register(self._atexit)

    # -------------------------------------------------------------------------------------- public API
    def log_params(self, params: Mapping[str, Any]) -> None:
        """Flattened (dotted keys) and truncated; on resume, params already recorded are not sent again."""
        if not self.enabled:
            return
        from mlflow.entities import Param
        flat = flatten_config(params)
        todo = [Param(k, v) for k, v in flat.items() if self._params_logged.get(k) != v]
        for i in range(0, len(todo), MAX_PARAMS_TAGS_PER_BATCH):
            retry(self.client.log_batch, self.run_id, params=todo[i:i + MAX_PARAMS_TAGS_PER_BATCH])
        self._params_logged.update(flat)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import RunTag
        todo = [RunTag(str(k)[:MAX_KEY_LENGTH], _truncate(str(v), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        try:
            for i in range(0, len(todo), MAX_PARAMS_TAGS_PER_BATCH):
                retry(self.client.log_batch, self.run_id, tags=todo[i:i + MAX_PARAMS_TAGS_PER_BATCH])
        except Exception as e:
            if self.spool is None:
                raise
            # the store is gone: the run's tags wait with its points (written again at the next set_tags)
            self._tags_lost = {**getattr(self, "_tags_lost", {}), **{t.key: t.value for t in todo}}
            print(f"[tracking] tags not recorded: the MLflow store {self.uri} cannot be written "
                  f"({store_cause(self.uri, e)})", flush=True)
            return
        lost = getattr(self, "_tags_lost", None)
        if lost:
            self._tags_lost = {}
            self.set_tags({k: v for k, v in lost.items() if k not in tags})

    def close_other(self, run_id: str, status: str, reason: str) -> None:
        """Mark another run of this store (a dead job's, still RUNNING) terminated, with the reason as tags."""
        if self.enabled:
            mark_terminated(self.uri, run_id, status, reason, client=self.client)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue the points and return at once (values may be floats or host tensors)."""
        if self._closed:
            if not self.enabled:
                return
            raise RuntimeError(f"Tracker for run {self.run_id} is closed")
        self._raise_if_failed()
        if self.cfg.writer == "process":  # host floats pickle cheaply; tensors would not
            metrics = {k: float(v) for k, v in metrics.items()}
        self._queue.put((int(step), int(time.time() * 1000), dict(metrics)))

    def log_artifact(self, path: os.PathLike, artifact_path: Optional[str] = None) -> None:
        if not self.enabled:
            return
        try:
            retry(self.client.log_artifact, self.run_id, str(path), artifact_path)
        except Exception as e:
            if self.spool is None:
                raise
            print(f"[tracking] artifact {path} not recorded: the MLflow store {self.uri} cannot be written "
                  f"({store_cause(self.uri, e)})", flush=True)

    def flush(self) -> None:
        """Block until every queued point is in MLflow; re-raise an error of the writer."""
        if self._closed:
            self._raise_if_failed()
            return
        self._control(_FLUSH)
        self._raise_if_failed()

    def close(self, status: str = "FINISHED") -> None:
        """Flush, stop the writer and mark the run terminated (FINISHED | FAILED | KILLED)."""
        if self._closed:
            self._raise_if_failed()
            return
        self._closed = True
        try:
            self._control(_STOP)
            self._worker.join(timeout=30)
            if self.cfg.writer == "process":
                self._queue.cancel_join_thread()  # the writer read everything it will ever read
        finally:
            try:
                atexit.unregister(self._atexit)
            except Exception:
                pass
            try:
                retry(self.client.set_terminated, self.run_id, status="FAILED" if self._error else status)
            except Exception as e:  # the writer's error, if any, is the one worth reporting
                if self.spool is None or self._error is not None:
                    self._error = self._error or e
                else:
                    print(f"[tracking] run {self.run_id} not marked {status}: the MLflow store {self.uri} cannot be "
                          f"written ({store_cause(self.uri, e)})", flush=True)
        self._raise_if_failed()

    def _control(self, kind: str) -> None:
        """Send flush/stop and wait for the writer's acknowledgement (or its death)."""
        if self.cfg.writer != "process":
            done = threading.Event()
            self._queue.put((kind, done))
            while not done.wait(0.5):
                if not self._worker.is_alive():
                    break
            return
        self._tokens += 1
        token = self._tokens
        self._queue.put((kind, token))
        while True:
            try:
                msg = self._acks.get(timeout=0.5)
            except queue.Empty:
                if not self._worker.is_alive():
                    self._error = self._error or RuntimeError(
                        f"MLflow writer process exited with code {self._worker.exitcode} (a script using "
                        f"tracking.writer=process needs an `if __name__ == '__main__':` guard)")
                    self._queue.cancel_join_thread()  # nobody reads the pipe: do not hang at exit
                    return
                continue
            if msg[0] == "error":
                self._error = self._error or RuntimeError(msg[1])
                continue
            _, got, self._proc_logged, self._proc_dropped, self._proc_store_error = msg
            if got == token:
                return

    @property
    def points_logged(self) -> int:
        """Metric points posted to MLflow (after duplicate removal); process writer: as of the last flush."""
        if not self.enabled:
            return 0
        return self._sink.points_logged if self.cfg.writer != "process" else getattr(self, "_proc_logged", 0)

    @property
    def store_error(self) -> Optional[str]:
        """The plain sentence of a store failure whose points wait in the spool (as of the last flush), or None."""
        if not self.enabled:
            return None
        if self.cfg.writer != "process":
            return self._sink.store_error if self._sink.pending else None
        return getattr(self, "_proc_store_error", None)

    @property
    def dropped_points(self) -> int:
        """Points not sent because their step was already logged (resume)."""
        if not self.enabled:
            return 0
        return self._sink.dropped if self.cfg.writer != "process" else getattr(self, "_proc_dropped", 0)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("FAILED" if exc_type else "FINISHED")

    # ------------------------------------------------------------------------------------------- internals
    def _last_steps(self, run) -> Dict[str, int]:
        """Last logged step per metric key, from the run's latest metrics (one query)."""
        objs = getattr(run.data, "_metric_objs", None)
        if objs is not None:
            return {m.key: int(m.step) for m in objs}
        out = {}
        for key in run.data.metrics:  # fallback: one history query per key
            hist = retry(self.client.get_metric_history, run.info.run_id, key)
            out[key] = max((int(m.step) for m in hist), default=-1)
        return out

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            raise RuntimeError(f"MLflow logging for run {self.run_id} failed: {err!r}") from err

    def _atexit(self) -> None:
        """Interpreter exit without close(): a crash or sys.exit; keep every point and mark the run."""
        if not self._closed:
            try:
                self.close("FAILED")
            except Exception as e:  # nothing left to raise to
                print(f"[tracking] could not close run {self.run_id} at exit: {e!r}")


__all__ = ["source_tags", "describe_run", "start_system_metrics", "log_job_artifacts", "record_outcome",
           "TrackingConfig", "Tracker", "TrackingUnreachable", "check_tracking", "resolve_uri",
           "default_tracking_uri", "flatten_config", "git_info", "find_parent", "write_parent_file",
           "get_or_create_experiment", "make_client", "PARENT_FILE", "RESULTS_DIR", "spooled_last_steps", "store_cause", "mark_terminated"]
