"""fp32_gemm=tf32x3: the TF32 rounding and split (kernels/tf32x3.py), the emulator's model of it, and the knob."""
import pytest
import torch

from flash_forensics.kernels import emulator, tf32x3
from flash_forensics.kernels.config import AttentionConfig, AttentionKnobs
from flash_forensics.kernels.knobs import route_labels

ULP = 2.0 ** -10  # TF32's fraction: 10 bits


def test_to_tf32_rounds_to_nearest_ties_away():
    x = torch.tensor([1 + ULP / 2, 1 + ULP / 4, 1 + 3 * ULP / 4, -(1 + ULP / 2), 1 + ULP + ULP / 2, 2 - 2 ** -23,
                      0.0, -0.0, 3.0], dtype=torch.float32)
    want = [1 + ULP, 1.0, 1 + ULP, -(1 + ULP), 1 + 2 * ULP, 2.0, 0.0, -0.0, 3.0]
    got = tf32x3.to_tf32(x)
    assert got.tolist() == want  # ties (1 + ulp/2) away from zero, for both signs; a carry into the exponent
    assert torch.equal(torch.signbit(got), torch.signbit(torch.tensor(want)))
    assert (got.view(torch.int32) & ((1 << 13) - 1) == 0).all()  # 13 low fraction bits cleared


def test_to_tf32_keeps_inf_nan_and_refuses_other_dtypes():
    x = torch.tensor([float("inf"), float("-inf"), float("nan")])
    y = tf32x3.to_tf32(x)
    assert y[0] == float("inf") and y[1] == float("-inf") and torch.isnan(y[2])
    with pytest.raises(TypeError, match="float32"):
        tf32x3.to_tf32(x.double())


def test_split_is_exact_for_bf16_values_and_keeps_22_bits():
    g = torch.Generator().manual_seed(0)
    b = torch.randn(1000, generator=g).to(torch.bfloat16).float()
    hi, lo = tf32x3.split(b)
    assert torch.equal(hi, b) and (lo == 0).all()  # BF16 (8 bits) is a subset of TF32 (11 bits)
    x = torch.randn(10000, generator=g)
    hi, lo = tf32x3.split(x)
    rel = ((hi.double() + lo.double() - x.double()).abs() / x.double().abs()).max().item()
    assert rel <= 2.0 ** -21  # hi + lo holds ~22 significant bits
    assert ((hi.double() - x.double()).abs() / x.double().abs()).max().item() > 2.0 ** -14  # hi alone does not


def test_matmul_is_fp32_accurate_where_one_tf32_pass_is_not():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 48, generator=g)
    exact = a.double() @ b.double()
    scale = exact.abs().max().item()
    err3 = (tf32x3.matmul(a, b).double() - exact).abs().max().item() / scale
    err_ieee = ((a @ b).double() - exact).abs().max().item() / scale
    err1 = ((tf32x3.to_tf32(a) @ tf32x3.to_tf32(b)).double() - exact).abs().max().item() / scale
    assert err3 <= 4 * err_ieee + 2 ** -22, (err3, err_ieee)
    assert err1 > 50 * err3, (err1, err3)
    bf = a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float()
    assert torch.equal(tf32x3.matmul(*bf), bf[0] @ bf[1] + 0.0)  # BF16 operands: lo terms are 0
    assert torch.equal(tf32x3.matmul(a.double(), b.double()), a.double() @ b.double())  # not FP32: plain


def _run(knobs, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, 2, 96, 32, generator=g) for _ in range(4))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    o = emulator.flash_attention(q, k, v, knobs)
    o.backward(do.to(dtype))
    return [o.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]


def test_emulator_fp32_recipe_tf32x3_is_close_to_fp64_and_not_ieee():
    ref = _run(AttentionKnobs(recipe="fp32", block_q=32, block_k=32), torch.float64)
    ieee = _run(AttentionKnobs(recipe="fp32", block_q=32, block_k=32))
    tc = _run(AttentionKnobs(recipe="fp32", block_q=32, block_k=32, fp32_gemm="tf32x3"))
    assert any(not torch.equal(a, b) for a, b in zip(ieee, tc))  # the knob reaches the emulator's GEMMs
    for r, a, b in zip(ref, ieee, tc):
        scale = r.abs().max().item()
        e_ieee, e_tc = (a - r).abs().max().item() / scale, (b - r).abs().max().item() / scale
        assert e_tc <= 4 * e_ieee + 1e-7, (e_tc, e_ieee)


@pytest.mark.parametrize("recipe", ["paper_bf16", "fa2"])
def test_emulator_bf16_recipes_unchanged_by_the_knob(recipe):
    a = _run(AttentionKnobs(recipe=recipe), torch.bfloat16)
    b = _run(AttentionKnobs(recipe=recipe, fp32_gemm="tf32x3"), torch.bfloat16)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_emulator_lifted_pv_uses_the_model():
    """o_fp32 on fa2 keeps P̄ in FP32: its P̄V GEMM is a real FP32 GEMM, so the knob changes the stored FP32 O, by
    about FP32's own rounding (the returned BF16 O hides it)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 96, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    saved = [emulator.forward(q, k, v, AttentionKnobs(recipe="fa2", o_fp32=True, fp32_gemm=m))[1] for m in
             ("ieee", "tf32x3")]
    assert saved[0].dtype == torch.float32
    diff = (saved[0] - saved[1]).abs().max().item()
    assert 0 < diff < 1e-5 * saved[0].abs().max().item()


def test_knob_values_route_label_and_implementations():
    k = AttentionKnobs(recipe="fp32", fp32_gemm="tf32x3")
    assert route_labels(k, "triton") == ["fp32_gemm=tf32x3"] and route_labels(k, "emulator") == ["fp32_gemm=tf32x3"]
    with pytest.raises(ValueError, match=r"attention.fp32_gemm='tf32' is not allowed: expected one of ieee, tf32x3"):
        AttentionKnobs(fp32_gemm="tf32").validate()
    # standard and sdpa run torch's matmul: the knob means nothing there and is not refused
    AttentionConfig(impl="standard", fp32_gemm="tf32x3").validate(4)
    AttentionConfig(impl="sdpa", fp32_gemm="tf32x3", counters=False).validate(4)
