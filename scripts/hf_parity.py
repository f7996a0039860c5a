"""The transformers backend's parity table: four families, tiny random models built from configs (no download).

Per family (Llama with GQA, Qwen3 with its own QK-norm, Mistral with a sliding window of 8 over 21 tokens, GPT-2):
- fp32 recipe vs transformers' eager attention on the same weights, FP32, a left-padded batch, train mode: max |error|
  of the logits (unpadded positions) and of every parameter gradient of mean(logits^2), relative to the largest
  gradient;
- paper_bf16 on a BF16 model: each layer's output against kernels/emulator.py flash_attention on the same q, k, v
  (bit for bit; Mistral's window is not the plain causal pattern, so it is compared with the emulator's masking on
  the window mask instead).

    python scripts/hf_parity.py [--out results/own_model/hf_parity.md]
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flash_forensics  # noqa: E402,F401
from flash_forensics import hooks  # noqa: E402
from flash_forensics.hf_backend import NAME, use  # noqa: E402
from flash_forensics.kernels.config import AttentionKnobs  # noqa: E402
from flash_forensics.kernels.emulator import flash_attention  # noqa: E402
from flash_forensics.kernels.masking import Masking  # noqa: E402

V, T = 128, 21
DEVICE = torch.device("cpu")  # --device


def configs():
    import transformers as tf
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return {"llama": tf.LlamaConfig(**common), "qwen3": tf.Qwen3Config(**common, head_dim=16),
            "mistral": tf.MistralConfig(**common, sliding_window=8),
            "gpt2": tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)}


def pair(cfg, dtype):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ff = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    ff.load_state_dict(ref.state_dict())
    return ref.to(DEVICE, dtype), ff.to(DEVICE, dtype)


def fp32_parity(cfg):
    ref, ff = pair(cfg, torch.float32)
    use(ff, recipe="fp32", block_q=8, block_k=8)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, T), generator=g).to(DEVICE)
    am = torch.ones(2, T, dtype=torch.long)
    am[1, :4] = 0
    am = am.to(DEVICE)
    out = []
    for m in (ref, ff):
        m.train()
        logits = m(input_ids=ids, attention_mask=am).logits[am.bool()]
        out.append((logits, torch.autograd.grad(logits.square().mean(), list(m.parameters()))))
    dl = (out[0][0] - out[1][0]).abs().max().item()
    dg = max((a - b).abs().max().item() for a, b in zip(out[0][1], out[1][1], strict=True))
    gmax = max(x.abs().max().item() for x in out[0][1])
    return dl, out[0][0].abs().max().item(), dg, dg / gmax


def bit_identity(name, cfg):
    _, ff = pair(cfg, torch.bfloat16)
    use(ff, recipe="paper_bf16")
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    calls = []
    with hooks.observing(calls.append), torch.no_grad():
        ff(input_ids=ids)
    knobs = AttentionKnobs(recipe="paper_bf16")
    same = []
    for c in calls:
        if name == "mistral":  # key j visible to query i when i - 8 < j <= i
            i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
            keep = ((j <= i) & (j > i - cfg.sliding_window))[None, None].to(DEVICE)
            want = flash_attention(c.q, c.k, c.v, knobs, masking=Masking(causal=False, keep=keep))
        else:
            want = flash_attention(c.q, c.k, c.v, knobs)
        same.append(torch.equal(c.o, want))
    return same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "own_model" / "hf_parity.md"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the models and both attentions run")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # eager's FP32 GEMMs in IEEE FP32, as the emulator's
    import transformers
    t0 = time.perf_counter()
    lines = ["# attn_implementation=\"forensics\" on four transformers families", "",
             f"transformers {transformers.__version__}, torch {torch.__version__}, "
             f"{torch.cuda.get_device_name() if DEVICE.type == 'cuda' else 'CPU'}. Command: "
             f"`python scripts/hf_parity.py{' --device ' + args.device if args.device != 'cpu' else ''}`.", "",
             "| family | fp32 vs eager: logits max err (largest logit) | grads max err (relative to max grad) | "
             "paper_bf16 layers bit-identical to flash_attention |", "|---|---|---|---|"]
    for name, cfg in configs().items():
        dl, lmax, dg, rel = fp32_parity(cfg)
        same = bit_identity(name, cfg)
        lines.append(f"| {name} | {dl:.1e} ({lmax:.2f}) | {dg:.1e} ({rel:.1e}) | {sum(same)}/{len(same)} |")
    lines += ["", f"Wall time {time.perf_counter() - t0:.0f} s.", ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
