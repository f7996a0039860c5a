"""Checkpoints: everything a job needs to continue bit-for-bit (CPU) from a step boundary.

A checkpoint holds the model, the optimizer, every RNG state, the next step, the detector and monitor state, the
MLflow run id, the model shape (checked on resume), the batch-order file and the resolved config. Writes are atomic
(temp file in the same folder + os.replace), so a crash or preemption mid-write leaves the previous checkpoint intact.
Each file carries the sha256 of its content as its zip comment, checked on every load: a damaged file is a clear
error naming it, and auto-resume (`latest`) falls back to the newest intact checkpoint and says so. Periodic
checkpoints are kept as step_<k>.pt (train.keep_checkpoints of them); last.pt, the resume target, is a separate copy
of the newest (a hard link would share one damage). A fork (orchestrator/job/fork.py) starts another intervention from
any of them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
import struct
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from flash_forensics.orchestrator import errors as faults

log = logging.getLogger(__name__)

FORMAT = 1
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, unreadable, or of another model shape)."""


def model_shape(model_cfg) -> Dict[str, int]:
    return {k: int(getattr(model_cfg, k)) for k in SHAPE_KEYS}


def rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


CHECKSUM_PREFIX = b"ff-sha256:"  # the zip archive's comment: sha256 of the archive as torch.save wrote it
_COMMENT_LEN = len(CHECKSUM_PREFIX) + 64
_EOCD = b"PK\x05\x06"  # zip end-of-central-directory record (22 bytes + comment); torch.save writes no comment


KILL_AFTER_BYTES: Optional[int] = None  # debug (fault tests): SIGKILL this process once so many bytes are written


class _HashingWriter:
    """The file object torch.save writes to: hashes what passes and keeps the OSError (ENOSPC, ...) that torch
    would otherwise turn into '[enforce fail at inline_container.cc] unexpected pos'."""

    def __init__(self, f):
        self.f, self.sha, self.error = f, hashlib.sha256(), None

    def write(self, b) -> int:
        try:
            n = self.f.write(b)
        except OSError as e:
            self.error = self.error or e
            raise
        self.sha.update(b)
        if KILL_AFTER_BYTES is not None and self.f.tell() >= KILL_AFTER_BYTES:
            import signal
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    def flush(self) -> None:
        self.f.flush()


def save(path: os.PathLike, state: Dict[str, Any]) -> Path:
    """Atomically write `state` (plus the format version) to path, with its checksum as the zip comment.

    A temp file in the same folder (named with our pid, so a later start removes it after a kill -9) + fsync +
    os.replace: a crash mid-write leaves the previous file intact. OSError (disk full, read-only folder) becomes a
    faults.WriteError whose message is one plain sentence naming the path and the cause; no temp file is left."""
    path = Path(path)
    tmp = faults.temp_name(path)
    w = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w+b") as f:
            w = _HashingWriter(f)
            torch.save({"format": FORMAT, **state}, w)
            f.flush()
            size = f.tell()
            f.seek(size - 22)
            if f.read(22)[:4] != _EOCD:
                raise RuntimeError(f"torch.save wrote {tmp} without a plain zip end record: cannot add a checksum")
            f.seek(size - 2)
            f.write(struct.pack("<H", _COMMENT_LEN))  # the comment's length (the hash covers it as 0)
            f.write(CHECKSUM_PREFIX + w.sha.hexdigest().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        err = (w.error if w is not None else None) or (e if isinstance(e, OSError) else None)
        if err is not None:
            raise faults.WriteError(err.errno, faults.sentence("checkpoint", path, err)) from e
        raise
    return path


def verify(path: os.PathLike, key: str = "resume") -> bool:
    """Check the checksum of the checkpoint at path: True when it matches, False when the file has none (written
    before checksums); CheckpointError (naming the path) when the file is not a checkpoint or does not match."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
            if head != b"PK\x03\x04":
                raise CheckpointError(f"{key}={str(path)!r} is not a readable checkpoint: a flash-forensics "
                                      f"checkpoint is a torch.save archive (zip); this file starts with {head!r}")
            f.seek(max(0, size - 22 - _COMMENT_LEN))
            tail = f.read()
            if len(tail) < 22 + _COMMENT_LEN or tail[:4] != _EOCD or not tail[22:].startswith(CHECKSUM_PREFIX):
                return False
            want = tail[22 + len(CHECKSUM_PREFIX):].decode("ascii", "replace")
            sha = hashlib.sha256()
            f.seek(0)
            left = size - _COMMENT_LEN - 2
            while left > 0:
                chunk = f.read(min(left, 1 << 22))
                if not chunk:
                    break
                sha.update(chunk)
                left -= len(chunk)
            sha.update(b"\0\0")  # the comment length as torch.save wrote it
    except OSError as e:
        raise CheckpointError(f"{key}={str(path)!r}: cannot read the checkpoint: {faults.cause(e)}") from None
    if sha.hexdigest() != want:
        raise CheckpointError(f"{key}={str(path)!r} is damaged: its content does not match the checksum written with "
                              f"it (sha256 {sha.hexdigest()[:16]}... vs {want[:16]}...); use an older checkpoint of "
                              f"the job (flash-forensics fork list <job dir>)")
    return True


def load(path: os.PathLike, map_location="cpu", key: str = "resume") -> Dict[str, Any]:
    """Verify the checksum, then load. Every failure is a CheckpointError naming the key and the path."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{key}={str(path)!r}: no such checkpoint file")
    if not verify(path, key):
        log.warning("%s=%s: the checkpoint has no checksum (written before checksums): loaded unverified", key, path)
    try:
        # our own files: they hold RNG states (numpy arrays, tuples) that weights_only refuses
        state = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{key}={str(path)!r} is not a readable checkpoint ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{key}={str(path)!r}: not a flash-forensics checkpoint (format {FORMAT})")
    return state


def check_compatible(path: os.PathLike, model_cfg, key: str = "resume") -> Dict[str, Any]:
    """Load the checkpoint at path and check it was written by a model of model_cfg's shape."""
    state = load(path, key=key)
    want, got = model_shape(model_cfg), state.get("model_shape", {})
    diff = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in diff.items())
        raise CheckpointError(f"{key}={str(path)!r} belongs to another model shape ({detail}); "
                              f"allowed: a checkpoint of model {want}")
    return state


STEP_RE = re.compile(r"^step_(\d+)\.pt$")


def step_path(ckpt_dir: os.PathLike, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{int(step)}.pt"


def step_files(ckpt_dir: os.PathLike) -> Dict[int, Path]:
    """step -> step_<k>.pt in ckpt_dir (the step is read from the name: no checkpoint is loaded)."""
    d = Path(ckpt_dir)
    found = {}
    if d.is_dir():
        for p in d.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_file():
                found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def save_step(ckpt_dir: os.PathLike, step: int, state: Dict[str, Any], keep: int = 0,
              protect_before: Optional[int] = None, last: str = "last.pt") -> Path:
    """Write step_<step>.pt, copy it to `last` (the resume target, a separate file), and prune old step files.

    Pruning keeps the `keep` newest step files (0 = all)
    and, when protect_before is given (a divergence step), the newest one at or before it: the checkpoint a fork
    would start from is never pruned by the steps that follow a divergence."""
    path = save(step_path(ckpt_dir, step), state)
    target = Path(ckpt_dir) / last
    tmp = faults.temp_name(target)
    try:
        shutil.copyfile(path, tmp)  # a separate file: damage to one never reaches the other
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        raise faults.WriteError(e.errno, faults.sentence("checkpoint", target, e)) from e
    finally:
        if tmp.exists():
            tmp.unlink()
    if keep > 0:
        files = step_files(ckpt_dir)
        kept = set(sorted(files)[-keep:])
        if protect_before is not None:
            before = [s for s in files if s <= protect_before]
            if before:
                kept.add(max(before))
        for s, p in files.items():
            if s not in kept:
                p.unlink(missing_ok=True)
    return path


def latest(job_dir: os.PathLike, key: str = "auto-resume") -> Optional[Path]:
    """The newest intact checkpoint of <job dir>/checkpoints (auto-resume of a requeued job): last.pt when it
    verifies, else the newest step_<k>.pt that does (said on stderr, with why last.pt was passed over). None when
    there is none at all; CheckpointError when every one is damaged."""
    d = Path(job_dir) / "checkpoints"
    cands = [d / "last.pt"] if (d / "last.pt").is_file() else []
    cands += [p for _, p in sorted(step_files(d).items(), reverse=True)]
    problems = []
    for p in cands:
        try:
            verify(p, key)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if problems:
            print(f"[checkpoint] {key}: resuming from {p}, the newest intact checkpoint ({'; '.join(problems)})",
                  file=sys.stderr, flush=True)
        return p
    if problems:
        raise CheckpointError(f"{key}: every checkpoint in {d} is damaged ({'; '.join(problems)})")
    return None


__all__ = ["CheckpointError", "model_shape", "rng_state", "set_rng_state", "save", "load", "check_compatible",
           "latest", "SHAPE_KEYS", "save_step", "step_files", "step_path", "verify"]


def read_header(path: os.PathLike, key: str = "resume") -> Dict[str, Any]:
    """A checkpoint without its tensors' data, for checks before launch: every small entry (step, config, model
    shape, detector, batch order, ...) and `param_shapes` (name -> shape of each model tensor) in place of the
    weights and the optimizer state. The file is memory-mapped, so no tensor bytes are read."""
    state = load(path, key=key)
    head = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    head["param_shapes"] = {n: tuple(t.shape) for n, t in (state.get("model") or {}).items()}
    return head
