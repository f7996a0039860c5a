"""The run log holds the run: everything the job prints, its warnings and its traceback are in <job dir>/run.log,
line by line, also after a kill -9."""
import sys
import warnings

from flash_forensics.orchestrator.launch import job_log
from tests.helpers.jobs import run_cli, run_in

SMOKE = ["experiment=smoke"]


def test_tee_keeps_lines_warnings_and_the_final_bar(tmp_path):
    with job_log.tee(tmp_path) as path:
        print("[job] the precision line")
        warnings.warn("a numerical warning", RuntimeWarning, stacklevel=1)
        sys.stderr.write("bar 1/3\rbar 2/3\rbar 3/3\n")  # a progress bar's refreshes: one line, its final state
        job_log.log_only("Traceback (most recent call last): only in the log")
        sys.stdout.write("an unfinished line")
    text = path.read_text()
    assert "[job] the precision line\n" in text and "RuntimeWarning: a numerical warning" in text
    assert "bar 3/3\n" in text and "bar 1/3" not in text
    assert "Traceback (most recent call last): only in the log" in text and text.endswith("an unfinished line\n")
    assert sys.stdout is sys.__stdout__ or not isinstance(sys.stdout, job_log._Tee)  # restored


def test_a_failed_job_logs_its_traceback(tmp_path):
    result = run_in(SMOKE, tmp_path, "job", "train.max_steps=3", "train.warmup_steps=1", "debug.raise_at_step=1",
                    "train.record_batches=false")
    assert result["observed"] == "failed"
    text = (tmp_path / "job" / job_log.LOG_FILE).read_text()
    assert "[job] train.precision=" in text  # the route/precision line
    assert "Traceback (most recent call last)" in text and "debug.raise_at_step=1: forced failure" in text
    assert not (tmp_path / "job" / "job.lock").exists()  # the folder's lock goes with the job


def test_run_log_survives_kill_9(tmp_path):
    job = tmp_path / "job"
    args = [*SMOKE, "intervention=baseline", "train.eval_every=2", "train.ckpt_every=2", f"hydra.run.dir={job}"]
    proc = run_cli(tmp_path, *args, "debug.kill_at_step=3", timeout=300)
    assert proc.returncode != 0  # SIGKILLed
    text = (job / job_log.LOG_FILE).read_text()
    assert "[job] train.precision=" in text and "attention routes:" in text
    assert "[job] step 2/20: train loss" in text  # the progress summary flushed before the kill
    assert not (job / "result.json").exists() and (job / "job.lock").exists()  # the dead job's lock
    # the same job again: the dead owner's lock is taken over, the auto-resume says from which checkpoint
    proc = run_cli(tmp_path, *args, "train.max_steps=4", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    again = (job / job_log.LOG_FILE).read_text()
    assert again.startswith(text) and "is gone; this job takes the folder over" in proc.stdout
    assert "[job] resuming from " in again and "at step 2 (auto-resume" in again
    assert not (job / "job.lock").exists() and (job / "result.json").exists()
