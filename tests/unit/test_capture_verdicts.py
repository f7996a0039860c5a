"""The analyzer's verdicts can be wrong in the ways issue 30 lists; each test here failed before its fix: counts in
integers and bits, unchecked heads said (or checked), no 100% banner for a near miss, FP8 captures readable, ties
across key tiles, backward-only points never "reproducing" the delta bias, a per-head bias the pooled t hides."""
import math

import pytest
import torch

from flash_forensics.capture import analysis as A
from flash_forensics.capture import fingerprint as fp
from flash_forensics.capture.recorder import write_call
from flash_forensics.capture.report import markdown
from flash_forensics.capture.synthetic import tied_inputs
from flash_forensics.kernels import probes as P
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import reference_attention


def test_identical_counts_compare_bits_not_values():
    n, total = fp.identical_count(torch.tensor([0.0, 1.0, float("nan")]), torch.tensor([-0.0, 1.0, float("nan")]))
    assert (n, total) == (2, 3)  # -0.0 == 0.0 is True for `==`, but the kernel wrote other bits


def test_a_near_miss_on_a_large_capture_is_no_match():
    """2^25 elements, one differs: a float32 mean of the equality mask reads exactly 1.0."""
    ref = torch.zeros(2 ** 25, dtype=torch.bfloat16)
    got = ref.clone()
    got[12345] = 2.0 ** -20
    assert fp.identical_count(ref, got) == (2 ** 25 - 1, 2 ** 25)
    assert fp.identical_share(ref, got) < 1.0
    assert not fp.is_exact({"o_differ": 2 ** 25 - fp.identical_count(ref, got)[0], "lse_differ": None})


@pytest.fixture(scope="module")
def near_miss(tmp_path_factory):
    """fa2 on 4 heads, the file naming no recipe, one O element of the head with the fewest ties changed by an ulp
    (so the default analysis, the 2 worst heads by ties, does not analyse that head)."""
    q, k, v, do = tied_inputs(2, 4, 128, 32, seed=1)
    kn = AttentionKnobs(recipe="fa2")
    o = reference_attention(q, k, v, kn)[0].clone()
    ties = P.tie_rows(q, k, kn)[0].sum(dim=(0, 2))
    quiet = int(torch.argmin(ties))
    o.view(torch.int16)[0, quiet, 5, 3] += 1  # the next BF16 value
    path = write_call(tmp_path_factory.mktemp("nm") / "nm.safetensors", q, k, v, o, do, family="test", layer=0)
    return path, quiet


def test_every_head_is_fingerprinted_when_cheap(near_miss):
    path, quiet = near_miss
    res = A.analyze(path, top=2, attribute=False, progress=False)
    assert quiet not in res["heads"]["chosen"]  # the head with the difference is not an analysed one
    assert res["fingerprint"]["heads"] == [0, 1, 2, 3] and res["fingerprint"]["unchecked_heads"] == []
    best = res["fingerprint"]["candidates"][0]
    assert not res["fingerprint"]["exact"] and best["label"] == "fa2" and best["o_differ"] == 1


def test_unchecked_heads_are_said(near_miss):
    path, quiet = near_miss
    res = A.analyze(path, top=2, attribute=False, progress=False, fingerprint_heads_mode="chosen")
    assert quiet in res["fingerprint"]["unchecked_heads"]
    assert any("were not checked" in n for n in res["notes"])
    assert "NOT checked" in markdown(res)


def test_the_banner_never_reads_100_percent_for_a_near_miss(near_miss):
    path, _ = near_miss
    res = A.analyze(path, attribute=False, progress=False)  # 1 of 32768 O elements differs: 99.997%
    text = markdown(res)
    assert "100.00%" not in text and "100.00%" not in " ".join(res["notes"])
    assert "99.996948%" in " ".join(res["notes"])


def test_an_fp8_capture_is_analysed(tmp_path):
    q, k, v, do = tied_inputs(1, 2, 64, 32, seed=0)
    q8, k8, v8 = (t.float().to(torch.float8_e4m3fn) for t in (q, k, v))
    kn = AttentionKnobs(recipe="fa2")
    o = reference_attention(q8.float(), k8.float(), v8.float(), kn)[0].bfloat16()  # fa2 reads BF16: e4m3 values exact
    path = write_call(tmp_path / "fp8.safetensors", q8, k8, v8, o, do, family="test", layer=0)
    res = A.analyze(path, attribute=False, progress=False)
    assert any("FP8" in n for n in res["notes"]) and res["fingerprint"]["candidates"]
    assert res["per_head"][0]["rows"] == 64


def test_ties_are_found_across_key_tiles():
    """Key 70 repeats key 6 exactly (another tile at block_k 64); queries from 70 on point at it: their row max
    sits once in tile 0 and once in tile 1, so P̄ = 1 twice in the accumulated O."""
    g = torch.Generator().manual_seed(0)
    T, D = 128, 32
    k = torch.randn(1, 1, T, D, generator=g)
    k[0, 0, 70] = k[0, 0, 6]
    q = 0.1 * torch.randn(1, 1, T, D, generator=g)
    q[0, 0, 70:] += 3.0 * k[0, 0, 6]
    q, k = q.bfloat16(), k.bfloat16()
    tie, exact = P.tie_rows(q, k, AttentionKnobs(recipe="fa2"))
    assert bool(tie[0, 0, 70:].all()) and bool(exact[0, 0, 70:].all())


def _run(t, mean):
    return {"state": "run", "t": t, "mean": mean}


def test_a_backward_only_point_never_reproduces_the_delta_bias():
    """Rounding a backward point alone leaves delta (dO_O) as the fp32 recipe's; that fp32 mean may itself be
    significant (its t is of the FP32 vs FP64 error), but it is not the base's bias."""
    att = {"base": {"mean": -1.0, "t": -8.0}, "fp32": {"mean": -0.02, "t": -4.0},
           "points": [{"point": "pbar", "lift": _run(-0.3, -0.03), "round": _run(-7.0, -0.9)},
                      {"point": "bwd_out", "backward_only": True, "lift": {"state": "n/a"},
                       "round": _run(-4.0, -0.02)}]}
    v = A.verdict(att)
    assert v["reproduces"] == ["pbar"] and "bwd_out" not in v["sentence"]
    assert v["removes"] == ["pbar"]


def test_a_lift_that_keeps_the_mean_does_not_remove_it():
    att = {"base": {"mean": -1.0, "t": -8.0}, "fp32": {"mean": 0.0, "t": 0.0},
           "points": [{"point": "acc", "lift": _run(-1.5, -0.9), "round": {"state": "n/a"}}]}
    assert A.verdict(att)["removes"] == []  # |t| fell (a noisier error), the bias did not


def test_a_bias_in_one_head_is_not_hidden_by_the_pooled_t():
    per = [{"mean": -1.0, "t": -8.0}, {"mean": 1.0, "t": 8.0}, {"mean": 0.0, "t": 0.1}]
    att = {"base": {"mean": 0.0, "t": 0.3, "per_head": per}, "fp32": {"mean": 0.0, "t": 0.0}, "heads": [0, 3, 5],
           "points": []}
    v = A.verdict(att)
    assert v["biased"] and [h["head"] for h in v["head_tests"] if h["significant"]] == [0, 3]
    assert "head 0 t = -8.0 *" in v["sentence"]


def test_per_head_tests_are_holm_corrected():
    p1 = A.p_two_sided(3.1)
    assert A.holm([p1]) == [pytest.approx(p1)]
    assert A.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    one = A.per_head_tests([{"mean": 1.0, "t": 3.1}], [0])
    two = A.per_head_tests([{"mean": 1.0, "t": 3.1}, {"mean": 1.0, "t": 3.1}], [0, 1])
    assert one[0]["significant"] and not any(h["significant"] for h in two)  # 2 tests: p x 2 > alpha
    assert math.isclose(A.ALPHA, math.erfc(3 / math.sqrt(2)))
