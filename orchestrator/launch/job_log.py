"""The job's log: everything the job prints goes to <job dir>/run.log as well as to the terminal.

Hydra's own run.log receives only `logging` records; the job speaks through print, warnings and tqdm. `tee(job_dir)`
wraps sys.stdout and sys.stderr for the job's duration: each complete line is appended to run.log and flushed to
the OS at once (a kill -9 loses at most the line being written), warnings (warnings.showwarning writes to
sys.stderr) and tracebacks (`log_only`) included. Carriage returns are rendered as a terminal renders them: a tqdm
bar's refreshes leave one line, its final state, when the bar ends its line.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Iterator, Optional, TextIO

LOG_FILE = "run.log"


class _Tee:
    """A text stream that writes to `stream` and, by complete lines, to the log file."""

    def __init__(self, stream: TextIO, log: TextIO, lock: threading.Lock):
        self._stream, self._log, self._lock = stream, log, lock
        self._pending = ""  # the current line, as a terminal would show it

    def write(self, text: str) -> int:
        with self._lock:
            try:
                self._stream.write(text)
            except (OSError, ValueError):  # a closed terminal must not stop the job
                pass
            self._to_log(text)
        return len(text)

    def _to_log(self, text: str) -> None:
        out = []
        line = self._pending
        for ch in text:
            if ch == "\n":
                out.append(line.rstrip() + "\n")
                line = ""
            elif ch == "\r":
                line = ""
            else:
                line += ch
        self._pending = line
        if out:
            try:
                self._log.write("".join(out))
                self._log.flush()
            except (OSError, ValueError):
                pass

    def log_only(self, text: str) -> None:
        with self._lock:
            self._to_log(text if text.endswith("\n") else text + "\n")

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def close_line(self) -> None:
        """Write the unfinished line (at the end of the job)."""
        if self._pending.strip():
            self._to_log("\n")

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the terminal's
        return getattr(self._stream, name)


_active: Optional[_Tee] = None


@contextlib.contextmanager
def tee(job_dir: os.PathLike) -> Iterator[Path]:
    """sys.stdout and sys.stderr also into <job dir>/run.log (appended) while the block runs."""
    global _active
    path = Path(job_dir) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", encoding="utf-8", errors="replace", buffering=1)
    lock = threading.Lock()
    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(old_out, log, lock), _Tee(old_err, log, lock)
    prev, _active = _active, sys.stderr
    shown = warnings.showwarning  # a caller's own hook (pytest, logging.captureWarnings) would bypass stderr

    def showwarning(message, category, filename, lineno, file=None, line=None):
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = showwarning
    try:
        yield path
    finally:
        warnings.showwarning = shown
        for t in (sys.stdout, sys.stderr):
            if isinstance(t, _Tee):
                t.close_line()
        sys.stdout, sys.stderr, _active = old_out, old_err, prev
        log.close()


def log_only(text: str) -> None:
    """A line for the log, not the terminal (a traceback the terminal already summarised in one line)."""
    if _active is not None:
        _active.log_only(text)


__all__ = ["tee", "log_only", "LOG_FILE"]
