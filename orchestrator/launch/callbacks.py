"""ValidateSweep: compose and validate every job of a sweep before any of them launches.

Hydra's Callbacks turn exceptions raised in callbacks into warnings, so a rejected config leaves through SystemExit
(printed, exit status 1) instead: nothing is launched, no job folder or MLflow run is created (this callback runs
before the report callback that opens the parent run).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List

from hydra.core.global_hydra import GlobalHydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from flash_forensics.orchestrator.config.folders import check_capture_dir, check_folder
from flash_forensics.orchestrator.config.validate import (
    ConfigError,
    check_typed_scope,
    ignored_scope,
    scope_refusal,
    validate_config,
)
from flash_forensics.orchestrator.launch import cluster  # looked up at call time (tests stand in for the cluster)
from flash_forensics.orchestrator.launch.task import close_dead_jobs


def sweep_jobs(config: DictConfig) -> List[List[str]]:
    """The per-job override lists the BasicSweeper will launch (its params + the command line, expanded)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(args)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def validate_sweep(config: DictConfig) -> int:
    """Compose each job of the multirun described by `config` and validate it; raise ConfigError on the first bad
    one (naming the job's overrides). The tracking store is checked once per distinct URI. Returns the job count."""
    target = OmegaConf.select(config, "hydra.sweeper._target_") or ""
    if not target.endswith("BasicSweeper"):
        jobs = [list(config.hydra.overrides.task)]  # other sweepers expand on their own: check the base config
    else:
        jobs = sweep_jobs(config)
    loader = GlobalHydra.instance().config_loader()
    checked_uris = set()
    ignored: Dict[str, List[str]] = {}  # typed scope key -> the jobs' interventions that ignore it
    names: List[str] = []
    for overrides in jobs:
        try:
            job_cfg = loader.load_sweep_config(config, list(overrides))
        except Exception as e:  # Hydra's own message (unknown group option, bad type, ...)
            raise ConfigError(f"job {overrides}: {e}") from None
        uri = OmegaConf.select(job_cfg, "tracking.uri")
        try:
            validate_config(job_cfg, overrides, check_store=uri not in checked_uris)
            # the job folder's place under the sweep folder (its subdir is numbered at launch)
            check_capture_dir(OmegaConf.select(job_cfg, "monitor.capture"), Path(str(config.hydra.sweep.dir)) / "job")
        except ConfigError as e:
            raise ConfigError(f"job {overrides}: {e}") from None
        checked_uris.add(uri)
        name = str(OmegaConf.select(job_cfg, "intervention.name"))
        names.append(name)
        for key in ignored_scope(name, overrides):
            ignored.setdefault(key, []).append(name)
    for key, who in ignored.items():  # a typed layer/heads that some job takes is the sweep's; none: refused
        if len(who) == len(jobs):
            raise scope_refusal(key, jobs[0], sorted(set(names)))
    _check_launcher(config)
    return len(jobs)


JOB_FOLDER = "the job folder: run.log, result.json, checkpoints"


def _check_launcher(config: DictConfig) -> None:
    """A submitit launcher: SLURM controller up, ranks split the batch, hard-killed jobs fail alone
    (flash_forensics.orchestrator.launch.cluster)."""
    target = OmegaConf.select(config, "hydra.launcher._target_") or ""
    if "submitit" not in target.lower():
        return
    device = str(OmegaConf.select(config, "train.device") or "auto")
    gpus = OmegaConf.select(config, "hydra.launcher.gpus_per_node")
    if target.endswith("LocalLauncher") and device.startswith("cuda") and not gpus:
        raise ConfigError(f"hydra.launcher.gpus_per_node={gpus!r} is not allowed with train.device={device!r}: "
                          f"submitit's local executor then hides every GPU from the jobs; expected >= 1 (the "
                          f"default ${{ff_gpu_count:}} gives each job all of this machine's GPUs)")
    try:
        cluster.check_launcher(config)  # controller up (sbatch, scontrol ping); grad_accum splits over tasks x nodes
    except Exception as e:
        raise ConfigError(str(e)) from None


def _reject(e: Exception) -> None:
    print(f"Error: configuration rejected, nothing launched.\n{e}", file=sys.stderr)
    raise SystemExit(1)


class ValidateSweep(Callback):
    """Hydra callback: validate all jobs at multirun start (and the single job at run start)."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        try:  # Hydra makes the folder after this callback (and the report callback's parent run): check it first
            check_folder("hydra.sweep.dir", config.hydra.sweep.dir, "the sweep's job folders and report")
            n = validate_sweep(config)
        except (ConfigError, ValueError) as e:
            _reject(e)
        else:
            print(f"[validate] {n} job(s) checked")

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        launcher = [o for o in (list(config.hydra.overrides.hydra) + list(config.hydra.overrides.task))
                    if o.lstrip("+~").startswith("hydra/launcher=")]
        if launcher:  # Hydra only launches through a launcher in multirun mode: it would train here, silently
            _reject(ConfigError(f"{launcher[0]} is not allowed without -m: Hydra uses a launcher only for a multirun; "
                                f"add -m (python run.py -m {launcher[0]} ...) to launch through it"))
        try:
            check_folder("hydra.run.dir", config.hydra.run.dir, JOB_FOLDER)
            validate_config(config, list(config.hydra.overrides.task))
            check_typed_scope(str(OmegaConf.select(config, "intervention.name")), list(config.hydra.overrides.task),
                              fork=OmegaConf.select(config, "from_checkpoint") is not None)
            check_capture_dir(OmegaConf.select(config, "monitor.capture"), Path(str(config.hydra.run.dir)))
        except (ConfigError, ValueError) as e:
            _reject(e)


class CloseDeadJobs(Callback):
    """Hydra callback, listed after the report callback (Hydra runs end callbacks in reverse order, so this runs
    first): a job of the sweep that died without a result (kill -9, OOM, node lost) gets its MLflow run marked KILLED
    with the reason and a result.json (observed failed, its intervention and overrides) before the report reads
    them (flash_forensics.orchestrator.launch.task.close_dead_jobs)."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
        if sweep_dir and Path(sweep_dir).is_dir():
            close_dead_jobs(Path(sweep_dir))


__all__ = ["ValidateSweep", "CloseDeadJobs", "validate_sweep", "sweep_jobs"]
