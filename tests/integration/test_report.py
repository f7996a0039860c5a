"""The sweep report: synthetic result.json files + a real sqlite MLflow store, and a real Hydra multirun."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from flash_forensics.orchestrator.report.sweep import SweepReport, compare, write_run_report
from flash_forensics.orchestrator.tracking.tracker import PARENT_FILE, Tracker, TrackingConfig, find_parent, make_client

ROOT = Path(__file__).resolve().parents[2]

# (intervention, expect, observed, divergence step, error)
JOBS = [("baseline", "diverges", "diverged", 30, None),
        ("fp32", "stable", "stable", None, None),
        ("pv_fp32", "stable", "stable", None, None),
        ("tiling_off", "diverges", "stable", None, None),  # disagrees with the paper
        ("sfa", "stable", "failed", None, "RuntimeError: CUDA out of memory (synthetic)")]


def fake_run(uri, parent, name, observed, div):
    tr = Tracker(TrackingConfig(uri=uri), name, parent_run_id=parent["run_id"], experiment="ignored",
                 tags={"intervention": name})
    for s in range(40):
        loss = 6.0 - 0.05 * s + (5.0 if div is not None and s >= div else 0.0)
        tr.log_metrics({"train/loss": loss}, step=s)
        if s % 10 == 0:
            tr.log_metrics({f"wq_sigma/L{l}.H{h}": 1.0 + 0.1 * s * (l + h) for l in range(2) for h in range(2)}, s)
            tr.log_metrics({f"rmax_rows/L{l}.H{h}": float(s * h) for l in range(2) for h in range(2)}, s)
    tr.set_tags({"verdict": observed})
    tr.close("FAILED" if observed == "failed" else "FINISHED")
    return tr.run_id


@pytest.fixture
def sweep(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep_dir = tmp_path / "results" / "synthetic" / "2026-01-01_00-00-00"
    cfg = OmegaConf.create({"sweep_name": "synthetic", "results_dir": str(tmp_path / "results"),
                            "tracking": {"uri": uri, "experiment": None},
                            "hydra": {"sweep": {"dir": str(sweep_dir)}}})
    return cfg, sweep_dir, uri


def test_report_from_synthetic_results_and_real_store(sweep, capsys):
    cfg, sweep_dir, uri = sweep
    SweepReport().on_multirun_start(cfg)
    parent = find_parent(sweep_dir)
    assert parent is not None and (sweep_dir / PARENT_FILE).is_file()
    for i, (name, expect, observed, div, error) in enumerate(JOBS):
        job = sweep_dir / str(i)
        job.mkdir(parents=True)
        rid = fake_run(uri, parent, name, observed, div)
        (job / "result.json").write_text(json.dumps({
            "intervention": name, "overrides": [f"intervention={name}", "seed=1"], "expected": expect,
            "observed": observed, "divergence_step": div, "final_loss": 4.0 if div is None else 9.0, "min_loss": 4.0,
            "peak_wq_norm": 4.9, "peak_wq_where": "L1.H1", "mlflow_run_id": rid, "steps_done": 40, "error": error,
            "wall_s": 1.0, "attention_routes": ["flash/emulator/paper_bf16"] * 2}))
    killed = sweep_dir / "5" / ".hydra"  # a job killed before it could write result.json
    killed.mkdir(parents=True)
    (killed / "overrides.yaml").write_text("- intervention=head_upcast\n- seed=1\n")

    SweepReport().on_multirun_end(cfg)  # a fresh instance: the parent run comes from mlflow_parent.json

    out = sweep_dir / "report"  # the dated sweep folder keeps its own report
    doc = json.loads((out / "verdicts.json").read_text())
    rows = doc["runs"]
    assert [r["intervention"] for r in rows] == [j[0] for j in JOBS] + ["head_upcast"]
    assert [r["expected"] for r in rows] == [j[1] for j in JOBS] + [None]
    assert [r["observed"] for r in rows] == [j[2] for j in JOBS] + ["failed"]
    assert [r["matches_paper"] for r in rows] == [True, True, True, False, False, False]
    assert rows[0]["divergence_step"] == 30 and rows[0]["mlflow_run_id"]
    assert "stable where the baseline diverged at step 30" in rows[2]["vs_baseline"]
    assert "final loss +0.000 vs fp32" in rows[2]["vs_baseline"]
    assert "CUDA out of memory" in rows[4]["error"] and "no result.json" in rows[5]["error"]
    assert rows[5]["overrides"] == ["intervention=head_upcast", "seed=1"]
    assert doc["summary"] == {"runs": 6, "matches_paper": 3, "void": 0, "failed": 2}
    assert doc["meta"]["git"]["git.commit"] and doc["meta"]["command"].startswith("python")
    md = (out / "verdicts.md").read_text()
    assert "| 3 | tiling_off | - |" in md and "## Failed runs" in md and "CUDA out of memory" in md
    assert "overrides shared by every run: `seed=1`" in md
    assert f"mlflow ui --backend-store-uri {uri}" in md
    for png in ("loss_curves", "wq_spectral_norm", "repeated_maxima"):
        p = out / "plots" / f"{png}.png"
        assert p.is_file() and p.stat().st_size > 5000 and f"plots/{png}.png" in md
    assert not (Path(cfg.results_dir) / "synthetic" / "verdicts.json").exists()  # never results/<sweep>/

    client = make_client(uri)
    prun = client.get_run(parent["run_id"])
    assert prun.info.status == "FINISHED" and prun.data.tags["sweep.failed"] == "2"
    assert {a.path for a in client.list_artifacts(parent["run_id"], "report")} == {"report/verdicts.md",
                                                                                  "report/verdicts.json"}
    assert len(client.list_artifacts(parent["run_id"], "plots")) == 3
    for r in rows[:5]:
        assert client.get_run(r["mlflow_run_id"]).data.tags["mlflow.parentRunId"] == parent["run_id"]
    printed = capsys.readouterr().out
    assert "tiling_off" in printed and "verdicts.md" in printed and "mlflow ui --backend-store-uri" in printed


def test_vs_baseline_notes_and_matching():
    rows = compare([
        {"intervention": "baseline", "expected": "diverges", "observed": "diverged", "divergence_step": 100,
         "overrides": ["intervention=baseline", "train.seed=1"]},
        {"intervention": "baseline", "expected": "diverges", "observed": "diverged", "divergence_step": 200,
         "overrides": ["intervention=baseline", "train.seed=2"]},
        {"intervention": "delta_dpp", "expected": "stable", "observed": "diverged", "divergence_step": 250,
         "overrides": ["intervention=delta_dpp", "train.seed=2"]}])
    assert rows[2]["matches_paper"] is False
    assert rows[2]["vs_baseline"] == ("diverged at step 250; baseline at 200 (+50 steps); "  # same-seed baseline
                                      "diverged at step 250; no FP32 control")


def test_single_run_report(tmp_path):
    paths = write_run_report({"intervention": "baseline", "overrides": [], "expected": "diverges",
                              "observed": "diverged", "divergence_step": 7, "final_loss": float("nan")},
                             sweep="single", out_dir=tmp_path / "single", echo=False)
    doc = json.loads(paths["json"].read_text())
    assert doc["runs"][0]["observed"] == "diverged" and doc["runs"][0]["matches_paper"] is False  # no control
    assert doc["runs"][0]["verdict"] == "diverged at step 7; no FP32 control"
    assert doc["runs"][0]["final_loss"] is None  # NaN written as JSON null
    assert paths["md"].is_file() and "loss_curves" not in paths  # no MLflow run: no curves


APP = '''
import json, sys
sys.path.insert(0, {root!r})
import hydra
from hydra.core.hydra_config import HydraConfig
from flash_forensics.orchestrator.tracking.tracker import Tracker, TrackingConfig

@hydra.main(version_base=None, config_path=".", config_name="cfg")
def main(cfg):
    if cfg.intervention == "crash":
        raise SystemExit("hard crash before result.json")  # escapes Hydra's job: on_multirun_end is skipped
    tr = Tracker(TrackingConfig(uri=cfg.tracking.uri), cfg.intervention, experiment=cfg.sweep_name)
    div = 6 if cfg.intervention == "baseline" else None
    for s in range(10):
        tr.log_metrics({{"train/loss": 5.0 - 0.1 * s + (10.0 if div is not None and s >= div else 0.0)}}, step=s)
    tr.close()
    out = HydraConfig.get().runtime.output_dir
    json.dump({{"intervention": cfg.intervention, "overrides": list(HydraConfig.get().overrides.task),
               "expected": "diverges" if cfg.intervention == "baseline" else "stable",
               "observed": "diverged" if div is not None else "stable", "divergence_step": div,
               "final_loss": 4.1, "mlflow_run_id": tr.run_id, "error": None}}, open(out + "/result.json", "w"))

main()
'''

CFG = '''
sweep_name: hydra_sweep
results_dir: {results}
intervention: baseline
tracking:
  uri: {uri}
hydra:
  sweep:
    dir: ${{results_dir}}/${{sweep_name}}/${{now:%H-%M-%S-%f}}
    subdir: ${{hydra.job.num}}
  callbacks:
    report:
      _target_: flash_forensics.orchestrator.report.sweep.SweepReport
'''


def _run_app(tmp_path, interventions):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "app.py").write_text(APP.format(root=str(ROOT)))
    (tmp_path / "cfg.yaml").write_text(CFG.format(results=str(tmp_path / "results"), uri=uri))
    proc = subprocess.run([sys.executable, "app.py", "-m", f"intervention={interventions}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    return proc, uri


def test_hydra_multirun_nests_runs_and_writes_report(tmp_path):
    proc, uri = _run_app(tmp_path, "baseline,fp32,crash")
    assert proc.returncode != 0  # the crash escaped the sweep ...
    assert "writing the report anyway" in proc.stdout  # ... and the report was still written at exit
    results = tmp_path / "results" / "hydra_sweep"
    sweep_dirs = [p for p in results.iterdir() if (p / PARENT_FILE).is_file()]
    assert len(sweep_dirs) == 1, "start and end must agree on the sweep dir"
    out = sweep_dirs[0] / "report"
    doc = json.loads((out / "verdicts.json").read_text())
    assert [(r["intervention"], r["observed"]) for r in doc["runs"]] == [
        ("baseline", "diverged"), ("fp32", "stable"), ("crash", "failed")]
    parent = find_parent(sweep_dirs[0])
    client = make_client(uri)
    for r in doc["runs"][:2]:  # each job's Tracker found the parent through HydraConfig
        assert client.get_run(r["mlflow_run_id"]).data.tags["mlflow.parentRunId"] == parent["run_id"]
    prun = client.get_run(parent["run_id"])
    assert prun.info.status == "FAILED" and "intervention=baseline,fp32,crash" in prun.data.tags["sweep.overrides"]
    assert (out / "plots" / "loss_curves.png").is_file()


def test_a_job_folder_with_only_job_json_is_a_failed_row_that_keeps_its_mlflow_run(tmp_path):
    """A job killed before result.json and outside Hydra's folders (isolate's baseline, a lent machine taken back)
    leaves job.json: its row is failed, says why, and keeps the intervention, overrides and MLflow run job.json
    names, so its metrics stay findable (early-warning --include-unfinished)."""
    from flash_forensics.orchestrator.report.rows import collect_rows, rows_from_dirs
    job = tmp_path / "seed1" / "baseline"
    job.mkdir(parents=True)
    (job / "job.json").write_text(json.dumps({"intervention": "baseline", "expected": "diverges", "mlflow_run_id":
                                              "f7fc81f5", "overrides": ["experiment=paper_1gpu", "train.seed=1"]}))
    for rows in (collect_rows(tmp_path / "seed1"), rows_from_dirs([job])):
        (row,) = rows
        assert (row["job"], row["observed"], row["intervention"], row["expected"], row["mlflow_run_id"]) == (
            "baseline", "failed", "baseline", "diverges", "f7fc81f5")
        assert row["overrides"] == ["experiment=paper_1gpu", "train.seed=1"]
        assert "no result.json: the job was killed" in row["error"]


def test_a_job_folder_whose_job_is_still_running_says_so(tmp_path):
    """A partial report collected while a job trains (gpu.sh paper-table collect): its job.json's pid is alive on
    this host, so the row says it is still running, not that it was killed."""
    import os
    import socket

    from flash_forensics.orchestrator.report.rows import rows_from_dirs
    job = tmp_path / "baseline"
    job.mkdir()
    start = {"intervention": "baseline", "mlflow_run_id": "r1", "pid": os.getpid(), "host": socket.gethostname()}
    (job / "job.json").write_text(json.dumps(start))
    (row,) = rows_from_dirs([job])
    assert row["error"] == f"no result.json yet: the job is still running (pid {os.getpid()})"
    (job / "job.json").write_text(json.dumps(dict(start, host="another-host")))  # its pid means nothing here
    (row,) = rows_from_dirs([job])
    assert row["error"].startswith("no result.json: the job was killed")
