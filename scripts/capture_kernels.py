"""Capture real attention kernels, forward and backward, on a fixed set of inputs: one snapshot per (kernel, inputs,
head dim, causal), for `flash-forensics analyze` on a CPU (GPU side of the real-kernel fingerprints).

    python scripts/capture_kernels.py --out DIR [--T 256] [--heads 2]          # needs a CUDA GPU

Kernels: torch SDPA with each backend forced (flash = FlashAttention-2, cudnn, efficient, math; a backend that
refuses a case is listed with its error, nothing falls back), the project's Triton paper_bf16 and fa2 (causal only:
the kernels are causal), all BF16 in and out. Inputs (flash_forensics.capture.synthetic, seed 0): random; repeated
maxima; repeated maxima with V shifted to -2 (the paper's negative-V case). D 64 and 128; causal and not. Each
snapshot holds q, k, v, O, dO and the kernel's own dQ, dK, dV from the same call (snapshot.OPTIONAL), the device,
torch/triton/cuDNN versions and which backend ran. Beside them: fp8_scaled_mm.pt, P̄ and V quantized to e4m3
(P̄ scaled by 2^8, V by its per-head amax) and torch._scaled_mm's FP32 products with the default and the fast
accumulation, for a model of Hopper's FP8 accumulation. index.json lists every file.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flash_forensics.capture.recorder import write_call  # noqa: E402
from flash_forensics.capture.synthetic import random_inputs, tied_inputs  # noqa: E402
from flash_forensics.kernels import formats as fmt  # noqa: E402
from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402


def inputs(name: str, B: int, H: int, T: int, D: int):
    if name == "random":
        return random_inputs(B, H, T, D, seed=0)
    q, k, v, do = tied_inputs(B, H, T, D, seed=0)
    if name == "negative_v":
        v = (v.float() - 2.5).to(torch.bfloat16)  # mostly negative V (mean -2): the sticky-bit round-up case
    return q, k, v, do


def sdpa_fn(backend_name: str, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend_name]

    def run(q, k, v):
        with sdpa_kernel(backend):  # only this backend: it runs or raises
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def triton_fn(recipe: str):
    from flash_forensics.kernels.triton_flash import flash_attention_triton
    knobs = AttentionKnobs(recipe=recipe, backend="triton", counters=False)
    return lambda q, k, v: flash_attention_triton(q, k, v, knobs), knobs


def fp8_products(out: Path, dev) -> dict:
    """P̄V operands in e4m3 and torch._scaled_mm's products (default and fast accumulation), random and tied."""
    e4m3 = torch.float8_e4m3fn
    res = {}
    g = torch.Generator().manual_seed(0)
    for case in ("random", "repeated_maxima"):
        q, k = torch.randn(128, 64, generator=g), torch.randn(256, 64, generator=g)
        if case == "repeated_maxima":
            k[::4] = k[0]
            q += 6.0 * k[0] / k[0].norm()
        s = q @ k.T / 8.0
        pbar = torch.exp(s - s.amax(1, keepdim=True)).to(dev)
        v = torch.randn(256, 64, generator=g).to(torch.bfloat16).float().to(dev)
        v_scale = fmt.amax_scale(v, e4m3, (0, 1))
        p8 = fmt.cast(pbar * fmt.PBAR_SCALES["fa3"], e4m3).to(e4m3)
        v8 = fmt.cast(v * v_scale, e4m3).to(e4m3)
        one = torch.ones((), device=dev)
        vt = v8.t().contiguous().t()  # _scaled_mm wants the second operand column-major
        prods = {fast: torch._scaled_mm(p8, vt, scale_a=one, scale_b=one, out_dtype=torch.float32,
                                        use_fast_accum=fast) for fast in (False, True)}
        res[case] = dict(p8=p8.view(torch.uint8).cpu(), v8=v8.view(torch.uint8).cpu(),
                         pbar_scale=fmt.PBAR_SCALES["fa3"], v_scale=float(v_scale), out=prods[False].cpu(),
                         out_fast=prods[True].cpu())
    torch.save(res, out / "fp8_scaled_mm.pt")
    return {c: {k: list(t.shape) for k, t in d.items() if torch.is_tensor(t)} for c, d in res.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--heads", type=int, default=2)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("scripts/capture_kernels.py needs a CUDA GPU")
    import triton
    dev = torch.device("cuda")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    index = dict(command="python scripts/capture_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv),
                 gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                 cudnn=torch.backends.cudnn.version(), time=time.strftime("%Y-%m-%dT%H:%M:%S"), files=[], refused=[])
    B, H, T = 1, a.heads, a.T
    for inp in ("random", "tied", "negative_v"):
        for D in (64, 128):
            base = [t.to(dev) for t in inputs(inp, B, H, T, D)]
            for causal in (True, False):
                kernels = [(f"sdpa_{b}", sdpa_fn(b, causal), None) for b in ("flash", "cudnn", "efficient", "math")]
                if causal:
                    kernels += [(f"triton_{r}", *triton_fn(r)) for r in ("paper_bf16", "fa2")]
                for name, fn, knobs in kernels:
                    q, k, v = (t.clone().requires_grad_() for t in base[:3])
                    do = base[3]
                    try:
                        o = fn(q, k, v)
                        o.backward(do)
                    except Exception as e:  # a backend refusing a case: listed, nothing falls back
                        index["refused"].append(dict(kernel=name, inputs=inp, D=D, causal=causal,
                                                     error=f"{type(e).__name__}: {e}"[:300]))
                        continue
                    torch.cuda.synchronize()
                    fname = f"{name}-{inp}-D{D}-{'causal' if causal else 'full'}.safetensors"
                    write_call(out / fname, q.detach(), k.detach(), v.detach(), o.detach(), do,
                               recipe=knobs.recipe if knobs is not None else None,
                               knobs=knobs.knob_values() if knobs is not None else None,
                               family="sdpa" if name.startswith("sdpa") else "triton", layer=0,
                               implementation=name, is_causal=causal, dq=q.grad, dk=k.grad, dv=v.grad,
                               kernel=name, inputs=inp, say=None)
                    index["files"].append(dict(file=fname, kernel=name, inputs=inp, D=D, causal=causal))
                    print(f"captured {fname}", flush=True)
    index["fp8"] = fp8_products(out, dev)
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"{len(index['files'])} captures, {len(index['refused'])} refused, in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
