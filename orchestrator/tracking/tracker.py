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
import json
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from flash_forensics.orchestrator.tracking.run_fields import (  # noqa: F401
    FINITE_SUFFIX,
    JOB_ARTIFACTS,
    describe_run,
    git_info,
    log_job_artifacts,
    record_outcome,
    source_tags,
    start_system_metrics,
)
from flash_forensics.orchestrator.tracking.store import (  # noqa: F401  (re-exported: the names readers import from here)
    MAX_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
    PARENT_FILE,
    REPO_ROOT,
    RESULTS_DIR,
    TrackingConfig,  # noqa: F401  (re-exported: the schema's node)
    TrackingUnreachable,
    _truncate,
    artifact_root_for,
    check_tracking,
    default_tracking_uri,
    find_parent,
    get_or_create_experiment,
    make_client,
    mark_terminated,
    resolve_uri,
    retry,
    sqlite_path,
    write_parent_file,
)
from flash_forensics.orchestrator.tracking.writer import (  # noqa: F401
    _FLUSH,
    _STOP,
    _drain,
    _Sink,
    _writer_process,
    spooled_last_steps,
    start_writer_process,
    store_cause,
)


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



def _writer_died(exitcode) -> str:
    """Why the writer process is gone, in words: a signal by name, else the spawn guard a script may lack."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"MLflow writer process was killed by {name} before the run's last points were written"
    return (f"MLflow writer process exited with code {exitcode} (a script using tracking.writer=process needs an "
            f"`if __name__ == '__main__':` guard)")


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
        if cfg.writer == "process":
            start_writer_process(self._worker)
        else:
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
                    self._error = self._error or RuntimeError(_writer_died(self._worker.exitcode))
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
           "get_or_create_experiment", "make_client", "PARENT_FILE", "RESULTS_DIR", "spooled_last_steps", "store_cause",
           "mark_terminated"]
