"""DivergenceDetector: NaN/Inf, spike windows, noisy-but-stable curves, resume via state_dict."""
import math
import random

import pytest

from flash_forensics.orchestrator.verdict import DivergenceDetector, VerdictConfig


def decaying(n, start=10.0, floor=3.0, noise=0.0, seed=0):
    rng = random.Random(seed)
    return [(s, floor + (start - floor) * math.exp(-s / 30) + rng.uniform(-noise, noise)) for s in range(n)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_loss_diverges_at_that_step(bad):
    det = DivergenceDetector(VerdictConfig(margin=1.0, window=5))
    pts = decaying(100)
    pts[63] = (63, bad)
    assert det.update(pts[:63]) is False and det.observed == "stable"
    assert det.update(pts[63:]) is True
    assert (det.observed, det.divergence_step, det.reason) == ("diverged", 63, "non-finite")
    assert det.last_step == 99  # keeps recording after the verdict


def test_spike_window_reports_first_step_of_the_window():
    det = DivergenceDetector(VerdictConfig(margin=1.0, window=10))
    pts = decaying(200)
    # a brief spike (shorter than the window) is forgiven, a sustained rise is not
    pts = [(s, v + 3.0) if 80 <= s < 85 else (s, v) for s, v in pts]
    pts = [(s, v + 2.0 + 0.01 * (s - 150)) if s >= 150 else (s, v) for s, v in pts]
    det.update(pts[:155])
    assert det.observed == "stable"  # only 5 "up" steps so far
    det.update(pts[155:])
    assert det.observed == "diverged" and det.divergence_step == 150 and det.reason == "spike"


def test_noisy_but_stable_curve_stays_stable():
    det = DivergenceDetector(VerdictConfig(margin=1.0, window=20))
    pts = decaying(2000, noise=0.6, seed=1)
    for i in range(0, len(pts), 7):  # arbitrary flush sizes
        det.update(pts[i:i + 7])
    assert det.observed == "stable" and det.divergence_step is None
    assert det.min_loss < 3.0 and det.final_loss == pytest.approx(pts[-1][1])


def test_margin_is_above_the_running_minimum_not_the_start():
    # the loss falls from 10 to 2, then comes back to 4 (still far below the first loss): that is a divergence
    pts = [(s, 10 - s * 0.08) for s in range(101)] + [(s, 4.0) for s in range(101, 140)]
    det = DivergenceDetector(VerdictConfig(margin=1.5, window=30))
    det.update(pts)
    assert det.divergence_step == 101


def test_state_dict_round_trip_matches_the_uninterrupted_stream():
    cfg = VerdictConfig(margin=0.5, window=8)
    pts = decaying(300, noise=0.2, seed=3)
    pts = [(s, v + (1.0 if s >= 240 else 0.0)) for s, v in pts]
    full = DivergenceDetector(cfg)
    full.update(pts)
    assert full.observed == "diverged"
    for cut in (100, 243):  # before the window and inside it
        first = DivergenceDetector(cfg)
        first.update(pts[:cut])
        resumed = DivergenceDetector(cfg)
        resumed.load_state_dict(first.state_dict())
        resumed.update(pts[cut - 5:])  # replayed steps after a resume are ignored
        assert resumed.state_dict() == full.state_dict()


def test_early_stop_after_divergence():
    det = DivergenceDetector(VerdictConfig(window=3, early_stop_after=4))
    det.update([(0, 5.0), (1, float("nan"))])
    assert not det.should_stop(4) and det.should_stop(5)
    assert not DivergenceDetector(VerdictConfig()).should_stop(10**6)


@pytest.mark.parametrize("field,value", [("margin", 0), ("margin", -1.0), ("window", 0), ("early_stop_after", -1),
                                         ("window", 2.5)])
def test_bad_config_names_key_and_value(field, value):
    cfg = VerdictConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"verdict\.{field}={value!r}"):
        cfg.validate()
