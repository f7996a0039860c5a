"""The report's live-alarm section (orchestrator/report/alarm_view.py) on scripted rows, and the record's alarm read
back from what a run logged to MLflow (record.alarm_from_mlflow)."""
from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.report import alarm_view

RULE = {"signal": "rmax_rate", "threshold": 339961.4, "direction": "above", "action": "tag"}


def _row(job, observed, step, divergence=None, value=4e5, done=3000):
    alarm = {**RULE, "step": step, **({"value": value} if step is not None else {})}
    return {"job": job, "intervention": "baseline", "observed": observed, "divergence_step": divergence,
            "steps_done": done, "alarm": alarm}


ROWS = [_row("hit_a", "diverged", 2219, 2288), _row("hit_b", "diverged", 4000, 4342),
        _row("late", "diverged", 2300, 2288), _row("miss", "diverged", None, 9697),
        _row("false", "stable", 1500), _row("quiet", "stable", None), _row("open", "failed", None, done=7610),
        {"job": "off", "intervention": "fp32", "observed": "stable", "divergence_step": None, "alarm": None}]


def test_each_run_is_judged_against_its_verdict():
    kinds = {r["job"]: alarm_view.outcome(r) for r in ROWS if r["alarm"]}
    assert {k: o["kind"] for k, o in kinds.items()} == {
        "hit_a": "hit", "hit_b": "hit", "late": "late", "miss": "miss", "false": "false alarm", "quiet": "quiet",
        "open": "not judged"}
    assert kinds["hit_a"]["lead"] == 69 and kinds["hit_b"]["lead"] == 342
    assert "69 steps before the divergence at step 2288" in kinds["hit_a"]["line"]
    assert "rmax_rate = 400000" in kinds["hit_a"]["line"]
    assert kinds["open"]["line"].startswith("no alarm by step 7610")


def test_section_counts_hits_misses_and_false_alarms():
    md = alarm_view.lines(ROWS)
    assert md[0] == alarm_view.HEADING
    head = md[2]
    assert "on in 7 of 8 runs" in head and "`rmax_rate > 339961`" in head
    assert "warned in time: 2 of 4 (lead: median 205.5, min 69, max 342 steps); late 1, missed 1" in head
    assert "False alarms: 1 of 2 stable runs" in head and "Not judged: 1." in head
    assert sum(1 for x in md if x.startswith("- ")) == 7  # the run with the alarm off has no line
    assert alarm_view.lines([r for r in ROWS if r["job"] == "off"]) == []  # never on: no section


def test_alarm_read_back_from_mlflow_params_and_tags():
    params = {"monitor.alarm.enabled": "True", "monitor.alarm.signal": "rmax_rate",
              "monitor.alarm.threshold": "339961.4", "monitor.alarm.action": "tag"}
    quiet = record.alarm_from_mlflow({}, params)
    assert quiet == {"step": None, "signal": "rmax_rate", "threshold": 339961.4, "action": "tag"}
    entropy = record.alarm_from_mlflow({}, {**params, "monitor.alarm.signal": "entropy"})
    assert "entropy < " in alarm_view.lines([{"job": "j", "observed": "stable", "alarm": entropy}])[2]  # its own
    tags = {"ff.alarm.step": "2219", "ff.alarm.signal": "rmax_rate", "ff.alarm.value": "351234.5",
            "ff.alarm.threshold": "339961.4", "ff.alarm.action": "tag"}
    fired = record.alarm_from_mlflow(tags, params)
    assert (fired["step"], fired["value"]) == (2219, 351234.5)
    assert record.alarm_from_mlflow({}, {"monitor.alarm.enabled": "False"}) is None
