"""The real-kernel fingerprint table: for each capture of scripts/capture_kernels.py (a folder with index.json), the
closest candidate of flash_forensics.capture.fingerprint (the recipes, their knob variants and the real-kernel rules
of kernels/real_kernels.py) by identical O elements, the kernel's own rule beside it, and the share of the kernel's
own dQ, dK, dV that the emulator's backward of each reproduces (from the captured O and dO); plus the tensor-core
models of kernels/tensor_core.py against torch._scaled_mm's FP8 products (fp8_scaled_mm.pt). CPU only.

    python scripts/real_kernel_table.py --captures DIR [--out results/real_kernels] [--refine 0]
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

from flash_forensics.capture import fingerprint as fp  # noqa: E402
from flash_forensics.capture import snapshot as snap_io  # noqa: E402
from flash_forensics.kernels import real_kernels, tensor_core  # noqa: E402
from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402

OWN_RULE = {"sdpa_flash": "torch_flash_sm90", "sdpa_cudnn": "cudnn_sm90", "sdpa_efficient": "efficient_sm90",
            "triton_paper_bf16": "triton_paper_bf16", "triton_fa2": "triton_fa2"}
TARGET = {"sdpa_flash": 0.9999, "sdpa_cudnn": 0.9999, "sdpa_efficient": 0.9999, "triton_paper_bf16": 0.99999,
          "triton_fa2": 0.99999}


def backward_shares(snap, knobs, causal: bool) -> dict:
    if snap.tensors.get("dq") is None or snap.do is None:
        return {}
    grads = {n: snap.tensors[n] for n in ("dq", "dk", "dv")}
    return fp.backward_shares(snap.q, snap.k, snap.v, snap.o, snap.do, grads, knobs, causal)


def one(path: Path, entry: dict, refine: int) -> dict:
    snap = snap_io.read(path)
    causal = entry["causal"]
    ranked = fp.run(snap.q, snap.k, snap.v, snap.o, None, refine_rounds=refine, causal=causal)
    best = ranked[0]
    row = dict(entry, best=best["label"], best_o=best["o_identical"], best_o_differ=best["o_differ"],
               o_elements=best["o_elements"], candidates=len(ranked))
    row["best_bwd"] = backward_shares(snap, AttentionKnobs(**best["knobs"]), causal)
    rule = OWN_RULE.get(entry["kernel"])
    if rule:
        mine = next(r for r in ranked if r["label"].startswith(rule + ":"))
        row.update(rule=rule, rule_o=mine["o_identical"], rule_o_differ=mine["o_differ"],
                   rule_bwd=backward_shares(snap, AttentionKnobs(**mine["knobs"]), causal))
    return row


def fp8_rows(path: Path) -> list:
    data = torch.load(path)
    rows = []
    for case, d in data.items():
        p8 = d["p8"].view(torch.float8_e4m3fn).float()
        v8 = d["v8"].view(torch.float8_e4m3fn).float()
        models = {"exact FP32 GEMM (fp8_fa3 today)": p8 @ v8}
        for kind in ("sm90", "sm90_fast_fp8"):
            models[f"tensor_core={kind}"] = tensor_core.matmul(p8, v8, None, *tensor_core.params(kind, True))
        for name, got in models.items():
            rows.append(dict(case=case, model=name, vs_default=fp.identical_share(d["out"], got),
                             vs_fast=fp.identical_share(d["out_fast"], got)))
    return rows


def _p(x) -> str:
    return "-" if x is None else ("100%" if x == 1 else f"{100 * x:.4f}%")


def markdown(rows: list, fp8: list, meta: dict) -> str:
    out = ["# Real kernels fingerprinted bit for bit", "",
           f"Captures: `{meta['capture_command']}` on an {meta['gpu']} (torch {meta['torch']}, triton "
           f"{meta['triton']}, cuDNN {meta['cudnn']}), {meta['captured']}; B1 H2 T256, BF16. Table: "
           f"`{meta['command']}` ({meta['elapsed_s']:.0f} s on a CPU).", "",
           "best: the closest of every candidate (recipes, knob variants, real-kernel rules); rule: the kernel's own "
           "rule (kernels/real_kernels.py). O, dQ, dK, dV: share of elements bit-identical (integer counts).", "",
           "| kernel | inputs | D | causal | best candidate | O | O differ | rule | rule O | rule dQ | rule dK | "
           "rule dV |", "|---|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        rb = r.get("rule_bwd") or {}
        out.append(f"| {r['kernel']} | {r['inputs']} | {r['D']} | {'causal' if r['causal'] else 'full'} | "
                   f"`{r['best']}` | {_p(r['best_o'])} | {r['best_o_differ']} | {r.get('rule', '-')} | "
                   f"{_p(r.get('rule_o'))} | {_p(rb.get('dq'))} | {_p(rb.get('dk'))} | {_p(rb.get('dv'))} |")
    out += ["", "## Per kernel: worst case of its own rule against the target", "",
            "| kernel | rule | min O share | target | met |", "|---|---|---:|---:|---|"]
    for kern, rule in OWN_RULE.items():
        mine = [r["rule_o"] for r in rows if r["kernel"] == kern and "rule_o" in r]
        if mine:
            out.append(f"| {kern} | {rule} | {_p(min(mine))} | {_p(TARGET[kern])} | "
                       f"{'yes' if min(mine) >= TARGET[kern] else 'no'} |")
    out += ["", "## FP8: torch._scaled_mm (e4m3 x e4m3 -> FP32, unit scales) against the models", "",
            "| case | model | identical to default accumulation | identical to use_fast_accum |",
            "|---|---|---:|---:|"]
    for r in fp8:
        out.append(f"| {r['case']} | {r['model']} | {_p(r['vs_default'])} | {_p(r['vs_fast'])} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--captures", required=True, help="folder written by scripts/capture_kernels.py")
    ap.add_argument("--out", default=str(ROOT / "results" / "real_kernels"))
    ap.add_argument("--refine", type=int, default=0, help="greedy refinement rounds of the fingerprint (default 0)")
    ap.add_argument("--only", default=None, help="only files whose name contains this")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    cap = Path(a.captures)
    index = json.loads((cap / "index.json").read_text())
    rows = []
    for entry in index["files"]:
        if entry["kernel"] == "sdpa_math" or (a.only and a.only not in entry["file"]):
            continue  # math: torch's unfused BF16 ops, no flash kernel to model
        rows.append(one(cap / entry["file"], entry, a.refine))
        print(f"{entry['file']}: {rows[-1]['best']} {_p(rows[-1]['best_o'])}; rule {_p(rows[-1].get('rule_o'))}",
              flush=True)
    fp8 = fp8_rows(cap / "fp8_scaled_mm.pt") if (cap / "fp8_scaled_mm.pt").exists() else []
    meta = dict(capture_command="python scripts/capture_kernels.py", gpu=index.get("gpu"), torch=index.get("torch"),
                triton=index.get("triton"), cudnn=index.get("cudnn"), captured=index.get("time"),
                command="python scripts/real_kernel_table.py " + " ".join(sys.argv[1:] if argv is None else argv),
                elapsed_s=time.time() - t0, rules={k: v.__name__ for k, v in real_kernels.RULES.items()})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(dict(meta=meta, rows=rows, fp8=fp8), indent=1) + "\n")
    (out / "table.md").write_text(markdown(rows, fp8, meta))
    print(markdown(rows, fp8, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
