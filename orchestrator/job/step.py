"""One optimizer step of the job: learning rate, micro-batches, backward, global grad clip, optimizer step, and
then the intervention's train hooks: `hooks.after_optimizer_step(step, model, {"loss", "grad_norm"})` is the one
place the loop calls them (orchestrator/interventions/hooks.py).

The hot path: nothing here syncs the host. The loss and grad norm come back as device scalars for the monitors.
Under DDP every micro-batch but the last skips the gradient all-reduce (`no_sync`), and the logged loss is averaged
over ranks so it is the global batch's, like the single-process run's.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Tuple

import torch

from flash_forensics.orchestrator.job.optim import lr_factor, set_lr


def autocast(device: torch.device, precision: str):
    """AMP: FP32 master weights, BF16 matmuls; attention casts q/k/v itself per recipe (never autocast's choice)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def precision_line(precision: str, routes) -> str:
    """What computes in which precision, said once at job start: train.precision covers the model outside attention
    only; attention keeps its recipe's explicit rounding either way (the route names the recipe)."""
    outside = ("BF16 autocast (FP32 master weights)" if precision == "bf16" else
               "FP32, no autocast (attention still rounds as its recipe says)")
    return f"train.precision={precision}: outside attention {outside}; attention routes: {', '.join(routes)}"


class TrainStep:
    """`step(k, batches) -> (loss, grad_norm, lr)`: optimizer step k on this rank's micro-batches."""

    def __init__(self, cfg, model, train_model, optimizer, device: torch.device, world: int, hooks=None):
        tc = cfg.train
        self.hooks = hooks
        self.cfg, self.model, self.train_model, self.optimizer = cfg, model, train_model, optimizer
        self.device, self.world = device, world
        self.accum_local = tc.grad_accum // world
        self.decay = cfg.optimizer.decay_steps or tc.max_steps
        self.min_ratio = cfg.optimizer.min_lr / cfg.optimizer.lr
        self.clip = tc.grad_clip if tc.grad_clip > 0 else math.inf
        self.autocast = autocast(device, tc.precision)
        self.nan = torch.tensor(float("nan"), device=device)
        # train.compile=cudagraphs: each optimizer step is a new iteration of the graphs (the previous step's
        # outputs, read by now, may be overwritten); the micro-batches of one step keep theirs (gradients accumulate)
        self.graphs = str(tc.compile).lower() == "cudagraphs" and device.type == "cuda"

    def __call__(self, step: int, batches: Iterable) -> Tuple[torch.Tensor, torch.Tensor, float]:
        cfg, tc = self.cfg, self.cfg.train
        lr_f = lr_factor(step, tc.warmup_steps, self.decay, self.min_ratio)
        set_lr(self.optimizer, lr_f)
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            last_micro = i >= self.accum_local - 1
            sync = self.train_model.no_sync() if self.world > 1 and not last_micro else contextlib.nullcontext()
            with sync:
                with self.autocast:
                    _, loss = self.train_model(x, y)
                loss = loss / self.accum_local
                if cfg.debug.nan_at_step == step:
                    loss = loss * self.nan  # poisons the grads too, as a real overflow would
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.world > 1:  # the logged loss is the global batch's, like the single-process run
            import torch.distributed as tdist
            tdist.all_reduce(loss_sum, op=tdist.ReduceOp.AVG)
        if self.hooks:
            self.hooks.after_optimizer_step(step, self.model, {"loss": loss_sum, "grad_norm": grad_norm})
        return loss_sum, grad_norm, cfg.optimizer.lr * lr_f


__all__ = ["TrainStep", "autocast", "precision_line"]
