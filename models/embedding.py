"""The token embedding with a deterministic backward, compiled or not: sorted, no atomics, no host sync.

Inductor decomposes an embedding's backward into a scatter-add over the batch's token ids. On a GPU it lowers that to
atomic adds, whose order varies from run to run wherever a token repeats (it always does in text): two compiled runs
of the same job differed from their first steps (an H100, 2026-12-07, results/bench/gpu-h100-2026-12-07c). Under
torch's deterministic algorithms it calls aten's index_put_ instead, at a cost in host time. Here the backward is
`flash_forensics::embedding_grad`, a custom op inductor does not look into. On CUDA it runs
kernels/triton_embedding.py (a stable sort, then each id's rows summed in a fixed order); elsewhere aten's
embedding_dense_backward, the kernel eager training runs (it sorts too), so there a compiled step's embedding
gradient has the eager step's bits. At GPT-2S's shape on an H100 (results/bench/gpu-h100-2026-12-07d, lease c) the
Triton kernel took 0.28-0.29 ms alone, aten's 0.30-0.39, inductor's atomic one 0.10-0.11;
in a compiled fa2 training step the sorted path cost 0.8% of tokens/s.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional: without it aten's kernel, deterministic too
    from flash_forensics.kernels.triton_embedding import embedding_grad as _triton_grad
except ImportError:  # pragma: no cover - exercised only where triton is missing
    _triton_grad = None

LIB = "flash_forensics"


@torch.library.custom_op(f"{LIB}::embedding_grad", mutates_args=())
def embedding_grad(grad: torch.Tensor, idx: torch.Tensor, num_weights: int) -> torch.Tensor:
    """d(embedding)/d(weight) (no padding index, no frequency scaling): kernels/triton_embedding.py on CUDA, else
    aten's dense embedding backward."""
    if _triton_grad is not None and grad.is_cuda:
        return _triton_grad(grad, idx, num_weights)
    return torch.ops.aten.embedding_dense_backward(grad, idx, num_weights, -1, False)


@embedding_grad.register_fake
def _(grad, idx, num_weights):
    return grad.new_empty((num_weights, grad.shape[-1]))


class _TokenEmbedding(torch.autograd.Function):
    """F.embedding forward (inductor may fuse the gather); the backward through embedding_grad."""

    @staticmethod
    def forward(idx, weight):
        return F.embedding(idx, weight)

    @staticmethod
    def setup_context(ctx, inputs, output):
        idx, weight = inputs
        ctx.save_for_backward(idx)
        ctx.num_weights = weight.shape[0]

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        return None, embedding_grad(grad.contiguous(), idx, ctx.num_weights)


def token_embedding(idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[idx], whose gradient is sorted and summed in a fixed order (embedding_grad; module docstring)."""
    return _TokenEmbedding.apply(idx, weight)


__all__ = ["embedding_grad", "token_embedding"]
