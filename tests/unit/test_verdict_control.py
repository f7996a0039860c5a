"""The verdict with its control, from constructed run records: a divergence is precision's only when an FP32 run
of the same setup stayed stable past it; the verdict names that run, or says there is none, or that the control
diverged too. Plus what the MLflow side shows of it (tags, colours, view, links) and the report's small fixes."""
import json
import urllib.parse

import pytest

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.report import links, plots, render, verdict_view
from flash_forensics.orchestrator.report import rows as R
from flash_forensics.orchestrator.report.rows import compare, control_for
from flash_forensics.orchestrator.tracking.run_fields import describe_run


def row(iv, expected, observed, div=None, job="0", lr="0.003", seed="1", steps=20, fork=None, rid=None):
    return {"job": job, "intervention": iv, "expected": expected, "observed": observed, "divergence_step": div,
            "steps_done": steps, "overrides": [f"intervention={iv}"], "fork_step": fork, "mlflow_run_id": rid,
            "setup": {"optimizer.lr": lr, "train.seed": seed, "data.seed": "1337"}}


def test_precision_only_with_a_stable_control_of_the_same_setup():
    rows = compare([row("baseline", "diverges", "diverged", 12, "0"), row("fp32", "stable", "stable", None, "1")])
    base = rows[0]
    assert base["cause"] == record.CAUSE_PRECISION and base["matches_paper"] is True
    assert base["verdict"] == "diverged at step 12; its FP32 control (job 1) stayed stable: precision"
    assert record.sweep_metrics(rows)["runs_matching_paper"] == 2.0


def test_no_control_is_not_a_match():
    for others in ([], [row("fp32", "stable", "stable", job="1", lr="1000")],  # another learning rate
                   [row("fp32", "stable", "stable", job="1", seed="2")],  # another seed
                   [row("fp32", "stable", "stable", job="1", steps=5)],  # stopped before the divergence step
                   [row("fp32", "stable", "failed", job="1")]):
        base, *_ = compare([row("baseline", "diverges", "diverged", 12), *others])
        assert base["cause"] == record.CAUSE_NO_CONTROL and base["matches_paper"] is False, others
        assert base["verdict"] == "diverged at step 12; no FP32 control"
        assert "no FP32 control" in base["vs_baseline"]


def test_a_diverged_control_says_the_cause_is_not_precision():
    base, ref = compare([row("baseline", "diverges", "diverged", 1, "0", lr="1000"),
                         row("fp32", "stable", "diverged", 1, "1", lr="1000")])
    assert base["cause"] == ref["cause"] == record.CAUSE_NOT_PRECISION
    assert not base["matches_paper"] and not ref["matches_paper"]
    assert base["verdict"].endswith("its FP32 control (job 1) diverged too (step 1): the cause is not precision")
    assert "in FP32 attention: the cause is not precision" in ref["verdict"]


def test_the_control_of_the_same_setup_is_picked_among_several():
    rows = [row("baseline", "diverges", "diverged", 3, "0", lr="1000"), row("fp32", "stable", "diverged", 2, "1",
                                                                             lr="1000"),
            row("baseline", "diverges", "diverged", 9, "2"), row("fp32", "stable", "stable", None, "3")]
    compare(rows)
    assert control_for(rows[0], rows) is rows[1] and control_for(rows[2], rows) is rows[3]
    assert [r["cause"] for r in rows[::2]] == [record.CAUSE_NOT_PRECISION, record.CAUSE_PRECISION]
    assert "stable where the baseline diverged at step 9" in rows[3]["vs_baseline"]  # its own setup's baseline
    # older records without a setup: the other overrides decide
    old = [dict(r, setup=None) for r in rows[2:]]
    assert compare(old)[0]["cause"] == record.CAUSE_PRECISION


def test_a_fork_after_the_divergence_vouches_for_nothing():
    assert record.control_cause("diverged", 10, {"observed": "stable", "steps_done": 40, "fork_step": 20}) == \
        record.CAUSE_NO_CONTROL
    assert record.control_cause("diverged", 10, {"observed": "stable", "steps_done": 40, "fork_step": 5}) == \
        record.CAUSE_PRECISION
    assert record.control_cause("stable", None, None) is None


def test_record_tags_say_no_control_until_the_report_judges():
    r = record.RunRecord(intervention="baseline", expected="diverges", observed="diverged", divergence_step=4)
    tags = record.record_tags(r)
    assert tags[record.TAG_MATCHES] == "false" and tags[record.TAG_CAUSE] == record.CAUSE_NO_CONTROL
    r.cause, r.control = record.CAUSE_PRECISION, "job 1"
    assert record.record_tags(r)[record.TAG_MATCHES] == "true"


def test_description_grammar_and_verdict():
    assert "the paper expects it to **stay stable**" in describe_run("fp32", "stable", None, "stable", None, 20)
    note = describe_run("baseline", "diverges", None, "diverged", 1, 5, None, record.CAUSE_NOT_PRECISION, "job 1", 1)
    assert "diverged too (step 1): the cause is not precision" in note and "does not match the paper" in note


def test_colours_by_verdict_and_distinct():
    rows = compare([row("baseline", "diverges", "diverged", 1, "0", lr="1000"),
                    row("fp32", "stable", "diverged", 1, "1", lr="1000"), row("pv_fp32", "stable", "stable", None, "2"),
                    row("sfa", "stable", "stable", None, "3")])
    cs = verdict_view.colors(rows)
    assert len(set(cs)) == 4
    assert cs[0] in verdict_view.PALETTES["not precision"] and cs[2] in verdict_view.PALETTES["stable"]


def test_view_state_and_links():
    state = verdict_view.view_state("abc123")
    assert "tags.`verdict`" in state["selectedColumns"] and "metrics.`divergence_step`" in state["selectedColumns"]
    assert state["searchFilter"] == "tags.sweep_run = 'abc123'"  # a filter: MLflow shows children unfolded
    assert json.loads(json.dumps(state)) == state
    assert links.view_route("7", "k").endswith("?viewStateShareKey=k&workflowType=machine_learning")
    route = links.compare_route("7", ["a", "b"])
    assert urllib.parse.unquote(route).startswith('#/compare-runs?runs=["a","b"]&experiments=["7"]')


def test_ui_url_from_the_environment(monkeypatch):
    monkeypatch.setenv(links.UI_URL_ENV, "http://127.0.0.1:5050/")
    assert links.ui_base("sqlite:///x.db") == "http://127.0.0.1:5050"
    assert links.link_lines("sqlite:///x.db", "1")[1] == ("  runs table: http://127.0.0.1:5050/#/experiments/1/runs"
                                                           "?workflowType=machine_learning")
    monkeypatch.delenv(links.UI_URL_ENV)
    assert "FF_MLFLOW_UI_URL" in links.link_lines("sqlite:///x.db", "1")[0]


@pytest.mark.parametrize("ui_url, serves", [
    ("http://127.0.0.1:5055", "mlflow ui --backend-store-uri sqlite:///x.db --port 5055"),
    ("http://localhost:5000/", "mlflow ui --backend-store-uri sqlite:///x.db"),
    ("http://gpu-node:8080", "mlflow ui --backend-store-uri sqlite:///x.db --host gpu-node --port 8080"),
])
def test_the_printed_ui_command_serves_where_the_links_point(monkeypatch, ui_url, serves):
    """Run as printed, `mlflow ui` listens at the address every printed link uses (FF_MLFLOW_UI_URL's port)."""
    monkeypatch.setenv(links.UI_URL_ENV, ui_url)
    first = links.link_lines("sqlite:///x.db", "1")[0]
    assert first.startswith(f"MLflow: {serves}   (serves {ui_url.rstrip('/')})"), first
    md = "\n".join(render._mlflow_lines({"tracking_uri": "sqlite:///x.db", "experiment_id": "1"}))
    assert f"`{serves}`, then open {ui_url.rstrip('/')}" in md  # verdicts.md says the same


def test_stable_runs_are_void_when_the_baseline_never_diverged(tmp_path):
    """'3 runs; 2 match the paper' read as a reproduction when the baseline never diverged: nothing was prevented."""
    rows = compare([row("baseline", "diverges", "stable", job="0"), row("fp32", "stable", "stable", job="1"),
                    row("qk_norm", "stable", "stable", job="2")])
    assert [r["matches_paper"] for r in rows] == [False, False, False]
    assert [bool(r.get("paper_void")) for r in rows] == [False, True, True]
    line = "3 runs; 0 match the paper (2 stable runs void: their baseline did not diverge); 0 failed."
    assert R.counts(rows) == line and record.sweep_metrics(rows)["runs_matching_paper"] == 0.0
    assert line in render.parent_note("s", rows, [None] * 3) and "void: its baseline did not diverge" in \
        rows[2]["vs_baseline"]
    table = render._table(rows)
    assert [r[table[0].index("matches paper")] for r in table[1:]] == ["NO", "void", "void"]
    # with a baseline that diverged (and its stable FP32 control), the same stable runs match
    rows = compare([row("baseline", "diverges", "diverged", 9, job="0"), row("fp32", "stable", "stable", job="1"),
                    row("qk_norm", "stable", "stable", job="2")])
    assert R.counts(rows) == "3 runs; 3 match the paper; 0 failed."


def test_user_overrides():
    assert record.user_overrides(["intervention=baseline", "tracking.uri=sqlite\\:////tmp/x.db", "results_dir=/r",
                                  "hydra.run.dir=/x", "optimizer.lr=1e3", "data.files=[a\\,b]"]) == \
        ["intervention=baseline", "optimizer.lr=1e3", "data.files=[a,b]"]


def test_identical_loss_curves_each_show(tmp_path):
    h = {"train/loss": [(s, 5.0 - 0.1 * s) for s in range(30)]}
    assert plots._same_curve(h["train/loss"], list(h["train/loss"]))
    assert not plots._same_curve(h["train/loss"], [(s, v + 0.1) for s, v in h["train/loss"]])
    import matplotlib.pyplot as plt
    captured = {}
    real = plt.subplots

    def spy(*a, **k):
        fig, ax = real(*a, **k)
        captured["ax"] = ax
        return fig, ax

    plt.subplots = spy
    try:
        assert plots.loss_curves([("0:baseline", h), ("1:fp32", h)], tmp_path / "loss.png").is_file()
    finally:
        plt.subplots = real
    lines = [ln for ln in captured["ax"].get_lines() if not ln.get_label().startswith("_")]
    assert "the same curve as 0:baseline" in lines[1].get_label()
    assert lines[1].get_marker() not in (None, "None", "") and lines[1].get_linestyle() != lines[0].get_linestyle()


def test_close_loss_curves_each_show(tmp_path):
    """An all-stable sweep: three curves 0.001 apart (under a pixel) each keep a visible share of the plot."""
    import math

    import matplotlib.image as mpimg
    import numpy as np
    base = [(s, 4 + 2 * math.exp(-s / 10)) for s in range(60)]
    runs = [(f"{i}:{n}", {"train/loss": [(s, v + 1e-3 * i) for s, v in base]})
            for i, n in enumerate(["baseline", "fp32", "qk_norm"])]
    img = mpimg.imread(plots.loss_curves(runs, tmp_path / "loss.png"))[..., :3]
    axes = img[:, : img.shape[1] // 2]  # the axes' left half: the legend (outside, right) counts no pixel here
    shown = [int((np.abs(axes - np.array(c)).max(-1) < 0.08).sum()) for c in plots.palette(3)]
    assert min(shown) > 0.2 * max(shown), shown  # drawn solid on top of each other, the first showed none


def test_the_wq_plot_draws_the_heads_the_verdicts_name(tmp_path, monkeypatch):
    """Each run's peak head (peak_wq_where) in every panel, bold and labelled, even where it is not its layer's
    top head in that run: the baseline's L0.H1 is read beside the same head of the fp32 run."""
    import matplotlib.pyplot as plt

    def hist(peak):
        return {f"wq_sigma/L{layer}.H{h}": [(s, 1 + 0.01 * s * (1 + h + layer) + (3.0 if (layer, h) == peak else 0))
                                           for s in range(20)] for layer in range(2) for h in range(4)}
    rows = [{"peak_wq_where": "L0.H1"}, {"peak_wq_where": "L1.H2"}, {"peak_wq_where": "L0.H1"}, {}]
    assert render.verdict_heads(rows) == [(0, 1), (1, 2)]
    panels = []
    real = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: panels.append(real(*a, **k)) or panels[-1])
    assert plots.wq_spectral_norms([("0:baseline", hist((0, 1))), ("1:fp32", hist((1, 2)))], tmp_path / "wq.png",
                                   named=render.verdict_heads(rows)).is_file()
    _, axes = panels[-1]
    for ax in axes.flat:
        bold = [ln for ln in ax.get_lines() if ln.get_linewidth() > 2]
        assert len(bold) == 2  # both named heads, in both runs (the fp32 run's L0 top head is H3, not H1)
        labels = {t.get_text() for t in ax.texts if t.get_fontweight() == "bold"}
        assert labels == {"L0.H1", "L1.H2"}
