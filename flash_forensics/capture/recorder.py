"""Capture: turn attention calls reported through flash_forensics.hooks into snapshot files.

`Recorder` is a hooks observer. For each call of a chosen layer (the first `calls_per_layer` calls of each) it keeps
detached copies of the chosen heads' q, k, v, o, lse and registers a tensor hook on o, so the backward's incoming
gradient dO is kept too when a backward runs. `flush()` writes one snapshot per kept call (snapshot.write: the size
is said first, the cap refuses). Nothing is written inside the forward or the backward.

`capture(...)` is the user's context manager; with `sdpa=True` it also wraps torch's own
`torch.nn.functional.scaled_dot_product_attention` (the real one computes, the wrapper reports the call), which is
what lets a user fingerprint the kernel their code really runs. Code that bound the function before the block
(`from torch.nn.functional import scaled_dot_product_attention`) is not seen.
"""
from __future__ import annotations

import datetime
import math
import numbers
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F

from flash_forensics.capture import snapshot as snap_io
from flash_forensics.hooks import AttentionCall, active, emit, observing
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.knobs import KNOBS
from flash_forensics.kernels.probes import tie_rows


@dataclass
class _Kept:
    tensors: Dict[str, torch.Tensor]
    meta: dict
    name: str
    do: List[torch.Tensor] = field(default_factory=list)


def knobs_of(values: Optional[dict]):
    """AttentionKnobs from a knob_values() dict (keys the table does not know are dropped); None for {} / None."""
    if not values:
        return None
    names = {r.name for r in KNOBS}
    return AttentionKnobs(**{k: v for k, v in values.items() if k in names})


def worst_heads(q: torch.Tensor, k: torch.Tensor, knobs, n: int) -> List[int]:
    """The n heads with the most tie rows (kernels.probes.tie_rows under `knobs`, paper_bf16 when None); one host
    read, at capture time only."""
    kn = knobs or AttentionKnobs(recipe="paper_bf16")
    with torch.no_grad():
        tie = tie_rows(q.detach(), k.detach(), kn)[0].sum(dim=(0, 2))
    order = sorted(range(q.shape[1]), key=lambda h: (-int(tie[h]), h))
    return sorted(order[:n])


class Recorder:
    """A hooks observer that keeps the chosen calls; `flush()` writes them and returns the paths written."""

    def __init__(self, out_dir="captures", layers: Optional[Sequence[int]] = None,
                 heads: Optional[Sequence[int]] = None, worst: Optional[int] = None, step: Optional[int] = None,
                 max_bytes: int = snap_io.DEFAULT_MAX_BYTES, calls_per_layer: int = 1, tag: str = "",
                 say: Optional[Callable[[str], None]] = print, extra_meta: Optional[dict] = None,
                 batch: Optional[int] = None):
        if heads is not None and worst is not None:
            raise ValueError("heads and worst are exclusive: name the heads, or ask for the `worst` N by tie count")
        for key, value in (("layers", layers), ("heads", heads)):
            if value is not None and (isinstance(value, (str, bytes)) or not all(
                    isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in value)):
                raise ValueError(f"capture {key}={value!r} is not allowed: expected a list of indices >= 0, or None")
        if worst is not None and (isinstance(worst, bool) or not isinstance(worst, numbers.Integral) or worst < 1):
            raise ValueError(f"capture worst={worst!r} is not allowed: expected an integer >= 1, or None")
        self.out_dir, self.layers = Path(out_dir), (None if layers is None else set(int(i) for i in layers))
        self.heads, self.worst, self.step = (None if heads is None else [int(h) for h in heads]), worst, step
        self.max_bytes, self.calls_per_layer, self.tag, self.say = max_bytes, calls_per_layer, tag, say
        self.extra_meta = dict(extra_meta or {})
        # the first `batch` sequences only: attention is per sequence, so the analysis of a slice is exact for it,
        # and a GPT-2-sized micro-batch (x alone is B*T*C) would not fit a file that must travel
        self.batch = None if batch is None else int(batch)
        self.inputs: Dict[int, tuple] = {}  # layer -> (x (B, T, C), W_Q (H, D, C)): set by whoever knows them
        self.kept: List[_Kept] = []
        self.paths: List[Path] = []
        self._seen: Dict[object, int] = {}
        self._calls = 0

    # ------------------------------------------------------------------------------------------ observing
    def __call__(self, call: AttentionCall) -> None:
        idx = self._calls
        self._calls += 1
        if self.layers is not None and call.layer not in self.layers:
            return
        key = call.layer if call.layer is not None else ("call", idx)
        if self._seen.get(key, 0) >= self.calls_per_layer:
            return
        self._seen[key] = self._seen.get(key, 0) + 1
        q = call.q
        H = q.shape[1]
        knobs = knobs_of(call.knobs)
        heads = self.heads if self.heads is not None else (
            worst_heads(q, call.k, knobs, self.worst) if self.worst else list(range(H)))
        bad = [h for h in heads if not 0 <= h < H]
        if bad:
            raise ValueError(f"capture heads={heads} is not allowed for layer {call.layer}: expected indices in "
                             f"0..{H - 1}")
        sel = torch.tensor(heads, device=q.device)

        rows = slice(0, self.batch)

        def pick(t):
            return t.detach()[rows].index_select(1, sel).contiguous().clone()

        tensors = {"q": pick(call.q), "k": pick(call.k), "v": pick(call.v), "o": pick(call.o)}
        if call.lse is not None:
            tensors["lse"] = pick(call.lse).float()
        if call.layer in self.inputs:
            x, w_q = self.inputs[call.layer]
            tensors["x"] = x.detach()[rows].contiguous().clone()
            tensors["w_q"] = w_q.detach().index_select(0, sel.to(w_q.device)).contiguous().clone()
        meta = self._meta(call, heads, H, idx)
        name = (f"{self.tag + '_' if self.tag else ''}{call.family}"
                + (f"_step{self.step}" if self.step is not None else "")
                + (f"_L{call.layer}" if call.layer is not None else f"_call{idx}")
                + (f"_{self._seen[key]}" if self.calls_per_layer > 1 else ""))
        kept = _Kept(tensors, meta, name)
        if call.o.requires_grad:
            call.o.register_hook(lambda g, kept=kept, sel=sel: kept.do.append(
                g.detach()[rows].index_select(1, sel).contiguous().clone()) or None)
        self.kept.append(kept)

    def _meta(self, call: AttentionCall, heads, H: int, idx: int) -> dict:
        q = call.q
        D = q.shape[-1]
        return {**self.extra_meta, "recipe": call.recipe or None, "knobs": dict(call.knobs or {}),
                "family": call.family, "layer": call.layer, "heads": list(heads), "n_head": H, "step": self.step,
                "call_index": idx, "implementation": call.implementation, "is_causal": bool(call.is_causal),
                "scale": float(call.scale) if call.scale is not None else D ** -0.5,
                "scale_default": call.scale is None or math.isclose(float(call.scale), D ** -0.5, rel_tol=1e-6),
                "shape": {"B": len(range(q.shape[0])[slice(0, self.batch)]), "H": H, "T": q.shape[2], "D": D},
                "batch_of": q.shape[0],
                "dtypes": {n: str(getattr(call, n).dtype).replace("torch.", "") for n in ("q", "k", "v", "o")},
                "device": snap_io.device_name(q), "versions": snap_io.versions(), "git_commit": snap_io.git_commit(),
                "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}

    # ------------------------------------------------------------------------------------------ writing
    def flush(self) -> List[Path]:
        """Write every kept call (dO attached when its backward ran) and forget them; returns the new paths."""
        out = []
        kept, self.kept = self.kept, []
        if not kept and self.say is not None and not self.paths:  # an empty capture is said, never silent
            self.say("[capture] nothing captured: " + (
                f"{self._calls} attention call(s) ran, none in layers={sorted(self.layers)} (calls through torch's "
                "SDPA carry no layer number: drop layers to keep them by call order)" if self._calls else
                "no attention call ran through flash_forensics in the block (a model on another attention; "
                "sdpa=True also wraps torch's scaled_dot_product_attention)"))
        for c in kept:
            tensors = dict(c.tensors)
            if c.do:
                tensors["do"] = c.do[0]
            meta = {**c.meta, "has_do": bool(c.do),
                    "dtypes": {**c.meta["dtypes"], **({"do": str(c.do[0].dtype).replace("torch.", "")} if c.do
                                                      else {})}}
            path = self.out_dir / f"{c.name}.safetensors"
            out.append(snap_io.write(path, snap_io.Snapshot(tensors, meta), self.max_bytes, say=self.say))
        self.paths += out
        return out


# ------------------------------------------------------------------------------------------------ torch SDPA
def _causal_mask(mask, Tq: int, Tk: int) -> bool:
    """Whether an SDPA attn_mask is exactly the causal lower triangle (bool, or 0/-inf additive)."""
    if not torch.is_tensor(mask) or mask.shape[-2:] != (Tq, Tk) or Tq != Tk:
        return False
    tri = torch.ones(Tq, Tk, dtype=torch.bool, device=mask.device).tril()
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if mask.dtype != torch.bool and not bool((torch.isneginf(mask) | (mask == 0)).all()):
        return False
    return bool((allowed == tri).all())


@contextmanager
def wrapping_sdpa(family: str = "sdpa") -> Iterator[None]:
    """While active, torch.nn.functional.scaled_dot_product_attention is torch's own, reporting each call to hooks
    (q, k, v repeated for GQA, the real O; causal when is_causal or the mask is the causal triangle)."""
    real = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
             **kw):
        extra = {"enable_gqa": enable_gqa} if enable_gqa else {}
        o = real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                 **extra, **kw)
        if active() and query.dim() == 4 and key.dim() == 4:
            k, v = key, value
            if k.shape[1] != query.shape[1]:  # GQA: the kernel's view of k, v is per query head
                rep = query.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            causal = bool(is_causal) or (attn_mask is not None and _causal_mask(attn_mask, query.shape[2],
                                                                                 k.shape[2]))
            emit(AttentionCall(query, k, v, o, None, recipe="", knobs={}, layer=None, family=family,
                               is_causal=causal, scale=scale,
                               implementation=f"torch-sdpa ({query.device.type}, dropout_p={dropout_p})"))
        return o

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


@contextmanager
def capture(out_dir="captures", *, layers: Optional[Sequence[int]] = None, heads: Optional[Sequence[int]] = None,
            worst: Optional[int] = None, step: Optional[int] = None, sdpa: bool = False,
            max_bytes: int = snap_io.DEFAULT_MAX_BYTES, calls_per_layer: int = 1, tag: str = "",
            say: Optional[Callable[[str], None]] = print) -> Iterator[Recorder]:
    """Capture the attention calls of the block (forward and backward) as snapshot files in `out_dir`.

        with flash_forensics.capture("captures", layers=[3], worst=2) as cap:
            loss = model(x).loss
            loss.backward()
        print(cap.paths)                     # then: flash-forensics analyze captures/<file>

    layers: layer indices to keep (None: every layer; SDPA calls have none and are kept by call order); heads: head
    indices, or `worst`: the N heads with the most tie rows; max_bytes: the per-file cap (default 64 MiB);
    sdpa=True: also wrap torch's own scaled_dot_product_attention. Files are written when the block ends normally.
    """
    rec = Recorder(out_dir, layers, heads, worst, step, max_bytes, calls_per_layer, tag, say)
    with observing(rec), (wrapping_sdpa() if sdpa else nullcontext()):
        yield rec
    rec.flush()


def write_call(path, q, k, v, o, do=None, lse=None, *, recipe: Optional[str] = None, knobs: Optional[dict] = None,
               family: str = "tensors", layer: Optional[int] = None, heads: Optional[Sequence[int]] = None,
               step: Optional[int] = None, x=None, w_q=None, implementation: str = "", is_causal: bool = True,
               max_bytes: int = snap_io.DEFAULT_MAX_BYTES, say: Optional[Callable[[str], None]] = None,
               dq=None, dk=None, dv=None, **meta):
    """Write one call's tensors directly (no hooks): a snapshot with the same meta a Recorder writes. dq, dk, dv:
    the kernel's own gradients for `do` (a real kernel's backward, fingerprinted like its forward)."""
    call = AttentionCall(q, k, v, o, lse, recipe or "", dict(knobs or {}), layer, family, is_causal, None,
                         implementation)
    rec = Recorder(Path(path).parent, heads=heads, step=step, max_bytes=max_bytes, say=say, extra_meta=meta)
    tensors = {"q": q, "k": k, "v": v, "o": o}
    for name, t in (("do", do), ("lse", lse), ("x", x), ("w_q", w_q), ("dq", dq), ("dk", dk), ("dv", dv)):
        if t is not None:
            tensors[name] = t.float() if name == "lse" else t
    m = rec._meta(call, list(heads) if heads is not None else list(range(q.shape[1])), q.shape[1], 0)
    m.update(has_do=do is not None, has_grads=dq is not None)
    for name, t in (("do", do), ("dq", dq), ("dk", dk), ("dv", dv)):
        if t is not None:
            m["dtypes"][name] = str(t.dtype).replace("torch.", "")
    if heads is not None and len(heads) != q.shape[1]:  # the tensors hold all heads: keep the named ones
        sel = torch.tensor(list(heads), device=q.device)
        tensors = {n: (t.index_select(0 if n == "w_q" else 1, sel.to(t.device)) if n != "x" else t)
                   for n, t in tensors.items()}
        m["n_head"] = q.shape[1]
    return snap_io.write(path, snap_io.Snapshot({n: t.detach() for n, t in tensors.items()}, m), max_bytes, say=say)


__all__ = ["Recorder", "capture", "wrapping_sdpa", "write_call", "worst_heads", "knobs_of"]
