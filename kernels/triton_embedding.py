"""The token embedding's backward as one deterministic Triton kernel after a stable sort (models/embedding.py).

dW[r] = sum of dY[i] over the positions i whose token id is r. Inductor adds these atomically (their order, so the
bits, vary run to run wherever a token repeats); aten's sorted kernel is deterministic. Here: ids sorted (stable:
within an id, positions in order), then one program per (sorted position, column block). A program whose position
starts an id's run sums that run's rows RB at a time (a masked tile, summed over its rows, then added to the running
FP32 sum: a fixed order for a given run length), and writes the row once; every other program returns at once. No
atomics, no host sync. Rows no id touches stay zero. Importing this module needs triton.
At GPT-2S's shape on an H100 (benchmarks/embedding_grad.py, results/bench/gpu-h100-2026-12-07d) this took 0.28-0.29
ms, aten's 0.30-0.39 and inductor's 0.10-0.11: one program per position, most returning after two loads, is
latency-bound (the benchmark times other launches beside it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

RB = 32  # rows of one run summed per step: a run of n rows takes ceil(n / RB) sequential steps
BLOCK_C = 256  # columns per program


@triton.jit
def _embedding_grad_kernel(G, PERM, SORTED, OUT, N, C, sg, so, RB: tl.constexpr, BLOCK_C: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cok = cols < C
    rid = tl.load(SORTED + i)
    prev = tl.load(SORTED + i - 1, mask=i > 0, other=-1)
    if rid != prev:  # position i starts id rid's run
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        j = i
        more = True
        while more:
            rows = j + tl.arange(0, RB)
            ids = tl.load(SORTED + rows, mask=rows < N, other=-1)
            same = ids == rid  # a prefix of the tile (sorted ids)
            src = tl.load(PERM + rows, mask=same, other=0)
            g = tl.load(G + src[:, None].to(tl.int64) * sg + cols[None, :], mask=same[:, None] & cok[None, :],
                        other=0.0)
            acc += tl.sum(g.to(tl.float32), 0)
            j += RB
            more = (tl.sum(same.to(tl.int32), 0) == RB) & (j < N)  # the run may go on past this tile
        tl.store(OUT + rid.to(tl.int64) * so + cols, acc.to(OUT.dtype.element_ty), mask=cok)


def embedding_grad(grad: torch.Tensor, idx: torch.Tensor, num_weights: int, rb: int = RB,
                   block_c: int = BLOCK_C, num_warps: int = 4, key32: bool = False) -> torch.Tensor:
    """(num_weights, C) in grad's dtype: each id's rows of grad (..., C) summed in FP32, in a fixed order.
    rb, block_c, num_warps: the launch (benchmarks/embedding_grad.py times others); key32: the ids sorted as int32
    (fewer radix passes; ids below 2**31), the same order."""
    C = grad.shape[-1]
    g = grad.reshape(-1, C)
    if g.stride(-1) != 1:
        g = g.contiguous()
    keys = idx.reshape(-1)
    sorted_ids, perm = torch.sort(keys.to(torch.int32) if key32 else keys, stable=True)
    out = torch.zeros((num_weights, C), dtype=grad.dtype, device=grad.device)
    N = sorted_ids.numel()
    if N:
        _embedding_grad_kernel[(N, triton.cdiv(C, block_c))](g, perm, sorted_ids, out, N, C, g.stride(0),
                                                             out.stride(0), RB=rb, BLOCK_C=block_c,
                                                             num_warps=num_warps)
    return out


__all__ = ["embedding_grad", "RB", "BLOCK_C"]
