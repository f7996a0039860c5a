"""Checkpoints: everything a job needs to continue bit-for-bit (CPU) from a step boundary.

A checkpoint holds the model, the optimizer, every RNG state, the next step, the detector and monitor state, the
MLflow run id, the model shape (checked on resume), the batch-order file and the resolved config. Writes are atomic
(temp file in the same folder + os.replace), so a crash or preemption mid-write leaves the previous checkpoint intact.
Periodic checkpoints are kept as step_<k>.pt (train.keep_checkpoints of them); last.pt, the resume target, is linked
to the newest. A fork (orchestrator/fork.py) starts another intervention from any of them.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

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


def save(path: os.PathLike, state: Dict[str, Any]) -> Path:
    """Atomically write `state` (plus the format version) to path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(path: os.PathLike, map_location="cpu", key: str = "resume") -> Dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{key}={str(path)!r}: no such checkpoint file")
    try:
        # our own files: they hold RNG states (numpy arrays, tuples) that weights_only refuses
        state = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{key}={str(path)!r}: not a readable checkpoint ({e})") from None
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
    """Write step_<step>.pt, point `last` (the resume target) at the same bytes, and prune old step files.

    `last` becomes a hard link to the step file (atomically, via a temp link + os.replace; a copy where links are
    not supported), so a periodic checkpoint costs one write. Pruning keeps the `keep` newest step files (0 = all)
    and, when protect_before is given (a divergence step), the newest one at or before it: the checkpoint a fork
    would start from is never pruned by the steps that follow a divergence."""
    path = save(step_path(ckpt_dir, step), state)
    target = Path(ckpt_dir) / last
    tmp = target.with_name(f".{last}.{os.getpid()}.link")
    try:
        if tmp.exists():
            tmp.unlink()
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, target)
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


def latest(job_dir: os.PathLike) -> Optional[Path]:
    """<job dir>/checkpoints/last.pt when it exists (auto-resume of a requeued job)."""
    path = Path(job_dir) / "checkpoints" / "last.pt"
    return path if path.is_file() else None


__all__ = ["CheckpointError", "model_shape", "rng_state", "set_rng_state", "save", "load", "check_compatible",
           "latest", "SHAPE_KEYS", "save_step", "step_files", "step_path"]


def read_header(path: os.PathLike, key: str = "resume") -> Dict[str, Any]:
    """A checkpoint without its tensors' data, for checks before launch: every small entry (step, config, model
    shape, detector, batch order, ...) and `param_shapes` (name -> shape of each model tensor) in place of the
    weights and the optimizer state. The file is memory-mapped, so no tensor bytes are read."""
    state = load(path, key=key)
    head = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    head["param_shapes"] = {n: tuple(t.shape) for n, t in (state.get("model") or {}).items()}
    return head
