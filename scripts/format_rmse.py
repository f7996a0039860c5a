"""RMSE of each recipe's O, dQ, dK, dV against FP64 on random inputs with outliers, with and without FA3's tricks.

    python scripts/format_rmse.py [--shape 2 4 256 64] [--seeds 2] [--out results/formats]

Inputs as FlashAttention-3's FP8 accuracy test (Shah et al. 2024, Sec. 4.3): Q, K, V ~ N(0, 1) with 0.1% of the
entries replaced by outliers ~ N(0, 100) (variance 100, std 10); dO ~ N(0, 1). FP32 inputs; the reference is FP64
attention (and its gradients) of the same values. Each recipe runs in the emulator (kernels/emulator.py); the FP8
recipes also with incoherent processing (Hadamard rotation), block quantization (one scale per tile) and both.
RMSE = sqrt(mean((x - x_64)^2)), averaged over the seeds. Writes <out>/rmse.md and rmse.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402
from flash_forensics.kernels.emulator import forward, reference_attention  # noqa: E402
from flash_forensics.kernels.stats import AttnStats  # noqa: E402

F64 = torch.float64
VARIANTS = {"plain": {}, "incoherent": dict(incoherent=True), "block": dict(input_scaling="block"),
            "incoherent+block": dict(incoherent=True, input_scaling="block")}
CASES = ([(r, "plain") for r in ("paper_bf16", "fa2", "fp16", "fp32")]
         + [(r, v) for r in ("fp8_fa3", "fp8_te") for v in VARIANTS])


def inputs(shape, seed: int, rate: float = 1e-3, std: float = 10.0):
    g = torch.Generator().manual_seed(seed)

    def one():
        x = torch.randn(*shape, generator=g)
        out = torch.rand(*shape, generator=g) < rate
        return torch.where(out, std * torch.randn(*shape, generator=g), x)

    return one(), one(), one(), torch.randn(*shape, generator=g)


def rmse(a, b) -> float:
    return float(((a.to(F64) - b) ** 2).mean().sqrt())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[2, 4, 256, 64], metavar=("B", "H", "T", "D"))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "formats"))
    a = ap.parse_args(argv)
    t0 = time.time()
    sums = {c: dict(o=0.0, dq=0.0, dk=0.0, dv=0.0, fp8_saturated=0) for c in CASES}
    for seed in range(a.seeds):
        q, k, v, do = inputs(a.shape, seed)
        ref = reference_attention(q.to(F64), k.to(F64), v.to(F64), AttentionKnobs(recipe="fp32"), do.to(F64))
        for recipe, var in CASES:
            knobs = AttentionKnobs(recipe=recipe, backend="emulator", **VARIANTS[var]).validate()
            out = reference_attention(q, k, v, knobs, do)
            o, _, dq, dk, dv = out
            o64, _, dq64, dk64, dv64 = ref
            s = sums[(recipe, var)]
            for name, x, y in (("o", o, o64), ("dq", dq, dq64), ("dk", dk, dk64), ("dv", dv, dv64)):
                s[name] += rmse(x, y) / a.seeds
            st = AttnStats(a.shape[1])  # the forward's saturation count (flash_attention's counters)
            forward(q, k, v, knobs, st)
            s["fp8_saturated"] += int(st.fp8_saturated.sum())
    rows = [dict(recipe=r, variant=v, **sums[(r, v)]) for r, v in CASES]
    cmd = "python scripts/format_rmse.py " + " ".join(sys.argv[1:] if argv is None else argv)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "rmse.json"), "w") as f:
        json.dump(dict(command=cmd, shape=a.shape, seeds=a.seeds, outliers="0.1% of entries ~ N(0, 100)",
                       versions=dict(python=platform.python_version(), torch=torch.__version__),
                       seconds=round(time.time() - t0, 1), rows=rows), f, indent=2)
    B, H, T, D = a.shape
    md = [f"# RMSE against FP64, random inputs with outliers\n\n`{cmd}` ({time.time() - t0:.0f} s, torch "
          f"{torch.__version__}). Q, K, V ~ N(0, 1) with 0.1% of entries ~ N(0, 100); dO ~ N(0, 1); B={B} H={H} "
          f"T={T} D={D}, causal, block 64; mean over {a.seeds} seeds.\n\n"
          "| recipe | variant | O | dQ | dK | dV | fp8_saturated |\n|---|---|---|---|---|---|---|\n"]
    md += [f"| {r['recipe']} | {r['variant']} | {r['o']:.3e} | {r['dq']:.3e} | {r['dk']:.3e} | {r['dv']:.3e} | "
           f"{r['fp8_saturated']} |\n" for r in rows]
    with open(os.path.join(a.out, "rmse.md"), "w") as f:
        f.write("".join(md))
    print("".join(md))
    return 0 if all(math.isfinite(r["o"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
