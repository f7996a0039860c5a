"""Data parallel: rank/world discovery (torchrun, SLURM, submitit local), the ranks' agreement on preemption, and
the main claim: 2-process gloo DDP gives the loss curve of 1 process with grad_accum 2 (same global batch, FP32)."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flash_forensics.orchestrator.job import distributed as D
from tests.helpers.procs import free_port, gather

ROOT = Path(__file__).resolve().parents[2]
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID",
             "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SUBMITIT_LOCAL_NTASKS",
             "SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_LOCALID")


@pytest.fixture
def clean_env(monkeypatch):
    for v in DIST_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_single_process_needs_no_process_group(clean_env):
    info = D.init_distributed(D.DistConfig(), device="cpu")
    assert (info.rank, info.world_size, info.is_main, info.distributed) == (0, 1, True, False)
    assert info.backend is None


def test_torchrun_env_wins_over_slurm(clean_env):
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}.items():
        clean_env.setenv(k, v)
    assert D.detect_env() == {"rank": 3, "local_rank": 1, "world_size": 4, "source": "torchrun"}


def test_slurm_tasks_inside_a_step(clean_env):
    for k, v in {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}.items():
        clean_env.setenv(k, v)
    assert D.detect_env() == {"rank": 5, "local_rank": 1, "world_size": 8, "source": "slurm"}
    clean_env.delenv("SLURM_STEP_ID")  # the batch script itself is not a rank
    assert D.detect_env()["world_size"] == 1


def test_submitit_local_tasks(clean_env):
    for k, v in {"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1"}.items():
        clean_env.setenv(k, v)
    assert D.detect_env() == {"rank": 1, "local_rank": 1, "world_size": 2, "source": "submitit_local"}


def test_rendezvous_from_slurm(clean_env):
    assert D.slurm_master_port("123456") == 20000 + 123456 % 20000
    assert D.slurm_master_port("77_3") == 20000 + 773 % 20000  # array ids: digits only, stable per task
    if subprocess.run(["which", "scontrol"], capture_output=True).returncode == 0:
        assert D.slurm_master_addr("node[07-09],gpu1") == "node07"


def test_global_batch_is_split_over_ranks():
    assert D.micro_steps_per_rank(8, 2) == 4
    with pytest.raises(D.DistError, match=r"train.grad_accum=3 .* multiple"):
        D.micro_steps_per_rank(3, 2)
    assert sorted(D.global_micro(m, r, 2) for m in range(2) for r in range(2)) == [0, 1, 2, 3]
    with pytest.raises(D.DistError, match="dist.backend"):
        D.DistConfig(backend="mpi").validate()


def test_a_group_that_cannot_be_destroyed_is_said_not_raised(monkeypatch, capsys):
    """cleanup runs in the job's finally: an error there must not stand in for the job's own."""
    import torch.distributed as dist

    def broken():
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", broken)
    D.cleanup(D.DistInfo(rank=1, world_size=2, owns_group=True))
    assert "rank 1: the process group could not be destroyed: connection reset by peer" in capsys.readouterr().out
    D.cleanup(D.DistInfo(rank=1, world_size=2, owns_group=False))  # not ours: not touched, nothing said
    assert capsys.readouterr().out == ""


def _agree_worker(rank, world, port, q):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from flash_forensics.orchestrator.job.distributed import DistConfig, cleanup, init_distributed
    from flash_forensics.orchestrator.job.preemption import PreemptionGuard

    info = init_distributed(DistConfig(timeout_s=60), device="cpu")
    guard = PreemptionGuard(signals=[signal.SIGUSR2], dist_info=info, check_every=2).install()
    stopped = None
    for step in range(40):
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGUSR2)  # only one rank is told
        if guard.should_stop(step):
            stopped = step
            break
    guard.uninstall()
    q.put((rank, stopped))
    cleanup(info)


def test_ranks_agree_on_the_preemption_step():
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_agree_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: 6, 1: 6}  # signal at step 5 on rank 1, next agreement at step 6, on both ranks


def _job_worker(rank, world, port, port2, tmp, q):
    """A 2-step job in this rank's process; then what is left of the process group, and a caller's own group."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from flash_forensics.orchestrator.job.distributed import DistConfig, cleanup, init_distributed
    from tests.helpers.jobs import run_in

    try:
        result = run_in(["experiment=smoke", "intervention=fp32"], Path(tmp), "job", "train.max_steps=2",
                        "train.warmup_steps=0", "train.eval_every=0", "train.ckpt_every=0", "monitor.log_every=1")
        after_job = dist.is_initialized()
        # the caller's own group, on a store of its own (the job's may not be gone on the other rank yet)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rank, world_size=world)
        info = init_distributed(DistConfig(timeout_s=60), device="cpu")
        cleanup(info)
        kept = dist.is_initialized()
        dist.destroy_process_group()
        q.put((rank, (result.get("error"), after_job, info.owns_group, kept)))
    except BaseException as e:  # the test reports it rather than waiting for the queue's timeout
        q.put((rank, repr(e)))


def test_a_ranks_job_destroys_the_process_group_it_made_and_only_that(tmp_path):
    """Left to the interpreter's exit, a gloo group aborted a finished rank (SIGABRT) and failed its torchrun."""
    import torch.multiprocessing as mp

    ports = [free_port(), free_port()]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_job_worker, args=(r, 2, *ports, str(tmp_path), q)) for r in range(2)]
    got = dict(gather(procs, q, 240))
    # the job's own group gone on both ranks; a group the caller made survives init_distributed + cleanup
    assert got == {0: (None, False, False, True), 1: (None, False, False, True)}, got
    assert [p.exitcode for p in procs] == [0, 0]


def _loss_curve(db: Path, run_id: str):
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT step, value FROM metrics WHERE run_uuid = ? AND key = 'train/loss' "
                           "ORDER BY step", (run_id,)).fetchall()
    finally:
        con.close()
    return rows


def test_two_rank_ddp_equals_one_rank_with_grad_accum(tmp_path):
    """torchrun --nproc_per_node 2 (gloo) vs one process, grad_accum 2, FP32: the same loss curve."""
    from flash_forensics.orchestrator.data import DataConfig, ensure_prepared

    ensure_prepared(DataConfig(), 50304)  # once, before two ranks start
    db = tmp_path / "m.db"
    common = ["experiment=smoke", "intervention=fp32", "train.precision=fp32", "train.max_steps=8",
              "train.grad_accum=2", "train.eval_every=0", "train.ckpt_every=0", "monitor.log_every=4",
              f"results_dir={tmp_path}", f"tracking.uri=sqlite:///{db}", "name=ddp_test"]
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "run.py", *common, f"hydra.run.dir={tmp_path}/one"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "run.py", *common, f"hydra.run.dir={tmp_path}/two"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    r1 = json.loads((tmp_path / "one" / "result.json").read_text())
    r2 = json.loads((tmp_path / "two" / "result.json").read_text())
    assert r1["error"] is None and r2["error"] is None, (r1["error"], r2["error"])
    a, b = _loss_curve(db, r1["mlflow_run_id"]), _loss_curve(db, r2["mlflow_run_id"])
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(8))  # rank 0 logged every step, once
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    print(f"2-rank DDP vs 1-rank grad_accum 2: max |loss diff| over {len(a)} steps = {diff:.3g}")
    assert diff < 1e-4, f"DDP and grad-accum loss curves differ by {diff}"
    assert a[0][1] != a[-1][1]  # it trained
    # only rank 0 recorded: one run per launch in the experiment
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    n_runs = con.execute("SELECT count(*) FROM runs").fetchone()[0]
    con.close()
    assert n_runs == 2


@pytest.mark.gpu
def test_two_gpu_ddp_matches_grad_accum_to_bf16_noise(tmp_path):
    """On 2 GPUs, BF16 AMP: same curve as 1 GPU with grad accumulation, up to BF16 rounding noise."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_ddp", ROOT / "benchmarks" / "ddp.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--steps", "40", "--workdir", str(tmp_path), "--no-write"])
    assert res["steps_compared"] == 40 and not res["steps_missing"]
    assert res["max_abs_loss_diff_first_10pct"] < 0.02, res
    assert res["max_abs_loss_diff"] < 0.1, res
