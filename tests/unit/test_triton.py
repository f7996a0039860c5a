"""Triton flash attention against an FP64 reference and the emulator (flash_forensics.kernels.emulator.flash_attention,
the source of truth).

CPU: Triton's interpreter (TRITON_INTERPRET=1) runs the same kernels on tiny shapes. It gets BF16 wrong (tl.dot of
BF16 inputs and .to(tl.bfloat16) rounding differ from the GPU), so on CPU only the FP32 logic is checked: the fp32
recipe, tiling on/off, safe/stabilized softmax, the three deltas and the repeated-maxima counters. The BF16 recipes
are checked by the `gpu` tests on CUDA.
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flash_forensics.kernels import emulator
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.stats import AttnStats

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


INTERP = os.environ.get("TRITON_INTERPRET") == "1"
# Triton must see TRITON_INTERPRET=1 before it is first imported, so the interpreter checks run in a child pytest
# (test_interpreter_checks); in this process they are skipped with that reason.
interp = pytest.mark.skipif(not INTERP, reason="runs in a child process with TRITON_INTERPRET=1 "
                                                 "(see test_interpreter_checks)")


@pytest.fixture(scope="module")
def tfi():
    from flash_forensics.kernels import triton_flash
    return triton_flash


def test_interpreter_checks():
    """Run the interpreter checks below in a child pytest with TRITON_INTERPRET=1 (CPU, FP32 logic)."""
    if INTERP:
        pytest.skip("already inside the interpreter run")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreter",
                          os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail


def _emulator():
    return emulator.flash_attention, AttnStats


class _Stats:
    """AttnStats' device contract, for kernel tests that must not depend on the emulator landing."""

    def __init__(self, n_head, device):
        self.repeated_max_rows = torch.zeros(n_head, dtype=torch.int64, device=device)
        self.max_logit = torch.full((), float("-inf"), dtype=torch.float32, device=device)


def reference(q, k, v):
    """Causal softmax attention in FP64."""
    q, k, v = (x.double() for x in (q, k, v))
    T = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def tile_counts_fp32(q, k, block_k, eps, tiling=True):
    """Per-head count of (row, key tile) pairs with more than one score within eps of the tile's row max (FP32)."""
    B, H, T, D = q.shape
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    bk = block_k if tiling else T
    out = torch.zeros(H, dtype=torch.int64, device=q.device)
    for j in range(0, T, bk):
        st, ok = s[..., j:j + bk], causal[:, j:j + bk]
        st = st.masked_fill(~ok, float("-inf"))
        rm = st.amax(-1, keepdim=True)
        near = ok & (rm - st <= eps)
        fire = (near.sum(-1) > 1) & ok.any(-1)
        out += fire.sum(dim=(0, 2))
    return out


def planted(B, H, T, D, device, dtype=torch.float32, seed=0):
    """Random q, k, v with repeated keys, so many rows have exactly repeated maxima (the SFA condition)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, H, T, D, generator=g)
    v = torch.randn(B, H, T, D, generator=g)
    k[:, :, 1::3] = k[:, :, 0:T - 1:3][:, :, : k[:, :, 1::3].shape[2]]  # every third key repeats its neighbour
    q = q * 2.0  # sharper scores: large positive and negative row maxima both occur
    return [x.to(device=device, dtype=dtype).requires_grad_(True) for x in (q, k, v)]


def _grads(o, inputs, g):
    return torch.autograd.grad(o, inputs, g)


# ------------------------------------------------------------------------------------------ CPU: interpreter, FP32
FP32_CASES = [
    dict(),
    dict(softmax="stabilized"),
    dict(softmax="stabilized", beta=4.0, tiling=False),
    dict(tiling=False),
    dict(delta="dP_P"),
    dict(delta="recompute_fp32", softmax="stabilized"),
    dict(block_q=32, block_k=16),
    dict(fp32_gemm="tf32x3"),  # the interpreter's tl.dot ignores the precision: this checks the plumbing
    dict(fp32_gemm="tf32x3", delta="recompute_fp32", tiling=False),
]


@interp
@pytest.mark.parametrize("case", FP32_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_interpreter_fp32_matches_fp64(tfi, case):
    knobs = replace(AttentionKnobs(recipe="fp32", block_q=16, block_k=16), **case)
    q, k, v = planted(1, 2, 40, 16, "cpu")
    o = tfi.flash_attention_triton(q, k, v, knobs)
    r = reference(q, k, v)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.double(), r, atol=2e-6, rtol=2e-6)
    g = torch.randn_like(o)
    for a, b in zip(_grads(o, (q, k, v), g), _grads(r, (q, k, v), g.double())):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("tiling", [True, False])
def test_interpreter_counters_fp32(tfi, tiling):
    knobs = AttentionKnobs(recipe="fp32", block_q=16, block_k=16, tiling=tiling, counters=True)
    q, k, v = planted(2, 3, 48, 16, "cpu", seed=1)
    stats = _Stats(3, "cpu")
    tfi.flash_attention_triton(q, k, v, knobs, stats)
    expect = tile_counts_fp32(q.detach(), k.detach(), 16, knobs.eps, tiling)
    assert expect.sum() > 0, "the planted inputs must contain repeated maxima"
    assert torch.equal(stats.repeated_max_rows, expect)
    smax = (q.detach() @ k.detach().transpose(-1, -2) / 4.0).masked_fill(
        ~torch.ones(48, 48, dtype=torch.bool).tril(), float("-inf")).max()
    torch.testing.assert_close(stats.max_logit, smax.float())
    tfi.flash_attention_triton(q, k, v, knobs, stats)  # counters accumulate across calls
    assert torch.equal(stats.repeated_max_rows, 2 * expect)


@interp
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32)])
def test_interpreter_counters_match_emulator(tfi, blocks):
    flash_attention, AttnStats = _emulator()
    knobs = AttentionKnobs(recipe="fp32", block_q=blocks[0], block_k=blocks[1], softmax="stabilized", counters=True)
    q, k, v = planted(1, 2, 48, 16, "cpu", seed=2)
    st_t, st_e = AttnStats(2, "cpu"), AttnStats(2, "cpu")
    o_t = tfi.flash_attention_triton(q, k, v, knobs, st_t)
    o_e = flash_attention(q, k, v, knobs, st_e)
    assert st_e.repeated_max_rows.sum() > 0
    assert torch.equal(st_t.repeated_max_rows, st_e.repeated_max_rows)
    assert torch.equal(st_t.rows_seen, st_e.rows_seen)
    torch.testing.assert_close(st_t.max_logit, st_e.max_logit)
    torch.testing.assert_close(o_t.float(), o_e.float(), atol=2e-6, rtol=2e-6)


@interp
@pytest.mark.parametrize("case", [dict(), dict(block_q=32, block_k=16), dict(key_keep=True)],
                         ids=["default", "q32k16", "keypad"])
def test_interpreter_exp2_folded_matches_the_emulator_and_keeps_the_counters(tfi, case):
    """exp_form=exp2_folded (FlashAttention-2's softmax on unscaled scores, P̄ = exp2(fl(S c) - fl(m c))) in the
    forward: O, lse and gradients as the emulator's exp2_folded computes them, and the counters bit for bit as
    exp_form=exp counts them (they read the scaled scores either way); O within FP32 noise of exp_form=exp."""
    from flash_forensics.kernels.masking import Masking
    flash_attention, AttnStats = _emulator()
    case = dict(case)
    B, H, T, D = 3, 2, 48, 16
    keep = _padded_keep(B, T) if case.pop("key_keep", False) else None
    knobs = replace(AttentionKnobs(recipe="fp32", block_q=16, block_k=16, counters=True), **case)
    folded = replace(knobs, exp_form="exp2_folded")
    assert tfi.supports(folded, torch.empty(1, H, T, D))
    q, k, v = planted(B, H, T, D, "cpu", seed=6)
    st_f, st_x, st_e = AttnStats(H, "cpu"), AttnStats(H, "cpu"), AttnStats(H, "cpu")
    o_f = tfi.flash_attention_triton(q, k, v, folded, st_f, key_keep=keep)
    o_x = tfi.flash_attention_triton(q, k, v, knobs, st_x, key_keep=keep)
    if keep is None:
        o_e = flash_attention(q, k, v, folded, st_e)
    else:
        m = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
        o_e = flash_attention(q, k, v, folded, st_e, Masking(keep=m))
        live = m.any(-1, keepdim=True)  # rows with a key (the kernels give the others O = 0)
        o_f, o_x, o_e = (torch.where(live, x, 0.0) for x in (o_f, o_x, o_e))
    assert st_x.repeated_max_rows.sum() > 0
    for name in ("repeated_max_rows", "max_logit", "underflow_rows", "rows_seen"):
        assert torch.equal(getattr(st_f, name), getattr(st_x, name)), name
    assert torch.equal(st_e.repeated_max_rows, st_f.repeated_max_rows)
    torch.testing.assert_close(o_f, o_e, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(o_f, o_x, atol=2e-6, rtol=2e-6)
    assert not torch.equal(o_f, o_x), "the folded form must change some bits of O (else the knob did nothing)"
    g = torch.randn_like(o_f)
    for a, b in zip(_grads(o_f, (q, k, v), g), _grads(o_e, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_exp2_folded_routes_to_triton_only_where_the_kernels_fold_it(tfi):
    """The forward folds the scale on FP32 scores and statistics with tiling on (fa2, fp32); paper_bf16's BF16 scores,
    or tiling off, stay on the emulator (knob table + supports), so no route drops the knob."""
    from flash_forensics.kernels.knobs import unsupported
    q = torch.empty(1, 2, 64, 64)
    for recipe, tiling, ok in (("fa2", True, True), ("fp32", True, True), ("paper_bf16", True, False),
                               ("fa2", False, False)):
        knobs = AttentionKnobs(recipe=recipe, tiling=tiling, exp_form="exp2_folded")
        assert not unsupported(knobs, "triton")
        assert tfi.fold_supported(knobs) is ok, (recipe, tiling)
    assert not tfi.fold_supported(AttentionKnobs(recipe="fa2", round_bf16=["scores"], exp_form="exp2_folded"))
    for recipe, tiling in (("fa2", True), ("paper_bf16", True), ("fa2", False)):  # any device: as exp does, or no
        knobs = AttentionKnobs(recipe=recipe, tiling=tiling)
        ok = tfi.supports(knobs, q) and tfi.fold_supported(knobs)
        assert tfi.supports(replace(knobs, exp_form="exp2_folded"), q) is ok
    assert unsupported(AttentionKnobs(exp_form="exp2_mul"), "triton")  # only the folded form is in the kernels


@interp
@pytest.mark.parametrize("tiling", [True, False])
def test_interpreter_underflow_rows_match_emulator(tfi, tiling):
    """Algorithm 3 at huge logits: the shift beta * rowmax underflows every P̄ of a row with repeated maxima (the
    paper regime's SFA forks). The kernel counts those rows per head as the emulator does; safe softmax has none."""
    flash_attention, AttnStats = _emulator()
    knobs = AttentionKnobs(recipe="fp32", block_q=16, block_k=16, tiling=tiling, softmax="stabilized", counters=True)
    q, k, v = planted(1, 2, 48, 16, "cpu", seed=4)
    with torch.no_grad():
        q.mul_(100.0)  # scores ~ 10^2: exp(-(beta - 1) * rowmax) is 0 in FP32
    st_t, st_e = AttnStats(2, "cpu"), AttnStats(2, "cpu")
    tfi.flash_attention_triton(q, k, v, knobs, st_t)
    flash_attention(q, k, v, knobs, st_e)
    assert st_e.underflow_rows.sum() > 0, "the inputs must underflow rows under exact Algorithm 3"
    assert torch.equal(st_t.underflow_rows, st_e.underflow_rows)
    st_safe = AttnStats(2, "cpu")
    tfi.flash_attention_triton(q, k, v, replace(knobs, softmax="safe"), st_safe)
    assert st_safe.underflow_rows.sum() == 0 and st_safe.repeated_max_rows.sum() > 0


def _padded_keep(B, T):
    """Left, right and inner padding in three batch elements (nonzero = attend)."""
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, :19] = False  # left padding: rows 0..18 have no key at all
    keep[1, 30:] = False  # right padding
    keep[2, :3] = False
    keep[2, 10:25] = False  # a hole
    return keep


KEYPAD_CASES = [dict(), dict(softmax="stabilized"), dict(tiling=False), dict(delta="dP_P"),
                dict(delta="recompute_fp32"), dict(block_q=32, block_k=16), dict(block_q=16, block_k=32),
                dict(pbar_clamp=True), dict(pbar_clamp=True, delta="dP_P", tiling=False),
                dict(pbar_clamp=True, delta="recompute_fp32", block_q=32, block_k=16),
                dict(softmax="stabilized_guarded"), dict(softmax="stabilized_guarded", tiling=False)]


@interp
@pytest.mark.parametrize("case", KEYPAD_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_interpreter_key_padding_matches_the_emulators_mask(tfi, case):
    """key_keep masks keys on top of causality as the emulator's Masking(keep=tril & keep) does: O and its gradients
    on every row with a key, and every counter; rows with no key give O = 0 (as SDPA and the backend's dead rows)."""
    from flash_forensics.kernels.masking import Masking
    B, H, T, D = 3, 2, 40, 16
    q, k, v = (x.detach() for x in planted(B, H, T, D, "cpu", seed=5))
    keep = _padded_keep(B, T)
    knobs = replace(AttentionKnobs(recipe="fp32", block_q=16, block_k=16, counters=True), **case)
    xt = [x.clone().requires_grad_(True) for x in (q, k, v)]
    xe = [x.clone().requires_grad_(True) for x in (q, k, v)]
    st_t, st_e = AttnStats(H), AttnStats(H)
    o_t = tfi.flash_attention_triton(*xt, knobs, st_t, key_keep=keep)
    m = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    o_e = emulator.flash_attention(*xe, knobs, st_e, Masking(keep=m))
    live = m.any(-1, keepdim=True).expand_as(o_t)
    assert (~live).any() and torch.equal(o_t[~live], torch.zeros_like(o_t[~live]))
    torch.testing.assert_close(o_t[live], o_e[live], atol=2e-6, rtol=2e-6)
    g = torch.randn_like(o_t).masked_fill(~live, 0.0)  # no gradient into rows without a key
    for a, b in zip(torch.autograd.grad(o_t, xt, g), torch.autograd.grad(o_e, xe, g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert st_e.repeated_max_rows.sum() > 0
    for name in ("repeated_max_rows", "rows_seen", "underflow_rows", "sfa_p1_rows"):
        assert torch.equal(getattr(st_t, name), getattr(st_e, name)), name
    torch.testing.assert_close(st_t.max_logit, st_e.max_logit)


@interp
@pytest.mark.parametrize("tiling", [True, False])
def test_interpreter_an_all_true_key_keep_is_the_plain_call_bit_for_bit(tfi, tiling):
    B, H, T, D = 3, 2, 40, 16
    q, k, v = (x.detach() for x in planted(B, H, T, D, "cpu", seed=6))
    knobs = AttentionKnobs(recipe="fp32", block_q=16, block_k=16, tiling=tiling, counters=True)
    out = []
    for kk in (None, torch.ones(B, T, dtype=torch.bool), torch.ones(1, T, dtype=torch.uint8)):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        st = AttnStats(H)
        o = tfi.flash_attention_triton(*x, knobs, st, key_keep=kk)
        out.append((o, *torch.autograd.grad(o, x, torch.ones_like(o)), st.repeated_max_rows, st.rows_seen,
                    st.max_logit))
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0], other))


@interp
def test_interpreter_key_padding_refuses_what_it_cannot_read(tfi):
    q, k, v = (x.detach() for x in planted(2, 1, 16, 16, "cpu", seed=7))
    knobs = AttentionKnobs(recipe="fp32", block_q=16, block_k=16)
    for bad, what in ((torch.ones(2, 15, dtype=torch.bool), "key_keep.shape"),
                      (torch.ones(3, 16, dtype=torch.bool), "key_keep.shape"),
                      (torch.ones(2, 16), "key_keep=torch.float32")):
        with pytest.raises(ValueError, match=what):
            tfi.flash_attention_triton(q, k, v, knobs, key_keep=bad)


@interp
def test_interpreter_stabilized_leaves_no_unit_pbar(tfi):
    q, k, v = planted(1, 2, 48, 16, "cpu", seed=3)
    safe = AttentionKnobs(recipe="fp32", block_q=16, block_k=16)
    pmax_safe, fired = tfi.fired_pbar_max(q, k, v, safe)
    assert fired.any() and (pmax_safe[fired] == 1).any(), "safe softmax: P̄ = 1 at a repeated row max"
    pmax, fired2 = tfi.fired_pbar_max(q, k, v, replace(safe, softmax="stabilized"))
    assert torch.equal(fired, fired2)
    assert (pmax[fired] < 1).all()


# the launch order of the query-tile kernels (kernels/triton_kernels.py _query_tile): speed only, every bit the same
ORDER_CASES = [
    (dict(recipe="fp32", counters=True), None),
    (dict(recipe="fp32", counters=True, tiling=False), None),
    (dict(recipe="fp32", counters=True, softmax="stabilized", delta="dP_P"), None),
    (dict(recipe="fp32", counters=True, delta="recompute_fp32", block_q=32), "keep"),
    (dict(recipe="paper_bf16", counters=True, pbar_clamp=0.99, stochastic_round=True), None),
]


# the interpreter's cases (its minutes count in CI): the order moves whole programs, whose arithmetic no knob ties to
# the order, so the most knobs at once (the clamp and stochastic rounding, whose streams name the tile) and key padding
INTERP_ORDER_CASES = [ORDER_CASES[4], ORDER_CASES[3]]


@interp
@pytest.mark.parametrize("case,keep", INTERP_ORDER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
                         if isinstance(c, dict) else str(c))
def test_interpreter_the_launch_order_keeps_every_bit(tfi, case, keep, monkeypatch):
    from flash_forensics.kernels import triton_launch
    # by_kernel at this head dim: the dK/dV and dQ kernels linear, the rest longest first
    monkeypatch.setattr(triton_launch, "LINEAR_LAUNCHES", frozenset(
        {(kern, r, 16) for kern in ("dkdv", "dq") for r in ("fa2", "paper_bf16", "fp32")}))
    B, H, T, D = 2, 2, 56, 16  # 4 query tiles of 16, the last one short
    q, k, v = (x.detach() for x in planted(B, H, T, D, "cpu", seed=11))
    knobs = AttentionKnobs(**{"block_q": 16, "block_k": 16, **case})
    key_keep = None
    if keep:  # a padded batch element: its first 9 keys masked
        key_keep = torch.ones(B, T, dtype=torch.bool)
        key_keep[1, :9] = False
    head_bytes = 2 * T * D * k.element_size()  # a head's K and V, as the launcher counts them
    out = {}
    # longest first in one section of all 4 heads, in two sections of 2 (3 heads' bytes: 2 divides 4), linear, and
    # by kernel
    for order, section_bytes in (("longest_first", None), ("longest_first", 3 * head_bytes), ("linear", None),
                                 ("by_kernel", None)):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        st = AttnStats(H)
        with triton_launch.launch_order(order, section_bytes):
            o = tfi.flash_attention_triton(*x, knobs, st, key_keep=key_keep)
            grads = torch.autograd.grad(o, x, torch.randn(o.shape, generator=torch.Generator().manual_seed(1)))
        out[order, section_bytes] = (o, *grads, st.repeated_max_rows, st.max_logit, st.underflow_rows,
                                     st.sfa_p1_rows)
    ref = out["linear", None]
    assert ref[-4].sum() > 0, "the planted repeats must be counted"
    for key, got in out.items():
        for a, b in zip(got, ref):
            assert torch.equal(a, b), key


# the counters' forms (kernels/triton_launch.py counter_form): speed only, every output and count the same
FORM_CASES = [
    dict(recipe="fp32", counters=True),
    dict(recipe="fp32", counters=True, softmax="stabilized", eps=0.5),  # near ties count too
    dict(recipe="fp32", counters=True, softmax="stabilized_guarded"),
    dict(recipe="fp32", counters=True, exp_form="exp2_folded", eps=0.25),
    dict(recipe="fp32", counters=True, pbar_clamp=0.99, block_q=32),
    dict(recipe="paper_bf16", counters=True, softmax="stabilized"),
]
FORMS = [("top2", "relaxed"), ("count", "relaxed"), ("top2", "acq_rel"), ("count", "acq_rel")]
# the interpreter runs atomics one program at a time, so their memory order cannot differ there: each test, once
INTERP_FORMS = [("top2", "relaxed"), ("count", "acq_rel")]


def _bits(t):
    """A tensor's bits (NaN payloads included), to compare outputs where NaN and inf occur."""
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int64: torch.int64}[t.dtype])


def _special(q, k):
    """Scores no test above has: a key whose scores are all NaN, a query whose scores reach +-inf (and NaN where
    they meet), a query whose scores are all exactly equal (every entry of its tiles a repeated maximum), and a key
    tile with one -inf score, the rest NaN."""
    q, k = q.detach().clone(), k.detach().clone()
    k[0, 1, 37] = float("nan")
    q[0, 0, 40] = 0.0
    q[0, 0, 41, 0] = 3.0e38
    q[-1, -1, 45] = 0.0  # all-zero scores: ties everywhere
    # batch 1, head 0: keys [0, n - 1) NaN and key n - 1 scoring -inf against the last query, so each key tile of
    # [0, n) that holds key n - 1 (tiles of 16 to 128 keys) gives that row one score reaching max - eps = -inf and
    # the rest NaN: no repeated max (top2's second largest must not exist there, rather than be -inf)
    n = 32 if q.shape[2] < 256 else 128
    k[1, 0, : n - 1] = float("nan")
    k[1, 0, n - 1] = 0.0
    k[1, 0, n - 1, 0] = -10.0
    q[1, 0, -1] = 0.0
    q[1, 0, -1, 0] = 3.0e38
    return q, k


def _forms_outputs(tfi, q, k, v, knobs, forms, key_keep=None):
    from flash_forensics.kernels import triton_launch
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, q.dtype)
    out = {}
    for test, atomics in forms:
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        st = AttnStats(q.shape[1], q.device)
        with triton_launch.counter_form(test, atomics):
            assert triton_launch.launch_config(knobs, q.shape[-1], q.shape[2])["fwd"]["counters"] == dict(
                test=test, atomics=atomics)
            o = tfi.flash_attention_triton(*x, knobs, st, key_keep=key_keep)
            grads = torch.autograd.grad(o, x, g)
        out[test, atomics] = (o, *grads, st.repeated_max_rows, st.max_logit, st.underflow_rows, st.sfa_p1_rows)
    return out


def _assert_forms_agree(out, specials=True):
    ref = out["count", "acq_rel"]  # the counters as they were computed before counter_form
    assert ref[-4].sum() > 0, "the planted repeats must be counted"
    for key, got in out.items():
        for i, (a, b) in enumerate(zip(got, ref)):
            assert torch.equal(_bits(a), _bits(b)), (key, ["O", "dQ", "dK", "dV", "repeated_max_rows", "max_logit",
                                                           "underflow_rows", "sfa_p1_rows"][i])
    if specials:  # the NaN key reached the outputs: the comparison above covered NaN scores
        assert torch.isnan(ref[0]).any()


def _interp_case(case, keep, seed):
    """(q, k, v, knobs, key_keep) of an interpreter comparison: B2 H2 T56 D16 with repeated keys and _special's
    scores, 16x16 tiles under `case`'s knobs; keep: batch element 1's first 9 keys masked (rows with no key)."""
    B, H, T, D = 2, 2, 56, 16
    q, k, v = (x.detach() for x in planted(B, H, T, D, "cpu", seed=seed))
    q, k = _special(q, k)
    key_keep = None
    if keep:
        key_keep = torch.ones(B, T, dtype=torch.bool)
        key_keep[1, :9] = False
    return q, k, v, AttentionKnobs(**{"block_q": 16, "block_k": 16, **case}), key_keep


# every case without key padding; with it, the plain counters and the clamp's (the interpreter's minutes count in CI:
# the padded cases took 2-3 times an unpadded one's)
INTERP_FORM_CASES = [(c, False) for c in FORM_CASES] + [(FORM_CASES[i], True) for i in (0, 4)]


@interp
@pytest.mark.parametrize("case,keep", INTERP_FORM_CASES,
                         ids=[("keep-" if kp else "nokeep-") + ",".join(f"{k}={v}" for k, v in c.items())
                              for c, kp in INTERP_FORM_CASES])
def test_interpreter_the_counter_forms_keep_every_bit(tfi, case, keep):
    """The repeated-max test by a tile's two largest scores (top2) and by counting, and the counters' atomics
    relaxed or acq_rel: O, the gradients and every counter bit for bit, with NaN, +-inf and all-equal scores in the
    tiles, near ties (eps > 0), exp2_folded's scaled test, the stabilizers that act on the test, and key padding
    (whose tiles keep counting)."""
    q, k, v, knobs, key_keep = _interp_case(case, keep, seed=13)
    _assert_forms_agree(_forms_outputs(tfi, q, k, v, knobs, INTERP_FORMS, key_keep))


SCORE_MAX_CASES = [  # where RAW acts (fa2 / fp32: unscaled max, top2 test) and where it must not (count, rounded)
    dict(recipe="fa2", counters=False), dict(recipe="fa2", counters=True), dict(recipe="fa2", softmax="stabilized"),
    dict(recipe="fa2", softmax="stabilized_guarded", pbar_clamp=True, counters=True),
    dict(recipe="fa2", counters=True, eps=0.25), dict(recipe="fp32", counters=True, eps=0.5),
    dict(recipe="paper_bf16", counters=True),
]


def _outputs_per_form(tfi, q, k, v, knobs, scope, forms, config_key, seed, key_keep=None):
    """{form: (O, dQ, dK, dV, the four counters)} of one fwd+bwd per form, each in scope(form), whose launch_config
    says the form at fwd[config_key]."""
    from flash_forensics.kernels import triton_launch
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.device, q.dtype)
    out = {}
    for form in forms:
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        st = AttnStats(q.shape[1], q.device)
        with scope(form):
            assert triton_launch.launch_config(knobs, q.shape[-1], q.shape[2])["fwd"][config_key] == form
            o = tfi.flash_attention_triton(*x, knobs, st, key_keep=key_keep)
            out[form] = (o, *torch.autograd.grad(o, x, g), st.repeated_max_rows, st.max_logit, st.underflow_rows,
                         st.sfa_p1_rows)
    return out


def _score_max_outputs(tfi, q, k, v, knobs):
    """{form: outputs} of one fwd+bwd per score_max_form."""
    from flash_forensics.kernels import triton_launch
    return _outputs_per_form(tfi, q, k, v, knobs, triton_launch.score_max_form, triton_launch.SCORE_MAX_FORMS,
                             "score_max", seed=1)


def _assert_score_max_forms_agree(out, counters):
    if counters:
        assert out["scaled"][4].sum() > 0, "the planted repeats must be counted"
    for i, (a, b) in enumerate(zip(out["raw"], out["scaled"])):
        assert torch.equal(_bits(a), _bits(b)), ["O", "dQ", "dK", "dV", "repeated_max_rows", "max_logit",
                                                 "underflow_rows", "sfa_p1_rows"][i]
    assert torch.isnan(out["scaled"][0]).any()  # the NaN key reached O: NaN scores were compared too


# the interpreter's cases (its minutes count in CI; the GPU test runs every one): the top2 test on the raw max, with
# near ties and the guarded shift with the clamp, and the recipe where raw must not act
INTERP_SCORE_MAX_CASES = [SCORE_MAX_CASES[i] for i in (1, 3, 5, 6)]


@interp
@pytest.mark.parametrize("case", INTERP_SCORE_MAX_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_interpreter_the_score_max_forms_keep_every_bit(tfi, case):
    """An unmasked tile's row max on the unscaled scores, scaled once (raw), against the max of the scaled scores
    (scaled, the default): O, the gradients and every counter bit for bit, with NaN, +-inf and all-equal
    scores planted, at a head dim whose scale is not a power of two (D 32: 1/sqrt(32))."""
    B, H, T, D = 2, 2, 56, 32
    q, k, v = (x.detach() for x in planted(B, H, T, D, "cpu", seed=17))
    q, k = _special(q, k)
    knobs = AttentionKnobs(**{"block_q": 16, "block_k": 16, **case})
    _assert_score_max_forms_agree(_score_max_outputs(tfi, q, k, v, knobs), knobs.counters)


def test_a_score_max_form_outside_the_list_is_refused():
    from flash_forensics.kernels import triton_launch
    with pytest.raises(ValueError, match="score max form 'max' is not allowed: expected one of scaled, raw"):
        with triton_launch.score_max_form("max"):
            pass
    assert triton_launch._raw_max == [False]  # left as it was
    assert triton_launch.launch_config(AttentionKnobs(recipe="fa2"), 64, 1024)["fwd"]["score_max"] == "scaled"


def test_a_counter_form_outside_the_lists_is_refused():
    from flash_forensics.kernels import triton_launch
    with pytest.raises(ValueError, match="counter test 'sum' is not allowed: expected one of by_recipe, top2, count"):
        with triton_launch.counter_form("sum"):
            pass
    with pytest.raises(ValueError, match="counter atomics 'seq_cst' are not allowed: expected one of relaxed, "
                                         "acq_rel"):
        with triton_launch.counter_form("top2", "seq_cst"):
            pass
    assert triton_launch._counter_form == {"test": "by_recipe", "relaxed": True}  # left as it was
    # by recipe (the default): paper_bf16 counts (top2 was slower there on an H100), every other recipe tests top2
    for recipe, test in (("paper_bf16", "count"), ("fa2", "top2"), ("fp32", "top2")):
        assert triton_launch.launch_config(AttentionKnobs(recipe=recipe), 64, 1024)["fwd"]["counters"] == dict(
            test=test, atomics="relaxed")
    with triton_launch.counter_form("top2", "acq_rel"):
        assert triton_launch.repeat_test("paper_bf16") == "top2"
        assert triton_launch.launch_config(AttentionKnobs(recipe="fa2"), 64, 1024)["fwd"]["counters"] == dict(
            test="top2", atomics="acq_rel")
    off = AttentionKnobs(recipe="fa2", counters=False)
    assert triton_launch.launch_config(off, 64, 1024)["fwd"]["counters"] is None


def test_the_accumulator_form_reaches_every_accumulating_launch_and_a_bad_one_is_refused():
    """accumulator_form: bf16 (the default) or fp32, recorded by launch_config and passed to the forward, dK/dV and
    dQ kernels as ACC16 (the kernels pick BF16 only where the recipe stores the accumulator so); anything else is
    refused, leaving the form as it was."""
    from flash_forensics.kernels import triton_launch
    with pytest.raises(ValueError, match="accumulator form 'fp16' is not allowed: expected one of bf16, fp32"):
        with triton_launch.accumulator_form("fp16"):
            pass
    assert triton_launch._acc16 == [True]
    ks = _kernel_sass()
    for text, acc16 in (("paper_bf16:counters=true", True), ("paper_bf16:counters=true:acc=fp32", False)):
        launched = {c[0]: c[3].get("ACC16") for c in ks.record_variant(text, (2, 2, 256, 64))}
        assert launched == {"_fwd_kernel": acc16, "_bwd_dkdv_kernel": acc16, "_bwd_dq_kernel": acc16}, text
    launched = {c[0]: c[3].get("ACC16") for c in ks.record_variant("paper_bf16:delta_form=kernel", (2, 2, 256, 64))}
    assert launched["_bwd_delta_kernel"] is None and launched["_bwd_dq_kernel"] is True  # (no accumulator there)
    knobs = AttentionKnobs(recipe="paper_bf16")
    cfg = triton_launch.launch_config(knobs, 64, 1024)
    assert (cfg["fwd"]["accumulators"], cfg["bwd"]["accumulators"]) == ("bf16", "bf16")
    with triton_launch.accumulator_form("fp32"):
        assert triton_launch.launch_config(knobs, 64, 1024)["bwd"]["accumulators"] == "fp32"


def _kernel_sass():
    import importlib.util
    spec = importlib.util.spec_from_file_location("kernel_sass", Path(__file__).resolve().parents[2] / "scripts" /
                                                  "kernel_sass.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


P1_CASES = [  # the stabilized softmaxes with counters: FP32 scores (the shift acts, P̄ rounds back to 1 at beta
    # 1.0001), BF16 scores, the guarded shift with the clamp, FP32-O heads (their P̄ unrounded), untiled
    dict(recipe="fa2", softmax="stabilized", beta=1.0001, counters=True),
    dict(recipe="fa2", softmax="stabilized", counters=True),
    dict(recipe="paper_bf16", softmax="stabilized", beta=1.0001, counters=True),
    dict(recipe="fa2", softmax="stabilized_guarded", pbar_clamp=True, beta=1.0001, counters=True),
    dict(recipe="paper_bf16", softmax="stabilized", beta=1.0001, counters=True, o_fp32_heads=[1]),
    dict(recipe="fa2", softmax="stabilized", beta=1.0001, counters=True, tiling=False),
]


def _p1_outputs(tfi, q, k, v, knobs, key_keep=None):
    """{form: outputs} of one fwd+bwd per p1_form."""
    from flash_forensics.kernels import triton_launch
    return _outputs_per_form(tfi, q, k, v, knobs, triton_launch.p1_form, triton_launch.P1_FORMS, "p1", seed=3,
                             key_keep=key_keep)


def _assert_p1_forms_agree(out, knobs):
    for i, (a, b) in enumerate(zip(out["max"], out["scores"])):
        assert torch.equal(_bits(a), _bits(b)), ["O", "dQ", "dK", "dV", "repeated_max_rows", "max_logit",
                                                 "underflow_rows", "sfa_p1_rows"][i]
    if knobs.beta == 1.0001 and knobs.recipe == "fa2" and knobs.softmax == "stabilized":  # the case that tells a
        # dropped rounding apart (the guarded shift with the clamp leaves no P̄ of 1)
        assert out["scores"][7].sum() > 0, "P̄ must round back to 1 where the shift fired"


# without key padding every case but the two the others cover (stabilized at beta's default: the first case's path
# with fewer P̄ of 1; paper_bf16 without FP32-O heads: the fifth's rounded heads), the first with padding too (the
# interpreter's minutes count in CI; the GPU test runs every case)
INTERP_P1_CASES = [(P1_CASES[i], False) for i in (0, 3, 4, 5)] + [(P1_CASES[0], True)]


@interp
@pytest.mark.parametrize("case,keep", INTERP_P1_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) + ("-keep" if kp else "")
                              for c, kp in INTERP_P1_CASES])
def test_interpreter_the_p1_forms_keep_every_bit(tfi, case, keep):
    """sfa_p1_rows' test on the row's largest P̄ rounded once (max, the default) against every P̄ rounded again
    (scores, as before): O, the gradients and every counter bit for bit, with the planted NaN, +-inf and ties and key
    padding."""
    q, k, v, knobs, key_keep = _interp_case(case, keep, seed=23)
    _assert_p1_forms_agree(_p1_outputs(tfi, q, k, v, knobs, key_keep), knobs)


def test_a_p1_form_outside_the_list_is_refused_and_the_config_says_the_form():
    from flash_forensics.kernels import triton_launch
    with pytest.raises(ValueError, match="p1 form 'rows' is not allowed: expected one of max, scores"):
        with triton_launch.p1_form("rows"):
            pass
    assert triton_launch._p1_max == [True]  # left as it was
    cfg = triton_launch.launch_config
    assert cfg(AttentionKnobs(recipe="fa2", softmax="stabilized", counters=True), 64, 1024)["fwd"]["p1"] == "max"
    assert cfg(AttentionKnobs(recipe="fa2", softmax="stabilized", counters=False), 64, 1024)["fwd"]["p1"] is None
    assert cfg(AttentionKnobs(recipe="fa2", counters=True), 64, 1024)["fwd"]["p1"] is None  # no P̄ test to make


SCORE_GEMM_CASES = [  # the forward's score paths: FP32 scores and the counters' top2 test, BF16-stored scores with
    # counting, the guarded shift with the clamp's tie bits, FP32 GEMMs with exp2_folded, stochastic rounding's
    # per-tile streams, and the counters off
    dict(recipe="fa2", counters=True),
    dict(recipe="paper_bf16", counters=True),
    dict(recipe="fa2", softmax="stabilized_guarded", pbar_clamp=True, beta=1.0001, counters=True),
    dict(recipe="fp32", exp_form="exp2_folded", counters=True),
    dict(recipe="paper_bf16", stochastic_round=True, sr_seed=5, counters=True),
    dict(recipe="fa2", counters=False),
]


def _score_gemm_outputs(tfi, q, k, v, knobs, key_keep=None):
    """{form: outputs} of one fwd+bwd per score_gemm_form."""
    from flash_forensics.kernels import triton_launch
    return _outputs_per_form(tfi, q, k, v, knobs, triton_launch.score_gemm_form, triton_launch.SCORE_GEMM_FORMS,
                             "score_gemm", seed=5, key_keep=key_keep)


def _assert_score_gemm_forms_agree(out, knobs):
    for i, (a, b) in enumerate(zip(out["ahead"], out["inline"])):
        assert torch.equal(_bits(a), _bits(b)), ["O", "dQ", "dK", "dV", "repeated_max_rows", "max_logit",
                                                 "underflow_rows", "sfa_p1_rows"][i]
    if knobs.counters and knobs.softmax == "safe":
        assert out["inline"][4].sum() > 0, "the planted repeats must be counted"
    assert torch.isnan(out["inline"][0]).any()  # the NaN key reached O


# T56 in 16x16 tiles: query tiles with no, one and two unmasked key tiles before the diagonal, and a last tile whose
# rows past T the ahead form reads from the last key (masked after). Every case without key padding, the BF16 scores'
# with it (its skipped tiles move the first QK^T); the counters-off case is the GPU's (the interpreter's minutes count)
INTERP_SCORE_GEMM_CASES = [(c, False) for c in SCORE_GEMM_CASES[:5]] + [(SCORE_GEMM_CASES[1], True)]


@interp
@pytest.mark.parametrize("case,keep", INTERP_SCORE_GEMM_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) + ("-keep" if kp else "")
                              for c, kp in INTERP_SCORE_GEMM_CASES])
def test_interpreter_the_score_gemm_forms_keep_every_bit(tfi, case, keep):
    """Each key tile's QK^T issued a tile ahead (ahead) against at the top of its own iteration (inline, the
    default): O, the gradients and every counter bit for bit, with the planted NaN, +-inf and ties, and key padding
    that skips a whole key tile."""
    q, k, v, knobs, key_keep = _interp_case(case, keep, seed=29)
    if keep:  # batch element 1's first 20 keys: its first key tile skipped, so the first QK^T is the second tile's
        key_keep[1, :20] = False
    _assert_score_gemm_forms_agree(_score_gemm_outputs(tfi, q, k, v, knobs, key_keep), knobs)


def test_a_score_gemm_form_outside_the_list_is_refused_and_the_config_says_where_it_applies():
    from flash_forensics.kernels import triton_launch
    with pytest.raises(ValueError, match="score gemm form 'early' is not allowed: expected one of inline, ahead"):
        with triton_launch.score_gemm_form("early"):
            pass
    assert triton_launch._qk_ahead == [False]  # left as it was
    cfg = triton_launch.launch_config
    fa2 = AttentionKnobs(recipe="fa2", counters=True)
    assert cfg(fa2, 64, 1024)["fwd"]["score_gemm"] == "inline"  # the default
    with triton_launch.score_gemm_form("ahead"):
        assert cfg(fa2, 64, 1024)["fwd"]["score_gemm"] == "ahead"
        # square tiles only, and the online path: the preset's 128x128 launches 64x128; untiled, one block
        preset = AttentionKnobs(recipe="paper_bf16", block_q=128, block_k=128, counters=True)
        assert cfg(preset, 64, 1024)["fwd"]["BLOCK_M"] != cfg(preset, 64, 1024)["fwd"]["BLOCK_N"]
        assert cfg(preset, 64, 1024)["fwd"]["score_gemm"] == "inline"
        assert cfg(AttentionKnobs(recipe="fa2", tiling=False), 64, 1024)["fwd"]["score_gemm"] == "inline"
    assert triton_launch._qk_ahead == [False]


DELTA_CASES = [  # delta=dO_O everywhere: the recipes, untiled, FP32-O heads (delta_prod kept FP32 there), padding
    dict(recipe="fp32", counters=True), dict(recipe="fp32", tiling=False), dict(recipe="fa2", counters=True),
    dict(recipe="paper_bf16", counters=True), dict(recipe="paper_bf16", counters=True, o_fp32_heads=[1]),
    dict(recipe="paper_bf16", softmax="stabilized_guarded", pbar_clamp=0.99, counters=True),
]


def _delta_outputs(tfi, q, k, v, knobs, key_keep=None):
    """{form: (O, dQ, dK, dV)} of one fwd+bwd per delta_form, with the kernels each launched (by name, in order)."""
    from flash_forensics.kernels import triton_launch
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.device, q.dtype)
    out, launched = {}, {}
    real = triton_launch._k

    class _Spy:  # the launcher's kernels, each launch's name recorded
        def __getattr__(self, name):
            launched[form].append(name)
            return getattr(real, name)
    for form in triton_launch.DELTA_FORMS:
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        launched[form] = []
        with triton_launch.delta_form(form):
            assert triton_launch.launch_config(knobs, q.shape[-1], q.shape[2])["bwd"]["delta"] == form
            o = tfi.flash_attention_triton(*x, knobs, AttnStats(q.shape[1], q.device), key_keep=key_keep)
            triton_launch._k = _Spy()
            try:
                out[form] = (o, *torch.autograd.grad(o, x, g))
            finally:
                triton_launch._k = real
    return out, launched


def _assert_delta_forms_agree(out, launched):
    assert launched == {"fused": ["_bwd_dq_kernel", "_bwd_dkdv_kernel"],
                        "kernel": ["_bwd_delta_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"]}
    for i, (a, b) in enumerate(zip(out["fused"], out["kernel"])):
        assert torch.equal(_bits(a), _bits(b)), ["O", "dQ", "dK", "dV"][i]
    assert torch.isfinite(out["kernel"][1]).any()


# without key padding: fp32 tiled and untiled, fa2, paper_bf16 with the clamp's ties (its plain case's path and
# more); with it, paper_bf16's FP32-O heads (the interpreter's minutes count in CI; the GPU test runs every case)
INTERP_DELTA_CASES = [(DELTA_CASES[i], False) for i in (0, 1, 2, 5)] + [(DELTA_CASES[4], True)]


@interp
@pytest.mark.parametrize("case,keep", INTERP_DELTA_CASES,
                         ids=[("keep-" if kp else "nokeep-") + ",".join(f"{k}={v}" for k, v in c.items())
                              for c, kp in INTERP_DELTA_CASES])
def test_interpreter_the_delta_forms_keep_every_bit(tfi, case, keep):
    """delta computed in the dQ kernel (fused, the default: no delta launch, dQ before dK/dV) against its own kernel
    (as before): O and every gradient bit for bit, with the planted NaN, +-inf and ties, rows past the last full
    tile (T 56) and key padding (rows with no key)."""
    q, k, v, knobs, key_keep = _interp_case(case, keep, seed=19)
    _assert_delta_forms_agree(*_delta_outputs(tfi, q, k, v, knobs, key_keep))


def test_the_delta_form_is_fused_only_where_the_dq_kernel_sums_as_the_delta_kernel_and_a_bad_one_is_refused():
    """fused where delta=dO_O and the dQ kernel's query tile and warps are the delta kernel's (64 rows, 4 warps: the
    BF16 recipes at D64 and D128, the preset's 128x128 tiles); the delta kernel for delta=dP_P / recompute_fp32, for
    the fp32 recipe at D128 (8 warps) and under delta_form("kernel"); anything else refused, the form left as it
    was."""
    from flash_forensics.kernels import triton_launch
    with pytest.raises(ValueError, match="delta form 'dq' is not allowed: expected one of fused, kernel"):
        with triton_launch.delta_form("dq"):
            pass
    assert triton_launch._delta_fused == [True]
    for kw, D, want in ((dict(recipe="fa2"), 64, "fused"), (dict(recipe="fa2"), 128, "fused"),
                        (dict(recipe="paper_bf16"), 64, "fused"),
                        (dict(recipe="paper_bf16", block_q=128, block_k=128), 64, "fused"),
                        (dict(recipe="fp32"), 64, "fused"), (dict(recipe="fp32"), 128, "kernel"),
                        (dict(recipe="paper_bf16", delta="dP_P"), 64, "kernel"),
                        (dict(recipe="fa2", delta="recompute_fp32"), 64, "kernel")):
        knobs = AttentionKnobs(**kw)
        assert triton_launch.launch_config(knobs, D, 1024)["bwd"]["delta"] == want, (kw, D)
        (_, (m2, _), warps, _) = triton_launch._bwd_blocks(knobs, D, 1024)
        assert (m2 == triton_launch._delta_blocks(knobs)[0] and warps == 4) is (want == "fused" or "delta" in kw)
    with triton_launch.delta_form("kernel"):
        assert triton_launch.launch_config(AttentionKnobs(recipe="fa2"), 64, 1024)["bwd"]["delta"] == "kernel"


def test_a_launch_order_outside_the_list_is_refused():
    from flash_forensics.kernels import triton_launch
    with pytest.raises(ValueError, match="order='lpt' is not allowed: expected one of by_kernel, longest_first, "
                                         "linear"):
        with triton_launch.launch_order("lpt"):
            pass
    with pytest.raises(ValueError, match="section_bytes=0 is not allowed: expected a positive int"):
        with triton_launch.launch_order("longest_first", 0):
            pass
    assert triton_launch._order == {"lpt": True, "by_kernel": True, "section_bytes": 32 << 20}  # left as it was


def test_longest_first_sections_hold_the_heads_whose_k_and_v_fit():
    """The launcher's grid: (heads of a section, tiles, sections), a section as many heads as section_bytes of K and
    V hold, rounded down to a divisor of B*H (at least 1, at most all); linear: the (tiles, heads) grid of before."""
    from flash_forensics.kernels import triton_launch as tl_
    k = torch.zeros(16, 12, 1024, 64, dtype=torch.bfloat16)  # 256 KiB of K and V a head: 32 MiB hold 128 heads
    assert tl_._grid(16, 192, k) == ((96, 16, 2), True)  # 96: the largest divisor of 192 up to 128
    with tl_.launch_order("longest_first", 1):
        assert tl_._grid(16, 192, k) == ((1, 16, 192), True)
    with tl_.launch_order("longest_first", 1 << 40):
        assert tl_._grid(16, 192, k) == ((192, 16, 1), True)
    with tl_.launch_order("linear"):
        assert tl_._grid(16, 192, k) == ((16, 192), False)
    # by_kernel (the default): the D128 dK/dV kernel linear (LINEAR_LAUNCHES), every other launch longest first
    k128 = torch.zeros(8, 16, 2048, 128, dtype=torch.bfloat16)  # 1 MiB a head: 32 heads a section
    assert tl_._grid(32, 128, k128, "dkdv", "fa2") == ((32, 128), False)
    assert tl_._grid(32, 128, k128, "dq", "fa2") == ((32, 32, 4), True)
    assert tl_._grid(16, 192, k, "dkdv", "fa2")[1] is True and tl_._grid(32, 128, k128, "dkdv", "paper_bf16")[1]
    with tl_.launch_order("longest_first"):
        assert tl_._grid(32, 128, k128, "dkdv", "fa2") == ((32, 32, 4), True)
    assert [tl_.section_heads(*a) for a in ((192, 128), (7, 5), (12, 12), (12, 0), (12, 100))] == [96, 1, 12, 1, 12]


def test_register_caps_apply_to_the_launches_measured_and_a_scope_overrides_them():
    """REGISTER_TABLE caps a launch only where it was measured: its kernel, recipe, softmax, head dim and launch
    config, the knobs otherwise their defaults (beta and eps aside), the forward with its counters on and no probe,
    no key padding; register_limit overrides it for a scope (None: no cap)."""
    from flash_forensics.kernels import triton_launch as tl_
    cfg_f, cfg_b = (64, 64, 4, 3), ((64, 64), (64, 64), 4, 3)
    pb = AttentionKnobs(recipe="paper_bf16", backend="triton", counters=True)
    assert tl_.register_cap("fwd", pb, 64, cfg_f, True) == 128 and tl_.register_cap("dkdv", pb, 64, cfg_b, True) == 168
    assert tl_.register_cap("dq", pb, 64, cfg_b, True) is None
    assert tl_.register_cap("fwd", AttentionKnobs(recipe="paper_bf16", beta=3.0, counters=True), 64, cfg_f, True) == 128
    assert tl_.register_cap("dkdv", AttentionKnobs(recipe="paper_bf16"), 64, cfg_b, True) == 168  # no counters there
    for other in (dict(pv_fp32=True), dict(o_fp32_heads=[0]), dict(exp_form="exp2_folded"), dict(pbar_clamp=0.99)):
        assert tl_.register_cap("fwd", AttentionKnobs(recipe="paper_bf16", counters=True, **other), 64, cfg_f,
                                True) is None, other
    assert tl_.register_cap("fwd", pb, 64, cfg_f, False) is None  # a probe, key padding or no counters
    assert tl_.register_cap("fwd", pb, 128, cfg_f, True) is None and tl_.register_cap("fwd", pb, 64, (64, 64, 4, 2),
                                                                                       True) is None
    # experiment=paper_1gpu's forward: its 128x128 tiles are in the launch config; the same knobs at another config
    # (or none of the preset's) are not capped at 168
    p1 = AttentionKnobs(recipe="paper_bf16", backend="triton", counters=True, block_q=128, block_k=128)
    cfg_p1 = tl_._fwd_blocks(p1, 64, 1024)
    assert cfg_p1 == (64, 128, 4, 2) and tl_.register_cap("fwd", p1, 64, cfg_p1, True) == 168
    assert tl_.register_cap("fwd", p1, 64, (64, 128, 4, 3), True) is None
    assert tl_.register_cap("fwd", dataclasses.replace(p1, pv_fp32=True), 64, cfg_p1, True) is None
    assert tl_.register_cap("fwd", p1, 64, cfg_p1, False) is None
    fa2 = AttentionKnobs(recipe="fa2", counters=True)
    assert tl_.register_cap("fwd", fa2, 64, cfg_f, True) == 128
    assert tl_.register_cap("dkdv", fa2, 64, ((32, 64), (64, 32), 4, 3), True) is None
    assert tl_.register_cap("fwd", AttentionKnobs(recipe="fa2", softmax="stabilized", counters=True), 64, cfg_f,
                            True) == 128
    with tl_.register_limit(fwd=None, dq=96):
        assert tl_.register_cap("fwd", pb, 64, cfg_f, True) is None
        assert tl_.register_cap("dq", pb, 64, cfg_b, True) == 96
        assert tl_.register_cap("dkdv", pb, 64, cfg_b, True) == 168
    assert tl_.register_cap("fwd", pb, 64, cfg_f, True) == 128


def test_supports():
    from flash_forensics.kernels import triton_flash as tf
    q = torch.zeros(1, 2, 8, 64)
    assert not tf.supports(AttentionKnobs(), q), "CPU tensors go to the emulator"
    if torch.cuda.is_available():
        qc = q.cuda()
        assert tf.supports(AttentionKnobs(), qc)
        assert not tf.supports(AttentionKnobs(), torch.zeros(1, 2, 8, 80, device="cuda"))
        assert not tf.supports(AttentionKnobs(block_k=48), qc)
        assert not tf.supports(AttentionKnobs(impl="standard"), qc)


def test_the_forward_key_tile_is_block_k_where_a_knob_reads_it():
    """Algorithm 3 and the counters act per key tile of block_k: the forward's BLOCK_N is block_k whenever one is on,
    whatever the speed tables choose otherwise (the fp32 recipe with softmax=stabilized and counters off took the
    table's 32-key tile for block_k = 64)."""
    from flash_forensics.kernels import triton_flash as tf
    for recipe in ("fp32", "fa2", "paper_bf16"):
        for case in (dict(softmax="stabilized", counters=False), dict(counters=True)):
            kn = AttentionKnobs(recipe=recipe, block_q=64, block_k=64, **case)
            assert tf.launch_config(kn, 64, 1024)["fwd"]["BLOCK_N"] == 64, (recipe, case)
    from flash_forensics.kernels.triton_launch import FWD_TABLE
    free = AttentionKnobs(recipe="fa2", counters=False, block_k=32)  # no knob reads the tile: the table's choice
    assert tf.launch_config(free, 64, 1024)["fwd"]["BLOCK_N"] == FWD_TABLE["fa2"][64][1]


# ------------------------------------------------------------------------------------------------------ GPU
# Error budgets (max abs error, inputs ~N(0,1) scaled as in `planted`):
#   vs emulator: fp32 1e-4; fa2 / paper_bf16 forward 2 BF16 ulps of |O| (~2e-2 absolute at |O|<=2), gradients 5e-2
#   relative to the gradient's max (BF16 accumulation order differs from the emulator's GEMMs).
#   vs FP64: fp32 1e-4; fa2 2e-2; paper_bf16 forward 5e-2, gradients 1e-1 relative to max.
GPU_CASES = [
    ("fp32", {}), ("fp32", dict(softmax="stabilized")), ("fp32", dict(tiling=False)),
    ("fa2", {}), ("fa2", dict(softmax="stabilized")), ("fa2", dict(delta="dP_P")), ("fa2", dict(tiling=False)),
    ("fa2", dict(pv_fp32=True)), ("fa2", dict(o_fp32=True)),
    ("paper_bf16", {}), ("paper_bf16", dict(softmax="stabilized")), ("paper_bf16", dict(tiling=False)),
    ("paper_bf16", dict(delta="dP_P")), ("paper_bf16", dict(delta="recompute_fp32")),
    ("paper_bf16", dict(pv_fp32=True)), ("paper_bf16", dict(o_fp32=True)),
    ("fp32", dict(fp32_gemm="tf32x3")), ("fp32", dict(fp32_gemm="tf32x3", softmax="stabilized", block_q=128,
                                                       block_k=128)),
    ("fp32", dict(fp32_gemm="tf32x3", tiling=False, delta="dP_P")),
    ("paper_bf16", dict(pv_fp32=True, fp32_gemm="tf32x3")), ("fa2", dict(o_fp32_heads=[1], fp32_gemm="tf32x3")),
    ("paper_bf16", dict(delta="recompute_fp32", fp32_gemm="tf32x3")),
    ("paper_bf16", dict(o_fp32_heads=[1, 3])), ("paper_bf16", dict(block_q=128, block_k=32)),
]
BUDGET_EMU = {"fp32": (1e-4, 1e-4), "fa2": (2e-2, 5e-2), "paper_bf16": (3e-2, 5e-2)}
BUDGET_REF = {"fp32": (1e-4, 1e-4), "fa2": (2e-2, 5e-2), "paper_bf16": (5e-2, 1e-1)}


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


GPU_PARAMS = [(r, c, 64) for r, c in GPU_CASES] + [
    ("fp32", {}, 128), ("fa2", {}, 128), ("fa2", dict(softmax="stabilized"), 128), ("paper_bf16", {}, 128),
    ("paper_bf16", dict(softmax="stabilized", delta="dP_P"), 128), ("paper_bf16", dict(o_fp32_heads=[0]), 128),
    ("fp32", dict(fp32_gemm="tf32x3"), 128),
    # exp_form=exp2_folded in the forward (FlashAttention-2's softmax; the emulator's model of it)
    ("fa2", dict(exp_form="exp2_folded"), 64), ("fa2", dict(exp_form="exp2_folded"), 128),
    ("fp32", dict(exp_form="exp2_folded"), 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,case,D", GPU_PARAMS,
                         ids=[f"{r}-{','.join(f'{k}={v}' for k, v in c.items()) or 'default'}-D{d}"
                              for r, c, d in GPU_PARAMS])
def test_gpu_matches_emulator_and_fp64(recipe, case, D):
    from flash_forensics.kernels import triton_flash as tf
    flash_attention, AttnStats = _emulator()
    knobs = replace(AttentionKnobs(recipe=recipe, backend="triton"), **case)
    T = 256
    dt = torch.float32 if recipe == "fp32" else torch.bfloat16
    q, k, v = planted(2, 4, T, D, "cuda", dtype=dt, seed=D)
    assert tf.supports(knobs, q)
    st_t, st_e = AttnStats(4, "cuda"), AttnStats(4, "cuda")
    o_t = tf.flash_attention_triton(q, k, v, knobs, st_t)
    o_e = flash_attention(q, k, v, replace(knobs, backend="emulator"), st_e)
    r = reference(q, k, v)
    g = torch.randn_like(o_t.float()).to(o_t.dtype)
    gt = _grads(o_t, (q, k, v), g)
    ge = _grads(o_e, (q, k, v), g.to(o_e.dtype))
    gr = _grads(r, (q, k, v), g.double())
    fo_e, fg_e = BUDGET_EMU[recipe]
    fo_r, fg_r = BUDGET_REF[recipe]
    assert (o_t.double() - o_e.double()).abs().max().item() <= fo_e
    assert (o_t.double() - r).abs().max().item() <= fo_r
    for name, a, b, c in zip("qkv", gt, ge, gr):
        assert _rel(a, b) <= fg_e, f"d{name} vs emulator"
        assert _rel(a, c) <= fg_r, f"d{name} vs FP64"
    # counters: exact on FP32 scores; BF16 scores may flip a near-tie where GEMM summation order differs
    ct, ce = st_t.repeated_max_rows, st_e.repeated_max_rows
    assert ce.sum() > 0
    assert torch.equal(st_t.rows_seen, st_e.rows_seen)
    if recipe == "fp32" and knobs.fp32_gemm == "ieee":
        assert torch.equal(ct, ce)
    else:
        assert (ct - ce).abs().sum().item() <= max(2, int(0.01 * ce.sum().item()))
    torch.testing.assert_close(st_t.max_logit, st_e.max_logit, atol=3e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["paper_bf16", "fa2", "fp32"])
def test_gpu_key_padding_matches_the_emulators_mask(recipe):
    """The key-padded route on CUDA (BF16 numerics only here): within the same budgets as the plain calls, on every
    row with a key; rows without one give 0; the repeated-maxima counts within the plain calls' slack."""
    from flash_forensics.kernels import triton_flash as tf
    from flash_forensics.kernels.masking import Masking
    flash_attention, AttnStats = _emulator()
    knobs = AttentionKnobs(recipe=recipe, backend="triton")
    B, H, T, D = 3, 4, 256, 64
    dt = torch.float32 if recipe == "fp32" else torch.bfloat16
    q, k, v = planted(B, H, T, D, "cuda", dtype=dt, seed=11)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, :70] = False
    keep[1, 200:] = False
    keep[2, 30:150] = False
    keep = keep.cuda()
    st_t, st_e = AttnStats(H, "cuda"), AttnStats(H, "cuda")
    o_t = tf.flash_attention_triton(q, k, v, knobs, st_t, key_keep=keep)
    m = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()[None, None] & keep[:, None, None, :]
    o_e = flash_attention(q, k, v, replace(knobs, backend="emulator"), st_e, Masking(keep=m))
    live = m.any(-1, keepdim=True).expand_as(o_t)
    assert torch.equal(o_t[~live].float(), torch.zeros_like(o_t[~live].float()))
    fo_e, fg_e = BUDGET_EMU[recipe]
    assert (o_t.double() - o_e.double())[live].abs().max().item() <= fo_e
    g = torch.randn_like(o_t.float()).masked_fill(~live, 0.0).to(o_t.dtype)
    for name, a, b in zip("qkv", _grads(o_t, (q, k, v), g), _grads(o_e, (q, k, v), g.to(o_e.dtype))):
        assert _rel(a, b) <= fg_e, f"d{name} vs emulator"
    ct, ce = st_t.repeated_max_rows, st_e.repeated_max_rows
    assert ce.sum() > 0 and torch.equal(st_t.rows_seen, st_e.rows_seen)
    assert (ct - ce).abs().sum().item() <= max(2, int(0.01 * ce.sum().item()))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_exp2_folded_keeps_the_counters_and_moves_only_the_last_bits(D):
    """fa2 with exp_form=exp2_folded against exp_form=exp on the GPU: the counters (repeated maxima, max logit) bit
    for bit, since both read the scaled scores; O and the gradients within BF16 rounding of each other, and O not
    bit-identical (the knob reached the kernel)."""
    from flash_forensics.kernels import triton_flash as tf
    _, AttnStats = _emulator()
    knobs = AttentionKnobs(recipe="fa2", backend="triton", counters=True)
    folded = replace(knobs, exp_form="exp2_folded")
    q, k, v = planted(2, 4, 384, D, "cuda", dtype=torch.bfloat16, seed=D + 1)
    st_x, st_f = AttnStats(4, "cuda"), AttnStats(4, "cuda")
    o_x = tf.flash_attention_triton(q, k, v, knobs, st_x)
    o_f = tf.flash_attention_triton(q, k, v, folded, st_f)
    assert st_x.repeated_max_rows.sum() > 0
    for name in ("repeated_max_rows", "max_logit", "underflow_rows", "rows_seen"):
        assert torch.equal(getattr(st_f, name), getattr(st_x, name)), name
    assert not torch.equal(o_f, o_x)
    assert (o_f.float() - o_x.float()).abs().max().item() <= 2e-2
    g = torch.randn_like(o_x)
    for a, b in zip(_grads(o_f, (q, k, v), g), _grads(o_x, (q, k, v), g)):
        assert _rel(a, b) <= 2e-2


GPU_FORM_CASES = [
    (dict(recipe="fa2", counters=True), 64), (dict(recipe="fa2", counters=True), 128),
    (dict(recipe="fa2", counters=True, softmax="stabilized"), 64),
    (dict(recipe="fa2", counters=True, exp_form="exp2_folded", eps=0.25), 64),
    (dict(recipe="paper_bf16", counters=True), 64),
    (dict(recipe="paper_bf16", counters=True, block_q=128, block_k=128), 64),  # the paper_1gpu preset's tiles
    (dict(recipe="paper_bf16", counters=True, softmax="stabilized_guarded", pbar_clamp=0.99), 64),
    (dict(recipe="fp32", counters=True, eps=0.5), 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case,D", GPU_FORM_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) + f"-D{d}" for c, d in GPU_FORM_CASES])
def test_gpu_the_counter_forms_keep_every_bit(case, D):
    """On the GPU, in BF16 where the recipe is: the counters by the two largest scores (top2, relaxed atomics: the
    default) against counting with acq_rel atomics (before): O, gradients and every counter bit for bit, with NaN,
    +-inf and all-equal scores planted (the launch configs and register caps of the real launches)."""
    from flash_forensics.kernels import triton_flash as tf
    dt = torch.float32 if case["recipe"] == "fp32" else torch.bfloat16
    q, k, v = (x.detach() for x in planted(2, 4, 384, D, "cuda", dtype=dt, seed=D + 5))
    q, k = _special(q, k)
    _assert_forms_agree(_forms_outputs(tf, q, k, v, replace(AttentionKnobs(backend="triton"), **case), FORMS))


GPU_SCORE_MAX_CASES = [(c, 64) for c in SCORE_MAX_CASES] + [
    (dict(recipe="fa2", counters=True), 128), (dict(recipe="fa2", counters=False), 128),  # 1/sqrt(128): no power of 2
    (dict(recipe="fa2", counters=True, stochastic_round=True, sr_seed=5), 64), (dict(recipe="fa2", o_fp32=True), 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("case,D", GPU_SCORE_MAX_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) + f"-D{d}" for c, d in GPU_SCORE_MAX_CASES])
def test_gpu_the_score_max_forms_keep_every_bit(case, D):
    """On the GPU, in BF16 where the recipe is: the forward's row max on the unscaled scores (raw) against the max
    of the scaled scores (scaled, the default): O, gradients and every counter bit for bit, with NaN, +-inf and
    all-equal scores planted. This is where ptxas's contraction of S scale - m into one FFMA must hold in both forms
    (the interpreter never contracts), at D 128 too, whose scale is no power of two."""
    from flash_forensics.kernels import triton_flash as tf
    dt = torch.float32 if case["recipe"] == "fp32" else torch.bfloat16
    q, k, v = (x.detach() for x in planted(2, 4, 384, D, "cuda", dtype=dt, seed=D + 7))
    q, k = _special(q, k)
    knobs = replace(AttentionKnobs(backend="triton"), **case)
    _assert_score_max_forms_agree(_score_max_outputs(tf, q, k, v, knobs), knobs.counters)


GPU_ACC_CASES = [  # the recipes whose accumulators are stored in BF16 after every tile, and where only some are
    dict(recipe="paper_bf16", counters=True),
    dict(recipe="paper_bf16", counters=True, block_q=128, block_k=128),  # the paper_1gpu preset's tiles
    dict(recipe="paper_bf16", counters=True, softmax="stabilized", stochastic_round=True, sr_seed=3),
    dict(recipe="paper_bf16", counters=True, keep_fp32=["bwd_out"]),  # grad_acc BF16 over FP32 chunks
    dict(recipe="paper_bf16", counters=True, keep_fp32=["acc", "grad_acc"]),  # no BF16 accumulator: FP32 both ways
    dict(recipe="paper_bf16", counters=True, o_fp32_heads=[1]),  # FP32-O heads: O_acc stays FP32
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_ACC_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_gpu_the_accumulator_forms_keep_every_bit(case):
    """On the GPU, in BF16: the accumulators in BF16 where the recipe stores them so (the default) against FP32 (as
    before): O, gradients and every counter bit for bit (NaN payloads too), with the planted NaN, +-inf and ties."""
    from flash_forensics.kernels import triton_flash as tf
    from flash_forensics.kernels import triton_launch
    q, k, v = (x.detach() for x in planted(2, 4, 384, 64, "cuda", dtype=torch.bfloat16, seed=9))
    q, k = _special(q, k)
    knobs = replace(AttentionKnobs(backend="triton"), **case)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, q.dtype)
    out = {}
    for form in ("bf16", "fp32"):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        st = AttnStats(q.shape[1], q.device)
        with triton_launch.accumulator_form(form):
            o = tf.flash_attention_triton(*x, knobs, st)
            out[form] = (o, *torch.autograd.grad(o, x, g), st.repeated_max_rows, st.max_logit, st.underflow_rows,
                         st.sfa_p1_rows)
    assert out["fp32"][4].sum() > 0
    for i, (a, b) in enumerate(zip(out["bf16"], out["fp32"])):
        assert torch.equal(_bits(a), _bits(b)), ["O", "dQ", "dK", "dV", "repeated_max_rows", "max_logit",
                                                 "underflow_rows", "sfa_p1_rows"][i]


GPU_DELTA_CASES = [(c, 64) for c in DELTA_CASES] + [
    (dict(recipe="fa2"), 128), (dict(recipe="fa2", counters=True, exp_form="exp2_folded"), 64),
    (dict(recipe="paper_bf16", counters=True, block_q=128, block_k=128), 64),  # the paper_1gpu preset's tiles
    (dict(recipe="paper_bf16", counters=True, keep_fp32=["delta_prod"]), 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("case,D", GPU_DELTA_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) + f"-D{d}" for c, d in GPU_DELTA_CASES])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_gpu_the_delta_forms_keep_every_bit(case, D, layout):
    """On the GPU, in BF16 where the recipe is: delta in the dQ kernel (fused, the default) against the delta
    kernel (as before): O and every gradient bit for bit, the planted NaN, +-inf and ties included, at T 384 (a last
    tile of 64 rows), in the (B, H, T, D) layout and in a GPT's (B, T, H, D) one (other strides for dO and O)."""
    from flash_forensics.kernels import triton_flash as tf
    dt = torch.float32 if case["recipe"] == "fp32" else torch.bfloat16
    q, k, v = (x.detach() for x in planted(2, 4, 384, D, "cuda", dtype=dt, seed=D + 11))
    q, k = _special(q, k)
    if layout == "bthd":
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    knobs = replace(AttentionKnobs(backend="triton"), **case)
    _assert_delta_forms_agree(*_delta_outputs(tf, q, k, v, knobs))


GPU_P1_CASES = [(c, 64) for c in P1_CASES] + [
    (dict(recipe="fa2", softmax="stabilized", beta=1.0001, counters=True), 128),
    (dict(recipe="paper_bf16", softmax="stabilized", counters=True, block_q=128, block_k=128), 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("case,D", GPU_P1_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) + f"-D{d}" for c, d in GPU_P1_CASES])
def test_gpu_the_p1_forms_keep_every_bit(case, D):
    """On the GPU, in BF16: sfa_p1_rows' test on the rounded row max (max, the default) against every P̄ rounded
    (scores, as before): O, gradients and every counter bit for bit, with the planted NaN, +-inf and ties."""
    from flash_forensics.kernels import triton_flash as tf
    q, k, v = (x.detach() for x in planted(2, 4, 384, D, "cuda", dtype=torch.bfloat16, seed=D + 13))
    q, k = _special(q, k)
    knobs = replace(AttentionKnobs(backend="triton"), **case)
    _assert_p1_forms_agree(_p1_outputs(tf, q, k, v, knobs), knobs)


GPU_SCORE_GEMM_CASES = [(c, D) for c in SCORE_GEMM_CASES for D in (64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("case,D", GPU_SCORE_GEMM_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) + f"-D{d}" for c, d in GPU_SCORE_GEMM_CASES])
def test_gpu_the_score_gemm_forms_keep_every_bit(case, D):
    """On the GPU, in BF16 (FP32 for fp32), at T 400 (a last query tile past T): each key tile's QK^T issued a tile
    ahead against inline (the default): O, gradients and every counter bit for bit, with the planted NaN, +-inf and
    ties."""
    from flash_forensics.kernels import triton_flash as tf
    dt = torch.float32 if case["recipe"] == "fp32" else torch.bfloat16
    q, k, v = (x.detach() for x in planted(2, 4, 400, D, "cuda", dtype=dt, seed=D + 29))
    q, k = _special(q, k)
    knobs = replace(AttentionKnobs(backend="triton"), **case)
    _assert_score_gemm_forms_agree(_score_gemm_outputs(tf, q, k, v, knobs), knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_tf32x3_is_fp32_accurate_and_not_ieee(D):
    """fp32_gemm=tf32x3 on the tensor cores: within a few times IEEE FP32's own error against FP64 (O and grads),
    not bit-identical to IEEE (the knob reaches the GEMMs), and far closer than one TF32 pass would be."""
    from flash_forensics.kernels import triton_flash as tf
    q, k, v = planted(2, 4, 512, D, "cuda", dtype=torch.float32, seed=11)
    g = torch.randn(2, 4, 512, D, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    r = reference(q, k, v)
    gr = _grads(r, (q, k, v), g.double())
    out = {}
    for mode in ("ieee", "tf32x3"):
        o = tf.flash_attention_triton(q, k, v, AttentionKnobs(recipe="fp32", backend="triton", fp32_gemm=mode))
        out[mode] = (o, _grads(o, (q, k, v), g))
    err = {m: [_rel(o, r)] + [_rel(a, c) for a, c in zip(gs, gr)] for m, (o, gs) in out.items()}
    assert not torch.equal(out["ieee"][0], out["tf32x3"][0])
    for e_ieee, e_tc in zip(err["ieee"], err["tf32x3"]):
        assert e_tc <= max(4 * e_ieee, 2e-6), err
    assert max(err["tf32x3"]) < 1e-4, err  # one TF32 pass (10-bit fraction) would err ~1e-3 here


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fa2", "paper_bf16"])
def test_gpu_tf32x3_changes_nothing_without_fp32_gemms(recipe):
    """BF16 recipes have no FP32 GEMM (their operands are BF16): the knob leaves O and the gradients bit-identical."""
    from flash_forensics.kernels import triton_flash as tf
    q, k, v = planted(2, 4, 256, 64, "cuda", dtype=torch.bfloat16, seed=12)
    g = torch.randn(2, 4, 256, 64, device="cuda").to(torch.bfloat16)
    res = []
    for mode in ("ieee", "tf32x3"):
        o = tf.flash_attention_triton(q, k, v, AttentionKnobs(recipe=recipe, backend="triton", fp32_gemm=mode))
        res.append([o, *_grads(o, (q, k, v), g)])
    assert all(torch.equal(a, b) for a, b in zip(*res))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fa2", "paper_bf16"])
@pytest.mark.parametrize("tiling", [True, False])
def test_gpu_stabilized_leaves_no_unit_pbar(recipe, tiling):
    from flash_forensics.kernels import triton_flash as tf
    q, k, v = planted(2, 4, 512, 64, "cuda", dtype=torch.bfloat16, seed=5)
    safe = AttentionKnobs(recipe=recipe, tiling=tiling)
    pmax_safe, fired = tf.fired_pbar_max(q, k, v, safe)
    assert fired.any() and (pmax_safe[fired] == 1).any()
    pmax, fired2 = tf.fired_pbar_max(q, k, v, replace(safe, softmax="stabilized"))
    assert (pmax[fired2] < 1).all()


@pytest.mark.gpu
def test_gpu_long_sequence_and_no_sync():
    """T=4096 runs; the call issues no host sync (counters stay on the device)."""
    from flash_forensics.kernels import triton_flash as tf
    q, k, v = planted(1, 2, 4096, 64, "cuda", dtype=torch.bfloat16, seed=6)
    knobs = AttentionKnobs(recipe="fa2", softmax="stabilized")
    stats = _Stats(2, "cuda")
    tf.flash_attention_triton(q, k, v, knobs, stats)  # compile outside the sync guard
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o = tf.flash_attention_triton(q, k, v, knobs, stats)
        o.backward(torch.ones_like(o))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    r = reference(q[:, :, :1024], k[:, :, :1024], v[:, :, :1024])
    assert (o[:, :, :1024].double() - r).abs().max().item() <= 2e-2
    assert torch.isfinite(q.grad).all()
