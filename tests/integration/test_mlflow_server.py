"""The shared tracking server (scripts/mlflow_server.sh): many jobs logging at once lose and duplicate nothing."""
import subprocess
from pathlib import Path

import pytest

from tests.helpers.procs import forkserver, free_port, gather, write_metrics

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mlflow_server.sh"
N_PROCS = 8
N_STEPS = 150
KEYS = ("train/loss", "train/grad_norm", "wq_sigma/L0.H0")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-shared")
    port = free_port()
    args = ["bash", str(SCRIPT), "start", "--port", str(port), "--root", str(root)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        yield {"uri": f"http://127.0.0.1:{port}", "root": root, "port": port}
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", "--port", str(port), "--root", str(root)], timeout=60)


def test_status_and_artifacts_on_the_shared_root(server):
    res = subprocess.run(["bash", str(SCRIPT), "status", "--port", str(server["port"]), "--root",
                          str(server["root"])], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "up" in res.stdout
    assert (server["root"] / "mlflow.db").is_file()  # the database backend lives on the shared root
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server["uri"])
    exp = client.create_experiment("artifact-check")
    run = client.create_run(exp)
    f = server["root"] / "note.txt"
    f.write_text("shared")
    client.log_artifact(run.info.run_id, str(f))
    stored = list((server["root"] / "artifacts").rglob("note.txt"))
    assert stored and stored[0].read_text() == "shared"


def test_eight_concurrent_writers_lose_and_duplicate_nothing(server):
    ctx = forkserver()
    barrier, out = ctx.Barrier(N_PROCS), ctx.Queue()
    procs = [ctx.Process(target=write_metrics, args=(server["uri"], i, barrier, out, N_STEPS, KEYS))
             for i in range(N_PROCS)]
    results = gather(procs, out, 180)
    assert [p.exitcode for p in procs] == [0] * N_PROCS
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server["uri"])
    assert len({r[1] for r in results}) == N_PROCS
    total = 0
    for idx, run_id, posted in results:
        assert posted == N_STEPS * len(KEYS)
        for key in KEYS:
            hist = client.get_metric_history(run_id, key)
            steps = [m.step for m in hist]
            assert sorted(steps) == list(range(N_STEPS)), f"run {idx} {key}: lost or duplicated steps"
            assert all(m.value == idx * 100000 + m.step for m in hist), f"run {idx} {key}: a value landed elsewhere"
            total += len(hist)
    assert total == N_PROCS * N_STEPS * len(KEYS)


def test_unreachable_server_is_a_clear_error():
    from flash_forensics.orchestrator.tracking.tracker import TrackingUnreachable, check_tracking

    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingUnreachable, match="unreachable"):
        check_tracking(uri, timeout_s=2)
