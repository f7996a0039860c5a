"""What a run will cost on disk, checked before it starts: the recorded batch order, the MLflow points and the
checkpoints it keeps, against the free space where they go. A run that cannot fit (10^12 steps) is refused, naming
train.max_steps, the estimate and the most that fits; the time it will take is said by the job once it has timed
its first steps (orchestrator/job/train.py)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict

from flash_forensics.orchestrator.config.folders import check_folder
from flash_forensics.orchestrator.errors import ConfigError

POINT_BYTES = 200  # one MLflow metric point in a sqlite store (row + index), generously
POINTS_PER_STEP = 3  # train/loss, train/grad_norm, train/lr
ADAM_COPIES = 3  # weights + AdamW's two moments, FP32


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def n_params(model) -> int:
    d, L = int(model.n_embd), int(model.n_layer)
    return 12 * L * d * d + int(getattr(model, "vocab_size", 50304)) * d + int(model.block_size) * d


def estimate(obj) -> Dict[str, float]:
    """Bytes the run writes: batch order, MLflow points, kept checkpoints."""
    t = obj.train
    steps = int(t.max_steps)
    order = steps * t.grad_accum * t.batch_size * 8 if t.record_batches else 0
    points = steps * POINTS_PER_STEP * POINT_BYTES
    saves = (max(0, steps - t.ckpt_start) // t.ckpt_every + 1) if t.ckpt_every else 1
    kept = min(saves, t.keep_checkpoints + 2) if t.keep_checkpoints else saves  # + last.pt, + the pre-divergence one
    ckpts = kept * n_params(obj.model) * 4 * ADAM_COPIES
    return {"batch order": float(order), "MLflow points": float(points), "checkpoints": float(ckpts)}


def _free(path: Path) -> int:
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def check_results_dir(results_dir: str) -> Path:
    """results_dir can hold the job folders (Hydra makes them before the job runs): ConfigError naming it otherwise."""
    return check_folder("results_dir", results_dir, "the job folders, checkpoints and reports go there")


def check_budget(obj) -> Dict[str, float]:
    """ConfigError when results_dir cannot be written, or when the run's estimated disk exceeds its free space; the
    estimate otherwise."""
    check_results_dir(str(obj.results_dir))
    est = estimate(obj)
    total = sum(est.values())
    free = _free(Path(str(obj.results_dir)))
    if total > free:
        per_step = total / max(int(obj.train.max_steps), 1)
        fits = int(free / per_step) if per_step else 0
        parts = ", ".join(f"{k} {_human(v)}" for k, v in est.items() if v)
        raise ConfigError(f"train.max_steps={obj.train.max_steps} is not allowed: the run would write ~{_human(total)} "
                          f"({parts}) and {obj.results_dir} has {_human(free)} free; expected at most ~{fits} steps "
                          f"(or train.record_batches=false, train.keep_checkpoints=N)")
    return est


__all__ = ["check_budget", "estimate", "n_params"]
