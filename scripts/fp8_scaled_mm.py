"""The fp8_fa3 recipe's P̄V product against real FP8 hardware: torch._scaled_mm (e4m3 x e4m3, FP32 out) vs the
emulator's rounding of the same product (kernels/formats.py: P̄ scaled by 2^8 and cast to e4m3, V cast to e4m3 with
its per-(batch, head) descale, an FP32 GEMM of the dequantized values).

Both sides get the same quantized operands, so what differs is only how the product of FP8 values is accumulated
and descaled. Reported per case: the share of output elements whose FP32 bits are identical, the max and mean
relative difference, and each side's max error against the exact (FP64) product of the same quantized operands,
with the tensor cores' default and fast (use_fast_accum) accumulation.
Cases: random scores, and scores with repeated row maxima (P̄ = 1 at several keys, the paper's regime).

    python scripts/fp8_scaled_mm.py [--out results/gpu_round4/fp8_scaled_mm.json]   # needs an FP8 GPU (sm_89+)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flash_forensics.kernels import formats as fmt  # noqa: E402

E4M3 = torch.float8_e4m3fn
PBAR_SCALE = fmt.PBAR_SCALES["fa3"]  # 2^8


def pbar_and_v(case: str, M: int, N: int, D: int, seed: int, device):
    """P̄ = exp(S - rowmax) in FP32 (M, N) and V (N, D) in BF16, for one (batch, head)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(M, D, generator=g)
    k = torch.randn(N, D, generator=g)
    if case == "repeated_maxima":  # every fourth key a copy of key 0: rows whose max is that key see it 1 + N/4 times
        k[::4] = k[0]
        q += 6.0 * k[0] / k[0].norm()
    s = (q @ k.T) / D ** 0.5
    pbar = torch.exp(s - s.amax(dim=1, keepdim=True))
    v = torch.randn(N, D, generator=g).to(torch.bfloat16)
    return pbar.to(device), v.to(device)


def compare(case: str, M: int, N: int, D: int, seed: int) -> dict:
    dev = torch.device("cuda")
    pbar, v = pbar_and_v(case, M, N, D, seed, dev)
    v32 = v.float()
    v_scale = fmt.amax_scale(v32, E4M3, (0, 1))  # the emulator's per-(batch, head) scale: 448 / amax
    # the emulator: quantize = cast(x * s) / s in FP32, then an FP32 GEMM (IEEE, no TF32)
    p_q = fmt.quantize(pbar, E4M3, PBAR_SCALE)
    v_q = fmt.quantize(v32, E4M3, v_scale)
    emulated = p_q @ v_q
    # the hardware: the same e4m3 codes, an FP8 tensor-core GEMM with FP32 output and the descales as scales
    p8 = fmt.cast(pbar * PBAR_SCALE, E4M3).to(E4M3)
    v8 = fmt.cast(v32 * v_scale, E4M3).to(E4M3)
    assert torch.equal(p8.float() / PBAR_SCALE, p_q) and torch.equal(v8.float() / v_scale, v_q)
    exact = p_q.double() @ v_q.double()
    denom = exact.abs().clamp_min(1e-30)
    row = {"case": case, "M": M, "N": N, "D": D, "seed": seed,
           "pbar_eq_1_share": (p_q == 1.0).float().mean().item(),
           "emulator_max_rel_err_vs_fp64": ((emulated.double() - exact).abs() / denom).max().item(),
           "emulator_mean_abs_err_vs_fp64": (emulated.double() - exact).abs().mean().item()}
    for fast in (False, True):  # use_fast_accum: the tensor cores' own accumulation, as fused FP8 kernels run it
        tag = "fast_accum" if fast else "accum"
        hw = torch._scaled_mm(p8, v8.T.contiguous().T, scale_a=torch.tensor(1.0 / PBAR_SCALE, device=dev),
                              scale_b=(1.0 / v_scale).reshape(()).float(), out_dtype=torch.float32,
                              use_fast_accum=fast)
        rel = (hw.double() - emulated.double()).abs() / denom
        row.update({f"{tag}_bit_identical_share": (hw.view(torch.int32) == emulated.view(torch.int32))
                    .float().mean().item(),
                    f"{tag}_rel_diff_max": rel.max().item(), f"{tag}_rel_diff_mean": rel.mean().item(),
                    f"{tag}_hw_max_rel_err_vs_fp64": ((hw.double() - exact).abs() / denom).max().item(),
                    f"{tag}_hw_mean_abs_err_vs_fp64": (hw.double() - exact).abs().mean().item()})
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu_round4" / "fp8_scaled_mm.json"))
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("fp8_scaled_mm: needs a CUDA GPU with FP8 (compute capability >= 8.9)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    rows = [compare(case, 128, n, 64, seed) for case in ("random", "repeated_maxima") for n in (128, 1024)
            for seed in range(args.seeds)]
    doc = {"command": "python scripts/fp8_scaled_mm.py", "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "wall_s": time.perf_counter() - t0, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"{'case':16s} {'N':>5s} {'seed':>4s} {'P̄=1':>6s} {'identical':>9s} {'fast id.':>9s} {'rel max':>9s} "
          f"{'hw err':>9s} {'fast err':>9s} {'emu err':>9s}")
    for r in rows:
        print(f"{r['case']:16s} {r['N']:5d} {r['seed']:4d} {r['pbar_eq_1_share']:6.3f} "
              f"{r['accum_bit_identical_share']:9.4f} {r['fast_accum_bit_identical_share']:9.4f} "
              f"{r['accum_rel_diff_max']:9.2e} {r['accum_hw_max_rel_err_vs_fp64']:9.2e} "
              f"{r['fast_accum_hw_max_rel_err_vs_fp64']:9.2e} {r['emulator_max_rel_err_vs_fp64']:9.2e}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
