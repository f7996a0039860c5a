"""models/: GPT-2 shapes and init, per-layer/per-head attention routing, W_Q spectral norms, config validation."""
import math

import pytest
import torch

import flash_forensics.kernels.emulator
import flash_forensics.models.attention as routing
from flash_forensics.kernels.config import AttentionConfig, LayerOverride
from flash_forensics.models.attention import resolve_backend
from flash_forensics.models.gpt import GPT, ModelConfig

IMPLS = ("flash", "standard", "sdpa")
V_SMALL = 512  # the tiny preset with a small vocabulary where the test is about attention, to keep the suite fast
# Every knob of kernels/config.py, one at a time (plus per-layer overrides and the model's qk_norm).
KNOB_CASES = {
    "paper_bf16": {},
    "fa2": dict(recipe="fa2"),
    "fp32": dict(recipe="fp32"),
    "untiled": dict(tiling=False),
    "stabilized": dict(softmax="stabilized", beta=2.0),
    "delta_dP_P": dict(delta="dP_P"),
    "delta_recompute_fp32": dict(delta="recompute_fp32"),
    "pv_fp32": dict(pv_fp32=True),
    "o_fp32": dict(o_fp32=True),
    "o_fp32_heads": dict(o_fp32_heads=[1, 2]),
    "no_counters": dict(counters=False),
    "overrides": dict(overrides=[LayerOverride(layers=[1], impl="standard", recipe="fp32"),
                                 LayerOverride(layers=[2], impl="flash", o_fp32_heads=[0, 3], softmax="stabilized")]),
    "qk_norm": {},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: one intra-op thread is as fast alone and avoids OpenMP spin-waits when other work
    shares the 2 cores (measured: 78 knob cases 103 s with 2 threads vs 7 s with 1 under load ~10)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(**changes):
    return ModelConfig.preset("tiny", vocab_size=V_SMALL, **changes)


def _tokens(B=2, T=32, vocab=V_SMALL, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def test_counters_follow_the_model_to_its_device_before_any_forward(monkeypatch):
    """.to(device) makes each layer's counters there at once (CausalSelfAttention._apply): made inside the first
    compiled forward they were its outputs, which a CUDA graph's next replay overwrote. A dtype change keeps them,
    and the Triton launchers' device constants are asked for on CUDA only (models/attention.py prepare_device)."""
    asked = []
    monkeypatch.setattr(routing, "prepare_device", lambda knobs, n, dev: asked.append((knobs.impl, n, str(dev))))
    import flash_forensics.models.gpt as gpt_mod
    monkeypatch.setattr(gpt_mod, "prepare_device", routing.prepare_device)
    model = GPT(_tiny(), AttentionConfig(overrides=[LayerOverride(layers=[3], impl="sdpa")]))
    before = model.attention_stats()
    model.to(torch.float64)  # same device: the same counters
    assert all(a is b for a, b in zip(model.attention_stats(), before, strict=True))
    model.to("meta")  # no forward: the counters are there already
    stats = [b.attn.stats for b in model.transformer.h]
    assert all(s.device.type == "meta" and s.repeated_max_rows.shape == (4,) for s in stats)
    assert [a for a in asked if a[2] == "meta"] == [(impl, 4, "meta") for impl in ("flash",) * 3 + ("sdpa",)]
    monkeypatch.undo()
    from flash_forensics.kernels import triton_launch
    made = set(triton_launch._DEVICE_CACHE)
    routing.prepare_device(model.transformer.h[0].attn.knobs, 4, "cpu")  # the real one: nothing off CUDA
    assert set(triton_launch._DEVICE_CACHE) == made


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32_stream", "bf16_autocast"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(KNOB_CASES))
def test_tiny_forward_backward_every_impl_and_knob(case, impl, autocast):
    torch.manual_seed(0)
    model = GPT(_tiny(qk_norm=case == "qk_norm"),
                AttentionConfig(impl=impl, block_q=16, block_k=16, **KNOB_CASES[case]))
    idx, targets = _tokens(), _tokens(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, loss = model(idx, targets)
    assert logits.shape == (2, 32, V_SMALL)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(V_SMALL)) < 1.0  # near-uniform predictions at init
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), [n for n, g in grads.items()
                                                                                     if g is None]
    assert grads["transformer.h.0.attn.c_attn.weight"][:128].abs().sum() > 0  # gradient reaches W_Q through attention
    if case == "qk_norm":
        assert grads["transformer.h.0.attn.q_norm.weight"].abs().sum() > 0


def test_attention_routes_name_each_layer():
    model = GPT(_tiny(), AttentionConfig(
        impl="standard", overrides=[LayerOverride(layers=[2], impl="flash", softmax="stabilized"),
                                    LayerOverride(layers=[3], impl="sdpa")]))
    assert model.attention_routes() == ["standard/paper_bf16", "standard/paper_bf16",
                                        "flash/emulator/paper_bf16+sfa(beta=2)", "sdpa/bf16/no-counters"]


def _spy(monkeypatch):
    """Record (layer stats object, knobs) for every flash and standard call."""
    calls = {"flash": [], "standard": []}
    real_flash, real_standard = flash_forensics.kernels.emulator.flash_attention, routing.standard_attention

    def flash(q, k, v, knobs, stats=None):
        calls["flash"].append((stats, knobs))
        return real_flash(q, k, v, knobs, stats)

    def standard(q, k, v, knobs, stats=None):
        calls["standard"].append((stats, knobs))
        return real_standard(q, k, v, knobs, stats)

    monkeypatch.setattr(flash_forensics.kernels.emulator, "flash_attention", flash)
    monkeypatch.setattr(routing, "standard_attention", standard)
    return calls


def _layer_of(model, stats):
    return [i for i, s in enumerate(model.attention_stats()) if s is stats]


def test_flash_only_in_layer_2_calls_flash_only_there(monkeypatch):
    calls = _spy(monkeypatch)
    model = GPT(_tiny(), AttentionConfig(
        impl="standard", overrides=[LayerOverride(layers=[2], impl="flash")]))
    model(_tokens())
    assert [_layer_of(model, s) for s, _ in calls["flash"]] == [[2]]
    assert [_layer_of(model, s) for s, _ in calls["standard"]] == [[0], [1], [3]]


def test_standard_only_in_layer_2(monkeypatch):
    calls = _spy(monkeypatch)
    model = GPT(_tiny(), AttentionConfig(
        impl="flash", overrides=[LayerOverride(layers=[2], impl="standard")]))
    model(_tokens())
    assert [_layer_of(model, s) for s, _ in calls["standard"]] == [[2]]
    assert [_layer_of(model, s) for s, _ in calls["flash"]] == [[0], [1], [3]]


def test_repeated_maxima_counted_only_in_the_flash_layer():
    # Identical tokens and no position embedding: every position has the same q and k, so every row's scores are
    # all equal (rows with > 1 key have repeated maxima). Only the flash layer counts; sdpa layers have no counters.
    torch.manual_seed(0)
    model = GPT(_tiny(), AttentionConfig(
        impl="sdpa", tiling=False, overrides=[LayerOverride(layers=[2], impl="flash")]))
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
    B, T = 2, 32
    model(torch.full((B, T), 7))
    counts = torch.stack([s.repeated_max_rows for s in model.attention_stats()])
    assert counts[[0, 1, 3]].sum() == 0
    assert counts[2].tolist() == [B * (T - 1)] * 4  # every row but the first (one key) on each head
    model.reset_attention_stats()
    assert torch.stack([s.repeated_max_rows for s in model.attention_stats()]).sum() == 0


def test_standard_counts_repeated_maxima_on_full_rows():
    model = GPT(_tiny(), AttentionConfig(impl="standard"))
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
    model(torch.full((1, 16), 3))
    for s in model.attention_stats():
        assert s.repeated_max_rows.tolist() == [15] * 4
        assert s.rows_seen.tolist() == [16] * 4
        assert torch.isfinite(s.max_logit)


@pytest.mark.parametrize("recipe", ["paper_bf16", "fp32"])
def test_standard_counts_agree_with_untiled_flash(recipe):
    # Keys repeated along the sequence give exact ties; small random perturbations give near-ties within eps.
    torch.manual_seed(2)
    B, H, T, D = 2, 4, 48, 32
    q = torch.randn(B, H, T, D)
    k = torch.randn(B, H, T // 4, D).repeat_interleave(4, dim=2) + 1e-4 * torch.randn(B, H, T, D)
    v = torch.randn(B, H, T, D)
    knobs = AttentionConfig(recipe=recipe, tiling=False)
    s_std, s_flash = routing.new_stats(H, "cpu"), routing.new_stats(H, "cpu")
    routing.standard_attention(q, k, v, knobs, s_std)
    flash_forensics.kernels.emulator.flash_attention(q, k, v, knobs, s_flash)
    assert s_std.repeated_max_rows.sum() > B * H * 5  # the input does produce ties
    assert s_std.repeated_max_rows.tolist() == s_flash.repeated_max_rows.tolist()
    assert s_std.rows_seen.tolist() == s_flash.rows_seen.tolist() == [B * T] * H
    assert s_std.max_logit.item() == pytest.approx(s_flash.max_logit.item(), rel=1e-6)


def test_o_fp32_heads_reach_only_the_named_layer(monkeypatch):
    cfg = ModelConfig(name="wide_heads", n_layer=4, n_head=12, n_embd=384, block_size=32, vocab_size=512)
    att = AttentionConfig(impl="flash", overrides=[LayerOverride(layers=[2], o_fp32_heads=[1, 7, 8])])
    calls = _spy(monkeypatch)
    model = GPT(cfg, att)
    model(_tokens(vocab=512))
    by_layer = {_layer_of(model, s)[0]: knobs.fp32_o_heads(12) for s, knobs in calls["flash"]}
    assert by_layer == {0: [], 1: [], 2: [1, 7, 8], 3: []}

    # The standard path honours it numerically: only heads 1, 7, 8 of layer 2 leave attention un-rounded to BF16.
    outs = {}
    real = routing.standard_attention

    def keep(q, k, v, knobs, stats=None):
        o = real(q, k, v, knobs, stats)
        outs[_layer_of(model, stats)[0]] = o
        return o

    monkeypatch.setattr(routing, "standard_attention", keep)
    model = GPT(cfg, AttentionConfig(impl="standard", overrides=att.overrides))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(_tokens(vocab=512))
    for layer, o in outs.items():
        exact_bf16 = (o.float() == o.to(torch.bfloat16).float()).all(dim=(0, 2, 3))  # per head
        fp32_heads = [h for h in range(12) if not exact_bf16[h]]
        assert fp32_heads == ([1, 7, 8] if layer == 2 else []), layer


def test_standard_and_sdpa_agree_with_flash_in_fp32():
    torch.manual_seed(0)
    B, H, T, D = 2, 4, 48, 32
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    knobs = AttentionConfig(recipe="fp32", block_q=16, block_k=16)
    ref = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(
        ~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")), dim=-1) @ v
    for impl in IMPLS:
        o = routing.attend(q, k, v, AttentionConfig(**{**vars(knobs), "impl": impl}))
        assert o.dtype == torch.float32
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_standard_bf16_recipe_rounds_scores_and_p():
    # S in BF16, softmax in FP32, P rounded to BF16 for a BF16 PV: differs from FP32 attention at BF16 level only.
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 32, 32) for _ in range(3))
    o = routing.standard_attention(q, k, v, AttentionConfig(impl="standard"))
    o32 = routing.standard_attention(q, k, v, AttentionConfig(impl="standard", recipe="fp32"))
    assert o.dtype == torch.bfloat16
    err = (o.float() - o32).abs().max().item()
    assert 0 < err < 0.05


def test_sdpa_probe_fills_max_logit_only_when_asked():
    model = GPT(_tiny(), AttentionConfig(impl="sdpa"))
    idx = _tokens()
    model(idx)
    assert all(s.max_logit.item() == float("-inf") for s in model.attention_stats())
    model.probe = True
    assert model.probe
    model(idx)
    stats = model.attention_stats()
    assert all(torch.isfinite(s.max_logit) for s in stats)
    assert all(s.repeated_max_rows.sum() == 0 for s in stats)  # counters are not available on sdpa
    # The probe's max equals the max scaled score computed independently for layer 0.
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(idx.shape[1]))
    q, k, _ = model.transformer.h[0].attn.c_attn(model.transformer.h[0].ln_1(x)).split(128, dim=2)
    q, k = (t.view(2, -1, 4, 32).transpose(1, 2).to(torch.bfloat16) for t in (q, k))
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(32))
    s = s.float().masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), float("-inf"))
    assert stats[0].max_logit.item() == pytest.approx(s.max().item(), rel=1e-2)


def test_wq_spectral_norms_match_svdvals():
    torch.manual_seed(0)
    cfg = ModelConfig(name="t", n_layer=3, n_head=6, n_embd=192, block_size=16, vocab_size=128)
    model = GPT(cfg, AttentionConfig(impl="sdpa"))
    with torch.no_grad():  # spread the spectra: scaled heads, a rank-1 head, a zero head
        for i, b in enumerate(model.transformer.h):
            b.attn.c_attn.weight.mul_(1 + 10 * i)
        w0 = model.transformer.h[0].attn.c_attn.weight
        w0[32:64] = torch.outer(torch.randn(32), torch.randn(192))
        w0[64:96] = 0
    norms = model.wq_spectral_norms()
    assert norms.shape == (3, 6) and norms.dtype == torch.float32 and norms.device == w0.device
    D = cfg.head_dim
    expect = torch.tensor([[torch.linalg.svdvals(b.attn.c_attn.weight[h * D:(h + 1) * D].detach().double())[0].item()
                            for h in range(6)] for b in model.transformer.h], dtype=torch.float32)
    torch.testing.assert_close(norms, expect, rtol=1e-4, atol=1e-6)
    assert norms[0, 2] == 0


@pytest.mark.parametrize("name,shape,params", [
    ("tiny", (4, 4, 128, 64), None),
    ("gpt2_s", (12, 12, 768, 1024), (123_000_000, 126_000_000)),
    ("gpt2_m", (24, 16, 1024, 1024), (350_000_000, 360_000_000)),
])
def test_presets_have_the_stated_sizes(name, shape, params):
    cfg = ModelConfig.preset(name)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (*shape, 50304)
    with torch.device("meta"):
        model = GPT(cfg, AttentionConfig())
    L, _, C, T = shape
    V = 50304
    assert model.num_params() == V * C + T * C + L * (12 * C * C + 2 * C) + C  # tied embedding counted once
    assert model.transformer.wte.weight is model.lm_head.weight
    if params:
        assert params[0] < model.num_params() < params[1]


def test_init_follows_nanogpt():
    torch.manual_seed(0)
    model = GPT(ModelConfig.preset("gpt2_s", n_layer=2, block_size=64), AttentionConfig())
    std = lambda name: dict(model.named_parameters())[name].std().item()  # noqa: E731
    assert std("transformer.h.0.attn.c_attn.weight") == pytest.approx(0.02, rel=0.02)
    assert std("transformer.h.0.mlp.c_fc.weight") == pytest.approx(0.02, rel=0.02)
    assert std("transformer.h.1.attn.c_proj.weight") == pytest.approx(0.02 / math.sqrt(4), rel=0.02)
    assert std("transformer.h.1.mlp.c_proj.weight") == pytest.approx(0.02 / math.sqrt(4), rel=0.02)
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())


@pytest.mark.parametrize("att,key,value", [
    (AttentionConfig(overrides=[LayerOverride(layers=[4], impl="standard")]), "attention.overrides[0].layers", "0..3"),
    (AttentionConfig(o_fp32_heads=[4]), "attention.o_fp32_heads", "0..3"),
    (AttentionConfig(overrides=[LayerOverride(layers=[1], o_fp32_heads=[0, 9])]), "attention.overrides[0].o_fp32_heads",
     "0..3"),
    (AttentionConfig(impl="triton"), "attention.impl", "flash"),
])
def test_bad_attention_indices_fail_when_the_model_is_built(att, key, value, monkeypatch):
    calls = _spy(monkeypatch)
    with pytest.raises(ValueError) as err:
        GPT(_tiny(), att)
    assert key in str(err.value) and value in str(err.value)
    assert calls == {"flash": [], "standard": []}


@pytest.mark.parametrize("change,key", [
    (dict(n_layer=0), "model.n_layer"), (dict(n_head=True), "model.n_head"), (dict(n_embd=130), "model.n_embd"),
    (dict(block_size=-1), "model.block_size"), (dict(vocab_size=1.5), "model.vocab_size"),
    (dict(dropout=1.0), "model.dropout"), (dict(qk_norm="yes"), "model.qk_norm"), (dict(name=""), "model.name"),
])
def test_model_config_validation_names_the_key(change, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ModelConfig(**{**vars(ModelConfig.preset("tiny")), **change}).validate()
    with pytest.raises(ValueError, match="model.name"):
        ModelConfig.preset("gpt3")


def test_model_config_is_a_structured_config():
    from omegaconf import OmegaConf

    node = OmegaConf.structured(ModelConfig.preset("tiny"))
    node.n_layer = 2
    model = GPT(node, {"impl": "sdpa"})
    assert model.config.n_layer == 2 and len(model.attention_routes()) == 2
    with pytest.raises(ValueError, match="unknown keys.*n_layers"):
        GPT({**vars(ModelConfig.preset("tiny")), "n_layers": 2}, {"impl": "sdpa"})


def test_backend_resolution():
    auto = AttentionConfig()
    assert resolve_backend(auto, "cpu") == "emulator"
    assert resolve_backend(AttentionConfig(backend="emulator"), "cpu") == "emulator"
    assert resolve_backend(AttentionConfig(impl="sdpa"), "cpu") == "sdpa"
    with pytest.raises(ValueError, match="attention.backend='triton'"):
        resolve_backend(AttentionConfig(backend="triton"), "cpu")
    model = GPT(_tiny(), AttentionConfig(overrides=[LayerOverride(layers=[1], backend="triton")]))
    with pytest.raises(ValueError, match=r"attention\(layer 1\)\.backend='triton'"):
        model.attention_routes()


@pytest.mark.gpu
def test_cuda_routes_stats_and_norms_stay_on_device():
    model = GPT(_tiny(), AttentionConfig(
        impl="flash", overrides=[LayerOverride(layers=[1], impl="standard"), LayerOverride(layers=[3], impl="sdpa")]))
    model.cuda()
    routes = model.attention_routes()
    assert routes[1] == "standard/paper_bf16" and routes[3] == "sdpa/bf16/no-counters"
    assert routes[0].split("/")[1] == resolve_backend(model.transformer.h[0].attn.knobs, "cuda", head_dim=32,
                                                      n_head=4, seq_len=64)
    idx = _tokens(B=4, T=64).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(s.device.type == "cuda" for s in model.attention_stats())
    norms = model.wq_spectral_norms()
    assert norms.is_cuda and norms.shape == (4, 4)
    w = torch.stack([b.attn.c_attn.weight[:128].view(4, 32, 128) for b in model.transformer.h]).float()
    torch.testing.assert_close(norms, torch.linalg.svdvals(w)[..., 0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32_stream", "bf16_autocast"])
@pytest.mark.parametrize("att", [dict(impl="flash", recipe="paper_bf16"), dict(impl="sdpa"),
                                 dict(impl="flash", recipe="fp32"), dict(impl="standard", recipe="fa2")],
                         ids=["flash", "sdpa", "fp32", "standard"])
def test_c_proj_takes_a_bf16_o_as_it_is_and_every_bit_stays(monkeypatch, autocast, att):
    """Under BF16 autocast a BF16 O enters c_proj without the copy to the FP32 stream that autocast would undo (two
    copies a layer, forward and backward): two training steps' losses and every gradient are bit for bit those of
    the model that makes the round trip (an FP32 O, and runs without autocast, still go to the stream's dtype)."""
    import flash_forensics.models.gpt as gpt

    def run():
        torch.manual_seed(0)
        model = GPT(_tiny(), AttentionConfig(block_q=16, block_k=16, **att))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        out = []
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                _, loss = model(_tokens(seed=step), _tokens(seed=step + 7))
            loss.backward()
            out.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
        return out

    seen = []
    real = gpt._c_proj_input
    monkeypatch.setattr(gpt, "_c_proj_input", lambda y, x: seen.append(real(y, x).dtype) or real(y, x))
    new = run()
    monkeypatch.setattr(gpt, "_c_proj_input", lambda y, x: y.to(x.dtype))  # before: always the stream's dtype
    old = run()
    skipped = autocast and att.get("recipe") != "fp32"
    assert set(seen) == {torch.bfloat16 if skipped else torch.float32}
    for (la, ga), (lb, gb) in zip(new, old):
        assert torch.equal(la, lb)
        assert all(torch.equal(ga[n], gb[n]) for n in ga), [n for n in ga if not torch.equal(ga[n], gb[n])]
