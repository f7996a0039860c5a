"""The isolation pipeline's CPU-side pieces: the merged report CLI, localization's sweep target, the GPU slot of a
local job, the local launcher's GPU check and resolver, the seeds sweep, and scripts/paper_isolation.sh end to end
(tiny, CPU)."""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config and the ff_gpu_count resolver
from flash_forensics.orchestrator.analysis.localize import localize
from flash_forensics.orchestrator.config.validate import ConfigError
from flash_forensics.orchestrator.job.distributed import init_distributed, resolve_device
from flash_forensics.orchestrator.job.train import _job_slot
from flash_forensics.orchestrator.launch import callbacks, cluster
from flash_forensics.orchestrator.launch.callbacks import sweep_jobs, validate_sweep
from flash_forensics.orchestrator.report.sweep import main as report_main

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
LOCAL_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"


@pytest.fixture
def hydra_conf():
    """compose(overrides) -> (multirun config with the hydra node, the overrides); Hydra cleared afterwards."""
    def go(*overrides):
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        plain = [o.input_line for o in parsed if not o.is_sweep_override()]
        GlobalHydra.instance().clear()
        with initialize_config_dir(CONF, version_base="1.3"):
            cfg = compose("config", overrides=plain, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.overrides.task = list(overrides)
        return cfg
    yield go
    GlobalHydra.instance().clear()


def _in_hydra(fn):
    """Run fn with Hydra initialised on conf/ (validate_sweep composes jobs through the global config loader)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(CONF, version_base="1.3"):
        return fn(GlobalHydra.instance().config_loader())


# ------------------------------------------------------------------------------------------- report CLI
def _write_result(d: Path, **result) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "result.json").write_text(json.dumps(result))


def test_report_cli_merges_a_job_dir_and_sweep_dirs(tmp_path, capsys):
    base = tmp_path / "runs" / "baseline"
    _write_result(base, intervention="baseline", expected="diverges", observed="diverged", divergence_step=30,
                  final_loss=float("nan"), overrides=["intervention=baseline"], steps_done=40)
    iso = tmp_path / "runs" / "paper_isolation"
    iso_rows = [("fp32", "stable", "stable", None, 4.1), ("sfa", "stable", "diverged", 33, None),
                ("head_upcast", "stable", "stable", None, 4.3)]
    for i, (name, exp, obs, div, fl) in enumerate(iso_rows):
        _write_result(iso / str(i), intervention=name, expected=exp, observed=obs, divergence_step=div,
                      final_loss=fl, overrides=[f"intervention={name}", "intervention.layer=1"], fork_step=10,
                      forked_from="/ckpt/step_10.pt", steps_done=40)  # the fp32 fork: the baseline's control
    beta = tmp_path / "runs" / "beta_sweep"
    _write_result(beta / "0", intervention="sfa", expected="stable", observed="stable", final_loss=4.2,
                  overrides=["intervention=sfa", "intervention.beta=2"], fork_step=10)
    (beta / "1" / ".hydra").mkdir(parents=True)  # a job killed before it wrote result.json
    (beta / "1" / ".hydra" / "overrides.yaml").write_text("- intervention=sfa\n- intervention.beta=8\n")

    out = tmp_path / "report"
    rc = report_main(["--out", str(out), "--sweep", "merged", "--meta", "fork_checkpoint=/ckpt/step_10.pt",
                      str(base), str(iso), str(beta)])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((out / "verdicts.json").read_text())
    runs = doc["runs"]
    assert [r["job"] for r in runs] == ["baseline", "paper_isolation/0", "paper_isolation/1", "paper_isolation/2",
                                        "beta_sweep/0", "beta_sweep/1"]
    for r in runs:
        assert {"intervention", "expected", "observed"} <= set(r), r
    by_job = {r["job"]: r for r in runs}
    for i, (name, exp, obs, _, _) in enumerate(iso_rows):
        r = by_job[f"paper_isolation/{i}"]
        assert (r["intervention"], r["expected"], r["observed"]) == (name, exp, obs)
        assert r["matches_paper"] == ((exp, obs) in (("stable", "stable"), ("diverges", "diverged")))
        assert r["fork_step"] == 10
    assert by_job["baseline"]["observed"] == "diverged" and by_job["baseline"]["matches_paper"] is True
    assert by_job["baseline"]["cause"] == "precision" and by_job["baseline"]["control"] == "job paper_isolation/0"
    assert by_job["baseline"]["final_loss"] is None  # NaN -> null: strict JSON
    # the missing result.json is a failed row, named by its Hydra overrides
    dead = by_job["beta_sweep/1"]
    assert (dead["intervention"], dead["observed"]) == ("sfa", "failed") and "no result.json" in dead["error"]
    # rows of different folders are compared with one baseline (the job dir's)
    assert "baseline diverged at step 30" in by_job["paper_isolation/0"]["vs_baseline"]
    assert "+3 steps" in by_job["paper_isolation/1"]["vs_baseline"]
    assert doc["sweep"] == "merged" and doc["meta"]["fork_checkpoint"] == "/ckpt/step_10.pt"
    assert doc["meta"]["tracking_uri"] is None  # no MLflow looked up without run ids and --tracking-uri
    assert doc["summary"] == {"runs": 6, "matches_paper": 4, "void": 0, "failed": 1}
    md = (out / "verdicts.md").read_text()
    assert "paper_isolation/2" in md and "beta_sweep/1" in md

    missing = tmp_path / "runs" / "nope"
    assert report_main(["--out", str(tmp_path / "r2"), str(base), str(missing)]) == 1
    err = capsys.readouterr().err
    assert str(missing) in err and "not a directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report_main(["--out", str(tmp_path / "r3"), str(empty)]) == 1
    assert "no job folders" in capsys.readouterr().err
    assert not (tmp_path / "r2" / "verdicts.json").exists()


# ------------------------------------------------------------------------------------- localize target
def _history(layers, n_head=6, steps=200, every=10, base=None):
    """W_Q sigma per head: sigma(s) = base[h] * (1 + rate * s) with rate = layers.get(layer, {}).get(head, tiny),
    plus a small deterministic wobble so no two heads tie exactly."""
    base = base or [1.0] * n_head
    n_layer = 4
    h = {}
    for l in range(n_layer):
        for hd in range(n_head):
            rate = layers.get(l, {}).get(hd, 1e-5)
            wob = 1.0 + 0.001 * math.sin(5 * l + 3 * hd)
            h[f"wq_sigma/L{l}.H{hd}"] = [(s, wob * base[hd] * (1 + rate * s)) for s in range(0, steps + 1, every)]
    return h


EVEN = [1.0, 1.5, 1.1, 1.4, 1.2, 1.3]  # shuffled, evenly spaced head norms: no outlier heads


def _sigma_end(history, layer, head, end):
    return [v for s, v in history[f"wq_sigma/L{layer}.H{head}"] if s <= end][-1]


def test_target_when_a_layer_stands_out():
    h = _history({2: {1: 0.02, 4: 0.015}})  # layer 2, heads 1 and 4 grow; the rest barely move
    loc = localize(h, divergence_step=200)
    assert loc.layer == 2, loc.reason
    layer, heads, why = loc.target()
    assert (layer, heads) == (2, [1, 4]) and why == "stands out"
    assert loc.sweep_overrides() == ["intervention.layer=2", "intervention.heads=[1,4]"]
    d = loc.to_dict()
    assert d["target"] == {"layer": 2, "heads": [1, 4], "why": "stands out"}
    assert d["sweep_overrides"] == loc.sweep_overrides()


def test_target_best_guess_when_no_layer_stands_out():
    # layer 1 grows most but only x1.25 layer 3's excess (< margin 1.5): nothing stands out; heads grow alike, so
    # the end-of-window sigma orders them like their (shuffled) starting norms
    base = EVEN
    rate1, rate3 = 0.004, 0.0032
    h = _history({1: {i: rate1 for i in range(6)}, 3: {i: rate3 for i in range(6)}}, base=base)
    loc = localize(h, divergence_step=200)
    assert loc.layer is None and "no layer stands out" in loc.reason
    assert loc.layers[0].layer == 1 and loc.outlier_heads == []
    layer, heads, why = loc.target()
    ends = {hd: _sigma_end(h, 1, hd, 200) for hd in range(6)}
    upper = sorted(sorted(ends, key=ends.get, reverse=True)[:3])
    assert layer == 1 and heads == upper == [1, 3, 5]
    assert "best guess" in why and "upper half" in why
    assert loc.sweep_overrides() == ["intervention.layer=1", "intervention.heads=[1,3,5]"]
    assert loc.overrides() == {}  # the ready-to-paste per-intervention overrides still need a standing-out layer
    # a standing-out layer without outlier heads (all heads grow alike) also falls back to the upper half
    h = _history({2: {i: 0.02 for i in range(6)}}, base=base)
    loc = localize(h, divergence_step=200)
    layer, heads, why = loc.target()
    assert loc.layer == 2 and loc.outlier_heads == [] and (layer, heads) == (2, [1, 3, 5])
    assert why.startswith("stands out") and "upper half" in why
    assert localize({}).target() == (None, [], "nothing to localize") and localize({}).sweep_overrides() == []


def _sweep_job_cfgs(hydra_conf, *overrides):
    cfg = hydra_conf(*overrides)
    n = _in_hydra(lambda _: validate_sweep(cfg))
    jobs = sweep_jobs(cfg)
    cfgs = _in_hydra(lambda loader: [loader.load_sweep_config(cfg, list(j)) for j in jobs])
    return n, cfgs


@pytest.mark.parametrize("case", ["stands_out", "best_guess"])
def test_sweep_overrides_compose_with_paper_isolation(hydra_conf, tmp_path, case):
    if case == "stands_out":
        loc = localize(_history({2: {1: 0.02, 4: 0.015}}), divergence_step=200)
    else:
        loc = localize(_history({1: {i: 0.004 for i in range(6)}, 3: {i: 0.0032 for i in range(6)}},
                                base=EVEN), divergence_step=200)
    layer, heads, _ = loc.target()
    common = ["experiment=smoke", "+sweep=paper_isolation", "model.n_layer=4", "model.n_head=6", "model.n_embd=96",
              f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"results_dir={tmp_path}/results"]
    n, cfgs = _sweep_job_cfgs(hydra_conf, *common, *loc.sweep_overrides())
    assert n == 11 == len(cfgs)
    by_name = {str(c.intervention.name): c for c in cfgs}
    for name in ("flash_only_layer", "standard_layer", "head_upcast"):
        assert by_name[name].intervention.layer == layer
    assert list(by_name["head_upcast"].intervention.heads) == heads
    # the same overrides on a model without that layer are rejected, naming the key
    with pytest.raises(ConfigError, match=rf"intervention.layer={layer}"):
        cfg = hydra_conf(*[o for o in common if not o.startswith("model.")], "model.n_head=6", "model.n_embd=96",
                         "model.n_layer=1", *loc.sweep_overrides())
        _in_hydra(lambda _: validate_sweep(cfg))


# ----------------------------------------------------------------------------------------- GPU slot
@pytest.fixture
def single_process(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_ID",
              "SUBMITIT_LOCAL_NTASKS"):
        monkeypatch.delenv(k, raising=False)


def test_slot_on_cpu(single_process):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    for dev in ("auto", "cpu"):
        for slot in (0, 1, 5):
            assert resolve_device(dev, slot) == torch.device("cpu")
    info = init_distributed(device="cpu", slot=5)
    assert info.device == torch.device("cpu") and info.world_size == 1 and info.source == "single"


def test_slot_picks_gpu_modulo_count(single_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    set_device = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_device.append(d))
    for slot, want in ((0, 0), (1, 1), (3, 1), (4, 0)):
        info = init_distributed(device="cuda", slot=slot)
        assert info.device == torch.device("cuda", want), (slot, info.device)
        assert info.world_size == 1
    assert init_distributed(device="auto", slot=3).device == torch.device("cuda", 1)
    assert init_distributed(device="cuda:0", slot=3).device == torch.device("cuda", 0)  # explicit index wins
    assert not torch.distributed.is_initialized() and set_device == []  # a single process: no process group
    # several ranks on one node: the rank, not the job slot, picks the GPU (torchrun env; no group is created
    # because we stop at the device)
    assert resolve_device("cuda", 3) == torch.device("cuda", 1)


def test_job_slot_is_the_hydra_job_number(hydra_conf):
    saved = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().cfg = None
        assert _job_slot() == 0  # not under Hydra
        cfg = hydra_conf("experiment=smoke")
        with open_dict(cfg):
            cfg.hydra.job.num = 7
        HydraConfig.instance().set_config(cfg)
        assert _job_slot() == 7
    finally:
        HydraConfig.instance().cfg = saved


# ------------------------------------------------------------------------------------ launcher check
def _launcher_cfg(device, gpus, target=LOCAL_LAUNCHER):
    return OmegaConf.create({"train": {"device": device, "grad_accum": 1},
                             "hydra": {"launcher": {"_target_": target, "gpus_per_node": gpus,
                                                    "tasks_per_node": 1}}})


def test_local_launcher_without_gpus_refuses_cuda(monkeypatch):
    seen = []
    monkeypatch.setattr(cluster, "check_launcher", lambda cfg: seen.append(cfg))
    for gpus in (0, None):
        with pytest.raises(ConfigError) as e:
            callbacks._check_launcher(_launcher_cfg("cuda", gpus))
        assert "hydra.launcher.gpus_per_node" in str(e.value) and "train.device='cuda'" in str(e.value)
    with pytest.raises(ConfigError, match="hydra.launcher.gpus_per_node"):
        callbacks._check_launcher(_launcher_cfg("cuda:1", 0))
    assert seen == []  # refused before the cluster checks
    callbacks._check_launcher(_launcher_cfg("cuda", 1))
    callbacks._check_launcher(_launcher_cfg("cpu", 0))
    callbacks._check_launcher(_launcher_cfg("auto", None))
    assert len(seen) == 3
    # the SLURM launcher allocates GPUs itself: gpus_per_node=0 with cuda is not this check's business
    callbacks._check_launcher(_launcher_cfg("cuda", 0, target=LOCAL_LAUNCHER.replace("Local", "Slurm")))
    callbacks._check_launcher(_launcher_cfg("cuda", 0, target="hydra._internal.core_plugins.basic_launcher."
                                                                  "BasicLauncher"))


def test_gpu_count_resolver_and_local_yaml(hydra_conf, monkeypatch):
    n = OmegaConf.create({"g": "${ff_gpu_count:}"}).g
    assert isinstance(n, int) and n >= 0
    assert n == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    monkeypatch.setattr(cluster, "check_launcher", lambda cfg: None)
    cfg = hydra_conf("experiment=smoke", "hydra/launcher=local", "train.device=cuda")
    assert cfg.hydra.launcher._target_.endswith("LocalLauncher")
    assert cfg.hydra.launcher.gpus_per_node == n
    if n == 0:  # this machine: the local launcher would hide the (absent) GPUs, so cuda is refused up front
        with pytest.raises(ConfigError, match=r"hydra.launcher.gpus_per_node=0 is not allowed"):
            callbacks._check_launcher(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = hydra_conf("experiment=smoke", "hydra/launcher=local", "train.device=cuda")  # a fresh resolver cache
    assert cfg.hydra.launcher.gpus_per_node == 2
    callbacks._check_launcher(cfg)


# ------------------------------------------------------------------------------------------- seeds sweep
def test_mini_repro_seeds_sweep(hydra_conf, tmp_path):
    n, cfgs = _sweep_job_cfgs(hydra_conf, "+sweep=mini_repro_seeds", "experiment=smoke",
                              f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"results_dir={tmp_path}/results")
    assert n == 6 == len(cfgs)
    pairs = sorted((str(c.intervention.name), int(c.train.seed)) for c in cfgs)
    assert pairs == [(i, s) for i in ("baseline", "fp32") for s in (1, 2, 3)]
    for c in cfgs:
        assert c.data.seed == c.train.seed
    assert cfgs[0].sweep_name == "mini_repro_seeds"


# ---------------------------------------------------------------------------------- the whole pipeline
def _sweep_values(name: str, key: str):
    """A sweep file's comma list for key, read with yaml (not through flash_forensics.orchestrator.job.fork, which the
    script uses)."""
    import yaml
    params = yaml.safe_load((ROOT / "sweeps" / f"{name}.yaml").read_text())["hydra"]["sweeper"]["params"]
    return [v.strip() for v in str(params[key]).split(",")]


def _max_overlap(intervals):
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


@pytest.mark.xdist_group("isolation_script")  # no module fixture: its 3+ minutes run beside its file
def test_paper_isolation_script_end_to_end(tmp_path):
    """baseline (NaN at step 25, a checkpoint every 5 steps) -> fork from the newest checkpoint <= its lowest-loss
    step (not the one at the divergence) -> localize -> 11 + 4 forks as separate runs, 3 at a time, 6 steps each
    (FORK_STEPS ends them before the baseline's last step) -> one report over the baseline and the forks folder."""
    from flash_forensics.orchestrator.job.fork import checkpoints
    root, out = tmp_path / "root", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "LAUNCHER", "MARGIN", "CUDA_VISIBLE_DEVICES")}
    env.update(ROOT=str(root), ISOLATION_OUT=str(out), PER_GPU="3", FORK_STEPS="6", URI=f"sqlite:///{tmp_path}/m.db",
               OUT=str(tmp_path / "not_the_report"))  # OUT is no longer read: the report must not land there
    overrides = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64",
                 "train.batch_size=4", "train.device=cpu", "tracking.writer=thread", "train.max_steps=40",
                 "train.warmup_steps=5", "train.ckpt_every=5", "debug.nan_at_step=25", "train.eval_every=0",
                 "monitor.wq_every=10", f"results_dir={tmp_path}/results",
                 # not what this test checks, and 16 CPU jobs' worth of cost: CPU autocast's BF16 GEMMs and
                 # mini_repro's probe at every checkpoint (tests/integration/test_probes.py covers the probes)
                 "train.precision=fp32", "monitor.probes.enabled=false"]
    r = subprocess.run(["bash", "scripts/paper_isolation.sh", *overrides], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((root / "forks").glob("*.log")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs
    assert "FAILED" not in r.stdout, r.stdout[-3000:] + logs
    assert not (tmp_path / "not_the_report").exists()

    # the baseline and the checkpoint the forks start from: newest <= the step of its lowest loss before NaN
    res = json.loads((root / "baseline" / "result.json").read_text())
    assert res["observed"] == "diverged" and res["divergence_step"] == 25
    mls = res["min_loss_step"]
    assert isinstance(mls, int) and 0 <= mls < 25
    ckpts = checkpoints(root / "baseline")
    assert {5, 10, 15, 20, 25} <= {s for s, _ in ckpts}, ckpts
    fork_step = max(s for s, _ in ckpts if s <= mls)
    assert fork_step < 25  # the divergence step's own checkpoint exists: --at-min must not pick it
    end = fork_step + 6
    assert end < res["steps_done"] == 40  # FORK_STEPS, not the baseline's end, stops the forks

    doc = json.loads((out / "verdicts.json").read_text())
    runs = doc["runs"]
    jobs = [r["job"] for r in runs]
    iso_names = _sweep_values("paper_isolation", "intervention")
    betas = _sweep_values("beta_sweep", "intervention.beta")
    want = {f"forks/paper_isolation-{i}" for i in range(len(iso_names))} | \
        {f"forks/beta_sweep-{i}" for i in range(len(betas))}
    assert jobs[0] == "baseline" and set(jobs[1:]) == want and len(jobs) == 1 + 11 + 4, jobs
    # natural order inside a group: -2 before -10
    assert jobs.index("forks/paper_isolation-2") < jobs.index("forks/paper_isolation-10")
    assert all(r["observed"] != "failed" for r in runs), [(r["job"], r["error"]) for r in runs]
    base = runs[0]
    assert base["intervention"] == "baseline" and base["observed"] == "diverged" and base["fork_step"] is None
    forks = {r["job"]: r for r in runs[1:]}
    for name, row in forks.items():
        assert row["fork_step"] == fork_step, (name, row["fork_step"], mls, ckpts)
        assert row["forked_from"] and Path(row["forked_from"]).name == dict(ckpts)[fork_step].name
        fres = json.loads((root / name / "result.json").read_text())
        assert fres["steps_done"] == end, (name, fres["steps_done"], end)
        assert (root / f"{name}.log").is_file()
    # each job name runs its own sweep entry
    for i, iv in enumerate(iso_names):
        assert forks[f"forks/paper_isolation-{i}"]["intervention"] == iv
    for i, b in enumerate(betas):
        row = forks[f"forks/beta_sweep-{i}"]
        assert row["intervention"] == "sfa" and f"intervention.beta={b}" in row["overrides"], row["overrides"]
        assert not any(o.startswith("intervention.layer=") for o in row["overrides"])  # localization: isolation only
    assert doc["meta"]["fork_step"] == str(fork_step) and doc["meta"]["fork_checkpoint"].endswith(".pt")

    # localization's target reaches the layer/head-specific isolation forks
    loc = json.loads((out / "localize.json").read_text())
    layer = loc["target"]["layer"]
    assert layer in (0, 1) and loc["sweep_overrides"][0] == f"intervention.layer={layer}"
    iso = {r["intervention"]: r for n, r in forks.items() if n.startswith("forks/paper_isolation-")}
    for name in ("flash_only_layer", "standard_layer", "head_upcast"):
        assert f"intervention.layer={layer}" in iso[name]["overrides"], (name, iso[name]["overrides"])
    heads = "intervention.heads=[" + ",".join(map(str, loc["target"]["heads"])) + "]"
    assert heads in iso["head_upcast"]["overrides"], iso["head_upcast"]["overrides"]
    assert (out / "verdicts.md").is_file()

    # PER_GPU=3 on CPU: never more than 3 forks alive at once (each job's folder is made after its process starts
    # and its result.json written before it ends, so these spans lie inside the processes' lifetimes)
    spans = [((root / n / ".hydra" / "config.yaml").stat().st_mtime, (root / n / "result.json").stat().st_mtime)
             for n in forks]
    assert 2 <= _max_overlap(spans) <= 3, spans
    assert "3 at a time" in r.stdout, r.stdout[-2000:]
