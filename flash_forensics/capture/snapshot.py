"""The attention snapshot file: one attention call's tensors and where they came from, as one safetensors file.

Tensors (heads are the captured subset, in the order of `meta["heads"]`):
    q, k, v, o   (B, h, T, D)  as the kernel saw and returned them (k, v repeated for GQA)
    do           (B, h, T, D)  the backward's incoming gradient dL/dO (absent when no backward ran)
    lse          (B, h, T)     FP32 log-sum-exp, when the implementation exposes it
    x            (B, T, C)     the layer's input as its Q projection's GEMM saw it (our GPT; optional)
    w_q          (h, D, C)     the captured heads' W_Q blocks (optional; with x: the W_Q gradient-error projection)
Metadata (safetensors' string header): `format` = FORMAT, `format_version`, `meta` (JSON: recipe, knobs, family,
layer, heads, n_head, step, dtypes, device, versions, git commit, ...) and `content_sha256`, a hash of the meta JSON
and of every tensor's name, dtype, shape and bytes: a file edited after writing is refused.

`write` states the size before writing and refuses past `max_bytes`; it writes a temporary file in the target's
folder, fsyncs it and renames it into place, so a reader never sees half a file. `read` refuses, with one message
naming what is wrong (SnapshotError), a missing, truncated, foreign, tampered or inconsistent file.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, Optional

import torch

from flash_forensics.orchestrator.data.cache import atomic_write

FORMAT = "flash-forensics.capture"
FORMAT_VERSION = 1
MiB = 1 << 20
DEFAULT_MAX_BYTES = 64 * MiB
REQUIRED = ("q", "k", "v", "o")
OPTIONAL = ("do", "lse", "x", "w_q", "dq", "dk", "dv")  # dq, dk, dv: the kernel's own gradients for dO
_HEADER_LIMIT = 100 * MiB  # a safetensors header longer than this is not one (the library's own limit)


class SnapshotError(ValueError):
    """A capture that cannot be written or read; the message names the file and what is wrong."""


@dataclass
class Snapshot:
    """One captured attention call: tensors by name (REQUIRED + present OPTIONAL ones) and its meta dict."""

    tensors: Dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)

    def __getattr__(self, name):
        if name in REQUIRED + OPTIONAL:
            return self.tensors.get(name)
        raise AttributeError(name)

    @property
    def heads(self) -> list:
        return list(self.meta.get("heads") or range(self.tensors["q"].shape[1]))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


# ------------------------------------------------------------------------------------------------ provenance
@lru_cache(maxsize=1)
def git_commit() -> Optional[str]:
    """The checkout's commit (with '-dirty' when its tracked files differ), None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict:
    """torch, triton (installed version, not imported), safetensors, python."""
    from importlib import metadata
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for pkg in ("triton", "safetensors", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def device_name(t: torch.Tensor) -> str:
    if t.device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(t.device)}"
    return str(t.device)


# ------------------------------------------------------------------------------------------------ the hash
def content_hash(tensors: Dict[str, torch.Tensor], meta_json: str) -> str:
    h = hashlib.sha256()
    h.update(f"{FORMAT}\0{FORMAT_VERSION}\0".encode())
    h.update(meta_json.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"\0{name}\0{str(t.dtype)}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ checks
def check(snap: Snapshot, where: str) -> None:
    """Required tensors present, optional ones known, shapes consistent with q and with meta: SnapshotError."""
    t = snap.tensors
    missing = [n for n in REQUIRED if n not in t]
    listed = [n for n in snap.meta.get("tensors", []) if n not in t]
    if missing or listed:
        raise SnapshotError(f"{where}: missing tensor {', '.join(missing + listed)} (a capture holds "
                            f"{', '.join(REQUIRED)} and, when captured, {', '.join(OPTIONAL)}; this file holds "
                            f"{', '.join(sorted(t)) or 'none'})")
    unknown = sorted(set(t) - set(REQUIRED + OPTIONAL))
    if unknown:
        raise SnapshotError(f"{where}: unknown tensor {', '.join(unknown)} (allowed: {', '.join(REQUIRED + OPTIONAL)})")
    q = t["q"]
    if q.dim() != 4 or any(n == 0 for n in q.shape):
        raise SnapshotError(f"{where}: q has shape {tuple(q.shape)}; expected (B, heads, T, D) with every dim > 0")
    B, h, T, D = q.shape
    want = {"k": (B, h, T, D), "v": (B, h, T, D), "o": (B, h, T, D), "do": (B, h, T, D), "lse": (B, h, T)}
    if "x" in t:
        want["x"] = (B, T, t["x"].shape[-1] if t["x"].dim() == 3 else -1)
        if "w_q" in t:
            want["w_q"] = (h, D, want["x"][2])
    elif "w_q" in t:
        want["w_q"] = (h, D, t["w_q"].shape[-1] if t["w_q"].dim() == 3 else -1)
    for name, shape in want.items():
        if name in t and tuple(t[name].shape) != shape:
            raise SnapshotError(f"{where}: mismatched shapes: {name} is {tuple(t[name].shape)}, expected {shape} "
                                f"(q is {tuple(q.shape)})")
    heads = snap.meta.get("heads")
    if heads is not None and len(heads) != h:
        raise SnapshotError(f"{where}: mismatched shapes: meta lists {len(heads)} heads ({heads}), the tensors "
                            f"hold {h}")
    _check_heads(heads, snap.meta.get("n_head"), where)
    for name in ("q", "k", "v", "o", "do"):
        if name in t and not t[name].is_floating_point():
            raise SnapshotError(f"{where}: {name} has dtype {t[name].dtype}; expected a floating-point tensor")


def _check_heads(heads, n_head, where: str) -> None:
    """meta's head numbers name the tensors' heads: distinct integers in [0, n_head) (a head the model lacks, or one
    listed twice, would be analysed and reported under a number no tensor holds)."""
    if heads is None:
        return
    bad = [x for x in heads if isinstance(x, bool) or not isinstance(x, int) or x < 0]
    if bad or len(set(heads)) != len(heads):
        raise SnapshotError(f"{where}: meta heads={heads}: expected distinct head numbers >= 0")
    if isinstance(n_head, int) and any(x >= n_head for x in heads):
        raise SnapshotError(f"{where}: meta heads={heads} names head {max(heads)}, but meta n_head={n_head}: "
                            f"expected head numbers 0..{n_head - 1}")


# ------------------------------------------------------------------------------------------------ write
def _encode(snap: Snapshot) -> tuple:
    from safetensors.torch import save
    tensors, seen = {}, set()
    for n, x in snap.tensors.items():  # safetensors refuses tensors sharing storage: copy those
        x = x.detach().contiguous().cpu()
        ptr = x.untyped_storage().data_ptr()
        tensors[n] = x.clone() if ptr in seen else x
        seen.add(ptr)
    meta = {**snap.meta, "tensors": sorted(tensors)}
    meta_json = json.dumps(meta, sort_keys=True, default=str)
    header = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "meta": meta_json,
              "content_sha256": content_hash(tensors, meta_json)}
    return save(tensors, metadata=header), meta


def write(path, snap: Snapshot, max_bytes: int = DEFAULT_MAX_BYTES, say=print) -> Path:
    """Write `snap` to `path` atomically; refuse (SnapshotError, nothing written) when it exceeds `max_bytes`.
    `say` (print by default; None: silent) gets one line with the size before anything is written."""
    path = Path(path)
    check(snap, str(path))
    lower = snap.nbytes()
    if lower > max_bytes:  # refuse before serialising a huge capture
        raise SnapshotError(_too_large(path, lower, max_bytes))
    data, meta = _encode(snap)
    if len(data) > max_bytes:
        raise SnapshotError(_too_large(path, len(data), max_bytes))
    if say is not None:
        say(f"[capture] writing {path} ({len(data) / MiB:.2f} MiB, cap {max_bytes / MiB:.0f} MiB): "
            f"{meta.get('family')} layer {meta.get('layer')} heads {meta.get('heads')} step {meta.get('step')}")
    atomic_write(path, data)  # temp file, fsync, rename: readers see no half-written capture
    try:  # the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path


def _size(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB // 10 else f"{n} bytes"


def _too_large(path, size: int, cap: int) -> str:
    return (f"{path}: the capture would be {_size(size)}, over the cap of {_size(cap)} "
            f"(max_bytes / monitor.capture.max_mib): capture fewer heads or a smaller batch, or raise the cap")


# ------------------------------------------------------------------------------------------------ read
def _header(path: Path) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SnapshotError(f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte header "
                                "length)")
        n = struct.unpack("<Q", head)[0]
        first = f.read(2)
        if n > _HEADER_LIMIT or n < 2 or first[:1] != b"{":
            raise SnapshotError(f"{path}: not a safetensors file (its first 8 bytes do not give a JSON header "
                                "length)")
        if 8 + n > size:
            raise SnapshotError(f"{path}: truncated: its header declares {n} bytes, the file has {size - 8} after "
                                "the length")
        f.seek(8)
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SnapshotError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise SnapshotError(f"{path}: not a safetensors file (its header is not a JSON object)")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    data = size - 8 - n
    if ends and max(ends) > data:
        raise SnapshotError(f"{path}: truncated: its header declares {max(ends)} bytes of tensor data, the file "
                            f"holds {data}")
    if ends and max(ends) < data:
        raise SnapshotError(f"{path}: damaged: {data - max(ends)} bytes past the tensor data its header declares")
    return header


def read(path) -> Snapshot:
    """The capture at `path`, checked (SnapshotError naming the file and what is wrong otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"{path}: no such file")
    header = _header(path)
    md = header.get("__metadata__") or {}
    names = sorted(k for k in header if k != "__metadata__")
    if md.get("format") != FORMAT:
        raise SnapshotError(f"{path}: foreign file: a safetensors file, but not a flash-forensics capture (its "
                            f"metadata has no format={FORMAT!r}; it holds {', '.join(names[:8]) or 'no tensors'}"
                            f"{', ...' if len(names) > 8 else ''})")
    if md.get("format_version") != str(FORMAT_VERSION):
        raise SnapshotError(f"{path}: unknown format version {md.get('format_version')!r} (this flash-forensics "
                            f"reads version {FORMAT_VERSION}); analyze it with the version that wrote it")
    try:
        meta = json.loads(md.get("meta", ""))
    except json.JSONDecodeError:
        raise SnapshotError(f"{path}: tampered: its meta is not JSON") from None
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise SnapshotError(f"{path}: damaged safetensors data ({str(e).splitlines()[0][:200]})") from None
    snap = Snapshot(tensors, meta)
    check(snap, str(path))  # the most specific message first: a missing tensor or a shape that does not fit
    if content_hash(tensors, md["meta"]) != md.get("content_sha256"):
        raise SnapshotError(f"{path}: tampered: its content hash does not match (the tensors or the meta changed "
                            "after it was written)")
    return snap


__all__ = ["Snapshot", "SnapshotError", "write", "read", "check", "FORMAT", "FORMAT_VERSION", "DEFAULT_MAX_BYTES",
           "REQUIRED", "OPTIONAL", "git_commit", "versions", "content_hash"]
