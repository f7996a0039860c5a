"""The tracker's writer: queued points drained into MLflow batches (a thread or a process), a spool file when the
store fails, replayed later without duplicates."""
from __future__ import annotations

import json
import multiprocessing
import os
import queue
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from flash_forensics.orchestrator.errors import WriteError, sentence
from flash_forensics.orchestrator.tracking.store import (
    MAX_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    make_client,
    retry,
    sqlite_path,
)

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
            raise WriteError(e.errno, sentence("the metric spool", self.spool, e)
                             + f", and the MLflow store {self.uri} "
                             f"cannot be written ({getattr(self, 'store_cause', '?')}): the points cannot be kept") \
                from e

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


def _stop_signals() -> set:
    """What asks a run to stop: ^C, SLURM's SIGTERM, submitit's preemption signal (SUBMITIT_PREEMPT_SIGNAL)."""
    names = {"SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2",
             "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").removeprefix("SIG")}
    return {getattr(signal, n) for n in names if hasattr(signal, n)}


def start_writer_process(proc) -> None:
    """Start the writer with the stop signals blocked; it ignores them once it runs (_writer_process).

    A stop request sent to the whole process group (^C in a terminal, SLURM's SIGTERM, a race's TERM to a run's
    group) is the training process's to answer. Ended first, the writer would take the points of that answer's
    last flush with it, and the stop checkpoint would fail. The mask is inherited through spawn's exec, so the
    seconds the child spends importing before it runs a line of ours are covered too."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _stop_signals())
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a signal that came meanwhile is delivered here


def _ignore_stop_signals() -> None:
    """Ignored, then unblocked: one that came while they were blocked is discarded."""
    sigs = _stop_signals()
    for s in sigs:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)


def _writer_process(uri: str, run_id: str, last_step: Dict[str, int], interval: float, q, acks,
                    spool: Optional[str] = None) -> None:
    """Entry point of writer='process': MLflow's Python work runs here, off the training process's GIL."""
    _ignore_stop_signals()
    parent = multiprocessing.parent_process()
    try:
        sink = _Sink(make_client(uri), run_id, last_step, spool, uri)
    except BaseException as e:
        acks.put(("error", f"{type(e).__name__}: {e}"))
        return

    def get(timeout: float):
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            if parent is not None and not parent.is_alive():  # killed (-9): no _STOP will come; post what is here
                acks.cancel_join_thread()  # and exit: nobody reads the acks
                return (_STOP, None)
            raise

    _drain(get, sink, interval,
           ack=lambda token: acks.put(("ack", token, sink.points_logged, sink.dropped, sink.store_error)),
           fail=lambda e: acks.put(("error", f"{type(e).__name__}: {e}")))


