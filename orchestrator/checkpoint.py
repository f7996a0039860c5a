"""Checkpoints: everything a job needs to continue bit-for-bit (CPU) from a step boundary.

A checkpoint holds the model, the optimizer, every RNG state, the next step, the detector and monitor state, the
MLflow run id, the model shape (checked on resume) and the resolved config. Writes are atomic (temp file in the
same folder + os.replace), so a crash or preemption mid-write leaves the previous checkpoint intact.
"""
from __future__ import annotations

import os
import random
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


def load(path: os.PathLike, map_location="cpu") -> Dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"resume={str(path)!r}: no such checkpoint file")
    try:
        # our own files: they hold RNG states (numpy arrays, tuples) that weights_only refuses
        state = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
    except Exception as e:
        raise CheckpointError(f"resume={str(path)!r}: not a readable checkpoint ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"resume={str(path)!r}: not a flash-forensics checkpoint (format {FORMAT})")
    return state


def check_compatible(path: os.PathLike, model_cfg, key: str = "resume") -> Dict[str, Any]:
    """Load the checkpoint at path and check it was written by a model of model_cfg's shape."""
    state = load(path)
    want, got = model_shape(model_cfg), state.get("model_shape", {})
    diff = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in diff.items())
        raise CheckpointError(f"{key}={str(path)!r} belongs to another model shape ({detail}); "
                              f"allowed: a checkpoint of model {want}")
    return state


def latest(job_dir: os.PathLike) -> Optional[Path]:
    """<job dir>/checkpoints/last.pt when it exists (auto-resume of a requeued job)."""
    path = Path(job_dir) / "checkpoints" / "last.pt"
    return path if path.is_file() else None


__all__ = ["CheckpointError", "model_shape", "rng_state", "set_rng_state", "save", "load", "check_compatible",
           "latest", "SHAPE_KEYS"]
