"""Where each transformers family keeps W_Q, the projection whose per-head spectral norm the Monitor reads.

A family is the config's `model_type`. Its attention modules are found by flash_forensics/sites.py (every module
that dispatches through AttentionInterface); W_Q is read from each of them by the entry's rule, a projection
attribute and how the query rows sit in its weight:
- "rows": the first H * D output rows are the query, head h rows [h*D, (h+1)*D): a separate q_proj / query, or a
  fused projection with the query first (Phi3's qkv_proj, DBRX's Wqkv, GPT-BigCode's c_attn).
- "per_head": rows grouped per head as [q_h; k_h; v_h] (GPT-NeoX's query_key_value): head h's query is rows
  [3hD, 3hD + D).
A Conv1D (GPT-2's c_attn, computing x @ W) is transposed first, so its query is columns [0, H * D).
A cross-attention module with a separate query projection `q_attn` (GPT-2, GPT-BigCode) is read from that one.
A model of another family is refused with how to name it: `register("my_type", wq="q_proj")`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from flash_forensics.models.gpt import top_singular_values
from flash_forensics.sites import Site, attention_sites

WQ_RULES: Dict[str, Tuple[str, str]] = {  # rule -> (projection attribute, layout)
    "q_proj": ("q_proj", "rows"), "query": ("query", "rows"), "qkv_proj": ("qkv_proj", "rows"),
    "Wqkv": ("Wqkv", "rows"), "c_attn": ("c_attn", "rows"), "query_key_value": ("query_key_value", "per_head"),
}
FAMILIES: Dict[str, str] = {  # model_type -> wq rule
    **{t: "q_proj" for t in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
                             "gemma2", "gemma3_text", "olmo", "olmo2", "granite", "cohere", "starcoder2", "phi",
                             "bart", "mbart", "whisper")},
    "bert": "query", "roberta": "query",
    "phi3": "qkv_proj", "dbrx": "Wqkv", "gpt_bigcode": "c_attn", "gpt2": "c_attn", "gpt_neox": "query_key_value",
}


def register(model_type: str, wq: str) -> None:
    """Name the W_Q rule of a family this table lacks (e.g. a custom Llama-like model_type)."""
    if wq not in WQ_RULES:
        raise ValueError(f"wq={wq!r} is not allowed: expected one of {', '.join(WQ_RULES)}")
    FAMILIES[str(model_type)] = wq


def _guess(model) -> Optional[str]:
    """The rule whose projection the model's first attention module has (None when none fits)."""
    found = attention_sites(model)
    for rule, (attr, _) in WQ_RULES.items():
        if found and hasattr(found[0].module, attr):
            return rule
    return None


def _no_rule(model) -> str:
    """What to do when no rule fits: the first attention module's own linear layers, to name a new rule after."""
    found = attention_sites(model)
    mod = found[0].module if found else None
    linears = [n for n, m in (mod.named_children() if mod is not None else ()) if hasattr(m, "weight")]
    return (f"no W_Q rule fits: its attention module {type(mod).__name__} has none of {', '.join(WQ_RULES)} (its "
            f"layers: {', '.join(linears) or 'none'}); add its query projection to flash_forensics.families.WQ_RULES"
            " ({rule: (attribute, 'rows' or 'per_head')}), then register(model_type, wq=rule)")


def family(model) -> str:
    """The model's family (config.model_type), refused when the table has no entry for it."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        guess = _guess(model)
        how = (_no_rule(model) if guess is None else f"name yours with flash_forensics.families.register("
               f"{model_type!r}, wq={guess!r}) (its query projection; rules: {', '.join(WQ_RULES)}: "
               "flash_forensics/families.py)")
        raise ValueError(f"model family {model_type!r} (config.model_type) is not allowed: expected one of "
                         f"{', '.join(sorted(FAMILIES))}; {how}")
    return model_type


def attention_layers(model) -> List[torch.nn.Module]:
    """The modules that dispatch through AttentionInterface (flash_forensics/sites.py), in module order."""
    return [s.module for s in attention_sites(model)]


def n_heads(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "num_attention_heads", None) or cfg.n_head)


def _weight(proj) -> torch.Tensor:
    """(out, in) whatever the module: a Conv1D (x @ W) stores (in, out)."""
    w = proj.weight.detach().float()
    return w.t() if type(proj).__name__ == "Conv1D" else w


def _fit(site: Site, rule: str):
    """(projection, D, rows) of a module under `rule`: a ValueError naming the module where the rule does not fit."""
    attr, layout = WQ_RULES[rule]
    mod, H = site.module, site.n_head
    proj = getattr(mod, "q_attn", None)  # GPT-2 / BigCode cross-attention: its own query projection
    proj = getattr(mod, attr, None) if proj is None else proj
    if proj is None:
        raise ValueError(f"{site.path} ({type(mod).__name__}) has no {attr!r}: the W_Q rule {rule!r} does not fit "
                         f"this module; name the right one with flash_forensics.families.register(model_type, wq=...)"
                         f" (one of {', '.join(WQ_RULES)})")
    out_rows, C = proj.weight.shape[::-1] if type(proj).__name__ == "Conv1D" else proj.weight.shape
    D = getattr(mod, "head_dim", None) or C // H
    rows = H * D * (3 if layout == "per_head" else 1)
    if out_rows < rows:
        raise ValueError(f"{site.path}: {attr}.weight has {out_rows} output rows, fewer than the {rows} that "
                         f"{H} heads of {D} need (rule {rule!r})")
    return proj, D, rows


def check_sites(model, sites: Sequence[Site]) -> None:
    """The model's W_Q rule fits every one of `sites` (the Monitor asks when made, not at its first W_Q read)."""
    rule = FAMILIES[family(model)]
    for s in sites:
        _fit(s, rule)


def site_wq(site: Site, rule: str) -> torch.Tensor:
    """One module's W_Q per head, (H, D, C) FP32 (detached, on the parameters' device)."""
    proj, D, rows = _fit(site, rule)
    w = _weight(proj)
    H, C = site.n_head, w.shape[1]
    if WQ_RULES[rule][1] == "per_head":
        return w[:rows].view(H, 3, D, C)[:, 0]
    return w[:H * D].view(H, D, C)


def wq_blocks(model) -> torch.Tensor:
    """Every head's W_Q block, (sum of heads over modules, D, C) FP32 (modules of one head dim and width)."""
    rule = FAMILIES[family(model)]
    return torch.cat([site_wq(s, rule) for s in attention_sites(model)])


@torch.no_grad()
def site_sigmas(model, iters: int = 30, sites: Optional[Sequence[Site]] = None) -> List[torch.Tensor]:
    """sigma_max of each head's W_Q, one (H,) FP32 device tensor per attention module (`sites`, default all; models/
    gpt.py's method, no host sync); modules of the same block shape in one batch."""
    rule = FAMILIES[family(model)]
    blocks = [site_wq(s, rule) for s in (attention_sites(model) if sites is None else sites)]
    out: List[torch.Tensor] = [None] * len(blocks)
    by_shape: Dict[tuple, List[int]] = {}
    for i, b in enumerate(blocks):
        by_shape.setdefault(tuple(b.shape[1:]), []).append(i)
    for idx in by_shape.values():
        sig = top_singular_values(torch.cat([blocks[i] for i in idx]), iters)
        for i, part in zip(idx, sig.split([blocks[i].shape[0] for i in idx])):
            out[i] = part
    return out


@torch.no_grad()
def wq_spectral_norms(model, iters: int = 30) -> torch.Tensor:
    """sigma_max of each head's W_Q, (n_module, H) FP32 on the device (modules with the same number of heads)."""
    sig = site_sigmas(model, iters)
    if len({s.numel() for s in sig}) > 1:
        raise ValueError(f"{type(model).__name__}: its attention modules have {sorted({s.numel() for s in sig})} "
                         "heads: expected one count for an (n_module, H) table; use site_sigmas(model)")
    return torch.stack(sig)


__all__ = ["FAMILIES", "WQ_RULES", "register", "family", "attention_layers", "n_heads", "check_sites", "site_wq",
           "wq_blocks", "site_sigmas", "wq_spectral_norms"]
