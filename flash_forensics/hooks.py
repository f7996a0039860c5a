"""Observers of attention calls: what capture (and anything else that watches a call) subscribes to.

The drop-in (`flash_forensics.attention`), the transformers backend and our own GPT's attention layers report each
call here after computing it; with no observer registered a call costs one list check (no tensor is touched).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional

import torch


@dataclass
class AttentionCall:
    """One attention call as its caller saw it: inputs as the kernel stored them, its output, and where it ran.

    q, k, v: (B, H, T, D) as passed to the kernel (k, v already repeated for GQA when the kernel needs that);
    o: (B, H, Tq, D), the call's output (still attached to autograd: an observer may register a hook on it for dO);
    lse: (B, H, Tq) FP32 log-sum-exp when the implementation exposes it, else None.
    """
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    lse: Optional[torch.Tensor]
    recipe: str
    knobs: dict = field(default_factory=dict)   # the knob values that computed this call (AttentionKnobs.knob_values())
    layer: Optional[int] = None
    family: str = "unknown"                     # model family (gpt, llama, qwen3, mistral, gpt2, sdpa)
    is_causal: bool = False
    scale: Optional[float] = None
    implementation: str = ""                    # what computed it: emulator, triton, torch-sdpa, ...


Observer = Callable[[AttentionCall], None]
_observers: List[Observer] = []


def active() -> bool:
    """True when someone observes attention calls (callers skip building an AttentionCall otherwise)."""
    return bool(_observers)


def emit(call: AttentionCall) -> None:
    for obs in list(_observers):
        obs(call)


@contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Register `observer` for the duration of the block."""
    _observers.append(observer)
    try:
        yield observer
    finally:
        _observers.remove(observer)
