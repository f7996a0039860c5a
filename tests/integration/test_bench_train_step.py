"""benchmarks/train_step.py on a CPU (a smoke check: its timings are not speeds; the GPU run is `scripts/gpu.sh
speed`): every variant built from the same weights and fed the same batches, timed round-robin with the order
rotated, the SDPA op that ran recorded, the JSON rewritten each round; the compiled-vs-eager comparison by hand."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import train_step as bench  # noqa: E402
from flash_forensics.kernels.config import AttentionConfig  # noqa: E402


def test_cpu_smoke_round_robin_same_batches_and_the_sdpa_op(tmp_path):
    out = tmp_path / "ts.json"
    doc = bench.main(["--device", "cpu", "--model", "tiny", "--shapes", "2x32", "--steps", "4", "--rounds", "2",
                      "--warmup", "1", "--variants", "sdpa,emulator_paper_bf16", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["partial"] is False and doc["errors"] == []
    assert doc["order_by_round"] == {"2x32": [["sdpa", "emulator_paper_bf16"], ["emulator_paper_bf16", "sdpa"]]}
    rows = {r["variant"]: r for r in doc["rows"]}
    # 1 warmup + 4 synced steps + 2 rounds of 6 streamed (the --stream-steps default): every step's loss is kept
    assert [(v, r["steps_timed"], r["stream_windows"], len(r["losses"])) for v, r in rows.items()] == [
        ("sdpa", 4, 2, 17), ("emulator_paper_bf16", 4, 2, 17)]  # fmt: skip
    for r in rows.values():
        assert r["stream_step_ms"] > 0 and r["stream_tokens_per_s"] == pytest.approx(2 * 32 / r["stream_step_ms"] * 1e3)
    assert rows["sdpa"]["sdpa_ops"] == ["flash"] and rows["emulator_paper_bf16"]["sdpa_ops"] == []
    for r in rows.values():  # the profiled step on a CPU: its top ops by self time, largest first
        top = r["profile"]["top"]
        assert r["profile"]["device"] == "cpu" and 0 < len(top) <= 10
        assert [t["ms"] for t in top] == sorted((t["ms"] for t in top), reverse=True) and top[0]["ms"] > 0
    assert all(0 < r["host_ms"] <= r["step_ms"] for r in rows.values())  # each step: enqueued <= done
    assert rows["emulator_paper_bf16"]["routes"] == ["flash/emulator/paper_bf16"]
    # the same initial weights and first batch: the first losses differ only by the attention's arithmetic
    assert rows["sdpa"]["losses"][0] == pytest.approx(rows["emulator_paper_bf16"]["losses"][0], abs=2e-2)
    assert rows["sdpa"]["losses"][0] != rows["sdpa"]["losses"][4]  # it trains: a later batch, a different loss
    assert set(doc["summary"]["B2_T32"]["tokens_per_s"]) == {"sdpa", "emulator_paper_bf16"}
    assert set(doc["summary"]["B2_T32"]["stream_tokens_per_s"]) == {"sdpa", "emulator_paper_bf16"}


def test_stream_steps_off_keeps_the_synced_steps_alone_and_a_bad_count_is_refused(tmp_path, capsys):
    doc = bench.main(["--device", "cpu", "--model", "tiny", "--shapes", "2x32", "--steps", "2", "--rounds", "2",
                      "--warmup", "1", "--stream-steps", "0", "--variants", "sdpa", "--out", str(tmp_path / "a.json")])
    (row,) = doc["rows"]
    assert (row["steps_timed"], row["stream_windows"], len(row["losses"])) == (2, 0, 3)
    assert row["stream_step_ms"] is None and "stream_tokens_per_s" not in doc["summary"]["B2_T32"]
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--stream-steps", "-1", "--out", str(tmp_path / "b.json")])
    assert "--stream-steps=-1 is not allowed: expected an integer >= 0" in capsys.readouterr().err


def test_stream_vs_sdpa_compile_by_hand():
    def row(v, tps, stream):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, stream_tokens_per_s=stream, losses=[1.0])
    s = bench.summarize([row("sdpa+compile", 100.0, 120.0), row("triton_fa2+compile", 90.0, 118.8),
                         row("sdpa", 50.0, None)])["B2_T8"]
    assert s["stream_tokens_per_s"] == {"sdpa+compile": 120.0, "triton_fa2+compile": 118.8}
    assert s["stream_vs_sdpa_compile"] == {"sdpa+compile": 1.0, "triton_fa2+compile": pytest.approx(0.99)}
    assert s["vs_sdpa_compile"]["triton_fa2+compile"] == pytest.approx(0.9)


def test_compiled_vs_eager_by_hand():
    def row(v, losses):
        return dict(variant=v, batch=2, T=8, tokens_per_s=100.0, losses=losses)
    s = bench.summarize([row("sdpa+compile", [3.0, 2.5, 2.25]), row("sdpa", [3.0, 2.5, 2.0]),
                         row("paper_1gpu", [3.0, 2.5]), row("paper_1gpu+compile", [3.0, 2.5, 9.0])])["B2_T8"]
    assert s["compiled_vs_eager"] == {
        "sdpa": dict(steps=3, bit_identical=False, first_diff_step=2, max_abs_loss_diff=0.25),
        "paper_1gpu": dict(steps=2, bit_identical=True, first_diff_step=None, max_abs_loss_diff=0.0)}
    assert s["vs_sdpa_compile"]["paper_1gpu"] == 1.0


def test_cudagraphs_vs_eager_is_keyed_apart_from_compile():
    def row(v, losses):
        return dict(variant=v, batch=2, T=8, tokens_per_s=100.0, losses=losses)
    s = bench.summarize([row("sdpa", [3.0, 2.5]), row("sdpa+compile", [3.0, 2.5]),
                         row("sdpa+cudagraphs", [3.0, 2.0])])["B2_T8"]["compiled_vs_eager"]
    assert s["sdpa"]["bit_identical"] is True
    assert s["sdpa+cudagraphs"] == dict(steps=2, bit_identical=False, first_diff_step=1, max_abs_loss_diff=0.5)


def test_ftz_vs_tl_exp_by_hand_and_its_scope():
    """ATTN+ftz: eager in exp_instruction("ex2_approx_ftz")'s scope; ftz_vs_tl_exp: its speed-up over ATTN and
    whether the losses kept every bit."""
    def row(v, tps, losses):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, losses=losses)
    s = bench.summarize([row("paper_1gpu", 100.0, [3.0, 2.5]), row("paper_1gpu+ftz", 110.0, [3.0, 2.5]),
                         row("triton_fa2", 100.0, [3.0, 2.5]), row("triton_fa2+ftz", 80.0, [3.0, 2.25])])["B2_T8"]
    assert s["ftz_vs_tl_exp"] == {"paper_1gpu": dict(speedup=1.1, bit_identical=True),
                                  "triton_fa2": dict(speedup=0.8, bit_identical=False)}
    assert bench.parse_variant("paper_1gpu+ftz") == ("paper_1gpu", "ftz")


def test_register_caps_vs_none_by_hand():
    """ATTN+ptxas: eager with no register caps; register_caps_vs_none: the default's speed-up over it and whether
    the losses kept every bit."""
    def row(v, tps, losses):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, losses=losses)
    s = bench.summarize([row("triton_paper_bf16", 110.0, [3.0, 2.5]), row("triton_paper_bf16+ptxas", 100.0, [3.0, 2.5]),
                         row("triton_fa2", 90.0, [3.0, 2.5]), row("triton_fa2+ptxas", 100.0, [3.0, 2.25]),
                         row("sdpa", 100.0, [3.0, 2.5])])["B2_T8"]
    assert s["register_caps_vs_none"] == {"triton_paper_bf16": dict(speedup=1.1, bit_identical=True),
                                          "triton_fa2": dict(speedup=0.9, bit_identical=False)}
    assert bench.parse_variant("triton_fa2+ptxas") == ("triton_fa2", "ptxas")


def test_counter_form_vs_old_by_hand():
    """ATTN+oldcounters: eager with the counters as before (counting, acq_rel atomics); counter_form_vs_old: the
    default's speed-up over it and whether the losses kept every bit."""
    def row(v, tps, losses):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, losses=losses)
    s = bench.summarize([row("triton_paper_bf16", 105.0, [3.0, 2.5]),
                         row("triton_paper_bf16+oldcounters", 100.0, [3.0, 2.5]),
                         row("triton_fa2", 100.0, [3.0, 2.5]), row("triton_fa2+oldcounters", 125.0, [3.0, 2.75]),
                         row("sdpa", 100.0, [3.0, 2.5])])["B2_T8"]
    assert s["counter_form_vs_old"] == {"triton_paper_bf16": dict(speedup=1.05, bit_identical=True),
                                        "triton_fa2": dict(speedup=0.8, bit_identical=False)}
    assert bench.parse_variant("triton_fa2+oldcounters") == ("triton_fa2", "oldcounters")


def test_stream_cast_is_the_old_c_proj_input_and_keeps_the_bits(tmp_path):
    """ATTN+streamcast: eager with O cast to the FP32 stream before c_proj (as before _c_proj_input); on a CPU under
    BF16 autocast its losses equal the default's bit for bit (c_proj_input_vs_stream_cast), and the scope restores
    models/gpt.py's function."""
    from flash_forensics.models import gpt
    default = gpt._c_proj_input
    y, x = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(2, 3)
    with bench.stream_cast(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert gpt._c_proj_input(y, x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gpt._c_proj_input is default and gpt._c_proj_input(y, x).dtype == torch.bfloat16
    doc = bench.main(["--device", "cpu", "--model", "tiny", "--shapes", "2x32", "--steps", "2", "--rounds", "1",
                      "--warmup", "1", "--variants", "sdpa,sdpa+streamcast", "--out", str(tmp_path / "ts.json")])
    got = doc["summary"]["B2_T32"]["c_proj_input_vs_stream_cast"]
    assert list(got) == ["sdpa"] and got["sdpa"]["bit_identical"] is True


def test_bf16_accumulators_vs_fp32_by_hand():
    def row(v, tps, losses):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, losses=losses)
    s = bench.summarize([row("paper_1gpu", 110.0, [3.0, 2.5]), row("paper_1gpu+acc32", 100.0, [3.0, 2.5])])["B2_T8"]
    assert s["bf16_accumulators_vs_fp32"] == {"paper_1gpu": dict(speedup=1.1, bit_identical=True)}
    assert bench.parse_variant("paper_1gpu+acc32") == ("paper_1gpu", "acc32")


def test_score_gemm_ahead_vs_inline_by_hand_and_its_scope():
    """ATTN+ahead: eager with each key tile's QK^T issued a tile ahead (score_gemm_form("ahead")); its speed-up over
    ATTN and whether the losses kept every bit; the row's launches in the form's scope, the default after."""
    from flash_forensics.kernels import triton_launch
    def row(v, tps, losses):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, losses=losses)
    s = bench.summarize([row("triton_fa2", 100.0, [3.0, 2.5]), row("triton_fa2+ahead", 108.0, [3.0, 2.5]),
                         row("triton_paper_bf16", 100.0, [3.0, 2.5]),
                         row("triton_paper_bf16+ahead", 95.0, [3.0, 2.25])])["B2_T8"]
    assert s["score_gemm_ahead_vs_inline"] == {"triton_fa2": dict(speedup=1.08, bit_identical=True),
                                               "triton_paper_bf16": dict(speedup=0.95, bit_identical=False)}
    assert bench.parse_variant("triton_fa2+ahead") == ("triton_fa2", "ahead")
    v = bench.Variant("triton_fa2+ahead", "tiny", 32, torch.device("cpu"))
    with v.launch_scope():
        assert triton_launch._qk_ahead == [True]
    assert triton_launch._qk_ahead == [False]


def test_a_register_cap_mode_by_hand_its_scope_and_a_bad_one():
    """ATTN+regs.KERNEL=N: eager with that kernel's registers capped (register_limit); register_cap_vs_default: each
    cap's speed-up over ATTN and whether the losses kept every bit. A cap register_limit refuses is refused here,
    naming --variants and the mode, before anything is built."""
    def row(v, tps, losses):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, losses=losses)
    s = bench.summarize([row("paper_1gpu", 100.0, [3.0, 2.5]), row("paper_1gpu+regs.fwd=168", 104.0, [3.0, 2.5]),
                         row("paper_1gpu+regs.dq=none", 95.0, [3.0, 2.25]), row("paper_1gpu+acc32", 90.0, [3.0, 2.5])])
    got = s["B2_T8"]["register_cap_vs_default"]
    assert got == {"regs.dq=none": {"paper_1gpu": dict(speedup=0.95, bit_identical=False)},
                   "regs.fwd=168": {"paper_1gpu": dict(speedup=1.04, bit_identical=True)}}
    assert bench.parse_variant("paper_1gpu+regs.fwd=168") == ("paper_1gpu", "regs.fwd=168")
    assert bench.register_caps("regs.dkdv=none") == {"dkdv": None}
    from flash_forensics.kernels import triton_launch as tl_
    with bench.register_limit_scope("regs.fwd=168")():
        assert tl_._maxnreg == {"fwd": 168}
    assert tl_._maxnreg == {}
    for bad, says in (("paper_1gpu+regs.fwd=999", "fwd=999"), ("paper_1gpu+regs.bwd=128", "'bwd'"),
                      ("paper_1gpu+regs.fwd=12", "fwd=12"), ("paper_1gpu+regs.fwd", "regs.KERNEL=N")):
        with pytest.raises(ValueError, match="--variants") as e:
            bench.parse_variant(bad)
        assert says in str(e.value), str(e.value)


def test_fp32_reference_vs_baseline_by_hand():
    """fp32_reference_vs_baseline: the preset's FP32 reference forks' tokens/s as a fraction of its BF16 baseline's,
    only where both ran; each variant builds the fork's attention (recipe fp32, 128x128 tiles, its GEMM mode)."""
    def row(v, tps):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, losses=[3.0])
    s = bench.summarize([row("paper_1gpu", 200.0), row("paper_1gpu_fp32", 124.0), row("paper_1gpu_fp32_ieee", 20.0),
                         row("triton_fa2", 300.0)])["B2_T8"]
    assert s["fp32_reference_vs_baseline"] == {"paper_1gpu_fp32": 0.62, "paper_1gpu_fp32_ieee": 0.1}
    assert bench.summarize([row("paper_1gpu_fp32", 124.0)])["B2_T8"]["fp32_reference_vs_baseline"] == {}
    for v, gemm in (("paper_1gpu_fp32", "tf32x3"), ("paper_1gpu_fp32_ieee", "ieee")):
        cfg = AttentionConfig(**bench.ATTN[v])
        assert (cfg.recipe, cfg.fp32_gemm, cfg.block_q, cfg.block_k) == ("fp32", gemm, 128, 128)
        assert bench.parse_variant(v) == (v, None)


class _Ev:  # a profiler kernel event: name and time_range (us)
    def __init__(self, name, a, b):
        self.name, self.time_range = name, type("R", (), dict(start=a, end=b))()


def test_kernel_breakdown_busy_span_attention_and_top():
    evs = [_Ev("ampere_bf16_gemm", 0, 100), _Ev("_fwd_kernel", 50, 150),  # overlapping: busy 0-150
           _Ev("_bwd_dq_kernel", 300, 400), _Ev("triton_poi_fused_add", 400, 410),
           _Ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 500, 520)]
    b = bench.kernel_breakdown(evs, top=2)
    assert b["kernels"] == 5 and b["kernels_ms"] == pytest.approx(0.33)
    assert b["busy_ms"] == pytest.approx(0.28) and b["span_ms"] == pytest.approx(0.52)
    assert b["busy_fraction"] == pytest.approx(0.28 / 0.52)
    assert b["attention_ms"] == pytest.approx(0.22)  # fwd, dq and cuDNN's sdpa; not the GEMM nor the add
    assert [t["name"] for t in b["top"]] == ["ampere_bf16_gemm", "_fwd_kernel"]
    assert bench.kernel_breakdown([])["busy_fraction"] is None


def test_a_bad_variant_stops_before_anything_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--variants", "sdpa,sdpa+compil", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert "'sdpa+compil' is not allowed" in err and "cudagraphs" in err
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):  # CUDA graphs on a CPU: refused, not silently an ordinary compile
        bench.main(["--device", "cpu", "--variants", "sdpa+cudagraphs", "--out", str(tmp_path / "x.json")])
    assert "CUDA graphs need --device cuda" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.fixture
def dynamo_eager(monkeypatch):
    """torch.compile through dynamo only (backend eager: no C++ build on a CPU), its caches and limits restored."""
    import torch._dynamo
    import torch._dynamo.config as dc
    monkeypatch.setattr(bench, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(dc, "recompile_limit", dc.recompile_limit)  # restored after the test
    monkeypatch.setattr(dc, "accumulated_recompile_limit", dc.accumulated_recompile_limit)
    torch._dynamo.reset()
    yield dc
    torch._dynamo.reset()


def _compiled_pair(tmp_path):
    return bench.main(["--device", "cpu", "--model", "tiny", "--shapes", "2x16", "--steps", "2", "--rounds", "1",
                       "--warmup", "1", "--variants", "sdpa+compile,emulator_paper_bf16+compile",
                       "--out", str(tmp_path / "ts.json")])


def test_a_compiled_variant_that_ran_eager_is_an_error_not_a_row(tmp_path, monkeypatch, dynamo_eager):
    # the 2026-12-06 H100 run: the recompile limit of GPT.forward, shared by every variant, reached by the earlier
    # ones; the next "compiled" variant ran eager and its row said compiled. Here the limit is 1 and not raised
    dynamo_eager.recompile_limit = 1
    monkeypatch.setattr(bench, "raise_recompile_limit", lambda n: dynamo_eager.recompile_limit)
    doc = _compiled_pair(tmp_path)
    assert [r["variant"] for r in doc["rows"]] == ["sdpa+compile"]
    (err,) = doc["errors"]
    assert err["variant"] == "emulator_paper_bf16+compile"
    assert "compiled no graph" in err["error"] and "recompile limit 1" in err["error"]
    assert err["where"].startswith("benchmarks/train_step.py:") and " in step" in err["where"], err["where"]


def test_where_names_the_innermost_frames_of_an_empty_assert():
    def inner():
        assert False  # noqa: B011  (an empty AssertionError, as torch's cudagraph trees raised on 2026-12-06)

    try:
        inner()
    except AssertionError as e:
        got = bench.where(e)
    first, second = got.split(" <- ")[:2]
    assert first.startswith("tests/integration/test_bench_train_step.py:") and first.endswith(" in inner"), got
    assert second.endswith(" in test_where_names_the_innermost_frames_of_an_empty_assert"), got


def test_the_recompile_limit_grows_with_the_compiled_variants(tmp_path, dynamo_eager):
    dynamo_eager.recompile_limit = 1  # as above, but the benchmark raises it: both variants compile
    doc = _compiled_pair(tmp_path)
    assert doc["errors"] == []
    assert [r["variant"] for r in doc["rows"]] == ["sdpa+compile", "emulator_paper_bf16+compile"]
    assert dynamo_eager.recompile_limit == 2 * bench.RECOMPILES_PER_VARIANT
    assert all(r["compiled"] for r in doc["rows"])


def test_sdpa_backend_from_the_kernels_that_ran_as_an_h100_recorded_them():
    """Under CUDA graphs the profiler sees the replayed kernels, not the aten SDPA op: the backend is read from the
    kernels' names. Names from a real H100 run (results/bench/gpu-h100-2026-12-07/attention.json)."""
    doc = json.loads((ROOT / "results/bench/gpu-h100-2026-12-07/attention.json").read_text())
    want = {"sdpa_cudnn": ["cudnn"], "sdpa_flash": ["flash"], "sdpa_efficient": ["efficient"], "triton_fa2": [],
            "triton_paper_bf16": []}
    got = {r["method"]: bench.sdpa_backends_of({k["name"] for k in r["kernels"]})
           for r in doc["rows"] if r["shape"] == "gpt2s_T1024" and r["method"] in want}
    assert got == want


def test_attention_kernels_are_every_kernel_an_attention_call_ran_on_an_h100():
    """ATTN_KERNELS (a training row's attention_ms) names every kernel that one attention fwd+bwd ran on an H100,
    cuDNN's delta and dQ conversion included (missed before 2026-12-07), and none of the copies and memsets."""
    doc = json.loads((ROOT / "results/bench/gpu-h100-2026-12-07/attention.json").read_text())
    rows = [r for r in doc["rows"] if r["shape"] == "gpt2s_T1024" and r["method"] in (
        "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "triton_fa2", "triton_fa2_counters", "triton_paper_bf16")]
    assert len(rows) == 6
    for r in rows:
        for k in r["kernels"]:
            helper = k["name"].startswith("Memset") or "at::native::" in k["name"]
            assert bool(bench.ATTN_KERNELS.search(k["name"])) is not helper, (r["method"], k["name"][:90])


def test_the_casts_modes_force_the_setting_and_its_cost_is_summarized():
    assert bench.parse_variant("sdpa+compilecasts") == ("sdpa", "compilecasts")
    assert bench.parse_variant("triton_fa2+compilenocasts") == ("triton_fa2", "compilenocasts")

    def row(v, tps, casts):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, compiled="+" in v, emulate_precision_casts=casts,
                    losses=[1.0])
    s = bench.summarize([row("sdpa+compile", 100.0, False), row("sdpa+compilecasts", 80.0, True),
                         row("triton_fa2+compile", 90.0, True), row("triton_fa2+compilenocasts", 99.0, False),
                         row("triton_paper_bf16+compile", 70.0, True), row("sdpa", 50.0, None)])["B2_T8"]
    assert s["casts_cost"] == {"sdpa": pytest.approx(1.25), "triton_fa2": pytest.approx(1.1)}


@pytest.mark.parametrize("name,emulate,det", [("sdpa+compile", False, False), ("sdpa+compilecasts", True, False),
                                              ("sdpa+compiledet", False, True),
                                              ("emulator_paper_bf16+compile", True, False),
                                              ("emulator_paper_bf16+compilenocasts", False, False),
                                              ("emulator_paper_bf16+compiledet", True, True),
                                              ("emulator_paper_bf16+compilenondet", True, False),
                                              ("sdpa", False, False), ("emulator_paper_bf16", False, False)])
def test_a_variant_compiles_with_the_casts_and_determinism_its_mode_says(name, emulate, det):
    v = bench.Variant(name, "tiny", 16, torch.device("cpu"))
    assert v.emulate is emulate and v.compiled is ("+" in name) and v.deterministic is det
    with v.det_scope():
        assert torch.are_deterministic_algorithms_enabled() is det
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_determinism_cost_is_summarized_per_attention():
    def row(v, tps, det):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, compiled="+" in v, deterministic=det, losses=[1.0])
    s = bench.summarize([row("sdpa+compile", 100.0, False), row("sdpa+compiledet", 98.0, True),
                         row("triton_fa2+compile", 90.0, True), row("triton_fa2+compilenondet", 91.8, False),
                         row("triton_paper_bf16+compilenondet", 70.0, False)])["B2_T8"]
    assert s["determinism_cost"] == {"sdpa": pytest.approx(100 / 98), "triton_fa2": pytest.approx(1.02)}


@pytest.mark.parametrize("name,sorted_grad", [("sdpa+compile", False), ("sdpa+compilesorted", True),
                                              ("sdpa+compiledet", False), ("sdpa", False),
                                              ("emulator_paper_bf16+compilenondet", True),
                                              ("emulator_paper_bf16+compilescatter", False),
                                              ("emulator_paper_bf16+compile", True), ("emulator_paper_bf16", False)])
def test_compiled_variants_but_the_reference_take_the_sorted_embedding_backward(name, sorted_grad):
    v = bench.Variant(name, "tiny", 16, torch.device("cpu"))
    assert v.model.sorted_embedding_grad is sorted_grad
    assert v.row(2, 16, 0)["sorted_embedding_grad"] is sorted_grad


def test_a_setting_costs_pair_rows_that_differ_in_that_setting_only():
    def row(v, tps, det, sort):
        return dict(variant=v, batch=2, T=8, tokens_per_s=tps, compiled=True, deterministic=det,
                    sorted_embedding_grad=sort, emulate_precision_casts=False, losses=[1.0])
    s = bench.summarize([row("sdpa+compile", 100.0, False, False), row("sdpa+compilesorted", 99.0, False, True),
                         row("triton_fa2+compilenondet", 90.0, False, True),
                         row("triton_fa2+compile", 80.0, True, True), row("triton_fa2+compiledet", 70.0, True, False)])
    s = s["B2_T8"]
    assert s["sorted_embedding_cost"] == {"sdpa": pytest.approx(100 / 99), "triton_fa2": pytest.approx(70 / 80)}
    assert s["determinism_cost"] == {"triton_fa2": pytest.approx(90 / 80)}  # not 90 / 70: its embedding differs


def test_a_casts_mode_compiles_its_own_graph_beside_its_twin(tmp_path, dynamo_eager):
    """sdpa+compilecasts differs from sdpa+compile only in inductor's config, which dynamo does not guard on: compiled
    as the module, it replayed its twin's graph (the 2026-12-07 H100 run refused it: no graph in its first step).
    Its own code object (fresh_entry) compiles its own."""
    doc = bench.main(["--device", "cpu", "--model", "tiny", "--shapes", "2x16", "--steps", "2", "--rounds", "1",
                      "--warmup", "1", "--stream-steps", "0", "--out", str(tmp_path / "ts.json"), "--variants",
                      "sdpa+compile,sdpa+compilecasts,emulator_paper_bf16+compile,emulator_paper_bf16+compilenocasts"])
    assert doc["errors"] == []
    rows = {r["variant"]: r for r in doc["rows"]}
    assert [rows[v]["emulate_precision_casts"] for v in rows] == [False, True, True, False]
    assert rows["sdpa+compile"]["losses"] == rows["sdpa+compilecasts"]["losses"]  # dynamo alone: the same step
    assert set(doc["summary"]["B2_T16"]["casts_cost"]) == {"sdpa", "emulator_paper_bf16"}
    f = bench.fresh_entry(lambda a, b: a - b, "x+y")
    assert f.__code__.co_name == "entry_x_y" and f(5, 3) == 2
    assert f.__code__ is not bench.fresh_entry(lambda a, b: a, "x+y").__code__


def test_host_syncs_are_the_sync_warnings_and_not_the_modes_notice():
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
                      "operations", stacklevel=1)
        warnings.warn(bench.SYNC_WARNING, stacklevel=1)
    assert len(caught) == 2
    assert bench.sync_sites(caught) == [f"{os.path.relpath(caught[1].filename, bench.ROOT)}:{caught[1].lineno}"]
