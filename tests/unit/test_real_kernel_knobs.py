"""The real-kernel knobs (exp_form, key_order, normalize, kv_split, rowsum_order, tensor_core): each changes what it
says and nothing when off, the tensor-core model truncates as documented, the rules follow FlashAttention-2's code."""
import pytest
import torch

from flash_forensics.capture.synthetic import random_inputs, tied_inputs
from flash_forensics.kernels import emulator, real_kernels
from flash_forensics.kernels import tensor_core as tc
from flash_forensics.kernels.config import AttentionKnobs


def _o(q, k, v, **kw):
    return emulator.forward(q, k, v, AttentionKnobs(recipe="fa2", counters=False, **kw).validate())


def test_the_forms_off_are_the_recipe_bit_for_bit():
    q, k, v, _ = random_inputs(1, 2, 96, 32, seed=2)
    base = _o(q, k, v)
    same = _o(q, k, v, exp_form="exp", key_order="forward", normalize="divide", kv_split=0, rowsum_order="torch",
              tensor_core="exact")
    for a, b in zip(base, same, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("change", [dict(exp_form="exp2_folded"), dict(exp_form="exp2_mul"),
                                    dict(key_order="reverse"), dict(normalize="reciprocal"), dict(kv_split=32),
                                    dict(rowsum_order="fa2_threads"), dict(tensor_core="sm90")])
def test_each_form_changes_some_bits_and_stays_close(change):
    """On the fp32 recipe (FP32 O: no BF16 rounding hides a last-bit change); tensor_core on fa2 (it models narrow
    operands only)."""
    q, k, v, _ = random_inputs(1, 2, 128, 32, seed=3)
    recipe = "fa2" if "tensor_core" in change else "fp32"
    if recipe == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    kn = dict(recipe=recipe, counters=False, block_q=32, block_k=32)
    o0, _, lse0 = emulator.forward(q, k, v, AttentionKnobs(**kn).validate())
    o1, _, lse1 = emulator.forward(q, k, v, AttentionKnobs(**kn, **change).validate())
    assert not torch.equal(o0, o1)
    assert (o0.float() - o1.float()).abs().max() < 0.02 and (lse0 - lse1).abs().max() < 1e-4


def test_folded_exp2_gives_p_bar_one_at_the_row_max():
    """FlashAttention-2 rounds S * c and m * c apart: at the max they are the same number, so P̄ = 1 exactly (with
    one FMA it would be exp2 of the product's rounding error)."""
    q, k, v, _ = tied_inputs(1, 1, 64, 32, seed=0)
    cap = {}
    emulator.forward(q, k, v, AttentionKnobs(recipe="fa2", exp_form="exp2_folded", counters=False), capture=cap)
    tile = cap["tiles"][0]
    assert bool((tile["p_bar"].amax(dim=-1) == 1.0).all())


def test_one_split_is_no_split():
    q, k, v, _ = random_inputs(1, 2, 64, 32, seed=4)
    a = _o(q, k, v, block_q=32, block_k=32)[0]
    assert torch.equal(a, _o(q, k, v, block_q=32, block_k=32, kv_split=64)[0])
    assert not torch.equal(a, _o(q, k, v, block_q=32, block_k=32, kv_split=32)[0])


def test_tensor_core_block_truncates_below_the_largest_term():
    """1 + 15 products of 2^-26 in one block: with 25 bits below the block max (2^0) each small product truncates to
    0; with 26 bits they are kept and the sum truncates toward zero to FP32; exact FP32 rounds to nearest."""
    a = torch.tensor([[1.0] + [2.0 ** -13] * 15])
    b = a.t().clone()
    ulp = 2.0 ** -23
    assert (a.double() @ b.double()).float().item() == 1 + 2 * ulp  # 1 + 1.875 ulp, to nearest
    assert tc.matmul(a, b, None, 16, 25, None).item() == 1.0
    assert tc.matmul(a, b, None, 16, 26, None).item() == 1 + ulp
    assert tc.round_toward_zero(torch.tensor([-(1 + 1.875 * ulp)], dtype=torch.float64)).item() == -(1 + ulp)


def test_fp8_promotion_adds_in_fp32_every_block_of_products():
    """A product of 64 first, then 255 of 2^-10: 13 bits below 64 is 2^-7, so while the accumulator holds 64 the
    small products vanish; cuBLAS' promotion every 128 products restarts the accumulator from 0."""
    a = torch.ones(1, 256)
    b = torch.full((256, 1), 2.0 ** -10)
    b[0, 0] = 64.0
    assert tc.matmul(a, b, None, *tc.params("sm90_fast_fp8", True)).item() == 64.0
    assert tc.matmul(a, b, None, *tc.params("sm90", True)).item() == 64.0 + 128 * 2.0 ** -10


def test_bad_values_name_the_knob():
    with pytest.raises(ValueError, match="attention.exp_form"):
        AttentionKnobs(exp_form="exp10").validate()
    with pytest.raises(ValueError, match="attention.kv_split"):
        AttentionKnobs(kv_split=-1).validate()
    with pytest.raises(ValueError, match="attention.softmax.*exp_form"):
        AttentionKnobs(exp_form="exp2_folded", softmax="stabilized").validate()


def test_fa2_rule_splits_as_flash_api_does():
    assert real_kernels.num_splits_heuristic(8, 264, 2, 128) == 2  # B1 H2 T256 D128: two splits of 128 keys
    assert real_kernels.num_splits_heuristic(8, 264, 1, 128) == 1
    assert real_kernels.num_splits_heuristic(400, 264, 8, 128) == 1  # a full grid: no split
    d128 = real_kernels.rule_knobs("torch_flash_sm90", 1, 2, 256, 128)
    d64 = real_kernels.rule_knobs("torch_flash_sm90", 1, 2, 256, 64)
    assert (d128["block_q"], d128["block_k"], d128["kv_split"]) == (64, 128, 128)
    assert (d64["block_q"], d64["block_k"], d64.get("kv_split", 0)) == (128, 128, 0)
    AttentionKnobs(**d128).validate()
    with pytest.raises(ValueError, match="rule 'fa9'"):
        real_kernels.rule_knobs("fa9", 1, 1, 1, 1)


def test_analyze_fingerprints_the_kernels_own_backward(tmp_path):
    from flash_forensics.capture.analysis import analyze
    from flash_forensics.capture.recorder import write_call
    from flash_forensics.kernels.emulator import reference_attention
    q, k, v, do = tied_inputs(1, 2, 64, 32, seed=5)
    kn = AttentionKnobs(recipe="fa2")
    o, lse, dq, dk, dv = reference_attention(q, k, v, kn, do=do)
    dk = dk.clone()
    dk.view(torch.int16)[0, 1, 3, 4] += 1  # one element of the kernel's dK differs
    path = write_call(tmp_path / "g.safetensors", q, k, v, o, do, dq=dq, dk=dk, dv=dv, family="test", layer=0)
    bwd = analyze(path, attribute=False, progress=False)["fingerprint"]["backward"]
    assert bwd["dq"] == 1.0 and bwd["dv"] == 1.0 and bwd["dk"] == 1 - 1 / dk.numel()


@pytest.mark.parametrize("recipe", ["fa2", "fp32"])
def test_folded_exp2_keeps_the_counters_of_exp(recipe):
    """exp2_folded's online softmax runs on the unscaled scores, but its counters read the scaled ones, as exp_form=exp
    does: repeated maxima and the max logit bit for bit (the Triton forward computes the form too, and the same
    counts; tests/unit/test_triton.py)."""
    from flash_forensics.kernels.stats import AttnStats
    q, k, v, _ = tied_inputs(2, 2, 96, 32, seed=5)
    if recipe == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    st = [AttnStats(2, "cpu"), AttnStats(2, "cpu")]
    for form, s in zip(("exp", "exp2_folded"), st):
        emulator.flash_attention(q, k, v, AttentionKnobs(recipe=recipe, block_q=32, block_k=32, exp_form=form), s)
    assert st[0].repeated_max_rows.sum() > 0
    for name in ("repeated_max_rows", "max_logit", "rows_seen", "underflow_rows"):
        assert torch.equal(getattr(st[0], name), getattr(st[1], name)), name


def test_a_route_says_why_exp2_folded_stays_on_the_emulator():
    """Triton folds exp2 only on FP32 scores and statistics with tiling on: paper_bf16's route names exp_form as what
    Triton lacks; fa2's does not."""
    from flash_forensics.models.attention import route_name
    assert route_name(AttentionKnobs(recipe="paper_bf16", exp_form="exp2_folded"), "emulator") == \
        "flash/emulator (triton lacks: exp_form)/paper_bf16+exp2_folded"
    assert route_name(AttentionKnobs(recipe="fa2", exp_form="exp2_folded"), "triton") == "flash/triton/fa2+exp2_folded"
