"""The folders a run writes are tried before launch: hydra.run.dir, hydra.sweep.dir and monitor.capture.dir under a
file or on a filesystem that cannot be written are refused naming the key (nothing trained, no MLflow run opened);
capture steps the run never reaches are refused too."""
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import open_dict

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config
from flash_forensics.orchestrator.launch.callbacks import ValidateSweep

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hook(tmp_path, capsys):
    """Run a ValidateSweep hook on the composed config (hydra node included); the rejection's message."""
    (tmp_path / "afile").write_text("x")

    def go(multirun, *overrides):
        ov = ["experiment=smoke", f"tracking.uri=sqlite:///{tmp_path}/m.db", f"results_dir={tmp_path}/res",
              *[o.format(t=tmp_path) for o in overrides]]
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=ov, return_hydra_config=True)
            with open_dict(cfg):
                cfg.hydra.overrides.task = ov
            with pytest.raises(SystemExit) as e:
                (ValidateSweep().on_multirun_start if multirun else ValidateSweep().on_run_start)(cfg)
        GlobalHydra.instance().clear()
        assert e.value.code == 1
        return capsys.readouterr().err
    return go


@pytest.mark.parametrize("multirun, overrides, says", [
    (False, ["hydra.run.dir={t}/afile/run"], "hydra.run.dir='{t}/afile/run' is not allowed: {t}/afile is a file"),
    (False, ["hydra.run.dir=/proc/ff/run"], "hydra.run.dir='/proc/ff/run' is not allowed: a folder cannot be made "
                                            "in /proc"),
    (True, ["hydra.sweep.dir={t}/afile/sweep"], "hydra.sweep.dir='{t}/afile/sweep' is not allowed"),
    (False, ["hydra.run.dir={t}/a/b", "monitor.capture.steps=[1]", "monitor.capture.dir=../../afile/cap"],
     "monitor.capture.dir='../../afile/cap' is not allowed: {t}/afile is a file"),
    (True, ["hydra.sweep.dir={t}/sw", "monitor.capture.steps=[1]", "monitor.capture.dir=/proc/ff"],
     "monitor.capture.dir='/proc/ff' is not allowed"),
])
def test_unwritable_folders_are_refused_before_launch(hook, tmp_path, multirun, overrides, says):
    err = hook(multirun, *overrides)
    assert "nothing launched" in err and says.format(t=tmp_path) in err and "folder this user can write" in err
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "sw").exists()


def test_capture_steps_past_max_steps_are_refused(tmp_path):
    ov = ["experiment=smoke", "train.max_steps=10", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for steps, ok in (("[9]", True), ("[2,10]", False)):
            cfg = compose("config", overrides=[*ov, f"monitor.capture.steps={steps}"])
            if ok:
                validate_config(cfg, ov, check_store=False)
                continue
            with pytest.raises(ConfigError, match=r"monitor.capture.steps=\[2, 10\] is not allowed: expected 0-based "
                                                  r"steps the run trains, < train.max_steps=10 \(step 10"):
                validate_config(cfg, ov, check_store=False)
    GlobalHydra.instance().clear()


def test_a_sweep_into_a_file_opens_no_parent_run(tmp_path):
    (tmp_path / "afile").write_text("x")
    p = subprocess.run([sys.executable, "run.py", "-m", "experiment=smoke", "train.seed=1,2",
                        f"tracking.uri=sqlite:///{tmp_path}/m.db", f"hydra.sweep.dir={tmp_path}/afile/sweep"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "hydra.sweep.dir=" in p.stderr and "Traceback" not in p.stderr + p.stdout
    assert not (tmp_path / "m.db").exists()  # the report callback never opened the sweep's parent run


def test_a_sweep_whose_every_job_failed_exits_nonzero(tmp_path):
    from flash_forensics.orchestrator.launch.task import sweep_status
    assert sweep_status([{"observed": "failed"}, {"observed": "stable"}]) == 0  # some failures: per job
    assert sweep_status([{"observed": "failed"}, {"observed": "failed"}]) == 1
    p = subprocess.run([sys.executable, "run.py", "-m", "experiment=smoke", "train.seed=1,2", "debug.raise_at_step=0",
                        "train.max_steps=2", "train.warmup_steps=0", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                        f"results_dir={tmp_path}/r",
                        f"hydra.sweep.dir={tmp_path}/sweep"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "debug.raise_at_step=0: forced failure" in p.stdout
