"""What a fork's verdict alone does not say (orchestrator/report/fork_health.py), from constructed rows and loss
histories: a fork whose first loss is far from its baseline's on the same weights and batch (SFA switched on at
huge logits), a "stable" fork whose loss was rising when it ended, and a control that is not taken for the
baseline. Plus the report read offline from a compact MLflow export (`report --histories`)."""
import gzip
import json

import pytest

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.report import fork_health, readback
from flash_forensics.orchestrator.report import rows as R
from flash_forensics.orchestrator.report.rows import compare
from flash_forensics.orchestrator.report.sweep import main as report_main


def row(iv, observed, div=None, job="0", fork=None, rid=None, extra=()):
    return {"job": job, "intervention": iv, "expected": "stable" if iv != "baseline" else "diverges",
            "observed": observed, "divergence_step": div, "steps_done": 400, "fork_step": fork, "mlflow_run_id": rid,
            "overrides": [f"intervention={iv}", *extra], "setup": {"train.seed": "1", "data.seed": "1"}}


def curve(start, end, f):
    return {"train/loss": [(s, f(s)) for s in range(start, end)]}


def annotated(rows, hist):
    rows = compare(rows)
    return fork_health.annotate(rows, hist, lambda r: R._peer(r, rows, R.BASELINE),
                                lambda r: R._peer(r, rows, R.REFERENCE))


def test_a_fork_that_starts_far_from_its_baseline_is_flagged():
    hist = {"b": curve(0, 300, lambda s: 2.0 if s < 250 else 9.0),
            "f": curve(100, 400, lambda s: 2.0 - 1e-4 * (s - 100)),
            "s": curve(100, 400, lambda s: 8.0 if s == 100 else 2.2),
            "t": curve(100, 400, lambda s: 2.3 if s == 100 else 2.0)}
    rows = annotated([row("baseline", "diverged", 250, "b", rid="b"), row("fp32", "stable", None, "f", 100, "f"),
                      row("sfa", "stable", None, "s", 100, "s"), row("tiling_off", "stable", None, "t", 100, "t")],
                     hist)
    by = {r["job"]: r for r in rows}
    assert abs(by["s"]["fork_jump"] - 6.0) < 1e-9
    assert "+6.00 nats from the baseline's on the same weights and batch" in by["s"]["vs_baseline"]
    assert abs(by["t"]["fork_jump"] - 0.3) < 1e-9 and "same weights" not in by["t"]["vs_baseline"]  # under 0.5
    assert by["f"]["fork_jump"] == 0.0 and "same weights" not in by["f"]["vs_baseline"]
    assert by["b"].get("fork_jump") is None  # the source run is no fork


def test_a_stable_fork_whose_loss_rose_is_degrading_unless_the_reference_rose_as_much():
    rising = lambda s: 2.0 + 0.004 * (s - 100)  # noqa: E731  +1.2 nats over 300 steps
    hist = {"b": curve(0, 300, lambda s: 2.0), "f": curve(100, 400, lambda s: 2.0 - 1e-4 * (s - 100)),
            "p": curve(100, 400, rising), "d": curve(100, 400, lambda s: 2.0 + 1e-4 * (s - 100))}
    rows = annotated([row("baseline", "diverged", 250, "b", rid="b"), row("fp32", "stable", None, "f", 100, "f"),
                      row("pv_fp32", "stable", None, "p", 100, "p"), row("delta_dpp", "stable", None, "d", 100, "d")],
                     hist)
    by = {r["job"]: r for r in rows}
    assert 0.7 < by["p"]["loss_rise"] < 1.2
    assert "degrading when it ended" in by["p"]["vs_baseline"] and "(fp32: -0.02)" in by["p"]["vs_baseline"]
    assert "degrading" not in by["d"]["vs_baseline"] and "degrading" not in by["f"]["vs_baseline"]
    # the same rise is not flagged when the fp32 reference rose as much (the data got harder, not the run worse)
    hist["f"] = curve(100, 400, rising)
    rows = annotated([row("baseline", "diverged", 250, "b", rid="b"), row("fp32", "stable", None, "f", 100, "f"),
                      row("pv_fp32", "stable", None, "p", 100, "p")], hist)
    assert "degrading" not in rows[2]["vs_baseline"]
    # a diverged fork is not called degrading: its verdict already says more
    rows = annotated([row("baseline", "diverged", 250, "b", rid="b"),
                      row("pv_fp32", "diverged", 300, "p", 100, "p")], hist)
    assert "degrading" not in rows[1]["vs_baseline"]


def test_a_control_is_compared_with_the_baseline_not_taken_for_it():
    rows = compare([row("baseline", "stable", None, "fa2", 100, extra=["+control=fa2"]),
                    row("baseline", "diverged", 250, "b"), row("fp32", "stable", None, "f", 100)])
    fa2, base, ref = rows
    assert R.control_of(fa2) == "fa2" and R.control_of(base) is None
    assert fa2["vs_baseline"].startswith("control fa2; stable where the baseline diverged at step 250")
    assert "comparisons with it are void" not in fa2["vs_baseline"]
    assert "stable where the baseline diverged at step 250" in ref["vs_baseline"]  # the plain baseline, not fa2
    assert R._peer(ref, rows, R.BASELINE) is base


def _job(path, rec):
    path.mkdir(parents=True)
    (path / record.RESULT_FILE).write_text(json.dumps(rec))


def test_the_report_reads_histories_from_a_compact_export_without_a_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    common = {"expected": "diverges", "steps_done": 300, "overrides": ["intervention=baseline"]}
    _job(tmp_path / "runs" / "baseline", {**common, "intervention": "baseline", "observed": "diverged",
                                           "divergence_step": 250, "mlflow_run_id": "r0"})
    _job(tmp_path / "runs" / "sfa", {**common, "intervention": "sfa", "expected": "stable", "observed": "stable",
                                      "overrides": ["intervention=sfa"], "fork_step": 100, "mlflow_run_id": "r1"})
    export = {"runs": [{"run_id": "r0", "metrics": {"train/loss": [[s, 2.0, 0] for s in range(300)]}},
                       {"run_id": "r1", "metrics": {"train/loss": [[s, 8.0 if s == 100 else 2.1]
                                                                   for s in range(100, 400)]}}]}
    with gzip.open(tmp_path / "e.json.gz", "wt") as f:
        json.dump(export, f)
    assert readback.histories_from_export(tmp_path / "e.json.gz")["r1"]["train/loss"][0] == (100, 8.0)
    out = tmp_path / "report"
    assert report_main(["runs", "--out", str(out), "--histories", str(tmp_path / "e.json.gz")]) == 0
    doc = json.loads((out / "verdicts.json").read_text())
    sfa = next(r for r in doc["runs"] if r["intervention"] == "sfa")
    assert sfa["fork_jump"] == 6.0 and "not a like-for-like continuation" in sfa["vs_baseline"]
    assert (out / "plots" / "loss_curves.png").is_file()
    assert not list(tmp_path.glob("*.db")) and not (tmp_path / "mlruns").exists()  # no store was opened
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    assert report_main(["runs", "--out", str(out), "--histories", str(tmp_path / "bad.json.gz")]) == 1


class _Client:
    """The three calls verdict_view.publish makes, recorded."""

    def __init__(self):
        self.tags = {}

    def get_run(self, rid):
        from types import SimpleNamespace
        return SimpleNamespace(data=SimpleNamespace(tags={}))

    def log_batch(self, rid, tags=()):
        self.tags.setdefault(rid, {}).update({t.key: t.value for t in tags})

    def delete_tag(self, rid, key):
        self.tags.get(rid, {}).pop(key, None)


def test_the_caveats_reach_the_runs_mlflow_tags_and_description():
    pytest.importorskip("mlflow")
    from flash_forensics.orchestrator.report import verdict_view
    hist = {"b": curve(0, 300, lambda s: 2.0), "s": curve(100, 400, lambda s: 8.0 if s == 100 else 2.2)}
    rows = annotated([row("baseline", "diverged", 250, "b", rid="b"), row("sfa", "stable", None, "s", 100, "s")],
                     hist)
    client = _Client()
    verdict_view.publish(client, rows, {"b": "1", "s": "1"})
    assert "not a like-for-like continuation" in client.tags["s"]["fork_health"]
    assert "Caveat: its loss at the fork step is +6.00 nats" in client.tags["s"]["mlflow.note.content"]
    assert "fork_health" not in client.tags["b"]
