"""Rounding points as knobs (keep_fp32 / round_bf16): validation, the emulator's per-point trace, the Triton switches
(GPU) and the generated rounding-point sweep.

The emulator's trace records, at every rounding point, the value before rounding and the value stored. "A point
changes exactly the values it names and nothing else" is then checked value by value: with p lifted, p stores its
unrounded value, every other point still stores round(value) in the recipe's dtype there; and the complement
(recipe fp32, round_bf16 = [p]).
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from flash_forensics.kernels.config import AttentionConfig, AttentionKnobs, LayerOverride
from flash_forensics.kernels.emulator import reference_attention
from flash_forensics.kernels.knobs import KNOBS, route_labels, unsupported
from flash_forensics.kernels.recipes import BF16, POINT_MEANINGS, PV_POINTS, ROUNDING_POINTS, Recipe, for_knobs, resolve
from tests.helpers.saved import saved_lse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCKS = dict(block_q=16, block_k=16)


def _inputs(dtype=torch.bfloat16, T=40, seed=0):
    """Causal attention inputs with large logits (so S, m and S - m round in BF16) and mostly negative V."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, 2, T, 16, generator=g) * 3).to(dtype)
    k = (torch.randn(1, 2, T, 16, generator=g) * 3).to(dtype)
    v = (torch.randn(1, 2, T, 16, generator=g) - 0.5).to(dtype)
    do = torch.randn(1, 2, T, 16, generator=g).to(dtype)
    return q, k, v, do


def _trace(knobs, dtype=torch.bfloat16):
    q, k, v, do = _inputs(dtype)
    trace: dict = {}
    out = reference_attention(q, k, v, knobs, do, trace=trace)
    return out, trace


def _assert_stored(trace, point, dtype):
    """Every value stored at `point` is its pre-rounding value rounded to `dtype` (BF16), or unchanged (FP32)."""
    pairs = trace[point]
    assert pairs, point
    for pre, post in pairs:
        want = pre.to(BF16).to(pre.dtype) if dtype == BF16 else pre
        assert torch.equal(post, want), f"{point}: stored value is not {dtype} of its pre-rounding value"


def _some_would_round(trace, point) -> bool:
    return any(not torch.equal(pre, pre.to(BF16).to(pre.dtype)) for pre, _ in trace[point])


# ------------------------------------------------------------------------------------------ the points and the knobs
def test_points_are_recipe_fields_and_documented():
    names = {f for f in Recipe.__dataclass_fields__}
    assert set(ROUNDING_POINTS) <= names and "gemm_in" not in names
    assert tuple(POINT_MEANINGS) == ROUNDING_POINTS
    doc = sys.modules["flash_forensics.kernels.recipes"].__doc__
    assert all(f"    {pt} " in doc for pt in ROUNDING_POINTS)
    assert resolve("paper_bf16").rounded() == ROUNDING_POINTS
    assert resolve("fp32").rounded() == ()
    assert resolve("fa2").rounded() == ("pbar", "o_store", "bwd_gemm_in")


def test_knob_rows_and_resolution():
    rows = {r.name: r for r in KNOBS}
    assert rows["keep_fp32"].default == [] and rows["round_bf16"].default == []
    rc = for_knobs(AttentionKnobs(keep_fp32=["scores", "stats"]))
    assert rc.scores == torch.float32 and rc.stats == torch.float32 and rc.shift == BF16
    rc = for_knobs(AttentionKnobs(recipe="fp32", round_bf16=["acc"]))
    assert rc.acc == BF16 and rc.rounded() == ("acc",)
    assert for_knobs(AttentionKnobs(pv_fp32=True)) == for_knobs(AttentionKnobs(keep_fp32=list(PV_POINTS)))
    k = AttentionKnobs(keep_fp32=["scores"], round_bf16=[])
    assert "keep_fp32=scores" in route_labels(k, "emulator")
    assert [r.name for r in unsupported(k, "standard")] == ["keep_fp32"]
    assert unsupported(k, "triton") == [] and unsupported(k, "emulator") == []


@pytest.mark.parametrize("knobs,key,words", [
    (dict(keep_fp32=["qk"]), "attention.keep_fp32=['qk']", "rounding points from scores"),
    (dict(round_bf16=["acc", "acc"]), "attention.round_bf16=['acc', 'acc']", "distinct rounding points"),
    (dict(recipe="fp32", keep_fp32=["acc"], round_bf16=["acc"]), "attention.round_bf16=['acc']", "in both"),
    (dict(recipe="fa2", keep_fp32=["scores"]), "attention.keep_fp32=['scores']",
     "recipe fa2 keeps scores in FP32 already"),
    (dict(recipe="fp32", keep_fp32=["pbar"]), "attention.keep_fp32=['pbar']", "recipe fp32 keeps pbar in FP32"),
    (dict(round_bf16=["acc"]), "attention.round_bf16=['acc']", "recipe paper_bf16 keeps acc in BF16 already"),
    (dict(recipe="fp32", pv_fp32=True, round_bf16=["pbar"]), "attention.round_bf16=['pbar']", "pv_fp32=true lifts"),
])
def test_validation_names_key_value_and_what_is_allowed(knobs, key, words):
    with pytest.raises(ValueError) as e:
        AttentionKnobs(**knobs).validate()
    msg = str(e.value)
    assert msg.startswith(key + " is not allowed: expected") and words in msg, msg


def test_validation_of_overrides_names_the_override():
    cfg = AttentionConfig(recipe="fa2", overrides=[LayerOverride(layers=[1], keep_fp32=["o_store"]),
                                                   LayerOverride(layers=[0], keep_fp32=["acc"])])
    with pytest.raises(ValueError, match=r"attention\.overrides\[1\]\.keep_fp32=\['acc'\].*recipe fa2"):
        cfg.validate(n_head=2, n_layer=2)
    AttentionConfig(recipe="fa2", overrides=cfg.overrides[:1]).validate(n_head=2, n_layer=2)


# ------------------------------------------------------------------------------------------ emulator: the trace
# the points each BF16 recipe stores in BF16 (a lift of any other point is refused: test_validation_...)
LIFTS = [(r, pt) for r in ("paper_bf16", "fa2") for pt in resolve(r).rounded()]


@pytest.mark.parametrize("recipe,point", LIFTS, ids=[f"{r}-{pt}" for r, pt in LIFTS])
def test_lifting_a_point_changes_exactly_that_point(recipe, point):
    base = resolve(recipe)
    knobs = AttentionKnobs(recipe=recipe, keep_fp32=[point], **BLOCKS).validate()
    _, trace = _trace(knobs)
    assert set(trace) == set(ROUNDING_POINTS)  # every point was stored somewhere (delta dO_O, tiled)
    for pt in ROUNDING_POINTS:
        _assert_stored(trace, pt, torch.float32 if pt == point else getattr(base, pt))
    assert _some_would_round(trace, point), f"the inputs never exercise {point}"


@pytest.mark.parametrize("point", ROUNDING_POINTS)
def test_rounding_one_point_of_fp32_changes_exactly_that_point(point):
    knobs = AttentionKnobs(recipe="fp32", round_bf16=[point], **BLOCKS).validate()
    (o, lse, dq, dk, dv), trace = _trace(knobs, torch.float32)
    (o0, lse0, dq0, dk0, dv0), _ = _trace(AttentionKnobs(recipe="fp32", **BLOCKS), torch.float32)
    for pt in ROUNDING_POINTS:
        _assert_stored(trace, pt, BF16 if pt == point else torch.float32)
    assert _some_would_round(trace, point)
    # and the result moved (every point feeds O or a gradient; the forward points also feed lse or O)
    moved = [not torch.equal(a, b) for a, b in ((o, o0), (lse, lse0), (dq, dq0), (dk, dk0), (dv, dv0))]
    assert any(moved), point
    if point in ("delta_prod", "bwd_gemm_in", "bwd_out", "grad_acc"):  # backward points leave the forward alone
        assert torch.equal(o, o0) and torch.equal(lse, lse0)


@pytest.mark.parametrize("recipe,points", [("paper_bf16", list(PV_POINTS)), ("fa2", ["pbar"])])
@pytest.mark.parametrize("tiling", [True, False])
def test_pv_fp32_is_keep_fp32_of_the_pv_path_bit_for_bit(recipe, points, tiling):
    q, k, v, do = _inputs()
    a = reference_attention(q, k, v, AttentionKnobs(recipe=recipe, pv_fp32=True, tiling=tiling, **BLOCKS), do)
    b = reference_attention(q, k, v, AttentionKnobs(recipe=recipe, keep_fp32=points, tiling=tiling, **BLOCKS), do)
    c = reference_attention(q, k, v, AttentionKnobs(recipe=recipe, tiling=tiling, **BLOCKS), do)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])  # and the lift does something


def test_lift_on_fp64_inputs_keeps_the_working_dtype():
    """Lifting means 'the working dtype': on FP64 inputs of the fp32 recipe, a rounded point lives in BF16 and the
    others stay FP64 (not FP32)."""
    knobs = AttentionKnobs(recipe="fp32", round_bf16=["acc"], **BLOCKS)
    rc = for_knobs(knobs, torch.float64)
    assert rc.acc == BF16 and rc.pv_out == torch.float64
    _, trace = _trace(knobs, torch.float64)
    _assert_stored(trace, "pv_out", torch.float64)
    _assert_stored(trace, "acc", BF16)


# ------------------------------------------------------------------------------------------ Triton: switches
def _tf():
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    from flash_forensics.kernels import triton_flash
    return triton_flash


def test_round_mask_is_the_recipe_and_round_trips():
    tf = _tf()
    assert tf.round_mask(AttentionKnobs()) == (1 << len(ROUNDING_POINTS)) - 1
    assert tf.round_mask(AttentionKnobs(recipe="fp32")) == 0
    for recipe in ("paper_bf16", "fa2", "fp32"):
        for pt in ROUNDING_POINTS:
            lift = getattr(resolve(recipe), pt) == BF16
            knobs = AttentionKnobs(recipe=recipe, **({"keep_fp32": [pt]} if lift else {"round_bf16": [pt]}))
            mask = tf.round_mask(knobs)
            assert bool(mask >> ROUNDING_POINTS.index(pt) & 1) != lift
            keep, rnd = tf.mask_points(recipe, mask)
            assert (keep, rnd) == (list(knobs.keep_fp32), list(knobs.round_bf16))
    assert tf.round_mask(AttentionKnobs(pv_fp32=True)) == tf.round_mask(AttentionKnobs(keep_fp32=list(PV_POINTS)))
    for knobs in (AttentionKnobs(recipe="fa2", pv_fp32=True, keep_fp32=["o_store"]),
                  AttentionKnobs(keep_fp32=["scores", "grad_acc"]),
                  AttentionKnobs(recipe="fp32", round_bf16=["stats", "bwd_out"], pv_fp32=True)):
        want = sum(1 << ROUNDING_POINTS.index(pt) for pt in for_knobs(knobs).rounded())
        assert tf.round_mask(knobs) == want  # the kernels' bits are the emulator's recipe
    assert tf.saved_o_dtype(tf.round_mask(AttentionKnobs(keep_fp32=["o_store"])), []) == torch.float32
    assert tf.saved_o_dtype(tf.round_mask(AttentionKnobs(recipe="fp32", round_bf16=["o_store"])), []) == BF16


def test_ops_carry_the_rounding_points():
    tf = _tf()
    from flash_forensics.kernels import ops
    knobs = AttentionKnobs(recipe="fa2", keep_fp32=["o_store"], pv_fp32=True)
    rebuilt = ops._knobs("fa2", True, 64, 64, pv_fp32=True, rounding=ops.op_rounding(knobs))
    assert tf.round_mask(rebuilt) == tf.round_mask(knobs)
    assert ops._knobs("fa2", True, 64, 64).keep_fp32 == []  # -1: the recipe's own points


INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def test_interpreter_rounding_points():
    """Each point moved, Triton against the emulator in the CPU interpreter (child pytest, TRITON_INTERPRET=1): fp32
    with one point rounded, paper_bf16 / fa2 with one point lifted. In the interpreter the kernels' BF16 store rounds
    to nearest even and BF16 GEMMs run as FP32 GEMMs of the BF16 values (kernels/triton_flash.py: the interpreter
    gets both wrong otherwise), so the two agree up to summation order; the GPU tests below check the real thing."""
    _tf()
    if INTERP:
        pytest.skip("already inside the interpreter run")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interp_run",
                          os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert " passed" in res.stdout and " skipped" not in res.stdout.split("passed")[-1], res.stdout[-2000:]


def _close_up_to_flips(a, b, tol=2e-4):
    """Equal to FP32 noise, except that a value next to a BF16 rounding boundary may round the other way where the
    FP32 summation order differs (Triton's GEMMs vs torch's): at most 1% of the elements, each by at most one BF16
    ulp of the tensor's largest value (an accumulator flips at its running magnitude, which cancellation hides)."""
    a, b = a.detach().double(), b.double()
    off = (a - b).abs() > tol * (1 + b.abs())
    assert off.float().mean().item() <= 0.01, f"{int(off.sum())} of {off.numel()} elements differ"
    assert ((a - b).abs()[off] <= 2.0 ** -7 * b.abs().max()).all(), "a difference beyond one BF16 ulp of the max"


INTERP_CASES = [dict(round_bf16=[pt]) for pt in ROUNDING_POINTS] + [
    dict(round_bf16=["scores", "stats", "shift"], tiling=False), dict(round_bf16=["pv_out", "acc"], tiling=False),
    dict(round_bf16=["bwd_out", "grad_acc"], tiling=False), dict(round_bf16=["acc"], softmax="stabilized"),
    dict(round_bf16=["bwd_out"], delta="dP_P"), dict(round_bf16=["pbar", "o_store"], o_fp32_heads=[1])]


INTERP_CASES = [("fp32", c) for c in INTERP_CASES] + [(r, dict(keep_fp32=[pt])) for r, pt in LIFTS] + [
    ("paper_bf16", dict(keep_fp32=["scores", "stats"], tiling=False)),
    ("paper_bf16", dict(keep_fp32=["grad_acc"], o_fp32_heads=[0])),
    ("paper_bf16", dict(keep_fp32=["acc"], softmax="stabilized", delta="dP_P"))]


@pytest.mark.skipif(not INTERP, reason="runs in a child process with TRITON_INTERPRET=1 "
                                       "(see test_interpreter_rounding_points)")
@pytest.mark.parametrize("recipe,case", INTERP_CASES,
                         ids=[f"{r}-" + ",".join(f"{k}={v}" for k, v in c.items()) for r, c in INTERP_CASES])
def test_interp_run_one_point_moved(recipe, case):
    tf = _tf()
    knobs = AttentionKnobs(recipe=recipe, **BLOCKS, **case).validate(n_head=2)
    q, k, v, do = _inputs(torch.float32 if recipe == "fp32" else torch.bfloat16, T=40)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    assert tf.supports(knobs, q)
    o = tf.flash_attention_triton(q, k, v, knobs)
    lse = saved_lse(o)  # the forward's own (launching it again for lse cost a third of the case)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref = reference_attention(q.detach(), k.detach(), v.detach(), knobs, do)
    base = reference_attention(q.detach(), k.detach(), v.detach(), AttentionKnobs(recipe=recipe, **BLOCKS), do)
    for a, b in zip((o, lse, *grads), ref):
        _close_up_to_flips(a, b)
    # the switch acts: where the rounding moved the emulator's result, it moved Triton's the same way
    moved = [i for i, (x, y) in enumerate(zip(ref, base)) if (x.double() - y.double()).abs().max() > 1e-3]
    assert moved, case
    got = (o, lse, *grads)
    for i in moved:  # nearer the emulator's moved result than its unmoved one (summed: flips are isolated)
        d_ref, d_base = ((got[i].double() - x.double()).abs().sum() for x in (ref[i], base[i]))
        assert d_ref < d_base / 4, (case, i, d_ref.item(), d_base.item())


# ------------------------------------------------------------------------------------------ GPU: Triton vs emulator
def _gpu_cases():
    cases = []
    for pt in ROUNDING_POINTS:
        cases.append(("paper_bf16", dict(keep_fp32=[pt])))
        cases.append(("fp32", dict(round_bf16=[pt])))
    for pt in ("pbar", "o_store", "bwd_gemm_in"):
        cases.append(("fa2", dict(keep_fp32=[pt])))
    cases += [("paper_bf16", dict(keep_fp32=["scores", "stats"], tiling=False)),
              ("fp32", dict(round_bf16=["pv_out", "acc"], tiling=False)),
              ("paper_bf16", dict(keep_fp32=["scores"], o_fp32_heads=[1])),
              ("fp32", dict(round_bf16=["acc"], softmax="stabilized", delta="dP_P"))]
    return cases


GPU_CASES = _gpu_cases()
# Triton vs emulator (same roundings; GEMM summation order differs): O, lse absolute; gradients relative to max
BUDGET = {"fp32": (3e-2, 3e-2, 5e-2), "fa2": (2e-2, 1e-2, 5e-2), "paper_bf16": (3e-2, 3e-2, 5e-2)}


def _planted(dt, seed=0, B=2, H=4, T=256, D=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, T, D, device="cuda", generator=g) * 2
    k = torch.randn(B, H, T, D, device="cuda", generator=g) * 2
    k[:, :, 10:14] = k[:, :, 10:11]  # repeated maxima: ties in some rows
    v = torch.randn(B, H, T, D, device="cuda", generator=g) - 0.3
    return tuple(x.to(dt).requires_grad_() for x in (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,case", GPU_CASES,
                         ids=[f"{r}-{','.join(f'{k}={v}' for k, v in c.items())}" for r, c in GPU_CASES])
def test_gpu_triton_matches_emulator_per_point(recipe, case):
    tf = _tf()
    knobs = replace(AttentionKnobs(recipe=recipe, backend="triton"), **case).validate(n_head=4)
    dt = torch.float32 if recipe == "fp32" else torch.bfloat16
    q, k, v = _planted(dt, seed=len(str(case)))
    assert tf.supports(knobs, q)
    o_t = tf.flash_attention_triton(q, k, v, knobs)
    with torch.no_grad():
        _, lse_t, _, _ = tf._forward(q.detach(), k.detach(), v.detach(), knobs)
    do = torch.randn_like(o_t.float()).to(o_t.dtype)
    g_t = torch.autograd.grad(o_t, (q, k, v), do)
    o_e, lse_e, *g_e = reference_attention(q.detach(), k.detach(), v.detach(), replace(knobs, backend="emulator"),
                                           do)
    assert o_t.dtype == o_e.dtype
    fo, fl, fg = BUDGET[recipe]
    assert (o_t.double() - o_e.double()).abs().max().item() <= fo
    assert (lse_t.double() - lse_e.double()).abs().max().item() <= fl
    for name, a, b in zip("qkv", g_t, g_e):
        rel = ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()
        assert rel <= fg, f"d{name} vs emulator: {rel:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("point", ["pv_out", "acc", "o_store", "grad_acc"])
def test_gpu_a_lift_moves_triton_as_it_moves_the_emulator(point):
    """The switch acts: lifting `point` moves Triton's output towards the emulator's lifted output, away from the
    unlifted one (a Triton kernel ignoring the switch would stay where it was)."""
    tf = _tf()
    base = AttentionKnobs(recipe="paper_bf16", backend="triton")
    lifted = replace(base, keep_fp32=[point])
    q, k, v = _planted(torch.bfloat16, seed=7)
    do = torch.randn(q.shape, device="cuda").to(torch.bfloat16)

    def run_t(kn):
        o = tf.flash_attention_triton(q, k, v, kn)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    def run_e(kn):
        o, _, *g = reference_attention(q.detach(), k.detach(), v.detach(), replace(kn, backend="emulator"), do)
        return (o, *g)

    idx = {"pv_out": 0, "acc": 0, "o_store": 1, "grad_acc": 1}[point]  # O, or dQ (o_store reaches it via delta)
    t_l, e_l, e_b = run_t(lifted)[idx], run_e(lifted)[idx], run_e(base)[idx]
    d_lifted = (t_l.double() - e_l.double()).abs().sum().item()
    d_base = (t_l.double() - e_b.double()).abs().sum().item()
    assert d_lifted < d_base, f"{point}: Triton lifted is nearer the emulator unlifted ({d_base}) than lifted"


# ------------------------------------------------------------------------------------------ the generated sweep
def test_committed_sweep_files_are_the_generators_output(tmp_path):
    from flash_forensics.orchestrator.config import rounding_sweep as rs
    files = rs.generate("paper_bf16")
    assert rs.stale(files) == [], "run: flash-forensics rounding-sweep"
    res = subprocess.run([sys.executable, "-m", "flash_forensics.orchestrator.config.rounding_sweep", "--check"],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # a stale copy: --check exits 1 and names it; a missing one too
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "conf/intervention/lift_acc.yaml").write_text(files["conf/intervention/lift_acc.yaml"] + "# edit\n")
    (tmp_path / "sweeps/rounding_points.yaml").unlink()
    (tmp_path / "conf/intervention/lift_old.yaml").write_text("name: lift_old\n")
    assert rs.main(["--check"], root=tmp_path) == 1
    assert sorted(rs.stale(files, tmp_path)) == ["conf/intervention/lift_acc.yaml", "conf/intervention/lift_old.yaml",
                                                  "sweeps/rounding_points.yaml"]
    assert rs.main([], root=tmp_path) == 0 and rs.stale(files, tmp_path) == ["conf/intervention/lift_old.yaml"]


def test_another_recipes_sweep_never_replaces_the_committed_one_unasked(tmp_path, capsys):
    from flash_forensics.orchestrator.config import rounding_sweep as rs
    rs.main([], root=tmp_path)  # the committed paper_bf16 sweep, in a copy
    before = {p: p.read_text() for p in tmp_path.rglob("*.yaml")}
    with pytest.raises(SystemExit):
        rs.main(["--recipe", "fp32"], root=tmp_path)
    assert "--recipe fp32 would replace" in capsys.readouterr().err
    assert {p: p.read_text() for p in tmp_path.rglob("*.yaml")} == before
    assert rs.main(["--recipe", "fp32", "--out", str(tmp_path / "elsewhere")], root=tmp_path) == 0
    assert {p: p.read_text() for p in tmp_path.rglob("*.yaml") if "elsewhere" not in str(p)} == before
    assert (tmp_path / "elsewhere" / "sweeps" / "rounding_points.yaml").is_file()
    # --check --out checks the folder written to, not the repository (it said "up to date" of an empty folder)
    assert rs.main(["--recipe", "fp32", "--check", "--out", str(tmp_path / "elsewhere")], root=tmp_path) == 0
    assert rs.main(["--check", "--out", str(tmp_path / "empty")], root=tmp_path) == 1
    assert "stale: sweeps/rounding_points.yaml (regenerate: flash-forensics rounding-sweep --out " in \
        capsys.readouterr().err
    # --replace where it would do nothing is refused, not ignored
    for args, why in ((["--replace"], "it needs --recipe"),
                      (["--recipe", "paper_bf16", "--replace"], "paper_bf16's files are"),
                      (["--recipe", "fp32", "--replace", "--check"], "--check writes nothing"),
                      (["--recipe", "fp32", "--replace", "--out", str(tmp_path / "x")], "--out writes elsewhere")):
        with pytest.raises(SystemExit):
            rs.main(args, root=tmp_path)
        assert f"--replace is not allowed here ({why}" in capsys.readouterr().err, args
    assert rs.main(["--recipe", "fp32", "--replace"], root=tmp_path) == 0  # asked for
    assert (tmp_path / "sweeps" / "rounding_points.yaml").read_text() == rs.generate("fp32")[
        "sweeps/rounding_points.yaml"]


def test_an_out_that_is_a_file_is_named_before_anything_is_written(tmp_path, capsys):
    """--out a file (or a path under one) failed mid-write with NotADirectoryError naming no flag."""
    from flash_forensics.orchestrator.config import rounding_sweep as rs
    (tmp_path / "afile").write_text("x")
    for args in (["--recipe", "fp32", "--out", str(tmp_path / "afile")],
                 ["--up", "fp16", "--out", str(tmp_path / "afile" / "sub")],
                 ["--check", "--out", str(tmp_path / "afile")]):
        with pytest.raises(SystemExit) as e:
            rs.main(args, root=tmp_path)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--out={args[-1]!r} is not allowed:" in err and "is a file" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_sweep_expectations_follow_the_mechanism():
    import yaml

    from flash_forensics.orchestrator.config import rounding_sweep as rs
    files = rs.generate("paper_bf16")
    for rel, text in files.items():
        if "/intervention/" not in rel:
            continue
        doc = yaml.safe_load(text)
        kind, pt = doc["name"].split("_", 1) if doc["name"].startswith("lift_") else ("bf16_only",
                                                                                    doc["name"][len("bf16_only_"):])
        on_path = pt in ("pv_out", "acc")
        assert doc["expect"] == ({"lift": "stable", "bf16_only": "diverges"}[kind] if on_path else
                                 {"lift": "diverges", "bf16_only": "stable"}[kind]), doc["name"]
        assert "predicted by the paper's mechanism (Sec. 3.3), not an experiment of the paper" in doc["paper"]
        knobs = {k: v for k, v in doc.items() if k in ("recipe", "keep_fp32", "round_bf16")}
        AttentionKnobs(**knobs).validate()  # every generated intervention is a valid config
    fa2 = rs.generate("fa2")
    assert sorted(r for r in fa2 if "lift_" in r) == [f"conf/intervention/lift_{p}.yaml"
                                                      for p in ("bwd_gemm_in", "o_store", "pbar")]
    sweep = yaml.safe_load(files["sweeps/rounding_points.yaml"])
    names = sweep["hydra"]["sweeper"]["params"]["intervention"].split(",")
    assert len(names) == 2 * len(ROUNDING_POINTS)
    conf_sweep = os.path.join(ROOT, "conf", "sweep", "rounding_points.yaml")  # Hydra's +sweep= group reads this
    assert open(conf_sweep).read() == files["sweeps/rounding_points.yaml"]


def test_sweep_forks_and_intervention_composes():
    from flash_forensics.orchestrator.job import fork
    jobs = fork.sweep_file_jobs(["rounding_points"])
    assert [j[1][0] for j in jobs][:2] == ["intervention=lift_scores", "intervention=lift_shift"]
    assert len(jobs) == 2 * len(ROUNDING_POINTS)


def test_generated_interventions_compose_validate_and_route(tmp_path):
    from flash_forensics.models.gpt import GPT, ModelConfig
    from flash_forensics.orchestrator.config.validate import ConfigError, validate_config
    from tests.unit.test_validate import job_cfg

    cfg, ov = job_cfg(tmp_path, "intervention=lift_scores")
    _, att = validate_config(cfg, ov, check_store=False)
    assert list(att.for_layer(0).keep_fp32) == ["scores"] and att.for_layer(0).recipe == "paper_bf16"
    model = GPT(ModelConfig(name="t", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64), att)
    assert all("keep_fp32=scores" in r for r in model.attention_routes("cpu"))
    cfg, ov = job_cfg(tmp_path, "intervention=bf16_only_acc")
    _, att = validate_config(cfg, ov, check_store=False)
    assert att.for_layer(1).recipe == "fp32" and list(att.for_layer(1).round_bf16) == ["acc"]
    # a lift the recipe already keeps in FP32: refused before launch, naming the recipe
    cfg, ov = job_cfg(tmp_path, "intervention=lift_scores", "attention=fa2")
    with pytest.raises(ConfigError, match=r"keep_fp32=\['scores'\].*recipe fa2 keeps scores in FP32 already"):
        validate_config(cfg, ov, check_store=False)


def test_rounding_grid_outcomes_each_their_own_colour():
    """'reproduces' and 'hastens' (and 'inconclusive' and 'mixed') shared a colour: two identical legend swatches."""
    import importlib
    grid = importlib.import_module("flash_forensics.orchestrator.analysis.localize.plot")
    assert len(set(grid._COLOURS.values())) == len(grid._COLOURS)
