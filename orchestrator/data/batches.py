"""Memory-mapped (x, y) batches whose order is a pure function of (seed, step, micro_step, rank).

No iterator state: a run resumed at step k asks for step k and gets what the uninterrupted run would have got,
and DDP ranks differ because the rank is part of the generator's seed. The order is recorded per step to a
compact file (replay.py) that a later run can replay exactly, whatever its seed.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from flash_forensics.orchestrator.data.config import DataError
from flash_forensics.orchestrator.data.replay import OrderHeader, OrderReader, OrderWriter, order_paths, seeded_offsets

PathLike = Union[str, Path]
Batch = Tuple[torch.Tensor, torch.Tensor]


def open_tokens(bin_path: PathLike, block_size: int) -> np.memmap:
    """uint16 token ids, checked: exists, whole tokens, at least block_size + 1 of them."""
    p = Path(bin_path)
    if not p.is_file():
        raise DataError(f"token file {p} does not exist; prepare it with `flash-forensics data prepare`")
    size = p.stat().st_size
    if size % 2:
        raise DataError(f"token file {p} has an odd byte count ({size}); uint16 tokens need an even one. "
                        "It is truncated or not a token file: delete its folder and prepare again")
    n = size // 2
    if n < block_size + 1:
        raise DataError(f"token file {p} holds {n} tokens; block_size={block_size} needs at least "
                        f"{block_size + 1} (T + 1 for the shifted targets). Use a larger corpus or a smaller T")
    return np.memmap(p, dtype=np.uint16, mode="r")


def _blocks(tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> Batch:
    idx = offsets[:, None] + np.arange(block_size + 1, dtype=np.int64)[None, :]
    buf = torch.from_numpy(tokens[idx].astype(np.int64))
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # x = t[o:o+T], y = t[o+1:o+T+1]


class BatchStream:
    """get(step, micro) -> (x, y), int64 CPU tensors (batch_size, block_size).

    record_path / replay_path name the order file; with world_size > 1 each rank uses its own file
    (order_paths). start_step: the step a resumed run restarts at; the record file keeps steps < start_step.
    Steps must be fetched in order while recording (micro 0..grad_accum-1 of step s, then s + 1); fetching a
    step already recorded again is fine. replay_past_end: what a replay does past the file's last step
    (replay.PAST_END: regenerate its seeded order, checked against the recorded part, or refuse)."""

    def __init__(self, bin_path: PathLike, block_size: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, record_path: Optional[PathLike] = None,
                 replay_path: Optional[PathLike] = None, grad_accum: int = 1, start_step: int = 0,
                 replay_past_end: str = "refuse"):
        for name, v, lo in (("block_size", block_size, 1), ("batch_size", batch_size, 1),
                            ("grad_accum", grad_accum, 1), ("world_size", world_size, 1), ("seed", seed, 0),
                            ("start_step", start_step, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise DataError(f"BatchStream {name}={v!r} is not allowed: expected an integer >= {lo}")
        if not 0 <= rank < world_size:
            raise DataError(f"BatchStream rank={rank} is not allowed: expected 0..{world_size - 1}")
        self.bin_path = Path(bin_path)
        self.tokens = open_tokens(self.bin_path, block_size)
        self.block_size, self.batch_size, self.grad_accum = int(block_size), int(batch_size), int(grad_accum)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.header = OrderHeader(self.block_size, self.batch_size, self.grad_accum, self.world_size, self.rank,
                                  self.seed, len(self.tokens))
        self.reader = (OrderReader(order_paths(replay_path, world_size)[rank], self.header, replay_past_end)
                       if replay_path is not None else None)
        self.writer: Optional[OrderWriter] = None
        self._pending: List[np.ndarray] = []
        if record_path is not None:
            self.writer = OrderWriter(order_paths(record_path, world_size)[rank], self.header, start_step)
            while self.writer.n_steps < start_step:  # a gap (recording switched on late): the order is pure
                s = self.writer.n_steps
                self.writer.append(np.stack([self.offsets(s, m) for m in range(self.grad_accum)]))

    # ------------------------------------------------------------------ order
    def offsets(self, step: int, micro: int = 0) -> np.ndarray:
        """The batch_size start offsets of (step, micro) for this rank, int64."""
        if not 0 <= micro < self.grad_accum:
            raise DataError(f"micro step {micro} is outside 0..{self.grad_accum - 1} (grad_accum)")
        if self.reader is not None:
            return self.reader.offsets(step, micro)
        return seeded_offsets(self.seed, step, micro, self.rank, len(self.tokens), self.block_size, self.batch_size)

    def get(self, step: int, micro: int = 0) -> Batch:
        offs = self.offsets(step, micro)
        if self.writer is not None:
            self._record(step, micro, offs)
        return _blocks(self.tokens, offs, self.block_size)

    def _record(self, step: int, micro: int, offs: np.ndarray) -> None:
        done = self.writer.n_steps
        if step < done:
            return  # already on file (the order is a pure function, so nothing can differ)
        if step > done or micro != len(self._pending):
            raise DataError(f"recording batch order: got (step {step}, micro {micro}) but the next to record is "
                            f"(step {done}, micro {len(self._pending)}); fetch batches in order")
        self._pending.append(offs)
        if len(self._pending) == self.grad_accum:
            self.writer.append(np.stack(self._pending))
            self._pending = []

    # ------------------------------------------------------------------ files
    @property
    def paths(self) -> List[Path]:
        """This rank's order file(s), for MLflow artifacts (recorded, else replayed)."""
        if self.writer is not None:
            return [self.writer.path]
        return [self.reader.path] if self.reader is not None else []

    @property
    def recorded_steps(self) -> int:
        return self.writer.n_steps if self.writer is not None else 0

    def check_covers(self, n_steps: int) -> None:
        """Replay: fail before training when the file is shorter than the run."""
        if self.reader is not None:
            self.reader.check_covers(n_steps)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def val_batches(bin_path: PathLike, block_size: int, batch_size: int, n_batches: int, seed: int = 0) -> List[Batch]:
    """A fixed list of validation batches: the same for every run, step and rank given the same seed."""
    tokens = open_tokens(bin_path, block_size)
    rng = np.random.default_rng([seed, 0x7A1])
    offs = rng.integers(0, len(tokens) - block_size, size=(n_batches, batch_size), dtype=np.int64)
    return [_blocks(tokens, o, block_size) for o in offs]
