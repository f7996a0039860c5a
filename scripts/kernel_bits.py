"""The Triton kernels' bits on a fixed set of cases, recorded and compared: does a change to kernels/ leave what the
existing recipes compute unchanged, bit for bit?

    python scripts/kernel_bits.py record OUT [--device cuda|cpu] [--cases full|small] [--tensors FILE.pt]
                                             [--exp ex2_approx|ex2_approx_ftz]
    python scripts/kernel_bits.py compare A.json B.json [--tensors A.pt B.pt]

`record` runs each case's forward and backward through the Triton route (flash_attention_triton: the ops a model
calls) on seeded inputs with exact ties (repeated row maxima, so counters and SFA fire) and writes OUT.json: per
case its knobs, shape, layout, and a SHA-256 of every output (O, dQ, dK, dV, and the counters when on), with the
versions, the device and the tree's commit. `--tensors` also saves the outputs (for `compare` to say by how much two
records differ). `--device cpu` runs Triton's interpreter (TRITON_INTERPRET=1: BF16 is not the GPU's there, but it
is deterministic, so two trees still compare).

`compare` says, case by case, which outputs differ (with --tensors: how many elements and the largest difference),
which cases only one record has, and exits 1 when an output of a common case differs or a case of A is missing in B.
A new kernel knob must leave every case here bit-identical: the paper_1gpu baseline's divergence at step 9,697
depends on every bit of paper_bf16 at 128x128 tiles. `bash scripts/gpu.sh patch-tests` records this tree and the
patched copy on the same GPU and compares them (kernel_bits.log). `--exp ex2_approx_ftz` records the kernels with
exp on ex2.approx.ftz (kernels/triton_launch.py exp_instruction), to compare with a default record of the same GPU
(`BITS_EXP=ex2_approx_ftz bash scripts/gpu.sh bits`); the interpreter's exp is NumPy's either way.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, knobs, (B, H, T, D), layout[, input scale]): every knob exists in the kernels as of this file; a patch may
# add knobs, never change what these compute. layout bthd: q, k, v as views of one fused projection (the GPT's own
# layout). The input scale (default 2) multiplies q, k and v: at 24 the scores spread over thousands, as the paper
# regime's reach (max logits up to 38,400 in layer 1), so P and P̄ underflow, some of them through FP32's denormals
# (exp(x) for x in (-103.3, -87.3)): the cases where an exp that flushes denormals to zero would differ.
FULL = (
    ("paper_1gpu", dict(recipe="paper_bf16", block_q=128, block_k=128, counters=True), (2, 4, 384, 64), "bthd"),
    ("paper_bf16", dict(recipe="paper_bf16", counters=True), (2, 4, 300, 64), "bhtd"),
    ("paper_bf16_pv_fp32", dict(recipe="paper_bf16", pv_fp32=True, counters=True), (1, 4, 256, 64), "bhtd"),
    ("paper_bf16_o_fp32_head0", dict(recipe="paper_bf16", o_fp32_heads=[0], counters=True), (1, 4, 256, 64), "bhtd"),
    ("paper_bf16_recompute_fp32", dict(recipe="paper_bf16", delta="recompute_fp32"), (1, 4, 256, 64), "bhtd"),
    ("paper_bf16_untiled", dict(recipe="paper_bf16", tiling=False, counters=True), (1, 4, 256, 64), "bhtd"),
    ("paper_bf16_sfa", dict(recipe="paper_bf16", softmax="stabilized", counters=True), (1, 4, 256, 64), "bhtd"),
    ("fa2", dict(recipe="fa2"), (2, 4, 384, 64), "bthd"),
    ("fa2_counters", dict(recipe="fa2", counters=True), (2, 4, 300, 64), "bhtd"),
    ("fa2_sfa", dict(recipe="fa2", softmax="stabilized", counters=True), (1, 4, 256, 64), "bhtd"),
    ("fa2_d128", dict(recipe="fa2", counters=True), (1, 2, 256, 128), "bhtd"),
    ("paper_bf16_d128", dict(recipe="paper_bf16", counters=True), (1, 2, 256, 128), "bhtd"),
    ("fa2_keypad", dict(recipe="fa2", counters=True), (2, 4, 256, 64), "keypad"),
    ("fp32", dict(recipe="fp32", counters=True), (1, 2, 256, 64), "bhtd"),
    ("fp32_tf32x3", dict(recipe="fp32", fp32_gemm="tf32x3"), (1, 2, 256, 64), "bhtd"),
    ("paper_1gpu_large_logits", dict(recipe="paper_bf16", block_q=128, block_k=128, counters=True), (1, 4, 384, 64),
     "bthd", 24.0),
    ("fa2_large_logits", dict(recipe="fa2", counters=True), (1, 4, 256, 64), "bhtd", 24.0),
)
SMALL = (  # the interpreter's (CPU) cases: tiny shapes, tiles of 16
    ("paper_bf16", dict(recipe="paper_bf16", block_q=16, block_k=16, counters=True), (1, 2, 40, 16), "bthd"),
    ("fa2_sfa", dict(recipe="fa2", softmax="stabilized", block_q=16, block_k=16, counters=True), (1, 2, 40, 16),
     "bhtd"),
    ("fp32_keypad", dict(recipe="fp32", block_q=16, block_k=16, counters=True), (2, 2, 40, 16), "keypad"),
)
CASES = {"full": FULL, "small": SMALL}
COUNTERS = ("repeated_max_rows", "max_logit", "underflow_rows")


def _inputs(shape, layout: str, dtype, device, seed: int, scale: float = 2.0):
    """q, k, v (B, H, T, D) with exact ties: every 7th key repeats the key before it, so rows attending both see
    their row max twice; scaled (`scale`) so that BF16 scores are coarse. bthd: views of one (B, T, 3, H, D)
    tensor."""
    import torch
    B, H, T, D = shape
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3, H, D, generator=g) * scale
    qkv[:, 6::7, 1] = qkv[:, 5:T - 1:7, 1][:, :qkv[:, 6::7, 1].shape[1]]
    qkv = qkv.to(dtype)
    if layout == "bthd":
        qkv = qkv.to(device)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    else:
        q, k, v = (qkv[:, :, i].transpose(1, 2).contiguous().to(device) for i in range(3))
    do = (torch.randn(B, H, T, D, generator=g) * 0.1).to(device)
    keep = None
    if layout == "keypad":  # left padding: batch element b misses its first 5 * b keys
        keep = torch.ones(B, T, dtype=torch.bool)
        for b in range(B):
            keep[b, :5 * b] = False
        keep = keep.to(device)
    return q, k, v, do, keep


def _digest(t) -> str:
    import torch
    t = t.detach().reshape(-1).contiguous().cpu()  # 0-d tensors (max_logit) cannot be viewed as bytes
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _run_case(knobs_kw, shape, layout, device, seed, scale: float = 2.0):
    import torch

    from flash_forensics.kernels.config import AttentionKnobs
    from flash_forensics.kernels.stats import AttnStats
    from flash_forensics.kernels.triton_flash import flash_attention_triton, supports
    knobs = AttentionKnobs(impl="flash", backend="triton", **knobs_kw).validate(shape[1])
    dtype = torch.float32 if knobs.recipe == "fp32" else torch.bfloat16
    q, k, v, do, keep = _inputs(shape, layout, dtype, device, seed, scale)
    if not supports(knobs, q):
        raise SystemExit(f"case knobs {knobs_kw} at shape {shape}: the Triton kernels here do not compute them")
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    stats = AttnStats(shape[1], device=device) if knobs.counters else None
    o = flash_attention_triton(q, k, v, knobs, stats, key_keep=keep)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do.to(o.dtype))
    out = {"o": o, "dq": dq, "dk": dk, "dv": dv}
    if stats is not None:
        out.update({c: getattr(stats, c) for c in COUNTERS})
    return {n: t.detach() for n, t in out.items()}


def _env(device: str) -> dict:
    import torch
    env = dict(python=platform.python_version(), torch=torch.__version__, device=device)
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["gpu"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    env["launch_table"] = os.environ.get("FF_LAUNCH_TABLE")  # a tune JSON's launch configs (speed-only), if any
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                       timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        env["kernels_modified"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


def record(out: str, device: str, cases: str, tensors_path=None, seed: int = 0, exp: str = "ex2_approx") -> dict:
    import torch

    from flash_forensics.kernels.triton_launch import exp_instruction
    doc = dict(env=_env(device), cases_set=cases, seed=seed, exp_instruction=exp, cases={})
    saved = {}
    for name, kw, shape, layout, *scale in CASES[cases]:
        scale = scale[0] if scale else 2.0
        with exp_instruction(exp):  # per case: each prints as it ends (a long GPU record shows its progress)
            outs = _run_case(kw, shape, layout, device, seed, scale)
        doc["cases"][name] = dict(knobs=kw, shape=list(shape), layout=layout, input_scale=scale,
                                  outputs={n: dict(sha256=_digest(t), dtype=str(t.dtype).replace("torch.", ""),
                                                   shape=list(t.shape)) for n, t in outs.items()})
        saved[name] = {n: t.cpu() for n, t in outs.items()}
        print(f"[kernel_bits] {name}: {', '.join(outs)}", flush=True)
    path = out if out.endswith(".json") else out + ".json"
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    if tensors_path:
        torch.save(saved, tensors_path)
    print(f"[kernel_bits] {len(doc['cases'])} cases on {doc['env']['gpu']} -> {path}", flush=True)
    return doc


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such file (expected a record written by `kernel_bits.py record`)") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not JSON ({e.msg}, line {e.lineno}): expected a `kernel_bits.py record` file") \
            from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), dict):
        raise SystemExit(f"{path}: no 'cases' table: expected a record written by `kernel_bits.py record`")
    return doc


def _how_far(a, b) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    x, y = a.double(), b.double()
    same = (x == y) | (x.isnan() & y.isnan())
    n = int((~same).sum())
    d = (x - y).abs().masked_fill(same, 0).nan_to_num(nan=float("inf"))
    return f"{n} of {a.numel()} elements differ, largest |diff| {float(d.max()):.3g}" if n else "equal values"


def compare(a_path: str, b_path: str, tensors=None) -> int:
    """Print the differences; 0 when every case of A is in B with the same bits, else 1."""
    import torch
    a, b = _load(a_path), _load(b_path)
    ta = tb = None
    if tensors:
        ta, tb = (torch.load(p, map_location="cpu", weights_only=True) for p in tensors)
    for side, doc in (("A", a), ("B", b)):
        e = doc.get("env", {})
        print(f"[kernel_bits] {side}: {e.get('gpu')}, torch {e.get('torch')}, triton {e.get('triton')}, "
              f"commit {str(e.get('commit'))[:10]}{' (kernels/ modified)' if e.get('kernels_modified') else ''}")
    ea, eb = a.get("env", {}), b.get("env", {})
    if any(ea.get(k) != eb.get(k) for k in ("gpu", "torch", "triton")):
        print("[kernel_bits] note: the two records differ in GPU or versions; bits may differ for that reason alone")
    bad = 0
    for name, ca in a["cases"].items():
        cb = b["cases"].get(name)
        if cb is None:
            print(f"  {name}: MISSING in B")
            bad += 1
            continue
        if ca.get("knobs") != cb.get("knobs") or ca.get("shape") != cb.get("shape"):
            print(f"  {name}: NOT THE SAME CASE (A {ca.get('knobs')} {ca.get('shape')}, B {cb.get('knobs')} "
                  f"{cb.get('shape')})")
            bad += 1
            continue
        diffs = []
        for out, ha in ca["outputs"].items():
            hb = cb["outputs"].get(out)
            if hb is None or hb["sha256"] != ha["sha256"]:
                how = "absent in B" if hb is None else "differs"
                if hb is not None and ta is not None and name in ta and name in tb:
                    how = _how_far(ta[name][out], tb[name][out])
                diffs.append(f"{out} ({how})")
        if diffs:
            bad += 1
            print(f"  {name}: DIFFERENT: {'; '.join(diffs)}")
        else:
            print(f"  {name}: identical ({', '.join(ca['outputs'])})")
    extra = sorted(set(b["cases"]) - set(a["cases"]))
    if extra:
        print(f"  only in B (not compared): {', '.join(extra)}")
    n = len(a["cases"])
    print(f"[kernel_bits] {n - bad} of {n} cases identical" + ("" if not bad else f"; {bad} not: exit 1"))
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the cases, write OUT.json")
    r.add_argument("out", help="the record's path (.json added when missing)")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--cases", choices=tuple(CASES), default=None,
                   help="full (default on cuda) or small (default on cpu: the interpreter is slow)")
    r.add_argument("--tensors", default=None, help="also save the outputs here (.pt), for compare --tensors")
    r.add_argument("--seed", type=int, default=0)
    # kernels/triton_launch.py EXP_INSTRUCTIONS, spelled out: importing it here would import triton before
    # --device cpu can set TRITON_INTERPRET
    r.add_argument("--exp", choices=("ex2_approx", "ex2_approx_ftz"), default="ex2_approx",
                   help="exp's instruction in the kernels (default tl.exp's ex2_approx)")
    c = sub.add_parser("compare", help="compare two records; exit 1 on any difference")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--tensors", nargs=2, metavar=("A.pt", "B.pt"), default=None)
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.a, args.b, args.tensors)
    if args.device == "cpu":  # the interpreter must be on before triton is first imported
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--device cpu: triton was imported before TRITON_INTERPRET=1 could be set; run in a new process")
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        import torch
        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA GPU here (--device cpu runs Triton's interpreter)")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    record(args.out, args.device, args.cases or ("full" if args.device == "cuda" else "small"), args.tensors,
           args.seed, args.exp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
