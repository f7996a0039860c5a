"""The paper's mechanism measured per recipe (format) on the CPU: P̄ = 1, ties and the delta error against FP64.

    python scripts/format_mechanism.py [--steps 40] [--out results/formats]

The default tiny model (conf/model/tiny.yaml) on fixed probe batches of the default corpus (the validation split,
orchestrator/monitor/probes' PROBE_SEED), at initialisation and after `--steps` optimizer steps on the default corpus.
It is trained with FP32 SDPA attention and FP32 everywhere else (as the CPU default trains outside attention), so every
recipe is measured on the same weights, Q, K, V and dO: per layer, the emulator's forward and backward in the
recipe (kernels/emulator.py), against FP64 attention of the same FP32 Q, K, V. Per recipe (summed / pooled over the
layers):
- pbar_one: P̄ entries stored as exactly 1 for the P̄V GEMM; rounded_to_one: those whose P̄ was < 1 before the store;
- tie_rows: query rows where some key tile stores P̄ = 1 at two or more keys (the repeated maxima the mechanism needs,
  read off the stored P̄, so FP8's rounding-made ties count); tie share: of sum(e) (signed) and of sum|e| (abs);
- delta error e = delta_recipe - delta_FP64 per row (kernels/probes.py's definition, delta = rowsum(dO * O) from the
  stored O): mean, t = mean / (std / sqrt(n));
- o_rel / dq_rel: ||O - O_64|| / ||O_64|| and the same for dQ; max_logit; the format counters (kernels/stats.py).
Writes <out>/mechanism.md and mechanism.json.
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

from flash_forensics.kernels import emulator  # noqa: E402
from flash_forensics.kernels.config import AttentionConfig, AttentionKnobs  # noqa: E402
from flash_forensics.kernels.probes import fp64_attention, fp64_dq  # noqa: E402
from flash_forensics.kernels.stats import FORMAT_COUNTERS, AttnStats  # noqa: E402

RECIPES = ("paper_bf16", "fa2", "fp16", "fp8_fa3", "fp8_te", "fp32")
F64 = torch.float64


def model_and_data(seed: int):
    from omegaconf import OmegaConf

    from flash_forensics.models.gpt import GPT
    from flash_forensics.orchestrator.data.config import DataConfig
    from flash_forensics.orchestrator.data.prepare import ensure_prepared
    tiny = OmegaConf.to_container(OmegaConf.load(os.path.join(ROOT, "conf", "model", "tiny.yaml")))
    torch.manual_seed(seed)
    model = GPT(tiny, AttentionConfig(impl="sdpa", recipe="fp32", counters=False))
    folder = ensure_prepared(DataConfig(), tiny["vocab_size"])
    return model, folder, tiny


def train(model, folder, block: int, steps: int, batch: int, lr: float) -> list:
    from flash_forensics.orchestrator.data.batches import BatchStream
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    losses = []
    model.train()
    with BatchStream(folder / "train.bin", block, batch, seed=1337) as stream:
        for step in range(steps):
            for g in opt.param_groups:  # linear warm-up over 10 steps, then cosine to lr / 10
                w = min(1.0, (step + 1) / 10)
                g["lr"] = lr * w * (0.55 + 0.45 * math.cos(math.pi * step / max(steps, 1)))
            x, y = stream.get(step)
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    return losses


def capture(model, batch):
    """Per layer (q, k, v, dO): the layer's own FP32 values on the probe batch (dO from the LM loss)."""
    caps = {}
    blocks = model.transformer.h
    def hook(i):
        return lambda x, q, k, v, o: caps.__setitem__(i, (q, k, v, o))

    for i, b in enumerate(blocks):
        b.attn.probe_capture = hook(i)
    model.eval()
    try:
        with torch.enable_grad():
            _, loss = model(*batch)
            outs = [caps[i][3] for i in range(len(blocks))]
            grads = torch.autograd.grad(loss, outs)
    finally:
        for b in blocks:
            b.attn.probe_capture = None
    return [(caps[i][0].detach(), caps[i][1].detach(), caps[i][2].detach(), grads[i].detach())
            for i in range(len(blocks))]


def _pbar_stats(trace, knobs, T: int, shape):
    """(stored P̄ = 1 entries, of them rounded up from < 1, tie rows (B, H, T) bool) from the forward's trace."""
    tie = torch.zeros(shape, dtype=torch.bool)
    one = up = 0
    pairs = iter(trace["pbar"])
    bq, bk = knobs.block_q, knobs.block_k
    for qs in range(0, T, bq):
        qe = min(qs + bq, T)
        for _ks in range(0, qe, bk):
            pre, post = next(pairs)
            ones = post == 1
            one += int(ones.sum())
            up += int((ones & (pre < 1)).sum())
            tie[:, :, qs:qe] |= ones.sum(dim=-1) >= 2
    return one, up, tie


@torch.no_grad()
def measure(layers, recipe: str) -> dict:
    knobs = AttentionKnobs(recipe=recipe, backend="emulator").validate()
    errs, ties = [], []
    acc = dict(pbar_one=0, rounded_to_one=0, o_num=0.0, o_den=0.0, dq_num=0.0, dq_den=0.0, max_logit=-math.inf,
               **{c: 0 for c in FORMAT_COUNTERS})
    for q, k, v, do in layers:
        B, H, T, D = q.shape
        st, trace = AttnStats(H), {}
        o, o_saved, lse = emulator.forward(q, k, v, knobs, st, trace=trace)
        delta = emulator.row_delta(q, k, v, o_saved, lse, do, knobs).squeeze(-1).to(F64)
        dq, _, _ = emulator.backward(q, k, v, o_saved, lse, do, knobs, stats=st)
        o64, p64, _ = fp64_attention(q, k, v)
        delta64 = (do.to(F64) * o64).sum(-1)
        dq64 = fp64_dq(p64, k, v, do, delta64)
        one, up, tie = _pbar_stats(trace, knobs, T, (B, H, T))
        errs.append((delta - delta64).flatten())
        ties.append(tie.flatten())
        acc["pbar_one"] += one
        acc["rounded_to_one"] += up
        acc["o_num"] += float((o.to(F64) - o64).norm() ** 2)
        acc["o_den"] += float(o64.norm() ** 2)
        acc["dq_num"] += float((dq.to(F64) - dq64).norm() ** 2)
        acc["dq_den"] += float(dq64.norm() ** 2)
        acc["max_logit"] = max(acc["max_logit"], float(st.max_logit))
        for c in FORMAT_COUNTERS:
            acc[c] += int(getattr(st, c).sum())
    e, tie = torch.cat(errs), torch.cat(ties)
    n = e.numel()
    mean = float(e.mean())
    std = float(e.std())
    tf = tie.to(F64)
    return dict(recipe=recipe, rows=n, tie_rows=int(tie.sum()), pbar_one=acc["pbar_one"],
                rounded_to_one=acc["rounded_to_one"], delta_err_mean=mean,
                delta_err_t=mean / (std / math.sqrt(n)) if std > 0 else 0.0,
                tie_share_signed=float((e * tf).sum() / e.sum()) if float(e.sum()) else float("nan"),
                tie_share_abs=float((e.abs() * tf).sum() / e.abs().sum()) if float(e.abs().sum()) else float("nan"),
                o_rel=math.sqrt(acc["o_num"] / acc["o_den"]), dq_rel=math.sqrt(acc["dq_num"] / acc["dq_den"]),
                max_logit=acc["max_logit"], **{c: acc[c] for c in FORMAT_COUNTERS})


COLS = [("recipe", "{}"), ("tie_rows", "{:d}"), ("pbar_one", "{:d}"), ("rounded_to_one", "{:d}"),
        ("delta_err_mean", "{:+.3e}"), ("delta_err_t", "{:+.2f}"), ("tie_share_signed", "{:+.3f}"),
        ("tie_share_abs", "{:.3f}"), ("o_rel", "{:.2e}"), ("dq_rel", "{:.2e}"), ("max_logit", "{:.2f}"),
        ("fp16_overflow", "{:d}"), ("fp8_saturated", "{:d}"), ("pbar_flushed", "{:d}")]


def table(rows) -> str:
    head = "| " + " | ".join(c for c, _ in COLS) + " |\n|" + "---|" * len(COLS) + "\n"
    return head + "".join("| " + " | ".join(f.format(r[c]) for c, f in COLS) + " |\n" for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps of the short training (default 40)")
    ap.add_argument("--batch", type=int, default=4,
                    help="training batch (sequences of block_size; default 4, as conf/experiment/default.yaml)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3, as conf/experiment)")
    ap.add_argument("--probe-batch", type=int, default=4, help="probe sequences (default 4, as monitor.probes)")
    ap.add_argument("--seed", type=int, default=0, help="model init seed (default 0)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "formats"), help="output folder")
    a = ap.parse_args(argv)
    t0 = time.time()
    from flash_forensics.orchestrator.monitor.probes.runner import probe_batch
    model, folder, tiny = model_and_data(a.seed)
    batch = probe_batch(folder / "val.bin", tiny["block_size"], a.probe_batch)
    result = dict(command="python scripts/format_mechanism.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  model=tiny, steps=a.steps, batch=a.batch, lr=a.lr, probe_batch=a.probe_batch, seed=a.seed,
                  versions=dict(python=platform.python_version(), torch=torch.__version__), checkpoints={})
    for when in ("init", "trained"):
        if when == "trained":
            losses = train(model, folder, tiny["block_size"], a.steps, a.batch, a.lr)
            result["train_loss_first_last"] = [losses[0], losses[-1]]
        layers = capture(model, batch)
        result["checkpoints"][when] = [measure(layers, r) for r in RECIPES]
        print(f"[{when}] done at {time.time() - t0:.0f} s", flush=True)
    result["seconds"] = round(time.time() - t0, 1)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "mechanism.json"), "w") as f:
        json.dump(result, f, indent=2)
    md = [f"# The mechanism per recipe (format), CPU\n\n`{result['command']}` ({result['seconds']} s; torch "
          f"{torch.__version__}). Tiny model ({tiny['n_layer']} layers x {tiny['n_head']} heads, T = "
          f"{tiny['block_size']}), probe batch of {a.probe_batch} validation sequences; sums / pooled rows over the "
          f"layers. Columns: scripts/format_mechanism.py.\n"]
    for when, rows in result["checkpoints"].items():
        extra = "" if when == "init" else (f" ({a.steps} steps, train loss {result['train_loss_first_last'][0]:.3f}"
                                           f" -> {result['train_loss_first_last'][1]:.3f})")
        md.append(f"\n## {when}{extra}\n\n" + table(rows))
    with open(os.path.join(a.out, "mechanism.md"), "w") as f:
        f.write("".join(md))
    print("".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
