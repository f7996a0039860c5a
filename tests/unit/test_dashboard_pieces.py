"""Dashboard pieces without a server: plots that answer the question, the HTML page, links, run descriptions."""
import math

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
