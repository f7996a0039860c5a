"""transformers' `attn_implementation="forensics"`: every attention layer through the kernels' emulator.

Registered under one name with both of transformers' tables (`import flash_forensics` does it, lazily; see
flash_forensics/__init__.py):
- AttentionInterface: `attention_forward`, called by each attention module as eager/sdpa are;
- AttentionMaskInterface: `mask_interface`, transformers' SDPA bool mask (True = attend) always materialised
  (allow_is_causal_skip off). Without a mask entry transformers builds no mask at all and causality, padding and
  sliding windows would be lost; with it every layer gets its own mask (sliding-window layers theirs).

What a call honours, or refuses (never ignores): GQA (k, v arrive un-repeated: repeat_interleave, as repeat_kv),
`scaling` (GPT-2 passes its own, None = 1/sqrt(D)), padding and sliding windows (in the mask), is_causal without a
mask (Tq == Tk, or a single decoding query). Refused with a ValueError naming the argument: dropout > 0, softcap,
attention sinks (s_aux), position_bias, paged caches, output_attentions, a sliding window without a mask.

`use(model, recipe=..., overrides={layer_idx: {knob: value}}, **knobs)` sets each layer's knobs (kernels/knobs.py;
per head: o_fp32_heads) and gives it fresh counters (AttnStats of the query heads). A layer never set computes
the defaults (paper_bf16).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch

from flash_forensics import families
from flash_forensics.kernels.checks import is_int
from flash_forensics.kernels.config import AttentionConfig, AttentionKnobs, LayerOverride
from flash_forensics.kernels.stats import AttnStats
from flash_forensics.sdpa import attend, check_emulated, make_knobs

NAME = "forensics"  # not "flash_forensics": transformers takes every name containing "flash" for a flash-attn kernel
# kwargs some families pass that this backend cannot compute: refused when set (None / False is fine)
_REFUSED = {"softcap": "a logit softcap (Gemma 2)", "s_aux": "attention sinks (gpt-oss)",
            "position_bias": "a learned position bias (T5-style)", "head_mask": "a head mask"}


@dataclass
class LayerState:
    """What one attention module computes with and counts (device tensors; read by flash_forensics.monitor)."""

    knobs: AttentionKnobs
    stats: AttnStats
    probe: bool = False  # this forward also measures the attention entropy (an extra softmax pass, no grad)
    entropy_sum: Optional[torch.Tensor] = None  # (H,) FP32: sum over rows of each row's entropy, since the last reset
    entropy_rows: Optional[torch.Tensor] = None  # (H,) FP32: rows summed

    def reset(self) -> None:
        self.stats.reset()
        if self.entropy_sum is not None:
            self.entropy_sum.zero_()
            self.entropy_rows.zero_()


def layer_state(module, n_head: int, device) -> LayerState:
    st = getattr(module, "ff_state", None)
    if st is None:
        st = LayerState(make_knobs(), AttnStats(n_head, device))
        module.ff_state = st
    if st.stats.device != torch.device(device):  # the model moved: counters start fresh there
        st.stats = AttnStats(n_head, device)
        st.entropy_sum = st.entropy_rows = None
    return st


def _family(module) -> str:
    return str(getattr(getattr(module, "config", None), "model_type", "unknown"))


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention-function contract: q (B, H, Tq, D), k/v (B, Hk, Tk, D) -> ((B, Tq, H, D), None)."""
    where = f"{NAME} attention (layer {getattr(module, 'layer_idx', '?')}, {_family(module)})"
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: {name}={kwargs[name]!r} is not allowed: expected None ({what} is not "
                             "computed by the emulator)")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{where}: output_attentions=True is not allowed: expected False (flash attention keeps no "
                         "attention weights; use attn_implementation='eager' to read them)")
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise ValueError(f"{where}: a PagedAttentionCache is not allowed: expected a regular cache or none")
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout != 0:
        raise ValueError(f"{where}: dropout={dropout!r} is not allowed: expected 0.0 (set the config's attention "
                         "dropout, e.g. attention_dropout or GPT-2's attn_pdrop, to 0; the flash kernels have none)")
    H, Tq, Tk = query.shape[1], query.shape[2], key.shape[2]
    st = layer_state(module, H, query.device)
    mask, causal = attention_mask, False
    if mask is not None:
        if mask.dim() == 4 and mask.shape[-1] > Tk:  # a mask built for a longer cache: its first Tk keys (as eager)
            mask = mask[..., :Tk]
    else:
        wants_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if kwargs.get("sliding_window") is not None and wants_causal:
            raise ValueError(f"{where}: sliding_window={kwargs['sliding_window']} without an attention mask is not "
                             f"allowed: expected the mask of AttentionMaskInterface[{NAME!r}] (import flash_forensics "
                             "before building the model)")
        if wants_causal and Tq > 1:
            if Tq != Tk:
                raise ValueError(f"{where}: causal attention with Tq={Tq} != Tk={Tk} and no mask is not allowed: "
                                 f"expected the mask of AttentionMaskInterface[{NAME!r}]")
            causal = True
    o = attend(query, key, value, st.knobs, attn_mask=mask, dropout_p=0.0, is_causal=causal, scale=scaling,
               enable_gqa=key.shape[1] != H, stats=st.stats if st.knobs.counters else None,
               layer=getattr(module, "layer_idx", None), family=_family(module))
    if st.probe:
        _entropy(st, query, key, mask, causal, scaling)
    return o.transpose(1, 2).contiguous(), None


@torch.no_grad()
def _entropy(st: LayerState, q, k, mask, causal: bool, scaling) -> None:
    """Add each row's softmax entropy (nats, FP32, the exact softmax of the call's scores) to st, per head."""
    H, D = q.shape[1], q.shape[-1]
    k = k.repeat_interleave(H // k.shape[1], dim=1) if k.shape[1] != H else k
    scale = D ** -0.5 if scaling is None else float(scaling)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    Tq, Tk = s.shape[-2:]
    if causal:
        s = s.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    elif mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    live = torch.isfinite(s).any(dim=-1)  # rows with a key (B, H, Tq)
    p = torch.softmax(s, dim=-1)
    ent = torch.where(live, -torch.special.xlogy(p, p).sum(dim=-1), torch.zeros((), device=s.device))
    if st.entropy_sum is None or st.entropy_sum.device != s.device:
        st.entropy_sum = torch.zeros(H, dtype=torch.float32, device=s.device)
        st.entropy_rows = torch.zeros(H, dtype=torch.float32, device=s.device)
    st.entropy_sum.add_(ent.sum(dim=(0, 2)))
    st.entropy_rows.add_(live.sum(dim=(0, 2)).float())


def mask_interface(*args, **kwargs):
    """transformers' SDPA mask, always materialised: a bool (B, 1, Tq, Tk), True = attend (or None for full
    bidirectional attention, which needs none)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_attention(modeling_utils=None) -> None:
    if modeling_utils is None:
        import transformers.modeling_utils as modeling_utils
    modeling_utils.AttentionInterface.register(NAME, attention_forward)


def register_mask(masking_utils=None) -> None:
    if masking_utils is None:
        import transformers.masking_utils as masking_utils
    masking_utils.AttentionMaskInterface.register(NAME, mask_interface)


def _overrides(overrides, n_layer: int):
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise ValueError(f"overrides={type(overrides).__name__} is not allowed: expected a dict {{layer_idx: "
                         "{knob: value}}, e.g. {2: {'pv_fp32': True}, 3: {'o_fp32_heads': [0, 5]}}")
    out = []
    for layer, patch in overrides.items():
        if not is_int(layer, 0, n_layer - 1):
            raise ValueError(f"overrides key {layer!r} is not allowed: expected a layer_idx in 0..{n_layer - 1}")
        if not isinstance(patch, Mapping):
            raise ValueError(f"overrides[{layer}]={patch!r} is not allowed: expected a dict {{knob: value}}")
        try:
            out.append(LayerOverride(layers=[layer], **dict(patch)))
        except TypeError:
            names = [f for f in AttentionKnobs.__dataclass_fields__]
            unknown = sorted(set(patch) - set(names))
            raise ValueError(f"overrides[{layer}]: unknown knob(s) {unknown}; allowed: {', '.join(names)}") from None
    return out


def use(model, recipe: str = "paper_bf16", overrides: Optional[Dict[int, dict]] = None, **knobs):
    """Set the recipe and knobs of every attention layer of a transformers model built with
    attn_implementation="forensics" (`overrides`: {layer_idx: {knob: value}}, later wins; per head:
    o_fp32_heads). Validates everything before changing anything; fresh counters per layer. Returns the model."""

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != NAME:
        raise ValueError(f"model.config._attn_implementation={impl!r} is not allowed: expected {NAME!r} (build the "
                         f"model with attn_implementation={NAME!r}, or call model.set_attn_implementation({NAME!r}))")
    layers = families.attention_layers(model)
    H = families.n_heads(model)
    base = make_knobs(recipe, key="use", **knobs)
    cfg = AttentionConfig(**base.knob_values(), overrides=_overrides(overrides, len(layers)))
    try:
        cfg.validate(H, key="use", n_layer=len(layers))
    except ValueError as e:  # AttentionConfig names an override by its list index; use() takes them by layer
        by_layer = [ov.layers[0] for ov in cfg.overrides]
        raise ValueError(re.sub(r"use\.overrides\[(\d+)\]", lambda m: f"use.overrides[{by_layer[int(m[1])]}]",
                                str(e))) from None
    per_layer = [check_emulated(cfg.for_layer(i), key=f"use.overrides[{i}]" if overrides and i in overrides
                                else "use") for i in range(len(layers))]
    device = next(model.parameters()).device
    for mod, k in zip(layers, per_layer, strict=True):
        mod.ff_state = LayerState(k, AttnStats(H, device))
    return model


def layer_states(model):
    """Each attention layer's LayerState (created with the defaults where `use` was never called)."""

    device = next(model.parameters()).device
    H = families.n_heads(model)
    return [layer_state(m, H, device) for m in families.attention_layers(model)]


__all__ = ["NAME", "use", "attention_forward", "mask_interface", "register_attention", "register_mask",
           "LayerState", "layer_states"]
