"""The knob table (kernels/knobs.py): the configs are built from it, it fails closed, and the clamp-only knob.

Fails closed: a knob an implementation does not compute is refused before launch when that implementation was
chosen explicitly, and sent to the emulator by backend=auto on CUDA (the route says so), never silently ignored.
"""
import pickle
from dataclasses import fields, replace
from typing import List, Optional

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

import flash_forensics.kernels.emulator
import flash_forensics.models.attention as routing
from flash_forensics.kernels import knobs as table
from flash_forensics.kernels import triton_flash as tf
from flash_forensics.kernels.checks import bad, is_int, is_num
from flash_forensics.kernels.config import AttentionConfig, AttentionKnobs, KnobPatch, LayerOverride, build
from flash_forensics.kernels.emulator import capture_forward, flash_attention
from flash_forensics.kernels.knobs import KNOBS, PBAR_CLAMP, Knob
from flash_forensics.models.attention import resolve_backend, route_name
from flash_forensics.models.gpt import GPT, ModelConfig
from flash_forensics.orchestrator.config.validate import ConfigError, check_knob_combos, validate_config
from tests.unit.test_emulator import tie_qkv
from tests.unit.test_validate import job_cfg

F64 = torch.float64


# -------------------------------------------------------------------------------------- configs from the table
def test_dataclasses_are_the_table():
    assert [f.name for f in fields(AttentionKnobs)] == [r.name for r in KNOBS]
    for f, row in zip(fields(AttentionKnobs), KNOBS):
        assert f.type == row.type and f.metadata["knob"] is row
    assert all(v == r.default for v, r in zip(AttentionKnobs().knob_values().values(), KNOBS))
    assert [f.name for f in fields(KnobPatch)] == [r.name for r in KNOBS]
    assert all(f.type == Optional[r.type] for f, r in zip(fields(KnobPatch), KNOBS))
    assert KnobPatch().set_knobs() == {} and KnobPatch(pbar_clamp=True).set_knobs() == {"pbar_clamp": True}
    assert [f.name for f in fields(LayerOverride)][-1] == "layers" and issubclass(AttentionConfig, AttentionKnobs)
    a, b = AttentionKnobs(), AttentionKnobs()
    a.o_fp32_heads.append(1)
    assert b.o_fp32_heads == []  # list defaults are per instance


def test_generated_classes_are_structured_configs():
    node = OmegaConf.structured(AttentionConfig)
    node = OmegaConf.merge(node, {"pbar_clamp": True, "overrides": [{"layers": [1], "impl": "standard"}]})
    att = OmegaConf.to_object(node)
    assert type(att) is AttentionConfig and type(att.overrides[0]) is LayerOverride
    assert att.pbar_clamp and att.for_layer(1).impl == "standard" and att.for_layer(0).impl == "flash"
    with pytest.raises(ValidationError, match="block_q"):
        OmegaConf.merge(node, {"block_q": "big"})
    with pytest.raises(ValidationError, match="pbar_clamp"):
        OmegaConf.merge(node, {"overrides": [{"layers": [0], "pbar_clamp": "maybe"}]})
    assert pickle.loads(pickle.dumps(att)) == att



def test_generated_classes_compose_through_hydra_configstore():
    from hydra import compose, initialize
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    ConfigStore.instance().store(name="knobs_test_attention", node=AttentionConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize(version_base="1.3", config_path=None):
            att = OmegaConf.to_object(compose("knobs_test_attention", overrides=["pbar_clamp=true", "block_k=32"]))
            assert type(att) is AttentionConfig and att.pbar_clamp and att.block_k == 32
            with pytest.raises(Exception, match="block_q"):
                compose("knobs_test_attention", overrides=["block_q=big"])
    finally:
        GlobalHydra.instance().clear()


def test_intervention_composes_with_the_table_knob(tmp_path, monkeypatch):
    cfg, ov = job_cfg(tmp_path, "intervention=pbar_clamp")
    obj, att = validate_config(cfg, ov, check_store=False)
    assert obj.intervention.pbar_clamp is True and att.for_layer(0).pbar_clamp is True
    model = GPT(ModelConfig(name="t", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64), att)
    assert model.attention_routes("cpu") == ["flash/emulator/paper_bf16+pbar_clamp"] * 2  # CPU: the emulator
    # Triton computes it (an explicit backend=triton on a CPU needs the interpreter: check_triton_device)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg, ov = job_cfg(tmp_path, "intervention=pbar_clamp", "attention.backend=triton")
    assert validate_config(cfg, ov, check_store=False)[1].for_layer(0).backend == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    cfg, ov = job_cfg(tmp_path, "intervention=pbar_clamp", "attention.impl=standard")
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, ov, check_store=False)
    assert "attention (layer 0): pbar_clamp=True is not computed by attention.impl='standard'" in str(e.value)
    assert "computed by: emulator, triton" in str(e.value)


def test_values_are_checked_by_the_table():
    for knobs, key, words in ((AttentionKnobs(block_k=0), "attention.block_k=0", "an integer > 0"),
                              (AttentionKnobs(beta=1), "attention.beta=1", "> 1"),
                              (AttentionKnobs(eps=True), "attention.eps=True", "a number > 0"),
                              (AttentionKnobs(pbar_clamp=1), "attention.pbar_clamp=1", "true or false"),
                              (AttentionKnobs(delta="dS"), "attention.delta='dS'", "dO_O, dP_P, recompute_fp32")):
        with pytest.raises(ValueError) as e:
            knobs.validate(n_head=4)
        assert key in str(e.value) and words in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=r"attention.overrides\[0\].pbar_clamp='yes'"):
        AttentionConfig(overrides=[LayerOverride(layers=[0], pbar_clamp="yes")]).validate(4, n_layer=2)


def test_a_row_must_state_where_it_runs_and_its_off_value():
    with pytest.raises(TypeError, match="computed_by"):
        Knob("toy", bool, False, "forgot computed_by", off=False)
    with pytest.raises(TypeError, match="off"):
        Knob("toy", bool, False, "forgot off", computed_by=("emulator",))
    with pytest.raises(ValueError, match="cuda_graph"):
        Knob("toy", bool, False, "unknown implementation", computed_by=("cuda_graph",), off=False)
    with pytest.raises(TypeError, match="needs `choices` or a `check`"):
        Knob("toy", int, 3, "an int without a check", computed_by=("emulator",), off=3)
    with pytest.raises(ValueError, match="twice"):
        build(KNOBS + (KNOBS[-1],))
    with pytest.raises(ValueError, match="a knob with choices gives computed_by as"):
        Knob("toy", str, "a", "choices need values per implementation", computed_by=("emulator",), off="a",
             choices=("a", "b"))


def test_a_new_choice_is_computed_nowhere_until_listed():
    """A value added to a knob's choices (as a new softmax would be) runs only where a row lists it."""
    softmax = next(r for r in KNOBS if r.name == "softmax")
    forgot = replace(softmax, choices=softmax.choices + ("toy_softmax",))
    listed = replace(forgot, computed_by={"emulator": ("stabilized", "toy_softmax"), "triton": ("stabilized",)})
    for row, where in ((forgot, "no implementation"), (listed, "emulator")):
        Knobs, _, _, Config = build(tuple(row if r.name == "softmax" else r for r in KNOBS))
        with pytest.raises(ConfigError, match=f"softmax='toy_softmax' is not computed by attention.backend='triton'"
                                              f"; computed by: {where};"):
            check_knob_combos(Config(backend="triton", softmax="toy_softmax"), n_layer=1)
        assert [r.name for r in table.unsupported(Knobs(softmax="toy_softmax"), "triton")] == ["softmax"]
        assert bool(table.unsupported(Knobs(softmax="toy_softmax"), "emulator")) == (row is forgot)
    assert route_name(Knobs(softmax="toy_softmax"), "emulator").startswith("flash/emulator (triton lacks: softmax)/")


def test_shared_checks():
    assert is_int(3, 1) and not is_int(True) and not is_int(3.0) and not is_int(5, 0, 4)
    assert is_num(0.5, 0) and not is_num(0, 0) and is_num(0, 0, strict=False) and not is_num(False)
    err = bad("train.x", 3, "an integer > 5", ConfigError)
    assert isinstance(err, ConfigError) and str(err) == "train.x=3 is not allowed: expected an integer > 5"


# ------------------------------------------------------------------------ a knob Triton lacks: never ignored
TOY = Knob("toy_knob", bool, False, "a knob only the emulator computes (test)", computed_by=("emulator",), off=False)


@pytest.fixture
def toy():
    """The table plus TOY (no Triton implementation), as the classes it builds."""
    return build(KNOBS + (TOY,))


@pytest.fixture
def cuda_like(monkeypatch):
    """Routing as on a CUDA machine whose Triton kernels take any input: only the knob table can say no."""
    asked = []

    class FakeTriton:
        @staticmethod
        def supports(knobs, q):
            asked.append(knobs)
            return tf.supports(knobs, q)

        flash_attention_triton = None

    monkeypatch.setattr(routing, "_triton_module", lambda: FakeTriton)
    monkeypatch.setattr(routing, "_example_q", lambda knobs, dev, h, t, d: torch.empty(1, h, t, d))
    monkeypatch.setattr(tf, "triton", tf.triton or object())  # supports() without an installed triton
    monkeypatch.setattr(tf, "_interpret", lambda: True)  # a CPU tensor passes its device check
    return asked


def test_new_knob_without_triton_is_refused_for_backend_triton(toy):
    Knobs, _, Override, Config = toy
    att = Config(backend="emulator", overrides=[Override(layers=[1], backend="triton", toy_knob=True)])
    check_knob_combos(Config(toy_knob=True), n_layer=2)  # auto: the emulator computes it
    check_knob_combos(Config(toy_knob=True, backend="emulator"), n_layer=2)
    with pytest.raises(ConfigError) as e:
        check_knob_combos(att, n_layer=2)
    assert str(e.value).startswith("attention.overrides[0] (layer 1): toy_knob=True is not computed by "
                                   "attention.overrides[0].backend='triton'; computed by: emulator")
    with pytest.raises(ConfigError, match=r"attention \(layer 0\): toy_knob=True is not computed by "
                                          r"attention.impl='standard'"):
        check_knob_combos(Config(impl="standard", toy_knob=True), n_layer=1)
    with pytest.raises(ValueError, match="attention.backend='triton' is not allowed here: Triton does not compute "
                                         "toy_knob"):
        resolve_backend(Knobs(backend="triton", toy_knob=True), "cuda", head_dim=16)


def test_new_knob_without_triton_routes_to_the_emulator_on_cuda(toy, cuda_like):
    Knobs = toy[0]
    plain, toy_on = Knobs(recipe="fp32", block_q=16, block_k=16), Knobs(recipe="fp32", block_q=16, block_k=16,
                                                                       toy_knob=True)
    assert resolve_backend(plain, "cuda", head_dim=16) == "triton"  # the control: Triton takes the layer
    assert resolve_backend(toy_on, "cuda", head_dim=16) == "emulator"
    assert cuda_like == [plain], "the table decided before the kernel was asked"
    q = torch.empty(1, 2, 16, 16)
    assert tf.supports(plain, q) and not tf.supports(toy_on, q)  # supports() reads the table too
    assert route_name(toy_on, "emulator") == "flash/emulator (triton lacks: toy_knob)/fp32+blocks16x16+toy_knob"
    assert route_name(plain, "triton") == "flash/triton/fp32+blocks16x16"


STABILIZER_KNOBS = [(dict(pbar_clamp=True), "pbar_clamp"),
                    (dict(softmax="stabilized_guarded"), "sfa_guarded(beta=2)"),
                    (dict(stochastic_round=True, sr_seed=7, round_bf16=["pv_out", "acc"]),
                     "round_bf16=pv_out,acc+stoch_round(seed=7)")]


@pytest.mark.parametrize("case,label", STABILIZER_KNOBS, ids=[c[1] for c in STABILIZER_KNOBS])
def test_stabilizer_knobs_route_to_triton_on_cuda(cuda_like, case, label):
    """pbar_clamp, softmax=stabilized_guarded and stochastic_round (issue 34): Triton computes them, so backend=auto
    takes Triton on CUDA and the route no longer says 'triton lacks'. Their Triton numerics are checked against the
    emulator by the interpreter tests and the `gpu` tests of tests/unit/test_triton.py."""
    knobs = AttentionKnobs(recipe="fp32", block_q=16, block_k=16, **case)
    assert table.unsupported(knobs, "triton") == []
    assert resolve_backend(knobs, "cuda", head_dim=16) == "triton"
    assert route_name(knobs, "triton") == f"flash/triton/fp32+blocks16x16+{label}"
    assert resolve_backend(replace(knobs, backend="triton"), "cuda", head_dim=16) == "triton"


def test_monkeypatched_table_row_without_triton_reroutes_a_real_model(monkeypatch, cuda_like, tmp_path):
    """The real classes: drop triton from pv_fp32's row; a GPT's routes on CUDA and the job's validation follow."""
    rows = tuple(replace(r, computed_by=("emulator", "standard")) if r.name == "pv_fp32" else r for r in KNOBS)
    monkeypatch.setattr(AttentionKnobs, "KNOB_ROWS", rows)
    cfg = ModelConfig(name="t", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    model = GPT(cfg, AttentionConfig(recipe="fp32", block_q=16, block_k=16,
                                     overrides=[LayerOverride(layers=[1], pv_fp32=True)]))
    assert model.attention_routes("cuda") == [
        "flash/triton/fp32+blocks16x16", "flash/emulator (triton lacks: pv_fp32)/fp32+blocks16x16+pv_fp32"]
    job, ov = job_cfg(tmp_path, "intervention=pv_fp32", "attention.backend=triton")
    with pytest.raises(ConfigError, match=r"pv_fp32=True is not computed by attention.backend='triton'; "
                                          r"computed by: emulator, standard"):
        validate_config(job, ov, check_store=False)


# ------------------------------------------------------------------------------- route labels from the table
def test_route_labels_read_the_table():
    assert route_name(AttentionKnobs(eps=1e-2, delta="dP_P", tiling=False), "emulator") == \
        "flash/emulator/paper_bf16+untiled+eps=0.01+delta=dP_P"
    assert route_name(AttentionKnobs(impl="standard", counters=False, o_fp32_heads=[3, 1], tiling=False),
                      "standard") == "standard/paper_bf16+o_fp32_heads=1,3+no-counters"
    assert route_name(AttentionKnobs(impl="sdpa", recipe="fp32"), "sdpa") == "sdpa/fp32/no-counters"
    assert table.unsupported(AttentionKnobs(impl="sdpa", block_q=32, beta=4.0, counters=True), "sdpa") == []
    assert [r.name for r in table.unsupported(AttentionKnobs(tiling=False, pbar_clamp=True), "standard")] == [
        "tiling", "pbar_clamp"]


# ------------------------------------------------------------------------------ pbar_clamp: the clamp-only knob
CLAMP_CASES = [("fp32", F64, dict(tiling=False)), ("fp32", F64, dict(block_q=8, block_k=8)),
               ("paper_bf16", torch.bfloat16, dict(block_q=8, block_k=16)), ("fa2", torch.bfloat16, {})]


def _ties(cap) -> List[torch.Tensor]:
    return [t["rep"] & (t["p_bar"] == 1) for t in cap["tiles"]]


def _tie_rows(cap, shape) -> torch.Tensor:
    rows = torch.zeros(shape[:3], dtype=torch.bool)
    for t, tie in zip(cap["tiles"], _ties(cap)):
        rows[:, :, t["qs"]:t["qs"] + tie.shape[2]] |= tie.any(dim=-1)
    return rows


@pytest.mark.parametrize("recipe,dtype,case", CLAMP_CASES, ids=lambda c: str(c))
def test_pbar_clamp_changes_only_unit_pbar_at_ties(recipe, dtype, case):
    q, k, v = (x.to(dtype) for x in tie_qkv(B=2, H=2, T=40))
    off = AttentionKnobs(recipe=recipe, backend="emulator", **case)
    st_off, st_on = flash_forensics.kernels.stats.AttnStats(2, "cpu"), flash_forensics.kernels.stats.AttnStats(2, "cpu")
    base = capture_forward(q, k, v, off, st_off)
    cap = capture_forward(q, k, v, replace(off, pbar_clamp=True), st_on)
    ties = _ties(cap)
    assert any(t.any() for t in ties), "the inputs must tie some row maxima at P̄ = 1"
    for t0, t1, tie in zip(base["tiles"], cap["tiles"], ties):
        assert torch.equal(t0["p_bar"], t1["p_bar"]) and torch.equal(t0["m"], t1["m"])  # the shift m is unchanged
        assert not (t1["p_bar_pv"][tie] == 1).any()  # no P̄ = 1 left at a tie
        assert (t1["p_bar_pv"][tie] == PBAR_CLAMP).all()
        assert torch.equal(torch.where(tie, 0.0, t1["p_bar_pv"]), torch.where(tie, 0.0, t0["p_bar"]))  # the rest
        assert torch.equal(t0["p_bar_pv"], t0["p_bar"])  # off: P̄V gets P̄
    assert torch.equal(base["l"], cap["l"]) and torch.equal(base["lse"], cap["lse"])
    assert torch.equal(st_off.repeated_max_rows, st_on.repeated_max_rows)  # counted as before: nothing hidden
    changed = (base["o"] != cap["o"]).any(dim=-1)
    tie_rows = _tie_rows(cap, q.shape)
    assert changed.any() and not (changed & ~tie_rows).any(), "O changes only in rows with ties"
    if dtype == F64:
        assert torch.equal(changed, tie_rows)


@pytest.mark.parametrize("delta", ["dO_O", "dP_P", "recompute_fp32"])
@pytest.mark.parametrize("case", [dict(tiling=False), dict(block_q=8, block_k=8), dict(block_q=16, block_k=8)],
                         ids=str)
def test_pbar_clamp_backward_is_the_gradient_of_what_was_computed(delta, case):
    """FP64: O = (c o softmax(S)) V with c = PBAR_CLAMP at the forward's tie positions, c held constant."""
    q, k, v = tie_qkv(B=1, H=2, T=40)
    knobs = AttentionKnobs(recipe="fp32", backend="emulator", delta=delta, pbar_clamp=True, **case)
    cap = capture_forward(q, k, v, knobs)
    T = q.shape[2]
    c = torch.ones(1, 2, T, T, dtype=F64)
    for t, tie in zip(cap["tiles"], _ties(cap)):
        rows, cols = tie.shape[2:]
        c[:, :, t["qs"]:t["qs"] + rows, t["ks"]:t["ks"] + cols][tie] = PBAR_CLAMP
    assert (c < 1).any()
    do = torch.randn(q.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    s = (qr @ kr.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o_ref = (c * torch.softmax(s, dim=-1)) @ vr
    o_ref.backward(do)
    qe, ke, ve = (x.clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(qe, ke, ve, knobs)
    o.backward(do)
    torch.testing.assert_close(o, o_ref.detach(), atol=1e-10, rtol=1e-10)
    for got, want in ((qe.grad, qr.grad), (ke.grad, kr.grad), (ve.grad, vr.grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    off = flash_attention(q, k, v, replace(knobs, pbar_clamp=False))
    assert (off - o).abs().max() > 1e-4  # the clamp is visible at this tolerance


def test_pbar_clamp_leaves_sfa_alone_where_no_unit_pbar_remains():
    """Algorithm 3 shifts repeated maxima away from P̄ = 1 (rm != 0 here), so the clamp finds nothing to change."""
    q, k, v = tie_qkv(B=2, H=2, T=40)
    sfa = AttentionKnobs(recipe="fp32", backend="emulator", softmax="stabilized", block_q=8, block_k=8)
    cap = capture_forward(q, k, v, replace(sfa, pbar_clamp=True))
    assert not any(t.any() for t in _ties(cap)) and any(t["rep"].any() for t in cap["tiles"])
    assert torch.equal(cap["o"], flash_attention(q, k, v, sfa))
