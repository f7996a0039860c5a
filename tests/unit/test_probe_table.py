"""The mechanism probes as a table per layer (orchestrator/report/probe_table.py), from scripted probe histories:
counts, medians, sums and monotonicity worked out by hand; the run picked is the diverged one with the densest probes
before its divergence."""
import json

from flash_forensics.orchestrator.report import probe_table
from flash_forensics.orchestrator.report.sweep import main as report_main

STEPS = list(range(100, 200, 10))  # 10 probes, steps 100..190


def probes(layer, mean, t, cum, share, exact, bf16, wq_cos, steps=STEPS):
    h = {}
    for kind, f in (("delta_err_mean", mean), ("delta_err_t", t), ("delta_err_cumsum", cum),
                    ("tie_share_abs", share), ("tie_rows_exact", exact), ("tie_rows_bf16", bf16),
                    ("wq_err_cos", wq_cos)):
        h[f"probe/{kind}/L{layer}"] = [(s, f(s)) for s in steps]
    return h


def history():
    h = probes(1, lambda s: 1e-7, lambda s: 3.0 if s < 150 else 1.0, lambda s: 1e-7 * (s - 99),
               lambda s: 0.9, lambda s: 0.0, lambda s: 100.0, lambda s: -0.5)
    h.update(probes(0, lambda s: 1e-7 if s % 20 else -1e-7, lambda s: 0.1, lambda s: 1e-8 * (-1) ** (s // 10),
                    lambda s: 0.1, lambda s: 1.0, lambda s: 10.0, lambda s: 0.0))
    h["probe/pkx_cos/L1.H0"] = [(s, 0.9) for s in STEPS]
    h["probe/pkx_cos/L1.H1"] = [(s, 1.0) for s in STEPS]
    h["train/loss"] = [(s, 2.0) for s in range(0, 200)]  # not a probe
    return h


def test_summary_per_layer_by_hand():
    rows = {r["layer"]: r for r in probe_table.summarize(history(), 100, 180)}  # probes 100..170: 8 of them
    one, zero = rows[1], rows[0]
    assert (one["probes"], one["positive"], one["t_above_2"], one["t_median"]) == (8, 8, 5, 3.0)
    assert one["cumsum_monotone"] is True and abs(one["cumsum_last"] - 7.1e-6) < 1e-12
    assert (one["tie_rows_exact"], one["tie_rows_bf16"], one["tie_share"]) == (0.0, 800.0, 0.9)
    assert one["pkx_cos"] == 0.95 and one["wq_err_cos"] == -0.5  # pooled over heads and probes
    assert zero["positive"] == 4 and zero["cumsum_monotone"] is False and zero["pkx_cos"] is None
    md = probe_table.markdown(list(rows.values()), "forks/x", 100, 180)
    assert "| 1 | 8 of 8 | +3.00 (5) | +7.10e-06, rising monotonically | 0.90 | 0 / 800 | 0.95 | -0.50 |" in md


def test_the_densest_diverged_run_before_its_divergence_is_picked():
    base = {"job": "baseline", "observed": "diverged", "divergence_step": 180, "mlflow_run_id": "b"}
    fork = {"job": "forks/m", "observed": "diverged", "divergence_step": 180, "fork_step": 100, "mlflow_run_id": "m"}
    calm = {"job": "forks/f", "observed": "stable", "fork_step": 100, "mlflow_run_id": "f"}
    sparse = probes(1, *(lambda s: 1.0,) * 7, steps=[0, 50, 150])  # the baseline probes rarely, from step 0
    hist = {"b": sparse, "m": history(), "f": history()}
    assert probe_table.pick([base, fork, calm], hist) == (fork, 100, 180)
    assert probe_table.pick([calm], hist) is None  # stable runs are never summarized
    assert probe_table.pick([base], {"b": {}}) is None


def test_the_report_writes_the_probe_table(tmp_path, monkeypatch):
    import gzip
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    d = tmp_path / "runs" / "baseline"
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps({"intervention": "baseline", "expected": "diverges",
                                               "observed": "diverged", "divergence_step": 180, "steps_done": 200,
                                               "mlflow_run_id": "r0", "overrides": ["intervention=baseline"]}))
    export = {"runs": [{"run_id": "r0", "metrics": {k: [[s, v] for s, v in pts] for k, pts in history().items()}}]}
    with gzip.open(tmp_path / "e.json.gz", "wt") as f:
        json.dump(export, f)
    assert report_main(["runs", "--out", "rep", "--histories", str(tmp_path / "e.json.gz")]) == 0
    doc = json.loads((tmp_path / "rep" / "probes.json").read_text())
    assert (doc["run"], doc["start"], doc["stop"]) == ("runs/baseline", 0, 180)
    assert [r["layer"] for r in doc["layers"]] == [0, 1] and doc["layers"][1]["probes"] == 8
    assert "steps 0-179 (before its divergence at 180)" in (tmp_path / "rep" / "probes.md").read_text()
