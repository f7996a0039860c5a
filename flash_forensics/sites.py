"""Where a transformers model computes attention: every module that dispatches through transformers'
AttentionInterface, addressed by its module path (encoder-decoder and cross-attention models share layer numbers).

A *site* is one such module: the backend routes it, `use()` sets its knobs, the Monitor reads its counters.
- `attention_sites(model)`: the sites, in `model.named_modules()` order (encoder before decoder, a decoder layer's
  self-attention before its cross-attention). A module dispatches when its class (or a base class in transformers)
  calls `ALL_ATTENTION_FUNCTIONS` in its source: that is how every transformers 5 family reaches the
  implementation named by its config.
- `attention_like(model)`: modules that look like attention (class name ends in "Attention", no such child) but do
  not dispatch: they compute with their own code, whatever attn_implementation says (use() warns or refuses).
- Labels: "L<layer_idx>" where every site has a distinct layer_idx (decoder-only models: the orchestrator's metric
  names), else the module path.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import List, Optional

import torch

_DISPATCH = "ALL_ATTENTION_FUNCTIONS"  # transformers' attention-function table, looked up in each forward


@dataclass(frozen=True)
class Site:
    path: str                     # module path in model.named_modules(), e.g. "model.decoder.layers.0.encoder_attn"
    module: torch.nn.Module
    layer: Optional[int]          # the module's layer_idx (None where it has none)
    label: str                    # metric tag: "L3" where layer numbers are unique, else the path
    n_head: int                   # query heads


@functools.lru_cache(maxsize=None)
def dispatches(cls: type) -> bool:
    """True when `cls` or one of its bases (other than torch's) looks up transformers' attention table. Models
    (PreTrainedModel: its set_attn_implementation names the table) are not attention modules."""
    if any(k.__name__ == "PreTrainedModel" for k in cls.__mro__):
        return False
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        try:
            if _DISPATCH in inspect.getsource(klass):
                return True
        except (OSError, TypeError):  # no source (built in, or made in a REPL): cannot tell, so not routed
            continue
    return False


def _looks_like_attention(mod) -> bool:
    return type(mod).__name__.endswith("Attention")


def module_heads(mod, model) -> int:
    """A module's query heads: its own attribute where it has one (encoder and decoder may differ), else the
    config's."""
    for name in ("num_heads", "num_attention_heads", "n_head", "n_heads"):
        v = getattr(mod, name, None)
        if isinstance(v, int) and v > 0:
            return v
    for cfg in (getattr(mod, "config", None), getattr(model, "config", None)):
        for name in ("num_attention_heads", "n_head"):
            v = getattr(cfg, name, None)
            if isinstance(v, int) and v > 0:
                return v
    raise ValueError(f"{type(mod).__name__}: cannot tell its number of heads (no num_heads / num_attention_heads "
                     "attribute on the module or its config)")


def attention_sites(model) -> List[Site]:
    """Every module of `model` that dispatches through AttentionInterface (module docstring)."""
    found = [(path, mod) for path, mod in model.named_modules() if dispatches(type(mod))]
    layers = [getattr(mod, "layer_idx", None) for _, mod in found]
    unique = all(isinstance(i, int) for i in layers) and len(set(layers)) == len(layers)
    return [Site(path, mod, i if isinstance(i, int) else None, f"L{i}" if unique else path, module_heads(mod, model))
            for (path, mod), i in zip(found, layers)]


def attention_like(model) -> List[str]:
    """Paths of modules named like attention (innermost ones) that do not dispatch: not routable."""
    out = []
    for path, mod in model.named_modules():
        if not _looks_like_attention(mod) or dispatches(type(mod)):
            continue
        inner = [m for m in mod.modules() if m is not mod and (_looks_like_attention(m) or dispatches(type(m)))]
        if not inner:
            out.append(path)
    return out


__all__ = ["Site", "attention_sites", "attention_like", "dispatches", "module_heads"]
