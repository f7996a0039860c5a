"""The transformers backend on tiny random models built from configs (no download): Llama (GQA), Qwen3 (its own
QK-norm), Mistral (sliding window), GPT-2 (fused c_attn, its own scaling); registration in both import orders."""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_forensics
from flash_forensics import families, hooks
from flash_forensics.hf_backend import NAME, attention_forward, use
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import flash_attention

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
V, T = 128, 21


def _config(family):
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=8)  # T = 21 > 8: the window masks keys
    return transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                                   resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _pair(family, dtype=torch.float32):
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(_config(family)), attn_implementation="eager")
    ff = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(_config(family)), attn_implementation=NAME)
    ff.load_state_dict(ref.state_dict())
    return ref.to(dtype), ff.to(dtype)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :4] = 0  # left padding in the second sequence
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gpt2"])
def test_fp32_recipe_matches_eager_logits_and_gradients(family):
    ref, ff = _pair(family)
    use(ff, recipe="fp32", block_q=8, block_k=8)
    ids, am = _batch()
    out = []
    for m in (ref, ff):
        m.train()
        logits = m(input_ids=ids, attention_mask=am).logits[am.bool()]  # padded rows: SDPA 0, eager uniform
        grads = torch.autograd.grad(logits.square().mean(), list(m.parameters()))
        out.append((logits, grads))
    assert (out[0][0] - out[1][0]).abs().max().item() < 2e-5
    gmax = max(g.abs().max().item() for g in out[0][1])
    assert max((a - b).abs().max().item() for a, b in zip(out[0][1], out[1][1], strict=True)) < 1e-4 * gmax


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gpt2"])
def test_paper_bf16_calls_equal_the_kernels_flash_attention_bit_for_bit(family):
    _, ff = _pair(family, torch.bfloat16)
    use(ff, recipe="paper_bf16")
    ids, _ = _batch()
    calls = []
    with hooks.observing(calls.append), torch.no_grad():
        ff(input_ids=ids)
    assert [c.layer for c in calls] == [0, 1] and all(c.family == family for c in calls)
    knobs = AttentionKnobs(recipe="paper_bf16")
    for c in calls:
        assert c.q.dtype == torch.bfloat16 and c.k.shape == c.q.shape  # k, v repeated for GQA
        want = flash_attention(c.q, c.k, c.v, knobs)  # the kernels' own causal call
        if family == "mistral":  # the window cuts keys more than 8 back: not the plain causal pattern
            assert not torch.equal(c.o, want)
        else:
            assert torch.equal(c.o, want), family


def test_use_validates_layers_knobs_and_the_model():
    _, ff = _pair("llama")
    use(ff, recipe="paper_bf16", overrides={1: {"pv_fp32": True, "o_fp32_heads": [0, 3]}})
    layers = families.attention_layers(ff)
    assert not layers[0].ff_state.knobs.pv_fp32 and layers[1].ff_state.knobs.pv_fp32
    assert layers[1].ff_state.knobs.o_fp32_heads == [0, 3]
    for overrides, needle in (({2: {"pv_fp32": True}}, "layer_idx in 0..1"), ({0: {"pvfp32": True}}, "unknown knob"),
                              ({0: {"o_fp32_heads": [4]}}, "o_fp32_heads"), ({0: {"impl": "sdpa"}}, "impl='sdpa'"),
                              ([1], "expected a dict"),
                              # named by the layer the user keyed, not the override's place in the list
                              ({0: {"pv_fp32": True}, 1: {"o_fp32_heads": [9]}}, "use.overrides[1].o_fp32_heads=[9]"),
                              ({1: {"pv_fp32": "yes"}}, "use.overrides[1].pv_fp32='yes' is not allowed")):
        with pytest.raises(ValueError, match="not allowed|unknown"):
            try:
                use(ff, overrides=overrides)
            except ValueError as e:
                assert needle in str(e), str(e)
                raise
    ref, _ = _pair("llama")
    with pytest.raises(ValueError, match="attn_implementation"):
        use(ref)


def test_refuses_what_it_cannot_compute():
    _, ff = _pair("llama")
    mod = families.attention_layers(ff)[0]
    q = torch.randn(1, 4, 5, 16)
    k = v = torch.randn(1, 2, 5, 16)
    for kw, needle in ((dict(softcap=30.0), "softcap"), (dict(dropout=0.1), "dropout"),
                       (dict(s_aux=torch.zeros(4)), "s_aux"), (dict(output_attentions=True), "output_attentions"),
                       (dict(sliding_window=4), "sliding_window")):
        with pytest.raises(ValueError, match=needle):
            attention_forward(mod, q, k, v, None, **kw)
    with pytest.raises(ValueError, match="Tq=3 != Tk=5"):
        attention_forward(mod, q[:, :, :3], k, v, None)


def test_unknown_family_says_how_to_name_it():
    _, ff = _pair("llama")
    ff.config.model_type = "my_llama"
    with pytest.raises(ValueError, match=r"register\('my_llama', wq='q_proj'\)"):
        families.family(ff)
    families.register("my_llama", wq="q_proj")
    assert families.wq_spectral_norms(ff).shape == (2, 4)


def test_a_family_no_rule_fits_is_not_told_a_rule_that_fails_later(monkeypatch):
    cfg = transformers.DistilBertConfig(vocab_size=V, dim=64, n_layers=1, n_heads=4, hidden_dim=128)
    model = transformers.AutoModel.from_config(cfg, attn_implementation=NAME)
    with pytest.raises(ValueError, match=r"no W_Q rule fits: its attention module DistilBertSelfAttention has none "
                                         r"of q_proj, .* \(its layers: q_lin, k_lin, v_lin, out_lin\); add"):
        families.family(model)  # said register('distilbert', wq='q_proj')
    monkeypatch.setitem(families.FAMILIES, "distilbert", "q_proj")  # that advice followed: refused when made
    with pytest.raises(ValueError, match=r"transformer.layer.0.attention \(DistilBertSelfAttention\) has no 'q_proj'"):
        flash_forensics.Monitor(model)  # was at its first step
    monkeypatch.setitem(families.WQ_RULES, "q_lin", ("q_lin", "rows"))  # the new advice followed: read
    monkeypatch.setitem(families.FAMILIES, "distilbert", "q_lin")
    w = model.transformer.layer[0].attention.q_lin.weight.detach()
    assert torch.equal(families.wq_blocks(model)[3], w[48:64])


def test_gpt2_wq_blocks_are_the_fused_c_attn_columns():
    _, ff = _pair("gpt2")
    w = families.attention_layers(ff)[1].c_attn.weight.detach()
    blocks = families.wq_blocks(ff)
    assert blocks.shape == (8, 16, 64)
    assert torch.equal(blocks[4 + 2], w[:, 32:48].t())  # layer 1, head 2
    sigma = families.wq_spectral_norms(ff)
    assert torch.allclose(sigma[1, 2], torch.linalg.matrix_norm(w[:, 32:48], ord=2), rtol=1e-4)


_ORDER = {
    "flash_forensics first": "import flash_forensics, sys; assert 'transformers' not in sys.modules; "
                             "from transformers import AttentionInterface",
    "transformers first": "from transformers import AttentionInterface; import transformers.masking_utils; "
                          "import flash_forensics",
}


@pytest.mark.parametrize("order", sorted(_ORDER))
def test_registration_in_both_import_orders(order):
    check = ("; from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as A; "
             "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as M; "
             f"assert {NAME!r} in A and {NAME!r} in M._global_mapping; print('ok')")
    r = subprocess.run([sys.executable, "-c", _ORDER[order] + check], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_public_names():
    for name in ("attention", "patch_sdpa", "use", "Monitor", "TrainerCallback"):
        assert callable(getattr(flash_forensics, name))
