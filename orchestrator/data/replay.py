"""The batch-order file: which offsets each (step, micro_step) of one DDP rank read.

Layout (little endian): a 64-byte header
    magic b"FFORDER1", version u16, offset width u16 (4 or 8 bytes), block_size u32, batch_size u32, grad_accum u32,
    world_size u32, rank u32, seed u64, n_tokens u64 (length of the train.bin it indexes), zero padding
then, per step, grad_accum * batch_size offsets (uint32 when the bin has < 2**32 tokens, else uint64).
Steps are appended and flushed as they happen, so a crash keeps every whole step written before it; a partial
trailing step is ignored on reading and cut on resume. One file per rank: `order_paths(base, world_size)`.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

import numpy as np

from orchestrator.data.config import DataError

MAGIC = b"FFORDER1"
VERSION = 1
_HEAD = struct.Struct("<8sHHIIIIIQQ")
HEADER_BYTES = 64


@dataclass(frozen=True)
class OrderHeader:
    block_size: int
    batch_size: int
    grad_accum: int
    world_size: int
    rank: int
    seed: int
    n_tokens: int
    width: int = 0  # bytes per offset; 0 = choose from n_tokens

    def __post_init__(self):
        if self.width == 0:
            object.__setattr__(self, "width", 4 if self.n_tokens < 2 ** 32 else 8)

    @property
    def dtype(self):
        return np.dtype("<u4") if self.width == 4 else np.dtype("<u8")

    @property
    def step_items(self) -> int:
        return self.grad_accum * self.batch_size

    @property
    def step_bytes(self) -> int:
        return self.step_items * self.width

    def pack(self) -> bytes:
        raw = _HEAD.pack(MAGIC, VERSION, self.width, self.block_size, self.batch_size, self.grad_accum,
                         self.world_size, self.rank, self.seed, self.n_tokens)
        return raw.ljust(HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes, path: Path) -> "OrderHeader":
        if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
            raise DataError(f"{path} is not a batch-order file (bad or missing header)")
        magic, version, width, T, B, ga, ws, rank, seed, n = _HEAD.unpack(raw[:_HEAD.size])
        if version != VERSION or width not in (4, 8):
            raise DataError(f"{path}: batch-order file version {version} / width {width} is not supported")
        return cls(T, B, ga, ws, rank, seed, n, width)

    def mismatch(self, other: "OrderHeader") -> List[str]:
        """What differs in the fields that decide which batches a run sees (not the seed: replay ignores it)."""
        names = ("block_size", "batch_size", "grad_accum", "world_size", "rank", "n_tokens")
        return [f"{n}: file {getattr(self, n)} vs run {getattr(other, n)}" for n in names
                if getattr(self, n) != getattr(other, n)]


def order_paths(base: Union[str, Path], world_size: int = 1) -> List[Path]:
    """The file of each rank: base itself for one rank, else base with '.rank<r>' before its suffix."""
    base = Path(base)
    if world_size == 1:
        return [base]
    return [base.with_name(f"{base.stem}.rank{r}{base.suffix}") for r in range(world_size)]


def read_header(path: Path) -> OrderHeader:
    with open(path, "rb") as f:
        return OrderHeader.unpack(f.read(HEADER_BYTES), path)


class OrderReader:
    """Replay side: the recorded offsets, memory-mapped."""

    def __init__(self, path: Union[str, Path], expect: OrderHeader):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"data.replay: {self.path} does not exist")
        self.header = read_header(self.path)
        diff = self.header.mismatch(expect)
        if diff:
            raise DataError(f"data.replay: {self.path} was recorded for another run shape ({'; '.join(diff)}); "
                            "replay needs the same block_size, batch_size, grad_accum, world size and corpus")
        body = self.path.stat().st_size - HEADER_BYTES
        self.n_steps = body // self.header.step_bytes
        self._data = (np.memmap(self.path, dtype=self.header.dtype, mode="r", offset=HEADER_BYTES,
                                shape=(self.n_steps, self.header.grad_accum, self.header.batch_size))
                      if self.n_steps else None)

    def offsets(self, step: int, micro: int) -> np.ndarray:
        if step >= self.n_steps:
            raise DataError(f"data.replay: {self.path} holds {self.n_steps} steps; the run asked for step {step} "
                            f"(0-based). Replay a file recorded for at least as many steps.")
        return np.asarray(self._data[step, micro], dtype=np.int64)

    def check_covers(self, n_steps: int) -> None:
        if n_steps > self.n_steps:
            raise DataError(f"data.replay: {self.path} holds {self.n_steps} steps, shorter than the run's "
                            f"{n_steps} steps")


class OrderWriter:
    """Record side: appends whole steps, flushed; on resume at step k keeps the first k steps and goes on."""

    def __init__(self, path: Union[str, Path], header: OrderHeader, start_step: int = 0):
        self.path = Path(path)
        self.header = header
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step > 0 and self.path.is_file():
            old = read_header(self.path)
            diff = old.mismatch(header) + ([f"seed: file {old.seed} vs run {header.seed}"]
                                          if old.seed != header.seed else [])
            if diff:
                raise DataError(f"resume: batch-order file {self.path} belongs to another run ({'; '.join(diff)})")
            have = (self.path.stat().st_size - HEADER_BYTES) // header.step_bytes
            self.n_steps = min(have, start_step)
            self._f = open(self.path, "r+b")
            self._f.truncate(HEADER_BYTES + self.n_steps * header.step_bytes)
            self._f.seek(0, os.SEEK_END)
        else:
            self._f = open(self.path, "wb")
            self._f.write(header.pack())
            self._f.flush()
            self.n_steps = 0

    def append(self, offsets: np.ndarray) -> None:
        """offsets: (grad_accum, batch_size) of the next step."""
        arr = np.ascontiguousarray(offsets, dtype=self.header.dtype)
        assert arr.size == self.header.step_items
        self._f.write(arr.tobytes())
        self._f.flush()
        self.n_steps += 1

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
