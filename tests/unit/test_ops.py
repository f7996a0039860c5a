"""The Triton flash kernels as torch.library operators (kernels/ops.py) and the compiled path (train.compile).

CPU: the ops' schemas and fake implementations (what torch.compile traces), and, in a child process with
TRITON_INTERPRET=1 (the kernels on the CPU, FP32 logic), torch.library.opcheck, a whole GPT traced with no graph
break, and compiled vs eager attention bit for bit. GPU (`pytest -m gpu`): the same under inductor on CUDA for the
BF16 recipes, a compiled GPT training step, and launch configs that must not change paper_bf16's bits.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from flash_forensics.kernels.config import AttentionConfig, AttentionKnobs

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERP, reason="runs in a child process with TRITON_INTERPRET=1 "
                                                 "(see test_interpreter_op_checks)")


def _ops():
    from flash_forensics.kernels import ops
    return ops


def test_interpreter_op_checks():
    """Run the interpreter checks of this file in a child pytest with TRITON_INTERPRET=1."""
    if INTERP:
        pytest.skip("already inside the interpreter run")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreter",
                          os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


# ------------------------------------------------------------------------------------------ CPU: schema and fakes
def test_schema_declares_the_counters_mutated():
    _ops()
    schema = torch.ops.flash_forensics.flash_fwd.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"repeated_max_rows", "max_logit", "underflow_rows", "sfa_p1_rows"}
    # torch <= 2.11 drops a default-valued argument before bumping the mutated ones' versions, then indexes past the
    # end (pytorch issue 176078): compile with counters off failed on the GPU. No mutated argument may have a default.
    defaulted = {a.name for a in schema.arguments if a.name in written and a.has_default_value()}
    assert not defaulted, defaulted
    assert not any(a.alias_info is not None and a.alias_info.is_write
                   for a in torch.ops.flash_forensics.flash_bwd.default._schema.arguments)


@pytest.mark.parametrize("recipe,heads,saved,clamp", [("fa2", [], torch.bfloat16, False),
                                                      ("paper_bf16", [], torch.bfloat16, False),
                                                      ("paper_bf16", [1], torch.float32, True),
                                                      ("fp32", [], torch.float32, True)])
def test_fake_tensors_propagate(recipe, heads, saved, clamp):
    """Under FakeTensorMode (what dynamo / AOTAutograd trace with) the ops give the real outputs' shapes and dtypes,
    pbar_clamp's tie bits (the forward's third output, empty when off) included."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    _ops()
    dt = torch.float32 if recipe == "fp32" else torch.bfloat16
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 3, 40, 16, dtype=dt) for _ in range(3))
        rep, maxl = torch.zeros(3, dtype=torch.int64), torch.zeros((), dtype=torch.float32)
        spec = _spec(recipe, heads, pbar_clamp=clamp)
        o, lse, ties = torch.ops.flash_forensics.flash_fwd(q, k, v, rep, maxl, None, None, None, spec)
        assert o.shape == (2, 3, 40, 16) and o.dtype == saved
        assert lse.shape == (2, 3, 40) and lse.dtype == torch.float32
        assert ties.shape == ((2, 3, 40, 16) if clamp else (0,)) and ties.dtype == torch.uint8  # 40 keys: 16 bytes
        dq, dk, dv = torch.ops.flash_forensics.flash_bwd(o.to(dt), q, k, v, o, lse, None, ties, spec)
        assert all(t.shape == q.shape and t.dtype == dt for t in (dq, dk, dv))


def _spec(recipe, heads=(), **kw):
    return _ops().op_spec(AttentionKnobs(recipe=recipe, block_q=16, block_k=16, o_fp32_heads=list(heads), **kw), 3)


def test_op_args_carry_every_knob():
    ops = _ops()
    knobs = AttentionKnobs(recipe="paper_bf16", tiling=False, block_q=32, block_k=16, softmax="stabilized", beta=3.0,
                           eps=1e-2, delta="dP_P", pv_fp32=True, o_fp32_heads=[2, 0])
    assert ops.op_args(knobs, 4) == ("paper_bf16", False, 32, 16, "stabilized", 3.0, 1e-2, "dP_P", True, [0, 2])
    assert ops.op_args(replace(knobs, o_fp32=True), 3)[-1] == [0, 1, 2]
    assert ops.op_stabilizers(knobs) == (False, False, 0)
    assert ops.op_stabilizers(replace(knobs, pbar_clamp=True, stochastic_round=True, sr_seed=9)) == (True, True, 9)
    assert ops.op_stabilizers(replace(knobs, sr_seed=9)) == (False, False, 0)  # the seed alone: one compiled call


@pytest.mark.parametrize("kw", [dict(recipe="paper_bf16", tiling=False, block_q=32, block_k=16, softmax="stabilized",
                                     beta=1.0001, eps=1e-2, delta="dP_P", pv_fp32=True, o_fp32_heads=[2, 0]),
                                dict(recipe="fp32", fp32_gemm="tf32x3", beta=0.1 + 0.2, eps=1 / 3),
                                dict(recipe="fa2", keep_fp32=["pbar"], round_bf16=["delta_prod"]),
                                dict(recipe="paper_bf16", pbar_clamp=True, stochastic_round=True, sr_seed=7),
                                dict(recipe="fa2", exp_form="exp2_folded")])
def test_op_spec_carries_every_knob_exactly(kw):
    """The ops' one string argument gives back op_args, the rounding bits and the GEMM mode, floats to the bit."""
    ops = _ops()
    knobs = AttentionKnobs(**kw)
    got = ops.parse_spec(ops.op_spec(knobs, 4))
    want = ops.op_args(knobs, 4)
    assert got[:9] == want[:9] and list(got[9]) == want[9]
    assert got[10:] == (ops.op_rounding(knobs), knobs.fp32_gemm, *ops.op_stabilizers(knobs), knobs.exp_form)
    assert got[5] == knobs.beta and got[6] == knobs.eps  # repr round-trips a float exactly
    with pytest.raises(ValueError, match=r"expected 16 ';'-separated fields"):
        ops.parse_spec("fa2;1;64")


def test_op_schemas_are_short():
    """torch dispatches a mutating custom op through a defaults fill-in whose cost grows with the square of the
    schema's length (a no-op op: 127 us a call at 18 arguments, 45 at 8, on a 2-core CPU): the knobs travel as one
    string."""
    _ops()
    assert len(torch.ops.flash_forensics.flash_fwd.default._schema.arguments) <= 9
    assert len(torch.ops.flash_forensics.flash_bwd.default._schema.arguments) <= 9


def test_train_compile_is_validated():
    from flash_forensics.orchestrator.config.schema import TrainConfig
    from flash_forensics.orchestrator.config.validate import check_train
    from flash_forensics.orchestrator.job.train import compile_enabled
    for ok in ("auto", "true", "false", "True", True, False):
        check_train(TrainConfig(compile=ok))
    with pytest.raises(ValueError, match=r"train\.compile='sometimes'.*auto, true, false, cudagraphs"):
        check_train(TrainConfig(compile="sometimes"))
    check_train(TrainConfig(compile="cudagraphs"))  # device auto: a GPU may run it (told at the job's start)
    with pytest.raises(ValueError, match=r"train\.compile='cudagraphs'.*train\.device=cpu"):
        check_train(TrainConfig(compile="cudagraphs", device="cpu"))
    assert compile_enabled("auto", torch.device("cuda")) and not compile_enabled("auto", torch.device("cpu"))
    assert compile_enabled("True", torch.device("cpu")) and not compile_enabled(False, torch.device("cuda"))
    assert not compile_enabled("auto", torch.device("cuda"), ["flash/triton/fa2", "flash/emulator/paper_bf16"])
    assert compile_enabled("auto", torch.device("cuda"), ["flash/triton/fa2", "sdpa/bf16/no-counters"])
    assert compile_enabled("cudagraphs", torch.device("cuda"))


def test_train_compile_casts_follow_what_the_compiler_traces():
    """auto: emulate_precision_casts on where a layer's attention is torch code inductor fuses (the emulator,
    impl=standard, a transformers family's too), off where every layer is one opaque kernel (Triton, SDPA); a bad
    value names the key; compile_model sets the setting either way (a job never inherits the last job's)."""
    import torch._inductor.config as inductor_config

    from flash_forensics.models.attention import route_name
    from flash_forensics.orchestrator.config.schema import TrainConfig
    from flash_forensics.orchestrator.config.validate import check_train
    from flash_forensics.orchestrator.job.train import compile_casts, compile_model
    emulator = route_name(AttentionKnobs(), "emulator")
    standard = route_name(AttentionKnobs(impl="standard"), "standard")
    triton, sdpa = route_name(AttentionKnobs(recipe="fa2"), "triton"), route_name(AttentionKnobs(impl="sdpa"), "sdpa")
    assert [compile_casts("auto", r) for r in ([triton], [sdpa], [triton, sdpa], [triton, emulator], [standard],
                                              ["llama:" + standard], [])] == [False, False, False, True, True, True,
                                                                              False]
    assert compile_casts("true", [triton]) and compile_casts(True, [sdpa]) and not compile_casts("False", [emulator])
    for ok in ("auto", "true", "false", True, False):
        check_train(TrainConfig(compile_casts=ok))
    with pytest.raises(ValueError, match=r"train\.compile_casts='eager'.*auto, true, false"):
        check_train(TrainConfig(compile_casts="eager"))
    before = inductor_config.emulate_precision_casts
    try:
        for casts in (True, False):
            compile_model(torch.nn.Linear(2, 2), None, casts)  # lazy: nothing compiles until a call
            assert inductor_config.emulate_precision_casts is casts
    finally:
        inductor_config.emulate_precision_casts = before


def test_train_compile_cudagraphs_mode_and_refusals():
    from flash_forensics.orchestrator.job.train import compile_mode
    cuda = torch.device("cuda", 0)
    assert compile_mode("cudagraphs", cuda) == "reduce-overhead"
    for setting in ("auto", "true", "True", True, False):
        assert compile_mode(setting, cuda) is None and compile_mode(setting, torch.device("cpu"), 4) is None
    with pytest.raises(ValueError, match=r"train\.compile='cudagraphs' is not allowed on device cpu"):
        compile_mode("cudagraphs", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"train\.compile='cudagraphs' is not allowed with 2 DDP ranks"):
        compile_mode("cudagraphs", cuda, world=2)


# ----------------------------------------------------------------------------------- CPU: interpreter (FP32 logic)
def _qkv(B=1, H=2, T=40, D=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    k[:, :, 1::3] = k[:, :, 0:T - 1:3][:, :, : k[:, :, 1::3].shape[2]]  # repeated keys: the counters fire
    return [(x * 2 if i == 0 else x).to(device=device, dtype=dtype).requires_grad_(True)
            for i, x in enumerate((q, k, v))]


# each stabilizer once and the counters both ways (not every pair: the interpreter's minutes count in CI)
@interp
@pytest.mark.parametrize("counters,stab", [(True, dict()), (False, dict(pbar_clamp=True)),
                                           (True, dict(stochastic_round=True, sr_seed=3))], ids=str)
def test_interpreter_opcheck(counters, stab):
    ops = _ops()
    q, k, v = (x.detach() for x in _qkv())
    rep, maxl, under, p1 = ((torch.zeros(2, dtype=torch.int64), torch.full((), float("-inf")),
                             torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)) if counters
                            else (None,) * 4)
    sr = dict(round_bf16=["pv_out", "acc"])  # what SR rounds
    torch.library.opcheck(ops.flash_fwd, (q, k, v, rep, maxl, under, p1, None,
                                          _spec("fp32", softmax="stabilized", **sr, **stab)))
    o, lse, ties = ops.flash_fwd(q, k, v, None, None, None, None, None, _spec("fp32", **sr, **stab))
    assert ties.numel() > 0 if stab.get("pbar_clamp") else ties.numel() == 0
    torch.library.opcheck(ops.flash_bwd, (torch.randn_like(o), q, k, v, o, lse, None, ties,
                                          _spec("fp32", delta="dP_P", **sr, **stab)))


def _fused_qkv(B=2, H=3, T=40, D=16, seed=0, grad=False):
    """q, k, v as a GPT's attention makes them: views of one (B, T, 3 * H * D) projection, (B, T, H, D)-ordered."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3 * H * D, generator=g).requires_grad_(grad)
    return [t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2)]


def test_fakes_give_outputs_and_gradients_in_the_inputs_memory_order():
    """What the compiled graph assumes: O and dQ/dK/dV (B, T, H, D)-ordered for a fused QKV's views (so the model's
    transposes back are views), contiguous (B, H, T, D) for contiguous inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = _ops()
    with FakeTensorMode() as mode:
        for fused in (True, False):
            q, k, v = (mode.from_tensor(x if fused else x.contiguous()) for x in _fused_qkv())
            o, lse, ties = ops._flash_fwd_fake(q, k, v, None, None, None, None, None, _spec("paper_bf16"))
            grads = ops._flash_bwd_fake(o, q, k, v, o, lse, None, ties, _spec("paper_bf16"))
            for t in (o, *grads):
                assert t.shape == q.shape
                assert t.transpose(1, 2).is_contiguous() == fused and t.is_contiguous() == (not fused)
            assert lse.is_contiguous()
        q, k, v = (mode.from_tensor(x) for x in _fused_qkv())
        _, _, dv = ops._flash_bwd_fake(o, q, k, v.contiguous(), o, lse, None, ties, _spec("paper_bf16"))
        assert dv.transpose(1, 2).is_contiguous()  # dK's order (a view's), not contiguous v's


@interp
@pytest.mark.parametrize("recipe", ["fp32"])  # the layout is the recipe's business nowhere; BF16 ones: the GPU test
def test_interpreter_fused_qkv_views_give_ordered_outputs_bit_for_bit(recipe):
    """The kernels write O and dQ/dK/dV in the inputs' (B, T, H, D) order, with the bits of contiguous inputs, and
    opcheck (fake vs real strides, autograd registration) passes on such views."""
    from flash_forensics.kernels.triton_flash import flash_attention_triton
    ops = _ops()
    knobs = AttentionKnobs(recipe=recipe, backend="triton", block_q=16, block_k=16)
    views = _fused_qkv(grad=True)
    dense = [x.detach().contiguous().requires_grad_(True) for x in views]
    g = torch.randn(dense[0].shape, generator=torch.Generator().manual_seed(3))
    o1, o2 = flash_attention_triton(*views, knobs), flash_attention_triton(*dense, knobs)
    g1, g2 = torch.autograd.grad(o1, views, g), torch.autograd.grad(o2, dense, g)  # the backward's own dQ, dK, dV
    assert o1.transpose(1, 2).is_contiguous() and o2.is_contiguous()
    assert all(t.transpose(1, 2).is_contiguous() for t in g1) and all(t.is_contiguous() for t in g2)
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    # mixed orders (k a view, v contiguous): one kernel writes dK and dV with one set of strides, so dV takes dK's
    # and k contiguous, v a view (qk_norm's model: RMSNorm gives a contiguous k, v stays the projection's view)
    for mixed in ([views[0], views[1], views[2].detach().contiguous().requires_grad_(True)],
                  [views[0], views[1].detach().contiguous().requires_grad_(True), views[2]]):
        g3 = torch.autograd.grad(flash_attention_triton(*mixed, knobs), mixed, g)
        assert all(torch.equal(a, b) for a, b in zip(g3, g2))
    q, k, v = (x.detach() for x in _fused_qkv(seed=5))
    torch.library.opcheck(ops.flash_fwd, (q, k, v, None, None, None, None, None, _spec(recipe)))
    o, lse, ties = ops.flash_fwd(q, k, v, None, None, None, None, None, _spec(recipe))
    torch.library.opcheck(ops.flash_bwd, (torch.randn_like(o), q, k, v, o, lse, None, ties, _spec(recipe)))


@interp
@pytest.mark.parametrize("case", [dict(), dict(softmax="stabilized"), dict(tiling=False, delta="recompute_fp32"),
                                  dict(pbar_clamp=True, delta="dP_P"), dict(softmax="stabilized_guarded"),
                                  dict(round_bf16=["pv_out", "acc"], stochastic_round=True, sr_seed=5)],
                         ids=["default", "stabilized", "untiled", "pbar_clamp", "sfa_guarded", "stoch_round"])
def test_interpreter_compiled_op_is_bitwise_eager(case):
    """fullgraph compile (AOTAutograd: forward and backward graphs) runs the same kernels: equal bits and counters."""
    import flash_forensics.kernels.emulator
    from flash_forensics.kernels.triton_flash import flash_attention_triton
    knobs = replace(AttentionKnobs(recipe="fp32", backend="triton", block_q=16, block_k=16), **case)
    q, k, v = _qkv(seed=1)
    g = torch.randn(q.shape)

    def f(q, k, v, stats):
        return flash_attention_triton(q, k, v, knobs, stats)

    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        stats = flash_forensics.kernels.stats.AttnStats(2)
        o = fn(q, k, v, stats)
        results.append((o, *torch.autograd.grad(o, (q, k, v), g), stats))
    (o1, *g1, s1), (o2, *g2, s2) = results
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert s1.repeated_max_rows.sum() > 0
    for name in ("repeated_max_rows", "rows_seen", "max_logit", "underflow_rows", "sfa_p1_rows"):
        assert torch.equal(getattr(s1, name), getattr(s2, name)), name


@interp
@pytest.mark.parametrize("attention", [dict(impl="flash", backend="triton", recipe="fp32", block_q=16, block_k=16),
                                       dict(impl="flash", backend="emulator", recipe="paper_bf16", block_q=16,
                                            block_k=16),
                                       dict(impl="sdpa"), dict(impl="standard")],
                         ids=["triton", "emulator", "sdpa", "standard"])
def test_interpreter_gpt_traces_without_graph_break(attention):
    from flash_forensics.models.gpt import GPT, ModelConfig
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64), AttentionConfig(**attention))
    x = torch.randint(0, 64, (2, 32))
    explained = torch._dynamo.explain(model)(x, x)
    assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]
    assert explained.graph_count == 1


# ------------------------------------------------------------------------------------------------------ GPU
GPU_CASES = [("fa2", dict(counters=False)), ("fa2", dict(softmax="stabilized")), ("paper_bf16", {}),
             ("paper_bf16", dict(o_fp32_heads=[1], delta="dP_P")), ("fp32", dict(tiling=False)),
             ("paper_bf16", dict(pbar_clamp=True)), ("paper_bf16", dict(softmax="stabilized_guarded")),
             ("paper_bf16", dict(stochastic_round=True, sr_seed=1)),
             ("fa2", dict(pbar_clamp=True, softmax="stabilized_guarded", delta="recompute_fp32"))]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,case", GPU_CASES, ids=[f"{r}-{c}" for r, c in GPU_CASES])
def test_gpu_compiled_op_is_bitwise_eager(recipe, case):
    """Under inductor (fullgraph) the attention op is opaque: O, dQ, dK, dV and the counters are bit-identical."""
    import flash_forensics.kernels.emulator
    from flash_forensics.kernels.triton_flash import flash_attention_triton
    knobs = replace(AttentionKnobs(recipe=recipe, backend="triton"), **case)
    dt = torch.float32 if recipe == "fp32" else torch.bfloat16
    q, k, v = _qkv(2, 4, 384, 64, dt, "cuda", seed=2)
    g = torch.randn(q.shape, device="cuda").to(dt)

    def f(q, k, v, stats):
        return flash_attention_triton(q * 1.0, k, v, knobs, stats)  # an op around it for inductor to compile

    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        stats = flash_forensics.kernels.stats.AttnStats(4, "cuda")
        o = fn(q, k, v, stats)
        results.append((o, *torch.autograd.grad(o, (q, k, v), g), stats))
    (o1, *g1, s1), (o2, *g2, s2) = results
    assert torch.equal(o1, o2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    for name in ("repeated_max_rows", "rows_seen", "max_logit", "underflow_rows", "sfa_p1_rows"):
        assert torch.equal(getattr(s1, name), getattr(s2, name)), name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fa2", "paper_bf16", "fp32"])
def test_gpu_fused_qkv_views_give_ordered_outputs_bit_for_bit(recipe):
    """On CUDA, BF16: a fused QKV's (B, T, H, D)-ordered views give O and dQ/dK/dV in that order, with the bits and
    counters of contiguous inputs, eager and compiled (the fake's strides are the kernels')."""
    import flash_forensics.kernels.emulator
    from flash_forensics.kernels.triton_flash import flash_attention_triton
    knobs = AttentionKnobs(recipe=recipe, backend="triton")
    dt = torch.float32 if recipe == "fp32" else torch.bfloat16
    B, H, T, D = 2, 4, 384, 64
    qkv = (torch.randn(B, T, 3 * H * D, device="cuda", generator=torch.Generator("cuda").manual_seed(4)) * 2).to(dt)
    g = torch.randn(B, H, T, D, device="cuda").to(dt)

    def f(q, k, v, stats):
        return flash_attention_triton(q * 1.0, k, v, knobs, stats)

    results = []
    # dense inputs, the fused views, mixed (v contiguous: dV must still come back right) and the views compiled
    for mode, fn in (("dense", f), ("fused", f), ("mixed", f), ("fused", torch.compile(f, fullgraph=True))):
        leaf = qkv.detach().clone().requires_grad_(True)
        views = [t.view(B, T, H, D).transpose(1, 2) for t in leaf.split(H * D, dim=2)]
        ins = {"dense": [x.contiguous() for x in views], "fused": views,
               "mixed": [views[0], views[1], views[2].contiguous()]}[mode]
        stats = flash_forensics.kernels.stats.AttnStats(H, "cuda")
        o = fn(*ins, stats)
        if fn is f:  # eager: the op sees the views as they are (compiled, `q * 1.0` is inductor's to lay out)
            assert o.transpose(1, 2).is_contiguous() == (mode != "dense"), (mode, o.stride())
        o.backward(g)
        results.append((o.detach(), leaf.grad, stats))
    (o0, g0, s0) = results[0]
    for o, grad, st in results[1:]:
        assert torch.equal(o, o0) and torch.equal(grad, g0)
        for name in ("repeated_max_rows", "rows_seen", "max_logit"):
            assert torch.equal(getattr(st, name), getattr(s0, name)), name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fa2", "paper_bf16"])
def test_gpu_compiled_gpt_trains_like_eager(recipe):
    """A whole GPT compiles with no graph break; 5 compiled steps track the eager ones to BF16 noise."""
    from flash_forensics.models.gpt import GPT, ModelConfig
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=256, block_size=256)
    att = AttentionConfig(impl="flash", backend="triton", recipe=recipe)
    x = torch.randint(0, 50257, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    idx, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    explained = torch._dynamo.explain(GPT(cfg, att).cuda())(idx, tgt)
    assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg, att).cuda()
        fwd = torch.compile(model, fullgraph=True) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        run = []
        for _ in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = fwd(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.append(loss.detach().float())
        losses.append(torch.stack(run))
        assert sum(s.rows_seen.sum() for s in model.attention_stats()) > 0  # the counters ran in both
    assert (losses[0] - losses[1]).abs().max().item() < 2e-2, losses


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fa2", "paper_bf16", "sdpa"])
def test_gpu_cuda_graphs_train_as_compiled_bit_for_bit(impl):
    """torch.compile(mode="reduce-overhead") (CUDA graphs replaying the step's launches) against the default mode:
    6 steps with the same losses and counters bit for bit (the same inductor kernels, replayed), and no graph
    skipped: the counters are static addresses the graphs add into (models/attention.py new_stats)."""
    from torch._dynamo.utils import counters

    from flash_forensics.models.gpt import GPT, ModelConfig
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=256, block_size=256)
    att = (AttentionConfig(impl="sdpa") if impl == "sdpa" else
           AttentionConfig(impl="flash", backend="triton", recipe=impl))
    x = torch.randint(0, 50257, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    idx, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    runs = []
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = GPT(cfg, att).cuda()
        fwd = torch.compile(model, mode=mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        losses = []
        for i in range(6):
            if mode:
                torch.compiler.cudagraph_mark_step_begin()
            model.probe = impl == "sdpa" and i % 3 == 2  # sdpa's max-logit pass on some steps: a second graph
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = fwd(idx, tgt)
            loss.backward()
            losses.append(loss.detach().clone())  # (a graph's output: the next replay overwrites it)
            opt.step()
            opt.zero_grad(set_to_none=True)
        stats = torch.cat([t.double().reshape(-1) for s in model.attention_stats() for t in s.tensors()])
        seen = sum(s.rows_seen.sum().item() for s in model.attention_stats())
        runs.append((torch.stack(losses), stats, dict(counters["inductor"]), seen))
    (l0, s0, _, _), (l1, s1, c1, seen) = runs
    assert c1.get("cudagraph_skips", 0) == 0, c1
    assert torch.equal(l0, l1), (l0, l1)
    assert torch.equal(s0, s1), (s0, s1)
    assert impl == "sdpa" or seen > 0  # the counters ran under the graphs


def _compiled_gpt(mode=None):
    from flash_forensics.models.gpt import GPT, ModelConfig
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=256, block_size=256),
                AttentionConfig(impl="flash", backend="triton", recipe="fa2")).cuda()
    return model, torch.compile(model, mode=mode), torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _repeated_tokens():
    g = torch.Generator("cuda").manual_seed(0)
    return [torch.randint(0, 25, (4, 257), device="cuda", generator=g) * 7 for _ in range(12)]  # 25 distinct ids


def _train_step(fwd, model, opt, micro, losses=None, graphs=False):
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    for x in micro:  # micro-batches, as train.grad_accum
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = fwd(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        (loss / len(micro)).backward()
        if losses is not None:
            losses.append(loss.detach().clone())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["plain", "deterministic_scope"])
def test_gpu_compiled_training_on_repeated_tokens_reproduces_its_bits(deterministic):
    """Text repeats its tokens. Inductor's own embedding backward adds them atomically: on an H100 (2026-12-07) two
    default-mode compiled runs of the same 6 steps differed in their losses. The GPT's embedding backward is aten's
    sorted kernel (models/embedding.py), so two runs, and a third on CUDA graphs, give the same losses and counters
    bit for bit, with or without the job's deterministic scope (train.deterministic)."""
    from flash_forensics.orchestrator.job.determinism import deterministic_algorithms
    data = _repeated_tokens()
    runs = []
    for mode in (None, None, "reduce-overhead"):
        model, fwd, opt = _compiled_gpt(mode)
        losses = []
        with deterministic_algorithms(deterministic):
            for step in range(6):
                _train_step(fwd, model, opt, data[2 * step:2 * step + 2], losses, graphs=mode is not None)
        stats = torch.cat([t.double().reshape(-1) for s in model.attention_stats() for t in s.tensors()])
        runs.append((torch.stack(losses), stats))
    (l0, s0), (l1, s1), (l2, s2) = runs
    assert torch.equal(l0, l1) and torch.equal(s0, s1), (l0 - l1)
    assert torch.equal(l0, l2) and torch.equal(s0, s2), (l0 - l2)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["plain", "deterministic_scope"])
def test_gpu_a_compiled_training_step_never_waits_for_the_gpu(deterministic):
    """Hot paths never sync the host: a compiled step (two micro-batches of repeated tokens, clip, fused AdamW)
    under torch's sync debug mode "error", once compiled and warm. Inside the deterministic scope inductor's embedding
    backward, had it one, would call aten's index_put_ (on an H100, 2026-12-07: 8-12 ms more host time a GPT-2S step
    in that scope)."""
    from flash_forensics.orchestrator.job.determinism import deterministic_algorithms
    data = _repeated_tokens()
    model, fwd, opt = _compiled_gpt()
    with deterministic_algorithms(deterministic):
        for step in range(2):
            _train_step(fwd, model, opt, data[2 * step:2 * step + 2])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _train_step(fwd, model, opt, data[4:6])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_launch_configs_keep_paper_bf16_bits():
    """Speed-only launch choices (tables, tuning) never change paper_bf16's result: its tiles are the knobs'."""
    from flash_forensics.kernels import triton_flash as tf
    knobs = AttentionKnobs(recipe="paper_bf16", backend="triton", softmax="stabilized")
    q, k, v = _qkv(2, 4, 512, 64, torch.bfloat16, "cuda", seed=3)
    g = torch.randn(q.shape, device="cuda").to(torch.bfloat16)
    results = []
    for fwd, bwd in [(None, None), ((128, 128, 8, 3), (32, 128, 128, 32, 4, 4))]:
        saved = dict(tf.SHAPE_TABLE)
        try:
            if fwd:  # keyed by the tile family, which SHAPE_TABLE's own paper_bf16_64x64 entries use
                fam = f"paper_bf16_{knobs.block_q}x{knobs.block_k}"
                tf.SHAPE_TABLE[("fwd", fam, 64, tf.length_class(512))] = fwd
                tf.SHAPE_TABLE[("bwd", fam, 64, tf.length_class(512))] = bwd
            o = tf.flash_attention_triton(q, k, v, knobs)
            results.append((tf.launch_config(knobs, 64, 512), o, *torch.autograd.grad(o, (q, k, v), g)))
        finally:
            tf.SHAPE_TABLE.clear()
            tf.SHAPE_TABLE.update(saved)
    (c1, *r1), (c2, *r2) = results
    assert c1 != c2
    assert c2["fwd"]["BLOCK_N"] == 64 and c2["bwd"]["dkdv"][0] == 64 and c2["bwd"]["dq"][1] == 64
    assert (c2["fwd"]["num_warps"], c2["bwd"]["num_stages"]) == (8, 4)  # both overrides launched
    assert all(torch.equal(a, b) for a, b in zip(r1, r2))
