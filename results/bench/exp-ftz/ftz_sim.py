"""python results/bench/exp-ftz/ftz_sim.py > results/bench/exp-ftz/ftz_sim.txt

Would an exp that flushes results below 2^-126 to zero move a bit of the large-logit kernel-bits cases? The emulator
(the kernels' source of truth) on a CPU, every torch.exp flushed vs kept."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
import kernel_bits as kb  # noqa: E402

from flash_forensics.kernels import emulator  # noqa: E402
from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402
from flash_forensics.kernels.stats import AttnStats  # noqa: E402

real_exp = torch.exp
TINY = 2.0 ** -126
def ftz_exp(x, *a, **k):
    r = real_exp(x, *a, **k)
    return torch.where(r.abs() < TINY, torch.zeros_like(r), r) if r.dtype == torch.float32 else r

def run(kw, shape, layout, scale, flush):
    knobs = AttentionKnobs(impl="flash", backend="emulator", **kw).validate(shape[1])
    dtype = torch.float32 if knobs.recipe == "fp32" else torch.bfloat16
    q, k, v, do, keep = kb._inputs(shape, layout, dtype, "cpu", 0, scale)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    torch.exp = ftz_exp if flush else real_exp
    try:
        st = AttnStats(shape[1], device="cpu")
        o = emulator.flash_attention(q, k, v, knobs, st)
        g = torch.autograd.grad(o, (q, k, v), do.to(o.dtype))
    finally:
        torch.exp = real_exp
    return dict(o=o.detach(), dq=g[0], dk=g[1], dv=g[2])

for name, kw, shape, layout, *sc in kb.FULL:
    if layout == "keypad":  # key padding: the kernels' route only (the emulator takes it as a mask)
        continue
    scale = sc[0] if sc else 2.0
    a, b = run(kw, shape, layout, scale, False), run(kw, shape, layout, scale, True)
    tiny = {n: int(((t.float().abs() < TINY) & (t != 0)).sum()) for n, t in a.items()}
    print(name, {n: int((a[n] != b[n]).sum()) for n in a}, "denormal outputs (kept):", tiny, flush=True)

print("magnitudes where they differ:")
for name, kw, shape, layout, *sc in kb.FULL:
    if "large" not in name:
        continue
    a, b = run(kw, shape, layout, sc[0], False), run(kw, shape, layout, sc[0], True)
    for n in ("dq", "dk", "dv"):
        d = a[n] != b[n]
        big = a[n].float().abs().max()
        print(name, n, "largest |value| differing:", float(a[n].float().abs()[d].max()), "of max", float(big))
