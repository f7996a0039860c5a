"""The job's model for a transformers family (model.family=llama): what orchestrator/job/train.py and the monitors read
from our GPT, over a transformers model built with attn_implementation="forensics".

`build_model(model_cfg, attention_cfg)` returns models.gpt.GPT for family=gpt and an `HFModel` otherwise. HFModel:
- forward(idx, targets) -> (logits, loss): the GPT's loss (FP32 cross entropy, targets -1 ignored, z-loss in the
  gradient only);
- attention_stats / reset_attention_stats / layer_knobs / attention_routes / wq_spectral_norms / probe / num_params,
  as GPT has them; the knobs of layer i are AttentionConfig.for_layer(i), each layer computed by the kernels'
  emulator (flash_forensics/hf_backend.py).
Llama here: RoPE (rope_theta), GQA (n_kv_head), SwiGLU (mlp_hidden; default 8/3 * n_embd rounded up to 64), RMSNorm,
no biases unless model.bias, embeddings tied to the LM head (as GPT-2's), std-0.02 init (transformers' default).
`check_attention` refuses, before launch, attention knobs the emulator does not compute (impl=standard/sdpa,
backend=triton) for such a family.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_forensics.kernels.knobs as knob_table
from flash_forensics.families import attention_layers, wq_spectral_norms
from flash_forensics.hf_backend import NAME, LayerState, layer_states
from flash_forensics.kernels.config import AttentionConfig
from flash_forensics.kernels.stats import AttnStats
from flash_forensics.models.attention import route_name
from flash_forensics.models.embedding import token_embedding
from flash_forensics.models.gpt import GPT, ModelConfig, z_loss_term
from flash_forensics.sdpa import check_emulated


def mlp_width(cfg: ModelConfig) -> int:
    if cfg.mlp_hidden is not None:
        return int(cfg.mlp_hidden)
    return -(-(8 * cfg.n_embd // 3) // 64) * 64


def hf_config(cfg: ModelConfig):
    """The transformers config of a model.family=llama ModelConfig."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=mlp_width(cfg),
                       num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                       num_key_value_heads=cfg.n_kv_head or cfg.n_head, max_position_embeddings=cfg.block_size,
                       rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
                       attention_bias=cfg.bias, mlp_bias=cfg.bias, attention_dropout=0.0, tie_word_embeddings=True,
                       rms_norm_eps=1e-5, initializer_range=0.02, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def check_attention(att: AttentionConfig, cfg: ModelConfig, key: str = "attention") -> None:
    """ValueError naming the layer's knob when a layer of a transformers family would not run on the emulator."""

    for i in range(cfg.n_layer):
        knobs = att.for_layer(i)
        lacking = knob_table.unsupported(knobs, "emulator")
        name = ("impl" if knobs.impl != "flash" else "backend" if knobs.backend == "triton" else
                lacking[0].name if lacking else None)
        if name is None:
            continue
        try:  # its message names the key that set the knob in this layer (attention or attention.overrides[k])
            check_emulated(knobs, att.where_set(i, key)[name])
        except ValueError as e:
            raise ValueError(f"{e} (model.family={cfg.family}, layer {i})") from None


def check_job(obj) -> None:
    """What a job of a transformers family cannot run: train hooks and mechanism probes act on models/gpt.py's
    layers (qk_observer, probe_capture, c_attn), which the family's model does not have."""
    fam = obj.model.family
    if list(obj.intervention.hooks):
        raise ValueError(f"intervention.hooks={list(obj.intervention.hooks)!r} is not allowed for model.family={fam}: "
                         "expected none (train hooks act on models/gpt.py's attention layers; use family=gpt)")
    if obj.monitor.probes.enabled:
        raise ValueError(f"monitor.probes.enabled=True is not allowed for model.family={fam}: expected false (the "
                         "mechanism probes read models/gpt.py's layers; use family=gpt)")


class HFModel(nn.Module):
    def __init__(self, model_cfg, attention_cfg=None):
        super().__init__()
        from transformers import AutoModelForCausalLM

        import flash_forensics  # noqa: F401  (registers attn_implementation="forensics" with transformers)

        cfg = ModelConfig.from_any(model_cfg).validate()
        att = AttentionConfig.from_any(attention_cfg if attention_cfg is not None else AttentionConfig())
        att.validate(cfg.n_head, n_layer=cfg.n_layer)
        check_attention(att, cfg)
        self.config, self.attention_config = cfg, att
        self.hf = AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation=NAME)
        # the token embedding's backward sorted, in a fixed order (models/embedding.py; models/gpt.py's switch)
        self.sorted_embedding_grad = True
        H = cfg.n_head
        for i, mod in enumerate(attention_layers(self.hf)):  # knobs checked above (check_attention)
            mod.ff_state = LayerState(att.for_layer(i), AttnStats(H, "cpu"))  # moved with the model on first use

    def _states(self):
        return layer_states(self.hf)

    def forward(self, idx: torch.Tensor, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size={self.config.block_size}")
        if self.sorted_embedding_grad:  # as GPT's (models/embedding.py); on a CPU the bits of transformers' own
            logits = self.hf(inputs_embeds=token_embedding(idx, self.hf.get_input_embeddings().weight)).logits
        else:
            logits = self.hf(input_ids=idx).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            if self.config.z_loss and self.training:
                z = self.config.z_loss * z_loss_term(logits, targets)
                loss = loss + (z - z.detach())
        return logits, loss

    # ---------------------------------------------------------------------------------- what the job reads
    @property
    def probe(self) -> bool:
        return False  # every layer runs the emulator, whose max logit is free

    @probe.setter
    def probe(self, on: bool) -> None:
        pass

    def attention_stats(self) -> list:
        return [st.stats for st in self._states()]

    def reset_attention_stats(self) -> None:
        for st in self._states():
            st.reset()

    def layer_knobs(self) -> list:
        return [st.knobs for st in self._states()]

    def attention_routes(self, device=None) -> List[str]:
        return [f"{self.config.family}:" + route_name(k, "emulator") for k in self.layer_knobs()]

    @torch.no_grad()
    def wq_spectral_norms(self, iters: int = 30) -> torch.Tensor:
        return wq_spectral_norms(self.hf, iters)

    def num_params(self, non_embedding: bool = False) -> int:
        return sum(p.numel() for p in self.parameters())  # tied embeddings counted once; no position table


def build_model(model_cfg, attention_cfg=None) -> nn.Module:
    """The job's model: GPT for model.family=gpt, HFModel for a transformers family."""
    cfg = ModelConfig.from_any(model_cfg)
    return GPT(cfg, attention_cfg) if cfg.family == "gpt" else HFModel(cfg, attention_cfg)


__all__ = ["build_model", "HFModel", "hf_config", "check_attention", "check_job", "mlp_width"]
