"""Training-loop parts on the CPU: sdpa layers log the max logit (an extra QK^T pass on the monitors'
flush steps only), and a bad train.compile launches nothing."""
from pathlib import Path

from tests.helpers import jobs as _jobs

ROOT = Path(__file__).resolve().parents[2]


def run_cli(tmp_path, *args, timeout=600):
    return _jobs.run_cli(tmp_path, *args, timeout=timeout)


def test_sdpa_run_logs_max_logit_on_flush_steps(tmp_path):
    from mlflow.tracking import MlflowClient
    p = run_cli(tmp_path, "experiment=smoke", "attention.impl=sdpa", "train.max_steps=10", "train.eval_every=0",
                "train.ckpt_every=0", "tracking.writer=thread")
    assert p.returncode == 0, p.stderr[-3000:]
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id])]
    assert len(runs) == 1
    rid = runs[0].info.run_id
    assert runs[0].data.params["attention_route.L0"].startswith("sdpa/")
    for layer in (0, 1):
        hist = sorted(c.get_metric_history(rid, f"max_logit/L{layer}"), key=lambda m: m.step)
        assert [m.step for m in hist] == [4, 9]  # log_every 5: the probe runs on the steps that flush
        assert all(0 < m.value < 100 for m in hist)


def test_bad_train_compile_launches_nothing(tmp_path):
    p = run_cli(tmp_path, "experiment=smoke", "train.compile=sometimes")
    assert p.returncode != 0
    assert "train.compile='sometimes'" in p.stderr + p.stdout
    assert not (tmp_path / "mlflow.db").exists() or not list((tmp_path / "results").rglob("result.json"))
