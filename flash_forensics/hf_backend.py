"""transformers' `attn_implementation="forensics"`: every attention layer through the kernels' emulator.

Registered under one name with both of transformers' tables (`import flash_forensics` does it, lazily; see
flash_forensics/__init__.py):
- AttentionInterface: `attention_forward`, called by each attention module as eager/sdpa are;
- AttentionMaskInterface: `mask_interface`, transformers' SDPA bool mask (True = attend) always materialised
  (allow_is_causal_skip off). Without a mask entry transformers builds no mask at all and causality, padding and
  sliding windows would be lost; with it every layer gets its own mask (sliding-window layers theirs).

What a call honours, or refuses (never ignores): GQA (k, v arrive un-repeated: repeat_interleave, as repeat_kv),
`scaling` (GPT-2 passes its own, None = 1/sqrt(D)), padding and sliding windows (in the mask), is_causal without a
mask (Tq == Tk, or a single decoding query). On CUDA a call whose mask is the bare causal triangle runs as a plain
causal call, on the Triton kernels where they compute the knobs (flash_forensics/fast_path.py). Refused with a
ValueError naming the argument: dropout > 0, softcap, attention sinks (s_aux), position_bias, paged caches,
output_attentions, a sliding window without a mask.

`use(model, recipe=..., overrides={where: {knob: value}}, **knobs)` sets the knobs (kernels/knobs.py; per head:
o_fp32_heads) of every attention module that dispatches through AttentionInterface (flash_forensics/sites.py:
encoder, decoder and cross-attention alike), `where` a module path, a pattern or a unique layer_idx
(flash_forensics/overrides.py), and gives each fresh counters (AttnStats of its query heads). Modules it cannot
route are named (NotRoutedWarning, or refused with strict=True); hooks notice when the model's forwards stop
reaching the backend (flash_forensics/watch.py). A module never set computes the defaults (paper_bf16). A forward
that activation checkpointing recomputes in the backward is computed again but not counted again.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from flash_forensics import fast_path, watch
from flash_forensics import sites as sites_mod
from flash_forensics.kernels.config import AttentionConfig, AttentionKnobs
from flash_forensics.kernels.stats import AttnStats
from flash_forensics.overrides import layer_overrides
from flash_forensics.sdpa import attend, check_emulated, make_knobs, recomputing, shown

NAME = "forensics"  # not "flash_forensics": transformers takes every name containing "flash" for a flash-attn kernel
# kwargs some families pass that this backend cannot compute: refused when set (None / False is fine)
_REFUSED = {"softcap": "a logit softcap (Gemma 2)", "s_aux": "attention sinks (gpt-oss)",
            "position_bias": "a learned position bias (T5-style)", "head_mask": "a head mask"}

# the config keys that families read their attention dropout from (BERT's, GPT-2's, ...; "dropout": T5's, last)
_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attention_dropout_prob",
                 "attn_dropout", "dropout")


@dataclass
class LayerState:
    """What one attention module computes with and counts (device tensors; read by flash_forensics.monitor)."""

    knobs: AttentionKnobs
    stats: AttnStats
    probe: bool = False  # this forward also measures the attention entropy (an extra softmax pass, no grad)
    entropy_sum: Optional[torch.Tensor] = None  # (H,) FP32: sum over rows of each row's entropy, since the last reset
    entropy_rows: Optional[torch.Tensor] = None  # (H,) FP32: rows summed
    path: str = ""  # the module's path in the model (flash_forensics/sites.py)
    calls: Optional[torch.Tensor] = None  # () int64 on the device: calls since the last reset (counted under compile)
    seen: bool = False  # called since the model's last forward began (eager only; flash_forensics/watch.py)

    def reset(self) -> None:
        self.stats.reset()
        if self.calls is not None:
            self.calls.zero_()
        if self.entropy_sum is not None:
            self.entropy_sum.zero_()
            self.entropy_rows.zero_()


def layer_state(module, n_head: int, device, path: str = "") -> LayerState:
    st = getattr(module, "ff_state", None)
    if st is None:
        st = LayerState(make_knobs(), AttnStats(n_head, device), path=path)
        module.ff_state = st
    if st.stats.device != torch.device(device) or st.stats.n_head != n_head:  # moved, or a head count use() guessed
        st.stats = AttnStats(n_head, device)  # wrong: counters start fresh
        st.entropy_sum = st.entropy_rows = None
    if st.calls is None or st.calls.device != torch.device(device):
        st.calls = torch.zeros((), dtype=torch.int64, device=device)
    return st


def _family(module) -> str:
    return str(getattr(getattr(module, "config", None), "model_type", "unknown"))


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention-function contract: q (B, H, Tq, D), k/v (B, Hk, Tk, D) -> ((B, Tq, H, D), None)."""
    st0 = getattr(module, "ff_state", None)
    place = st0.path if st0 is not None and st0.path else f"layer {getattr(module, 'layer_idx', '?')}"
    where = f"{NAME} attention ({place}, {_family(module)})"
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: {name}={shown(kwargs[name])} is not allowed: expected None ({what} is not "
                             "computed by the emulator)")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{where}: output_attentions=True is not allowed: expected False (flash attention keeps no "
                         "attention weights; use attn_implementation='eager' to read them)")
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise ValueError(f"{where}: a PagedAttentionCache is not allowed: expected a regular cache or none")
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout != 0:
        cfg = getattr(module, "config", None)  # the family's own key: modules keep the value they were built with
        key = next((k for k in _DROPOUT_KEYS if getattr(cfg, k, None) == dropout),
                   next((k for k in _DROPOUT_KEYS if getattr(cfg, k, None) is not None), "attention_dropout"))
        raise ValueError(f"{where}: dropout={dropout!r} is not allowed: expected 0.0 (the flash kernels have no "
                         f"attention dropout: build the model with config.{key}=0.0, as setting it on a built "
                         "model changes nothing, or run it in eval mode)")
    H, Tq, Tk = query.shape[1], query.shape[2], key.shape[2]
    st = layer_state(module, H, query.device)
    again = recomputing()  # gradient checkpointing's second forward, in the backward: counted in the first
    if not again:
        st.calls.add_(1)  # a device op: counted also in compiled graphs (the Monitor reads it at each flush)
    if not torch.compiler.is_compiling():
        st.seen = True  # a Python flag: dynamo would guard on it and recompile, so eager only
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
    key_keep = None  # the Triton route takes plain causal calls and causal calls with key padding
    if query.is_cuda and fast_path.causal_only(mask, Tq, Tk):
        mask, causal, scaling = None, True, fast_path.plain_scale(scaling, query.shape[-1])
    elif query.is_cuda and (key_keep := fast_path.key_padding(mask, Tq, Tk)) is not None:
        padded_mask = mask  # the probes' entropy reads the mask itself
        mask, causal, scaling = None, True, fast_path.plain_scale(scaling, query.shape[-1])
    o = attend(query, key, value, st.knobs, attn_mask=mask, dropout_p=0.0, is_causal=causal, scale=scaling,
               enable_gqa=key.shape[1] != H, stats=st.stats if st.knobs.counters else None,
               layer=getattr(module, "layer_idx", None), family=_family(module), key_keep=key_keep)
    if st.probe and not again:
        if key_keep is not None:
            _entropy(st, query, key, padded_mask, False, scaling)
        else:
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


def _routable(sites, model):
    """(routed sites, reasons for the modules use() cannot route): a site whose own config names another
    implementation (a sub-model's config), and attention-like modules that do not dispatch at all."""
    routed, skipped = [], []
    for s in sites:
        impl = getattr(getattr(s.module, "config", model.config), "_attn_implementation", None)
        if impl == NAME:
            routed.append(s)
        else:
            skipped.append(f"{s.path} (its config's _attn_implementation={impl!r})")
    skipped += [f"{p or 'the model itself'} (its class computes attention itself, not through transformers' "
                "AttentionInterface)" for p in sites_mod.attention_like(model)]
    return routed, skipped


def not_routed(model, who: str = "use()"):
    """The ValueError for a model none of whose attention modules routes to the backend (use(), Monitor)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{who}: model={type(model).__name__} is not allowed: expected a transformers model "
                         f"(a torch.nn.Module) built with attn_implementation={NAME!r}")
    found = sites_mod.attention_sites(model)
    skipped = _routable(found, model)[1]
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    raise ValueError(f"{who}: model.config._attn_implementation={impl!r} is not allowed: expected {NAME!r} (build "
                     f"the model with attn_implementation={NAME!r}, or call model.set_attn_implementation({NAME!r}))"
                     + (f"; no attention module routes: {'; '.join(skipped[:4])}" if skipped else "")
                     + ("" if skipped or found else
                        f"; no attention module of transformers was found in {type(model).__name__}"))


def _unrouted(model, skipped, who: str) -> str:
    return (f"{who}: {len(skipped)} attention module(s) of {type(model).__name__} cannot run the {NAME} backend "
            f"and keep their own attention: {'; '.join(skipped[:6])}{'; ...' if len(skipped) > 6 else ''}")


def unrouted_unsaid(model, who: str) -> Optional[str]:
    """use()'s NotRoutedWarning text for a model use() never set up (e.g. a Monitor on a model only built with the
    backend), else None: use() said it already, or every attention module routes."""
    found = sites_mod.attention_sites(model)
    if any(getattr(s.module, "ff_state", None) is not None for s in found):
        return None
    skipped = _routable(found, model)[1]
    return _unrouted(model, skipped, who) if skipped else None


def use(model, recipe: str = "paper_bf16", overrides: Optional[Dict[object, dict]] = None, strict: bool = False,
        **knobs):
    """Set the recipe and knobs of every attention module of a transformers model built with
    attn_implementation="forensics". `overrides`: {module path, path pattern or layer_idx: {knob: value}}
    (flash_forensics/overrides.py; later wins; per head: o_fp32_heads). Attention modules it cannot route are
    named in a NotRoutedWarning (strict=True: a ValueError). Validates everything before changing anything; fresh
    counters per module. Returns the model."""

    if not isinstance(model, torch.nn.Module):
        not_routed(model)
    all_sites = sites_mod.attention_sites(model)
    routed, skipped = _routable(all_sites, model)
    if not routed:
        not_routed(model)
    if skipped:
        msg = _unrouted(model, skipped, "use()")
        if strict:
            raise ValueError(msg + " (strict=True: expected every attention module routed)")
        warnings.warn(msg, watch.NotRoutedWarning, stacklevel=2)
    base = make_knobs(recipe, key="use", **knobs)
    pairs = layer_overrides(routed, overrides)
    cfg = AttentionConfig(**base.knob_values(), overrides=[ov for _, ov in pairs])
    try:
        cfg.validate(None, key="use", n_layer=len(routed))
    except ValueError as e:  # AttentionConfig names an override by its list index; use() takes them by key
        raise ValueError(re.sub(r"use\.overrides\[(\d+)\]", lambda m: f"use.overrides[{pairs[int(m[1])][0]!r}]",
                                str(e))) from None
    per_site = []
    for i, s in enumerate(routed):
        keys = [k for k, ov in pairs if i in ov.layers]
        where = f"use.overrides[{keys[-1]!r}]" if keys else "use"
        per_site.append(check_emulated(cfg.for_layer(i).validate(s.n_head, key=where), key=where))
    device = next(model.parameters()).device
    states = []
    for s, k in zip(routed, per_site, strict=True):
        st = getattr(s.module, "ff_state", None)
        if st is None:
            st = s.module.ff_state = LayerState(k, AttnStats(s.n_head, device), path=s.path)
        else:  # the same object re-armed: a Monitor made before this use() holds it and would read orphans
            st.knobs, st.stats, st.path = k, AttnStats(s.n_head, device), s.path
            st.entropy_sum = st.entropy_rows = None
        st.calls = torch.zeros((), dtype=torch.int64, device=device)
        states.append(st)
    watch.install(model, routed, states, NAME)
    return model


def sites(model):
    """The attention modules the backend routes (flash_forensics/sites.py Site), in module order: those use() set
    up (also after their config was switched away: flash_forensics/watch.py says so), else those it would route."""
    found = sites_mod.attention_sites(model)
    set_up = [s for s in found if getattr(s.module, "ff_state", None) is not None]
    return set_up or _routable(found, model)[0]


def layer_states(model):
    """Each routed attention module's LayerState (created with the defaults where `use` was never called)."""

    device = next(model.parameters()).device
    return [layer_state(s.module, s.n_head, device, s.path) for s in sites(model)]


__all__ = ["NAME", "use", "not_routed", "unrouted_unsaid", "sites", "attention_forward", "mask_interface",
           "register_attention", "register_mask", "LayerState", "layer_states"]
