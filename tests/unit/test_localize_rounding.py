"""Localization's third stage (rounding point): verdicts from constructed run records, the files it writes, the
Cause section of a report, ff.cause.* tags on a real sqlite MLflow store, and its wiring into
flash_forensics.orchestrator.analysis.isolate."""
import json

import pytest

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.analysis.localize import main as localize_main
from flash_forensics.orchestrator.analysis.localize import rounding, rounding_io
from flash_forensics.orchestrator.analysis.localize.rounding import analyze, parse_point
from flash_forensics.orchestrator.record import RunRecord
from flash_forensics.orchestrator.report.rows import row_from_record

BD = 860  # the baseline's divergence step in these rows


def row(job, intervention, observed, div=None, steps=1000, error=None, run_id=None, seed=1):
    rec = RunRecord(intervention=intervention, observed=observed, divergence_step=div, steps_done=steps,
                    error=error, mlflow_run_id=run_id, overrides=[f"intervention={intervention}", f"train.seed={seed}"])
    return row_from_record(rec, job=job)


def pv_out_rows(**ids):
    """pv_out is the cause; lifting acc delays by 52 steps; scores does nothing."""
    return [row("baseline", "baseline", "diverged", BD, run_id=ids.get("baseline")),
            row("fp32", "fp32", "stable"),
            row("r-0", "lift_pv_out", "stable"), row("r-1", "bf16_only_pv_out", "diverged", 912),
            row("r-2", "lift_acc", "diverged", BD + 52), row("r-3", "bf16_only_acc", "stable"),
            row("r-4", "lift_scores", "diverged", BD), row("r-5", "bf16_only_scores", "stable")]


def by_point(result):
    return {p.point: p for p in result.points}


def test_parse_point():
    assert parse_point("lift_pv_out") == ("lift", "pv_out")
    assert parse_point("bf16_only_bwd_gemm_in") == ("bf16_only", "bwd_gemm_in")
    assert parse_point("lift_bf16_only_x") == ("lift", "bf16_only_x")
    for name in ("baseline", "pv_fp32", "lift_", "bf16_only_", "lifted_pv_out", None):
        assert parse_point(name) is None, name


def test_names_the_point_that_lifting_prevents_and_rounding_reproduces(monkeypatch):
    # only the points these rows fork: the others would be listed as 'no fork of ...' (the next tests)
    monkeypatch.setattr(rounding, "known_points", lambda: ('scores', 'pv_out', 'acc'))
    res = analyze(pv_out_rows())
    assert res.needs_bf16 == ["pv_out"] and res.cause_points == ["pv_out"]
    assert res.prevents == ["pv_out"] and res.reproduces == ["pv_out"] and res.delays == {"acc": 52}
    pts = by_point(res)
    assert pts["scores"].lift.outcome == "no effect" and pts["scores"].bf16_only.outcome == "no effect"
    assert pts["acc"].bf16_only.outcome == "no effect"
    assert res.verdict() == ("divergence needs BF16 at `pv_out` (lifting it alone prevents it; rounding it alone to "
                             "BF16, the rest FP32, reproduces it at step 912); lifting `acc` alone delays it by 52 "
                             "steps")
    assert "no single rounding point" not in res.format()


def test_delay_only():
    rows = [r for r in pv_out_rows() if not r["intervention"].endswith("pv_out")]
    rows += [row("r-6", "lift_pv_out", "diverged", BD + 7), row("r-7", "bf16_only_pv_out", "stable")]
    res = analyze(rows)
    assert res.needs_bf16 == [] and res.cause_points == [] and res.delays == {"acc": 52, "pv_out": 7}
    v = res.verdict()
    assert v.startswith("no single rounding point explains it (no lift prevents it and no BF16-only rounding "
                        "reproduces it)")
    assert "lifting `acc` alone delays it by 52 steps" in v and "lifting `pv_out` alone delays it by 7 steps" in v
    # a gain below min_delay is no delay
    res8 = analyze(rows, min_delay=8)
    assert res8.delays == {"acc": 52} and by_point(res8)["pv_out"].lift.outcome == "no effect"
    with pytest.raises(ValueError, match="min_delay=0"):
        analyze(rows, min_delay=0)


def test_nothing_explains_it(monkeypatch):
    # only the points these rows fork: the others would be listed as 'no fork of ...' (the next tests)
    monkeypatch.setattr(rounding, "known_points", lambda: ('scores', 'pv_out'))
    rows = [row("baseline", "baseline", "diverged", BD), row("fp32", "fp32", "stable"),
            row("r-0", "lift_pv_out", "diverged", BD), row("r-1", "bf16_only_pv_out", "stable"),
            row("r-2", "lift_scores", "diverged", BD - 30), row("r-3", "bf16_only_scores", "stable")]
    res = analyze(rows)
    assert res.cause_points == [] and res.delays == {}
    assert by_point(res)["scores"].lift.outcome == "hastens"
    assert res.verdict() == ("no single rounding point explains it (no lift prevents it and no BF16-only rounding "
                             "reproduces it); lifting `scores` alone hastens it by 30 steps")


def test_lift_prevents_but_lowering_alone_does_not_reproduce():
    rows = [row("baseline", "baseline", "diverged", BD), row("fp32", "fp32", "stable"),
            row("r-0", "lift_stats", "stable"), row("r-1", "bf16_only_stats", "stable")]
    res = analyze(rows)
    assert res.needs_bf16 == [] and res.cause_points == ["stats"]
    assert res.what() == "lifting `stats` alone prevents it (rounding it alone to BF16, the rest FP32: no effect)"


def test_failed_and_missing_forks_are_named():
    rows = [r for r in pv_out_rows() if r["intervention"] != "lift_pv_out" and r["intervention"] != "bf16_only_acc"]
    rows.append(row("r-9", "lift_pv_out", "failed", error="RuntimeError: CUDA out of memory\ntraceback..."))
    res = analyze(rows)
    pts = by_point(res)
    assert pts["pv_out"].lift.outcome == "failed" and pts["acc"].bf16_only.outcome == "not run"
    assert res.needs_bf16 == [] and res.cause_points == ["pv_out"]  # the lowering alone still reproduces it
    v = res.verdict()
    assert "rounding `pv_out` alone to BF16 (the rest FP32) reproduces it at step 912 (lifting it alone: failed)" in v
    assert "lift_pv_out (r-9): failed: RuntimeError: CUDA out of memory" in v and "traceback" not in v
    assert "not run: bf16_only_acc" in v


def test_forks_that_cannot_be_judged_say_why(monkeypatch):
    # only the points these rows fork: the others would be listed as 'no fork of ...' (the next tests)
    monkeypatch.setattr(rounding, "known_points", lambda: ('pv_out',))
    # the baseline did not diverge: a lift has nothing to prevent
    res = analyze([row("baseline", "baseline", "stable"), row("r-0", "lift_pv_out", "stable")])
    side = by_point(res)["pv_out"].lift
    assert side.outcome == "inconclusive" and "nothing to prevent" in side.runs[0].note
    assert res.cause_points == [] and res.verdict().startswith(
        "the baseline did not diverge: there is no divergence to explain. Not used: lift_pv_out (r-0): "
        "inconclusive: the baseline (baseline) stable: nothing to prevent")
    # no baseline at all, and a failed fork: nothing could be judged (not "no single point explains it")
    res = analyze([row("r-0", "lift_pv_out", "stable"), row("r-1", "bf16_only_pv_out", "failed", error="killed")])
    assert res.verdict() == ("no rounding-point fork could be judged. Not used: lift_pv_out (r-0): inconclusive: no "
                             "baseline run to compare with; bf16_only_pv_out (r-1): failed: killed")
    # a stable lift that stopped before the baseline's divergence step proves nothing
    res = analyze([row("baseline", "baseline", "diverged", BD), row("r-0", "lift_pv_out", "stable", steps=BD - 10)])
    assert by_point(res)["pv_out"].lift.outcome == "inconclusive" and res.prevents == []
    assert f"stopped at step {BD - 11}, before the baseline's divergence at step {BD}" in res.verdict()
    # a diverged lowering without a stable fp32 run reproduces nothing
    res = analyze([row("baseline", "baseline", "diverged", BD), row("r-1", "bf16_only_pv_out", "diverged", 900)])
    assert res.reproduces == [] and "no fp32 reference run" in res.verdict()
    res = analyze([row("baseline", "baseline", "diverged", BD), row("fp32", "fp32", "diverged", 990),
                   row("r-1", "bf16_only_pv_out", "diverged", 900)])
    assert res.reproduces == [] and "the fp32 reference (fp32) diverged too" in res.verdict()
    # no rounding forks at all
    res = analyze([row("baseline", "baseline", "diverged", BD), row("fp32", "fp32", "stable")])
    assert res.points == [] and res.verdict().startswith("no rounding-point forks")


def test_each_fork_is_judged_against_its_own_seed():
    rows = [row("b1", "baseline", "diverged", 500, seed=1), row("b2", "baseline", "diverged", 800, seed=2),
            row("l1", "lift_acc", "diverged", 540, seed=1), row("l2", "lift_acc", "diverged", 830, seed=2)]
    side = by_point(analyze(rows))["acc"].lift
    assert side.outcome == "delays" and side.steps == 30  # the smaller gain: 40 (seed 1), 30 (seed 2)
    assert [r.against for r in side.runs] == ["b1", "b2"]
    rows[3] = row("l2", "lift_acc", "stable", seed=2)
    side = by_point(analyze(rows))["acc"].lift
    assert side.outcome == "mixed"


def test_every_point_of_the_recipe_is_listed(monkeypatch):
    import flash_forensics.kernels.recipes
    monkeypatch.setattr(flash_forensics.kernels.recipes, "ROUNDING_POINTS", ("scores", "pv_out", "acc", "o_store"),
                        raising=False)
    res = analyze(pv_out_rows() + [row("r-8", "lift_pv_outt", "stable")])
    assert [p.point for p in res.points] == ["scores", "pv_out", "acc", "o_store", "pv_outt"]
    assert by_point(res)["o_store"].lift.outcome == "not run"
    v = res.verdict()
    assert "not run: bf16_only_pv_outt; no fork of o_store" in v
    assert "`pv_outt` is not a rounding point of flash_forensics.kernels.recipes" in v


def test_with_the_layer_heads_stage():
    loc = {"target": {"layer": 2, "heads": [1, 7], "why": "stands out"}}
    res = analyze(pv_out_rows(), localization=loc)
    assert res.verdict().startswith("layer 2, heads 1,7 (stands out) -> divergence needs BF16 at `pv_out`")
    tags = rounding_io.tags(res)
    assert tags["ff.cause.layer"] == "2" and tags["ff.cause.heads"] == "1,7"
    assert tags["ff.cause.point"] == "pv_out" and tags["ff.cause.delays"] == "acc:+52"
    assert tags["ff.cause.verdict"] == res.verdict()


def test_json_and_plot_written(tmp_path):
    import matplotlib.image
    res = analyze(pv_out_rows(), source="constructed")
    paths = rounding_io.write(res, tmp_path / "out")
    doc = json.loads(paths["json"].read_text())
    assert paths["json"] == tmp_path / "out" / "rounding.json"
    assert doc["needs_bf16"] == ["pv_out"] and doc["verdict"] == res.verdict() and doc["delays"] == {"acc": 52}
    pv = next(p for p in doc["points"] if p["point"] == "pv_out")
    assert pv["lift"]["outcome"] == "prevents" and pv["bf16_only"]["steps"] == 912
    img = matplotlib.image.imread(paths["plot"])
    assert paths["plot"] == tmp_path / "out" / "rounding.png" and img.shape[0] > 200 and img.shape[1] > 600


def _report(tmp_path, rows, uri=None, parent=None):
    from flash_forensics.orchestrator.report.sweep import write_report
    out = tmp_path / "report"
    write_report(rows, out, uri, parent_run_id=parent, sweep="rounding_points", echo=False)
    return out


def test_cli_adds_the_cause_to_an_existing_report(tmp_path, capsys):
    out = _report(tmp_path, pv_out_rows())
    assert "## Cause" not in (out / "verdicts.md").read_text()
    assert localize_main(["rounding", str(out), "--no-tags"]) == 0
    assert "Cause: divergence needs BF16 at `pv_out`" in capsys.readouterr().out
    md = (out / "verdicts.md").read_text().split("\n")
    i = md.index("## Cause")
    assert "runs; " in md[i - 2] and md[i + 2].startswith("divergence needs BF16 at `pv_out`")
    assert "| `pv_out` | stable: prevents (to step 999) | diverged at 912: reproduces |" in md
    assert "![rounding points](rounding.png)" in md and (out / "rounding.png").is_file()
    assert json.loads((out / "verdicts.json").read_text())["cause"].startswith("divergence needs BF16 at `pv_out`")
    # run again over a changed report: one Cause section, the new verdict
    assert rounding_io.main([str(out), "--no-tags", "--min-delay", "60"]) == 0
    md = (out / "verdicts.md").read_text()
    assert md.count("## Cause") == 1 and "delays it by 52" not in md and "## Plots" in md


def test_cli_refuses_what_is_no_report(tmp_path, capsys):
    assert rounding_io.main([str(tmp_path / "nowhere")]) == 2
    assert "not a report dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rounding_io.main([str(tmp_path), "--min-delay", "0"])
    assert "--min-delay=0 is not allowed: expected an integer >= 1" in capsys.readouterr().err


def test_cli_refuses_a_report_without_rounding_point_forks(tmp_path, capsys):
    """A report of baseline and fp32 only wrote an empty rounding.json/png, a 'Cause: no rounding-point forks' into
    verdicts.md/json and ff.cause.* tags, with exit 0; it is refused, and the report is left as it was."""
    out = _report(tmp_path, [row("baseline", "baseline", "diverged", BD), row("fp32", "fp32", "stable")])
    before = (out / "verdicts.md").read_text(), (out / "verdicts.json").read_text()
    assert rounding_io.main([str(out), "--no-tags"]) == 2
    err = capsys.readouterr().err
    assert f"source {str(out)!r} is not allowed: its 2 runs hold no rounding-point fork" in err, err
    assert not (out / "rounding.json").exists() and not (out / "rounding.png").exists()
    assert ((out / "verdicts.md").read_text(), (out / "verdicts.json").read_text()) == before


def test_cli_refuses_an_out_that_is_a_file_before_reading(tmp_path, capsys):
    """--out a file (or under one) failed after the analysis with FileExistsError / NotADirectoryError."""
    out = _report(tmp_path, pv_out_rows())
    (tmp_path / "afile").write_text("x")
    for bad in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert rounding_io.main([str(out), "--out", str(bad), "--no-tags"]) == 2
        err = capsys.readouterr().err
        assert f"--out={str(bad)!r} is not allowed: {tmp_path / 'afile'} is a file" in err, err
    assert not (out / "rounding.json").exists()


def test_write_report_renders_the_cause(tmp_path):
    from flash_forensics.orchestrator.report.sweep import write_report
    rows = pv_out_rows()
    res = analyze(rows)
    out = tmp_path / "r"
    c = rounding_io.cause(res, rounding_io.write(res, out))
    write_report(rows, out, None, sweep="s", echo=False, cause=c)
    md = (out / "verdicts.md").read_text()
    assert md.count("## Cause") == 1 and res.verdict() in md
    assert json.loads((out / "verdicts.json").read_text())["cause"] == res.verdict()
    html = (out / "verdicts.html").read_text()
    assert "Cause: " in html and "lifting it alone prevents it" in html


@pytest.fixture
def store(tmp_path):
    from flash_forensics.orchestrator.tracking.tracker import get_or_create_experiment, make_client
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = make_client(uri)
    exp = get_or_create_experiment(client, "rounding_test", uri)
    ids = {name: client.create_run(exp, run_name=name).info.run_id for name in ("baseline", "lift", "parent")}
    return uri, client, ids


def test_mlflow_tags_on_the_baseline_and_parent_run(tmp_path, store, capsys):
    uri, client, ids = store
    rows = pv_out_rows(baseline=ids["baseline"])
    rows[2]["mlflow_run_id"] = ids["lift"]
    out = _report(tmp_path, rows, uri, ids["parent"])
    assert rounding_io.main([str(out)]) == 0, capsys.readouterr()
    base = client.get_run(ids["baseline"]).data.tags
    assert base["ff.cause.point"] == "pv_out" and base["ff.cause.needs_bf16"] == "pv_out"
    assert base["ff.cause.verdict"].startswith("divergence needs BF16 at `pv_out`")
    assert base["ff.cause.delays"] == "acc:+52" and base["ff.cause.reproduces"] == "pv_out"
    assert client.get_run(ids["parent"]).data.tags["ff.cause.point"] == "pv_out"
    assert not any(k.startswith("ff.cause.") for k in client.get_run(ids["lift"]).data.tags)  # forks untouched
    logged = {f.path for f in client.list_artifacts(ids["parent"], "report")}
    assert {"report/rounding.json", "report/rounding.png"} <= logged


def test_nothing_explained_is_tagged_none(tmp_path, store):
    uri, client, ids = store
    rows = [row("baseline", "baseline", "diverged", BD, run_id=ids["baseline"]), row("fp32", "fp32", "stable"),
            row("r-0", "lift_pv_out", "diverged", BD), row("r-1", "bf16_only_pv_out", "stable")]
    rounding_io.tag_runs(uri, rounding_io.baseline_run_ids(analyze(rows)), rounding_io.tags(analyze(rows)))
    tags = client.get_run(ids["baseline"]).data.tags
    assert tags["ff.cause.point"] == "none" and tags["ff.cause.verdict"].startswith("no single rounding point")


def test_isolate_report_runs_the_stage(tmp_path, store, capsys):
    """flash_forensics.orchestrator.analysis.isolate's report step over job folders (no training): with rounding_points
    among the sweeps the Cause reaches verdicts.md, rounding.{json,png}, the baseline's and the parent run's tags."""
    from flash_forensics.orchestrator.analysis.isolate import Pipeline, Plan
    from flash_forensics.orchestrator.analysis.localize import LayerStats, Localization
    uri, client, ids = store
    root = tmp_path / "root"
    rows = pv_out_rows(baseline=ids["baseline"])
    for r in rows:
        job = root / "baseline" if r["job"] == "baseline" else root / "forks" / r["job"]
        rec = RunRecord.from_dict({k: v for k, v in r.items() if k not in ("job", "vs_baseline")})
        record.write(job, rec)
    loc = Localization(0, 10, BD, [LayerStats(layer=1, growth=2.0, rank=1)], [], layer=1, outlier_heads=[0, 3],
                       reason="stands out")
    plan = Plan(root=root, out=root / "report", uri=uri, sweeps=("paper_isolation", rounding.SWEEP))
    Pipeline(plan).report(root / "baseline", 100, root / "ckpt.pt", loc)
    out = plan.out
    md = (out / "verdicts.md").read_text()
    assert "## Cause" in md and "layer 1, heads 0,3 (stands out) -> divergence needs BF16 at `pv_out`" in md
    assert json.loads((out / "rounding.json").read_text())["needs_bf16"] == ["pv_out"]
    assert (out / "rounding.png").is_file()
    tags = client.get_run(ids["baseline"]).data.tags
    assert tags["ff.cause.point"] == "pv_out" and tags["ff.cause.layer"] == "1"
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="tags.role = 'sweep'")
    assert len(runs) == 1 and runs[0].data.tags["ff.cause.point"] == "pv_out"
    assert {"report/rounding.json", "report/rounding.png"} <= {f.path for f in
                                                              client.list_artifacts(runs[0].info.run_id, "report")}


def test_isolate_without_rounding_sweep_adds_no_cause(tmp_path, store):
    from flash_forensics.orchestrator.analysis.isolate import Pipeline, Plan
    from flash_forensics.orchestrator.analysis.localize import LayerStats, Localization
    uri, client, ids = store
    root = tmp_path / "root"
    record.write(root / "baseline", RunRecord(intervention="baseline", observed="diverged", divergence_step=BD,
                                              steps_done=1000, mlflow_run_id=ids["baseline"]))
    record.write(root / "forks" / "r-0", RunRecord(intervention="lift_pv_out", observed="stable", steps_done=1000))
    loc = Localization(0, 10, BD, [LayerStats(layer=1, growth=2.0, rank=1)], [], layer=1)
    plan = Plan(root=root, out=root / "report", uri=uri, sweeps=("paper_isolation",))
    Pipeline(plan).report(root / "baseline", 100, root / "ckpt.pt", loc)
    assert "## Cause" not in (plan.out / "verdicts.md").read_text() and not (plan.out / "rounding.json").exists()
    assert not any(k.startswith("ff.cause.") for k in client.get_run(ids["baseline"]).data.tags)
