"""What the Triton flash forward saved for its backward, read off the autograd graph."""
import torch


def saved_lse(o: torch.Tensor) -> torch.Tensor:
    """The lse that the forward which returned o saved for its backward (kernels/ops.py FlashAttention saves q, k, v,
    O, lse, key_keep, ties): that forward's own lse, without launching the forward again to get it (on Triton's CPU
    interpreter a launch costs about a second). Read before the backward runs (it frees the saved tensors)."""
    node = o.grad_fn
    while type(node).__name__ != "FlashAttentionBackward":  # past O's cast to the returned dtype
        node = node.next_functions[0][0]
    return node.saved_tensors[4]
