"""Checks that a SLURM sweep can be submitted, run before anything is submitted (from ValidateSweep).

We do not schedule anything ourselves: hydra-submitit-launcher submits, SLURM runs, MLflow records. What can go
wrong before submission is that SLURM is not there (no sbatch on PATH) or its controller does not answer; both
are caught here with a message saying what to do, instead of a submitit traceback after the sweep started.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

START_HINT = "start the one-node cluster with `scripts/slurm_local.sh start` (as root), or run on a SLURM login node"


class ClusterError(RuntimeError):
    """SLURM cannot take the sweep; raised before anything is submitted."""


def check_slurm(timeout_s: float = 10.0) -> str:
    """sbatch on PATH and `scontrol ping` reports the controller UP. Returns the ping line."""
    missing = [b for b in ("sbatch", "scontrol") if shutil.which(b) is None]
    if missing:
        raise ClusterError(f"hydra/launcher=slurm: {' and '.join(missing)} not found on PATH "
                           f"(PATH={os.environ.get('PATH', '')}); install SLURM's client tools or {START_HINT}")
    try:
        res = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"hydra/launcher=slurm: `scontrol ping` did not answer within {timeout_s:g}s: the "
                           f"SLURM controller is down or unreachable; {START_HINT}") from None
    out = (res.stdout + res.stderr).strip()
    if res.returncode != 0 or " is UP" not in out:
        raise ClusterError(f"hydra/launcher=slurm: the SLURM controller is not up (`scontrol ping`: "
                           f"{out or 'exit ' + str(res.returncode)}); {START_HINT}")
    return out


def slurm_up() -> bool:
    """For tests: is a usable controller there?"""
    try:
        check_slurm(timeout_s=5)
        return True
    except ClusterError:
        return False


def check_tasks(tasks_per_node: int, nodes: int, grad_accum: int, gpus_per_node: Optional[int] = None) -> None:
    """One SLURM task per rank: the global micro-batch count must split over the ranks, and a GPU job needs a GPU
    per task."""
    world = int(tasks_per_node) * int(nodes)
    if world < 1:
        raise ClusterError(f"hydra.launcher.tasks_per_node={tasks_per_node} x nodes={nodes}: expected >= 1 task")
    if grad_accum % world:
        raise ClusterError(f"train.grad_accum={grad_accum} is not allowed with hydra.launcher.tasks_per_node="
                           f"{tasks_per_node} x nodes={nodes} ({world} ranks): expected a multiple of {world}")
    if gpus_per_node and tasks_per_node > gpus_per_node:
        raise ClusterError(f"hydra.launcher.tasks_per_node={tasks_per_node} is not allowed with gpus_per_node="
                           f"{gpus_per_node}: expected at most one rank per GPU")


def check_launcher(config) -> None:
    """Everything above for a composed job config (an OmegaConf node with `hydra.launcher`); then lets a job that
    dies hard fail alone (tolerate_dead_jobs)."""
    from omegaconf import OmegaConf

    target = OmegaConf.select(config, "hydra.launcher._target_") or ""
    if not target.endswith(("SlurmLauncher", "LocalLauncher")):  # basic launcher: nothing to check
        return
    if target.endswith("SlurmLauncher"):
        check_slurm()
    tolerate_dead_jobs()
    tasks = OmegaConf.select(config, "hydra.launcher.tasks_per_node") or 1
    nodes = OmegaConf.select(config, "hydra.launcher.nodes") or 1
    accum = OmegaConf.select(config, "train.grad_accum") or 1
    check_tasks(int(tasks), int(nodes), int(accum), OmegaConf.select(config, "hydra.launcher.gpus_per_node"))


# ------------------------------------------------------------------------------------------ dead jobs
# hydra-submitit-launcher collects `job.results()` for every job of the array; a job that died without a result
# (OOM kill, scancel, node failure, timed out too often) raises there and Hydra's sweep stops before the report.
# Our jobs record their own failures in result.json and return normally, so only hard deaths reach this point.
# Hydra only accepts launchers from the hydra_plugins package, so instead of a launcher subclass the launching
# process (ValidateSweep -> check_launcher) makes submitit's Job.results turn such a death into a result row
# ('failed', with submitit's reason): the sweep finishes and its report lists the job as failed.
_tolerant = False


def tolerate_dead_jobs() -> None:
    """Idempotent; affects this (launching) process only."""
    global _tolerant
    if _tolerant:
        return
    import submitit
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.utils import UncompletedJobError

    original = submitit.core.core.Job.results

    def results(job):
        try:
            return original(job)
        except UncompletedJobError as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            ret = JobReturn()
            ret.status = JobStatus.COMPLETED  # Hydra's sweeper aborts on FAILED; the report shows it as failed
            ret.return_value = {"observed": "failed", "error": f"job {job.job_id} died without a result: {reason}"}
            print(f"[cluster] job {job.job_id} died without a result; the sweep goes on ({reason})", flush=True)
            return [ret]

    submitit.core.core.Job.results = results
    _tolerant = True
