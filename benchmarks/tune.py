"""Speed-only launch configs of the Triton flash kernels, timed per launch family and shape on this GPU.

    python benchmarks/tune.py [--out results/bench/tune-<gpu>.json]     (or: benchmarks/attention.py --tune)

    python benchmarks/tune.py --shapes gpt2s_T1024 --families paper_1gpu --out /tmp/tune.json
    FF_LAUNCH_TABLE=/tmp/tune.json python ...     (any process: the JSON's choices in its SHAPE_TABLE)

For each family (fa2, fa2_exact, paper_bf16, fp32, and paper_1gpu: paper_bf16 at experiment=paper_1gpu's 128x128
tiles) and backward recipe, every candidate below is timed alone (forward: the forward kernel; backward: delta +
dK/dV + dQ from a saved forward) with do_bench on a CUDA graph of the call (the kernels' time, not the host's:
`timing` says where a capture failed and the call was timed as it is), and the fastest is written into
flash_forensics.kernels.triton_launch.SHAPE_TABLE for this process, keyed by kernels/triton_launch.py table_family
(paper_bf16's tile sizes are in it). The candidates never touch a block size that carries meaning: paper_bf16 and
fa2_exact keep block_k as the forward's key tile and paper_bf16 keeps block_q / block_k in the backward
(kernels/triton_launch.py applies those overrides after the table). For those families (KEEP_BITS) a candidate is
chosen only if its outputs on the tuning inputs equal the default launch's bit for bit (`same_bits` in the JSON).
The JSON lists every timing; the chosen ones are what to copy into FWD_TABLE / BWD_TABLE / SHAPE_TABLE
(kernels/triton_launch.py).
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
                  (64, 128, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4), (64, 64, 4, 2)],
             128: [(64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2)]},
    "fp32": {64: [(32, 32, 4, 2), (16, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2)],
             128: [(32, 32, 4, 1), (16, 32, 4, 2), (32, 32, 8, 2), (16, 16, 4, 2)]},
}
BWD = {  # (dkdv BLOCK_M, dkdv BLOCK_N, dq BLOCK_M, dq BLOCK_N, num_warps, num_stages)
    "bf16": {64: [(64, 64, 64, 64, 4, 3), (32, 128, 128, 32, 4, 3), (32, 128, 128, 32, 4, 5),
                  (64, 128, 128, 64, 8, 3), (64, 64, 64, 64, 4, 4), (32, 64, 64, 32, 4, 3), (64, 128, 128, 64, 4, 3),
                  (32, 64, 64, 32, 4, 4), (64, 128, 128, 64, 8, 4),
                  # 2 stages: compiled for sm_90 (Triton 3.9), paper_bf16's dQ kernel takes 48 KB of shared memory
                  # instead of 64, so 4 of its programs fit on an SM instead of 3 (its registers allow 4); its dK/dV
                  # kernel then needs its 168-register cap (--regs dkdv=168) to stay at 3
                  (64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 4, 2)],
             128: [(32, 128, 128, 32, 8, 2), (64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 2),
                   (64, 64, 64, 64, 8, 3)]},
    "fp32": {64: [(32, 32, 32, 32, 4, 2), (16, 32, 32, 16, 4, 2), (32, 64, 64, 32, 4, 2), (16, 16, 16, 16, 2, 2),
                  (32, 32, 32, 32, 8, 2), (16, 64, 64, 16, 4, 2)],
             128: [(16, 32, 32, 16, 4, 1), (16, 16, 16, 16, 4, 2), (32, 32, 32, 32, 8, 2)]},
}
# experiment=paper_1gpu's attention: paper_bf16 at 128x128 tiles, which fix the forward's BLOCK_N and the backward's
# dK/dV BLOCK_M and dQ BLOCK_N to 128; the candidates vary the rest (the first: the default launch)
FWD["paper_1gpu"] = {64: [(64, 128, 4, 3), (64, 128, 4, 2), (64, 128, 4, 1), (128, 128, 8, 3), (128, 128, 8, 2),
                          (32, 128, 4, 2), (128, 128, 4, 2)]}
# (an H100, 2026-12-06: 8 warps and 3 or more stages were the slowest; 4 warps, 2 stages took 20% off the default)
BWD["paper_1gpu"] = {64: [(128, 64, 64, 128, 4, 3), (128, 64, 64, 128, 4, 2), (128, 64, 64, 128, 4, 1),
                          (128, 128, 64, 128, 4, 2), (128, 64, 128, 128, 4, 2), (128, 32, 64, 128, 4, 1),
                          (128, 64, 32, 128, 4, 2), (128, 128, 128, 128, 4, 2), (128, 32, 32, 128, 4, 2),
                          (128, 128, 64, 128, 4, 1),
                          # 8 warps: compiled for sm_90, the 4-warp dK/dV kernel of this launch spills (255 registers
                          # and a 104-byte stack), the 8-warp one with 1 or 3 stages does not (scripts/kernel_sass.py,
                          # Triton 3.6, 2026-12-06); not timed yet
                          (128, 64, 64, 128, 8, 2), (128, 64, 64, 128, 8, 1), (128, 64, 64, 128, 8, 3)]}
FAMILIES = {  # name -> the knobs it is tuned with (counters as a run uses them)
    "fa2": AttentionKnobs(recipe="fa2", counters=False),
    "fa2_exact": AttentionKnobs(recipe="fa2", counters=True),
    "paper_bf16": AttentionKnobs(recipe="paper_bf16", counters=True),
    "fp32": AttentionKnobs(recipe="fp32", counters=True),
    "paper_1gpu": AttentionKnobs(recipe="paper_bf16", block_q=128, block_k=128, counters=True),
}
KEEP_BITS = ("fa2_exact", "paper_bf16", "paper_1gpu")  # tune_shape: only bit-identical candidates are chosen
FP32_MAX_T = 2048  # the FP32 recipe runs ~30x slower: tuned at the short shapes only


def _time(fn):
    """(median ms, timing) of fn's kernels: benchmarks/kernel_time.py (a CUDA graph of the call, so the figure is the
    kernels' time, not the host's; at T <= 1024 a host-bound timing would rank the candidates by noise)."""
    from benchmarks.kernel_time import kernel_ms
    return kernel_ms(fn)


def tune_shape(tf, fam, knobs, B, H, T, D, dev, log):
    """Time the forward and backward candidates of one family at one shape; keep the fastest in SHAPE_TABLE."""
    import flash_forensics.kernels.emulator
    kind = fam if fam in FWD else "fp32" if fam == "fp32" else "bf16"
    dt = torch.float32 if fam == "fp32" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device=dev, dtype=dt, generator=g) for _ in range(4))
    stats = flash_forensics.kernels.stats.AttnStats(H, dev)
    rep, maxl = (stats.repeated_max_rows, stats.max_logit) if knobs.counters else (None, None)
    res = dict(family=fam, shape=[B, H, T, D], fwd=[], bwd=[])
    fwd_key = lambda c: tf._fwd_blocks(knobs, D, T)  # noqa: E731  (with c in SHAPE_TABLE: what actually launches)
    # families whose tiles carry meaning keep the default launch's bits: a candidate whose outputs differ is timed
    # and listed (same_bits: false) but never chosen; fa2 and fp32 leave their tiles free
    keep_bits = fam in KEEP_BITS
    res["keep_bits"] = keep_bits

    def outputs(fn):  # the call's tensors (O and lse, or dQ, dK and dV), kept apart from the next call's
        return [t.clone() for t in fn() if isinstance(t, torch.Tensor)]

    def pick(kind_key, table_key, cands, fn, key):
        saved = tf.SHAPE_TABLE.pop(table_key, None)
        ref = outputs(fn)  # the launch without this table key: the default (what the code launched before it)
        if saved is not None:
            tf.SHAPE_TABLE[table_key] = saved
        best, best_ms = None, None
        tried = set()
        for c in cands:
            tf.SHAPE_TABLE[table_key] = c
            eff = key(c)
            if eff in tried:  # a block size the knobs fix makes two candidates the same launch
                continue
            tried.add(eff)
            try:
                ms, timing = _time(fn)
                same = all(torch.equal(a, b) for a, b in zip(ref, outputs(fn)))
            except Exception as e:  # e.g. out of shared memory: skipped
                log(f"  {fam:10s} {kind_key} T={T} D={D} {c}: failed {type(e).__name__}")
                continue
            res[kind_key].append(dict(config=list(c), launch=str(eff), ms=ms, timing=timing, same_bits=same))
            refused = keep_bits and not same  # faster or not, it would change the recipe's numbers
            # each timing as it lands: a run stopped by its time limit still says what it measured
            log(f"  {fam:10s} {kind_key} T={T} D={D} {c}: {ms:.4f} ms ({timing}), same bits as the default: {same}"
                + (": not chosen" if refused else ""))
            if refused:
                continue
            if best_ms is None or ms < best_ms:
                best, best_ms = c, ms
        if best is None:
            tf.SHAPE_TABLE.pop(table_key, None)
        else:
            tf.SHAPE_TABLE[table_key] = best
        log(f"  {fam:10s} {kind_key} T={T} D={D}: best {best} {best_ms:.3f} ms of {len(res[kind_key])}")
        return best, best_ms

    lc = tf.length_class(T)
    res["fwd_best"], res["fwd_ms"] = pick("fwd", ("fwd", tf.table_family(tf.fwd_family(knobs), knobs), D, lc),
                                          FWD[kind][D], lambda: tf._forward(q, k, v, knobs, rep, maxl), fwd_key)
    if fam in ("fa2", "paper_bf16", "fp32", "paper_1gpu"):  # the backward does not depend on SFA / counters
        o, lse, _, _ = tf._forward(q, k, v, knobs)
        res["bwd_best"], res["bwd_ms"] = pick("bwd", ("bwd", tf.table_family(tf.bwd_family(knobs), knobs), D, lc),
                                              BWD[kind][D],
                                              lambda: tf._backward(do, q, k, v, o, lse, knobs),
                                              lambda c: tf._bwd_blocks(knobs, D, T))
    return res


def plan(shapes, families=None):
    """([(family, knobs, shape)] to time, [{family, shape, why}] skipped): every requested family at every shape, or
    why not (a family no --families named is not listed)."""
    todo, skipped = [], []
    for B, H, T, D in shapes:
        for fam, knobs in FAMILIES.items():
            if families and fam not in families:
                continue
            why = (f"the fp32 recipe is tuned up to T={FP32_MAX_T} only" if fam == "fp32" and T > FP32_MAX_T else
                   f"no launch candidates at head dim {D} (candidates at D in "
                   f"{sorted(FWD.get(fam, FWD['bf16']))})" if D not in FWD.get(fam, FWD["bf16"]) else None)
            if why:
                skipped.append(dict(family=fam, shape=[B, H, T, D], why=why))
            else:
                todo.append((fam, knobs, (B, H, T, D)))
    return todo, skipped


def parse_regs(text: str) -> dict:
    """`--regs fwd=128,dkdv=168` -> kernels/triton_launch.py register_limit's caps (an empty text: none); a bad pair
    names itself and what is allowed."""
    from flash_forensics.kernels.triton_launch import REGISTER_KERNELS
    caps = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, _, n = pair.partition("=")
        if name not in REGISTER_KERNELS or not n.isdigit() or not 24 <= int(n) <= 255:
            raise ValueError(f"--regs {pair!r} is not allowed: expected KERNEL=N pairs, KERNEL one of "
                             f"{', '.join(REGISTER_KERNELS)}, N from 24 to 255")
        caps[name] = int(n)
    return caps


def tune_all(dev, shapes, log=print, families=None, regs=None) -> dict:
    """Every family at every shape (plan), each candidate launched under the register caps `regs` (register_limit;
    None or {}: each launch's default cap, REGISTER_TABLE's where it measured that launch, else none). A cap the
    default launch already has gives another config of the same family the same cap, so a candidate that holds
    fewer pipeline stages is timed at the occupancy the cap gives, not ptxas's."""
    from flash_forensics.kernels import triton_launch as tf
    todo, skipped = plan(shapes, families)
    out = dict(results=[], skipped=skipped, regs=dict(regs or {}))
    for s in skipped:
        log(f"not tuning {s['family']} at {s['shape']}: {s['why']}")
    for fam, knobs, (B, H, T, D) in todo:
        log(f"tuning {fam} at B={B} H={H} T={T} D={D}" + (f" under register caps {regs}" if regs else ""))
        with tf.register_limit(**(regs or {})):
            out["results"].append(tune_shape(tf, fam, knobs, B, H, T, D, dev, log))
    out["shape_table"] = {"/".join(map(str, k)): list(v) for k, v in tf.SHAPE_TABLE.items()}
    return out


def load_shape_table(path) -> dict:
    """Put a tune JSON's chosen configs into SHAPE_TABLE (kernels/triton_launch.py load_shape_table)."""
    from flash_forensics.kernels.triton_launch import load_shape_table as load
    return load(path)


def main(argv=None):
    from benchmarks.shapes import SHAPES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma list of: " + ", ".join(FAMILIES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--regs", default="", help="register caps for every launch timed, e.g. fwd=128,dkdv=168 "
                    "(kernels/triton_launch.py register_limit; default: each launch's own)")
    args = ap.parse_args(argv)
    try:
        regs = parse_regs(args.regs)
    except ValueError as e:
        ap.error(str(e))
    for name, known in (("shapes", SHAPES), ("families", FAMILIES)):
        bad = [x for x in getattr(args, name).split(",") if x not in known]
        if bad:
            ap.error(f"--{name}: {bad[0]!r} is not allowed: expected names from {', '.join(known)}")
    shapes, families = [SHAPES[s] for s in args.shapes.split(",")], args.families.split(",")
    todo, skipped = plan(shapes, families)
    if not todo:  # before any GPU work: a run that would time nothing says so and fails (it wrote an empty table)
        sys.exit("benchmarks/tune.py: nothing to time for --shapes " + args.shapes + " --families " + args.families
                 + ": " + "; ".join(f"{s['family']} at {s['shape']}: {s['why']}" for s in skipped))
    if not torch.cuda.is_available():
        sys.exit("benchmarks/tune.py needs a CUDA GPU")
    res = tune_all(torch.device("cuda"), shapes, families=families, regs=regs)
    from benchmarks.envinfo import environment
    res.update(environment(sys.argv[1:] if argv is None else argv, __file__))
    path = args.out or os.path.join(ROOT, "results", "bench", "tune.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res["shape_table"], indent=1))


if __name__ == "__main__":
    main()
