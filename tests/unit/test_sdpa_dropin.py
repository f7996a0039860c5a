"""flash_forensics.attention / patch_sdpa against torch's scaled_dot_product_attention, and the emulator's masking."""
import pytest
import torch
import torch.nn.functional as F

from flash_forensics import hooks
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import flash_attention, reference_attention
from flash_forensics.kernels.masking import Masking
from flash_forensics.kernels.stats import AttnStats
from flash_forensics.sdpa import attention, patch_sdpa


def _inputs(tq, tk, d=16, h=4, hk=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, t, d, generator=g, dtype=torch.float64).to(dtype)
            for n, t in ((h, tq), (hk, tk), (hk, tk), (h, tq))]


def _mask(kind, tq, tk):
    g = torch.Generator().manual_seed(1)
    if kind == "bool":
        m = torch.rand(2, 1, tq, tk, generator=g) > 0.4
        m[1, 0, 2] = False  # a row with no key: SDPA returns 0 there
        return m
    if kind == "additive":
        m = torch.randn(tq, tk, generator=g, dtype=torch.float64)
        m[torch.rand(tq, tk, generator=g) > 0.7] = float("-inf")
        m[:, 0] = 0.0
        return m
    return None


def _both(q, k, v, w, **kw):
    out = []
    for fn in (lambda *a: attention(*a, recipe="fp32", block_q=8, block_k=8, **kw),
               lambda *a: F.scaled_dot_product_attention(*a, **kw)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = fn(*leaves)
        out.append((o, *torch.autograd.grad((o * w).sum(), leaves)))
    return out


@pytest.mark.parametrize("tq,tk", [(19, 19), (7, 19), (19, 7)])
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize("gqa", [False, True])
def test_matches_torch_sdpa_in_fp64(tq, tk, kind, gqa):
    q, k, v, w = _inputs(tq, tk, hk=2 if gqa else 4)
    mine, ref = _both(q, k, v, w, attn_mask=_mask(kind, tq, tk), is_causal=kind == "causal", enable_gqa=gqa)
    for a, b in zip(mine, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a - b).abs().max().item() < 1e-12


def test_scale_and_large_head_dim_in_fp32():
    q, k, v, w = _inputs(13, 13, d=256, dtype=torch.float32)
    mine, ref = _both(q, k, v, w, is_causal=True, scale=0.07)
    assert max((a - b).abs().max().item() for a, b in zip(mine, ref, strict=True)) < 1e-4


def test_causal_self_attention_is_the_emulators_own_path_bit_for_bit():
    q, k, v, _ = _inputs(70, 70, dtype=torch.bfloat16)
    knobs = AttentionKnobs(recipe="paper_bf16")
    s1, s2 = AttnStats(4), AttnStats(4)
    assert torch.equal(attention(q, k, v, is_causal=True, stats=s1), flash_attention(q, k, v, knobs, s2))
    assert torch.equal(s1.repeated_max_rows, s2.repeated_max_rows) and torch.equal(s1.rows_seen, s2.rows_seen)


def test_masking_with_the_causal_mask_equals_the_default_path_bit_for_bit():
    """A bool tril mask (what transformers passes) computes the same bits as causal=True in paper_bf16 and fa2."""
    q, k, v, do = _inputs(70, 70, dtype=torch.bfloat16)
    keep = torch.ones(70, 70, dtype=torch.bool).tril()[None, None]
    for recipe in ("paper_bf16", "fa2"):
        knobs = AttentionKnobs(recipe=recipe)
        ref = reference_attention(q, k, v, knobs, do)
        got = reference_attention(q, k, v, knobs, do, masking=Masking(causal=False, keep=keep))
        for a, b in zip(ref, got, strict=True):
            assert torch.equal(a, b), recipe
        s1, s2 = AttnStats(4), AttnStats(4)  # the counters too: rows_seen skips rows without a key in a tile
        flash_attention(q, k, v, knobs, s1)
        flash_attention(q, k, v, knobs, s2, masking=Masking(causal=False, keep=keep))
        assert all(torch.equal(a, b) for a, b in zip(s1.snapshot(), s2.snapshot(), strict=True)), recipe


@pytest.mark.parametrize("call,needle", [
    (lambda q, k, v: attention(q, k, v, dropout_p=0.1), "dropout_p=0.1"),
    (lambda q, k, v: attention(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool), is_causal=True), "is_causal"),
    (lambda q, k, v: attention(q, k, v, blocks=3), "unknown knob"),
    (lambda q, k, v: attention(q, k, v, impl="standard"), "impl='standard'"),
    (lambda q, k, v: attention(q, k, v, backend="triton"), "backend='triton'"),
    (lambda q, k, v: attention(q, k, v, recipe="fp8"), "recipe='fp8'"),
    (lambda q, k, v: attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool)), "attn_mask.shape"),
    (lambda q, k, v: attention(q, k, v, attn_mask=torch.zeros(5, 5, requires_grad=True)), "requires grad"),
    (lambda q, k, v: attention(q, k, v, attn_mask=torch.zeros(5, 5, device="meta")),  # not masking.keep.device
     "attn_mask.device=meta is not allowed: expected q's device cpu"),
    (lambda q, k, v: attention(q, k[:, :2], v[:, :2]), "enable_gqa"),
    (lambda q, k, v: attention(q, k[:, :3], v[:, :3], enable_gqa=True), "divisor"),
    (lambda q, k, v: attention(q[0], k[0], v[0]), "4 dims"),
    (lambda q, k, v: attention(q, k, v, is_causal=True, scale=0), "scale=0 is not allowed"),  # not masking.scale
    (lambda q, k, v: attention(q, k, v, scale=float("nan")), "scale=nan is not allowed"),
])
def test_refusals_name_the_argument(call, needle):
    q, k, v, _ = _inputs(5, 5)
    with pytest.raises(ValueError, match="not allowed|unknown"):
        try:
            call(q, k, v)
        except ValueError as e:
            assert needle in str(e), str(e)
            raise


def test_refusals_show_a_tensor_by_shape_and_dtype_only():
    q, k, v, _ = _inputs(5, 5)
    big = torch.full((300,), 0.123)
    for kw, name in ((dict(scale=big), "scale"), (dict(is_causal=big), "is_causal"), (dict(dropout_p=big), "dropout_p"),
                     (dict(beta=big), "flash_forensics.beta"), (dict(recipe=big), "flash_forensics.recipe")):
        with pytest.raises(ValueError) as e:
            attention(q, k, v, **kw)
        msg = str(e.value)
        assert f"{name}=a tensor of shape (300,) and dtype torch.float32 is not allowed" in msg, msg
        assert "0.123" not in msg and len(msg) < 300, msg


def test_patch_sdpa_routes_and_restores_also_on_errors():
    q, k, v, _ = _inputs(9, 9, dtype=torch.bfloat16)
    original = F.scaled_dot_product_attention
    calls = []
    with hooks.observing(calls.append), patch_sdpa(recipe="paper_bf16", block_q=4, block_k=4) as knobs:
        got = F.scaled_dot_product_attention(q, k, v, None, 0.0, True)  # nanoGPT's positional call
    assert F.scaled_dot_product_attention is original
    assert torch.equal(got, flash_attention(q, k, v, knobs))
    assert len(calls) == 1 and calls[0].implementation == "emulator" and calls[0].is_causal
    with pytest.raises(RuntimeError), patch_sdpa(recipe="fa2"):
        raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original
    with pytest.raises(ValueError, match="patch_sdpa.beta"):
        with patch_sdpa(beta=0.5):
            pass
    assert F.scaled_dot_product_attention is original


def test_patch_sdpa_blocks_closed_out_of_order_leave_torch_s_function_and_inductor_as_they_were(inductor_casts):
    import torch._inductor.config as inductor

    inductor_casts(False)
    q, k, v, _ = _inputs(5, 5, dtype=torch.float32)
    original = F.scaled_dot_product_attention

    def recipe():
        calls = []
        with hooks.observing(calls.append):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return calls[0].recipe if calls else "torch"

    outer, inner = patch_sdpa(recipe="fp32"), patch_sdpa(recipe="fa2")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # an ExitStack or a generator closed late: not LIFO
    assert recipe() == "fa2" and inductor.emulate_precision_casts is True  # was torch's, inner still open
    inner.__exit__(None, None, None)
    assert F.scaled_dot_product_attention is original  # was fp32's patch, for good
    assert inductor.emulate_precision_casts is False  # was left True
    with patch_sdpa(recipe="fp32"), patch_sdpa(recipe="fa2"):  # nested as usual
        assert recipe() == "fa2"
    assert F.scaled_dot_product_attention is original and recipe() == "torch"


def test_rows_whose_first_key_tiles_are_all_masked():
    """The running max starts at the fill value there; later tiles must wash that start out (alpha = 0)."""
    q, k, v, w = _inputs(12, 20)
    keep = torch.ones(12, 20, dtype=torch.bool)
    keep[3, :16] = False  # row 3: its first two key tiles (8 wide) see nothing
    keep[5] = False  # row 5: no key at all
    mine, ref = _both(q, k, v, w, attn_mask=keep)
    assert max((a - b).abs().max().item() for a, b in zip(mine, ref, strict=True)) < 1e-12
    for recipe in ("paper_bf16", "fa2"):  # BF16 recipes: finite, row 5 zero, close to the FP64 answer
        o = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=keep, recipe=recipe, block_q=8, block_k=8)
        assert torch.isfinite(o).all() and (o[:, :, 5] == 0).all()
        assert (o.double() - ref[0]).abs().max().item() < 0.05


@pytest.mark.gpu
def test_cuda_plain_causal_calls_run_on_triton_and_masked_ones_on_the_emulator():
    from flash_forensics.kernels.triton_flash import flash_attention_triton

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    calls = []
    with hooks.observing(calls.append):
        o = attention(q, k, v, is_causal=True, recipe="paper_bf16")
        keep = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()
        o_masked = attention(q, k, v, attn_mask=keep, recipe="paper_bf16")
    assert [c.implementation for c in calls] == ["triton", "emulator"]
    assert torch.equal(o, flash_attention_triton(q, k, v, AttentionKnobs(recipe="paper_bf16")))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (o_masked.float() - ref).abs().max().item() < 0.05 and (o.float() - ref).abs().max().item() < 0.05
    o32 = attention(q.float(), k.float(), v.float(), is_causal=True, recipe="fp32")
    assert (o32 - ref).abs().max().item() < 1e-4
