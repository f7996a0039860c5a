"""Caught before launch, with the key the user typed: intervention knobs, model.n_head,
model.block_size against the corpus, a data.replay that is not a batch order, hydra/launcher without -m. And the
numerical-failure counters reaching the metrics and the run's warning."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import flash_forensics.orchestrator.config.schema  # noqa: F401
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[2]


def check(tmp_path, *overrides):
    ov = ["experiment=smoke", f"tracking.uri=sqlite:///{tmp_path}/m.db", *overrides]
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=ov)
    GlobalHydra.instance().clear()
    return validate_config(cfg, ov, check_store=False)


@pytest.mark.parametrize("overrides,needle", [
    (["intervention.eps=0"], "intervention.eps=0.0 is not allowed"),
    (["intervention=sfa", "intervention.softmax=stabilised"], "intervention.softmax='stabilised' is not allowed"),
    (["model.n_head=3"], "model.n_head=3 is not allowed: expected a divisor of model.n_embd=64"),
])
def test_messages_name_the_key_typed(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as e:
        check(tmp_path, *overrides)
    assert needle in str(e.value)


def test_replay_that_is_not_a_batch_order(tmp_path):
    junk = tmp_path / "order.bin"
    junk.write_bytes(b"x" * 200)
    with pytest.raises(ConfigError, match=r"data.replay=.*is not a batch-order file"):
        check(tmp_path, f"data.replay={junk}")
    with pytest.raises(ConfigError, match=r"data.replay=.*expected an existing batch-order file"):
        check(tmp_path, f"data.replay={tmp_path / 'missing.bin'}")


def test_block_size_larger_than_the_corpus(tmp_path):
    from flash_forensics.orchestrator.data import ensure_prepared
    obj, _ = check(tmp_path)
    ensure_prepared(obj.data, obj.model.vocab_size)  # the default corpus (prepared once per machine)
    with pytest.raises(ConfigError, match=r"model.block_size=2000000 is not allowed: expected at most \d+"):
        check(tmp_path, "model.block_size=2000000")


def test_launcher_without_multirun_is_refused(tmp_path):
    p = subprocess.run([sys.executable, "run.py", "experiment=smoke", "hydra/launcher=submitit_local",
                        f"tracking.uri=sqlite:///{tmp_path}/m.db", f"results_dir={tmp_path}/results",
                        f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert "hydra/launcher=submitit_local is not allowed without -m" in p.stderr and "add -m" in p.stderr
    assert not (tmp_path / "run" / "result.json").exists()  # nothing launched


def test_numerics_counters_become_metrics_and_a_warning():
    from flash_forensics.kernels.config import AttentionConfig
    from flash_forensics.models.gpt import GPT, ModelConfig
    from flash_forensics.orchestrator.monitor.monitors import MonitorConfig, Monitors

    class Sink:
        def __init__(self):
            self.points = {}

        def log_metrics(self, m, step):
            self.points.update({k: (step, v) for k, v in m.items()})

    model = GPT(ModelConfig(name="t", n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64),
                AttentionConfig(recipe="fp32", softmax="stabilized", beta=8.0))
    x = torch.randint(0, 64, (2, 16))
    sink = Sink()
    mon = Monitors(model, MonitorConfig(log_every=1, wq_every=100), sink)
    assert mon.numerics_warning() is None
    stats = model.attention_stats()[0]
    stats.underflow_rows[1] += 3  # as the kernel adds them on the device
    mon.step_end(0, torch.tensor(1.0), torch.tensor(1.0), 1e-3, 32)
    assert sink.points["underflow_rows/L0.H1"] == (0, 3.0)
    assert "sfa_p1_rows/L0.H0" not in sink.points and "underflow_rows/L0.H0" not in sink.points  # zero: no series
    assert mon.numerics["underflow_rows"] == 3 and "3 attention rows" in mon.numerics_warning()
    assert "Algorithm 3 shift is too large" in mon.numerics_warning()  # the SFA model: the shift is the suspect
    safe = GPT(ModelConfig(name="t", n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64),
               AttentionConfig(recipe="fp32"))
    mon_safe = Monitors(safe, MonitorConfig(log_every=1, wq_every=100), Sink())
    safe.attention_stats()[0].underflow_rows[0] += 2
    mon_safe.step_end(0, torch.tensor(1.0), torch.tensor(1.0), 1e-3, 32)
    assert "non-finite (NaN or inf) scores" in mon_safe.numerics_warning()  # the safe softmax: not the shift
    assert "Algorithm 3" not in mon_safe.numerics_warning()
    assert int(stats.underflow_rows.sum()) == 0  # reset after the flush
    mon.step_end(1, torch.tensor(1.0), torch.tensor(1.0), 1e-3, 32)
    assert sink.points["underflow_rows/L0.H1"] == (1, 0.0)  # a started series goes on through its zeros
    assert "underflow_rows/L0.H0" not in sink.points
    del x
