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
FORMS = ("runs", "tiles")


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


# form="tiles" (opt-in, not yet timed on a GPU): one program per (tile of RB sorted positions, column block) instead of
# one per position. A tile's rows are gathered at once and summed per id by a segmented scan along the tile (a fixed
# tree: only rows of one id are ever added, so a NaN stays in its own id's row); an id whose rows all lie in the
# tile is written there. An id whose rows cross a tile boundary leaves partial sums, the tile's first one (PF) and
# last one (PL); a second pass adds them, in tile order, from the tile where the id starts.
@triton.jit
def _seg_comb(f1, v1, f2, v2):
    return f1 | f2, tl.where(f2, v2, v1 + v2)


@triton.jit
def _tiles_kernel(G, PERM, SORTED, OUT, PF, PL, N, C, sg, so, RB: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cok = cols < C
    local = tl.arange(0, RB)
    rows = t * RB + local
    ok = rows < N
    ids = tl.load(SORTED + rows, mask=ok, other=-1)
    starts = (ids != tl.load(SORTED + rows - 1, mask=ok & (rows > 0), other=-2)) & ok  # an id's first row
    ends = (ids != tl.load(SORTED + rows + 1, mask=rows + 1 < N, other=-3)) & ok  # an id's last row
    src = tl.load(PERM + rows, mask=ok, other=0)
    g = tl.load(G + src[:, None].to(tl.int64) * sg + cols[None, :], mask=ok[:, None] & cok[None, :], other=0.0)
    opens = starts | (local == 0)  # where a run of one id begins inside the tile
    _, run = tl.associative_scan((opens[:, None] & cok[None, :], g.to(tl.float32)), 0, _seg_comb)
    first_run = tl.cumsum((opens & (local > 0)).to(tl.int32), 0) == 0  # rows of the tile's first run
    # the tile's first run, when it began in an earlier tile (its row 0 starts no id)
    row0 = tl.sum((starts & (local == 0)).to(tl.int32), 0)
    cont = first_run & (local * 0 + row0 == 0)  # (a vector compare: the interpreter's scalar one is no mask)
    shut = ok & (ends | (local == RB - 1))  # the row where a run stops inside the tile
    at = local[:, None] * 0 + cols[None, :]  # one row of PF / PL: every row of the tile maps onto it
    # an id all of whose rows are in this tile: its sum, where its run ends
    tl.store(OUT + ids[:, None].to(tl.int64) * so + cols[None, :], run.to(OUT.dtype.element_ty),
             mask=(shut & ends & (cont == 0))[:, None] & cok[None, :])
    tl.store(PF + t * so + at, run, mask=(shut & cont)[:, None] & cok[None, :])  # from an earlier tile
    tl.store(PL + t * so + at, run, mask=(shut & (ends == 0) & (cont == 0))[:, None] & cok[None, :])  # into a later one


@triton.jit
def _join_kernel(SORTED, OUT, PF, PL, N, C, so, RB: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cok = cols < C
    last = tl.minimum((t + 1) * RB, N) - 1
    rid = tl.load(SORTED + last)
    nxt = tl.load(SORTED + last + 1, mask=last + 1 < N, other=-1)
    first = tl.load(SORTED + t * RB)
    before = tl.load(SORTED + t * RB - 1, mask=t > 0, other=-1)
    began_here = (first != rid) | (before != first)  # the last run starts in this tile
    if (nxt == rid) & began_here:  # this tile owns an id whose rows go on into later tiles
        acc = tl.load(PL + t * so + cols, mask=cok, other=0.0)
        j = t + 1
        more = True
        while more:
            acc += tl.load(PF + j * so + cols, mask=cok, other=0.0)
            lj = tl.minimum((j + 1) * RB, N) - 1
            more = (tl.load(SORTED + lj) == rid) & (lj + 1 < N)
            more = more & (tl.load(SORTED + lj + 1, mask=lj + 1 < N, other=-1) == rid)
            j += 1
        tl.store(OUT + rid.to(tl.int64) * so + cols, acc.to(OUT.dtype.element_ty), mask=cok)


def embedding_grad(grad: torch.Tensor, idx: torch.Tensor, num_weights: int, rb: int = RB,
                   block_c: int = BLOCK_C, num_warps: int = 4, key32: bool = False, form: str = "runs") -> torch.Tensor:
    """(num_weights, C) in grad's dtype: each id's rows of grad (..., C) summed in FP32, in a fixed order.
    rb, block_c, num_warps: the launch (benchmarks/embedding_grad.py times others); key32: the ids sorted as int32
    (fewer radix passes; ids below 2**31), the same order; form: "runs" (one program per sorted position) or
    "tiles" (one per tile of rb positions, and a pass joining the ids that cross tiles)."""
    if form not in FORMS:
        raise ValueError(f"form={form!r} is not allowed: expected one of {', '.join(FORMS)}")
    C = grad.shape[-1]
    g = grad.reshape(-1, C)
    if g.stride(-1) != 1:
        g = g.contiguous()
    keys = idx.reshape(-1)
    sorted_ids, perm = torch.sort(keys.to(torch.int32) if key32 else keys, stable=True)
    out = torch.zeros((num_weights, C), dtype=grad.dtype, device=grad.device)
    N = sorted_ids.numel()
    if N and form == "tiles":
        tiles = triton.cdiv(N, rb)
        pf = torch.empty((tiles, C), dtype=torch.float32, device=grad.device)
        pl = torch.empty_like(pf)
        grid = (tiles, triton.cdiv(C, block_c))
        _tiles_kernel[grid](g, perm, sorted_ids, out, pf, pl, N, C, g.stride(0), C, RB=rb, BLOCK_C=block_c,
                            num_warps=num_warps)
        _join_kernel[grid](sorted_ids, out, pf, pl, N, C, C, RB=rb, BLOCK_C=block_c, num_warps=num_warps)
    elif N:
        _embedding_grad_kernel[(N, triton.cdiv(C, block_c))](g, perm, sorted_ids, out, N, C, g.stride(0),
                                                             out.stride(0), RB=rb, BLOCK_C=block_c,
                                                             num_warps=num_warps)
    return out


__all__ = ["embedding_grad", "RB", "BLOCK_C", "FORMS"]
