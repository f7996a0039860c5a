"""Fault injection: kill -9 at several points then resume, corrupted checkpoint and batch-order bytes,
disk full, a lost MLflow store. Each scenario compares the full metric history with an uninterrupted run: points
lost 0, duplicated 0, curves equal. CPU, a 1-layer model, 20 steps per run (bounded in time).

Disk full: mounting a small tmpfs needs root; this suite simulates ENOSPC by monkeypatching the write (said here).
"""
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flash_forensics.orchestrator import errors as faults
from flash_forensics.orchestrator.data.config import DataError
from flash_forensics.orchestrator.data.replay import HEADER_BYTES, OrderReader, read_header
from flash_forensics.orchestrator.job import checkpoint

ROOT = Path(__file__).resolve().parents[2]
BASE = ["experiment=smoke", "intervention=baseline", "model.n_layer=1", "model.n_embd=32", "train.grad_accum=1",
        "train.ckpt_every=5", "train.eval_every=10", "monitor.log_every=5", "monitor.wq_every=5",
        "train.keep_checkpoints=2", "optimizer.decay_steps=20",
        "train.precision=fp32"]  # FP32 outside attention: CPU autocast's BF16 GEMMs were most of each run's time
SKIP = ("perf/", "system/")  # wall-clock metrics differ between any two runs
WALL_CLOCK = ("wall_s",)  # the run record's wall time (orchestrator/record.py), one point per run


def run(tmp, name, *extra, check=True):
    cmd = [sys.executable, "run.py", *BASE, f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"results_dir={tmp}/results",
           f"hydra.run.dir={tmp}/{name}", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def history(tmp, run_id):
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    run = c.get_run(run_id)
    return {k: [(m.step, m.value) for m in sorted(c.get_metric_history(run_id, k), key=lambda m: (m.step, m.timestamp))]
            for k in run.data.metrics if not k.startswith(SKIP) and k not in WALL_CLOCK}, run


def compare(ref, got):
    """(points lost, points duplicated, curves equal) of got against ref."""
    lost = dup = 0
    equal = set(ref) == set(got)
    for k, pts in ref.items():
        g = got.get(k, [])
        steps = [s for s, _ in g]
        dup += len(steps) - len(set(steps))
        lost += len({s for s, _ in pts} - set(steps))
        equal = equal and dict(g) == dict(pts)
    return lost, dup, equal


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    run(tmp, "ref")
    res = json.loads((tmp / "ref" / "result.json").read_text())
    hist, _ = history(tmp, res["mlflow_run_id"])
    assert hist["train/loss"] and [s for s, _ in hist["train/loss"]] == list(range(20))
    return tmp, res, hist


TABLE = []


@pytest.mark.parametrize("step,where", [(7, "step"), (9, "after_checkpoint"), (14, "checkpoint_write"),
                                        (0, "step_start")])
def test_kill9_then_resume_gives_the_uninterrupted_curve(ref, step, where):
    tmp, ref_res, ref_hist = ref
    name = f"kill_{where}_{step}"
    p = run(tmp, name, f"debug.kill_at_step={step}", f"debug.kill_where={where}", check=False)
    assert p.returncode == -9, (p.returncode, p.stderr[-2000:])
    assert not (tmp / name / "result.json").exists()
    run(tmp, name)  # the same job again: auto-resume from the newest intact checkpoint
    res = json.loads((tmp / name / "result.json").read_text())
    assert res["error"] is None and res["steps_done"] == 20
    hist, mlrun = history(tmp, res["mlflow_run_id"])
    lost, dup, equal = compare(ref_hist, hist)
    TABLE.append((f"kill -9 at step {step} ({where})", lost, dup, equal))
    print(f"\nFAULT | kill -9 at step {step} ({where}) | lost {lost} | duplicated {dup} | curves equal {equal}")
    assert (lost, dup, equal) == (0, 0, True)
    assert mlrun.info.status == "FINISHED"
    from mlflow.tracking import MlflowClient
    runs = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db").search_runs(
        [mlrun.info.experiment_id], filter_string=f"tags.job_dir = '{tmp / name}'")
    assert all(r.info.status in ("FINISHED", "KILLED") for r in runs)  # no run of this folder left RUNNING
    assert res["final_loss"] == ref_res["final_loss"]
    assert not list((tmp / name).rglob(".*.tmp")), "temp files left behind"


def test_corrupted_checkpoint_is_refused_and_auto_resume_falls_back(ref, tmp_path):
    tmp, ref_res, ref_hist = ref
    src = tmp / "ref" / "checkpoints"
    assert not os.path.samefile(src / "last.pt", src / "step_20.pt")  # separate files
    d = tmp_path / "job" / "checkpoints"
    d.mkdir(parents=True)
    for p in src.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    b = bytearray((d / "last.pt").read_bytes())
    mid = len(b) // 2
    b[mid:mid + 4096] = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    (d / "last.pt").write_bytes(b)
    with pytest.raises(checkpoint.CheckpointError, match="last.pt' is damaged"):
        checkpoint.load(d / "last.pt")
    assert checkpoint.latest(tmp_path / "job") == d / "step_20.pt"  # the newest intact one (and it says so)
    (d / "not_a_ckpt.pt").write_text("hello")
    with pytest.raises(checkpoint.CheckpointError,
                       match="not a readable checkpoint: a flash-forensics checkpoint is a torch.save archive"):
        checkpoint.load(d / "not_a_ckpt.pt")
    # a single run resumed from the damaged file: refused before launch, exit status 1, the path named
    p = run(tmp, "bad_resume", f"resume={d / 'last.pt'}", check=False)
    assert p.returncode == 1 and "is damaged" in p.stderr and str(d / "last.pt") in p.stderr
    TABLE.append(("corrupted checkpoint (4 KiB random in last.pt)", "-", "-",
                  "refused naming the path; auto-resume falls back to step_20.pt; resume= exits 1"))


def test_corrupted_batch_order_is_refused_before_step_0(ref, tmp_path):
    tmp, _, _ = ref
    order = tmp / "ref" / "batch_order.bin"
    h = read_header(order)
    raw = bytearray(order.read_bytes())
    wrong = tmp_path / "wrong.bin"  # valid offsets, but not the recorded ones
    raw2 = bytearray(raw)
    raw2[HEADER_BYTES:HEADER_BYTES + 4] = (1).to_bytes(4, "little")
    wrong.write_bytes(raw2)
    with pytest.raises(DataError, match="damaged"):
        OrderReader(wrong, h)
    past = tmp_path / "past.bin"  # past the end of the corpus, checksum made consistent: the range check
    import zlib
    body = bytearray(raw[HEADER_BYTES:HEADER_BYTES + h.covered * h.step_bytes])
    body[:4] = (h.n_tokens - 1).to_bytes(4, "little")
    from dataclasses import replace
    past.write_bytes(replace(h, crc=zlib.crc32(bytes(body))).pack() + bytes(body))
    with pytest.raises(DataError, match="past the end of the corpus"):
        OrderReader(past, h)
    p = run(tmp, "bad_replay", f"data.replay={wrong}", check=False)
    assert p.returncode == 1 and "damaged" in (p.stdout + p.stderr)
    TABLE.append(("corrupted batch order (valid offsets / past the end)", "-", "-",
                  "refused before step 0 (checksum / range check); data.replay= exits 1"))


def test_disk_full_during_a_checkpoint_is_one_sentence_and_leaves_no_temp(tmp_path, monkeypatch):
    """ENOSPC simulated (no tmpfs mount without root): the write of the checkpoint fails part-way."""
    real = checkpoint._HashingWriter.write
    calls = {"n": 0}

    def full(self, b):
        calls["n"] += 1
        if calls["n"] > 3:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return real(self, b)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", full)
    with pytest.raises(faults.WriteError) as e:
        checkpoint.save(tmp_path / "c" / "step_5.pt", {"step": 5, "x": torch.randn(100000)})
    assert str(e.value).endswith("the disk is full (ENOSPC)") and str(tmp_path / "c" / "step_5.pt") in str(e.value)
    assert list((tmp_path / "c").iterdir()) == []


def test_read_only_folder_is_one_sentence(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(faults.WriteError, match=r"permission denied \(EACCES\)"):
            checkpoint.save(d / "last.pt", {"step": 1})
    finally:
        d.chmod(0o700)


def test_lost_store_mid_run_spools_and_training_goes_on(tmp_path):
    """The store fails while the tracker runs (simulated: log_batch raises sqlite's 'attempt to write a readonly
    database', what a deleted store gave): points go to the spool, nothing raises, a resumed tracker does not log
    the spooled steps again, and the spool is replayed into the store once it is back (none lost, none doubled)."""
    from flash_forensics.orchestrator.tracking.tracker import Tracker, TrackingConfig
    db = tmp_path / "m.db"
    cfg = TrackingConfig(uri=f"sqlite:///{db}", flush_interval_s=0.1)
    spool = tmp_path / "spool.jsonl"
    t = Tracker(cfg, "lost", experiment="e", spool=spool)
    for s in range(5):
        t.log_metrics({"train/loss": float(s)}, step=s)
    t.flush()
    real = t.client.log_batch

    def broken(*a, **k):
        raise RuntimeError("(sqlite3.OperationalError) attempt to write a readonly database")

    t.client.log_batch = broken
    for s in range(5, 10):
        t.log_metrics({"train/loss": float(s)}, step=s)
    t.flush()  # no exception: the points are kept in the spool (fsynced)
    assert spool.is_file() and t.store_error and str(db) in t.store_error
    t.client.log_batch = real
    for s in range(10, 12):
        t.log_metrics({"train/loss": float(s)}, step=s)
    t.close()
    from mlflow.tracking import MlflowClient
    hist = MlflowClient(tracking_uri=f"sqlite:///{db}").get_metric_history(t.run_id, "train/loss")
    steps = [m.step for m in hist]
    lost, dup = len(set(range(12)) - set(steps)), len(steps) - len(set(steps))
    TABLE.append(("MLflow store failing mid-run (spooled, replayed)", lost, dup, dict((m.step, m.value) for m in hist)
                  == {s: float(s) for s in range(12)}))
    assert (lost, dup) == (0, 0) and sorted(steps) == list(range(12))
    assert not spool.exists()


def test_spool_that_cannot_be_written_stops_with_one_sentence(tmp_path):
    from flash_forensics.orchestrator.tracking.tracker import Tracker, TrackingConfig
    cfg = TrackingConfig(uri=f"sqlite:///{tmp_path / 'm.db'}", flush_interval_s=0.1)
    t = Tracker(cfg, "lost", experiment="e", spool=tmp_path / "no_such_dir" / "spool.jsonl")

    def broken(*a, **k):
        raise RuntimeError("database is gone")

    t.client.log_batch = broken
    t.log_metrics({"train/loss": 1.0}, step=0)
    with pytest.raises(RuntimeError, match="cannot be kept"):
        t.flush()


def test_zz_fault_table():
    """Print the fault table (pytest -s shows it)."""
    print("\n| scenario | points lost | duplicated | curves equal |\n|---|---|---|---|")
    for row in TABLE:
        print("| %s | %s | %s | %s |" % row)


def test_pv_trace_shares_are_shares():
    """pv-trace printed a 'share' of 1.895 (s1 / total with opposite-signed parts): shares stay in their ranges."""
    from flash_forensics.kernels.forensics import PVTrace
    step = np.array([3.0, -1.0, 0.5, -0.6])
    tr = PVTrace(err=np.cumsum(step), step=step, is_one=np.array([True, False, False, False]), accumulate="fp32")
    s = tr.summary()
    assert 0.0 <= s["ones_share"] <= 1.0 and s["ones_share"] == pytest.approx(3.0 / 5.1)
    assert -1.0 <= s["ones_share_signed"] <= 1.0 and s["ones_share_signed"] == pytest.approx(3.0 / 4.1)
    assert s["ones_sum"] / s["total_error"] > 1  # the old definition


def test_dead_job_is_closed_with_its_intervention_and_overrides(tmp_path):
    """A job killed without a result: close_dead_jobs (the launcher side, callbacks.CloseDeadJobs at multirun end)
    marks its MLflow run KILLED with the reason and writes result.json keeping intervention and overrides."""
    from mlflow.tracking import MlflowClient

    from flash_forensics.orchestrator.launch.task import close_dead_jobs
    p = run(tmp_path, "dead", "debug.kill_at_step=3", check=False)
    assert p.returncode == -9
    job = json.loads((tmp_path / "dead" / "job.json").read_text())
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert c.get_run(job["mlflow_run_id"]).info.status == "RUNNING"
    assert close_dead_jobs(tmp_path) == [tmp_path / "dead"]
    run_ = c.get_run(job["mlflow_run_id"])
    assert run_.info.status == "KILLED" and run_.data.tags["verdict"] == "failed"
    assert "died without writing a result" in run_.data.tags["error"]
    res = json.loads((tmp_path / "dead" / "result.json").read_text())
    assert res["intervention"] == "baseline" and "debug.kill_at_step=3" in res["overrides"]
    assert res["observed"] == "failed" and res["mlflow_run_id"] == job["mlflow_run_id"]
    assert close_dead_jobs(tmp_path) == []  # once


def test_failed_single_run_exits_nonzero(tmp_path):
    p = run(tmp_path, "boom", "debug.raise_at_step=2", "train.max_steps=4", check=False)
    assert p.returncode == 1, p.stderr[-2000:]
    assert json.loads((tmp_path / "boom" / "result.json").read_text())["observed"] == "failed"


def test_sigterm_outside_slurm_counts_the_steps_done(tmp_path):
    import signal
    import time
    cmd = [sys.executable, "run.py", *BASE, "train.max_steps=2000", "train.ckpt_every=0",
           f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"results_dir={tmp_path}/results",
           f"hydra.run.dir={tmp_path}/term"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    order = tmp_path / "term" / "batch_order.bin"
    deadline = time.time() + 300
    while time.time() < deadline and (not order.is_file() or order.stat().st_size < 64 + 5 * 4 * 4):
        time.sleep(0.5)  # a few steps recorded
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-2000:]  # REQUEUE_EXIT_CODE: checkpoint saved, not finished
    res = json.loads((tmp_path / "term" / "result.json").read_text())
    state = checkpoint.load(tmp_path / "term" / "checkpoints" / "last.pt")
    assert res["steps_done"] == state["step"] > 0
    assert "SIGTERM" in res["error"]


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_sigterm_to_the_process_group_loses_nothing(tmp_path, writer):
    """A TERM to the run's whole process group (what SLURM sends, and gpu.sh's race to the seed it stops) reaches
    the MLflow writer process too. The writer leaves the stop to the training process: the stop checkpoint is
    written and every step's loss is in the store. Before the writer ignored it, the TERM ended it first, the last
    flush failed and the run was recorded as failed (the H100 lease of 2026-12-06, seed 2)."""
    import signal
    import time

    from mlflow.tracking import MlflowClient
    cmd = [sys.executable, "run.py", *BASE, "train.max_steps=2000", "train.ckpt_every=0", "monitor.log_every=1",
           f"tracking.writer={writer}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
           f"results_dir={tmp_path}/results", f"hydra.run.dir={tmp_path}/term"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    order = tmp_path / "term" / "batch_order.bin"
    deadline = time.time() + 300
    while time.time() < deadline and (not order.is_file() or order.stat().st_size < 64 + 5 * 4 * 4):
        time.sleep(0.5)  # a few steps recorded
    time.sleep(2)  # past the writer's start (a signal before its first line of Python still ends it)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-3000:]  # REQUEUE_EXIT_CODE: checkpoint saved, not finished
    res = json.loads((tmp_path / "term" / "result.json").read_text())
    assert res["error"].startswith("stopped by SIGTERM"), res["error"]  # a preemption, not "MLflow logging failed"
    state = checkpoint.load(tmp_path / "term" / "checkpoints" / "last.pt")
    assert res["steps_done"] == state["step"] > 0
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    steps = sorted(m.step for m in c.get_metric_history(res["mlflow_run_id"], "train/loss"))
    assert steps == list(range(res["steps_done"])), (steps[-5:], res["steps_done"])


def test_fork_never_writes_to_its_source_run(ref):
    """A fork pointed at its source's own folder (auto-resume would reopen the source's run) is refused, writing
    nothing: the source's MLflow run, result.json and job.json stay as they were."""
    from mlflow.tracking import MlflowClient
    tmp, ref_res, _ = ref
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    before = c.get_run(ref_res["mlflow_run_id"])
    files = {n: (tmp / "ref" / n).read_bytes() for n in ("result.json", "job.json")}
    p = run(tmp, "ref", f"from_checkpoint={tmp / 'ref' / 'checkpoints' / 'step_15.pt'}", "intervention=fp32",
            check=False)
    assert p.returncode == 1 and "a fork never writes to another run" in p.stdout, p.stdout[-2000:]
    after = c.get_run(ref_res["mlflow_run_id"])
    assert after.data.tags == before.data.tags and after.info.status == before.info.status
    assert {n: (tmp / "ref" / n).read_bytes() for n in files} == files


@pytest.mark.parametrize("ckpt_every", [0, 3])
def test_ctrl_c_says_which_checkpoint_there_is_and_leaves_running(tmp_path, ckpt_every):
    """^C lands mid-step (no checkpoint of its own): the error names the checkpoint a rerun resumes from, or that
    there is none, and the MLflow run's verdict tag is no longer 'running'."""
    import signal
    import time

    from mlflow.tracking import MlflowClient
    cmd = [sys.executable, "run.py", *BASE, "train.max_steps=2000", f"train.ckpt_every={ckpt_every}",
           f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"results_dir={tmp_path}/results",
           f"hydra.run.dir={tmp_path}/int"]
    with open(tmp_path / "out.log", "w") as log:  # a file, not a pipe: nobody reads a pipe while we wait
        # SIGINT back to its default in the child: a suite started in the background inherits it ignored
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    order = tmp_path / "int" / "batch_order.bin"
    deadline = time.time() + 300
    while time.time() < deadline and (not order.is_file() or order.stat().st_size < 64 + 8 * 4 * 4):
        time.sleep(0.5)  # past the first periodic checkpoint when there is one
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=300)
    res = json.loads((tmp_path / "int" / "result.json").read_text())
    says = "no checkpoint was saved (train.ckpt_every=0): a rerun starts from step 0"
    if ckpt_every:  # ^C during the step right after a checkpoint: that one is the run's last step
        saved = checkpoint.load(tmp_path / "int" / "checkpoints" / "last.pt")["step"]
        says = (f"the checkpoint at step {saved} is saved" if saved == res["steps_done"] else
                f"the newest checkpoint is step {saved} ")
    assert "stopped by KeyboardInterrupt" in res["error"] and says in res["error"], res["error"]
    assert "the checkpoint is saved" not in res["error"]
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(res["mlflow_run_id"])
    assert run.data.tags["verdict"] == "failed" and run.info.status == "KILLED"
