"""The batch-order file: which offsets each (step, micro_step) of one DDP rank read.

Layout (little endian): a 64-byte header
    magic b"FFORDER1", version u16, offset width u16 (4 or 8 bytes), block_size u32, batch_size u32, grad_accum u32,
    world_size u32, rank u32, seed u64, n_tokens u64 (length of the train.bin it indexes), then (version 2) crc32 u32
    of the first `covered` steps' bytes and covered u64, zero padding
then, per step, grad_accum * batch_size offsets (uint32 when the bin has < 2**32 tokens, else uint64).
Steps are appended and flushed as they happen, and the header's checksum is brought up to date after each, so a crash
keeps every whole step written before it; steps past `covered` (a partial trailing step, or the one step a crash
wrote before its header update) are ignored on reading and cut on resume. Reading checks the checksum (a file whose
offsets were changed is refused, naming it) and that every offset lies inside the corpus, before the first step.
Version-1 files (no checksum) are still read, unverified. One file per rank: `order_paths(base, world_size)`.

Past the recorded end: the seeded order is a pure function (`seeded_offsets`) of the header's seed, rank and corpus
size and of the step, so with past_end="regenerate" a replay asks it for the steps the file does not hold, once the
function is checked to reproduce every recorded step (a file recorded from another order, e.g. a fork that replayed
another seed's batches, is refused, naming the first step that differs). A fork can then run as long as it needs.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

import numpy as np

from flash_forensics.orchestrator.data.config import PAST_END, DataError

log = logging.getLogger(__name__)

MAGIC = b"FFORDER1"
VERSION = 2
_HEAD = struct.Struct("<8sHHIIIIIQQ")
_SUM = struct.Struct("<IQ")  # crc32, covered steps: right after _HEAD
HEADER_BYTES = 64


def seeded_offsets(seed: int, step: int, micro: int, rank: int, n_tokens: int, block_size: int,
                   batch_size: int) -> np.ndarray:
    """The batch_size window starts of (step, micro, rank) under `seed`: the seeded batch order (batches.py)."""
    rng = np.random.default_rng([seed, step, micro, rank])
    return rng.integers(0, n_tokens - block_size, size=batch_size, dtype=np.int64)


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
    version: int = VERSION
    crc: int = 0  # crc32 of the first `covered` steps (version 2)
    covered: int = 0

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
                         self.world_size, self.rank, self.seed, self.n_tokens) + _SUM.pack(self.crc, self.covered)
        return raw.ljust(HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes, path: Path) -> "OrderHeader":
        if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
            raise DataError(f"{path} is not a batch-order file (bad or missing header)")
        magic, version, width, T, B, ga, ws, rank, seed, n = _HEAD.unpack(raw[:_HEAD.size])
        if version not in (1, VERSION) or width not in (4, 8):
            raise DataError(f"{path}: batch-order file version {version} / width {width} is not supported")
        crc, covered = _SUM.unpack(raw[_HEAD.size:_HEAD.size + _SUM.size]) if version >= 2 else (0, 0)
        return cls(T, B, ga, ws, rank, seed, n, width, version, crc, covered)

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
    """Replay side: the recorded offsets, memory-mapped; past their end, with past_end="regenerate", the seeded
    order of the file's own seed (module docstring)."""

    def __init__(self, path: Union[str, Path], expect: OrderHeader, past_end: str = "refuse"):
        if past_end not in PAST_END:
            raise DataError(f"data.replay_past_end={past_end!r} is not allowed: expected one of {', '.join(PAST_END)}")
        self.past_end = past_end
        self._seeded: Optional[str] = None  # "" once checked equal to the seeded order, else why not
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"data.replay: {self.path} does not exist")
        self.header = read_header(self.path)
        diff = self.header.mismatch(expect)
        if diff:
            raise DataError(f"data.replay: {self.path} was recorded for another run shape ({'; '.join(diff)}); "
                            "replay needs the same block_size, batch_size, grad_accum, world size and corpus")
        h = self.header
        body = self.path.stat().st_size - HEADER_BYTES
        self.n_steps = body // h.step_bytes
        if h.version >= 2:
            if h.covered > self.n_steps:
                raise DataError(f"data.replay: {self.path} is damaged: its header covers {h.covered} steps, the file "
                                f"holds {self.n_steps}")
            self.n_steps = h.covered
            with open(self.path, "rb") as f:
                f.seek(HEADER_BYTES)
                crc, left = 0, self.n_steps * h.step_bytes
                while left:
                    chunk = f.read(min(left, 1 << 22))
                    crc, left = zlib.crc32(chunk, crc), left - len(chunk)
            if crc != h.crc:
                raise DataError(f"data.replay: {self.path} is damaged: its offsets do not match the checksum in its "
                                f"header (crc32 {crc:08x} vs {h.crc:08x}); replay the run's own recorded file")
        else:
            log.warning("data.replay: %s is a version-1 batch order (no checksum): replayed unverified", self.path)
        self._data = (np.memmap(self.path, dtype=h.dtype, mode="r", offset=HEADER_BYTES,
                                shape=(self.n_steps, h.grad_accum, h.batch_size))
                      if self.n_steps else None)
        if self.n_steps:  # every window [o, o + block_size + 1) inside the corpus, before the first step
            top = int(self._data.max())
            if top + h.block_size + 1 > h.n_tokens:
                bad = int(np.argmax(self._data.reshape(self.n_steps, -1).max(axis=1) + h.block_size + 1 > h.n_tokens))
                raise DataError(f"data.replay: {self.path} holds offset {top} (first at step {bad}), past the end of "
                                f"the corpus ({h.n_tokens} tokens, block_size {h.block_size}): expected offsets <= "
                                f"{h.n_tokens - h.block_size - 1}")

    def offsets(self, step: int, micro: int) -> np.ndarray:
        if step >= self.n_steps:
            if self.past_end != "regenerate":
                raise DataError(f"data.replay: {self.path} holds {self.n_steps} steps; the run asked for step {step} "
                                f"(0-based). Replay a file recorded for at least as many steps, or continue its "
                                f"seeded order with data.replay_past_end=regenerate.")
            self.check_covers(step + 1)
            h = self.header
            return seeded_offsets(h.seed, step, micro, h.rank, h.n_tokens, h.block_size, h.batch_size)
        return np.asarray(self._data[step, micro], dtype=np.int64)

    def seeded_mismatch(self) -> str:
        """'' when every recorded step is the seeded order of the header's seed (so steps past the end can be
        regenerated), else which step differs. Computed once (~15 us a micro-batch)."""
        if self._seeded is None:
            h, why = self.header, ""
            for step in range(self.n_steps):
                for micro in range(h.grad_accum):
                    want = seeded_offsets(h.seed, step, micro, h.rank, h.n_tokens, h.block_size, h.batch_size)
                    if not np.array_equal(np.asarray(self._data[step, micro], dtype=np.int64), want):
                        why = (f"its step {step} (micro-batch {micro}) is not the seeded order of its seed {h.seed}: "
                               f"the file was recorded from another order (a replay of another seed's batches?)")
                        break
                if why:
                    break
            self._seeded = why
        return self._seeded

    def regenerates(self, n_steps: int) -> bool:
        """True when a run of n_steps goes past the recorded end and the steps past it are regenerated."""
        return n_steps > self.n_steps and self.past_end == "regenerate" and not self.seeded_mismatch()

    def check_covers(self, n_steps: int) -> None:
        if n_steps <= self.n_steps:
            return
        if self.past_end != "regenerate":
            raise DataError(f"data.replay: {self.path} holds {self.n_steps} steps, shorter than the run's "
                            f"{n_steps} steps (data.replay_past_end=refuse; `regenerate` continues the file's seeded "
                            f"order past its end)")
        why = self.seeded_mismatch()
        if why:
            raise DataError(f"data.replay: {self.path} holds {self.n_steps} steps, shorter than the run's "
                            f"{n_steps} steps, and the steps past its end cannot be regenerated: {why}")


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
            if old.version >= 2:
                have = min(have, old.covered)
            self.n_steps = min(have, start_step)
            self._f = open(self.path, "r+b")
            self._f.truncate(HEADER_BYTES + self.n_steps * header.step_bytes)
            self._f.seek(HEADER_BYTES)
            crc, left = 0, self.n_steps * header.step_bytes
            while left:
                chunk = self._f.read(min(left, 1 << 22))
                crc, left = zlib.crc32(chunk, crc), left - len(chunk)
            self._crc = crc
            self._write_header()
        else:
            self._f = open(self.path, "wb")
            self._crc = 0
            self.n_steps = 0
            self._f.write(header.pack())
            self._f.flush()

    def append(self, offsets: np.ndarray) -> None:
        """offsets: (grad_accum, batch_size) of the next step."""
        arr = np.ascontiguousarray(offsets, dtype=self.header.dtype)
        assert arr.size == self.header.step_items
        raw = arr.tobytes()
        self._f.write(raw)
        self._crc = zlib.crc32(raw, self._crc)
        self.n_steps += 1
        self._write_header()

    def _write_header(self) -> None:
        """The checksum and step count after the body they cover (a crash in between loses one step, not the file)."""
        from dataclasses import replace
        self._f.flush()
        self._f.seek(0)
        self._f.write(replace(self.header, crc=self._crc, covered=self.n_steps).pack())
        self._f.seek(0, os.SEEK_END)
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
