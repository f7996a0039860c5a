"""One exclusive lock file, removed by its holder: the corpus folder's and the sqlite store's (no .lock is left).

A waiter blocks on flock; when it wakes, the holder may have unlinked the file it locked, so it checks that the
inode it holds is the one at the path now and otherwise locks the new file. Without fcntl (Windows) it does not
serialize, and the callers' own atomic steps (renames, MLflow's own locking) are what is left.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    path = Path(path)
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # while held: a waiter finds its inode gone and locks the next file
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        f.close()


__all__ = ["exclusive"]
