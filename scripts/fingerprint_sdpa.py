"""Fingerprint torch's own SDPA on this machine: capture one BF16 causal call (random, then repeated-maxima inputs)
through the SDPA wrapper and say which emulated recipe comes closest, and how close. Prints a Markdown table and
writes it to --out (default results/capture_default/sdpa_fingerprint.md).

    python scripts/fingerprint_sdpa.py [--shape 2 4 256 64] [--device cpu]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[2, 4, 256, 64], metavar=("B", "H", "T", "D"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "results" / "capture_default" / "sdpa_fingerprint.md"))
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)  # see flash_forensics.capture --threads
    import flash_forensics
    from flash_forensics.capture.analysis import analyze
    from flash_forensics.capture.synthetic import random_inputs, tied_inputs
    B, H, T, D = args.shape
    lines = [f"# torch SDPA fingerprinted ({args.device}, BF16, causal, B={B} H={H} T={T} D={D})", "",
             f"Command: `python scripts/fingerprint_sdpa.py {' '.join(sys.argv[1:] if argv is None else argv)}`; "
             f"torch {torch.__version__}", "", "| inputs | closest candidate | O identical | mean abs diff | "
             "next | O identical |", "|---|---|---:|---:|---|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, gen in (("random", random_inputs), ("repeated maxima", tied_inputs)):
            q, k, v, do = (t.to(args.device) for t in gen(B, H, T, D, seed=0))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            with flash_forensics.capture(Path(tmp) / name.replace(" ", "_"), sdpa=True, say=None) as cap:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(do)
            res = analyze(cap.paths[0], progress=False, attribute=False)
            c = res["fingerprint"]["candidates"]
            lines.append(f"| {name} | `{c[0]['label']}` | {100 * c[0]['o_identical']:.2f}% | "
                         f"{c[0]['o_mean_abs_diff']:.3g} | `{c[1]['label']}` | {100 * c[1]['o_identical']:.2f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
