"""The job folder's own files: job.json (written at start, what the launcher needs if the job dies without a result)
and result.json (the typed run record at the end), each written atomically."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.errors import WriteError, _alive, sentence, temp_name
from flash_forensics.orchestrator.record import RESULT_FILE

START_FILE = "job.json"  # written at job start: what the launcher needs if the job dies without a result


def _write_json(path: Path, data: Dict[str, Any], what: str) -> Path:
    """Atomic (temp + os.replace), NaN/inf as the run record writes them; an OSError becomes one plain sentence
    naming the path and the cause."""
    tmp = temp_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(record.dumps(data))
        tmp.replace(path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise WriteError(e.errno, sentence(what, path, e)) from e
    return path


def write_result(job_dir: Path, result: Dict[str, Any]) -> Path:
    """<job dir>/result.json as the typed run record (orchestrator/record.py): one encoding, atomic."""
    return _write_json(Path(job_dir) / RESULT_FILE, record.RunRecord.from_dict(result).to_dict(), "the job result")


def write_job_start(job_dir: Path, **fields) -> Path:
    """Merge fields into <job dir>/job.json (created at job start)."""
    path = Path(job_dir) / START_FILE
    data = read_job_start(job_dir) or {}
    data.update(fields)
    return _write_json(path, data, "the job record")


def alive_here(start: Dict[str, Any]) -> bool:
    """job.json's process is alive on this machine (its host is this one, its pid a live process)."""
    import socket
    pid = start.get("pid")
    return (start.get("host") == socket.gethostname() and isinstance(pid, int) and not isinstance(pid, bool)
            and pid > 0 and _alive(pid))


def read_job_start(job_dir: Path) -> Optional[Dict[str, Any]]:
    path = Path(job_dir) / START_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
