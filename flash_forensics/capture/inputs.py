"""`analyze`'s arguments checked before any work: the capture is a file, --out a folder that can be written, --mlflow
a store that answers. Each refusal names the argument, the value and what is allowed (InputError)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

from flash_forensics.orchestrator.tracking.store import TrackingUnreachable, check_tracking, make_client


class InputError(ValueError):
    """An argument of `analyze` that cannot work; raised before the analysis starts."""


def check_file(value: str) -> Path:
    path = Path(value)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.safetensors"))[:5]
        hint = f" (it holds {', '.join(found)})" if found else " (it holds no .safetensors file)"
        raise InputError(f"FILE={value!r} is a folder{hint}; expected one .safetensors capture file")
    if not path.is_file():
        raise InputError(f"FILE={value!r}: no such file; expected a .safetensors capture file")
    return path


def check_out(value: str) -> Path:
    """The folder (existing or to be created) the reports go to: refused when it or its nearest existing parent is
    a file, or when that parent is not writable. Nothing is created here."""
    path = Path(value)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        what = "is a file" if probe == path else f"lies under {probe}, which is a file"
        raise InputError(f"--out={value!r} {what}; expected a folder (existing, or one that can be created)")
    try:  # a real write: os.access says yes to root on a read-only filesystem or /proc
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise InputError(f"--out={value!r}: {probe} is not writable ({e.strerror}); expected a folder this user "
                         "can write") from None
    return path


def check_mlflow(value: Optional[str], timeout_s: float = 3.0):
    """The MLflow client for --mlflow (None without it): a server must answer /health within timeout_s (no
    MLflow retries), a sqlite path must be a new file or an SQLite database in a writable folder."""
    if not value:
        return None
    try:
        uri = check_tracking(value, timeout_s=timeout_s)
        return uri, make_client(uri)
    except (TrackingUnreachable, ValueError) as e:
        why = str(e).split(": ", 1)[-1].split(". Start it with")[0]  # the store's words without tracking.uri advice
        if "expected" not in why and "use sqlite" not in why:
            why += "; expected sqlite:///<path>.db or the http(s):// address of a running MLflow server"
        raise InputError(f"--mlflow={value!r}: {why}") from None


__all__ = ["InputError", "check_file", "check_out", "check_mlflow"]
