"""One job per job folder at a time: <job dir>/job.lock holds the pid and host of the job that owns the folder.

Two jobs given the same folder (the same hydra.run.dir, a requeue racing its original) would overwrite each
other's result.json and checkpoints. `hold(job_dir)` creates the lock atomically (O_EXCL); a lock whose process
is gone (kill -9, node loss: same host, pid not alive) is taken over, said in one line; a live one is refused with
`FolderBusy`, naming the pid. The lock is removed when the job ends.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Iterator, Optional

from flash_forensics.orchestrator.errors import _alive

LOCK_FILE = "job.lock"


class FolderBusy(RuntimeError):
    """The job folder belongs to a job that is still running."""


def _owner(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _create(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
    return True


def acquire(job_dir: os.PathLike) -> Path:
    """Take the folder's lock; FolderBusy when a live job holds it."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / LOCK_FILE
    for _ in range(3):
        if _create(path):
            return path
        owner = _owner(path)
        if owner is None:  # being written this instant, or garbage: look again, then take it
            if path.exists() and path.stat().st_size == 0:
                continue
        pid, host = (owner or {}).get("pid"), (owner or {}).get("host")
        if isinstance(pid, int) and pid != os.getpid() and (host != socket.gethostname() or _alive(pid)):
            where = "" if host == socket.gethostname() else f" on {host}"
            raise FolderBusy(f"the job folder {job_dir} is in use by the job with pid {pid}{where} ({path}); two "
                             f"jobs in one folder overwrite each other's result.json: give this one its own folder "
                             f"(hydra.run.dir=...), or wait for it to end")
        print(f"[job] {path}: its job (pid {pid}) is gone; this job takes the folder over")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    raise FolderBusy(f"the job folder {job_dir}: could not take {path} (another job keeps taking it)")


def release(path: Path) -> None:
    owner = _owner(path)
    if owner is not None and owner.get("pid") == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def hold(job_dir: os.PathLike) -> Iterator[Path]:
    path = acquire(job_dir)
    try:
        yield path
    finally:
        release(path)


__all__ = ["hold", "acquire", "release", "FolderBusy", "LOCK_FILE"]
