"""Composing and running one job in-process, for tests that need a real job folder (fork, interventions)."""
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from flash_forensics.orchestrator.launch.task import run_job

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")


def compose_cfg(base, tmp_path, *overrides):
    """conf/config.yaml with `base` + overrides, its MLflow store and results inside tmp_path."""
    overrides = [*base, *overrides, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"results_dir={tmp_path}/results"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    GlobalHydra.instance().clear()
    return cfg, overrides


def run_in(base, tmp_path, name, *overrides):
    cfg, overrides = compose_cfg(base, tmp_path, *overrides)
    return run_job(cfg, job_dir=tmp_path / name, overrides=overrides)


def run_cli(tmp_path, *args, timeout=600):
    """`python run.py ARGS` in tmp_path, its MLflow store and results inside tmp_path."""
    # the caller's PYTHONPATH kept after the tree (the GPU machine's packages live there: /tmp/site, scripts/gpu.sh)
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0"}
    cmd = [sys.executable, str(ROOT / "run.py"), *args,
           f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"results_dir={tmp_path}/results"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
