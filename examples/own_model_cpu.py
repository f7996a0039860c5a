"""Point flash-forensics at your own transformers model, on a CPU, in a few minutes.

A tiny random-initialised Llama (RoPE, GQA, SwiGLU) from transformers, built with attn_implementation="forensics" so
every attention layer runs the kernels' emulator with the paper's BF16 flash-attention recipe, trained for a few
hundred steps on the project's default corpus (the King James Bible, GPT-2 BPE; prepared once under data/), with
flash_forensics.Monitor logging the paper's signals to an MLflow run: loss, repeated-maxima rows and max logit per
layer, attention entropy and W_Q's spectral norm per head.

    python examples/own_model_cpu.py [--steps 300] [--recipe paper_bf16]
    mlflow ui --backend-store-uri sqlite:///results/own_model/mlflow.db   # then open the run it prints
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flash_forensics  # noqa: E402  (registers attn_implementation="forensics" with transformers)
from flash_forensics.orchestrator.data.batches import BatchStream  # noqa: E402
from flash_forensics.orchestrator.data.config import DataConfig  # noqa: E402
from flash_forensics.orchestrator.data.prepare import ensure_prepared  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--recipe", default="paper_bf16", help="paper_bf16 | fa2 | fp32")
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'results' / 'own_model' / 'mlflow.db'}")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    block, batch = 64, 4
    config = LlamaConfig(vocab_size=50304, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=block,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="forensics")
    flash_forensics.use(model, recipe=args.recipe)  # e.g. overrides={1: {"pv_fp32": True}} for one layer
    data = ensure_prepared(DataConfig(), config.vocab_size)  # the default corpus, tokenized once
    stream = BatchStream(data / "train.bin", block, batch, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    Path(args.tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    first = last = None
    sigma = {}  # the latest W_Q spectral norms per head (logged every wq_every steps)
    with flash_forensics.Monitor(model, log_every=25, wq_every=50, mlflow=True, tracking_uri=args.tracking_uri,
                                 experiment="own_model_example", run_name=f"llama-tiny {args.recipe}",
                                 params={"steps": args.steps, "block": block, "batch": batch}) as mon:
        for step in range(args.steps):
            x, y = stream.get(step)
            logits = model(input_ids=x).logits.float()  # y is x shifted by one token already
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out = mon.step(loss)  # a dict on logging steps (one host transfer), else None
            if out:
                last = out
                first = first or out
                sigma.update({k: v for k, v in out.items() if k.startswith("wq_sigma/")})
                rmax = sum(v for k, v in out.items() if k.startswith("rmax_rows/"))
                seen = sum(v for k, v in out.items() if k.startswith("rows_seen/"))
                print(f"step {step:4d}  loss {out['train/loss']:.3f}  max logit L0/L1 {out['max_logit/L0']:.2f}/"
                      f"{out['max_logit/L1']:.2f}  repeated-max rows {rmax:.0f}/{seen:.0f}  "
                      f"entropy L1.H0 {out['attn_entropy/L1.H0']:.2f}", flush=True)
    peak = max(sigma, key=sigma.get) if sigma else None
    print(f"\n{args.steps} steps in {time.perf_counter() - t0:.0f} s; loss {first['train/loss']:.3f} -> "
          f"{last['train/loss']:.3f}; W_Q sigma peak {peak}={sigma.get(peak, float('nan')):.3f}")
    print(f"MLflow run {mon.run_id} in {args.tracking_uri} (experiment own_model_example)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
