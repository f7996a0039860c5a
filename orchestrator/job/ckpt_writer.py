"""Periodic checkpoints written behind the step loop (train.ckpt_async).

A GPT-2S checkpoint (weights and AdamW moments, 1.5 GB) stalled the paper regime's baseline for ~6 s on an H200:
torch.save, its sha256 and fsync, then the separate last.pt copy. 34 of them were 201 s of an 838 s baseline
(results/FINDINGS.md, section 2). Here the step loop only copies the state into host memory: page-locked buffers
kept from one checkpoint to the next, the copy queued on the current CUDA stream behind the step that made the state,
so the loop does not wait for it. A thread waits for the copy, then writes the files exactly as the synchronous path
does (atomic, checksummed: orchestrator/job/checkpoint.py). The write still uses the host's cores and disk: on a
2-core CPU, work beside it ran at 0.35 of its rate, so a checkpoint cost 0.57 of writing it in the loop
(results/bench/checkpoint-write-cpu.json; not yet measured on a GPU).

One write at a time: the next checkpoint, every other save, the run's end and each failure path wait for it first,
and a write that failed raises there (or at the next step, `check`). A kill -9 leaves what it left before, the
newest complete file; during a write that is the checkpoint one interval older.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


class HostSnapshot:
    """A deep copy of a checkpoint's state with every tensor in host memory, in buffers kept per position in the
    state and reused by the next snapshot (allocating 1.5 GB, page-locked or not, costs more than the copy: on a
    2-core CPU the first copy took 0.7-7.7 s, mostly page faults, the next ones 0.09-0.16 s). CUDA tensors go to
    page-locked buffers without a host sync; the returned events say when they are there. CPU tensors are copied
    too: the optimizer updates the originals in place. A snapshot's tensors are valid until the next one is taken."""

    def __init__(self):
        self._buffers: Dict[Tuple, torch.Tensor] = {}

    def _host(self, t: torch.Tensor, where: Tuple) -> torch.Tensor:
        t = t.detach()
        cuda = t.device.type == "cuda"
        buf = self._buffers.get(where)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:  # contiguous: load_state_dict copies values
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
            self._buffers[where] = buf
        buf.copy_(t, non_blocking=cuda)
        return buf

    def take(self, state: Any) -> Tuple[Any, List["torch.cuda.Event"]]:
        """(the copy, the events to wait on before reading it: one per CUDA device its tensors came from)."""
        memo: Dict[int, Any] = {}  # deepcopy's memo: each tensor (shared ones once) already mapped to its copy
        same: Dict[Tuple, torch.Tensor] = {}  # one copy per view: tied weights are two objects over one memory
        devices = set()

        def visit(obj, where):
            if isinstance(obj, torch.Tensor):
                if id(obj) not in memo:
                    view = (obj.device, obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride())
                    if view not in same:  # torch.save then writes a shared storage once, as it did the originals
                        same[view] = self._host(obj, where)
                    memo[id(obj)] = same[view]
                    if obj.device.type == "cuda":
                        devices.add(obj.device)
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    visit(v, (*where, k))
            elif isinstance(obj, (list, tuple)):
                for i, v in enumerate(obj):
                    visit(v, (*where, i))

        visit(state, ())
        out = copy.deepcopy(state, memo)  # containers and plain values copied: the detector keeps mutating its own
        events = []
        for dev in devices:  # each copy is queued on its own device's current stream (a job on cuda:1 sets no device)
            with torch.cuda.device(dev):
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
            events.append(ev)
        return out, events


class CheckpointWriter:
    """At most one checkpoint write in flight, on a thread. `submit` waits for the one before, snapshots the state
    and returns; `wait` joins and raises what the write raised; `check` raises it only once the write has ended."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._snapshot = HostSnapshot()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[Any], None], state: Any) -> None:
        self.wait()
        host, events = self._snapshot.take(state)

        def run():
            try:
                for ev in events:
                    ev.synchronize()
                write(host)
            except BaseException as e:  # raised in the step loop by wait/check, never lost with the thread
                self._error = e

        # not a daemon: a run that ends without waiting (an uncaught error) still finishes its file before exit
        self._thread = threading.Thread(target=run, name="ff-checkpoint-writer", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:  # joined before it is forgotten: a ^C in the join leaves it to settle()
            self._thread.join()
        self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err

    def check(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def settle(self) -> Optional[BaseException]:
        """On a failing path: wait, and return the write's error instead of raising it."""
        try:
            self.wait()
        except BaseException as e:
            return e
        return None


__all__ = ["CheckpointWriter", "HostSnapshot"]
