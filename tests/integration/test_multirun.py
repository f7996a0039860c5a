"""End to end through `python run.py -m ...` (the basic launcher): MLflow runs under one parent, the monitors'
metrics at the steps they should be at, verdict tags, report files; a bad sweep launches nothing. (A forced NaN
diverges, stops early and the sweep goes on: tests/integration/test_record.py, on the smoke sweep it runs anyway.)"""
import json
import math
from pathlib import Path

from tests.helpers import jobs as _jobs

ROOT = Path(__file__).resolve().parents[2]


def run_cli(tmp_path, *args, timeout=600):
    return _jobs.run_cli(tmp_path, *args, timeout=timeout)


def client(tmp_path):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")


def all_runs(tmp_path):
    c = client(tmp_path)
    return [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id])]


def steps(c, run_id, key):
    return [m.step for m in sorted(c.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_multirun_three_interventions(tmp_path):
    p = run_cli(tmp_path, "-m", "experiment=smoke", "intervention=baseline,fp32,sfa")
    assert p.returncode == 0, p.stderr[-3000:]
    c = client(tmp_path)
    runs = all_runs(tmp_path)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 3
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert sorted(r.data.tags["intervention"] for r in children) == ["baseline", "fp32", "sfa"]
    for r in children:
        rid = r.info.run_id
        assert r.info.status == "FINISHED"
        assert r.data.tags["verdict"] in ("stable", "diverged")
        assert r.data.tags["expected"] in ("stable", "diverges")
        assert r.data.params["intervention.name"] == r.data.tags["intervention"]
        assert steps(c, rid, "train/loss") == list(range(20))  # every step, once
        assert steps(c, rid, "train/grad_norm") == list(range(20))
        assert steps(c, rid, "train/lr") == list(range(20))
        assert steps(c, rid, "val/loss") == [9, 19]  # eval_every 10 (and the end)
        assert steps(c, rid, "wq_sigma/L1.H3") == [0, 5, 10, 15]  # wq_every 5
        for key in ("rmax_rows/L0.H0", "rmax_rows/L1.H3", "max_logit/L1", "perf/tokens_per_s"):
            s = steps(c, rid, key)
            assert s and s[-1] == 19 and len(s) == len(set(s)), key
        hist = c.get_metric_history(rid, "train/loss")
        assert all(math.isfinite(m.value) for m in hist)
    sfa = next(r for r in children if r.data.tags["intervention"] == "sfa")
    assert "stabilized" in sfa.data.params["attention_effective.softmax"]
    # which code computed each layer is a param (CPU: the emulator)
    assert [sfa.data.params[f"attention_route.L{i}"] for i in range(2)] == ["flash/emulator/paper_bf16+sfa(beta=2)"] * 2
    # the report: one row per run
    report, = (tmp_path / "results" / "smoke").glob("*/report")  # in the dated sweep folder
    doc = json.loads((report / "verdicts.json").read_text())
    assert sorted(r["intervention"] for r in doc["runs"]) == ["baseline", "fp32", "sfa"]
    assert all(r["observed"] in ("stable", "diverged") for r in doc["runs"])
    assert (report / "verdicts.md").is_file()
    assert list(report.rglob("*.png"))
    # each job wrote result.json with the contract's keys
    results = sorted((tmp_path / "results" / "smoke").glob("*/*/result.json"))
    assert len(results) == 3
    for f in results:
        res = json.loads(f.read_text())
        for key in ("intervention", "overrides", "expected", "observed", "divergence_step", "final_loss",
                    "min_loss", "peak_wq_norm", "peak_wq_where", "mlflow_run_id", "steps_done", "error", "wall_s",
                    "attention_routes"):
            assert key in res, key
        assert res["steps_done"] == 20 and res["error"] is None
        assert (f.parent / "checkpoints" / "last.pt").is_file()
        assert (f.parent / "batch_order.bin").is_file()


def test_bad_sweep_launches_nothing(tmp_path):
    p = run_cli(tmp_path, "-m", "experiment=smoke", "intervention=baseline,head_upcast", "intervention.heads=[0,9]")
    assert p.returncode != 0
    assert "intervention.heads=[0, 9]" in p.stderr and "0..3" in p.stderr
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").rglob("result.json"))
    assert not list((tmp_path / "results").rglob("*/0")) if (tmp_path / "results").exists() else True
    db = tmp_path / "mlflow.db"
    assert not db.exists() or not all_runs(tmp_path)


def test_unknown_intervention_cli(tmp_path):
    p = run_cli(tmp_path, "-m", "experiment=smoke", "intervention=baseline,nope")
    assert p.returncode != 0
    assert "Could not find 'intervention/nope'" in p.stderr
    assert not (tmp_path / "mlflow.db").exists() or not all_runs(tmp_path)
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").rglob("result.json"))


def test_a_single_run_with_a_layer_its_intervention_ignores_launches_nothing(tmp_path):
    p = run_cli(tmp_path, "experiment=smoke", "intervention=sfa", "intervention.layer=1")
    assert p.returncode != 0
    assert "intervention.layer=1 is not allowed with intervention=sfa: its file takes no layer" in p.stderr
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").rglob("result.json"))


def test_a_run_given_another_runs_folder_writes_nothing_there(tmp_path):
    """A finished run's folder given again (hydra.run.dir) with another model shape, or fewer steps than its
    checkpoint holds: refused before anything is written, its result.json and report as they were."""
    job = tmp_path / "job"
    common = ["experiment=smoke", "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=0",
              f"hydra.run.dir={job}"]
    p = run_cli(tmp_path, *common)
    assert p.returncode == 0, p.stderr[-2000:]
    before = {f: (job / f).read_bytes() for f in ("result.json", "job.json", "report/verdicts.json")}
    for extra, needle in ((["model.n_embd=128"], "another model shape (n_embd: checkpoint 64 vs this run 128)"),
                          (["train.max_steps=2", "train.warmup_steps=0"], "past this run's train.max_steps=2")):
        p = run_cli(tmp_path, *common, *extra)
        assert p.returncode == 1 and needle in p.stdout, p.stdout[-2000:]
        assert {f: (job / f).read_bytes() for f in before} == before


def test_unfinished_twins_are_the_dead_same_command_folders_with_a_checkpoint(tmp_path):
    import json
    import socket

    from flash_forensics.orchestrator.launch.task import unfinished_twins
    runs = tmp_path / "runs"

    def job(name, overrides, pid=2 ** 22 + 7, ckpt=True, result=False):
        d = runs / name
        (d / "checkpoints").mkdir(parents=True)
        if ckpt:
            (d / "checkpoints" / "last.pt").write_bytes(b"x")
        (d / "job.json").write_text(json.dumps({"overrides": overrides, "pid": pid, "host": socket.gethostname()}))
        if result:
            (d / "result.json").write_text("{}")
        return d

    ov = ["experiment=smoke", "train.max_steps=400"]
    killed = job("a", ov)
    job("b", ov, result=True)  # finished
    job("c", ov, ckpt=False)  # died before its first checkpoint
    job("d", ["experiment=smoke"])  # another command
    import os
    job("e", ov, pid=os.getppid())  # still running
    fresh = runs / "new"
    fresh.mkdir()
    assert unfinished_twins(fresh, ov) == [killed]
    assert unfinished_twins(killed, ov) == []  # a folder with checkpoints resumes itself


def test_a_sweep_folder_started_again_keeps_its_parent_run(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "experiment=smoke", "train.max_steps=2", "train.warmup_steps=0", "train.eval_every=0",
            "intervention=baseline", f"hydra.sweep.dir={sweep}"]
    for _ in range(2):  # e.g. after a kill -9: the same command, the same sweep folder
        p = run_cli(tmp_path, *args)
        assert p.returncode == 0, p.stderr[-2000:]
    assert "reopened" in p.stdout
    c = client(tmp_path)
    parents = [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id])
               if r.data.tags.get("role") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
