"""A job folder is taken by one job at a time: a live owner's lock refuses a second job (nothing written there),
a dead owner's lock is taken over, and the lock goes when the job ends."""
import json
import os
import socket

import pytest

from flash_forensics.orchestrator.job import folder_lock
from flash_forensics.orchestrator.launch.task import run_job
from tests.helpers.jobs import compose_cfg


def _lock(job, pid):
    job.mkdir(parents=True, exist_ok=True)
    (job / folder_lock.LOCK_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))


def test_a_live_owner_refuses_a_second_job(tmp_path, capsys):
    job = tmp_path / "job"
    _lock(job, os.getppid())  # a live process that is not this one
    cfg, overrides = compose_cfg(["experiment=smoke"], tmp_path)
    result = run_job(cfg, job_dir=job, overrides=overrides)
    assert result["observed"] == "failed" and f"in use by the job with pid {os.getppid()}" in result["error"]
    assert sorted(p.name for p in job.iterdir()) == [folder_lock.LOCK_FILE]  # nothing of this job's written there
    assert "[job] refused: the job folder" in capsys.readouterr().out


def test_a_dead_owner_is_taken_over_and_the_lock_released(tmp_path, capsys):
    job = tmp_path / "job"
    dead = 2 ** 22 + 12345  # above the default pid_max: no such process
    _lock(job, dead)
    with folder_lock.hold(job) as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(folder_lock.FolderBusy):  # another job of this host while we hold it
            _lock_other = json.loads(path.read_text())
            assert _lock_other["pid"] == os.getpid()
            (job / folder_lock.LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
            folder_lock.acquire(job)
        path.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    assert not (job / folder_lock.LOCK_FILE).exists()
    assert f"its job (pid {dead}) is gone" in capsys.readouterr().out


@pytest.mark.parametrize("env", [{"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0"},
                                 {"WORLD_SIZE": "2", "RANK": "1"}])
def test_the_other_ranks_of_one_ddp_job_share_its_folder(tmp_path, monkeypatch, env):
    """Rank 0 holds the lock; rank 1 of the same job (SLURM tasks or torchrun) runs in the folder without it."""
    from flash_forensics.orchestrator.launch import task
    job = tmp_path / "job"
    _lock(job, os.getppid())  # rank 0, alive
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ran = []
    monkeypatch.setattr(task, "_run_job", lambda cfg, job_dir, overrides=None: ran.append(job_dir) or {"ok": 1})
    assert task.run_job(object(), job_dir=job) == {"ok": 1} and ran == [job]
