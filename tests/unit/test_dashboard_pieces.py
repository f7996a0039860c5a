"""Dashboard pieces without a server: plots that answer the question, the HTML page, links, run descriptions."""
import math
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from flash_forensics.orchestrator.report import html as report_html
from flash_forensics.orchestrator.report import links, plots
from flash_forensics.orchestrator.tracking.tracker import describe_run, source_tags


def _has_colour(png, hex_colour, tol=0.03, min_pixels=50):
    img = mpimg.imread(png)[..., :3]
    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - rgb).max(axis=-1) < tol).sum()) >= min_pixels


def test_palette_distinct_for_twenty_layers():
    cols = plots.palette(20)
    assert len({tuple(np.round(mpl_rgb(c), 3)) for c in cols}) == 20  # L0 != L10


def mpl_rgb(c):
    import matplotlib.colors as mc
    return mc.to_rgb(c)


def test_loss_curves_fork_window_full_labels_and_markers(tmp_path):
    long = "paper_isolation-10:sfa intervention.heads=[0,1,5,6,8,10] intervention.layer=2 train.seed=3"
    runs = [("baseline", {"train/loss": [(s, 10.0 - s / 200) for s in range(0, 1000)]}),
            (long, {"train/loss": [(s, 5.0 - s / 1000) for s in range(400, 900)] + [(900, math.nan)]})]
    import matplotlib.pyplot as plt
    captured = {}
    real_save = plots._save

    def keep(fig, path):
        ax = fig.axes[0]
        captured.update(xlim=ax.get_xlim(), yscale=ax.get_yscale(),
                        labels=[t.get_text() for t in ax.get_legend().get_texts()],
                        markers=[ln for ln in ax.get_lines() if ln.get_marker() == "X"])
        return real_save(fig, path)

    plots._save = keep
    try:
        out = plots.loss_curves(runs, tmp_path / "loss.png", {long: 900}, window=400)
    finally:
        plots._save = real_save
    assert out.is_file() and captured["yscale"] == "linear" and captured["xlim"][0] == 400
    assert captured["labels"][1].replace("\n", " ") == long + "  (diverged at 900)"  # wrapped, never cut
    assert len(captured["markers"]) == 1 and captured["markers"][0].get_xdata()[0] == 899  # last finite point
    plt.close("all")


def test_delays_chart(tmp_path):
    items = [("fp32", "stable", None, 999, 867), ("pv_fp32", "diverged", 919, 999, 867),
             ("recompute", "diverged", 816, 999, 867), ("no-baseline", "diverged", 5, 9, None)]
    png = plots.delays(items, tmp_path / "d.png")
    assert png.is_file()
    assert _has_colour(png, "#F38400") and _has_colour(png, "#BE0032")  # delayed and hastened bars
    assert plots.delays([("fp32", "stable", None, 999, 867)], tmp_path / "none.png") is None  # nothing delayed
    assert plots.delays([("x", "diverged", 5, 9, None)], tmp_path / "none2.png") is None  # no diverged baseline


def _loc(layer):
    from flash_forensics.orchestrator.analysis.localize import HeadStats, LayerStats, Localization
    layers = [LayerStats(layer=i, growth=1.1 + 0.1 * i, rmax_total=10.0 * i, rank=3 - i) for i in range(3)]
    heads = [HeadStats(layer=l_, head=h, sigma_start=1.0, sigma_end=1.0 + h) for l_ in range(3) for h in range(4)]
    return Localization(start=10, end=50, divergence_step=50, layers=sorted(layers, key=lambda L: -L.growth),
                        heads=heads, layer=layer, outlier_heads=[3] if layer is not None else [])


@pytest.mark.parametrize("layer, colour", [(2, "#BE0032"), (None, "#F38400")])
def test_localization_highlights_the_chosen_bar(tmp_path, layer, colour):
    png = plots.localization(_loc(layer), {}, tmp_path / "loc.png")
    assert _has_colour(png, colour, min_pixels=400)  # the chosen bar (stands out: red; best guess: orange)


def test_html_page_is_self_contained_and_escaped(tmp_path):
    png = tmp_path / "p.png"
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=(1, 1))
    fig.savefig(png)
    plt.close(fig)
    table = [["job", "observed", "matches paper", "MLflow run"], ["0", "diverged", "NO", "abc<def"]]
    page = report_html.render("s<1>", [{"matches_paper": False, "observed": "diverged"}], table,
                              [[("command: ", False), ("a & b", True)]], {"loss": png},
                              ["http://h/#/experiments/1/runs/abc"], ["", "## MLflow", "", "- [runs table](http://h/x)"])
    assert "<title>Verdicts: s&lt;1&gt;</title>" in page and "abc&lt;def" in page and "<code>a &amp; b</code>" in page
    assert 'src="data:image/png;base64,' in page and 'class="no"' in page and 'class="diverged"' in page
    assert '<a href="http://h/#/experiments/1/runs/abc"' in page and '<a href="http://h/x"' in page


def test_links_and_descriptions():
    assert links.ui_base("sqlite:////x.db") == "http://127.0.0.1:5000"
    assert links.ui_base("http://h:5000/") == "http://h:5000"
    lines = links.link_lines("http://h:1", "7", "r1")
    ml = "workflowType=machine_learning"  # MLflow 3's model-training UI on every page a link opens
    assert lines == ["MLflow: http://h:1", f"  runs table: http://h:1/#/experiments/7/runs?{ml}",
                     f"  parent run: http://h:1/#/experiments/7/runs/r1?{ml}"]
    assert links.artifact_view_route("7", "r1", "job/run.log") == f"#/experiments/7/runs/r1/artifacts/job/run.log?{ml}"
    with_view = links.link_lines("http://h:1", "7", "r1", share_key="k")  # the verdicts view is the runs table
    assert not any("runs table" in line for line in with_view) and "verdicts: " in with_view[1]
    assert links.link_lines("sqlite:////x.db", None)[0].startswith("MLflow: mlflow ui --backend-store-uri sqlite")
    d = describe_run("fp32", "stable", "Sec. 3: FP32 is stable", "diverged", 12)
    assert "**fp32**" in d and "Sec. 3: FP32 is stable" in d and "diverged at step 12" in d
    assert "does not match the paper" in d
    assert "Verdict: running" in describe_run("fp32", "stable", None)
    t = source_tags()
    assert t["mlflow.source.type"] in ("LOCAL", "JOB") and t["mlflow.user"] and "mlflow.source.git.commit" in t


# ------------------------------------------------------------------------ plots people can read at a glance
def _on_save(monkeypatch, measure):
    """Patch plots._save: each figure is drawn, `measure(fig, renderer, path)` reads it, then it is saved."""
    real_save = plots._save

    def keep(fig, path):
        fig.canvas.draw()
        measure(fig, fig.canvas.get_renderer(), path)
        return real_save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)


def _capture(monkeypatch):
    """Keep each figure's legend texts, all its texts, line colours and the axes' share of the saved figure."""
    from matplotlib.text import Text
    got = {}

    def measure(fig, r, path):
        tight = fig.get_tightbbox(r)  # inches: what bbox_inches="tight" saves
        ax = fig.axes[0]
        leg = ax.get_legend() or (fig.legends[0] if fig.legends else None)
        got[Path(path).stem] = dict(
            legend=[t.get_text() for t in leg.get_texts()] if leg else [],
            texts=[t.get_text() for t in fig.findobj(Text)],
            colours=[ln.get_color() for ln in ax.get_lines() if not ln.get_label().startswith("_")],
            ax_h=ax.get_window_extent(r).height / fig.dpi / tight.height,
            legend_h=leg.get_window_extent(r).height / fig.dpi if leg else 0.0,
            ax_h_in=ax.get_window_extent(r).height / fig.dpi)

    _on_save(monkeypatch, measure)
    return got


def _rows(n):
    """n runs like a fork sweep: every fork has attention.fp32_gemm=tf32x3, the baseline they forked from not."""
    rows = [{"job": "baseline", "intervention": "baseline", "observed": "diverged", "divergence_step": 150,
             "mlflow_run_id": "r0", "overrides": ["experiment=paper_1gpu", "intervention=baseline", "train.seed=1"]}]
    for k in range(1, n):
        rows.append({"job": f"forks/paper_isolation-{k}", "intervention": f"iv{k}", "observed": "stable",
                     "mlflow_run_id": f"r{k}", "fork_step": 100,
                     "overrides": ["experiment=paper_1gpu", f"intervention=iv{k}", "train.seed=1",
                                   "attention.fp32_gemm=tf32x3", "intervention.heads=[1]", "intervention.layer=1"]})
    return rows


def _hist(k, n=300):
    h = {"train/loss": [(s, 3.0 + 0.3 * math.sin(s / 7 + k) + 0.05 * k) for s in range(n)]}
    for layer in range(12):
        h[f"rmax_rows/L{layer}.H0"] = [(s, float(layer * s + k)) for s in range(0, n, 10)]
        h[f"wq_sigma/L{layer}.H0"] = [(s, 1.0 + layer + s / 100) for s in range(0, n, 10)]
    return h


def test_override_of_most_runs_said_once_not_in_every_label(monkeypatch, tmp_path):
    from flash_forensics.orchestrator.report import render
    got = _capture(monkeypatch)
    rows = _rows(18)
    render.make_plots(rows, {r["mlflow_run_id"]: _hist(i) for i, r in enumerate(rows)}, tmp_path)
    loss = got["loss_curves"]
    assert len(loss["legend"]) == 18 and len(set(loss["legend"])) == 18  # every run, each its own label
    assert not any("tf32x3" in lab or "experiment=" in lab for lab in loss["legend"])
    for name in ("loss_curves", "wq_spectral_norm", "repeated_maxima"):
        text = " ".join(got[name]["texts"]).replace("\n", " ")
        assert text.count("attention.fp32_gemm=tf32x3") == 1, name  # said once, with the run it is not on
        assert "every run but baseline: attention.fp32_gemm=tf32x3" in text, name
        assert "intervention.heads=[1]" in text  # shared by 17 of 18 too: said once as well
    # 18 runs: 18 colours, no two alike (was 10 colours, repeated with another line style)
    assert len(set(map(str, loss["colours"]))) == 18


def test_many_runs_legend_no_taller_than_the_axes(monkeypatch, tmp_path):
    got = _capture(monkeypatch)
    runs = [(f"forks/paper_isolation-{k}:intervention_{k} intervention.heads=[0,1,5,6,8,10] intervention.layer=1 "
             f"attention.fp32_gemm=tf32x3", _hist(k)) for k in range(18)]
    plots.loss_curves(runs, tmp_path / "loss.png", {runs[0][0]: 150}, window=100)
    loss = got["loss"]
    assert loss["legend_h"] <= loss["ax_h_in"] * 1.05  # the legend beside the axes, not taller than them
    assert loss["ax_h"] > 0.6  # the axes get most of the figure's height


def test_one_run_panel_plot_gives_the_axes_the_figure(monkeypatch, tmp_path):
    """One run: a long label once (not wrapped over the panel), the layer legend a row under it."""
    got = _capture(monkeypatch)
    from flash_forensics.orchestrator.report import rows as R
    row = {"job": "baseline", "intervention": "baseline",
           "overrides": ["intervention=baseline", "data.seed=1337", "experiment=paper_1gpu", "train.keep_last=false",
                         "train.seed=1337", "verdict.early_stop_after=300"]}
    shared, note = R.shared_overrides([row])
    label = R._label(row, shared)
    assert label == "baseline:baseline" and "verdict.early_stop_after=300" in note
    plots.repeated_maxima([(label, _hist(0))], tmp_path / "rm.png", note=note)
    plots.wq_spectral_norms([(label, _hist(0))], tmp_path / "wq.png", note=note)
    for name in ("rm", "wq"):
        assert got[name]["ax_h"] > 0.5, (name, got[name]["ax_h"])  # was 0.38: title and legend squeezed it
        assert sum(t.count("verdict.early_stop_after=300") for t in got[name]["texts"]) == 1


def test_shared_overrides_keep_labels_unique():
    from flash_forensics.orchestrator.report import rows as R
    rows = _rows(6)
    shared, note = R.shared_overrides(rows)
    assert "attention.fp32_gemm=tf32x3" in shared and note.startswith("every run: experiment=paper_1gpu")
    # two runs that differ only by an override most runs share: it stays in their labels
    a = {"job": "j", "intervention": "sfa", "overrides": ["intervention=sfa", "x=1"]}
    rows = [dict(a) for _ in range(4)] + [dict(a, overrides=["intervention=sfa"])]
    shared, _ = R.shared_overrides(rows)
    assert "x=1" not in shared
    assert R.shared_overrides([]) == (set(), "")


def test_delays_words_stay_in_the_axes(monkeypatch, tmp_path):
    """A stable run's 'no divergence by step N' ran past the axes' right edge; it is now inside its long bar."""
    got = {}

    def measure(fig, r, path):
        ax = fig.axes[0]
        got["right"] = ax.get_window_extent(r).x1
        got["words"] = [t.get_window_extent(r).x1 for t in ax.texts if "no divergence" in t.get_text()]

    _on_save(monkeypatch, measure)
    items = [(f"run{k}", "stable", None, 4651, 4342) for k in range(12)] + [("late", "diverged", 4363, 4651, 4342)]
    plots.delays(items, tmp_path / "d.png")
    assert len(got["words"]) == 12 and max(got["words"]) <= got["right"]


def test_localization_head_legend_is_two_rows_not_a_column(monkeypatch, tmp_path):
    """12 heads in 2 columns made a legend half as tall as the axes under them; now 2 rows."""
    got = {}

    def measure(fig, r, path):
        a = fig.axes[0]
        got.update(legend=a.get_legend().get_window_extent(r).height, axes=a.get_window_extent(r).height)

    _on_save(monkeypatch, measure)
    hist = {f"wq_sigma/L2.H{h}": [(s, 1.0 + h * s / 50) for s in range(0, 60, 5)] for h in range(12)}
    plots.localization(_loc(2), hist, tmp_path / "loc.png")
    assert got["legend"] < 0.25 * got["axes"]
