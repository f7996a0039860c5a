"""Tracker (async batched MLflow logging, resume, errors), check_tracking, flatten_config and Monitors."""
import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flash_forensics.orchestrator.monitor.monitors import MonitorConfig, Monitors
from flash_forensics.orchestrator.tracking.tracker import (
    PARENT_FILE,
    Tracker,
    TrackingConfig,
    TrackingUnreachable,
    check_tracking,
    find_parent,
    flatten_config,
    write_parent_file,
)
from tests.helpers.procs import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def history(tracker, run_id, key):
    return sorted((int(m.step), m.value) for m in tracker.client.get_metric_history(run_id, key))


def test_many_threads_all_points_arrive_exactly_once_in_batches(uri):
    tr = Tracker(TrackingConfig(uri=uri, flush_interval_s=0.2), "threads", experiment="t-threads")
    calls = []
    real = tr.client.log_batch

    def spy(run_id, metrics=(), **kw):
        calls.append(len(metrics))
        return real(run_id, metrics=metrics, **kw)
    tr.client.log_batch = spy  # the thread writer shares this client
    n_threads, n_steps = 8, 300

    def work(i):
        for s in range(n_steps):
            tr.log_metrics({f"t{i}/x": s * 0.5, "shared": float(i)}, step=i * n_steps + s)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tr.close()
    for i in range(n_threads):
        assert history(tr, tr.run_id, f"t{i}/x") == [(i * n_steps + s, s * 0.5) for s in range(n_steps)]
    shared = history(tr, tr.run_id, "shared")
    assert shared == [(i * n_steps + s, float(i)) for i in range(n_threads) for s in range(n_steps)]
    metric_calls = [c for c in calls if c]
    assert sum(metric_calls) == 2 * n_threads * n_steps == tr.points_logged
    assert max(metric_calls) <= 1000
    assert len(metric_calls) < n_threads * n_steps / 10  # batched, not one request per step
    assert tr.client.get_run(tr.run_id).info.status == "FINISHED"


def test_log_metrics_does_not_wait_for_mlflow(uri):
    tr = Tracker(TrackingConfig(uri=uri, flush_interval_s=0.05), "slow-store", experiment="t-slow")
    real = tr.client.log_batch

    def slow(*a, **kw):
        time.sleep(0.3)
        return real(*a, **kw)
    tr.client.log_batch = slow
    t0 = time.perf_counter()
    for s in range(200):
        tr.log_metrics({"train/loss": 1.0 / (s + 1)}, step=s)
    enqueue = time.perf_counter() - t0
    tr.close()
    assert enqueue < 0.1, enqueue
    assert len(history(tr, tr.run_id, "train/loss")) == 200


def test_resume_continues_the_run_and_skips_duplicate_steps(uri):
    cfg = TrackingConfig(uri=uri)
    first = Tracker(cfg, "resume", experiment="t-resume")
    for s in range(20):
        first.log_metrics({"train/loss": float(s), "wq_sigma/L0.H0": 10.0 + s}, step=s)
    first.log_metrics({"val/loss": 7.0}, step=10)
    first.log_params({"train": {"max_steps": 30}})
    first.close("KILLED")  # e.g. preempted after step 19; the checkpoint was at step 12
    second = Tracker(cfg, "resume", run_id=first.run_id)
    assert second.client.get_run(first.run_id).info.status == "RUNNING"
    second.log_params({"train": {"max_steps": 30}})  # same params again: accepted, not re-sent
    for s in range(13, 30):
        second.log_metrics({"train/loss": 100.0 + s, "wq_sigma/L0.H0": 10.0 + s}, step=s)
        if s == 20:
            second.log_metrics({"val/loss": 6.0}, step=s)
    second.close()
    loss = history(second, first.run_id, "train/loss")
    assert [s for s, _ in loss] == list(range(30))  # contiguous, each step once
    assert loss[19] == (19, 19.0) and loss[20] == (20, 120.0)  # old points kept, new ones appended
    assert [s for s, _ in history(second, first.run_id, "val/loss")] == [10, 20]
    assert second.dropped_points == 2 * 7
    assert second.client.get_run(first.run_id).info.status == "FINISHED"


def test_errors_in_the_logging_thread_are_raised_at_flush(uri):
    tr = Tracker(TrackingConfig(uri=uri, flush_interval_s=0.05), "broken", experiment="t-broken")

    def boom(*a, **kw):
        raise ConnectionError("store went away")
    tr.client.log_batch = boom
    tr.log_metrics({"a": 1.0}, step=0)
    with pytest.raises(RuntimeError, match="store went away"):
        tr.flush()
    with pytest.raises(RuntimeError, match="store went away"):
        tr.close()
    assert tr.client.get_run(tr.run_id).info.status == "FAILED"


def test_parent_run_from_sweep_dir_and_nesting(uri, tmp_path):
    parent = Tracker(TrackingConfig(uri=uri), "sweep", experiment="t-parent", discover_parent=False)
    path = write_parent_file(tmp_path, uri, parent.experiment_id, parent.run_id)
    assert path.name == PARENT_FILE
    found = find_parent(tmp_path)
    assert found == {"tracking_uri": uri, "experiment_id": parent.experiment_id, "run_id": parent.run_id}
    assert find_parent(tmp_path / "missing") is None
    assert find_parent() is None  # not inside a Hydra multirun job
    child = Tracker(TrackingConfig(uri=uri), "child", experiment="t-parent", parent_run_id=found["run_id"],
                    tags={"intervention": "baseline", "expect": "diverges"})
    child.close()
    parent.close()
    tags = child.client.get_run(child.run_id).data.tags
    assert tags["mlflow.parentRunId"] == parent.run_id
    assert (tags["intervention"] == "baseline" and len(tags["git.commit"]) >= 7
            and tags["git.dirty"] in ("true", "false"))


def test_concurrent_processes_share_one_sqlite_store(uri):
    Tracker(TrackingConfig(uri=uri), "init", experiment="t-procs").close()  # the store exists before the jobs
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from flash_forensics.orchestrator.tracking.tracker import Tracker, TrackingConfig\n"
            "t = Tracker(TrackingConfig(uri=%r, flush_interval_s=0.01), sys.argv[1], experiment='t-procs')\n"
            "for s in range(400): t.log_metrics({'x': s}, step=s)\n"
            "t.close(); print(t.run_id)\n") % (str(ROOT), uri)
    procs = [subprocess.Popen([sys.executable, "-c", code, f"p{i}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    probe = Tracker(TrackingConfig(uri=uri), "probe", experiment="t-procs")
    for out, _ in outs:
        assert [s for s, _ in history(probe, out.strip().splitlines()[-1], "x")] == list(range(400))
    probe.close()


def test_unreachable_server_fails_fast_with_advice():
    t0 = time.perf_counter()
    with pytest.raises(TrackingUnreachable, match=r"tracking\.uri='http://127\.0\.0\.1:\d+'.*unreachable"
                                                  r".*scripts/mlflow_server\.sh"):
        check_tracking(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)
    assert time.perf_counter() - t0 < 5


def test_server_that_answers_health_passes():
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{srv.server_address[1]}"
        assert check_tracking(uri, timeout_s=2) == uri
    finally:
        srv.shutdown()


def test_sqlite_default_and_refused_stores(tmp_path):
    assert check_tracking(None).startswith("sqlite:////") and check_tracking(None).endswith("results/mlflow.db")
    assert check_tracking(f"sqlite:///{tmp_path}/sub/m.db") == f"sqlite:///{tmp_path}/sub/m.db"
    with pytest.raises(TrackingUnreachable, match="file store"):
        check_tracking(str(tmp_path / "mlruns"))
    with pytest.raises(TrackingUnreachable, match="file store"):
        check_tracking(f"file://{tmp_path}/mlruns")


def test_flatten_config_dotted_keys_and_limits():
    from omegaconf import OmegaConf
    cfg = OmegaConf.create({"model": {"n_layer": 12, "name": "gpt2_s"}, "x": "${model.n_layer}",
                            "attention": {"overrides": [{"layers": [2], "impl": "flash"}], "heads": [1, 7]},
                            "long": "v" * 7000, "hydra": {"run": {"dir": "."}}, "empty": {}})
    flat = flatten_config(cfg)
    assert flat["model.n_layer"] == "12" and flat["x"] == "12"
    assert flat["attention.overrides.0.layers"] == "[2]" and flat["attention.heads"] == "[1, 7]"
    assert len(flat["long"]) == 6000 and flat["long"].endswith("...")
    assert not any(k.startswith("hydra") for k in flat) and flat["empty"] == "{}"


# -------------------------------------------------------------------------------------------------- Monitors
class FakeTracker:
    def __init__(self):
        self.points = {}

    def log_metrics(self, metrics, step):
        for k, v in metrics.items():
            assert isinstance(v, float), (k, type(v))  # host floats only: the transfer happened in Monitors
            self.points.setdefault(k, []).append((step, v))


@pytest.fixture
def tiny_gpt():
    from flash_forensics.models.gpt import GPT, ModelConfig
    torch.manual_seed(0)
    model = GPT(ModelConfig(name="t", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64),
                {"impl": "flash", "backend": "emulator", "recipe": "paper_bf16", "block_q": 8, "block_k": 8})
    return model


def test_monitors_buffer_on_device_and_flush_in_one_transfer(tiny_gpt, monkeypatch):
    tracker = FakeTracker()
    mon = Monitors(tiny_gpt, MonitorConfig(log_every=4, wq_every=6), tracker)
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3)
    syncs = []
    real_cpu, real_item = torch.Tensor.cpu, torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: syncs.append("cpu") or real_cpu(self, *a, **k))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: syncs.append("item") or real_item(self))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    host_losses, syncs_per_step = [], []
    for step in range(12):  # 0-based like the train loop
        _, loss = tiny_gpt(idx, idx)
        opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(tiny_gpt.parameters(), 1.0)
        opt.step()
        if step == 6:  # sigma_max of layer 1, head 1's W_Q block when the monitors probe it
            w = tiny_gpt.transformer.h[1].attn.c_attn.weight[:32][16:32].detach()
            expected_sigma = torch.linalg.svdvals(w)[0].item()
        n = len(syncs)
        host_losses += mon.step_end(step, loss, gn, lr=1e-3 * step, tokens=32)
        syncs_per_step.append(syncs[n:])
    # inside step_end: one .cpu() per flush, no other host sync
    assert syncs_per_step == [["cpu"] if s in (3, 7, 11) else [] for s in range(12)]
    assert [s for s, _ in host_losses] == list(range(12))
    assert all(isinstance(v, float) and 0 < v < 10 for _, v in host_losses)
    p = tracker.points
    assert [s for s, _ in p["train/loss"]] == list(range(12))
    assert [v for _, v in p["train/lr"]] == pytest.approx([1e-3 * s for s in range(12)])
    assert [s for s, _ in p["train/grad_norm"]] == list(range(12))
    assert [s for s, _ in p["perf/tokens_per_s"]] == [3, 7, 11] and all(v > 0 for _, v in p["perf/tokens_per_s"])
    for layer in range(2):
        assert [s for s, _ in p[f"max_logit/L{layer}"]] == [3, 7, 11]
        for h in range(2):
            assert [s for s, _ in p[f"wq_sigma/L{layer}.H{h}"]] == [0, 6]
            assert [s for s, _ in p[f"rmax_rows/L{layer}.H{h}"]] == [3, 7, 11]
    # the W_Q sigma is the top singular value of the head's block of c_attn
    assert p["wq_sigma/L1.H1"][-1] == (6, pytest.approx(expected_sigma, rel=1e-3))
    assert mon.peak_wq == max(v for k, pts in p.items() if k.startswith("wq_sigma") for _, v in pts)
    # counters are reset at each flush: the interval counts, not a running total
    stats = tiny_gpt.attention_stats()
    assert all(int(s.repeated_max_rows.sum()) == 0 for s in stats)


def test_monitors_counters_count_repeated_maxima_per_interval(monkeypatch):
    from flash_forensics.kernels.stats import AttnStats

    class Model(torch.nn.Module):  # the GPT interface, with counters we control
        def __init__(self):
            super().__init__()
            self.stats = [AttnStats(3), AttnStats(3)]

        def attention_stats(self):
            return self.stats

        def wq_spectral_norms(self):
            return torch.arange(6, dtype=torch.float32).view(2, 3)
    model, tracker = Model(), FakeTracker()
    mon = Monitors(model, MonitorConfig(log_every=2, wq_every=100, max_logit=False), tracker)
    for step in (1, 2, 3, 4):
        model.stats[1].repeated_max_rows += torch.tensor([0, step, 0])
        mon.step_end(step, torch.tensor(2.0), torch.tensor(1.0), 0.1, 10)
    assert tracker.points["rmax_rows/L1.H1"] == [(1, 1.0), (3, 5.0)]  # 0-based steps: flush after 1, 3
    assert tracker.points["rmax_rows/L0.H2"] == [(1, 0.0), (3, 0.0)]
    mon.flush()  # step 4 was still buffered
    assert tracker.points["rmax_rows/L1.H1"][-1] == (4, 4.0)
    assert not any(k.startswith("max_logit") for k in tracker.points)
    assert "wq_sigma/L0.H0" not in tracker.points  # step 100 never reached
    mon.log_val(4, torch.tensor(2.5))
    assert tracker.points["val/loss"] == [(4, 2.5)]


def test_max_logit_logged_only_where_measured():
    from flash_forensics.kernels.stats import AttnStats

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stats = [AttnStats(2), AttnStats(2)]

        def attention_stats(self):
            return self.stats
    model, tracker = Model(), FakeTracker()
    mon = Monitors(model, MonitorConfig(log_every=1, wq_every=10), tracker)
    model.stats[0].max_logit.fill_(3.5)  # layer 1 never ran a measuring kernel (e.g. sdpa without probe)
    mon.step_end(0, torch.tensor(2.0), torch.tensor(1.0), 0.1, 10)
    assert tracker.points["max_logit/L0"] == [(0, 3.5)] and "max_logit/L1" not in tracker.points
    assert float(model.stats[0].max_logit) == -float("inf")  # reset for the next interval


@pytest.mark.gpu
def test_monitors_never_sync_between_flushes_on_cuda():
    from flash_forensics.models.gpt import GPT, ModelConfig
    model = GPT(ModelConfig(name="t", n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=128),
                {"impl": "flash"}).cuda()
    mon = Monitors(model, MonitorConfig(log_every=4, wq_every=3), FakeTracker())
    idx = torch.randint(0, 128, (2, 64), device="cuda")
    flushed = []
    for step in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        model.zero_grad(set_to_none=True)
        if (step + 1) % 4:
            torch.cuda.set_sync_debug_mode("error")  # any host sync inside step_end raises
        try:
            flushed += mon.step_end(step, loss, gn, 1e-3, 128)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [s for s, _ in flushed] == list(range(8))


def test_crash_without_close_keeps_every_point(uri):
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from flash_forensics.orchestrator.tracking.tracker import Tracker, TrackingConfig\n"
            "t = Tracker(TrackingConfig(uri=%r, flush_interval_s=60), 'crash', experiment='t-crash')\n"
            "print(t.run_id, flush=True)\n"
            "for s in range(500): t.log_metrics({'train/loss': s}, step=s)\n"
            "raise RuntimeError('boom')\n") % (str(ROOT), uri)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "boom" in proc.stderr
    probe = Tracker(TrackingConfig(uri=uri), "probe", experiment="t-crash")
    rid = proc.stdout.split()[0]
    assert [s for s, _ in history(probe, rid, "train/loss")] == list(range(500))  # flushed at exit
    assert probe.client.get_run(rid).info.status == "FAILED"
    probe.close()


def test_process_writer_delivers_exactly_once_and_resumes(uri):
    """writer=process: MLflow's work in a spawned process (off the trainer's GIL), same guarantees."""
    cfg = TrackingConfig(uri=uri, flush_interval_s=0.1, writer="process")
    tr = Tracker(cfg, "proc", experiment="t-proc")
    for s in range(700):
        tr.log_metrics({"train/loss": float(s), "rmax_rows/L0.H0": torch.tensor(2.0)}, step=s)
    tr.flush()
    assert tr.points_logged == 1400
    tr.close("KILLED")
    again = Tracker(cfg, "proc", run_id=tr.run_id)
    for s in range(650, 720):
        again.log_metrics({"train/loss": -1.0}, step=s)
    again.close()
    assert again.dropped_points == 50
    loss = history(again, tr.run_id, "train/loss")
    assert [s for s, _ in loss] == list(range(720)) and loss[699] == (699, 699.0) and loss[700] == (700, -1.0)
    assert again.client.get_run(tr.run_id).info.status == "FINISHED"


def test_process_writer_outlives_stop_signals_and_not_its_trainer(tmp_path):
    """writer=process: a TERM or INT sent to the writer (as to a whole process group) leaves it running, and the
    run's points all arrive; when the training process is killed (-9) the writer posts what it holds and exits
    instead of waiting forever for a stop."""
    import os
    import signal
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    code = ("import os, signal, sys, time; sys.path.insert(0, %r)\n"
            "from flash_forensics.orchestrator.tracking.tracker import Tracker, TrackingConfig\n"
            "if __name__ == '__main__':\n"
            "    t = Tracker(TrackingConfig(uri=%r, flush_interval_s=0.2, writer='process'), 'sig', experiment='t')\n"
            "    t.flush()\n"
            "    print(t.run_id, t._worker.pid, flush=True)\n"
            "    sys.stdin.readline()\n"  # the test signals the writer meanwhile
            "    for s in range(300): t.log_metrics({'train/loss': float(s)}, step=s)\n"
            "    t.flush()\n"
            "    for s in range(300, 310): t.log_metrics({'train/loss': float(s)}, step=s)\n"
            "    time.sleep(1)\n"  # posted by the writer's timer (0.2 s), not by a flush
            "    print('logged', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n") % (str(ROOT), uri)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    run_id, pid = proc.stdout.readline().split()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        os.kill(int(pid), sig)
    time.sleep(0.5)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and "logged" in out, err[-3000:]
    deadline = time.time() + 30
    while time.time() < deadline and _running(int(pid)):
        time.sleep(0.2)
    assert not _running(int(pid)), "the writer outlived its killed training process"
    probe = Tracker(TrackingConfig(uri=uri), "probe", experiment="t")
    assert [s for s, _ in history(probe, run_id, "train/loss")] == list(range(310))
    probe.close()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by whoever adopts it, perhaps later)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_process_writer_surfaces_errors(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tr = Tracker(TrackingConfig(uri=uri, writer="process"), "gone", experiment="t-proc-err")
    tr.log_metrics({"x": float("nan"), "k" * 300: 1.0}, step=0)  # NaN is fine; this key is truncated, fine
    tr.client.delete_run(tr.run_id)  # logging to a deleted run fails inside the writer process
    tr.log_metrics({"x": 1.0}, step=1)
    with pytest.raises(RuntimeError, match="(?i)deleted|active"):
        tr.close()
