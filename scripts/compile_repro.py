"""Does a compiled GPT training step reproduce its bits? (CUDA; ~1.5 min on an H100)

    python scripts/compile_repro.py [--json OUT]

A 2-layer GPT (Triton fa2 attention, counters on) trains 6 steps of 2 micro-batches on text made of 25 token ids,
as real text repeats its tokens, three ways per setting: torch.compile's default mode twice and mode="reduce-overhead"
(CUDA graphs) once. The settings: the token embedding's backward left to inductor (nn.Embedding's, lowered to an
atomic scatter-add), then the sorted one the model trains with (models/embedding.py; a compiled job's default),
then that inside orchestrator/job/determinism.py's scope (train.deterministic=true). Prints whether the losses and
the counters are bit-identical.
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

SETTINGS = {  # name: (GPT.sorted_embedding_grad, inside the deterministic scope)
    "inductor's embedding backward": (False, False),
    "sorted embedding backward": (True, False),
    "sorted embedding backward, deterministic scope": (True, True),
}


def train(mode, sorted_grad: bool, deterministic: bool, data):
    from flash_forensics.kernels.config import AttentionConfig
    from flash_forensics.models.gpt import GPT, ModelConfig
    from flash_forensics.orchestrator.job.determinism import deterministic_algorithms
    from flash_forensics.orchestrator.job.train import compile_model
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=256, block_size=256),
                AttentionConfig(impl="flash", backend="triton", recipe="fa2")).cuda()
    model.sorted_embedding_grad = sorted_grad
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    with deterministic_algorithms(deterministic):
        fwd = compile_model(model, mode, casts=False)  # as train.compile_casts=auto compiles a Triton route
        for step in range(6):
            if mode:
                torch.compiler.cudagraph_mark_step_begin()
            total = torch.zeros((), device="cuda")
            for x in data[2 * step:2 * step + 2]:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = fwd(x[:, :-1].contiguous(), x[:, 1:].contiguous())
                (loss / 2).backward()
                total += loss.detach() / 2
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total.item())
    stats = torch.cat([t.double().reshape(-1) for s in model.attention_stats() for t in s.tensors()])
    return losses, stats


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the comparisons here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("compile_repro: needs a CUDA GPU")
    g = torch.Generator("cuda").manual_seed(0)
    data = [torch.randint(0, 25, (4, 257), device="cuda", generator=g) * 7 for _ in range(12)]
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, results={})
    for setting, (sorted_grad, det) in SETTINGS.items():
        a, b, c = (train(m, sorted_grad, det, data) for m in (None, None, "reduce-overhead"))
        for name, other in (("default vs default", b), ("default vs CUDA graphs", c)):
            key = f"{setting}: {name}"
            same = dict(losses=a[0] == other[0], counters=bool(torch.equal(a[1], other[1])),
                        last_losses=[a[0][-1], other[0][-1]])
            out["results"][key] = same
            print(f"{key}: losses bit-identical {same['losses']}, counters {same['counters']} "
                  f"(last loss {a[0][-1]!r} / {other[0][-1]!r})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
