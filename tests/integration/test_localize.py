"""Localization: synthetic metric histories (the right layer and heads, ties, flat data, missing metrics) and a
round trip through a sqlite MLflow store and the CLI."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from flash_forensics.orchestrator.analysis.localize import (
    LocalizeConfig,
    _split_outliers,
    format_localization,
    load_history,
    localize,
    main,
    resolve_source,
)

ROOT = Path(__file__).resolve().parents[2]
PAPER_NORMS = [4.34, 2.68, 1.90, 2.67, 2.04, 2.66, 4.12, 6.27, 5.32, 1.74, 4.64, 5.39]  # layer 2, heads 1-12


def make_history(n_layer=4, n_head=6, steps=400, every=20, grow=None, rmax=(), logit=True, wq=True,
                 onset=200, rate=0.01, base_rate=3e-4, seed=0):
    """W_Q sigma per head: slow common growth, plus exp(rate * (s - onset)) after `onset` for (layer, head) in
    `grow`; rmax_rows per 10-step interval: counts rising after onset for (layer, head) in `rmax` (a dict of
    weights; None: not logged, as in sdpa runs). A tiny deterministic wobble per head keeps the data realistic."""
    grow = grow or set()
    rmax = dict(rmax) if rmax is not None else None
    h = {}
    for l in range(n_layer):
        for hd in range(n_head):
            wob = 1.0 + 0.002 * math.sin(7 * l + 3 * hd + seed)
            if wq:
                h[f"wq_sigma/L{l}.H{hd}"] = [
                    (s, wob * (1.0 + base_rate * s) * (math.exp(rate * max(0, s - onset)) if (l, hd) in grow
                                                       else 1.0)) for s in range(0, steps + 1, every)]
            if rmax is not None:
                w = rmax.get((l, hd), 0.0)
                h[f"rmax_rows/L{l}.H{hd}"] = [(s, float(round(w * max(0, s - onset) / 10))) for s in
                                              range(9, steps + 1, 10)]
        if logit:
            h[f"max_logit/L{l}"] = [(s, 5.0 + (0.02 * max(0, s - onset) if any(g[0] == l for g in grow) else 0))
                                    for s in range(9, steps + 1, 10)]
    return h


def test_growing_subset_is_found():
    grow = {(2, 1), (2, 4)}
    h = make_history(grow=grow, rmax={(2, 1): 1.0, (2, 4): 0.5})
    loc = localize(h, divergence_step=400)
    assert loc.layer == 2, loc.reason
    assert loc.outlier_heads == [1, 4], loc.head_reason
    assert loc.layers[0].layer == 2 and loc.layers[0].rank == 1
    heads = {(x.layer, x.head): x for x in loc.heads}
    # "first": the growing heads' rate stands out first, the others' never does
    assert heads[(2, 1)].first_fast is not None and heads[(2, 1)].first_fast > 200
    assert heads[(0, 0)].first_fast is None
    assert heads[(2, 1)].growth > 1.5 > heads[(2, 0)].growth
    assert heads[(2, 1)].rmax_total > 0 and heads[(2, 1)].rmax_trend > 0.5  # rising into the divergence
    assert loc.layers[0].max_logit_end > loc.layers[0].max_logit_start
    ov = loc.overrides()
    assert ov["head_upcast"] == "intervention=head_upcast intervention.layer=2 'intervention.heads=[1,4]'"
    assert ov["standard_layer"].endswith("intervention.layer=2")
    assert ov["flash_only_layer"].endswith("intervention.layer=2")
    text = format_localization(loc)
    assert "intervention.heads=[1,4]" in text and "L2" in text
    json.dumps(loc.to_dict())  # JSON-safe


def test_window_ends_at_the_divergence_step():
    # layer 3 only grows after step 300: with the divergence at 300 the data points at layer 1
    h = make_history(grow={(1, 0)}, onset=100, rate=0.005)
    late = make_history(grow={(3, 2)}, onset=300, rate=0.05)
    for k in h:
        if k.startswith("wq_sigma/L3.H2"):
            h[k] = late[k]
    assert localize(h, divergence_step=300).layer == 1
    assert localize(h).layer == 3  # no divergence: the window ends at the last step, where layer 3 exploded
    # an explicit window in steps, and the default of the last `samples` W_Q samples
    loc = localize(h, window=100, divergence_step=300)
    assert (loc.start, loc.end) == (200, 300)
    loc = localize(h, divergence_step=300, samples=4)
    assert (loc.start, loc.end) == (240, 300)


def test_paper_norms_split_six_of_twelve():
    heads, why = _split_outliers(dict(enumerate(PAPER_NORMS)), k=3.0)
    assert heads == [0, 6, 7, 8, 10, 11], why  # the paper's heads 1, 7, 8, 9, 11, 12 (1-based)
    heads, why = _split_outliers({i: 1.0 + 0.1 * i for i in range(12)}, k=3.0)  # evenly spread: no outlier
    assert heads == [] and "no head stands out" in why


def test_tie_broken_by_repeated_maxima():
    grow = {(0, 2), (3, 2)}  # same growth in two layers
    h = make_history(grow=grow, rmax={(3, 2): 2.0, (0, 2): 0.2})
    loc = localize(h, divergence_step=400)
    assert loc.layer == 3, loc.reason
    assert "repeated-maxima" in loc.reason
    assert loc.outlier_heads == [2]
    # the same tie without repeated maxima: says so, picks nothing
    loc = localize(make_history(grow=grow, rmax={}), divergence_step=400)
    assert loc.layer is None and "no layer stands out" in loc.reason
    assert loc.overrides() == {}
    assert {L.layer for L in loc.layers[:2]} == {0, 3}  # the candidates still head the ranking
    assert "no layer stands out" in format_localization(loc)


def test_flat_data_says_so():
    loc = localize(make_history(base_rate=0.0, rmax={}), divergence_step=None)
    assert loc.layer is None and loc.outlier_heads == []
    assert "flat" in loc.reason
    assert "Hydra overrides" not in format_localization(loc)


def test_sdpa_run_without_repeated_maxima_counts():
    h = make_history(grow={(1, 3)}, rmax=None, logit=False)
    assert not any(k.startswith(("rmax_rows/", "max_logit/")) for k in h)
    loc = localize(h, divergence_step=400)
    assert loc.layer == 1 and loc.outlier_heads == [3]
    assert all(x.rmax_total is None for x in loc.heads)
    assert all(L.max_logit_end is None for L in loc.layers)
    format_localization(loc)


def test_only_repeated_maxima():
    h = make_history(wq=False, rmax={(2, 0): 1.0, (2, 5): 1.2, (1, 1): 0.05})
    loc = localize(h, divergence_step=400)
    assert loc.layer == 2 and "no W_Q metrics" in loc.reason
    assert loc.outlier_heads == [0, 5]
    loc = localize({"train/loss": [(0, 5.0), (1, 4.0)]})
    assert loc.layer is None and "nothing to localize" in loc.reason
    loc = localize({})
    assert loc.layer is None and format_localization(loc)


def test_non_finite_points_and_bad_config():
    h = make_history(grow={(2, 1), (2, 4)})
    for k in h:  # NaN/inf after the divergence must not poison the window
        h[k] = h[k] + [(410, float("nan")), (420, float("inf"))]
    assert localize(h, divergence_step=400).outlier_heads == [1, 4]
    with pytest.raises(ValueError, match=r"localize.head_metric='x'"):
        localize(h, head_metric="x")
    with pytest.raises(ValueError, match=r"localize.samples=1"):
        LocalizeConfig(samples=1).validate()


# ------------------------------------------------------------------------------------ MLflow round trip
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    tmp = tmp_path_factory.mktemp("loc")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("loc", artifact_location=(tmp / "art").as_uri())
    h = make_history(n_layer=3, n_head=4, grow={(1, 0), (1, 3)}, rmax={(1, 3): 1.0})
    h["train/loss"] = [(s, 5.0 - 0.001 * s) for s in range(0, 401, 10)]
    run = client.create_run(exp, tags={"intervention": "baseline"})
    rid = run.info.run_id
    ms = [Metric(k, v, 0, s) for k, pts in h.items() for s, v in pts]
    for i in range(0, len(ms), 1000):
        client.log_batch(rid, metrics=ms[i:i + 1000])
    client.set_tag(rid, "divergence_step", "400")
    client.set_terminated(rid)
    # a sweep dir with a baseline job (result.json + Hydra config naming the store) and a failed job
    sweep = tmp / "sweep"
    job = sweep / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / "result.json").write_text(json.dumps({"intervention": "baseline", "observed": "diverged",
                                                 "divergence_step": 400, "mlflow_run_id": rid}))
    (job / ".hydra" / "config.yaml").write_text(f"tracking:\n  uri: {uri}\n")
    (sweep / "1" / ".hydra").mkdir(parents=True)
    return {"uri": uri, "run_id": rid, "sweep": sweep, "job": job, "tmp": tmp, "n_points": len(ms)}


def test_load_history_and_resolve(store):
    h = load_history(store["run_id"], store["uri"])
    assert sum(len(v) for v in h.values()) == store["n_points"]
    assert h["wq_sigma/L1.H0"][0] == (0, pytest.approx(1.0 + 0.002 * math.sin(7)))
    src = resolve_source(str(store["sweep"]))
    assert src["run_id"] == store["run_id"] and src["tracking_uri"] == store["uri"]
    assert src["divergence_step"] == 400
    src = resolve_source(store["run_id"], store["uri"])
    assert src["divergence_step"] == 400 and src["intervention"] == "baseline"
    with pytest.raises(ValueError, match="not a job dir"):
        resolve_source(str(store["tmp"] / "nope" / "x"))


def test_cli_on_sqlite_store(store, capsys):
    out = store["tmp"] / "by_id" / "loc.json"
    assert main([store["run_id"], "--tracking-uri", store["uri"], "--out", str(out), "--plot"]) == 0
    printed = capsys.readouterr().out
    assert "intervention=head_upcast intervention.layer=1 'intervention.heads=[0,3]'" in printed
    d = json.loads(out.read_text())
    assert d["layer"] == 1 and d["outlier_heads"] == [0, 3] and d["divergence_step"] == 400
    assert d["overrides"]["standard_layer"] == "intervention=standard_layer intervention.layer=1"
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_cli_refuses_output_paths_it_cannot_write_before_reading(store, capsys):
    """--out a folder failed after the report with IsADirectoryError (no flag named); --plot a folder or a bare name
    was saved by matplotlib as <name>.png while 'wrote <name>' was printed (exit 0). Both are refused first."""
    folder = store["tmp"] / "a_folder"
    folder.mkdir()
    for argv, says in ((["--out", str(folder)], f"--out={str(folder)!r} is not allowed: it is a folder"),
                       (["--plot", str(folder)], f"--plot={str(folder)!r} is not allowed: it is a folder"),
                       (["--plot", str(store["tmp"] / "loc")], "its suffix is ''; expected a file path ending in .png"),
                       (["--out", str(store["tmp"] / "loc.json"), "--plot", str(store["tmp"] / "loc.txt")],
                        "--plot=")):
        with pytest.raises(SystemExit) as e:
            main([store["run_id"], "--tracking-uri", store["uri"], *argv])
        printed = capsys.readouterr()
        assert e.value.code == 2 and says in printed.err, printed.err
        assert "sweep target" not in printed.out  # refused before the run was read
    assert list(folder.iterdir()) == [] and not list(store["tmp"].glob("loc*"))
    assert not (store["tmp"] / "a_folder.png").exists()


def test_cli_subprocess_on_job_dir(store):
    out = store["tmp"] / "by_job.json"
    png = store["tmp"] / "by_job.png"
    r = subprocess.run([sys.executable, "-m", "flash_forensics.orchestrator.analysis.localize", str(store["job"]),
                        "--out", str(out), "--plot", str(png)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "'intervention.heads=[0,3]'" in r.stdout
    assert json.loads(out.read_text())["source"]["job_dir"] == str(store["job"])
    assert png.is_file()
    r = subprocess.run([sys.executable, "-m", "flash_forensics.orchestrator.analysis.localize",
                        str(store["tmp"] / "missing" / "dir")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a job dir" in r.stderr
