"""A model of the causal kernels' launch order: why the longest tiles go first, across the heads of an L2 section.

Each program's time is taken as its key (or query) tiles plus one tile's worth of fixed cost; an SM holds `occ` of
them at once (scripts/kernel_sass.py's ctas_per_sm for the launch) and, as the GPU does, a freed slot starts the next
program in launch order. No memory system: what it ignores is L2, which the sections exist for (a section's K and V
fit in 32 MB, as in FlashAttention-3's tile scheduler; kernels/triton_launch.py _grid). A model, not a measurement:
only a GPU says what the order gains (benchmarks/attention.py's triton_fa2_linear row beside triton_fa2).

    python results/bench/launch-order/schedule_model.py > results/bench/launch-order/schedule_model.txt
"""
import heapq

SMS = 132  # H100 SXM (the H200 has 132 too)


def makespan(durations, slots):
    free = [0.0] * slots
    end = 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def work(i, kind, BM, BN, T):
    if kind == "q":  # query tile i: the key tiles up to its diagonal
        return -(-min((i + 1) * BM, T) // BN)
    lo = (i * BN) // BM * BM  # key block i: the query tiles from its diagonal on
    return -(-(T - lo) // BM)


def section_heads(BH, most):
    return max(d for d in range(1, min(BH, max(1, most)) + 1) if BH % d == 0)


def orders(B, H, T, D, BM, BN, kind):
    n = -(-T // (BM if kind == "q" else BN))
    w = [1.0 + work(i, kind, BM, BN, T) for i in range(n)]
    BH = B * H
    tile_order = [w[i] for _ in range(BH) for i in range(n)]  # before: (tiles, heads), tile 0 first
    per_head = [x for _ in range(BH) for x in sorted(w, reverse=True)]  # each head's longest first
    g = section_heads(BH, (32 << 20) // (2 * T * D * 2))
    sectioned = [w_i for _ in range(BH // g) for w_i in sorted(w, reverse=True) for _ in range(g)]
    return dict(tile_order=tile_order, per_head_longest_first=per_head, sectioned_longest_first=sectioned), g


CASES = [  # (name, B, H, T, D, BM, BN, kind, programs per SM of the launch)
    ("fa2 forward 64x64, T1024", 16, 12, 1024, 64, 64, 64, "q", 4),
    ("fa2 dK/dV 32x64, T1024", 16, 12, 1024, 64, 32, 64, "k", 3),
    ("fa2 dQ 64x32, T1024", 16, 12, 1024, 64, 64, 32, "q", 4),
    ("preset forward 64x128", 16, 12, 1024, 64, 64, 128, "q", 2),
    ("preset dK/dV 128x64", 16, 12, 1024, 64, 128, 64, "k", 2),
    ("preset dQ 64x128", 16, 12, 1024, 64, 64, 128, "q", 2),
    ("fa2 forward 64x64, B4 T4096", 4, 12, 4096, 64, 64, 64, "q", 4),
    ("fa2 dK/dV 32x64, B4 T4096", 4, 12, 4096, 64, 32, 64, "k", 3),
]

if __name__ == "__main__":
    print("makespan in tile times (lower is better); ideal = total work / slots")
    for name, B, H, T, D, BM, BN, kind, occ in CASES:
        o, g = orders(B, H, T, D, BM, BN, kind)
        slots = SMS * occ
        ms = {k: makespan(v, slots) for k, v in o.items()}
        ideal = sum(o["tile_order"]) / slots
        base = ms["tile_order"]
        print(f"{name:30s} {occ}/SM, sections of {g:3d} heads: ideal {ideal:6.1f}; "
              + ", ".join(f"{k} {v:5.0f} ({base / v:.3f}x)" for k, v in ms.items()))
