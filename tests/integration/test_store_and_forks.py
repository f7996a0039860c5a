"""The store and forks: the lowest-loss step (verdict, fork pick --at-min), a sweep file's jobs as separate runs
(fork jobs), a fresh sqlite store opened by several processes at once (tracking's flock), the report rebuilt from
an MLflow store alone (report --from-mlflow), the many-runs loss plot and legend labels, and meta given as text."""
import json
import math
import os
from pathlib import Path

import matplotlib.image as mpimg
import pytest
import yaml

from flash_forensics.orchestrator.job import checkpoint, fork
from flash_forensics.orchestrator.job.fork import ForkError, pick, sweep_file_jobs
from flash_forensics.orchestrator.report import plots
from flash_forensics.orchestrator.report import sweep as report
from flash_forensics.orchestrator.verdict import DivergenceDetector, VerdictConfig
from tests.helpers.procs import forkserver, gather, open_store

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = ROOT / "sweeps"


# ------------------------------------------------------------------------------------ verdict: min_loss_step
def test_min_loss_step_is_the_best_step_before_the_divergence():
    d = DivergenceDetector(VerdictConfig(margin=1.0, window=3))
    losses = [5.0, 4.0, 3.2, 3.5, 2.9, 3.1, 3.0, 4.5, 4.6, 4.7, 1.0, float("nan")]
    d.update(enumerate(losses))
    # steps 7-9 stay > min + margin for 3 steps: a spike at 7; the lower loss at step 10 comes after it
    assert d.divergence_step == 7 and d.reason == "spike"
    assert (d.min_loss, d.min_loss_step) == (2.9, 4)
    # an "up" step that is not (yet) a divergence does not move the minimum either
    d = DivergenceDetector(VerdictConfig(margin=0.5, window=5))
    d.update([(10, 3.0), (11, 3.6), (12, 2.5), (13, 2.4), (14, float("inf"))])
    assert (d.min_loss, d.min_loss_step, d.divergence_step, d.reason) == (2.4, 13, 14, "non-finite")
    assert DivergenceDetector(VerdictConfig()).min_loss_step is None  # nothing seen yet


def test_min_loss_step_survives_state_dict_and_old_checkpoints():
    d = DivergenceDetector(VerdictConfig())
    d.update([(0, 4.0), (1, 3.0), (2, 3.5)])
    state = d.state_dict()
    assert state["min_loss_step"] == 1
    e = DivergenceDetector(VerdictConfig())
    e.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint would hold it
    assert (e.min_loss, e.min_loss_step) == (3.0, 1)
    e.update([(3, 2.0)])
    assert e.min_loss_step == 3
    old = {k: v for k, v in state.items() if k != "min_loss_step"}  # a checkpoint from before the field existed
    f = DivergenceDetector(VerdictConfig())
    f.load_state_dict(old)
    assert f.min_loss == 3.0 and f.min_loss_step is None
    f.update([(3, 2.5)])
    assert f.min_loss_step == 3


# ---------------------------------------------------------------------------------- fork pick --at-min
def _job_dir(tmp_path: Path, steps, **result) -> Path:
    job = tmp_path / "job"
    (job / "checkpoints").mkdir(parents=True)
    for s in steps:
        checkpoint.save(job / "checkpoints" / f"step_{s}.pt", {"step": s})  # verified: fork pick skips damaged files
    if result:
        (job / "result.json").write_text(json.dumps(result))
    return job


def test_pick_at_min(tmp_path, capsys):
    job = _job_dir(tmp_path, [10, 15, 20, 25, 30], divergence_step=28, min_loss_step=17)
    ck = job / "checkpoints"
    assert pick(job) == ck / "step_25.pt"  # the divergence step, as before
    assert pick(job, at_min=True) == ck / "step_15.pt"  # newest <= 17
    assert pick(job, at_min=True, margin=3) == ck / "step_10.pt"  # newest <= 14
    assert pick(job, before=20, at_min=True) == ck / "step_20.pt"  # an explicit step wins
    assert fork.main(["pick", str(job), "--at-min"]) == 0
    assert capsys.readouterr().out.strip() == str(ck / "step_15.pt")
    assert fork.main(["pick", str(job)]) == 0
    assert capsys.readouterr().out.strip() == str(ck / "step_25.pt")
    # the min on a checkpoint step itself
    (job / "result.json").write_text(json.dumps({"divergence_step": 28, "min_loss_step": 20}))
    assert pick(job, at_min=True) == ck / "step_20.pt"
    # no checkpoint at or before the minimum
    (job / "result.json").write_text(json.dumps({"divergence_step": 28, "min_loss_step": 9}))
    with pytest.raises(ForkError):
        pick(job, at_min=True)


def test_pick_at_min_errors(tmp_path, capsys):
    job = _job_dir(tmp_path, [10, 20], divergence_step=28)  # a result.json from before min_loss_step
    with pytest.raises(ForkError, match="min_loss_step"):
        pick(job, at_min=True)
    assert pick(job) == job / "checkpoints" / "step_20.pt"
    (job / "result.json").write_text(json.dumps({"divergence_step": None, "min_loss_step": 12}))  # stable run
    with pytest.raises(ForkError, match="no divergence step"):
        pick(job, at_min=True)
    assert fork.main(["pick", str(job), "--at-min"]) == 1
    err = capsys.readouterr().err
    assert "no divergence step" in err and "--before" in err


# -------------------------------------------------------------------------------------------- fork jobs
def _hydra_jobs(path: Path):
    """Oracle: the jobs Hydra's BasicSweeper makes of a sweep file's hydra.sweeper.params."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    params = yaml.safe_load(path.read_text())["hydra"]["sweeper"]["params"]
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    return BasicSweeper.split_arguments(parsed, None)[0]


@pytest.mark.parametrize("sweep", sorted(p.stem for p in SWEEPS.glob("*.yaml")))
def test_sweep_file_jobs_match_hydra(sweep):
    """Hydra's expansion of the params, then the file's other settings (the same for every job)."""
    jobs = sweep_file_jobs([sweep])
    want = _hydra_jobs(SWEEPS / f"{sweep}.yaml")
    assert [n for n, _ in jobs] == [f"{sweep}-{i}" for i in range(len(want))]
    assert [ov[:len(w)] for (_, ov), w in zip(jobs, want)] == want
    assert len({tuple(ov[len(w):]) for (_, ov), w in zip(jobs, want)}) == 1


def test_sweep_file_jobs_carry_the_files_other_settings():
    """mini_repro_seeds ties data.seed to train.seed outside its params: each job, run on its own, must too."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
    jobs = sweep_file_jobs(["mini_repro_seeds"])
    assert len(jobs) == 6
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(SWEEPS.parent / "conf"), version_base="1.3"):
            for _, ov in jobs:
                cfg = compose("config", overrides=["experiment=smoke", *ov])
                assert cfg.data.seed == cfg.train.seed in (1, 2, 3)
    finally:
        GlobalHydra.instance().clear()


def test_sweep_file_jobs_several_files_and_cli(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("hydra:\n  sweeper:\n    params:\n      x: 1,2\n      y: p, q ,r\n")
    (tmp_path / "b.yaml").write_text("hydra:\n  sweeper:\n    params:\n      z: 7\n")
    jobs = sweep_file_jobs(["b", "a"], root=tmp_path)
    assert jobs == [("b-0", ["z=7"]), ("a-0", ["x=1", "y=p"]), ("a-1", ["x=1", "y=q"]), ("a-2", ["x=1", "y=r"]),
                    ("a-3", ["x=2", "y=p"]), ("a-4", ["x=2", "y=q"]), ("a-5", ["x=2", "y=r"])]
    with pytest.raises(ForkError) as e:
        sweep_file_jobs(["a", "nope"], root=tmp_path)
    assert "'nope'" in str(e.value) and "allowed: a, b" in str(e.value)

    assert fork.main(["jobs", "paper_isolation", "beta_sweep"]) == 0
    lines = capsys.readouterr().out.splitlines()
    want = [(f"paper_isolation-{i}", j) for i, j in enumerate(_hydra_jobs(SWEEPS / "paper_isolation.yaml"))] + \
        [(f"beta_sweep-{i}", j) for i, j in enumerate(_hydra_jobs(SWEEPS / "beta_sweep.yaml"))]
    assert len(lines) == len(want) == 15
    for line, (name, ov) in zip(lines, want):
        assert line.split("\t") == [name, " ".join(ov)]
    assert fork.main(["jobs", "paper_isolation", "no_such_sweep"]) == 1
    err = capsys.readouterr().err
    assert "'no_such_sweep'" in err and "paper_isolation" in err and "beta_sweep" in err


# ------------------------------------------------------------------------------ tracking: the store's lock
def test_fresh_sqlite_store_opened_by_four_processes(tmp_path):
    db = tmp_path / "store" / "new.db"
    uri = f"sqlite:///{db}"
    assert not db.exists()
    # four processes all the same (each opens the store, and takes the flock on <db>.lock, on its own); with the lock
    # removed they still collide on MLflow's table creation and this test fails
    ctx = forkserver()
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=open_store, args=(uri, barrier, i, results)) for i in range(4)]
    got = gather(procs, results, 240)
    assert all(s == "ok" for _, s, _ in got), [g for g in got if g[1] != "ok"]
    assert [p.exitcode for p in procs] == [0] * 4
    assert not Path(str(db) + ".lock").exists()  # its holder removes the lock file: none is left behind
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    exps = [e for e in client.search_experiments() if e.name == "race"]
    assert len(exps) == 1  # one experiment, four runs in it
    runs = client.search_runs([exps[0].experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(rid for _, _, rid in got)
    assert sorted(r.data.metrics["train/loss"] for r in runs) == [1.0, 2.0, 3.0, 4.0]


# ---------------------------------------------------------------------------- report --from-mlflow
def _store(tmp_path):
    """A store as scripts/paper_isolation.sh leaves it: a baseline, forks of two sweep files, one fork killed
    mid-run (verdict still 'running'), and a sweep parent run (role=sweep) that holds no training."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = MlflowClient(tracking_uri=uri)
    exp = c.create_experiment("x", artifact_location=(tmp_path / "art").as_uri())
    t0 = 1_700_000_000_000
    made = {}

    def run(name, start, tags, losses=(), wq=None, first=0):
        r = c.create_run(exp, start_time=t0 + start, tags=tags, run_name=f"run {name}")
        ms = [Metric("train/loss", v, 0, first + i) for i, v in enumerate(losses)]
        for key, pts in (wq or {}).items():
            ms += [Metric(f"wq_sigma/{key}", v, 0, s) for s, v in pts]
        for i in range(0, len(ms), 500):
            c.log_batch(r.info.run_id, metrics=ms[i:i + 500])
        made[name] = r.info.run_id
        return r.info.run_id

    run("parent", 0, {"role": "sweep", "sweep": "x"}, losses=[9.0, 9.0])
    base_loss = [6.0 - 0.1 * i for i in range(30)] + [float("nan")] * 5  # min 3.1 at step 29, NaN from 30
    run("baseline", 1, {"intervention": "baseline", "expect": "diverges", "verdict": "diverged",
                        "divergence_step": "30", "overrides": "intervention=baseline train.seed=1",
                        "job_dir": "/jobs/baseline", "sweep": "x/baseline"}, base_loss,
        wq={"L0.H1": [(0, 1.0), (10, 2.5), (20, 7.25)], "L1.H0": [(0, 1.0), (10, 3.0), (20, 6.0)]})

    def fork_tags(name, iv, expect, verdict, extra=""):
        return {"intervention": iv, "expect": expect, "verdict": verdict, "divergence_step": "None",
                "overrides": f"intervention={iv}{extra} from_checkpoint=/jobs/baseline/checkpoints/step_20.pt",
                "job_dir": f"/jobs/forks/{name}", "sweep": f"paper_isolation_runs/{name}", "fork_step": "20",
                "forked_from": "/jobs/baseline/checkpoints/step_20.pt", "forked_from_run": made["baseline"]}

    # launch order: paper_isolation-1 first, then -0, beta_sweep-0, the killed -2, then -10 (numeric, not lexical)
    run("paper_isolation-1", 2, fork_tags("paper_isolation-1", "fp32", "stable", "stable"),
        [4.0, 3.8, 3.9, 3.7], wq={"L1.H1": [(20, 2.0)]}, first=20)
    run("paper_isolation-0", 3, {**fork_tags("paper_isolation-0", "baseline", "diverges", "diverged"),
                                 "divergence_step": "22"}, [4.0, 3.9, float("nan"), float("nan")], first=20)
    run("beta_sweep-0", 4, fork_tags("beta_sweep-0", "sfa", "stable", "stable", " intervention.beta=2"),
        [4.1, 4.0, 3.95], first=20)
    run("paper_isolation-2", 5, fork_tags("paper_isolation-2", "tiling_off", "diverges", "running"),
        [4.0, 3.9, 3.8, 3.85, 3.7, 3.6, 3.65, 3.5], first=20)  # killed at step 27
    run("paper_isolation-10", 6, fork_tags("paper_isolation-10", "sfa", "stable", "stable"), [4.2, 4.1], first=20)
    for i in range(3):  # > 6 runs with losses in the plot: the many-runs layout
        run(f"beta_sweep-{i + 1}", 7 + i, fork_tags(f"beta_sweep-{i + 1}", "sfa", "stable", "stable",
                                                     f" intervention.beta={4 * (i + 1)}"), [4.3, 4.2], first=20)
    return uri, made


def test_rows_from_mlflow(tmp_path):
    uri, made = _store(tmp_path)
    rows, hist = report.rows_from_mlflow(uri, "x")
    jobs = [r["job"] for r in rows]
    assert jobs == ["baseline", "paper_isolation-0", "paper_isolation-1", "paper_isolation-2", "paper_isolation-10",
                    "beta_sweep-0", "beta_sweep-1", "beta_sweep-2", "beta_sweep-3"]
    assert made["parent"] not in hist  # the sweep parent run is skipped
    by = {r["job"]: r for r in rows}
    assert {j: r["mlflow_run_id"] for j, r in by.items()} == {j: made[j] for j in jobs}
    b = by["baseline"]
    assert (b["intervention"], b["expected"], b["observed"], b["divergence_step"]) == \
        ("baseline", "diverges", "diverged", 30)
    assert math.isnan(b["final_loss"]) and b["min_loss"] == pytest.approx(3.1) and b["steps_done"] == 35
    assert (b["peak_wq_norm"], b["peak_wq_where"]) == (7.25, "L0.H1")
    assert b["fork_step"] is None and b["job_dir"] == "/jobs/baseline"
    assert b["overrides"] == ["intervention=baseline", "train.seed=1"]
    f1 = by["paper_isolation-1"]
    assert (f1["observed"], f1["final_loss"], f1["min_loss"], f1["steps_done"]) == ("stable", 3.7, 3.7, 24)
    assert (f1["fork_step"], f1["forked_from"]) == (20, "/jobs/baseline/checkpoints/step_20.pt")
    assert f1["divergence_step"] is None and f1["error"] is None and f1["matches_paper"] is True
    assert (f1["peak_wq_norm"], f1["peak_wq_where"]) == (2.0, "L1.H1")
    f0 = by["paper_isolation-0"]
    assert (f0["observed"], f0["divergence_step"], f0["min_loss"]) == ("diverged", 22, 3.9)
    killed = by["paper_isolation-2"]
    assert killed["observed"] == "failed" and killed["intervention"] == "tiling_off"
    assert "step 27" in killed["error"] and "'running'" in killed["error"], killed["error"]
    assert killed["final_loss"] == 3.5 and killed["steps_done"] == 28 and killed["matches_paper"] is False
    assert [s for s, _ in hist[made["paper_isolation-2"]]["train/loss"]] == list(range(20, 28))
    assert set(hist[made["baseline"]]) == {"train/loss", "wq_sigma/L0.H1", "wq_sigma/L1.H0"}
    with pytest.raises(ValueError, match="no such experiment"):
        report.rows_from_mlflow(uri, "y")


def test_rows_from_mlflow_one_table_per_source_run(tmp_path):
    """Two runs of the script in one store: refused without --source-run; with it, one source and its forks."""
    from mlflow.tracking import MlflowClient
    uri, made = _store(tmp_path)
    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name("x").experiment_id
    other = c.create_run(exp, tags={"intervention": "baseline", "expect": "diverges", "verdict": "stable",
                                    "sweep": "x/baseline"}).info.run_id
    c.create_run(exp, tags={"intervention": "fp32", "expect": "stable", "verdict": "stable", "fork_step": "5",
                            "forked_from_run": other, "sweep": "x/paper_isolation-1"})
    with pytest.raises(ValueError, match="holds 2 source runs.*--source-run"):
        report.rows_from_mlflow(uri, "x")
    rows, _ = report.rows_from_mlflow(uri, "x", source_run=made["baseline"])
    assert len(rows) == 9 and rows[0]["mlflow_run_id"] == made["baseline"]
    rows, _ = report.rows_from_mlflow(uri, "x", source_run=other)
    assert [(r["intervention"], r["fork_step"]) for r in rows] == [("baseline", None), ("fp32", 5)]
    with pytest.raises(ValueError, match="--source-run 'nope': not a source run"):
        report.rows_from_mlflow(uri, "x", source_run="nope")


def test_report_cli_from_mlflow(tmp_path, capsys):
    uri, made = _store(tmp_path)
    out = tmp_path / "report"
    rc = report.main(["--out", str(out), "--from-mlflow", "x", "--tracking-uri", uri, "--meta", "git=abc1234"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((out / "verdicts.json").read_text())
    assert [r["job"] for r in doc["runs"]][:5] == ["baseline", "paper_isolation-0", "paper_isolation-1",
                                                   "paper_isolation-2", "paper_isolation-10"]
    # the baseline (diverged at 30) has no FP32 control that ran past step 30 (the fp32 fork stops at 23): no match;
    # its fork paper_isolation-0 (diverged at 22) has one, stable past it: a match
    assert doc["summary"] == {"runs": 9, "matches_paper": 7, "void": 0, "failed": 1}
    assert doc["runs"][0]["final_loss"] is None  # NaN -> null
    assert "mlflow experiment x" in doc["meta"]["sources"]
    png = out / "plots" / "loss_curves.png"
    assert png.is_file() and mpimg.imread(png).shape[1] > 1000  # 8 curves: the wide, legend-outside layout
    assert (out / "plots" / "wq_spectral_norm.png").is_file()
    md = (out / "verdicts.md").read_text()
    assert "abc1234" in md and "paper_isolation-10" in md and "step 27" in md
    # bad invocations: rc 1, a message, nothing written
    for argv, msg in ((["--out", str(tmp_path / "r1")], "nothing to report"),
                      (["--out", str(tmp_path / "r2"), "--from-mlflow", "x"], "--tracking-uri"),
                      (["--out", str(tmp_path / "r3"), "--from-mlflow", "nope", "--tracking-uri", uri], "nope")):
        assert report.main(argv) == 1, argv
        assert msg in capsys.readouterr().err
        assert not Path(argv[1], "verdicts.json").exists()


# ----------------------------------------------------------------------------------- plots and labels
def test_moving_average():
    pts = [(0, 1.0), (1, 3.0), (2, 5.0), (5, 7.0), (9, 0.0)]
    assert plots._moving_average(pts, 2) == [(0, 1.0), (1, 2.0), (2, 4.0), (5, 6.0), (9, 3.5)]
    assert plots._moving_average(pts, 3) == [(0, 1.0), (1, 2.0), (2, 3.0), (5, 5.0), (9, 4.0)]
    assert plots._moving_average(pts, 1) == pts
    assert plots._moving_average(pts, 100) == [(s, sum(v for _, v in pts[:i + 1]) / (i + 1))
                                               for i, (s, _) in enumerate(pts)]
    assert plots._moving_average([], 5) == []


def test_loss_curves_many_runs(tmp_path):
    def hist(k, n=120):
        return {"train/loss": [(s, 5.0 / (1 + 0.01 * k * s) + 0.3 * math.sin(s)) for s in range(n)]
                + ([(n, float("nan"))] if k % 3 == 0 else [])}
    runs = [(f"job{k}:sfa intervention.beta={k}", hist(k)) for k in range(1, 10)]
    div = {runs[2][0]: 120, runs[5][0]: 120}
    many = plots.loss_curves(runs, tmp_path / "many.png", div)
    few = plots.loss_curves(runs[:4], tmp_path / "few.png", div)
    assert many == tmp_path / "many.png" and few == tmp_path / "few.png"
    w_many, w_few = mpimg.imread(many).shape[1], mpimg.imread(few).shape[1]
    assert w_many > w_few  # room for the legend outside the axes
    assert plots.loss_curves([("a", {"val/loss": [(0, 1.0)]})], tmp_path / "none.png") is None


def test_label_drops_plumbing_overrides():
    row = {"job": "b-1", "intervention": "sfa",
           "overrides": ["intervention=sfa", "intervention.beta=2", "from_checkpoint=/r/b/checkpoints/step_20.pt",
                         "sweep_name=paper_isolation_runs/beta_sweep-1", "tracking.uri=sqlite:////r/m.db",
                         "tracking.experiment=paper_isolation", "train.max_steps=1000", "train.ckpt_every=0",
                         "train.keep_checkpoints=0", "train.early_stop=false", "results_dir=/tmp/r",
                         "hydra.run.dir=/r/forks/beta_sweep-1", "+sweep=beta_sweep", "train.seed=3",
                         "intervention.layer=1"]}
    assert report._label(row) == "b-1:sfa intervention.beta=2 intervention.layer=1 train.seed=3"
    assert report._label(row, common={"train.seed=3"}) == "b-1:sfa intervention.beta=2 intervention.layer=1"
    assert report._label({"job": "j", "intervention": "fp32", "overrides": ["intervention=fp32"]}) == "j:fp32"


# ------------------------------------------------------------------------------------ meta given as text
def test_markdown_meta_as_text(tmp_path):
    rows = [report.row_from_result({"intervention": "baseline", "expected": "diverges", "observed": "diverged",
                                    "divergence_step": 5, "overrides": ["intervention=baseline"]}, "baseline")]
    meta = {"git": "0123abc (clean)", "hardware": "1x H200, 16 CPUs", "versions": "torch 2.13.0, mlflow 3.17.2",
            "command": "bash scripts/paper_isolation.sh", "fork_step": "20", "wall_s": 321, "ratio": 0.5,
            "sources": ["/a", "/b"]}
    paths = report.write_report(rows, tmp_path / "r", meta=meta, echo=False)
    md = paths["md"].read_text()
    assert "`0123abc (clean)`" in md
    assert "- hardware: 1x H200, 16 CPUs" in md and "- versions: torch 2.13.0, mlflow 3.17.2" in md
    assert "- command: `bash scripts/paper_isolation.sh`" in md
    assert "- fork_step: 20" in md and "- wall_s: 321" in md and "- ratio: 0.5" in md
    assert "- sources:" not in md  # not a scalar
    assert md.count("- hardware:") == 1 and md.count("- git") == 0  # shown once, in its own line
    doc = json.loads(paths["json"].read_text())
    assert doc["meta"]["git"] == "0123abc (clean)" and doc["meta"]["hardware"] == "1x H200, 16 CPUs"
    # the same through the CLI's --meta key=value
    job = tmp_path / "baseline"
    job.mkdir()
    (job / "result.json").write_text(json.dumps({"intervention": "baseline", "expected": "diverges",
                                                 "observed": "diverged", "divergence_step": 5}))
    assert report.main(["--out", str(tmp_path / "c"), "--meta", "git=feedbee", "--meta", "hardware=laptop",
                        "--meta", "localized=intervention.layer=1", str(job)]) == 0
    md = (tmp_path / "c" / "verdicts.md").read_text()
    assert "`feedbee`" in md and "- hardware: laptop" in md and "- localized: intervention.layer=1" in md
    # dict meta (run_meta's own) still renders as before
    md = report.write_report(rows, tmp_path / "d", echo=False)["md"].read_text()
    assert f"{os.cpu_count()} CPUs" in md and "torch " in md
