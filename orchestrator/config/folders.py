"""A folder a job will write (results_dir, hydra.run.dir, hydra.sweep.dir, monitor.capture.dir), tried before
anything runs: made and removed as a temporary folder in it, or in its nearest existing parent (os.access says yes
to root on a read-only filesystem)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from flash_forensics.orchestrator.errors import ConfigError


def check_folder(key: str, value, what: str, base: Optional[Path] = None) -> Path:
    """The nearest existing folder of `value` (relative to `base` when given); ConfigError naming key, value and
    what is allowed when it is a file or cannot be written. `what`: what goes there, for the message."""
    p = Path(os.path.expanduser(str(value)))
    if base is not None and not p.is_absolute():
        p = Path(base) / p
    p = Path(os.path.abspath(p))
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    why = None
    if not probe.is_dir():
        why = f"{probe} is a file, not a folder"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".ff-write-test-", dir=probe))
        except OSError as e:
            why = f"a folder cannot be made in {probe} ({e.strerror or e})"
    if why:
        raise ConfigError(f"{key}={value!r} is not allowed: {why}; expected a folder this user can write ({what})")
    return probe


def check_capture_dir(capture, job_dir: Path) -> None:
    """monitor.capture.dir (relative to the job folder) can be written when the job captures anything: said
    before launch, not at the capture step after the training up to it. `capture`: the config node or dataclass."""
    if capture is None:
        return
    get = lambda name: getattr(capture, name, None)
    if get("steps") or get("at_alarm") or get("before_divergence"):
        check_folder("monitor.capture.dir", get("dir"), "the attention snapshots go there, relative to the job "
                     "folder", base=job_dir)


__all__ = ["check_folder", "check_capture_dir"]
