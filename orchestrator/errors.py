"""The errors every stage shares: ConfigError (a configuration that must not run), plain sentences for the OS errors
a job meets (disk full, read-only folder, a store that vanished) and the clean-up of temp files a killed job leaves
behind (checkpoints, the tracking spool, result.json)."""
from __future__ import annotations

import errno
import os
from pathlib import Path


class ConfigError(ValueError):
    """A configuration that must not run; the message names the key, the value and what is allowed."""


_CAUSES = {errno.ENOSPC: "the disk is full (ENOSPC)", errno.EDQUOT: "the disk quota is exceeded (EDQUOT)",
           errno.EROFS: "the file system is read-only (EROFS)", errno.EACCES: "permission denied (EACCES)",
           errno.EPERM: "permission denied (EPERM)", errno.ENOENT: "the folder does not exist (ENOENT)"}


def cause(e: BaseException) -> str:
    """'the disk is full (ENOSPC)', ... or the OS's own words."""
    if isinstance(e, OSError) and e.errno in _CAUSES:
        return _CAUSES[e.errno]
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} (errno {e.errno})"
    return f"{type(e).__name__}: {e}"


def sentence(what: str, path, e: BaseException) -> str:
    """One plain sentence: what could not be done, where, and why."""
    return f"cannot write {what} {path}: {cause(e)}"


class WriteError(OSError):
    """A file the job must keep could not be written; str() is the plain sentence."""


def temp_name(path: Path) -> Path:
    """The temp file beside `path` this process writes before os.replace (the pid lets a later start remove it)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def remove_stale_temps(folder) -> list:
    """Remove `.<name>.<pid>.tmp` files in folder whose writer is gone (a kill -9 mid-write). Returns their paths."""
    removed = []
    d = Path(folder)
    if not d.is_dir():
        return removed
    for p in d.glob(".*.tmp"):
        parts = p.name.rsplit(".", 2)
        try:
            pid = int(parts[-2])
        except (ValueError, IndexError):
            pid = None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue
        if pid == os.getpid():
            continue
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
