"""monitor.alarm: on a scripted metric history (fires at the first logged step past the threshold, not before, once),
its validation (key, value, what is allowed; nothing launched), and real tiny CPU runs with MLflow sqlite: the
tags, the alarm checkpoint, a clean stop, and a detached fork child that trains from the alarm checkpoint."""
import json
import os
import time

import pytest
from mlflow.tracking import MlflowClient

import flash_forensics.orchestrator.config.schema  # noqa: F401
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config
from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.monitor import signals
from flash_forensics.orchestrator.monitor.alarm import Alarm, AlarmConfig, fork_overrides
from tests.helpers import jobs as _jobs

# sdpa: the fastest CPU attention; it logs max_logit/L* on flush steps (the probe QK^T pass); a flush every 2 steps
BASE = ["experiment=smoke", "attention=sdpa", "train.max_steps=8", "monitor.log_every=2", "train.early_stop=false"]


def on(*kv):
    return ["monitor.alarm.enabled=true", *[f"monitor.alarm.{x}" for x in kv]]


# ------------------------------------------------------------------------------------------- scripted
def test_fires_at_first_step_above_threshold_not_before_once():
    a = Alarm(AlarmConfig(enabled=True, signal="max_logit", threshold=5.0))
    script = [(1, 1.0), (3, 5.0), (5, 4.0), (7, 7.5), (9, 9.0), (11, 3.0)]  # max over layers: L0 here, L1 below
    seen = []
    for step, v in script:
        a.observe(step, {"max_logit/L0": v, "max_logit/L1": v - 2.0, record.LOSS: 100.0})
        seen.append((step, a.pending))
    # 5.0 at step 3 is not strictly above 5: the first step above is 7 (7.5), and step 9 does not fire again
    assert seen == [(1, False), (3, False), (5, False), (7, True), (9, True), (11, True)]
    assert a.fired == {"step": 7, "signal": "max_logit", "value": 7.5, "threshold": 5.0, "direction": "above",
                       "action": "tag"}


def test_signal_from_one_family_ignores_other_points():
    a = Alarm(AlarmConfig(enabled=True, signal="wq_sigma", threshold=2.0))
    a.observe(4, {"max_logit/L0": 50.0, "rmax_rows/L0.H0": 99.0, record.LOSS: 9.0})  # no W_Q point: no value
    assert a.fired is None
    a.observe(5, {"wq_sigma/L0.H0": 1.5, "wq_sigma/L1.H3": 2.5})
    assert (a.fired["step"], a.fired["value"]) == (5, 2.5)


def test_fork_overrides_drop_what_the_child_sets(tmp_path):
    got = fork_overrides(["experiment=smoke", "intervention=baseline", "intervention.beta=4", "+from_checkpoint=x",
                          "monitor.alarm.enabled=true", "hydra.run.dir=/a", "train.max_steps=9", "data.replay=/o",
                          "+sweep=seeds", "hydra/launcher=local", "sweep_name=mine", "intervention_x=1"],
                         tmp_path / "c.pt", tmp_path / "o.bin", "sfa", tmp_path)
    assert got == ["experiment=smoke", "train.max_steps=9", "sweep_name=mine", "intervention_x=1",
                   f"from_checkpoint={tmp_path / 'c.pt'}", "intervention=sfa", f"data.replay={tmp_path / 'o.bin'}",
                   "monitor.alarm.enabled=false", f"hydra.run.dir={tmp_path / 'alarm_fork'}"]


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("overrides,needles", [
    (on("signal=loss"), ["monitor.alarm.signal='loss'", "rmax_rate", "delta_cumsum"]),
    (on("action=explode"), ["monitor.alarm.action='explode'", "tag, checkpoint, stop, fork"]),
    (on("threshold=nan"), ["monitor.alarm.threshold=nan", "a finite number"]),
    (on("growth_window=0"), ["monitor.alarm.growth_window=0", "an integer > 0"]),
    (on("spike_window=-3"), ["monitor.alarm.spike_window=-3", "an integer > 0"]),
    (on("action=fork", "fork_intervention=nope"), ["monitor.alarm.fork_intervention='nope'", "sfa"]),
    (on("action=fork", "fork_intervention=qk_norm"), ["monitor.alarm.fork_intervention='qk_norm'", "model patch"]),
    (on("signal=rmax_rate") + ["monitor.counters=false"], ["monitor.alarm.signal='rmax_rate'", "monitor.counters"]),
    (on("signal=entropy"), ["monitor.alarm.signal='entropy'", "monitor.probes"]),
    (on("signal=val_rise") + ["train.eval_every=0"], ["monitor.alarm.signal='val_rise'", "train.eval_every > 0"]),
])
def test_bad_alarm_config_is_named(tmp_path, overrides, needles):
    cfg, ov = _jobs.compose_cfg(BASE, tmp_path, *overrides)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, ov, check_store=False)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_bad_alarm_launches_nothing(tmp_path):
    p = _jobs.run_cli(tmp_path, *BASE, *on("action=halt"))
    assert p.returncode != 0 and "monitor.alarm.action='halt'" in p.stdout + p.stderr
    assert not (tmp_path / "mlflow.db").exists() or not _runs(tmp_path)


# --------------------------------------------------------------------------------------- real CPU runs
def _runs(tmp_path):
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    return [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id])]


def _run(tmp_path, run_id):
    return MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id)


def _history(tmp_path, run_id):
    from flash_forensics.orchestrator.report import readback as store
    return store.history(store.client_for(f"sqlite:///{tmp_path}/mlflow.db"), run_id, signals.PREFIXES)


def _wait(pid, result, timeout=600):
    """Until the fork child (launched from this process) has exited and left its result.json."""
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # already reaped (subprocess reaps dropped Popen objects)
        pass
    t0 = time.time()
    while not result.is_file() and time.time() - t0 < timeout:
        time.sleep(1)


def test_checkpoint_then_stop_at_the_first_step_above(tmp_path):
    # 1. threshold 0: fires at the first flush (step 1), writes checkpoints/alarm_2.pt and trains on
    r1 = _jobs.run_in(BASE, tmp_path, "ckpt", *on("threshold=0", "action=checkpoint"))
    assert r1["observed"] == "stable" and r1["steps_done"] == 8
    tags = _run(tmp_path, r1["mlflow_run_id"]).data.tags
    assert (tags["ff.alarm.step"], tags["ff.alarm.signal"], tags["ff.alarm.action"]) == \
        ("1", "max_logit", "checkpoint")
    series = signals.series(_history(tmp_path, r1["mlflow_run_id"]))["max_logit"]
    assert [s for s, _ in series] == [1, 3, 5, 7]
    assert float(tags["ff.alarm.value"]) == series[0][1] == r1["alarm"]["value"]
    ck = tmp_path / "ckpt" / record.CKPT_DIR / "alarm_2.pt"
    assert r1["alarm"]["checkpoint"] == str(ck) and checkpoint.load(ck)["step"] == 2
    assert sorted(checkpoint.step_files(ck.parent)) == [8]  # not a step_<k>.pt: pruning and auto-resume skip it

    # 2. the same run with the threshold at the first flush's value: not at step 1 (not strictly above), but at the
    # first later flush above it, computed from run 1's history; there it stops cleanly
    thr = series[0][1]
    expect = signals.first_alarm(series, signals.ABOVE, thr)
    assert expect is not None, f"max_logit never rose above its first value {thr} in {series}"
    r2 = _jobs.run_in(BASE, tmp_path, "stop", *on(f"threshold={thr!r}", "action=stop"))
    step = expect[0]
    assert (r2["alarm"]["step"], r2["alarm"]["value"]) == expect
    assert r2["alarm"]["stopped"] and f"at step {step}" in r2["alarm"]["reason"]
    assert r2["observed"] != "failed" and r2["error"] is None and r2["early_stopped"]
    assert r2["steps_done"] == step + 1
    run = _run(tmp_path, r2["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["ff.alarm.step"] == str(step)
    assert checkpoint.load(tmp_path / "stop" / record.CKPT_DIR / f"alarm_{step + 1}.pt")["step"] == step + 1
    saved = json.loads((tmp_path / "stop" / record.RESULT_FILE).read_text())
    assert saved["alarm"]["reason"] == r2["alarm"]["reason"]

    # 3. the early-warning table reads both runs back through the job folders' records and MLflow
    from flash_forensics.orchestrator.analysis import early_warning
    assert early_warning.main([str(tmp_path / "ckpt"), str(tmp_path / "stop"), "--out", str(tmp_path / "ew")]) == 0
    doc = json.loads((tmp_path / "ew" / "early_warning.json").read_text())
    got = [(x["name"], x["observed"], x["start"]) for x in doc["runs"]]
    assert got == [("ckpt", "stable", 0), ("stop", "stable", 0)]
    assert {"max_logit", "wq_sigma"} <= set(doc["runs"][0]["signals"]) and doc["chosen"] is None  # nothing diverged
    md = (tmp_path / "ew" / "early_warning.md").read_text()
    assert "entropy: absent in 2 of 2 runs" in md  # monitor.probes is off
    # the runs' own firings against the table's offline computation of the same rule on their histories
    live = {c["run"]: c for c in doc["live_check"]}
    assert (live["ckpt"]["online_step"], live["ckpt"]["offline_step"], live["ckpt"]["agree"]) == (1, 1, True)
    assert (live["stop"]["online_step"], live["stop"]["offline_step"]) == (step, step) and live["stop"]["agree"]
    assert live["stop"]["offline_value"] == live["stop"]["online_value"] == r2["alarm"]["value"]
    assert "2 of 2 runs with monitor.alarm on fired where this table's computation" in md


def test_tag_only_and_fork_child(tmp_path):
    r = _jobs.run_in(BASE, tmp_path, "fork", *on("threshold=0", "action=fork", "fork_intervention=fp32"))
    a = r["alarm"]
    assert a["step"] == 1 and r["steps_done"] == 8 and r["observed"] == "stable"  # the run went on
    tags = _run(tmp_path, r["mlflow_run_id"]).data.tags
    assert tags["ff.alarm.fork_command"] == a["fork_command"] and "intervention=fp32" in a["fork_command"]
    ck = tmp_path / "fork" / record.CKPT_DIR / "alarm_2.pt"
    assert a["checkpoint"] == str(ck) and "fork_error" not in a
    child = tmp_path / "fork" / "alarm_fork"
    _wait(a["fork_pid"], child / record.RESULT_FILE)
    res = json.loads((child / record.RESULT_FILE).read_text())
    assert (res["intervention"], res["forked_from"], res["fork_step"], res["steps_done"]) == ("fp32", str(ck), 2, 8)
    assert res["observed"] == "stable" and res["error"] is None and res["alarm"] is None  # its alarm is off
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert [m.step for m in c.get_metric_history(res["mlflow_run_id"], record.LOSS)] == list(range(2, 8))
    # tag only: the same signal and threshold tag the run and write no checkpoint
    t = _jobs.run_in(BASE + ["train.max_steps=4"], tmp_path, "tag", *on("threshold=0"))
    assert t["alarm"]["step"] == 1 and "checkpoint" not in t["alarm"] and t["steps_done"] == 4
    assert not list((tmp_path / "tag" / record.CKPT_DIR).glob("alarm_*"))
    assert _run(tmp_path, t["mlflow_run_id"]).data.tags["ff.alarm.step"] == "1"
    # the report says what the live alarm did, from the job folder and from MLflow alike: it fired in a run that
    # stayed stable, a false alarm
    from flash_forensics.orchestrator.report import alarm_view, render
    from flash_forensics.orchestrator.report.rows import rows_from_dirs
    rows = rows_from_dirs([tmp_path / "tag"])
    assert rows[0]["alarm"]["step"] == 1 and rows[0]["alarm"]["signal"] == "max_logit"
    paths = render.write_report(rows, tmp_path / "report", sweep="alarm", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert _run(tmp_path, t["mlflow_run_id"]).data.tags["live_alarm"] == "false alarm"  # the MLflow column
    md, page = paths["md"].read_text(), paths["html"].read_text()
    assert alarm_view.HEADING in md and "False alarms: 1 of 1 stable runs" in md
    assert "fired at step 1 (max_logit = " in md and "a false alarm, the run stayed stable" in md
    assert "<h2>Live alarm (monitor.alarm)</h2>" in page and "a false alarm, the run stayed stable" in page
    back = record.from_mlflow_run(_run(tmp_path, t["mlflow_run_id"]), {})
    assert (back.alarm["step"], back.alarm["signal"], back.alarm["action"]) == (1, "max_logit", "tag")
    assert back.alarm["value"] == t["alarm"]["value"]


def test_a_resumed_run_keeps_its_firing_and_does_not_fire_or_act_again(tmp_path):
    """Fired at step 1 (threshold 0, action checkpoint: alarm_2.pt), killed -9 at step 3, so the run resumes from
    step_2.pt, the checkpoint of the boundary where it fired: the resumed run's record and tags still say step 1,
    with the value of that firing, and there is one alarm checkpoint. Without the alarm in the checkpoint it fired
    anew at the first flush after the resume; with it but acting after that checkpoint, it acted again."""
    import subprocess
    import sys
    args = [*BASE, "train.ckpt_every=2", *on("threshold=0", "action=checkpoint"),
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"results_dir={tmp_path}/results", f"hydra.run.dir={tmp_path}/job"]
    run = [sys.executable, str(_jobs.ROOT / "run.py"), *args]
    killed = subprocess.run([*run, "debug.kill_at_step=3", "debug.kill_where=step"], cwd=_jobs.ROOT,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    first = [ln for ln in killed.stdout.splitlines() if ln.startswith("[alarm]")]
    assert len(first) == 1 and "at step 1 " in first[0], killed.stdout[-2000:]
    again = subprocess.run(run, cwd=_jobs.ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from" in again.stdout and "[alarm]" not in again.stdout  # said once, in the first process
    res = json.loads((tmp_path / "job" / record.RESULT_FILE).read_text())
    assert res["steps_done"] == 8 and res["alarm"]["step"] == 1 and res["alarm"]["signal"] == "max_logit"
    assert first[0].split("max_logit=")[1].split(" ")[0] == f"{res['alarm']['value']:.6g}"
    assert _run(tmp_path, res["mlflow_run_id"]).data.tags["ff.alarm.step"] == "1"
    assert "resuming from" in again.stdout and " at step 2 " in again.stdout
    assert sorted(p.name for p in (tmp_path / "job" / record.CKPT_DIR).glob("alarm_*.pt")) == ["alarm_2.pt"]


def test_a_run_the_alarm_stopped_stops_again_when_rerun(tmp_path):
    """action=stop at step 1 ends the run at 2 steps; the same job again resumes from that end and, its alarm's
    firing restored, stops at its next step boundary instead of training on to train.max_steps."""
    first = _jobs.run_in(BASE, tmp_path, "stop", *on("threshold=0", "action=stop"))
    assert first["alarm"]["stopped"] and first["steps_done"] == 2
    again = _jobs.run_in(BASE, tmp_path, "stop", *on("threshold=0", "action=stop"))
    assert again["resumed_from"] and again["alarm"]["step"] == 1 and again["alarm"]["stopped"]
    assert again["early_stopped"] and again["steps_done"] == 3, again


def test_an_rmax_rate_alarm_that_cannot_fire_says_so(tmp_path):
    """SDPA computes no repeated-maxima counters, so an rmax_rate alarm there stays quiet whatever happens. The run is
    allowed (a sweep's SDPA control beside flash runs), and its record, its tags and the report say the alarm could
    never fire, instead of counting a quiet alarm as a run rightly spared."""
    r = _jobs.run_in(BASE + ["train.max_steps=4"], tmp_path, "sdpa", *on("signal=rmax_rate", "threshold=0"))
    why = r["alarm"]["inactive"]
    assert r["alarm"]["step"] is None and "no layer counts repeated maxima" in why and "sdpa/bf16/no-counters" in why
    assert _run(tmp_path, r["mlflow_run_id"]).data.tags["ff.alarm.inactive"] == why
    assert record.from_mlflow_run(_run(tmp_path, r["mlflow_run_id"]), {}).alarm["inactive"] == why
    from flash_forensics.orchestrator.report import alarm_view
    row = dict(job="sdpa", intervention="baseline", observed="stable", alarm=r["alarm"])
    assert alarm_view.outcome(row) == dict(kind="inactive", line=f"could never fire: {why}")
    text = "\n".join(alarm_view.lines([row]))
    assert "Could never fire (its signal not logged): 1." in text and "False alarms: 0 of 0" in text
    # where one layer counts (flash, counters on), or for another signal, nothing is said
    from flash_forensics.kernels.config import AttentionKnobs
    from flash_forensics.models.attention import route_name
    from flash_forensics.orchestrator.monitor.alarm import cannot_fire
    flash = route_name(AttentionKnobs(recipe="paper_bf16"), "emulator")
    off = route_name(AttentionKnobs(recipe="fa2", counters=False), "emulator")
    assert "no-counters" in off and "no-counters" not in flash
    assert cannot_fire("rmax_rate", [off]) and cannot_fire("rmax_rate", [off, flash]) is None
    assert cannot_fire("max_logit", ["sdpa/bf16/no-counters"]) is None and cannot_fire("rmax_rate", []) is None
