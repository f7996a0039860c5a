"""Where each transformers family keeps what the monitors read: its attention layers and each head's W_Q.

A family is the config's `model_type`. Its attention modules are the modules with a `layer_idx` whose class name ends
in "Attention" (every decoder family in transformers 5 names them so); W_Q is read from one of them by the entry's
`wq` rule:
- "q_proj": a Linear of weight (H * D, C); head h owns rows [h*D, (h+1)*D).
- "c_attn": GPT-2's fused Conv1D of weight (C, 3C) computing x @ W: W_Q is columns [0, C), head h columns
  [h*D, (h+1)*D) (transposed to a (D, C) block).
A model of another family is refused with how to name it: `register("my_type", wq="q_proj")`.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from flash_forensics.models.gpt import top_singular_values

WQ_RULES = ("q_proj", "c_attn")
FAMILIES: Dict[str, str] = {  # model_type -> wq rule
    "llama": "q_proj", "mistral": "q_proj", "qwen2": "q_proj", "qwen3": "q_proj", "gemma": "q_proj",
    "gemma2": "q_proj", "phi3": "q_proj", "olmo": "q_proj", "olmo2": "q_proj", "granite": "q_proj",
    "gpt2": "c_attn",
}


def register(model_type: str, wq: str) -> None:
    """Name the W_Q rule of a family this table lacks (e.g. a custom Llama-like model_type)."""
    if wq not in WQ_RULES:
        raise ValueError(f"wq={wq!r} is not allowed: expected one of {', '.join(WQ_RULES)}")
    FAMILIES[str(model_type)] = wq


def family(model) -> str:
    """The model's family (config.model_type), refused when the table has no entry for it."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model family {model_type!r} (config.model_type) is not allowed: expected one of "
                         f"{', '.join(sorted(FAMILIES))}; name yours with flash_forensics.families.register("
                         f"{model_type!r}, wq='q_proj') (a per-head q_proj Linear) or wq='c_attn' (GPT-2's fused "
                         "Conv1D)")
    return model_type


def attention_layers(model) -> List[torch.nn.Module]:
    """The attention modules, in layer_idx order (one per decoder layer)."""
    found = {}
    for mod in model.modules():
        if type(mod).__name__.endswith("Attention") and isinstance(getattr(mod, "layer_idx", None), int):
            found.setdefault(mod.layer_idx, mod)
    if not found or sorted(found) != list(range(len(found))):
        raise ValueError(f"{type(model).__name__}: found attention modules at layer_idx {sorted(found)}; expected "
                         "layers 0..n-1 with a `layer_idx` (a transformers decoder)")
    return [found[i] for i in range(len(found))]


def n_heads(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "num_attention_heads", None) or cfg.n_head)


def wq_blocks(model) -> torch.Tensor:
    """Every head's W_Q block, (n_layer * H, D, C) FP32 (detached; on the parameters' device)."""
    rule = FAMILIES[family(model)]
    H = n_heads(model)
    blocks = []
    for mod in attention_layers(model):
        if rule == "q_proj":
            w = mod.q_proj.weight
            if w.shape[0] % H:
                raise ValueError(f"{family(model)}: q_proj.weight.shape={tuple(w.shape)} does not split into {H} heads")
            blocks.append(w.detach().float().view(H, w.shape[0] // H, w.shape[1]))
        else:  # c_attn: x @ W with W (C, 3C); W_Q = W[:, :C], head h = W[:, h*D:(h+1)*D]^T
            w = mod.c_attn.weight
            C = w.shape[0]
            blocks.append(w.detach().float()[:, :C].t().reshape(H, C // H, C))
    return torch.cat(blocks)


@torch.no_grad()
def wq_spectral_norms(model, iters: int = 30) -> torch.Tensor:
    """sigma_max of each head's W_Q, (n_layer, H) FP32 on the device (no host sync; models/gpt.py's method)."""
    H = n_heads(model)
    return top_singular_values(wq_blocks(model), iters).view(-1, H)


__all__ = ["FAMILIES", "WQ_RULES", "register", "family", "attention_layers", "n_heads", "wq_blocks",
           "wq_spectral_norms"]
