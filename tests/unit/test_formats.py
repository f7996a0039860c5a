"""Formats at the rounding points (kernels/formats.py, kernels/recipes.py): cast semantics, hand-computed roundings
per point, the FP8 recipes, validation, Triton's refusal, the shorthands, the format counters and the generator."""
from __future__ import annotations

import math
import struct
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

from flash_forensics.kernels import formats as fmt
from flash_forensics.kernels import knobs as table
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import (
    _plan,
    flash_attention,
    forward,
    reference_attention,
)
from flash_forensics.kernels.recipes import (
    BF16,
    E4M3,
    E5M2,
    F16,
    F32,
    FP8_POINTS,
    RECIPES,
    ROUNDING_POINTS,
    for_knobs,
    resolve,
)
from flash_forensics.kernels.stats import FORMAT_COUNTERS, AttnStats

F64 = torch.float64
BLOCKS = dict(block_q=16, block_k=16)


# ------------------------------------------------------------------------------------------ an independent oracle
def rne(x: float, frac: int, emin: int, vmax: float) -> float:
    """x rounded to nearest even with `frac` stored fraction bits, smallest normal exponent `emin` (subnormals
    below), saturating at +-vmax: exact rational arithmetic, no torch."""
    if x == 0 or math.isnan(x):
        return x
    r = Fraction(abs(x))
    e = max(math.floor(math.log2(r)), emin)
    while Fraction(2) ** e > r:  # log2 of a float can be off by one
        e -= 1
    while Fraction(2) ** (e + 1) <= r and e >= emin:
        e += 1
    e = max(e, emin)
    ulp = Fraction(2) ** (e - frac)
    n, rem = divmod(r, ulp)
    if rem * 2 > ulp or (rem * 2 == ulp and n % 2 == 1):
        n += 1
    y = min(float(n * ulp), vmax)
    return math.copysign(y, x)


ORACLE = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0), F16: (10, -14, math.inf), BF16: (7, -126, math.inf)}


def oracle(t: torch.Tensor, dtype, scale=None) -> torch.Tensor:
    frac, emin, vmax = ORACLE[dtype]
    s = 1.0 if scale is None else scale
    flat = [rne(float(v) * (float(s) if not torch.is_tensor(s) else 1.0), frac, emin, vmax) for v in t.flatten()]
    out = torch.tensor(flat, dtype=t.dtype).view(t.shape)
    if dtype == F16:  # IEEE: beyond 65520 is inf (rne's exponent is unbounded)
        out = torch.where(t.abs() >= 65520, torch.copysign(torch.full_like(t, math.inf), t), out)
    return out if scale is None else out / s


# ------------------------------------------------------------------------------------------ cast semantics
def test_torch_casts_as_measured_and_ours_saturate():
    big = torch.tensor([464.0, 500.0, 1e6, math.inf, -math.inf, 61440.0, 70000.0])
    # torch 2.13: e4m3fn's plain cast saturates (inf too); e5m2's overflows to inf from 61440 (57344 + half an ulp)
    assert big.to(E4M3).float().abs().tolist() == [448.0] * 7
    assert torch.isinf(torch.tensor([61440.0, 1e6]).to(E5M2).float()).all()
    assert torch.tensor([61439.0]).to(E5M2).float().item() == 57344.0
    # ours: both FP8 formats saturate, inf included; NaN stays NaN
    for dt in fmt.FP8:
        beyond = torch.tensor([fmt.OVERFLOW_AT[dt], 1.5 * fmt.fmax(dt), 1e6, math.inf, -math.inf])
        y = fmt.cast(beyond, dt)
        assert torch.equal(y.abs(), torch.full_like(y, fmt.fmax(dt))) and y[-1] < 0
        assert math.isnan(fmt.cast(torch.tensor([math.nan]), dt).item())
    # FP16 overflows to inf (IEEE, as torch and CUDA do)
    assert fmt.cast(torch.tensor([65519.0, 65520.0]), F16).tolist() == [65504.0, math.inf]


def test_facts_below_one_windows_and_subnormals():
    assert fmt.next_below_one(E4M3) == 0.9375 and fmt.next_below_one(E5M2) == 0.875
    assert fmt.next_below_one(BF16) == 0.99609375
    p = torch.tensor([0.96875, 0.9687499, 1.0625, 1.0626])
    assert fmt.cast(p, E4M3).tolist() == [1.0, 0.9375, 1.0, 1.125]  # P in [0.96875, 1.0625] rounds to 1
    assert fmt.cast(torch.tensor([2.0 ** -9, 2.0 ** -10]), E4M3).tolist() == [2.0 ** -9, 0.0]
    assert fmt.cast(torch.tensor([2.0 ** -16, 2.0 ** -17]), E5M2).tolist() == [2.0 ** -16, 0.0]
    assert fmt.cast(torch.tensor([2.0 ** -24]), F16).item() == 2.0 ** -24  # FP16 keeps its subnormals
    sat = fmt.saturated(torch.tensor([463.9, 464.0, -500.0, math.inf]), E4M3)
    assert sat.tolist() == [False, True, True, True]  # (448, 464) rounds to 448 either way: not counted


@pytest.mark.parametrize("dtype", [E4M3, E5M2, F16, BF16], ids=fmt.name_of)
def test_casts_match_the_oracle(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(3000, generator=g) * 10.0 ** torch.randint(-8, 6, (3000,), generator=g),
                   torch.tensor([0.96875, 0.90625, 3 * 2.0 ** -11, 2.0 ** -10])])
    x = x[x.abs() < 60000] if dtype == E5M2 else x
    assert torch.equal(fmt.cast(x, dtype), oracle(x, dtype))
    s = torch.tensor(256.0)
    assert torch.equal(fmt.quantize(x, dtype, s), oracle(x * 256, dtype) / 256)


def test_round_to_bf16_is_unchanged():
    """keep_fp32 / round_bf16 go through round_to; its BF16 (and FP16) branch is torch's plain cast, as before."""
    from flash_forensics.kernels.recipes import round_to
    x = torch.randn(10000, dtype=F32) * 1e3
    assert torch.equal(round_to(x, BF16), x.to(BF16).to(F32))
    assert torch.equal(round_to(x, F16), x.to(F16).to(F32))
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[::2] = True
    assert torch.equal(round_to(x, BF16, keep), torch.where(keep, x, x.to(BF16).to(F32)))


def test_rotation_is_orthogonal_and_scores_unchanged():
    m = fmt.rotation(64, F64)
    assert torch.allclose(m @ m.T, torch.eye(64, dtype=F64), atol=1e-14)
    assert set(fmt.hadamard(8).abs().flatten().tolist()) == {1.0}
    with pytest.raises(ValueError, match="head_dim=12 is not allowed: expected a power of two"):
        fmt.hadamard(12)


# ------------------------------------------------------------------------------------------ hand-computed per point
GAPS = [0.0, 0.02, 0.04, 0.1, 8.0]  # P̄ = exp(-gap) in the last row of one tile


def _gap_inputs():
    """One head, T = 5, D = 4, scale 1/2: rows 0-3 have q = 0 (every score 0: P̄ = 1); row 4 has S_j = -gap_j."""
    q = torch.zeros(1, 1, 5, 4, dtype=F32)
    k = torch.zeros(1, 1, 5, 4, dtype=F32)
    q[0, 0, 4, 0] = 2.0
    k[0, 0, :, 0] = -torch.tensor(GAPS)
    v = torch.randn(1, 1, 5, 4, generator=torch.Generator().manual_seed(0))
    return q, k, v


@pytest.mark.parametrize("scale,want", [
    ("none", [1.0, 1.0, 0.9375, 0.875, 0.0]),  # exp(-8) = 3.4e-4 < 2^-10: flushed
    ("fa3", [1.0, 1.0, 0.9375, 0.875, 11 * 2.0 ** -7 / 256]),  # x 256 = 0.0859 -> 11 * 2^-7 (spacing 2^-7 there)
])
def test_pbar_in_e4m3_by_hand(scale, want):
    q, k, v = _gap_inputs()
    knobs = AttentionKnobs(recipe="fp32", formats={"pbar": "e4m3"}, pbar_scale=scale, tiling=False).validate()
    trace, st = {}, AttnStats(1)
    forward(q, k, v, knobs, st, trace=trace)
    (pre, post), = trace["pbar"]
    assert torch.allclose(pre[0, 0, 4], torch.exp(-torch.tensor(GAPS)))
    assert post[0, 0, 4].tolist() == want
    assert post[0, 0, :4][~torch.ones(4, 5, dtype=torch.bool).tril()[:, :]].eq(0).all()  # masked: 0
    assert st.pbar_flushed.tolist() == [1 if scale == "none" else 0]


def test_pbar_in_fp16_and_e5m2_by_hand():
    q, k, v = _gap_inputs()
    p = torch.exp(-torch.tensor(GAPS))
    for f, dt in (("fp16", F16), ("e5m2", E5M2)):
        trace = {}
        forward(q, k, v, AttentionKnobs(recipe="fp32", formats={"pbar": f}, tiling=False).validate(), trace=trace)
        assert torch.equal(trace["pbar"][0][1][0, 0, 4], oracle(p, dt))
    assert oracle(p, E5M2).tolist()[:4] == [1.0, 1.0, 1.0, 0.875]  # e5m2: [0.9375, 1] is 1


@pytest.mark.parametrize("recipe", ["fp16", "fp8_fa3", "fp8_te"])
def test_every_point_stores_its_format_exactly(recipe):
    """The trace: every stored value is the oracle's rounding of its pre-store value in the point's format (FP8:
    with the scale it was stored with, recovered as the one that reproduces it), FP32 points unchanged."""
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=g) * s for s in (2, 2, 1, 1))
    knobs = AttentionKnobs(recipe=recipe, **BLOCKS).validate()
    rc = for_knobs(knobs)
    trace = {}
    reference_attention(q, k, v, knobs, do, trace=trace)
    for pt, pairs in trace.items():
        dts = {getattr(rc, pt)} | ({rc.operand("ds_in")} if pt == "bwd_gemm_in" else set()) | (
            {rc.operand("dp_out")} if pt == "bwd_out" else set())
        for pre, post in pairs:
            if dts == {F32}:
                assert torch.equal(pre, post), pt
                continue
            ok = False
            for dt in dts:
                if dt in fmt.FP8:
                    for s in ({rc.pbar_scale} | ({1.0} if pt != "pbar" else set())):
                        ok |= torch.equal(post, fmt.quantize(pre, dt, s))
                    ok |= torch.equal(post, fmt.quantize(pre, dt, fmt.amax_scale(pre, dt, (2, 3))))
                    ok |= torch.equal(post, fmt.quantize(pre, dt, fmt.amax_scale(pre, dt, (0, 1, 2, 3))))
                elif dt == F32:
                    ok |= torch.equal(post, pre)
                else:
                    ok |= torch.equal(post, oracle(pre, dt))
            assert ok, (recipe, pt)


def test_fp16_overflow_and_fp8_saturation_are_counted():
    q = torch.zeros(1, 2, 8, 4)
    k = torch.zeros(1, 2, 8, 4)
    q[0, 1, :, 0], k[0, 1, :, 0] = 300.0, 300.0  # head 1: QK^T = 90000 > 65504
    st = AttnStats(2)
    forward(q, k, torch.ones(1, 2, 8, 4), AttentionKnobs(recipe="fp32", formats={"scores": "fp16"}).validate(), st)
    assert st.fp16_overflow[0] == 0 and st.fp16_overflow[1] > 0
    p = _plan(AttentionKnobs(recipe="fp8_te").validate(), torch.zeros(1, 2, 4, 4), stats=AttnStats(2))
    x = torch.tensor([100.0, 463.0, 464.0, 1e4]).view(1, 1, 2, 2).expand(1, 2, 2, 2).clone()
    x[0, 0] = 1.0
    y = p.r("pbar", x, scale=1.0)
    assert p.stats.fp8_saturated.tolist() == [0, 2] and y[0, 1].flatten().tolist() == [96.0, 448.0, 448.0, 448.0]


def test_counters_ride_along_snapshot_and_flash_attention_backward():
    st = AttnStats(2)
    assert set(FORMAT_COUNTERS) <= set(n for n in ("fp16_overflow", "fp8_saturated", "pbar_flushed"))
    q, k, v = _gap_inputs()
    q, k, v = (x.expand(1, 2, 5, 4).clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(q, k, v, AttentionKnobs(recipe="fp32", formats={"pbar": "e4m3", "bwd_gemm_in": "e4m3"},
                                                tiling=False).validate(), st)
    snap = st.snapshot()
    o.sum().backward()  # the backward's P in e4m3 (unscaled) flushes exp(-8)-ish entries too
    assert st.pbar_flushed.tolist() == [1, 1]
    st.reset()
    assert st.pbar_flushed.sum() == 0
    st.restore(snap)
    assert st.pbar_flushed.tolist() == [1, 1]


def test_monitors_log_and_warn_once():
    from flash_forensics.orchestrator.monitor.monitors import NUMERICS, MonitorConfig, Monitors

    class Fake:
        def __init__(self):
            self.stats = [AttnStats(4), AttnStats(4)]

        def attention_stats(self):
            return self.stats

    m = Fake()
    mon = Monitors(m, MonitorConfig(log_every=1, wq_every=1000))
    assert {"fp16_overflow", "fp8_saturated", "pbar_flushed"} <= set(NUMERICS)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(3):
            m.stats[1].fp8_saturated[2] += 5
            mon.step_end(step, torch.tensor(1.0), torch.tensor(1.0), 1e-3, 10)
    msgs = [str(x.message) for x in w if "fp8_saturated" in str(x.message)]
    assert msgs == ["attention fp8_saturated: layer 1 head 2 counted 5 (metric fp8_saturated/L1.H2; "
                    "kernels/formats.py); warned once per run"]
    assert mon.numerics["fp8_saturated"] == 15 and "15 fp8_saturated" in mon.numerics_warning()


# ------------------------------------------------------------------------------------------ recipes
def test_recipes_as_documented():
    assert RECIPES[-3:] == ("fp16", "fp8_fa3", "fp8_te")
    fa3, te, f16 = resolve("fp8_fa3"), resolve("fp8_te"), resolve("fp16")
    assert (fa3.inputs, fa3.pbar, fa3.pv_out, fa3.acc, fa3.o_store, fa3.out) == (E4M3, E4M3, F32, F32, BF16, BF16)
    assert fa3.operand("bwd_inputs") == BF16 and fa3.pbar_scale == 256 and fa3.input_scaling == "head"
    assert (te.pbar, te.o_store, te.operand("do_in"), te.operand("dp_out"), te.operand("ds_in")) == (
        E4M3, E4M3, E5M2, E5M2, E5M2)
    assert te.stats == F32 and te.bwd_gemm_in == E4M3 and te.operand("bwd_inputs") == E4M3
    fa2 = resolve("fa2")
    assert all((getattr(f16, pt) == F16) == (getattr(fa2, pt) == BF16) for pt in ROUNDING_POINTS)
    lifted = resolve("fp8_te", formats={"bwd_gemm_in": "bf16", "bwd_out": "fp32"})
    assert lifted.operand("ds_in") == BF16 and lifted.operand("dp_out") == F32  # operands follow their point


def test_fp8_recipes_run_and_return_bf16():
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 2, 33, 16, generator=g) for _ in range(4))
    ref = reference_attention(*(x.double() for x in (q, k, v)), AttentionKnobs(recipe="fp32"), do.double())
    for recipe in ("fp8_fa3", "fp8_te", "fp16"):
        for extra in ({}, dict(incoherent=True), dict(input_scaling="block")) if recipe != "fp16" else ({},):
            out = reference_attention(q, k, v, AttentionKnobs(recipe=recipe, **extra, **BLOCKS).validate(), do)
            assert out[0].dtype == (F16 if recipe == "fp16" else BF16)
            for x, y in zip(out, ref, strict=True):
                err = ((x.double() - y).norm() / y.norm()).item()
                assert err < 0.2, (recipe, extra, err)


def test_incoherent_is_exact_in_fp64():
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 24, 16, generator=g, dtype=F64) for _ in range(4))
    base = reference_attention(q, k, v, AttentionKnobs(recipe="fp32", **BLOCKS), do)
    rot = reference_attention(q, k, v, AttentionKnobs(recipe="fp32", incoherent=True, **BLOCKS).validate(), do)
    for a, b in zip(base, rot, strict=True):
        assert (a - b).abs().max() < 1e-12
    with pytest.raises(ValueError, match="attention.incoherent=True is not allowed for head_dim 12"):
        flash_attention(*(torch.zeros(1, 1, 4, 12) for _ in range(3)),
                        AttentionKnobs(recipe="fp8_fa3", incoherent=True))


def test_incoherent_rotates_what_fp8_quantizes():
    """With incoherent on, the FP8 Q, K are the e4m3 values of QM, KM (not of Q, K): the forward differs, and its
    scores equal those of the rotated, quantized inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 32, 16, generator=g) for _ in range(3))
    q[..., 0] = 40.0  # an outlier channel
    knobs = AttentionKnobs(recipe="fp8_fa3", incoherent=True, tiling=False).validate()
    p = _plan(knobs, q)
    qw, kw = p.inputs((q, k), E4M3, (32, 32), rotate=(0, 1))
    m = fmt.rotation(16, F32)
    assert torch.equal(qw, fmt.quantize(q @ m, E4M3, fmt.amax_scale(q @ m, E4M3, (2, 3))))
    trace = {}
    forward(q, k, v, knobs, trace=trace)
    assert torch.equal(trace["scores"][0][1], qw @ kw.transpose(-1, -2))
    plain = forward(q, k, v, AttentionKnobs(recipe="fp8_fa3", tiling=False))[0]
    assert not torch.equal(plain, forward(q, k, v, knobs)[0])


# ------------------------------------------------------------------------------------------ shorthands, validation
@pytest.mark.parametrize("recipe,point", [("paper_bf16", "acc"), ("paper_bf16", "pbar"), ("fa2", "o_store")])
def test_formats_fp32_is_keep_fp32_bit_for_bit(recipe, point):
    g = torch.Generator().manual_seed(2)
    q, k, v, do = ((torch.randn(1, 2, 40, 16, generator=g) * 3).to(BF16) for _ in range(4))
    a = reference_attention(q, k, v, AttentionKnobs(recipe=recipe, keep_fp32=[point], **BLOCKS), do)
    b = reference_attention(q, k, v, AttentionKnobs(recipe=recipe, formats={point: "fp32"}, **BLOCKS), do)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("point", ["scores", "pv_out", "grad_acc"])
def test_formats_bf16_is_round_bf16_bit_for_bit(point):
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=g) * 3 for _ in range(4))
    a = reference_attention(q, k, v, AttentionKnobs(recipe="fp32", round_bf16=[point], **BLOCKS), do)
    b = reference_attention(q, k, v, AttentionKnobs(recipe="fp32", formats={point: "bf16"}, **BLOCKS), do)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("knobs,key,words", [
    (dict(formats={"qk": "e4m3"}), "attention.formats={'qk': 'e4m3'}", "points from scores"),
    (dict(formats={"pbar": "fp8"}), "attention.formats={'pbar': 'fp8'}", "formats from fp32, bf16, fp16, e4m3, e5m2"),
    (dict(recipe="fa2", formats={"stats": "e4m3"}), "attention.formats={'stats': 'e4m3'}",
     "FP8 (e4m3) only at pbar, o_store, bwd_gemm_in, bwd_out"),
    (dict(formats={"acc": "fp32"}, keep_fp32=["acc"]), "attention.formats={'acc': 'fp32'}", "keep_fp32 (acc"),
    (dict(recipe="fp8_fa3", formats={"pbar": "e4m3"}), "attention.formats={'pbar': 'e4m3'}",
     "recipe fp8_fa3 keeps pbar in E4M3 already"),
    (dict(input_scaling="block"), "attention.input_scaling='block'", "no FP8 input"),
    (dict(recipe="fa2", pbar_scale="fa3"), "attention.pbar_scale='fa3'", "P̄ is not FP8 in recipe fa2"),
    (dict(recipe="fp8_fa3", keep_fp32=["scores"]), "attention.keep_fp32=['scores']",
     "recipe fp8_fa3 keeps scores in FP32 already"),
    (dict(recipe="fp8_fa3", round_bf16=["o_store"]), "attention.round_bf16=['o_store']",
     "keeps o_store in BF16 already"),
])
def test_validation_names_point_format_and_what_is_allowed(knobs, key, words):
    with pytest.raises(ValueError) as e:
        AttentionKnobs(**knobs).validate()
    msg = str(e.value)
    assert msg.startswith(key + " is not allowed: expected") and words in msg, msg


def test_one_format_up_is_allowed():
    AttentionKnobs(recipe="fp8_fa3", round_bf16=["pbar"]).validate()  # e4m3 -> bf16 by the shorthand
    AttentionKnobs(recipe="fp8_te", formats={"bwd_out": "fp32"}).validate()  # lifts dP (its e5m2 operand)
    AttentionKnobs(recipe="fp32", formats={p: "e5m2" for p in FP8_POINTS}).validate()


# ------------------------------------------------------------------------------------------ Triton refuses
@pytest.mark.parametrize("knobs", [
    dict(recipe="fp8_fa3"), dict(recipe="fp8_te"), dict(recipe="fp16"), dict(recipe="fp8_fa3", incoherent=True),
    dict(recipe="fa2", formats={"pbar": "fp16"}), dict(recipe="fp8_fa3", input_scaling="block"),
    dict(recipe="fp8_te", pbar_scale="fa3")])
def test_triton_refuses_the_new_formats(knobs):
    from flash_forensics.kernels.config import AttentionConfig
    from flash_forensics.models.attention import resolve_backend
    from flash_forensics.orchestrator.config.validate import ConfigError, check_knob_combos
    k = AttentionKnobs(**knobs).validate()
    lacks = [r.name for r in table.unsupported(k, "triton")]
    assert lacks and table.unsupported(k, "emulator") == []
    assert [r.name for r in table.unsupported(k, "standard")] == lacks  # nor standard / sdpa
    with pytest.raises(ValueError, match=f"Triton does not compute {lacks[0]}"):
        resolve_backend(AttentionKnobs(**knobs, backend="triton"), "cuda", head_dim=16)
    assert resolve_backend(k, "cuda", head_dim=16) == "emulator"  # auto: the emulator computes it
    with pytest.raises(ConfigError, match=f"{lacks[0]}=.* is not computed by attention.backend='triton'; "
                                          "computed by: emulator"):
        check_knob_combos(AttentionConfig(**knobs, backend="triton"), n_layer=1)


# ------------------------------------------------------------------------------------------ generator, configs
def test_committed_up_sweeps_are_the_generators_output():
    import yaml

    from flash_forensics.orchestrator.config import rounding_sweep as rs
    files = rs.generate_all()
    assert rs.stale(files) == [], "run: flash-forensics rounding-sweep"
    ups = {rel: yaml.safe_load(t) for rel, t in files.items() if "/intervention/up_" in rel}
    assert "conf/intervention/up_fp8_fa3_pbar.yaml" in ups
    assert ups["conf/intervention/up_fp8_fa3_pbar.yaml"]["formats"] == {"pbar": "bf16"}
    for doc in ups.values():
        AttentionKnobs(recipe=doc["recipe"], formats=doc["formats"]).validate()
        assert doc["expect"] == "stable" and "not an experiment of the paper" in doc["paper"]
    for recipe in rs.UP_RECIPES:
        sweep = yaml.safe_load(files[f"sweeps/up_{recipe}.yaml"])
        names = sweep["hydra"]["sweeper"]["params"]["intervention"].split(",")
        assert names[0] == f"{recipe}_baseline"
        assert len(names) == 1 + sum(f in rs.UP for f in resolve(recipe).formats().values())


def test_attention_and_baseline_files_validate():
    import os

    import yaml
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for recipe in ("fp16", "fp8_fa3", "fp8_te"):
        att = yaml.safe_load(open(os.path.join(root, "conf", "attention", f"{recipe}.yaml")))
        AttentionKnobs(**att).validate()
        iv = yaml.safe_load(open(os.path.join(root, "conf", "intervention", f"{recipe}_baseline.yaml")))
        assert iv["name"] == f"{recipe}_baseline" and iv["recipe"] == recipe and iv["expect"] in ("stable",
                                                                                                 "diverges")
        assert "not an experiment of the paper" in iv["paper"]


# ------------------------------------------------------------------------------------------ forensics per format
def test_forensics_in_every_format(capsys):
    from flash_forensics.kernels import forensics as fx
    rng = np.random.default_rng(0)
    for f, dt in (("fp16", F16), ("e4m3", E4M3), ("e5m2", E5M2)):
        for _ in range(100):
            a = float(np.float32(rng.normal() * 4))
            b = float(np.float32(rng.normal() * 4))
            x = fx.explain_add(a, b, f)
            exact = float(Fraction(a) + Fraction(b))
            assert x.bf16 == rne(exact, *ORACLE[dt]) or (dt == F16 and math.isinf(x.bf16)), (f, a, b)
    x = fx.explain_add(fx.PAPER_A, -2.25, "e4m3")
    assert x.bf16 == -4.5 and x.bf16_bits_raw == "11001001"
    assert fx.unit_window("e4m3") == 0.96875 and fx.unit_window("bf16") == 0.998046875
    assert fx.unit_window("e5m2") == 0.9375
    assert fx.main(["example", "--format", "e4m3"]) == 0
    out = capsys.readouterr().out
    assert "every P̄ in [0.96875, 1] is stored as 1" in out and "stored as -2.25" in out
    assert fx.main(["add", "-2.4071154594421387", "-2.296875", "--format", "fp16"]) == 0
    assert "FP16 result -4.703125" in capsys.readouterr().out


def test_struct_sanity():  # the oracle agrees with Python's own float16 packing
    for x in (1.0009765625, 65504.0, 6.1e-5, 3.3e-8):
        assert rne(x, *ORACLE[F16][:2], math.inf) == struct.unpack("e", struct.pack("e", x))[0]


def test_pv_trace_per_format():
    from flash_forensics.kernels import forensics as fx
    p, v = np.array([1.0, 0.97, 1e-3]), np.array([-2.25, 1.0, -2.0])
    tr = fx.pv_trace(p, v, fmt="e4m3")
    assert tr.is_one.tolist() == [True, True, False]  # 0.97 is fed as 1 in e4m3 (not in BF16)
    assert fx.pv_trace(p, v).is_one.tolist() == [True, False, False]
    hp = np.cumsum(p * v)
    want = [rne(float(np.float32(-2.25)), 3, -6, 448.0), rne(-1.25, 3, -6, 448.0),
            rne(float(np.float32(-1.25) + np.float32(2.0 ** -9 * -2.0)), 3, -6, 448.0)]
    assert np.allclose(tr.err, np.array(want) - hp, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="--format='fp8' is not allowed"):
        fx.pv_trace(p, v, fmt="fp8")
