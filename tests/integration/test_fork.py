"""Forking an intervention from a checkpoint of another run (from_checkpoint=PATH): the same intervention reproduces
the source exactly from the fork step on, in a new MLflow run tagged with where it came from; another intervention
sees the same batches and gives another curve; a multirun forks every intervention; bad forks launch nothing."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flash_forensics.orchestrator.config.schema  # noqa: F401
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config
from flash_forensics.orchestrator.job import checkpoint, fork
from tests.helpers import jobs as _jobs

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
BASE = ["experiment=smoke", "train.ckpt_every=4", "train.keep_checkpoints=3", "train.early_stop=false",
        "train.eval_every=8"]


def compose_cfg(tmp_path, *overrides):
    return _jobs.compose_cfg(BASE, tmp_path, *overrides)


def job(tmp_path, name, *overrides):
    return _jobs.run_in(BASE, tmp_path, name, *overrides)


def client(tmp_path):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")


def history(tmp_path, run_id, key):
    hist = client(tmp_path).get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """One baseline smoke run of 20 steps, checkpoints every 4 (step_4 ... step_20, the newest 3 kept)."""
    tmp = tmp_path_factory.mktemp("fork")
    res = job(tmp, "source", "intervention=baseline")
    assert res["error"] is None, res["error"]
    return tmp, res


def test_checkpoints_are_kept_per_step(source):
    tmp, res = source
    d = tmp / "source" / "checkpoints"
    assert sorted(checkpoint.step_files(d)) == [12, 16, 20]  # keep_checkpoints=3 pruned 4 and 8
    assert checkpoint.load(d / "last.pt")["step"] == 20
    # last.pt is a separate copy of the newest (a hard link shared one damage between both)
    assert not os.path.samefile(d / "last.pt", d / "step_20.pt")
    assert (d / "last.pt").read_bytes() == (d / "step_20.pt").read_bytes()
    state = checkpoint.load(d / "step_12.pt")
    assert state["step"] == 12 and Path(state["batch_order"]) == tmp / "source" / "batch_order.bin"
    assert [s for s, _ in fork.checkpoints(tmp / "source")] == [12, 16, 20]
    assert fork.pick(tmp / "source", before=17) == d / "step_16.pt"
    assert fork.pick(tmp / "source", before=17, margin=2) == d / "step_12.pt"
    with pytest.raises(fork.ForkError, match="no divergence step"):
        fork.pick(tmp / "source")  # the baseline smoke run did not diverge: --before is needed
    with pytest.raises(fork.ForkError, match="no checkpoint at step <= 10"):
        fork.pick(tmp / "source", before=10)


def test_pruning_keeps_the_last_checkpoint_before_a_divergence(tmp_path):
    d = tmp_path / "checkpoints"
    for step in range(5, 45, 5):  # a run that diverged at step 17 and kept training
        checkpoint.save_step(d, step, {"step": step}, keep=2, protect_before=17 if step > 17 else None)
    assert sorted(checkpoint.step_files(d)) == [15, 35, 40]
    assert checkpoint.load(d / "last.pt")["step"] == 40
    assert sorted(p.name for p in d.iterdir()) == ["last.pt", "step_15.pt", "step_35.pt", "step_40.pt"]  # no temps
    checkpoint.save_step(d, 45, {"step": 45}, keep=0)  # 0 = keep all
    assert sorted(checkpoint.step_files(d)) == [15, 35, 40, 45]


def test_pick_cli_defaults_to_the_divergence_step(source, tmp_path, capsys):
    tmp, _ = source
    job_dir = tmp_path / "copy"
    (job_dir / "checkpoints").mkdir(parents=True)
    for s in (12, 16):
        os.link(tmp / "source" / "checkpoints" / f"step_{s}.pt", job_dir / "checkpoints" / f"step_{s}.pt")
    (job_dir / "result.json").write_text(json.dumps({"divergence_step": 17}))
    assert fork.main(["pick", str(job_dir), "--margin", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(job_dir / "checkpoints" / "step_12.pt")
    assert fork.main(["list", str(job_dir)]) == 0
    out = capsys.readouterr().out
    assert "step_12.pt  (before the divergence)" in out and "step_16.pt" in out


def test_fork_same_intervention_reproduces_the_source(source):
    tmp, src = source
    ckpt = tmp / "source" / "checkpoints" / "step_12.pt"
    res = job(tmp, "same", "intervention=baseline", f"from_checkpoint={ckpt}")
    assert res["error"] is None, res["error"]
    assert res["forked_from"] == str(ckpt) and res["fork_step"] == 12 and res["resumed_from"] is None
    assert res["source_run_id"] == src["mlflow_run_id"] != res["mlflow_run_id"]
    run = client(tmp).get_run(res["mlflow_run_id"])
    assert run.data.tags["forked_from"] == str(ckpt) and run.data.tags["fork_step"] == "12"
    assert run.data.tags["forked_from_run"] == src["mlflow_run_id"]
    for key in ("train/loss", "train/grad_norm", "train/lr", "val/loss"):
        a = history(tmp, res["mlflow_run_id"], key)
        b = [(s, v) for s, v in history(tmp, src["mlflow_run_id"], key) if s >= 12]
        assert a == b, key  # bit-identical, at the source's steps
    assert [s for s, _ in history(tmp, res["mlflow_run_id"], "train/loss")] == list(range(12, 20))
    assert res["final_loss"] == src["final_loss"]
    # the fork records the batches it replayed: byte-identical to the source's order file
    assert (tmp / "same" / "batch_order.bin").read_bytes() == (tmp / "source" / "batch_order.bin").read_bytes()


def test_fork_other_intervention_same_batches_other_curve(source):
    tmp, src = source
    ckpt = tmp / "source" / "checkpoints" / "step_12.pt"
    res = job(tmp, "sfa", "intervention=sfa", f"from_checkpoint={ckpt}")
    assert res["error"] is None, res["error"]
    assert res["intervention"] == "sfa" and res["fork_step"] == 12
    order = (tmp / "source" / "batch_order.bin").read_bytes()
    assert (tmp / "sfa" / "batch_order.bin").read_bytes() == order
    a = history(tmp, res["mlflow_run_id"], "train/loss")
    b = [(s, v) for s, v in history(tmp, src["mlflow_run_id"], "train/loss") if s >= 12]
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(12, 20))
    assert [v for _, v in a] != [v for _, v in b]
    params = client(tmp).get_run(res["mlflow_run_id"]).data.params
    assert "stabilized" in params["attention_effective.softmax"]
    assert params["optimizer.decay_steps"] == "20"  # the source's lr schedule


def test_fork_shorter_run_keeps_the_source_schedule(source):
    """A fork that stops at 16 still sees the source's learning rates (decay over the source's 20 steps)."""
    tmp, src = source
    ckpt = tmp / "source" / "checkpoints" / "step_12.pt"
    res = job(tmp, "short", "intervention=baseline", f"from_checkpoint={ckpt}", "train.max_steps=16")
    assert res["error"] is None, res["error"]
    a = history(tmp, res["mlflow_run_id"], "train/loss")
    b = [(s, v) for s, v in history(tmp, src["mlflow_run_id"], "train/loss") if 12 <= s < 16]
    assert a == b


def test_fork_verdict_baseline_source_continues_the_source_detector(source, tmp_path):
    """verdict.fork_baseline=source: the fork's detector continues the source's at the checkpoint (its running
    minimum, pending up-steps), so the fork is judged as a run that switched the intervention on at the fork step;
    fresh starts the running minimum at the fork step."""
    tmp, src = source
    state = checkpoint.load(tmp / "source" / "checkpoints" / "step_12.pt")
    assert state["detector"]["divergence_step"] is None
    state["detector"]["min_loss"] = 0.5  # a source that was once far better than anything the fork will reach
    ckpt = tmp_path / "low" / "checkpoints" / "step_12.pt"
    checkpoint.save(ckpt, state)
    replay = f"data.replay={tmp / 'source' / 'batch_order.bin'}"
    tight = ["verdict.margin=1.0", "verdict.window=2", "train.early_stop=false", replay, f"from_checkpoint={ckpt}"]
    fresh = job(tmp_path, "v_fresh", "intervention=baseline", *tight)
    cont = job(tmp_path, "v_source", "intervention=baseline", *tight, "verdict.fork_baseline=source")
    assert fresh["error"] is None and cont["error"] is None, (fresh["error"], cont["error"])
    assert fresh["final_loss"] == cont["final_loss"] == src["final_loss"]  # one curve, two judgements
    assert fresh["observed"] == "stable" and fresh["min_loss"] > 0.5
    assert cont["observed"] == "diverged" and cont["divergence_step"] == 12 and cont["min_loss"] == 0.5
    # refused before launch when the checkpoint's detector had already diverged, and for an unknown value
    state["detector"]["divergence_step"] = 3
    checkpoint.save(tmp_path / "gone" / "checkpoints" / "step_12.pt", state)
    cfg, overrides = compose_cfg(tmp_path, "intervention=baseline", "verdict.fork_baseline=source", replay,
                                 f"from_checkpoint={tmp_path}/gone/checkpoints/step_12.pt")
    with pytest.raises(ConfigError, match="verdict.fork_baseline='source' is not allowed.*already diverged at step 3"):
        validate_config(cfg, overrides, check_store=False)
    cfg, overrides = compose_cfg(tmp_path, "intervention=baseline", "verdict.fork_baseline=sauce")
    with pytest.raises(ConfigError, match="verdict.fork_baseline='sauce' is not allowed: expected one of fresh, "
                                          "source"):
        validate_config(cfg, overrides, check_store=False)


@pytest.mark.parametrize("case", ["missing", "shape", "max_steps", "resume", "no_order", "short_order"])
def test_bad_fork_is_rejected(source, tmp_path, case):
    tmp, _ = source
    ckpt = tmp / "source" / "checkpoints" / "step_12.pt"
    extra, match = {
        "missing": ([f"from_checkpoint={tmp_path}/nope.pt"], "from_checkpoint=.*no such checkpoint file"),
        "shape": ([f"from_checkpoint={ckpt}", "model.n_embd=128"],
                  "from_checkpoint=.*another model shape.*n_embd: checkpoint 64 vs model 128"),
        "max_steps": ([f"from_checkpoint={ckpt}", "train.max_steps=12"],
                      r"train.max_steps=12 is not allowed .*expected an integer > 12"),
        "resume": ([f"from_checkpoint={ckpt}", f"resume={ckpt}"], "resume=.* and from_checkpoint=.* both set"),
        "no_order": ([f"from_checkpoint={tmp_path}/lone/checkpoints/step_12.pt"],
                     "batch order was not found.*data.replay"),
        # refused only when asked: by default the seeded order is regenerated past the file's end (test_replay_past_end)
        "short_order": ([f"from_checkpoint={ckpt}", "train.max_steps=30", "data.replay_past_end=refuse"],
                        "holds 20 steps, shorter than .* 30"),
    }[case]
    if case == "no_order":  # a checkpoint copied away from its job folder, its recorded order path gone too
        state = checkpoint.load(ckpt)
        state["batch_order"], state["job_dir"] = str(tmp_path / "gone.bin"), str(tmp_path / "gone")
        checkpoint.save(tmp_path / "lone" / "checkpoints" / "step_12.pt", state)
    cfg, overrides = compose_cfg(tmp_path, "intervention=baseline", *extra)
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg, overrides, check_store=False)
    if case == "no_order":  # ... and data.replay makes it usable
        cfg, overrides = compose_cfg(tmp_path, "intervention=baseline", *extra,
                                     f"data.replay={tmp / 'source' / 'batch_order.bin'}")
        validate_config(cfg, overrides, check_store=False)


def run_cli(tmp_path, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    cmd = [sys.executable, str(ROOT / "run.py"), *args,
           f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"results_dir={tmp_path}/results"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_multirun_forks_every_intervention(source, tmp_path):
    tmp, src = source
    ckpt = tmp / "source" / "checkpoints" / "step_16.pt"
    p = run_cli(tmp_path, "-m", *BASE, f"from_checkpoint={ckpt}", "intervention=baseline,fp32")
    assert p.returncode == 0, p.stderr[-3000:]
    c = client(tmp_path)
    runs = [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id])]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2 and len(runs) == 3
    assert sorted(r.data.tags["intervention"] for r in children) == ["baseline", "fp32"]
    for r in children:
        assert r.data.tags["fork_step"] == "16" and r.data.tags["forked_from"] == str(ckpt)
        assert r.info.status == "FINISHED"
        assert [m.step for m in c.get_metric_history(r.info.run_id, "train/loss")] == [16, 17, 18, 19]
    report, = (tmp_path / "results" / "smoke").glob("*/report")  # in the dated sweep folder
    doc = json.loads((report / "verdicts.json").read_text())
    assert sorted(r["intervention"] for r in doc["runs"]) == ["baseline", "fp32"]
    assert all(r["fork_step"] == 16 for r in doc["runs"])
    assert "forked from" in (report / "verdicts.md").read_text()
    # a bad fork in a multirun launches nothing
    bad = tmp_path / "bad"
    bad.mkdir()
    p = run_cli(bad, "-m", *BASE, f"from_checkpoint={ckpt}", f"resume={ckpt}", "intervention=baseline,fp32")
    assert p.returncode == 1 and "nothing launched" in p.stderr and "from_checkpoint" in p.stderr
    assert not (bad / "results").exists() or not list((bad / "results").rglob("result.json"))
