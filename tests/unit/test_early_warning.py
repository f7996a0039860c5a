"""The early-warning table on scripted metric histories: lead times, false alarms and misses worked out by hand from
the script; the signals' arithmetic (repeated-maxima rate, W_Q growth rate) on scripted points."""
import json
import math

import pytest

from flash_forensics.orchestrator.analysis import early_warning as ew
from flash_forensics.orchestrator.analysis.early_warning import Run
from flash_forensics.orchestrator.monitor import signals

FLUSH = list(range(9, 200, 10))  # steps 9, 19, ..., 199: a flush every 10 steps


def logit_run(name, observed, div, value, start=0, steps=FLUSH):
    hist = {"max_logit/L0": [(s, value(s)) for s in steps], "max_logit/L1": [(s, 0.0) for s in steps]}
    return Run(name, observed, start, div, signals.series(hist, start))


def script():
    return [
        logit_run("A", "diverged", 100, lambda s: s + 1.0),  # value s+1
        logit_run("B", "diverged", 60, lambda s: 2.0 * (s + 1)),  # value 2(s+1)
        logit_run("C", "stable", None, lambda s: 45.0 if s == 49 else 30.0),  # one spike to 45
        logit_run("D", "stable", None, lambda s: 20.0),
        # a fork at step 50 diverging at 150: the 1000s before its fork step must not count
        logit_run("E", "diverged", 150, lambda s: 1000.0 if s < 50 else s - 40.0, start=50),
    ]


def by_threshold(rows, signal="max_logit"):
    return {r.threshold: r for r in rows if r.signal == signal}


def test_grid_is_each_runs_peak_in_its_judged_window():
    # A before 100: 99+1; B before 60: 2*60; C: 45; D: 20; E in [50, 150): 149-40
    assert ew.grid(script(), "max_logit") == [20.0, 45.0, 100.0, 109.0, 120.0]


def test_lead_times_false_alarms_and_misses_by_hand():
    rows = by_threshold(ew.table(script()))
    # threshold 45 (C's peak, strictly above): A first > 45 at 49 (50), lead 100-49; B at 29 (60), lead 60-29;
    # E at 89 (49), lead 150-89; C never strictly above 45, D never: no false alarm
    r = rows[45.0]
    assert r.leads == {"A": 51, "B": 31, "E": 61}
    assert r.mean_lead == pytest.approx((51 + 31 + 61) / 3)
    assert (r.false_alarms, r.misses, r.diverged, r.stable) == (0, 0, 3, 2)
    # threshold 20 (D's peak): A at 29 (30), lead 71; B at 19 (40), lead 41; E at 69 (29), lead 81; C alarms
    r = rows[20.0]
    assert r.leads == {"A": 71, "B": 41, "E": 81}
    assert (r.false_alarms, r.false_alarm_runs, r.misses) == (1, ["C"], 0)
    # threshold 100 (A's peak): A misses (100 is not above 100, 110 at 109 is after its divergence); B at 49 (100
    # is not above 100, so 59: 120), lead 1; E at 149 (109), lead 1
    r = rows[100.0]
    assert r.leads == {"A": None, "B": 1, "E": 1}
    assert (r.misses, r.false_alarms, r.mean_lead) == (1, 0, 1.0)
    # threshold 120 (B's peak): every diverged run misses (A and E pass 120 only after their divergence)
    r = rows[120.0]
    assert (r.misses, r.false_alarms, r.mean_lead) == (3, 0, None)


def test_chosen_rule_no_misses_then_fewest_false_alarms_then_longest_lead():
    runs = script()
    # a signal absent from most runs: rmax in A only (0 rows, then 50 rows over 10 steps = 5 per step); at the
    # extra threshold 1 it warns A at 19, 81 steps ahead, with no miss or false alarm among the runs that have it
    runs[0].series.update(signals.series({"rmax_rows/L0.H0": [(9, 0.0), (19, 50.0)]}))
    rows = ew.table(runs, {"rmax_rate": [1.0]})
    rmax = [r for r in rows if r.signal == "rmax_rate"]
    assert [(r.threshold, r.runs_present, r.leads) for r in rmax] == [(1.0, 1, {"A": 81}), (5.0, 1, {"A": None})]
    chosen = ew.choose(rows, len(runs))  # only signals present in every run are eligible: max_logit > 45
    assert (chosen.signal, chosen.threshold, chosen.misses, chosen.false_alarms) == ("max_logit", 45.0, 0, 0)
    assert ew.choose(rmax, len(runs)).threshold == 1.0  # none present everywhere: every row is eligible


def test_entropy_alarms_below():
    hist = lambda vals: {"probe/entropy/L0.H0": list(zip(FLUSH, vals))}  # noqa: E731
    runs = [Run("x", "diverged", 0, 45, signals.series(hist([3.0, 2.5, 1.0, 0.5, 0.2]))),
            Run("y", "stable", 0, None, signals.series(hist([3.0, 2.8, 2.6, 2.7, 2.9])))]
    rows = by_threshold(ew.table(runs), "entropy")
    assert sorted(rows) == [0.5, 2.6]  # x's minimum before 45 (steps 9..39), y's minimum
    r = rows[2.6]  # strictly below 2.6: x at 19 (2.5), lead 45-19; y never
    assert (r.leads, r.false_alarms, r.misses) == ({"x": 26}, 0, 0)


def test_rmax_rate_per_step_max_over_layers_and_fork_interval():
    st = signals.SignalState(start_step=0)
    # flush after steps 0..4: L0 heads 10 + 5, L1 20 -> max(15, 20) / 5 steps
    assert st.update(4, {"rmax_rows/L0.H0": 10, "rmax_rows/L0.H1": 5, "rmax_rows/L1.H0": 20}) == {"rmax_rate": 4.0}
    # a checkpoint flush after 2 more steps (5, 6): 30 rows in L0 over 2 steps
    assert st.update(6, {"rmax_rows/L0.H0": 30, "rmax_rows/L1.H0": 0})["rmax_rate"] == 15.0
    fork = signals.SignalState(start_step=50)  # a fork's first interval starts at its fork step
    assert fork.update(54, {"rmax_rows/L0.H0": 10})["rmax_rate"] == 2.0


def test_val_rise_is_the_val_loss_above_its_lowest_so_far():
    # evals at 0, 500, ..., 2500: falls to 2.0 at 1500, then 2.25, 2.125, and a non-finite point that is skipped
    val = [(0, 4.0), (500, 3.0), (1000, 2.5), (1500, 2.0), (2000, 2.25), (2500, 2.125), (3000, float("nan"))]
    other = {"max_logit/L0": [(s, 1.0) for s in range(0, 3001, 100)]}  # other families on their own steps
    out = signals.series({"val/loss": val, **other})
    assert out["val_rise"] == [(0, 0.0), (500, 0.0), (1000, 0.0), (1500, 0.0), (2000, 0.25), (2500, 0.125)]
    # a fork from 1000: its lowest starts at its own first eval, not the source's
    assert dict(signals.series({"val/loss": val}, start_step=1000)["val_rise"])[2000] == 0.25
    # the online state sees val/loss alone (the eval's own log call) and the monitors' batches apart
    st = signals.SignalState()
    assert st.update(0, {"val/loss": 3.0}) == {"val_rise": 0.0}
    assert "val_rise" not in st.update(9, {"max_logit/L0": 5.0})
    assert st.update(10, {"val/loss": 3.5}) == {"val_rise": 0.5}
    rows = [r for r in ew.table([Run("d", "diverged", 0, 2600, out), Run("s", "stable", 0, None, {
        "val_rise": [(500, 0.0), (1000, 0.05)]})]) if r.signal == "val_rise"]
    assert [(r.threshold, r.leads, r.false_alarms) for r in rows] == [(0.05, {"d": 600}, 0), (0.25, {"d": None}, 0)]


def test_wq_growth_is_d_ln_sigma_per_step_over_the_window():
    a = [(s, math.exp(0.01 * s)) for s in range(0, 301, 50)]  # grows at 0.01 per step throughout
    b = [(s, 1.0 if s <= 200 else math.exp(0.05 * (s - 200))) for s in range(0, 301, 50)]  # flat, then fast
    out = signals.series({"wq_sigma/L0.H0": a, "wq_sigma/L1.H2": b}, growth_window=100)
    assert [s for s, _ in out["wq_sigma"]] == list(range(0, 301, 50))
    growth = dict(out["wq_growth"])
    assert sorted(growth) == [100, 150, 200, 250, 300]  # no sample 100 steps back before step 100
    assert growth[100] == pytest.approx(0.01) and growth[200] == pytest.approx(0.01)
    assert growth[250] == pytest.approx(0.05 * 50 / 100)  # b: ln sigma from 0 (step 150) to 2.5 (step 250)
    assert growth[300] == pytest.approx(0.05)  # b: 0 at 200 to 5 at 300


def test_grad_and_loss_spikes_against_the_median_of_the_previous_values():
    """The generic monitors: grad norm / median, loss - median, of the previous spike_window finite values, from
    half a window on; NaN skipped (the detector's), inf a spike; a fork's window starts at its fork step."""
    grad = [(s, 2.0 + (s % 3)) for s in range(10)]  # 2, 3, 4, 2, 3, 4, 30 (the spike), 3, 4, 2
    loss = [(s, 5.0 - 0.25 * s) for s in range(10)]  # 5, 4.75, ..., 3.5, NaN (step 7), 3.0, 2.75
    grad[6], loss[7] = (6, 30.0), (7, float("nan"))
    out = signals.series({"train/grad_norm": grad, "train/loss": loss}, spike_window=4)
    g = dict(out["grad_spike"])
    assert sorted(g) == list(range(2, 10))  # from 2 previous values (half of 4) on
    assert g[2] == 4.0 / 2.5 and g[5] == 4.0 / 3.0  # medians of (2, 3) and of the last 4, (3, 4, 2, 3)
    assert g[6] == 30.0 / 3.5 and g[7] == 3.0 / 3.5  # the spike against (4, 2, 3, 4); then 30 is in the window
    lo = dict(out["loss_spike"])
    assert 7 not in lo and lo[8] == pytest.approx(3.0 - 3.875)  # NaN skipped: (4.25, 4.0, 3.75, 3.5) -> 3.875
    st = signals.SignalState(spike_window=2)
    assert "grad_spike" not in st.update(0, {"train/grad_norm": 1.0})
    assert st.update(1, {"train/grad_norm": float("inf")})["grad_spike"] == math.inf  # an overflow is a spike
    assert st.update(2, {"train/grad_norm": 3.0})["grad_spike"] == 3.0  # inf never enters the median
    # what the monitors log for a NaN/inf gradient norm: the flag, not the value; a NaN loss stays the detector's
    got = st.update(3, {"train/grad_norm_nonfinite": 1.0, "train/loss": float("nan"), "train/loss_nonfinite": 1.0})
    assert got == {"grad_spike": math.inf}
    fork = signals.series({"train/grad_norm": grad}, start_step=5, spike_window=4)["grad_spike"]
    assert fork[0] == (7, 3.0 / 17.0)  # from 5: (4, 30) before step 7; the source's values are not in its window
    # in the table they are signals like the others, present in every run that logs a loss
    rows = [r for r in ew.table([Run("d", "diverged", 0, 9, out), Run("s", "stable", 0, None, {
        "grad_spike": [(3, 1.0)], "loss_spike": [(3, 0.0)]})]) if r.signal == "grad_spike"]
    assert [(r.threshold, r.leads, r.false_alarms) for r in rows] == [(1.0, {"d": 7}, 0), (30.0 / 3.5, {"d": None}, 0)]


def test_write_md_json_plot(tmp_path):
    runs = script()
    rows = ew.table(runs)
    chosen = ew.choose(rows, len(runs))
    paths = ew.write(tmp_path, runs, rows, chosen, ["F: failed (boom)"], 100)
    md = paths["md"].read_text()
    assert "`monitor.alarm.enabled=true monitor.alarm.signal=max_logit monitor.alarm.threshold=45`" in md
    assert "| max_logit **(chosen)** | > 45 | 5 | 47.67 | 0/2 | 0/3 |" in md
    assert "entropy: absent in 5 of 5 runs" in md and "F: failed (boom)" in md
    doc = json.loads(paths["json"].read_text())
    assert doc["chosen"]["leads"] == {"A": 51, "B": 31, "E": 61}
    assert paths["png"].stat().st_size > 10_000


def test_probe_signals_from_the_probes_metric_names():
    got = signals.SignalState().update(99, {
        "probe/delta_err_cumsum/L0": -3.0, "probe/delta_err_cumsum/L1": 2.0,  # |cumsum|, max over layers
        "probe/max_logit/L0.H2": 40.0, "probe/max_logit/L1.H0": 55.0,  # max over heads
        "probe/entropy/L0.H0": 1.2, "probe/entropy/L1.H1": 0.8,  # min over heads
        "probe/delta_err_mean/L0": 99.0, "max_logit/L0": 7.0})  # not a signal of its own; the per-layer logit
    assert got == {"delta_cumsum": 3.0, "max_logit_head": 55.0, "entropy": 0.8, "max_logit": 7.0}


# ------------------------------------------------------------------------------------- unfinished runs
def test_unfinished_run_alarms_are_listed_apart_and_change_no_criterion():
    """U ended without a verdict at step 199, not diverged: its alarm is 'steps on after the alarm', never a false
    alarm, and at every threshold the other runs' numbers are what they are without it."""
    u = logit_run("U", "unfinished", None, lambda s: 3.0 * (s + 1))
    u.last_step = 199
    base = {r.threshold: r for r in ew.table(script()) if r.signal == "max_logit"}
    rows = by_threshold(ew.table(script() + [u]))
    assert 600.0 in rows  # U's peak (3 * 200) joins the grid
    r = rows[45.0]  # U first > 45 at step 19 (60): 199 - 19 steps on without diverging
    assert r.unfinished_alarms == {"U": 180} and r.unfinished == 1
    assert (r.false_alarms, r.stable, r.misses, r.diverged) == (0, 2, 0, 3)
    for t, b in base.items():
        got = rows[t]
        assert (got.leads, got.false_alarm_runs, got.misses, got.stable) == (b.leads, b.false_alarm_runs, b.misses,
                                                                            b.stable), t
    assert rows[600.0].unfinished_alarms == {}  # strictly above its own peak: no alarm
    md = ew.markdown(ew.table(script() + [u]), script() + [u], None, [], 100)
    assert "1 unfinished" in md and "alarms on unfinished" in md and "| U | unfinished | - | 0 | 199 |" in md


def _store_with_killed_runs(tmp_path):
    """A sqlite store with two runs killed before their verdict (no tags but their metrics, as after kill -9):
    'calm' whose loss falls, and 'blown' whose loss goes non-finite at step 30."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    (tmp_path / "store").mkdir()
    c = MlflowClient(tracking_uri=uri)
    exp = c.create_experiment("paper_isolation")
    for name, loss in (("calm seed=1", lambda s: 5.0 - 0.01 * s), ("blown seed=2", lambda s: math.nan if s >= 30
                                                                       else 5.0 - 0.01 * s)):
        rid = c.create_run(exp, run_name=name).info.run_id
        pts = [Metric("train/loss", loss(s), 0, s) for s in range(40)]
        pts += [Metric("max_logit/L0", 10.0 * s, 0, s) for s in range(9, 40, 10)]
        c.log_batch(rid, metrics=pts)
    return uri


def test_store_source_reads_unfinished_runs_and_leaves_out_a_diverged_one(tmp_path):
    uri = _store_with_killed_runs(tmp_path)
    runs, skipped = ew.load([uri])
    assert runs == [] and len(skipped) == 2  # without --include-unfinished: no verdict, left out, both said
    runs, skipped = ew.load([uri], unfinished=True)
    assert [(r.name, r.observed, r.last_step) for r in runs] == [("store/calm", "unfinished", 39)]
    assert len(skipped) == 1 and skipped[0].startswith("store/blown: unfinished, and its loss diverged at step 30")
    assert [s for s, _ in runs[0].series["max_logit"]] == [9, 19, 29, 39]
    row = next(r for r in ew.table(runs) if r.signal == "max_logit" and r.threshold == 390.0)
    assert row.unfinished_alarms == {} and row.unfinished == 1
    row = next(r for r in ew.table(runs, {"max_logit": [150.0]}) if r.threshold == 150.0)
    assert row.unfinished_alarms == {"store/calm": 39 - 19}  # 190 at step 19


def test_cli_with_a_store_and_include_unfinished(tmp_path):
    uri = _store_with_killed_runs(tmp_path)
    assert ew.main([uri, "--include-unfinished", "--out", str(tmp_path / "ew")]) == 0
    doc = json.loads((tmp_path / "ew" / "early_warning.json").read_text())
    assert [(r["name"], r["observed"], r["last_step"]) for r in doc["runs"]] == [("store/calm", "unfinished", 39)]
    assert doc["chosen"] is None  # no diverged run: nothing to choose


def test_cli_reads_job_folders_with_histories_from_a_compact_export(tmp_path):
    """--histories: the runs' signals from scripts/mlflow_export.py's file, no store opened (what comes back from a
    lent GPU); a run missing from the export is left out and said so."""
    import gzip
    for name, rec in (("base", {"intervention": "baseline", "observed": "diverged", "divergence_step": 100,
                                "mlflow_run_id": "r0"}),
                      ("calm", {"intervention": "fp32", "observed": "stable", "mlflow_run_id": "r1"}),
                      ("lost", {"intervention": "fp32", "observed": "stable", "mlflow_run_id": "r9"})):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "result.json").write_text(json.dumps({**rec, "expected": "stable",
                                                                          "steps_done": 200}))
    export = {"runs": [{"run_id": "r0", "metrics": {"max_logit/L0": [[s, float(s), 0] for s in FLUSH]}},
                       {"run_id": "r1", "metrics": {"max_logit/L0": [[s, 30.0] for s in FLUSH]}}]}
    with gzip.open(tmp_path / "e.json.gz", "wt") as f:
        json.dump(export, f)
    out = tmp_path / "ew"
    assert ew.main([str(tmp_path / "runs"), "--histories", str(tmp_path / "e.json.gz"), "--out", str(out)]) == 0
    doc = json.loads((out / "early_warning.json").read_text())
    assert sorted(r["name"] for r in doc["runs"]) == ["runs/base", "runs/calm"]
    assert any("r9 is not in the export" in s for s in doc["skipped"])
    # the chosen rule: max_logit above the stable run's 30, first crossed at step 39 (value 39): lead 100 - 39
    assert doc["chosen"]["signal"] == "max_logit" and doc["chosen"]["threshold"] == 30.0
    assert doc["chosen"]["leads"] == {"runs/base": 61} and doc["chosen"]["false_alarms"] == 0
    with pytest.raises(SystemExit):
        ew.main(["sqlite:///x.db", "--histories", str(tmp_path / "e.json.gz")])


def test_a_job_killed_before_its_result_is_unfinished_by_its_job_json_and_its_exported_history(tmp_path, capsys):
    """A job killed before result.json (the lent machine taken back mid-run) leaves only job.json, which names its
    MLflow run: with --include-unfinished and an export it is judged as unfinished to its last logged step; without
    a logged loss it is left out, said so; without --include-unfinished it is a failed row, left out."""
    import gzip
    for name, rid in (("seed1/baseline", "k1"), ("seed2/baseline", "k2")):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "job.json").write_text(json.dumps({"intervention": "baseline", "expected": "diverges",
                                                              "overrides": ["intervention=baseline"],
                                                              "mlflow_run_id": rid}))
    export = {"runs": [{"run_id": "k1", "metrics": {"train/loss": [[s, 5.0 - 0.01 * s] for s in range(60)],
                                                    "max_logit/L0": [[s, 10.0 * s] for s in FLUSH]}},
                       {"run_id": "k2", "metrics": {"max_logit/L0": [[s, 1.0] for s in FLUSH]}}]}
    with gzip.open(tmp_path / "e.json.gz", "wt") as f:
        json.dump(export, f)
    args = [str(tmp_path / "seed1"), str(tmp_path / "seed2"), "--histories", str(tmp_path / "e.json.gz")]
    assert ew.main([*args, "--include-unfinished", "--out", str(tmp_path / "ew")]) == 0
    doc = json.loads((tmp_path / "ew" / "early_warning.json").read_text())
    assert [(r["name"], r["observed"], r["last_step"]) for r in doc["runs"]] == [("seed1/baseline", "unfinished",
                                                                                   59)]
    assert any(s.startswith("seed2/baseline: unfinished, with no logged loss") for s in doc["skipped"])
    assert ew.main([*args, "--out", str(tmp_path / "ew2")]) == 1  # nothing left to judge: refused, each said
    err = capsys.readouterr().err
    assert "every run was left out" in err and err.count("failed (no result.json: the job was killed") == 2


def test_cli_reads_several_seeds_reports_and_exports_and_leaves_out_jumped_forks(tmp_path):
    """Two seeds' tables (a report's verdicts.json each) and their exports (--histories twice): runs named by their
    seed's folder, since both have a 'baseline'; a fork whose first loss jumped (fork_jump > 0.5 nats: the
    intervention's own damage at the fork, e.g. SFA at huge logits) is left out unless --keep-jumped."""
    import gzip
    for seed, rid, div in (("seed1", "a", 100), ("seed2", "b", 150)):
        (tmp_path / seed / "report").mkdir(parents=True)
        runs = [{"job": "baseline", "intervention": "baseline", "observed": "diverged", "divergence_step": div,
                 "mlflow_run_id": rid + "0"},
                {"job": "forks/sfa", "intervention": "sfa", "observed": "diverged", "divergence_step": 50,
                 "fork_step": 50, "fork_jump": 6.0, "mlflow_run_id": rid + "1"},
                {"job": "forks/fp32", "intervention": "fp32", "observed": "stable", "fork_step": 50,
                 "fork_jump": 0.01, "mlflow_run_id": rid + "2"}]
        (tmp_path / seed / "report" / "verdicts.json").write_text(json.dumps({"runs": runs}))
        export = {"runs": [{"run_id": rid + "0", "metrics": {"max_logit/L0": [[s, float(s)] for s in FLUSH]}},
                           {"run_id": rid + "1", "metrics": {"max_logit/L0": [[s, 999.0] for s in FLUSH]}},
                           {"run_id": rid + "2", "metrics": {"max_logit/L0": [[s, 30.0] for s in FLUSH]}}]}
        with gzip.open(tmp_path / f"{seed}.json.gz", "wt") as f:
            json.dump(export, f)
    args = [str(tmp_path / s / "report" / "verdicts.json") for s in ("seed1", "seed2")]
    args += ["--histories", str(tmp_path / "seed1.json.gz"), "--histories", str(tmp_path / "seed2.json.gz")]
    assert ew.main([*args, "--out", str(tmp_path / "ew")]) == 0
    doc = json.loads((tmp_path / "ew" / "early_warning.json").read_text())
    assert sorted(r["name"] for r in doc["runs"]) == ["seed1/baseline", "seed1/forks/fp32", "seed2/baseline",
                                                      "seed2/forks/fp32"]
    assert sum("fork_jump" in s for s in doc["skipped"]) == 2
    # max_logit above the stable forks' 30 first at step 39: leads 100 - 39 and 150 - 39, no false alarm
    assert doc["chosen"]["leads"] == {"seed1/baseline": 61, "seed2/baseline": 111}
    assert doc["chosen"]["false_alarms"] == 0 and doc["chosen"]["misses"] == 0
    assert ew.main([*args, "--out", str(tmp_path / "ew2"), "--keep-jumped"]) == 0
    doc = json.loads((tmp_path / "ew2" / "early_warning.json").read_text())
    assert len(doc["runs"]) == 6 and doc["chosen"]["misses"] >= 1  # a divergence at its own fork step: no lead


def test_holdout_chooses_on_the_other_sources_and_judges_the_left_out_one_by_hand():
    """Two sources. Left out g1 (A diverges at 100, C spikes to 45): chosen on g2 (B peak 120, D flat 20) the rule is
    max_logit > 20, which warns A at 29 (lead 71) and false-alarms on C. Left out g2: chosen on g1 it is > 45, which
    warns B at 29 (2*30 = 60 > 45; lead 31) and not D."""
    a, b, c, d = (logit_run("A", "diverged", 100, lambda s: s + 1.0),
                  logit_run("B", "diverged", 60, lambda s: 2.0 * (s + 1)),
                  logit_run("C", "stable", None, lambda s: 45.0 if s == 49 else 30.0),
                  logit_run("D", "stable", None, lambda s: 20.0))
    for r, g in ((a, "g1"), (c, "g1"), (b, "g2"), (d, "g2")):
        r.group = g
    folds = ew.holdout([a, b, c, d])
    assert [(f.held_out, f.chosen.threshold, f.test.leads, f.test.false_alarm_runs) for f in folds] == [
        ("g1", 20.0, {"A": 71}, ["C"]), ("g2", 45.0, {"B": 31}, [])]
    p = ew.pooled(folds)
    assert (p["misses"], p["diverged"], p["false_alarms"], p["stable"], p["mean_lead"]) == (0, 2, 1, 2, 51.0)
    assert ew.pooled(folds, "max_logit")["thresholds"] == {"g1": 20.0, "g2": 45.0}
    assert "rmax_rate" not in folds[0].per_signal  # absent from the runs: no threshold to carry
    md = ew.markdown(ew.table([a, b, c, d]), [a, b, c, d], None, [], 100, folds)
    assert "| g1 | 1/1 | `max_logit > 20` | 0/1, 0/1 | 0/1 | 1/1 | A 71 |" in md
    assert "**Pooled over the held-out sources:** 0 misses of 2, 1 false alarms of 2, mean lead 51 steps." in md
    # every diverged run in g1: left out, the others (D) have no divergence to choose a rule on, and the table says so
    b.group = "g1"
    folds = ew.holdout([a, b, c, d])
    assert (folds[0].chosen, folds[0].test) == (None, None) and folds[1].test.false_alarms == 0
    assert "| g1 | 2/1 | none (no diverged run left) |" in ew.markdown([], [a, b, c, d], None, [], 100, folds)
    assert ew.holdout([a, b, c]) == []  # one source only: nothing to hold out


def test_cli_holdout_needs_two_sources(tmp_path, capsys):
    import gzip
    (tmp_path / "s1" / "report").mkdir(parents=True)
    runs = [{"job": "baseline", "observed": "diverged", "divergence_step": 100, "mlflow_run_id": "r0"},
            {"job": "fp32", "observed": "stable", "fork_step": 50, "mlflow_run_id": "r1"}]
    (tmp_path / "s1" / "report" / "verdicts.json").write_text(json.dumps({"runs": runs}))
    export = {"runs": [{"run_id": "r0", "metrics": {"max_logit/L0": [[s, float(s)] for s in FLUSH]}},
                       {"run_id": "r1", "metrics": {"max_logit/L0": [[s, 30.0] for s in FLUSH]}}]}
    with gzip.open(tmp_path / "s1.json.gz", "wt") as f:
        json.dump(export, f)
    with pytest.raises(SystemExit):
        ew.main([str(tmp_path / "s1" / "report" / "verdicts.json"), "--histories", str(tmp_path / "s1.json.gz"),
                 "--holdout", "--out", str(tmp_path / "ew")])
    assert "--holdout needs runs from at least two sources" in capsys.readouterr().err


def test_live_check_compares_the_runs_firing_with_the_offline_rule():
    pts = [(9, 10.0), (19, 500.0), (29, 2000.0)]
    rule = {"signal": "max_logit", "threshold": 1000.0, "action": "tag"}
    runs = [Run("same", "stable", 0, None, {"max_logit": pts}, live={**rule, "step": 29, "value": 2000.0}),
            Run("other", "stable", 0, None, {"max_logit": pts}, live={**rule, "step": 19, "value": 500.0}),
            Run("quiet", "stable", 0, None, {"max_logit": pts[:2]}, live={**rule, "step": None}),
            Run("off", "stable", 0, None, {"max_logit": pts})]
    got = {c["run"]: (c["online_step"], c["offline_step"], c["agree"]) for c in ew.live_check(runs)}
    assert got == {"same": (29, 29, True), "other": (19, 29, False), "quiet": (None, None, True)}
    md = ew.markdown([], runs, None, [], 100)
    assert "2 of 3 runs with monitor.alarm on fired where" in md and "| other | max_logit > 1000 | step 19" in md
    assert "| **NO** |" in md


def test_a_source_is_named_by_the_folder_above_its_report():
    for report in ("report", "report_source", "report_gpu", "report_partial"):
        assert ew._label(f"results/x/seed1337-h100/{report}/verdicts.json") == "seed1337-h100"
    assert ew._label("results/x/seed1337-h100/baseline") == "baseline"  # a job folder: its own name
    assert ew._label("results/x/seed2-h100") == "seed2-h100"


def test_a_run_is_prefixed_with_its_source_once():
    assert ew._qualified({"job": "baseline", "source_label": "seed1"}) == "seed1/baseline"
    assert ew._qualified({"job": "seed2-h100/baseline", "source_label": "seed2-h100"}) == "seed2-h100/baseline"
    assert ew._qualified({"job": None, "mlflow_run_id": "abc", "source_label": "s"}) == "s/abc"
