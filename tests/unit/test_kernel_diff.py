"""scripts/kernel_diff.py: two train_step variants' kernels matched by name (Inductor's index dropped), per family."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kd():
    spec = importlib.util.spec_from_file_location("kernel_diff", ROOT / "scripts" / "kernel_diff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(variant, kernels, kernels_ms=None, step_ms=10.0):
    top = [dict(name=n, ms=ms, calls=c) for n, ms, c in kernels]
    listed = sum(ms for _, ms, _ in kernels)
    return dict(variant=variant, step_ms=step_ms, profile=dict(
        device="cuda", kernels=sum(c for *_, c in kernels), kernels_ms=listed if kernels_ms is None else kernels_ms,
        busy_ms=listed, top=top))


def _run(*rows):
    return dict(command="python benchmarks/train_step.py", gpu="test", rows=list(rows))


def test_inductor_kernels_match_across_their_index_and_families_add_up(kd):
    a = _row("sdpa+compile", [("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_x", 2.7, 12),
                              ("triton_per_fused_native_layer_norm_backward_5", 1.4, 23),
                              ("nvjet_sm90_tst_256x128", 3.8, 37),
                              ("void at::native::multi_tensor_apply_kernel<Adam>", 1.3, 7)])
    b = _row("triton_fa2+compile", [("_fwd_kernel", 1.4, 12), ("_bwd_dkdv_kernel", 1.9, 12),
                                    ("triton_per_fused_native_layer_norm_backward_7", 1.7, 23),
                                    ("nvjet_sm90_tst_256x128", 3.8, 37),
                                    ("void at::native::multi_tensor_apply_kernel<Adam>", 1.3, 7)], step_ms=11.0)
    d = kd.diff(_run(a, b), "sdpa+compile", "triton_fa2+compile")
    assert d["complete"] is True
    fam = {f["family"]: f for f in d["families"]}
    assert set(fam) == {"attention", "inductor", "gemm", "optimizer"}
    assert fam["attention"]["delta_ms"] == pytest.approx(1.4 + 1.9 - 2.7)
    assert fam["inductor"]["delta_ms"] == pytest.approx(0.3)  # _5 and _7: one kernel, matched
    assert fam["gemm"]["delta_ms"] == pytest.approx(0.0) and fam["optimizer"]["delta_ms"] == pytest.approx(0.0)
    ln = next(k for k in d["kernels"] if k["name"] == "triton_per_fused_native_layer_norm_backward")
    assert (ln["a_calls"], ln["b_calls"]) == (23, 23)
    assert [k["name"] for k in d["kernels"][:1]] == ["cudnn_generated_fort_native_sdpa_sm90_flash_bprop_x"]
    text = kd.render(d, top=3)
    assert "B - A: step +1.000 ms" in text and "not listed" not in text


def test_a_top_n_profile_says_what_it_left_out(kd):
    a = _row("sdpa", [("nvjet_a", 3.0, 1)], kernels_ms=10.0)
    b = _row("triton_fa2", [("nvjet_a", 3.0, 1), ("_fwd_kernel", 2.0, 12)], kernels_ms=11.0)
    d = kd.diff(_run(a, b), "sdpa", "triton_fa2")
    assert d["complete"] is False
    rest = d["families"][-1]
    assert rest["family"] == "not listed" and (rest["a_ms"], rest["b_ms"]) == pytest.approx((7.0, 6.0))
    assert "listed only the longest kernels" in kd.render(d, top=5)


def test_a_missing_variant_or_a_cpu_profile_is_named(kd, tmp_path, capsys):
    run = _run(_row("sdpa", [("nvjet_a", 1.0, 1)]), dict(variant="cpu_one", step_ms=1.0,
                                                           profile=dict(device="cpu", top=[])))
    with pytest.raises(ValueError, match="variant 'nope' is not in this run: it has sdpa, cpu_one"):
        kd.diff(run, "sdpa", "nope")
    with pytest.raises(ValueError, match="'cpu_one' has no GPU kernel profile"):
        kd.diff(run, "sdpa", "cpu_one")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert kd.main([str(path), "sdpa", "nope"]) == 2
    assert "kernel_diff: variant 'nope'" in capsys.readouterr().err


def test_the_cli_writes_its_comparison(kd, tmp_path, capsys):
    run = _run(_row("a", [("_fwd_kernel", 1.0, 1)]), _row("b", [("_fwd_kernel", 1.5, 1)]))
    src, out = tmp_path / "run.json", tmp_path / "diff.json"
    src.write_text(json.dumps(run))
    assert kd.main([str(src), "a", "b", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["kernels"][0]["delta_ms"] == pytest.approx(0.5) and got["families"][0]["family"] == "attention"
    assert "+0.500" in capsys.readouterr().out
