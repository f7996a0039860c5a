"""The transformers backend, eager and compiled, on five families (tiny random models from configs; no download):
Llama (GQA), Phi3 (fused qkv_proj), GPT-2, GPT-2 with cross-attention, BART (encoder-decoder: encoder self-,
decoder self- and cross-attention), each with a left-padded batch, train mode.

Per family x recipe (fp32 on an FP32 model, paper_bf16 on a BF16 one) x mode (eager, torch.compile with inductor's
emulate_precision_casts set, as the project's training sets it; without it a compiled call is refused):
- logits / grads: max |error| against transformers' eager attention on the same weights and dtype (logits at the
  unpadded positions; gradients of mean(logits^2), relative to the largest gradient);
- = eager: compiled logits and gradients bit-identical to the eager forensics model's;
- calls = emulator: each attention call's output bit-identical to the emulator (flash_forensics.sdpa.attend, eager,
  with the call's own q, k, v, mask, scale and knobs), calls that were / all calls.

    python scripts/hf_compile_table.py [--out results/own_model/hf_compile_table.md] [--device cpu]
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
from flash_forensics import hf_backend  # noqa: E402
from flash_forensics.hf_backend import NAME, use  # noqa: E402

V, T, TE = 128, 12, 10  # vocab, decoder tokens, encoder tokens (cross-attention keys)
DEVICE = torch.device("cpu")
NOTE = ('"compiled = eager forensics" NO: outside attention, inductor generates its own code for the rest of the '
        'model (LayerNorm / RMSNorm reductions, GELU, the embedding backward), which differs from eager in the last '
        'bits even with emulated casts; every attention call of every compiled run is bit-identical to the emulator '
        '(last column), since the emulator runs eagerly inside the graph.')


def families():
    import transformers as tf
    small = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 max_position_embeddings=64)
    gpt2 = dict(vocab_size=V, n_embd=64, n_layer=1, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                embd_pdrop=0.0)
    causal, s2s = tf.AutoModelForCausalLM, tf.AutoModelForSeq2SeqLM
    return {
        "llama (GQA 4/2)": (causal, tf.LlamaConfig(**small, num_key_value_heads=2)),
        "phi3 (fused qkv_proj)": (causal, tf.Phi3Config(**small, num_key_value_heads=2, pad_token_id=0)),
        "gpt2": (causal, tf.GPT2Config(**gpt2)),
        "gpt2 + cross-attention": (causal, tf.GPT2Config(**gpt2, add_cross_attention=True)),
        "bart (encoder-decoder)": (s2s, tf.BartConfig(vocab_size=V, d_model=64, encoder_layers=1, decoder_layers=1,
                                                      encoder_attention_heads=4, decoder_attention_heads=4,
                                                      encoder_ffn_dim=128, decoder_ffn_dim=128,
                                                      max_position_embeddings=64, dropout=0.0,
                                                      attention_dropout=0.0)),
    }


def batch(name, dtype):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, T), generator=g)
    am = torch.ones(2, T, dtype=torch.long)
    am[1, :4] = 0  # left padding
    out = dict(input_ids=ids, attention_mask=am)
    if "bart" in name:
        out["decoder_input_ids"] = torch.randint(0, V, (2, T), generator=g)
        keep = torch.ones(2, T, dtype=torch.bool)  # decoder positions all real
    else:
        keep = am.bool()
    if "cross" in name:
        out["encoder_hidden_states"] = torch.randn(2, TE, 64, generator=g).to(dtype)
    return {k: v.to(DEVICE) for k, v in out.items()}, keep.to(DEVICE)


def pair(auto, cfg, dtype):
    torch.manual_seed(0)
    ref = auto.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ff = auto.from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    ff.load_state_dict(ref.state_dict())
    return ref.to(DEVICE, dtype).train(), ff.to(DEVICE, dtype).train()


class Recorder:
    """Wraps the backend's attend: each call's inputs and output (the reference recomputes them eagerly)."""

    def __init__(self):
        self.real, self.calls = hf_backend.attend, []

    def __call__(self, q, k, v, cfg, **kw):
        o = self.real(q, k, v, cfg, **kw)
        self.calls.append((q.detach(), k.detach(), v.detach(), cfg, dict(kw, stats=None), o.detach()))
        return o

    def __enter__(self):
        hf_backend.attend = self
        return self

    def __exit__(self, *exc):
        hf_backend.attend = self.real


def run(fn, model, inputs, keep):
    logits = fn(**inputs).logits[keep].float()  # padded rows: SDPA's 0 against eager's uniform average
    grads = torch.autograd.grad(logits.square().mean(), list(model.parameters()), allow_unused=True)
    return logits, [g for g in grads if g is not None]


def row(name, auto, cfg, recipe, compiled):
    dtype = torch.float32 if recipe == "fp32" else torch.bfloat16
    ref, ff = pair(auto, cfg, dtype)
    use(ff, recipe=recipe, block_q=16, block_k=16)
    inputs, keep = batch(name, dtype)
    want = run(ref, ref, inputs, keep)
    eager = run(ff, ff, inputs, keep)
    torch._dynamo.reset()
    with Recorder() as rec:
        got = run(torch.compile(ff) if compiled else ff, ff, inputs, keep)
    dl = (got[0] - want[0]).abs().max().item()
    gmax = max(g.abs().max().item() for g in want[1])
    dg = max((a.float() - b.float()).abs().max().item() for a, b in zip(got[1], want[1], strict=True)) / gmax
    same_eager = torch.equal(got[0], eager[0]) and all(torch.equal(a, b) for a, b in zip(got[1], eager[1]))
    with torch.no_grad():
        same = [torch.equal(o, rec.real(q, k, v, c, **kw)) for q, k, v, c, kw, o in rec.calls]
    return dl, dg, same_eager, sum(same), len(same)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "own_model" / "hf_compile_table.md"))
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    import torch._inductor.config as inductor
    import transformers
    inductor.emulate_precision_casts = True  # compiled rows: as orchestrator/job/train.py compiles
    t0 = time.perf_counter()
    lines = ["# The transformers backend, eager and compiled, on five families", "",
             f"transformers {transformers.__version__}, torch {torch.__version__}, "
             f"{torch.cuda.get_device_name() if DEVICE.type == 'cuda' else 'CPU'}; one layer per stack, "
             f"{T} tokens (left-padded second row), tiles 16x16. Command: `python scripts/hf_compile_table.py"
             f"{' --device ' + args.device if args.device != 'cpu' else ''}`. Compiled: torch.compile with "
             "`torch._inductor.config.emulate_precision_casts = True` (without it the backend refuses to compile).",
             "", "| family | recipe | mode | logits max err vs eager attention | grads max err (rel. to max grad) "
             "| compiled = eager forensics | calls = emulator |", "|---|---|---|---|---|---|---|"]
    for name, (auto, cfg) in families().items():
        for recipe in ("fp32", "paper_bf16"):
            for compiled in (False, True):
                t = time.perf_counter()
                dl, dg, same_eager, n_same, n = row(name, auto, cfg, recipe, compiled)
                mode = "compiled" if compiled else "eager"
                lines.append(f"| {name} | {recipe} | {mode} | {dl:.1e} | {dg:.1e} | "
                             f"{('yes' if same_eager else 'NO') if compiled else '-'} | {n_same}/{n} |")
                print(lines[-1], f"({time.perf_counter() - t:.0f} s)", flush=True)
    lines += ["", NOTE, "", f"Wall time {time.perf_counter() - t0:.0f} s.", ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
