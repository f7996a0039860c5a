"""The kernel fingerprint: a capture made with each recipe (random and repeated-maxima inputs) is named by the
fingerprint, 100% identical, even when the file does not say its recipe; candidates come from kernels.recipes."""
import pytest
import torch

from flash_forensics.capture import fingerprint as fp
from flash_forensics.capture.analysis import analyze
from flash_forensics.capture.recorder import write_call
from flash_forensics.capture.synthetic import random_inputs, tied_inputs
from flash_forensics.kernels import recipes
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import reference_attention


def _capture(tmp_path, recipe, inputs, say_recipe, **knobs):
    q, k, v, do = inputs
    if recipe == "fp32":
        q, k, v, do = (t.float() for t in (q, k, v, do))
    kn = AttentionKnobs(recipe=recipe, **knobs)
    o, lse, *_ = reference_attention(q, k, v, kn)
    return write_call(tmp_path / f"{recipe}.safetensors", q, k, v, o, do, lse,
                      recipe=recipe if say_recipe else None, knobs=kn.knob_values() if say_recipe else {},
                      family="test", layer=0)


@pytest.mark.parametrize("recipe", ["paper_bf16", "fa2", "fp32"])
@pytest.mark.parametrize("kind", ["random", "tied"])
def test_each_recipe_is_named_by_its_fingerprint_unsaid(tmp_path, recipe, kind):
    inputs = (random_inputs if kind == "random" else tied_inputs)(2, 2, 64, 32, seed=3)
    res = analyze(_capture(tmp_path, recipe, inputs, say_recipe=False), attribute=False, progress=False)
    best = res["fingerprint"]["candidates"][0]
    assert best["o_identical"] == 1.0 and best["lse_identical"] == 1.0
    assert best["label"] == recipe and res["fingerprint"]["exact"]
    assert res["recipe"] == recipe  # the analysis then uses what the fingerprint found
    # and the other recipes do not reproduce it
    others = [c for c in res["fingerprint"]["candidates"] if c["recipe"] != recipe and c["changes"] == 0]
    assert others and all(c["o_identical"] < 1.0 for c in others)


def test_a_knob_variant_is_told_apart_from_its_recipe(tmp_path):
    res = analyze(_capture(tmp_path, "fa2", random_inputs(2, 2, 64, 32, seed=4), False, block_q=32, block_k=32),
                  attribute=False, progress=False)
    best = res["fingerprint"]["candidates"][0]
    assert best["label"] == "fa2+blocks32x32" and best["o_identical"] == 1.0
    plain = next(c for c in res["fingerprint"]["candidates"] if c["label"] == "fa2")
    assert plain["o_identical"] < 1.0 or plain["lse_identical"] < 1.0


def test_candidates_follow_the_recipe_list_at_run_time(monkeypatch):
    names = {c.knobs.recipe for c in fp.candidates(2, 64)}
    assert names == set(recipes.RECIPES)
    monkeypatch.setattr(recipes, "RECIPES", ("fa2",))
    assert {c.knobs.recipe for c in fp.candidates(2, 64)} == {"fa2"}
    labels = [c.label for c in fp.candidates(2, 256)]  # T > every block: untiled differs from all tilings
    assert len(labels) == len(set(labels))  # each distinct computation once
    assert "fa2+pv_fp32" in labels and "fa2+untiled" in labels and "fa2+round_bf16=scores" in labels


def test_identical_share_counts_bits():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert fp.identical_share(a, torch.tensor([1.0, float("nan"), 3.5])) == pytest.approx(2 / 3)
