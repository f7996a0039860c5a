"""Every attention module routed, by module path: BART (encoder self-, decoder self- and cross-attention sharing
layer numbers), GPT-2 with cross-attention; fused QKV layouts (Phi3, GPT-NeoX) for W_Q; the backend noticing it is
not called (a shared config switched to eager); refusals that never print tensors. Tiny random models, no download."""
import copy
import warnings

import pytest
import torch

import flash_forensics
from flash_forensics import families, hooks
from flash_forensics.hf_backend import NAME, attention_forward, sites, use
from flash_forensics.watch import NotRoutedWarning

transformers = pytest.importorskip("transformers")
V = 128


def _bart_config():
    return transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                   encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_dim=64,
                                   decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)


def _gpt2_cross_config():
    return transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                                   resid_pdrop=0.0, embd_pdrop=0.0, add_cross_attention=True)


def _pair(cfg, auto):
    torch.manual_seed(0)
    ref = auto.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ff = auto.from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    ff.load_state_dict(ref.state_dict())
    return ref, ff


def _bart_inputs():
    g = torch.Generator().manual_seed(1)
    ids, dec = torch.randint(0, V, (2, 9), generator=g), torch.randint(0, V, (2, 5), generator=g)
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0  # padded encoder keys: the cross-attention's mask too
    return dict(input_ids=ids, attention_mask=am, decoder_input_ids=dec)


BART_PATHS = ["model.encoder.layers.0.self_attn", "model.encoder.layers.1.self_attn",
              "model.decoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn",
              "model.decoder.layers.1.self_attn", "model.decoder.layers.1.encoder_attn"]


def test_bart_every_module_routed_by_path_and_fp32_matches_eager():
    ref, ff = _pair(_bart_config(), transformers.AutoModelForSeq2SeqLM)
    use(ff, recipe="fp32", overrides={"model.decoder.layers.*.encoder_attn": {"block_k": 16},
                                      "model.encoder.layers.1.self_attn": {"block_q": 32}})
    assert [s.path for s in sites(ff)] == BART_PATHS
    knobs = {s.path: s.module.ff_state.knobs for s in sites(ff)}
    assert all(k.recipe == "fp32" for k in knobs.values())  # not only the first module of each layer number
    assert [knobs[p].block_k for p in BART_PATHS] == [64, 64, 64, 16, 64, 16]
    assert knobs["model.encoder.layers.1.self_attn"].block_q == 32
    calls = []
    with hooks.observing(calls.append):
        got = ff(**_bart_inputs()).logits
    assert len(calls) == 6 and sorted({c.q.shape[1] for c in calls}) == [2, 4]  # encoder 4 heads, decoder 2
    want = ref(**_bart_inputs()).logits
    assert (got - want).abs().max().item() < 1e-5


def test_a_shared_layer_number_is_refused_and_a_bad_path_named():
    _, ff = _pair(_bart_config(), transformers.AutoModelForSeq2SeqLM)
    with pytest.raises(ValueError, match=r"layer 0 is shared by 3 attention modules \('model.encoder.layers.0"):
        use(ff, overrides={0: {"pv_fp32": True}})
    with pytest.raises(ValueError, match=r"overrides key 'model.decoder.layers.0.cross_attn' is not allowed"):
        use(ff, overrides={"model.decoder.layers.0.cross_attn": {"pv_fp32": True}})
    with pytest.raises(ValueError, match=r"overrides\['model.decoder.layers.0.encoder_attn'\].o_fp32_heads"):
        use(ff, overrides={"model.decoder.layers.0.encoder_attn": {"o_fp32_heads": [3]}})  # 2 decoder heads


def test_monitor_sees_every_bart_module():
    _, ff = _pair(_bart_config(), transformers.AutoModelForSeq2SeqLM)
    use(ff)
    mon = flash_forensics.Monitor(ff, log_every=1, wq_every=1)
    ff(**_bart_inputs()).logits.sum().backward()
    out = mon.step()
    for p in BART_PATHS:
        heads = 4 if "encoder." in p else 2
        assert out[f"rows_seen/{p}.H{heads - 1}"] > 0 and f"rows_seen/{p}.H{heads}" not in out
        assert out[f"wq_sigma/{p}.H0"] > 0 and out[f"max_logit/{p}"] > 0
    enc = ff.model.encoder.layers[1].self_attn.q_proj.weight.detach()  # head 3 of 4, head dim 8
    assert torch.allclose(torch.tensor(out[f"wq_sigma/{BART_PATHS[1]}.H3"]),
                          torch.linalg.matrix_norm(enc[24:32], ord=2), rtol=1e-4)


def test_gpt2_cross_attention_routed_with_its_own_query_projection():
    ref, ff = _pair(_gpt2_cross_config(), transformers.AutoModelForCausalLM)
    use(ff, recipe="fp32", overrides={"transformer.h.*.crossattention": {"block_k": 16}})
    paths = [s.path for s in sites(ff)]
    assert paths == ["transformer.h.0.attn", "transformer.h.0.crossattention", "transformer.h.1.attn",
                     "transformer.h.1.crossattention"]
    g = torch.Generator().manual_seed(2)
    ids, enc = torch.randint(0, V, (2, 7), generator=g), torch.randn(2, 11, 32, generator=g)
    calls = []
    with hooks.observing(calls.append):
        got = ff(input_ids=ids, encoder_hidden_states=enc).logits
    assert [c.k.shape[2] for c in calls] == [7, 11, 7, 11]
    assert (got - ref(input_ids=ids, encoder_hidden_states=enc).logits).abs().max().item() < 1e-5
    cross = sites(ff)[1]
    w = cross.module.q_attn.weight.detach()  # Conv1D (C, C): head h = columns [8h, 8h + 8)
    assert torch.equal(families.site_wq(cross, "c_attn")[2], w[:, 16:24].t())


def test_modules_it_cannot_route_are_named_or_refused():
    _, ff = _pair(_bart_config(), transformers.AutoModelForSeq2SeqLM)

    class HomemadeAttention(torch.nn.Module):  # computes attention itself: never reaches the backend
        def forward(self, x):
            return x

    ff.model.extra = HomemadeAttention()
    ff.model.decoder.layers[1].encoder_attn.config = copy.deepcopy(ff.config)
    ff.model.decoder.layers[1].encoder_attn.config._attn_implementation = "eager"
    with pytest.warns(NotRoutedWarning, match=r"2 attention module\(s\).*model.decoder.layers.1.encoder_attn \(its "
                      r"config's _attn_implementation='eager'\); model.extra \(its class computes attention itself"):
        use(ff)
    assert len(sites(ff)) == 5
    with pytest.raises(ValueError, match="strict=True"):
        use(ff, strict=True)


def test_a_monitor_on_a_model_never_use_d_names_the_modules_it_cannot_monitor():
    _, ff = _pair(_bart_config(), transformers.AutoModelForSeq2SeqLM)
    ff.model.decoder.layers[1].encoder_attn.config = copy.deepcopy(ff.config)
    ff.model.decoder.layers[1].encoder_attn.config._attn_implementation = "eager"
    with pytest.warns(NotRoutedWarning, match=r"Monitor: 1 attention module\(s\) of BartForConditionalGeneration "
                      r"cannot run.*model.decoder.layers.1.encoder_attn .*\(not monitored\)"):
        mon = flash_forensics.Monitor(ff)  # monitored 5 of 6, unsaid
    assert len(mon.sites) == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llama = transformers.AutoModelForCausalLM.from_config(_llama_config(), attn_implementation=NAME)
        flash_forensics.Monitor(llama)  # every module routes: nothing to say
    with pytest.warns(NotRoutedWarning, match="use()"):
        use(ff)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_forensics.Monitor(ff)  # use() said it: not twice


def test_attention_dropout_in_training_names_the_familys_own_config_key():
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, attention_probs_dropout_prob=0.1)
    model = transformers.AutoModel.from_config(cfg, attn_implementation=NAME)
    use(model)
    model.config.attention_probs_dropout_prob = 0.0  # too late: the module kept 0.1 (the message said to do this)
    with pytest.raises(ValueError, match=r"dropout=0.1 is not allowed: expected 0.0 .*build the model with "
                                         r"config.attention_probs_dropout_prob=0.0, as setting it on a built model"):
        model.train()(input_ids=torch.randint(0, V, (1, 5)))
    model.eval()(input_ids=torch.randint(0, V, (1, 5)))  # no dropout in eval mode


def _llama_config():
    return transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_a_shared_config_switched_to_eager_is_said_with_its_cause():
    cfg = _llama_config()
    ff = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    use(ff)
    mon = flash_forensics.Monitor(ff, log_every=1, wq_every=1)
    ids = torch.randint(0, V, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # routed: nothing to say
        ff(input_ids=ids)
        mon.step()
    transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")  # same config object
    with pytest.warns(NotRoutedWarning) as said:
        ff(input_ids=ids)
        mon.step()
    text = [str(w.message) for w in said]
    assert len(text) == 2 and all("no longer 'forensics'" in t and "copy.deepcopy(config)" in t for t in text)
    assert text[0].startswith("LlamaForCausalLM.forward: 2 of 2") and text[1].startswith("Monitor: no attention call")


def test_a_forward_that_skips_the_backend_is_said():
    _, ff = _pair(_bart_config(), transformers.AutoModelForSeq2SeqLM)
    use(ff)
    for s in sites(ff):  # as if another model object ran: the backend never sees these modules
        s.module.forward = lambda *a, **k: (torch.zeros(a[0].shape if a else k["hidden_states"].shape), None)
    with pytest.warns(NotRoutedWarning, match=r"made no call to the forensics backend \(6 attention modules.*not on "
                      "this forward's path"):
        ff(**_bart_inputs())


def test_fused_qkv_layouts_give_the_query_heads():
    torch.manual_seed(0)
    phi3 = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0), attn_implementation=NAME)
    w = phi3.model.layers[1].self_attn.qkv_proj.weight.detach()  # (64 + 2 * 32, 64): the query rows first
    assert torch.equal(families.wq_blocks(phi3)[4 + 3], w[48:64])
    use(phi3)
    mon = flash_forensics.Monitor(phi3, log_every=1, wq_every=1)  # crashed before: no q_proj
    phi3(input_ids=torch.randint(0, V, (1, 8)))
    out = mon.step()
    assert torch.allclose(torch.tensor(out["wq_sigma/L1.H3"]), torch.linalg.matrix_norm(w[48:64], ord=2), rtol=1e-4)
    neox = transformers.AutoModelForCausalLM.from_config(transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=64), attn_implementation=NAME)
    w = neox.gpt_neox.layers[0].attention.query_key_value.weight.detach()  # per head [q; k; v], 16 rows each
    assert torch.equal(families.wq_blocks(neox)[2], w[2 * 48:2 * 48 + 16])


def test_refusals_name_a_tensor_by_shape_and_dtype_only():
    ff = transformers.AutoModelForCausalLM.from_config(_llama_config(), attn_implementation=NAME)
    use(ff)
    mod = sites(ff)[0].module
    q, k = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    for name in ("s_aux", "position_bias"):
        with pytest.raises(ValueError) as e:
            attention_forward(mod, q, k, k, None, **{name: torch.full((4, 5, 5), 0.123)})
        msg = str(e.value)
        assert f"{name}=a tensor of shape (4, 5, 5) and dtype torch.float32 is not allowed" in msg, msg
        assert "0.123" not in msg and "tensor([" not in msg and "model.layers.0.self_attn" in msg
    with pytest.raises(ValueError) as e:  # a knob in overrides: refused before the knob validator prints it
        use(ff, overrides={0: {"beta": torch.full((300,), 0.123)}})
    assert str(e.value) == ("overrides[0].beta=a tensor of shape (300,) and dtype torch.float32 is not allowed: "
                            "expected a Python value (e.g. .item() or .tolist() of it)")
