"""train.max_hours: a run whose steps left would take longer, at the tokens/s measured past the warm-up, stops
there naming train.max_steps, the estimate and the most that fits (not '~1 year' and then training on)."""
import pytest

from flash_forensics.orchestrator.config.schema import TrainConfig
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config
from flash_forensics.orchestrator.job.train import TimeBudgetError, check_hours
from tests.helpers import jobs as _jobs

BASE = ["experiment=smoke", "model.n_layer=1", "model.n_embd=32", "train.precision=fp32", "train.eval_every=0",
        "monitor.log_every=2", "train.ckpt_every=0"]


def test_the_limit_is_the_measured_estimate():
    tc = TrainConfig(max_steps=10_000_000, max_hours=720.0)
    step_s = 3.2  # ~1 year for the 10^7 steps
    with pytest.raises(TimeBudgetError, match=r"train.max_steps=10000000 is not allowed at this speed: the "
                                              r"9,999,990 steps left take ~1.01 years, over train.max_hours=720; "
                                              r"expected train.max_steps <= ~810,010"):
        check_hours(tc, 10, (tc.max_steps - 10) * step_s, step_s, world_size=1)
    check_hours(tc, 10, 700 * 3600.0, step_s, world_size=1)  # within: nothing
    check_hours(TrainConfig(max_steps=10_000_000, max_hours=None), 10, 1e12, step_s, world_size=1)  # no limit


def test_a_run_too_long_for_max_hours_stops_after_the_warm_up(tmp_path):
    res = _jobs.run_in(BASE, tmp_path, "long", "train.max_steps=100000", "train.max_hours=0.0001")
    assert res["observed"] == "failed" and res["error"].startswith("TimeBudgetError: train.max_steps=100000 is not "
                                                                   "allowed at this speed")
    assert res["steps_done"] <= 10  # three logging intervals of warm-up, then the stop
    assert not (tmp_path / "long" / "checkpoints" / "crash.pt").exists()  # nobody resumes a run refused so


def test_max_hours_must_be_a_positive_number(tmp_path):
    cfg, ov = _jobs.compose_cfg(BASE, tmp_path, "train.max_hours=0")
    with pytest.raises(ConfigError, match=r"train.max_hours=0.0 is not allowed"):
        validate_config(cfg, ov, check_store=False)
