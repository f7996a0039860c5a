"""Speed-only launch configs of the Triton flash kernels, timed per launch family and shape on this GPU.

    python benchmarks/tune.py [--out results/bench/tune-<gpu>.json]     (or: benchmarks/attention.py --tune)

For each forward family (fa2, fa2_exact, paper_bf16, fp32) and backward recipe, every candidate below is timed
alone (forward: the forward kernel; backward: delta + dK/dV + dQ from a saved forward) with do_bench, and the
fastest is written into flash_forensics.kernels.triton_flash.SHAPE_TABLE for this process. The candidates never touch a
block size that carries meaning: paper_bf16 and fa2_exact keep block_k as the forward's key tile and paper_bf16 keeps
block_q / block_k in the backward (kernels/triton_launch.py applies those overrides after the table). The JSON lists
every timing; the chosen ones are what to copy into FWD_TABLE / BWD_TABLE / SHAPE_TABLE (kernels/triton_launch.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402

FWD = {  # (BLOCK_M, free BLOCK_N, num_warps, num_stages)
    "bf16": {64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4),
                  (64, 128, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4)],
             128: [(64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2)]},
    "fp32": {64: [(32, 32, 4, 2), (16, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2)],
             128: [(32, 32, 4, 1), (16, 32, 4, 2), (32, 32, 8, 2), (16, 16, 4, 2)]},
}
BWD = {  # (dkdv BLOCK_M, dkdv BLOCK_N, dq BLOCK_M, dq BLOCK_N, num_warps, num_stages)
    "bf16": {64: [(64, 64, 64, 64, 4, 3), (32, 128, 128, 32, 4, 3), (32, 128, 128, 32, 4, 5),
                  (64, 128, 128, 64, 8, 3), (64, 64, 64, 64, 4, 4), (32, 64, 64, 32, 4, 3), (64, 128, 128, 64, 4, 3),
                  (32, 64, 64, 32, 4, 4), (64, 128, 128, 64, 8, 4)],
             128: [(32, 128, 128, 32, 8, 2), (64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 2),
                   (64, 64, 64, 64, 8, 3)]},
    "fp32": {64: [(32, 32, 32, 32, 4, 2), (16, 32, 32, 16, 4, 2), (32, 64, 64, 32, 4, 2), (16, 16, 16, 16, 2, 2),
                  (32, 32, 32, 32, 8, 2), (16, 64, 64, 16, 4, 2)],
             128: [(16, 32, 32, 16, 4, 1), (16, 16, 16, 16, 4, 2), (32, 32, 32, 32, 8, 2)]},
}
FAMILIES = {  # forward family -> the knobs it is tuned with (counters as a run uses them)
    "fa2": AttentionKnobs(recipe="fa2", counters=False),
    "fa2_exact": AttentionKnobs(recipe="fa2", counters=True),
    "paper_bf16": AttentionKnobs(recipe="paper_bf16", counters=True),
    "fp32": AttentionKnobs(recipe="fp32", counters=True),
}
FP32_MAX_T = 2048  # the FP32 recipe runs ~30x slower: tuned at the short shapes only


def _time(fn, rep_ms=60):
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median")


def tune_shape(tf, fam, knobs, B, H, T, D, dev, log):
    """Time the forward and backward candidates of one family at one shape; keep the fastest in SHAPE_TABLE."""
    import flash_forensics.kernels.emulator
    kind = "fp32" if fam == "fp32" else "bf16"
    dt = torch.float32 if fam == "fp32" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device=dev, dtype=dt, generator=g) for _ in range(4))
    stats = flash_forensics.kernels.stats.AttnStats(H, dev)
    rep, maxl = (stats.repeated_max_rows, stats.max_logit) if knobs.counters else (None, None)
    res = dict(family=fam, shape=[B, H, T, D], fwd=[], bwd=[])
    fwd_key = lambda c: tf._fwd_blocks(knobs, D, T)  # noqa: E731  (with c in SHAPE_TABLE: what actually launches)

    def pick(kind_key, table_key, cands, fn, key):
        best, best_ms = None, None
        tried = set()
        for c in cands:
            tf.SHAPE_TABLE[table_key] = c
            eff = key(c)
            if eff in tried:  # a block size the knobs fix makes two candidates the same launch
                continue
            tried.add(eff)
            try:
                ms = _time(fn)
            except Exception as e:  # e.g. out of shared memory: skipped
                log(f"  {fam:10s} {kind_key} T={T} D={D} {c}: failed {type(e).__name__}")
                continue
            res[kind_key].append(dict(config=list(c), launch=str(eff), ms=ms))
            if best_ms is None or ms < best_ms:
                best, best_ms = c, ms
        if best is None:
            tf.SHAPE_TABLE.pop(table_key, None)
        else:
            tf.SHAPE_TABLE[table_key] = best
        log(f"  {fam:10s} {kind_key} T={T} D={D}: best {best} {best_ms:.3f} ms of {len(res[kind_key])}")
        return best, best_ms

    res["fwd_best"], res["fwd_ms"] = pick("fwd", ("fwd", fam, D, tf.length_class(T)), FWD[kind][D],
                                          lambda: tf._forward(q, k, v, knobs, rep, maxl), fwd_key)
    if fam in ("fa2", "paper_bf16", "fp32"):  # the backward does not depend on SFA / counters: one per recipe
        o, lse, _, _ = tf._forward(q, k, v, knobs)
        res["bwd_best"], res["bwd_ms"] = pick("bwd", ("bwd", knobs.recipe, D, tf.length_class(T)), BWD[kind][D],
                                              lambda: tf._backward(do, q, k, v, o, lse, knobs),
                                              lambda c: tf._bwd_blocks(knobs, D, T))
    return res


def tune_all(dev, shapes, log=print) -> dict:
    from flash_forensics.kernels import triton_flash as tf
    out = dict(results=[])
    for B, H, T, D in shapes:
        for fam, knobs in FAMILIES.items():
            if fam == "fp32" and T > FP32_MAX_T:
                continue
            log(f"tuning {fam} at B={B} H={H} T={T} D={D}")
            out["results"].append(tune_shape(tf, fam, knobs, B, H, T, D, dev, log))
    out["shape_table"] = {"/".join(map(str, k)): list(v) for k, v in tf.SHAPE_TABLE.items()}
    return out


def load_shape_table(path) -> dict:
    """Put a tune JSON's chosen configs into kernels/triton_flash.py's SHAPE_TABLE (another process's tuning)."""
    from flash_forensics.kernels import triton_flash as tf
    with open(path) as f:
        data = json.load(f)
    table = data["shape_table"] if "shape_table" in data else data["tuning"]["shape_table"]  # tune or attention JSON
    for key, cfg in table.items():
        kind, fam, D, length = key.split("/")
        tf.SHAPE_TABLE[(kind, fam, int(D), length)] = tuple(cfg)
    return table


def main(argv=None):
    from benchmarks.shapes import SHAPES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = tune_all(torch.device("cuda"), [SHAPES[s] for s in args.shapes.split(",")])
    path = args.out or os.path.join(ROOT, "results", "bench", "tune.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res["shape_table"], indent=1))


if __name__ == "__main__":
    main()
