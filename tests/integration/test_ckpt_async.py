"""train.ckpt_async on a real job (CPU, the smoke model): the step loop goes on while the periodic checkpoint is
written, the files hold what the synchronous write holds, and a write that fails ends the run with the sentence
that names the file. kill -9 during a background write, then resume: tests/integration/test_faults.py
(checkpoint_write, now on the writer's thread by default)."""
import errno
import threading

import pytest
import torch

from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.job import train as train_mod
from tests.helpers import jobs

BASE = ["experiment=smoke", "model.n_layer=1", "model.n_embd=32", "train.max_steps=6", "train.ckpt_every=2",
        "train.eval_every=0", "train.keep_checkpoints=0", "monitor.log_every=2", "monitor.wq_every=2",
        "tracking.writer=thread", "tracking.system_metrics=false"]


def _steps(job_dir):
    return {s: checkpoint.load(p) for s, p in checkpoint.step_files(job_dir / "checkpoints").items()}


def test_async_checkpoints_hold_what_the_synchronous_ones_hold(tmp_path):
    a = jobs.run_in(BASE, tmp_path, "async", "train.ckpt_async=true")
    s = jobs.run_in(BASE, tmp_path, "sync", "train.ckpt_async=false")
    assert a["error"] is None and s["error"] is None and a["final_loss"] == s["final_loss"]
    fa, fs = _steps(tmp_path / "async"), _steps(tmp_path / "sync")
    assert sorted(fa) == sorted(fs) == [2, 4, 6]
    for k in fa:
        assert fa[k]["step"] == fs[k]["step"] == k
        for name, t in fs[k]["model"].items():
            assert torch.equal(fa[k]["model"][name], t), (k, name)
        for i, st in fs[k]["optimizer"]["state"].items():
            for name, t in st.items():
                assert torch.equal(fa[k]["optimizer"]["state"][i][name], t), (k, i, name)
        assert fa[k]["detector"] == fs[k]["detector"] and fa[k]["rng"]["python"] == fs[k]["rng"]["python"]


@pytest.mark.parametrize("async_,waited,hold_s", [(True, False, 60), (False, True, 3)])
def test_the_loop_goes_on_while_the_checkpoint_is_written(tmp_path, monkeypatch, async_, waited, hold_s):
    """The write of step_2.pt holds until the loop has started step 3: with ckpt_async it does, without it the
    loop is stuck in the write (the hold then gives up, after hold_s, and says so: long where the loop goes on,
    whatever the machine's load; short where it cannot)."""
    real = checkpoint.save_step
    next_step, said = threading.Event(), []

    def held(ckpt_dir, step, *a, **k):
        if step == 2:
            said.append("loop waited for the write" if not next_step.wait(hold_s) else "loop went on")
        return real(ckpt_dir, step, *a, **k)

    real_kill = train_mod.Job._maybe_kill

    def step_start(self, step, where):
        if where == "step_start" and step >= 3:
            next_step.set()
        return real_kill(self, step, where)

    monkeypatch.setattr(checkpoint, "save_step", held)
    monkeypatch.setattr(train_mod.Job, "_maybe_kill", step_start)
    r = jobs.run_in(BASE, tmp_path, "job", f"train.ckpt_async={str(async_).lower()}")
    assert r["error"] is None and sorted(checkpoint.step_files(tmp_path / "job" / "checkpoints")) == [2, 4, 6]
    assert said == ["loop waited for the write" if waited else "loop went on"]


def test_a_failed_background_write_ends_the_run_naming_the_file(tmp_path, monkeypatch):
    """ENOSPC simulated on the writer's thread only (the crash path's own checkpoint, written in the loop, works):
    the run fails with the checkpoint's one sentence, long before its last step."""
    real = checkpoint._HashingWriter.write

    def full(self, b):
        if threading.current_thread().name == "ff-checkpoint-writer":
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return real(self, b)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", full)
    r = jobs.run_in(BASE + ["train.max_steps=40"], tmp_path, "job")
    assert r["observed"] == "failed", r
    assert f"cannot write checkpoint {tmp_path / 'job' / 'checkpoints' / 'step_2.pt'}: the disk is full (ENOSPC)" in \
        r["error"]
    assert r["steps_done"] < 40
    assert not checkpoint.step_files(tmp_path / "job" / "checkpoints")
    assert (tmp_path / "job" / "checkpoints" / "crash.pt").is_file()  # the crash path still saved the weights
