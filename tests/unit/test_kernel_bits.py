"""scripts/kernel_bits.py's compare on hand-made records: which outputs differ and by how much, missing and changed
cases, unreadable files (record itself runs the kernels: tests/integration/test_gpu_sh_patch_tests.py on the CPU
interpreter, `gpu.sh patch-tests` on the GPU)."""
import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kernel_bits", ROOT / "scripts" / "kernel_bits.py")
kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb)


def _doc(outs):
    return dict(env=dict(gpu="cpu", torch=torch.__version__, triton=None, commit="x"), cases={
        name: dict(knobs=dict(recipe="fa2"), shape=[1, 2, 8, 16], layout="bhtd",
                   outputs={n: dict(sha256=kb._digest(t), dtype=str(t.dtype), shape=list(t.shape))
                            for n, t in o.items()}) for name, o in outs.items()})


def _write(tmp_path, name, outs, doc=None):
    (tmp_path / f"{name}.json").write_text(json.dumps(doc or _doc(outs)))
    torch.save(outs, tmp_path / f"{name}.pt")
    return str(tmp_path / f"{name}.json"), str(tmp_path / f"{name}.pt")


def _outs(seed):
    g = torch.Generator().manual_seed(seed)
    return {"o": torch.randn(1, 2, 8, 16, generator=g).bfloat16(), "max_logit": torch.tensor(3.5)}


def test_identical_records_pass_and_one_changed_element_is_named_with_its_size(tmp_path, capsys):
    a = {"c1": _outs(0), "c2": _outs(1)}
    a["c2"]["o"][0, 1, 3, 5] = 1.0
    b = copy.deepcopy(a)
    ja, pa = _write(tmp_path, "a", a)
    jb, pb = _write(tmp_path, "b", b)
    assert kb.compare(ja, jb, (pa, pb)) == 0
    assert "2 of 2 cases identical" in capsys.readouterr().out
    b["c2"]["o"][0, 1, 3, 5] = 1.5
    jb, pb = _write(tmp_path, "b", b)
    assert kb.compare(ja, jb, (pa, pb)) == 1
    out = capsys.readouterr().out
    assert "c1: identical" in out
    assert "c2: DIFFERENT: o (1 of 256 elements differ, largest |diff| 0.5" in out and "1 of 2 cases identical" in out
    assert kb.compare(ja, jb) == 1 and "o (differs)" in capsys.readouterr().out  # hashes only: that it differs


def test_a_zero_dim_counter_and_a_nan_in_the_same_place_are_equal_bits(tmp_path):
    o = _outs(0)
    o["o"][0, 0, 0, 0] = float("nan")
    ja, pa = _write(tmp_path, "a", {"c": o})
    jb, pb = _write(tmp_path, "b", {"c": copy.deepcopy(o)})
    assert kb.compare(ja, jb, (pa, pb)) == 0


def test_missing_and_changed_cases_fail_and_extra_ones_are_listed(tmp_path, capsys):
    ja, _ = _write(tmp_path, "a", {"c1": _outs(0), "c2": _outs(1)})
    doc = _doc({"c1": _outs(0), "c3": _outs(2)})
    jb, _ = _write(tmp_path, "b", {}, doc)
    assert kb.compare(ja, jb) == 1
    out = capsys.readouterr().out
    assert "c2: MISSING in B" in out and "only in B (not compared): c3" in out
    doc = _doc({"c1": _outs(0), "c2": _outs(1)})
    doc["cases"]["c2"]["knobs"] = dict(recipe="paper_bf16")
    jb, _ = _write(tmp_path, "b", {}, doc)
    assert kb.compare(ja, jb) == 1 and "c2: NOT THE SAME CASE" in capsys.readouterr().out


@pytest.mark.parametrize("text,says", [(None, "no such file"), ("{not json", "not JSON"), ("[1, 2]", "no 'cases'")])
def test_unreadable_records_are_refused_in_one_sentence(tmp_path, text, says):
    ja, _ = _write(tmp_path, "a", {"c": _outs(0)})
    bad = tmp_path / "bad.json"
    if text is not None:
        bad.write_text(text)
    with pytest.raises(SystemExit, match=says):
        kb.compare(ja, str(bad))


def test_the_cases_run_only_knobs_the_kernels_have_and_validate():
    from flash_forensics.kernels.config import AttentionKnobs
    for table in kb.CASES.values():
        names = [c[0] for c in table]
        assert len(set(names)) == len(names)
        for name, kw, shape, layout, *scale in table:
            AttentionKnobs(impl="flash", backend="triton", **kw).validate(shape[1])
            assert layout in ("bhtd", "bthd", "keypad"), name
            assert scale in ([], [24.0]), name


def test_the_large_logit_cases_reach_fp32_denormals_in_p():
    """The input-scale-24 cases: some P = exp(s - max) fall in FP32's denormals (s - max in (-103.3, -87.3)), where
    an exp that flushes denormals to zero would differ, and the rest of their scores are spread over thousands."""
    import torch
    scaled = [c for c in kb.FULL if len(c) == 5]
    assert {c[0] for c in scaled} == {"paper_1gpu_large_logits", "fa2_large_logits"}
    for name, _kw, shape, layout, scale in scaled:
        q, k, _, _, _ = kb._inputs(shape, layout, torch.bfloat16, "cpu", 0, scale)
        s = (q.double() @ k.double().transpose(-1, -2)) / shape[3] ** 0.5
        T = shape[2]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        x = s - s.amax(-1, keepdim=True)
        in_band = int(((x > -103.28) & (x < -87.34)).sum())
        assert in_band >= 100, (name, in_band)
        assert float(s.amax()) > 1000, name
