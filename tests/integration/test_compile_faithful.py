"""torch.compile computes the recipe bit for bit, or is refused: attention(), patch_sdpa() and the transformers backend,
compiled against eager on the same inputs (CPU; CUDA in the gpu-marked test). Inductor keeps a fused chain's BF16
intermediates in FP32 unless emulate_precision_casts is set: compiling without it is refused while dynamo traces.
Kept small (one causal and one padded shape, a one-layer Llama): inductor compiles slowly on a 2-core CPU."""
import pytest
import torch
import torch._inductor.config as inductor
import torch.nn.functional as F

import flash_forensics
from flash_forensics.hf_backend import NAME
from flash_forensics.sdpa import attention, patch_sdpa

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    torch._dynamo.reset()  # nothing compiled by another test (or with another setting) is reused
    yield
    torch._dynamo.reset()


def _qkv(device="cpu", B=2, H=2, T=16, D=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, D, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(3)]


def _padded(device="cpu"):
    m = torch.ones(2, 1, 16, 16, dtype=torch.bool, device=device).tril()
    m[1, :, :, :5] = False  # left padding: key-padded rows, rows with no key
    return m


def _run(f, q, k, v):
    o = f(q, k, v)
    return (o, *torch.autograd.grad(o.float().square().sum(), (q, k, v)))


def test_compiling_without_emulated_casts_is_refused_naming_the_setting(inductor_casts):
    inductor_casts(False)
    q, k, v = _qkv()
    with pytest.raises(Exception, match=r"emulate_precision_casts=False is not allowed while compiling.*expected True"):
        torch.compile(lambda q, k, v: attention(q, k, v, is_causal=True))(q, k, v)


@pytest.mark.parametrize("masked,recipe", [(False, "paper_bf16"), (True, "paper_bf16"), (True, "fp32")])
def test_attention_compiled_equals_eager_bit_for_bit(inductor_casts, masked, recipe):
    """fp32: inductor's own FP32 code for the emulator's steps differed in the last bits (the emulator now runs
    eagerly inside the graph); paper_bf16: 488 of 1,024 outputs differed without emulated casts."""
    inductor_casts(True)
    q, k, v = (x.detach().to(torch.float32 if recipe == "fp32" else torch.bfloat16).requires_grad_()
               for x in _qkv())
    mask = _padded() if masked else None

    def f(q, k, v):
        return attention(q, k, v, attn_mask=mask, is_causal=not masked, recipe=recipe, block_q=8, block_k=8)

    for a, b in zip(_run(torch.compile(f), q, k, v), _run(f, q, k, v), strict=True):
        assert torch.equal(a, b)


def test_patch_sdpa_sets_emulated_casts_in_its_scope_only(inductor_casts):
    inductor_casts(False)
    q, k, v = _qkv()

    def f(q, k, v):  # unchanged SDPA code
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with patch_sdpa(recipe="paper_bf16", block_q=8, block_k=8):
        assert inductor.emulate_precision_casts is True
        got = _run(torch.compile(f), q, k, v)
        want = _run(f, q, k, v)
    assert inductor.emulate_precision_casts is False
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def _llama(device):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).to(device, torch.bfloat16)
    flash_forensics.use(model, recipe="paper_bf16", block_q=16, block_k=16)
    # distinct tokens: the embedding's backward sums a repeated token's rows in another order under inductor,
    # a difference outside attention
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:32].view(2, 16).to(device)
    return model, ids


def _model_run(model, fn, ids):
    logits = fn(input_ids=ids).logits
    return (logits, *torch.autograd.grad(logits.float().square().mean(), list(model.parameters())))


def _compare_backend(inductor_casts, device):
    inductor_casts(True)
    model, ids = _llama(device)
    got = _model_run(model, torch.compile(model), ids)
    want = _model_run(model, model, ids)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    inductor_casts(False)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="emulate_precision_casts=False is not allowed"):
        torch.compile(model)(input_ids=ids)


def test_backend_compiled_model_equals_eager_bit_for_bit(inductor_casts):
    _compare_backend(inductor_casts, "cpu")


@pytest.mark.gpu
def test_backend_and_attention_compiled_equal_eager_on_cuda(inductor_casts):
    """CUDA: the backend's model (plain causal calls on the Triton route when it computes the knobs) and a padded
    attention() call on the emulator, compiled against eager, bit for bit."""
    _compare_backend(inductor_casts, "cuda")
    inductor_casts(True)
    torch._dynamo.reset()
    q, k, v = _qkv("cuda")
    mask = _padded("cuda")
    f = lambda q, k, v: attention(q, k, v, attn_mask=mask, block_q=16, block_k=16)  # noqa: E731
    for a, b in zip(_run(torch.compile(f), q, k, v), _run(f, q, k, v), strict=True):
        assert torch.equal(a, b)
