"""The offline analysis: the probes' math reused (same numbers as kernels.probes on the same tensors), heads chosen
by tie rows or named, the attribution naming the rounding point behind a delta bias, and the three reports."""
import json

import pytest
import torch

from flash_forensics.capture import analysis as A
from flash_forensics.capture.cli import main
from flash_forensics.capture.recorder import write_call
from flash_forensics.capture.synthetic import tied_inputs
from flash_forensics.kernels import probes as P
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import reference_attention


def _capture(tmp_path, recipe="fa2", B=4, H=2, T=128, D=64, gain=4.0, with_x=False, **kw):
    q, k, v, do = tied_inputs(B, H, T, D, seed=0, gain=gain)
    kn = AttentionKnobs(recipe=recipe)
    o, lse, *_ = reference_attention(q, k, v, kn)
    extra = {}
    if with_x:
        g = torch.Generator().manual_seed(5)
        extra = {"x": torch.randn(B, T, 32, generator=g).bfloat16(),
                 "w_q": torch.randn(H, D, 32, generator=g)}
    return write_call(tmp_path / f"{recipe}.safetensors", q, k, v, o, do, lse, recipe=recipe,
                      knobs=kn.knob_values(), family="test", layer=0, **extra, **kw), (q, k, v, o, do, kn)


def test_per_head_numbers_are_the_probes_numbers(tmp_path):
    path, (q, k, v, o, do, kn) = _capture(tmp_path, B=2, T=64, with_x=True)
    res = A.analyze(path, heads=[1], fingerprint=False, attribute=False, progress=False)
    (row,) = res["per_head"]
    sl = slice(1, 2)
    x = A.snap_io.read(path).x
    w_q = A.snap_io.read(path).w_q[sl]
    dq_lp = A.emulator.backward(q[:, sl], k[:, sl], v[:, sl], o[:, sl], A.emulator.forward(
        q[:, sl], k[:, sl], v[:, sl], kn)[2], do[:, sl], kn)[0]
    ref = P.layer_probe(x, q[:, sl], k[:, sl], v[:, sl], o[:, sl], do[:, sl], dq_lp, w_q, kn, flash=True)
    assert row["delta"]["mean"] == pytest.approx(float(ref["delta_err_mean"]), rel=1e-12)
    assert row["delta"]["t"] == pytest.approx(float(ref["delta_err_t"]), rel=1e-9)
    assert row["tie_exact"] == int(ref["tie_rows_exact"]) and row["tie_bf16"] == int(ref["tie_rows_bf16"])
    assert row["wq_err_proj"] == pytest.approx(float(ref["wq_err_proj"][0]), rel=1e-9)


def test_heads_are_the_worst_by_ties_unless_named(tmp_path, capsys):
    path, (q, k, *_ ) = _capture(tmp_path, H=4, B=2, T=64)
    tie = P.tie_rows(q, k, AttentionKnobs(recipe="fa2"))[0].sum(dim=(0, 2)).tolist()
    res = A.analyze(path, top=2, fingerprint=False, attribute=False, progress=False)
    worst = sorted(sorted(range(4), key=lambda h: (-tie[h], h))[:2])
    assert res["heads"]["chosen"] == worst and res["heads"]["tie_rows"] == {h: tie[h] for h in range(4)}
    assert A.analyze(path, heads=[3], fingerprint=False, attribute=False, progress=False)["heads"]["chosen"] == [3]
    assert main([str(path), "--heads", "7", "--quiet"]) == 2
    assert "head 7 is not in the file" in capsys.readouterr().err


def test_attribution_names_pbar_behind_the_fa2_bias(tmp_path):
    """fa2 rounds P̄ (and the stored O) to BF16, nothing else in the forward: with repeated maxima the delta error
    is biased, and of the single changes only P̄ both removes it (lifted) and reproduces it (alone)."""
    path, _ = _capture(tmp_path)
    res = A.analyze(path, fingerprint=False, progress=False)
    att = res["attribution"]
    assert abs(att["base"]["t"]) >= A.SIGNIFICANT_T and att["biased"]
    assert "pbar" in att["removes"] and "pbar" in att["reproduces"]
    assert "`pbar`" in att["sentence"]
    lift = {r["point"]: r["lift"] for r in att["points"]}
    assert lift["scores"]["state"] == "n/a"  # fa2 keeps S in FP32: nothing to lift
    assert abs(att["fp32"]["t"]) < A.SIGNIFICANT_T
    for r in att["points"]:
        if r["backward_only"] and r["lift"].get("state") == "run":  # delta (dO_O) never reads backward points
            assert r["lift"]["mean"] == att["base"]["mean"] or abs(r["lift"]["t"] - att["base"]["t"]) < 1e-6


def test_verdict_sentence_cases():
    base = {"mean": -1.0, "t": -8.0}
    run = lambda t, m=-1.0: {"state": "run", "t": t, "mean": m}  # noqa: E731
    pts = [{"point": "pbar", "lift": run(-0.5, -0.05), "round": run(-6.0)},  # a removal leaves a small mean
           {"point": "acc", "lift": run(-7.0), "round": run(4.0, 1.0)}]
    v = A.verdict({"base": base, "points": pts})
    assert v["removes"] == ["pbar"] and v["reproduces"] == ["pbar"] and "needs BF16 at `pbar`" in v["sentence"]
    v = A.verdict({"base": {"mean": 0.1, "t": 1.0}, "points": pts})
    assert not v["biased"] and "no significant" in v["sentence"]
    pts = [{"point": "acc", "lift": run(-7.0), "round": {"state": "n/a"}}]
    assert "no single rounding point" in A.verdict({"base": base, "points": pts})["sentence"]


def test_reports_md_html_json(tmp_path):
    path, _ = _capture(tmp_path, B=2, T=64)
    assert main([str(path), "--quiet", "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "fa2.md").read_text()
    assert "## Fingerprint" in md and "## Attribution per rounding point" in md and "| `pbar` |" in md
    page = (tmp_path / "rep" / "fa2.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "<table>" in page and "http" not in page
    data = json.loads((tmp_path / "rep" / "fa2.json").read_text())
    assert data["fingerprint"]["best"] == "fa2" and len(data["attribution"]["points"]) == 11
    assert data["per_head"][0]["rows"] == 2 * 64


def test_a_near_miss_never_reads_as_100_percent():
    from flash_forensics.capture.report import pct
    assert pct(1.0) == "100%"
    assert pct(1 - 4 / 262144) == "99.998474%"  # 4 of 262,144 elements differ: not "100.00%"
    assert pct(0.5) == "50.00%"
