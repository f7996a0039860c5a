"""The SDPA parity matrix: flash_forensics.attention (recipe fp32) against torch's scaled_dot_product_attention.

Each cell is the max absolute error over O and the gradients dq, dk, dv (loss sum(O * W), W a fixed random
tensor) of one configuration, in FP64 (FP64 inputs: the emulator computes in FP64) and in FP32 (FP32 inputs, torch
SDPA in FP32). Rows: mask (none, causal, bool, additive float with -inf entries and a fully masked row), GQA
(H=4 query heads on 4 or 2 key heads), lengths (Tq = Tk, Tq < Tk as in a KV cache, Tq > Tk; odd T); columns: head dims.
Tiles of 16 so every case spans several query and key tiles.

    python scripts/sdpa_parity.py [--out results/own_model/sdpa_parity.md]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flash_forensics.sdpa import attention  # noqa: E402

HEAD_DIMS = (16, 32, 64, 128, 256)
LENGTHS = ((37, 37), (13, 37), (37, 13))
MASKS = ("none", "causal", "bool", "additive")


def case_inputs(mask: str, gqa: bool, tq: int, tk: int, d: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hk = 2 if gqa else 4
    q = torch.randn(2, 4, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, hk, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, hk, tk, d, generator=g, dtype=torch.float64)
    w = torch.randn(2, 4, tq, d, generator=g, dtype=torch.float64)
    m = None
    if mask == "bool":  # per batch, shared by heads; row 3 of batch 1 sees no key at all
        m = torch.rand(2, 1, tq, tk, generator=g) > 0.4
        m[..., 0] = True
        m[1, 0, 3] = False
    elif mask == "additive":  # a float bias broadcast over batch and heads, with -inf holes
        m = torch.randn(tq, tk, generator=g, dtype=torch.float64)
        m[torch.rand(tq, tk, generator=g) > 0.7] = float("-inf")
        m[:, 0] = 0.0
    cast = [x.to(dtype) for x in (q, k, v, w)]
    if m is not None and m.dtype != torch.bool:
        m = m.to(dtype)
    return cast, m


def max_error(mask: str, gqa: bool, tq: int, tk: int, d: int, dtype) -> float:
    (q, k, v, w), m = case_inputs(mask, gqa, tq, tk, d, dtype)
    causal = mask == "causal"
    out = []
    for fn in (lambda *a: attention(*a, attn_mask=m, is_causal=causal, enable_gqa=gqa, recipe="fp32", block_q=16,
                                    block_k=16),
               lambda *a: F.scaled_dot_product_attention(*a, attn_mask=m, is_causal=causal, enable_gqa=gqa)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = fn(*leaves)
        grads = torch.autograd.grad((o * w).sum(), leaves)
        out.append((o, *grads))
    return max((a - b).abs().max().item() for a, b in zip(*out, strict=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "own_model" / "sdpa_parity.md"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    lines = ["# SDPA parity: flash_forensics.attention (recipe fp32) vs torch scaled_dot_product_attention", "",
             "Max |error| over O, dq, dk, dv per cell, as `FP64 / FP32` (B=2, H=4, tiles 16x16, torch "
             f"{torch.__version__}, CPU). Command: `python scripts/sdpa_parity.py`.", "",
             "| mask | GQA (H/Hk) | Tq x Tk | " + " | ".join(f"D={d}" for d in HEAD_DIMS) + " |",
             "|---|---|---|" + "---|" * len(HEAD_DIMS)]
    worst = {torch.float64: 0.0, torch.float32: 0.0}
    for mask in MASKS:
        for gqa in (False, True):
            for tq, tk in LENGTHS:
                cells = []
                for d in HEAD_DIMS:
                    errs = {dt: max_error(mask, gqa, tq, tk, d, dt) for dt in worst}
                    for dt, e in errs.items():
                        worst[dt] = max(worst[dt], e)
                    cells.append(f"{errs[torch.float64]:.1e} / {errs[torch.float32]:.1e}")
                lines.append(f"| {mask} | {'4/2' if gqa else '4/4'} | {tq}x{tk} | " + " | ".join(cells) + " |")
    lines += ["", f"Worst cell: FP64 {worst[torch.float64]:.2e}, FP32 {worst[torch.float32]:.2e}. "
              f"Wall time {time.perf_counter() - t0:.0f} s.", ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
