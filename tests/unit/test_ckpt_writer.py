"""orchestrator/job/ckpt_writer.py: periodic checkpoints written by a thread while the step loop goes on
(train.ckpt_async). The snapshot is taken at the step boundary (later in-place updates never reach it), one write
is in flight at a time, and a write's failure is raised in the loop, never lost with its thread."""
import threading

import pytest
import torch

from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.job.ckpt_writer import CheckpointWriter, HostSnapshot


def _state():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {"model": {"w": w, "tied": w}, "optimizer": {"state": {0: {"exp_avg": torch.ones(4)}}, "param_groups":
            [{"lr": 1e-3, "params": [0]}]}, "detector": {"losses": [1.0, 2.0]}, "step": 5}


def test_snapshot_is_the_state_at_the_step_boundary():
    s = _state()
    host, events = HostSnapshot().take(s)
    assert events == []  # no CUDA tensor: nothing to wait for
    s["model"]["w"].add_(100)  # the optimizer's in-place update of the next step
    s["optimizer"]["state"][0]["exp_avg"].mul_(0)
    s["detector"]["losses"].append(3.0)  # the detector goes on in the loop
    assert torch.equal(host["model"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert host["model"]["tied"] is host["model"]["w"]  # a tensor shared in the state is one tensor in the copy
    assert torch.equal(host["optimizer"]["state"][0]["exp_avg"], torch.ones(4))
    assert host["detector"]["losses"] == [1.0, 2.0] and host["step"] == 5


def test_tied_weights_are_one_tensor_in_the_copy_and_one_storage_in_the_file(tmp_path):
    """An embedding tied to the output layer: state_dict gives two objects over one memory; torch.save writes it once,
    and so must the copy (it was written twice: 10% more bytes for GPT-2S)."""
    emb = torch.nn.Embedding(1000, 64)
    head = torch.nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight
    state = torch.nn.ModuleDict({"wte": emb, "lm_head": head}).state_dict()
    assert state["wte.weight"] is not state["lm_head.weight"]
    host, _ = HostSnapshot().take(state)
    assert host["wte.weight"] is host["lm_head.weight"]
    checkpoint.save(tmp_path / "orig.pt", state)
    checkpoint.save(tmp_path / "copy.pt", host)
    assert abs((tmp_path / "copy.pt").stat().st_size - (tmp_path / "orig.pt").stat().st_size) < 4096


def test_a_strided_or_expanded_tensor_is_copied_by_value():
    base = torch.arange(12.0).reshape(3, 4)
    state = {"t": base.t(), "e": torch.ones(1, 4).expand(3, 4)}  # a transpose, and stride 0 rows
    host, _ = HostSnapshot().take(state)
    base.add_(1)
    assert torch.equal(host["t"], torch.arange(12.0).reshape(3, 4).t()) and torch.equal(host["e"], torch.ones(3, 4))


def test_snapshot_saves_and_loads_like_the_state(tmp_path):
    s = _state()
    host, _ = HostSnapshot().take(s)
    checkpoint.save(tmp_path / "a.pt", s)
    checkpoint.save(tmp_path / "b.pt", host)
    a, b = checkpoint.load(tmp_path / "a.pt"), checkpoint.load(tmp_path / "b.pt")
    assert torch.equal(a["model"]["w"], b["model"]["w"]) and a["detector"] == b["detector"]
    assert torch.equal(a["optimizer"]["state"][0]["exp_avg"], b["optimizer"]["state"][0]["exp_avg"])


def test_the_loop_goes_on_while_a_write_runs_and_the_next_save_waits_for_it():
    w = CheckpointWriter()
    release, order = threading.Event(), []

    def slow(state):
        release.wait(10)
        order.append(("written", state["step"]))

    w.submit(slow, {"step": 1})
    assert w.busy  # submit returned with the write still running
    order.append(("loop", 2))
    w.check()  # not finished: check neither waits nor raises
    release.set()
    w.submit(lambda s: order.append(("written", s["step"])), {"step": 3})  # waits for the first write
    w.wait()
    assert order == [("loop", 2), ("written", 1), ("written", 3)] and not w.busy


def test_a_failed_write_is_raised_once_in_the_loop():
    w = CheckpointWriter()

    def full(state):
        raise OSError(28, "No space left on device")

    w.submit(full, {"step": 1})
    w._thread.join()  # ended (however loaded the machine): check raises only then
    with pytest.raises(OSError, match="No space left"):
        w.check()
    w.check()  # raised once: the crash path's own save is not refused for it
    w.submit(full, {"step": 2})
    err = w.settle()  # the failing path: returned, not raised
    assert isinstance(err, OSError) and w.settle() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tensors need a GPU")
def test_cuda_state_goes_to_reused_page_locked_buffers():
    snap = HostSnapshot()
    t = torch.randn(1 << 20, device="cuda")
    before = t.cpu()
    host, events = snap.take({"w": t})
    t.add_(1)  # queued after the copy on the same stream
    for ev in events:
        ev.synchronize()
    assert len(events) == 1 and host["w"].is_pinned() and torch.equal(host["w"], before)
    again, events = snap.take({"w": t})
    for ev in events:
        ev.synchronize()
    assert again["w"].data_ptr() == host["w"].data_ptr() and torch.equal(again["w"], t.cpu())
