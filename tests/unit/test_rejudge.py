"""A fork judged as its source's detector would judge it (orchestrator/report/rejudge.py, `report --fork-baseline
source`): the paper regime's seed 1 had the baseline's own fork, identical to its source at every shared step, called
stable while the source diverged, because the fork's running minimum started at the fork step on noisy losses."""
import gzip
import json
import math

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.report import rejudge
from flash_forensics.orchestrator.report.rows import compare
from flash_forensics.orchestrator.report.sweep import main as report_main

FORK = 100


def source_curve(s):
    # one lucky batch at step 40 (1.0) sets the source's running minimum; the loss sits at 1.6 otherwise, then rises
    # to 2.3 from step 150: > 1.0 + margin 1 for good, but never > 1.6 + 1 (the minimum a fresh detector would see)
    return 1.0 if s == 40 else (1.6 if s < 150 else 2.3)


def rows_and_histories():
    base = {"job": "baseline", "intervention": "baseline", "expected": "diverges", "observed": "diverged",
            "divergence_step": 150, "mlflow_run_id": "b", "job_dir": "/r/baseline", "verdict_margin": 1.0,
            "verdict_window": 20, "overrides": ["intervention=baseline"], "steps_done": 300}
    fork = dict(base, job="forks/0", observed="stable", divergence_step=None, mlflow_run_id="f0", job_dir="/r/f0",
                fork_step=FORK, forked_from="/r/baseline/checkpoints/step_100.pt", fork_baseline="fresh")
    ref = dict(fork, job="forks/1", intervention="fp32", expected="stable", mlflow_run_id="f1", job_dir="/r/f1",
               source_run_id="b", forked_from=None, overrides=["intervention=fp32"])
    hist = {"b": {"train/loss": [(s, source_curve(s)) for s in range(0, 170)]},
            "f0": {"train/loss": [(s, source_curve(s)) for s in range(FORK, 300)]},   # the source, repeated
            "f1": {"train/loss": [(s, 1.5) for s in range(FORK, 300)]}}
    return [base, fork, ref], hist


def test_a_fork_that_repeats_its_source_gets_its_sources_verdict():
    rows, hist = rows_and_histories()
    rejudge.source_verdicts(rows, hist)
    base, fork, ref = rows
    assert (fork["observed"], fork["divergence_step"]) == ("diverged", 150)  # found by its checkpoint's job folder
    assert fork["fresh_observed"] == "stable" and fork["fork_rule"] == "source (fresh: stable)"
    assert fork["min_loss"] == 1.0  # the source's minimum, from before the fork
    assert (ref["observed"], ref["fork_rule"]) == ("stable", "source")  # found by its source run id; unchanged
    assert "fork_rule" not in base and base["observed"] == "diverged"  # the source itself is no fork
    assert "said stable" in rejudge.note(fork) and rejudge.note(ref) is None
    compare(rows)
    assert fork["matches_paper"] is True and ref["matches_paper"] is True  # the baseline's fork now diverged
    assert "stable where the baseline diverged at step 150" in ref["vs_baseline"]


def test_forks_that_cannot_be_rejudged_keep_their_verdict_and_say_why():
    rows, hist = rows_and_histories()
    del hist["b"]  # no source history
    rejudge.source_verdicts(rows, hist)
    assert rows[1]["observed"] == "stable" and rows[1]["fork_rule"].startswith("fresh (no source history")
    rows, hist = rows_and_histories()
    rows[1]["fork_step"] = 200  # the source diverged at 150, before this fork
    rejudge.source_verdicts(rows, hist)
    assert rows[1]["observed"] == "stable" and "had diverged at step 150, before the fork" in rows[1]["fork_rule"]
    rows, hist = rows_and_histories()
    rows[1]["fork_baseline"] = "source"  # the run's own detector was already the source's
    rejudge.source_verdicts(rows, hist)
    assert rows[1]["observed"] == "stable" and rows[1]["fork_rule"] == "source" and "fresh_observed" not in rows[1]


def test_a_nan_in_the_fork_is_a_non_finite_divergence():
    rows, hist = rows_and_histories()
    hist["f1"]["train/loss"][5] = (FORK + 5, math.nan)
    rejudge.source_verdicts(rows, hist)
    assert (rows[2]["observed"], rows[2]["divergence_step"]) == ("diverged", FORK + 5)


def test_the_report_cli_rejudges_from_a_compact_export(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rows, hist = rows_and_histories()
    keys = ("intervention", "expected", "observed", "divergence_step", "mlflow_run_id", "verdict_margin",
            "verdict_window", "fork_step", "forked_from", "source_run_id", "fork_baseline", "overrides", "steps_done")
    for r in rows:
        d = tmp_path / "runs" / r["job"]
        d.mkdir(parents=True)
        rec = {k: r.get(k) for k in keys}
        if rec["forked_from"]:
            rec["forked_from"] = str(tmp_path / "runs" / "baseline" / "checkpoints" / "step_100.pt")
        (d / record.RESULT_FILE).write_text(json.dumps(rec))
    export = {"runs": [{"run_id": k, "metrics": {m: [[s, None if math.isnan(v) else v] for s, v in pts]
                                                 for m, pts in h.items()}} for k, h in hist.items()]}
    with gzip.open(tmp_path / "e.json.gz", "wt") as f:
        json.dump(export, f)
    args = ["runs/baseline", "runs/forks", "--histories", str(tmp_path / "e.json.gz")]
    assert report_main([*args, "--out", "recorded"]) == 0
    assert report_main([*args, "--out", "source", "--fork-baseline", "source"]) == 0
    rec = {r["job"]: r for r in json.loads((tmp_path / "recorded" / "verdicts.json").read_text())["runs"]}
    src = json.loads((tmp_path / "source" / "verdicts.json").read_text())
    by = {r["job"]: r for r in src["runs"]}
    assert rec["forks/0"]["observed"] == "stable" and rec["forks/0"]["fork_rule"] is None
    assert by["forks/0"]["observed"] == "diverged" and by["forks/0"]["divergence_step"] == 150
    assert by["forks/0"]["fork_rule"] == "source (fresh: stable)" and by["forks/1"]["matches_paper"] is True
    assert src["meta"]["fork_rule"].startswith("source: each fork judged from its source's detector")
