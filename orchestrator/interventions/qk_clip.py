"""QK-clip (as MuonClip): per head, when that head's max attention logit on the training step exceeds tau,
rescale the head's W_Q and W_K rows by sqrt(tau / max_logit) each, so its q.k logits shrink by tau / max_logit.

The max logit is measured on the step's own forward: an observer on each layer (models/gpt.py `qk_observer`) folds
max over (batch, query, key <= query) of q.k / sqrt(D), per head, in FP32, from the q and k the layer attends with
(after QK-norm, when on). It is a running max over the step's micro-batches (and, under DDP, over ranks: an
all-reduce MAX, no host sync), reset after each step. The rescale is torch.where on the device: no .item().
A head that is not clipped is multiplied by exactly 1.0, so its weights stay bit-identical.
Counted, never silent: `clips` (n_layer, n_head) counts the steps each head was clipped; it is saved in the
checkpoint and logged at the end of the run (qk_clip/clipped_steps, qk_clip/heads_clipped).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Dict, List, Mapping, Optional

import torch

from flash_forensics.orchestrator.interventions.hooks import TrainHook


class QKClip(TrainHook):
    def __init__(self, tau: float = 100.0, layers: Optional[List[int]] = None):
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"tau={tau!r} is not allowed: expected a finite number > 0 (the max logit kept)")
        self.tau = float(tau)
        self.layers = None if layers is None else [int(x) for x in layers]
        self.max_logit: Optional[torch.Tensor] = None  # (n_layer, n_head) FP32, this step's
        self.clips: Optional[torch.Tensor] = None  # (n_layer, n_head) int64, steps clipped

    def check(self, model_cfg) -> None:
        for x in self.layers or []:
            if not 0 <= x < model_cfg.n_layer:
                raise ValueError(f"layers={self.layers} is not allowed: expected layer indices in "
                                 f"0..{model_cfg.n_layer - 1}")
        if model_cfg.qk_norm:
            raise ValueError("model.qk_norm=True is not allowed with QK-clip: the norms undo a W_Q/W_K rescale; "
                             "allowed: model.qk_norm=false")

    def attach(self, model) -> None:
        cfg = model.config
        device = model.lm_head.weight.device
        self.max_logit = torch.full((cfg.n_layer, cfg.n_head), float("-inf"), dtype=torch.float32, device=device)
        if self.clips is None or self.clips.device != device:
            self.clips = torch.zeros((cfg.n_layer, cfg.n_head), dtype=torch.int64, device=device)
        for i, block in enumerate(model.transformer.h):
            if self.layers is None or i in self.layers:
                block.attn.qk_observer = partial(self._observe, i)

    @torch.no_grad()
    def _observe(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Fold this forward's per-head max of q.k / sqrt(D) (causal positions only) into max_logit[layer]."""
        T, D = q.shape[-2], q.shape[-1]
        s = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(D))  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        head_max = s.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
        torch.maximum(self.max_logit[layer], head_max, out=self.max_logit[layer])

    @torch.no_grad()
    def after_optimizer_step(self, step: int, model, metrics: Mapping[str, Any]) -> None:
        m = self.max_logit
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)  # every rank rescales alike
        over = m > self.tau
        factor = torch.where(over, torch.sqrt(self.tau / m), torch.ones_like(m))  # (L, H); 1.0 where not over
        C, D = model.config.n_embd, model.config.head_dim
        for i, block in enumerate(model.transformer.h):
            if self.layers is not None and i not in self.layers:
                continue
            rows = factor[i].repeat_interleave(D)  # (C,): head h owns rows [h*D, (h+1)*D) of W_Q and of W_K
            lin = block.attn.c_attn
            lin.weight[:C].mul_(rows[:, None].to(lin.weight.dtype))
            lin.weight[C:2 * C].mul_(rows[:, None].to(lin.weight.dtype))
            if lin.bias is not None:  # q = Wx + b: both scale, so q.k scales exactly
                lin.bias[:C].mul_(rows.to(lin.bias.dtype))
                lin.bias[C:2 * C].mul_(rows.to(lin.bias.dtype))
        self.clips += over
        m.fill_(float("-inf"))

    def state_dict(self) -> Dict[str, Any]:
        return {"tau": self.tau, "clips": None if self.clips is None else self.clips.detach().cpu().clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("clips") is not None:
            device = self.clips.device if self.clips is not None else "cpu"
            self.clips = state["clips"].to(device).clone()

    def final_metrics(self) -> Dict[str, float]:
        if self.clips is None:
            return {}
        c = self.clips.cpu()  # end of run: one sync
        return {"qk_clip/clipped_steps": float(c.sum()), "qk_clip/heads_clipped": float((c > 0).sum())}


__all__ = ["QKClip"]
