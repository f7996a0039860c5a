"""Optimizers and the lr schedule: AdamW with nanoGPT-style groups, Muon for 2-D hidden weights, cosine + warmup.

Every param group carries `base_lr` (its peak); `set_lr(optimizer, factor)` scales all groups by the schedule's
factor, so AdamW and Muon groups follow one curve with their own peaks.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Tuple

import torch
from torch import nn

# Jordan et al. (2024): quintic Newton-Schulz coefficients chosen to push singular values towards 1 quickly
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Linear warmup over `warmup_steps` (step 0 gets 1/warmup), then cosine from 1 to min_ratio at decay_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor


def _split_params(model: nn.Module) -> Tuple[List[nn.Parameter], List[nn.Parameter], List[nn.Parameter]]:
    """(hidden matrices, embeddings/head, gains/biases), each parameter once (tied weights counted once)."""
    embed_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            embed_ids.add(id(module.weight))
    hidden, embed, gains, seen = [], [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in embed_ids or "lm_head" in name:
            embed.append(p)
        elif p.ndim >= 2:
            hidden.append(p)
        else:
            gains.append(p)
    return hidden, embed, gains


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise g (U S V^T -> ~U V^T) with the quintic iteration.

    BF16 on CUDA (cheap, the iteration tolerates it); FP32 on CPU where BF16 matmuls are slow.
    """
    a, b, c = NS_COEFFS
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    transposed = x.size(-2) > x.size(-1)
    if transposed:  # iterate on the wide orientation: X X^T is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if transposed:
        x = x.mT
    return x.to(g.dtype)


class Muon(torch.optim.Optimizer):
    """SGD momentum (Nesterov) whose update is replaced by its orthogonalisation, for 2-D weights only.

    The update is scaled by sqrt(max(1, rows/cols)) so tall and wide matrices move by a comparable RMS.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.02, momentum: float = 0.95,
                 ns_steps: int = 5, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad)
                update = p.grad.add(buf, alpha=group["momentum"])  # Nesterov look-ahead
                update = newton_schulz(update.reshape(update.size(0), -1), group["ns_steps"]).view_as(p)
                scale = max(1.0, p.size(0) / p[0].numel()) ** 0.5
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * scale)
        return loss


class Combined:
    """Several optimizers stepped as one (Muon + AdamW); exposes the union of their param groups."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state):
        for opt, sd in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(sd)


def _adamw(groups, cfg, device: torch.device) -> torch.optim.AdamW:
    for g in groups:
        g["base_lr"] = cfg.lr
    fused = device.type == "cuda"  # one kernel per step on the GPU; foreach (few big ops) elsewhere
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None,
                             foreach=None if fused else True)


def build_optimizer(model: nn.Module, cfg, device: torch.device | str = "cpu"):
    """AdamW over everything (weight decay only on hidden matrices, as nanoGPT excludes gains; embeddings too) or
    Muon for hidden matrices + AdamW for the rest."""
    device = torch.device(device)
    hidden, embed, gains = _split_params(model)
    if cfg.name == "adamw":
        groups = [dict(params=hidden, weight_decay=cfg.weight_decay),
                  dict(params=embed + gains, weight_decay=0.0)]
        return _adamw([g for g in groups if g["params"]], cfg, device)
    if cfg.name == "muon":
        muon = Muon(hidden, lr=cfg.muon_lr, momentum=cfg.muon_momentum, ns_steps=cfg.ns_steps,
                    weight_decay=cfg.weight_decay)
        for g in muon.param_groups:
            g["base_lr"] = cfg.muon_lr
        adamw = _adamw([dict(params=embed + gains, weight_decay=0.0)], cfg, device)
        return Combined(muon, adamw)
    raise ValueError(f"optimizer.name={cfg.name!r} is not allowed: expected one of adamw, muon")


__all__ = ["lr_factor", "set_lr", "newton_schulz", "Muon", "Combined", "build_optimizer"]
