"""The token embedding's backward at GPT-2S's shape, every way side by side in one process (CUDA):

    python benchmarks/embedding_grad.py [--tokens 16384] [--rounds 5] [--out results/bench/embedding-grad-<gpu>.json]

- inductor: torch.compile of aten.embedding_dense_backward, as inductor lowers nn.Embedding's backward in a compiled
  step (a zero fill and atomic adds: the bits vary run to run where an id repeats);
- aten: aten.embedding_dense_backward, eager (sorted, deterministic: what a compiled job ran with
  models/embedding.py before the Triton kernel);
- triton: kernels/triton_embedding.py (a stable sort, then each id's rows summed in a fixed order); triton_FORM_rb..:
  other launches of it (LAUNCHES), int32 sort keys, and its opt-in tile form.
Two id distributions of N = --tokens ids over GPT-2's padded vocab (50304): uniform (few repeats) and Zipf (s = 1,
as text: the most frequent id about 1 in 11). Each method's time by triton.testing.do_bench (L2 flushed), in rounds,
the order rotated each round; the median per method. Also recorded: whether two calls of a method gave the same
bits (inductor's need not), and the largest difference from aten's result.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

V, C = 50304, 768


def ids(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.randint(0, V, (n,), generator=g)
    w = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)  # Zipf, s = 1
    return torch.multinomial(w, n, replacement=True, generator=g)


# the Triton kernel's launches timed beside its default: (rows a step or a tile, columns a program, warps, int32 keys,
# form: "runs", one program per sorted position, the default; "tiles", one per tile of positions, opt-in)
LAUNCHES = [(32, 256, 4, True, "runs"), (16, 1024, 8, True, "runs"), (32, 512, 4, True, "runs"),
            (64, 256, 8, True, "runs"), (8, 1024, 4, True, "runs"), (32, 256, 4, True, "tiles"),
            (64, 128, 4, True, "tiles"), (16, 256, 4, True, "tiles"), (32, 128, 4, False, "tiles")]


def methods():
    from flash_forensics.kernels.triton_embedding import embedding_grad
    aten = torch.ops.aten.embedding_dense_backward
    compiled = torch.compile(lambda g, i: aten(g, i, V, -1, False))
    out = {"inductor": compiled, "aten": lambda g, i: aten(g, i, V, -1, False),
           "triton": lambda g, i: embedding_grad(g, i, V)}
    for rb, bc, w, k32, form in LAUNCHES:
        out[f"triton_{form}_rb{rb}_c{bc}_w{w}{'_k32' if k32 else ''}"] = (
            lambda g, i, rb=rb, bc=bc, w=w, k32=k32, form=form: embedding_grad(g, i, V, rb, bc, w, k32, form))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("embedding_grad: needs a CUDA GPU")
    import triton.testing

    from benchmarks.envinfo import environment, write_json
    out = dict(environment(sys.argv[1:] if argv is None else argv, __file__), tokens=args.tokens, vocab=V, width=C,
               rows=[])
    fns = methods()
    g = torch.Generator().manual_seed(0)
    for kind in ("uniform", "zipf"):
        idx = ids(kind, args.tokens, g).cuda()
        grad = torch.randn(args.tokens, C, generator=g).cuda()
        ref = fns["aten"](grad, idx)
        times = {m: [] for m in fns}
        for r in range(args.rounds):
            order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
            for m in order:
                times[m].append(triton.testing.do_bench(lambda m=m, g=grad, i=idx: fns[m](g, i)))
        for m, fn in fns.items():
            a, b = fn(grad, idx), fn(grad, idx)
            row = dict(ids=kind, method=m, ms=statistics.median(times[m]), rounds_ms=times[m],
                       same_bits_twice=bool(torch.equal(a, b)), max_abs_diff_vs_aten=float((a - ref).abs().max()),
                       most_frequent_id_count=int(torch.bincount(idx).max()))
            out["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rounds_ms"}), flush=True)
    path = args.out or os.path.join(ROOT, "results", "bench",
                                    f"embedding-grad-{out['gpu'].split()[-1].lower()}.json")
    write_json(out, path)
    return out


if __name__ == "__main__":
    main()
