"""The run record (orchestrator/record.py): encoding, names, the one verdict formula; a real smoke sweep whose table
rebuilt from MLflow equals the one built from its job folders, field for field, with the typed MLflow fields; and
committed reports that no sweep or single run overwrites."""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.record import RunRecord

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ the record itself
def test_non_finite_floats_round_trip_as_strict_json(tmp_path):
    rec = RunRecord(intervention="baseline", expected="diverges", observed="diverged", divergence_step=7,
                    final_loss=math.nan, min_loss=3.25, peak_wq_norm=math.inf, val_loss=-math.inf, steps_done=11,
                    cause=record.CAUSE_PRECISION)
    path = record.write(tmp_path, rec)
    assert path == tmp_path / record.RESULT_FILE and not list(tmp_path.glob("*.tmp"))
    raw = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert (raw["final_loss"], raw["peak_wq_norm"], raw["val_loss"]) == ("NaN", "Infinity", "-Infinity")
    assert raw["matches_paper"] is True and raw["record_version"] == record.RECORD_VERSION
    back = record.read(tmp_path)
    assert math.isnan(back.final_loss) and back.peak_wq_norm == math.inf and back.val_loss == -math.inf
    assert (back.min_loss, back.divergence_step, back.steps_done) == (3.25, 7, 11)
    assert back.to_json() == rec.to_json()


def test_older_result_json_is_read():
    """Before the record, job.py wrote str(x) for NaN and there was no record_version."""
    old = {"intervention": "baseline", "observed": "diverged", "final_loss": "nan", "peak_wq_norm": "inf",
           "divergence_step": 30, "unknown_key": 1}
    rec = RunRecord.from_dict(old)
    assert math.isnan(rec.final_loss) and rec.peak_wq_norm == math.inf and rec.record_version == 1
    assert RunRecord.from_dict({}).observed == "failed"


def test_metric_names_and_their_parsers():
    assert record.wq_sigma_name(2, 11) == "wq_sigma/L2.H11"
    assert record.parse_head_metric(record.wq_sigma_name(2, 11)) == ("wq_sigma", 2, 11)
    assert record.parse_head_metric(record.rmax_rows_name(0, 3)) == ("rmax_rows", 0, 3)
    assert record.parse_layer_metric(record.max_logit_name(5)) == 5
    assert record.parse_head_metric("wq_sigma/L2") is None and record.parse_layer_metric("train/loss") is None
    assert record.parse_where(record.head_where(1, 4)) == (1, 4) and record.parse_where(None) is None
    assert all(name.startswith(record.HISTORY_PREFIXES) for name in
               (record.LOSS, record.VAL_LOSS, record.wq_sigma_name(0, 0), record.rmax_rows_name(0, 0),
                record.max_logit_name(0)))


def test_matches_paper_is_the_one_formula():
    cases = {("diverges", "diverged"): True, ("stable", "stable"): True, ("diverges", "stable"): False,
             ("stable", "diverged"): False, ("stable", "failed"): False, ("diverges", "failed"): False,
             (None, "stable"): False, (None, "diverged"): False}
    for (expected, observed), want in cases.items():
        cause = record.control_cause(observed, 5, {"observed": "stable", "steps_done": 20})  # a stable control
        assert record.matches_paper(expected, observed, cause) is want, (expected, observed)
        assert RunRecord(expected=expected, observed=observed, cause=cause).matches_paper is want
    # a divergence without its FP32 control, or whose control diverged too, is not precision's: no match
    assert not record.matches_paper("diverges", "diverged")
    for ctrl in (None, {"observed": "diverged", "divergence_step": 1, "steps_done": 4},
                 {"observed": "stable", "steps_done": 5}, {"observed": "failed"}):
        cause = record.control_cause("diverged", 5, ctrl)
        assert cause == (record.CAUSE_NOT_PRECISION if ctrl and ctrl["observed"] == "diverged"
                         else record.CAUSE_NO_CONTROL) and not record.matches_paper("diverges", "diverged", cause)
    # the formula train.py used to tag runs with: a failed run "matched" a stable expectation
    old = lambda e, o: (o == "diverged") == (e == "diverges")  # noqa: E731
    assert old("stable", "failed") and not record.matches_paper("stable", "failed")


def test_record_metrics_and_tags_are_typed():
    stable = RunRecord(intervention="fp32", expected="stable", observed="stable", final_loss=4.0, min_loss=3.9,
                       peak_wq_norm=2.5, peak_wq_where="L1.H0", steps_done=20, wall_s=1.5)
    m = record.record_metrics(stable)
    assert "divergence_step" not in m  # absent, never "None"
    assert m == {"final_loss": 4.0, "min_loss": 3.9, "peak_wq_sigma": 2.5, "steps_done": 20.0, "wall_s": 1.5}
    assert record.record_tags(stable) == {"verdict": "stable", "matches_paper": "true", "intervention": "fp32",
                                          "record_version": str(record.RECORD_VERSION), "peak_wq_where": "L1.H0",
                                          "verdict_line": "stable"}
    rows = [{"expected": "diverges", "observed": "diverged", "cause": record.CAUSE_PRECISION},
            {"expected": "stable", "observed": "failed"},
            {"expected": "stable", "observed": "diverged"}]
    assert record.sweep_metrics(rows) == {"runs": 3.0, "runs_matching_paper": 1.0, "runs_diverged": 2.0,
                                          "runs_stable": 0.0, "runs_failed": 1.0}


def test_isolation_slots_per_gpu(monkeypatch):
    """The pipeline's concurrency: PER_GPU slots on each visible GPU (interleaved), PER_GPU on the CPU."""
    import torch

    from flash_forensics.orchestrator.analysis.isolate import Pipeline, Plan
    plan = Plan(root=Path("/r"), out=Path("/o"), uri="sqlite:///x.db", per_gpu=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Pipeline(plan).slots() == ([None, None], 0, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert Pipeline(plan).slots() == (["3", "5", "3", "5"], 2, 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert Pipeline(plan).slots()[0] == ["0", "1", "0", "1"]


# ---------------------------------------------------------------------------------- a real smoke sweep
# FP32 outside attention (attention stays paper_bf16, as asserted below): CPU autocast's BF16 GEMMs were most of
# this fixture's time, and nothing here depends on them. The sweep keeps the preset's 20 steps: the NaN job's early
# stop (3 steps after step 7, before step 20) is checked on it below, with the sweep going on past the failure
SMOKE = ["experiment=smoke", "sweep_name=paper_isolation", "tracking.writer=thread", "train.precision=fp32"]


def _run(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    cmd = [sys.executable, str(ROOT / "run.py"), *args, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
           f"results_dir={tmp_path}/results"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _digest(folder: Path):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory):
    """Two smoke jobs (a forced NaN, and none) in results/paper_isolation/<date>/, next to a copy of the committed
    reproduction in results/paper_isolation/; then a single run with the same sweep_name."""
    tmp = tmp_path_factory.mktemp("record")
    committed = tmp / "results" / "paper_isolation"
    committed.mkdir(parents=True)
    for name in ("verdicts.md", "verdicts.json", "localize.json"):
        shutil.copy(ROOT / "results" / "paper_isolation" / name, committed / name)
    shutil.copytree(ROOT / "results" / "paper_isolation" / "plots", committed / "plots")
    before = _digest(committed)
    sweep = _run(tmp, "-m", *SMOKE, "intervention=baseline", "debug.nan_at_step=7,null")
    single = _run(tmp, *SMOKE, "intervention=fp32", "train.max_steps=10", f"hydra.run.dir={tmp}/single")
    return tmp, committed, before, sweep, single


def test_committed_report_is_not_overwritten(smoke_sweep):
    tmp, committed, before, sweep, single = smoke_sweep
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    after = {k: v for k, v in _digest(committed).items() if k in before}
    assert after == before  # every committed file byte for byte
    report, = committed.glob("*/report")  # the sweep's report: in its dated folder
    assert (report / "verdicts.md").is_file() and (report / "verdicts.json").is_file()
    assert (report / "plots" / "loss_curves.png").is_file()
    assert (tmp / "single" / "report" / "verdicts.json").is_file()  # the single run: its own folder
    assert len(json.loads((report / "verdicts.json").read_text())["runs"]) == 2  # not rewritten by the single run
    assert not [k for k in _digest(committed) if k not in before and not k.startswith(report.parent.name)]


def test_forced_nan_diverges_stops_early_and_sweep_goes_on(smoke_sweep):
    """The fixture's sweep through `python run.py -m` (the basic launcher): the forced NaN diverges at its step,
    stops early with every step up to the stop recorded, and the sweep goes on to the clean job."""
    tmp, committed, _, sweep, _ = smoke_sweep
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    results = {}
    for f in committed.glob("*/*/result.json"):  # the sweep's dated folder: <date>/<job>/result.json
        res = json.loads(f.read_text())
        results["nan" if any("nan_at_step=7" in o for o in res["overrides"]) else "clean"] = res
    nan, clean = results["nan"], results["clean"]
    assert nan["observed"] == "diverged" and nan["divergence_step"] == 7
    assert nan["early_stopped"] and nan["steps_done"] < 20  # early_stop_after 3: stops at the flush after step 10
    assert clean["observed"] == "stable" and clean["steps_done"] == 20 and clean["divergence_step"] is None
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    run = c.get_run(nan["mlflow_run_id"])
    assert run.data.tags["verdict"] == "diverged" and run.data.tags["divergence_step"] == "7"
    hist = {m.step: m.value for m in c.get_metric_history(nan["mlflow_run_id"], "train/loss")}
    assert math.isnan(hist[7]) and math.isfinite(hist[6])
    assert sorted(hist) == list(range(nan["steps_done"]))  # everything up to the stop is recorded
    report, = committed.glob("*/report")
    doc = json.loads((report / "verdicts.json").read_text())
    assert sorted(r["observed"] for r in doc["runs"]) == ["diverged", "stable"]


def test_table_from_mlflow_equals_table_from_job_folders(smoke_sweep):
    from flash_forensics.orchestrator.report.readback import rows_from_mlflow
    from flash_forensics.orchestrator.report.rows import ROW_KEYS, collect_rows, compare
    tmp, committed, _, sweep, _ = smoke_sweep
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    sweep_dir = next(committed.glob("*/report")).parent
    uri = f"sqlite:///{tmp}/mlflow.db"
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name("paper_isolation")
    # the single run of the fixture is its own source run: one table per source, the sweep's two jobs
    parent = json.loads((sweep_dir / "mlflow_parent.json").read_text())["run_id"]
    jobs = [r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("mlflow.parentRunId") == parent]
    assert len(jobs) == 2
    from_dirs = compare(collect_rows(sweep_dir))
    from_store = []
    for run in jobs:
        rows, _ = rows_from_mlflow(uri, "paper_isolation", source_run=run.info.run_id)
        from_store += rows
    from_store = compare(sorted(from_store, key=lambda r: int(r["job"])))
    assert [r["job"] for r in from_dirs] == ["0", "1"]
    assert len(from_store) == len(from_dirs)
    for a, b in zip(from_dirs, from_store):
        assert {k: record.encode(a[k]) for k in ROW_KEYS} == {k: record.encode(b[k]) for k in ROW_KEYS}
    obs = {r["observed"] for r in from_dirs}
    assert obs == {"diverged", "stable"}
    diverged = next(r for r in from_dirs if r["observed"] == "diverged")
    assert diverged["divergence_step"] == 7 and math.isnan(diverged["final_loss"]) and diverged["min_loss"] > 0


def test_mlflow_fields_are_typed(smoke_sweep):
    tmp, committed, _, sweep, _ = smoke_sweep
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    sweep_dir = next(committed.glob("*/report")).parent
    parent_id = json.loads((sweep_dir / "mlflow_parent.json").read_text())["run_id"]
    runs = c.search_runs([c.get_experiment_by_name("paper_isolation").experiment_id])
    jobs = {r.data.tags["verdict"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id}
    assert set(jobs) == {"diverged", "stable"}
    for verdict, run in jobs.items():
        t, m, p = run.data.tags, run.data.metrics, run.data.params
        res = record.read(Path(t["job_dir"]))
        # two baselines, no FP32 run: the divergence has no control and matches nothing
        assert t["intervention"] == "baseline" and t["matches_paper"] == "false"
        assert t.get("cause") == ("no FP32 control" if verdict == "diverged" else None)
        assert "matches_expect" not in t
        for key in ("final_loss", "min_loss", "peak_wq_sigma", "wall_s", "steps_done"):
            assert key in m, key
        assert m["wall_s"] == res.wall_s and m["steps_done"] == res.steps_done
        assert m["peak_wq_sigma"] == res.peak_wq_norm and t["peak_wq_where"] == res.peak_wq_where
        # params: no plumbing, no pre-intervention attention config, no unset intervention knobs
        assert not [k for k in p if k.split(".")[0] in ("results_dir", "tracking", "debug", "attention", "hydra")]
        assert p["intervention.name"] == "baseline" and "None" not in [p[k] for k in p
                                                                          if k.startswith("intervention.")]
        assert p["attention_effective.recipe"] == "paper_bf16" and p["attention_route.L0"]
        # the device model is part of the setup a control must share (a seed repeats on one GPU model only)
        assert p["device.name"] == "cpu" and res.setup["device.name"] == "cpu"
    assert jobs["diverged"].data.metrics["divergence_step"] == 7 and jobs["diverged"].data.tags["divergence_step"] \
        == "7"
    assert "divergence_step" not in jobs["stable"].data.metrics  # absent, not the string "None"
    assert "divergence_step" not in jobs["stable"].data.tags
    pm = c.get_run(parent_id).data.metrics
    assert pm == {"runs": 2.0, "runs_matching_paper": 0.0, "runs_diverged": 1.0, "runs_stable": 1.0,
                  "runs_failed": 0.0}
