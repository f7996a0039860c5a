"""experiment=paper_1gpu: the preset holds the probe's settings, its controls validate, isolate's
--stop-after reaches the baseline, and scripts/paper_1gpu.sh runs its one-lease plan end to end on the CPU (tiny)."""
import json
import os
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
from flash_forensics.orchestrator.analysis import isolate
from flash_forensics.orchestrator.config.validate import validate_config
from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.job.fork import sweep_file_jobs

ROOT = Path(__file__).resolve().parents[2]
CPU = ["train.device=cpu"]  # the preset says cuda; everything else as on the GPU


def _compose(*overrides):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            return compose("config", overrides=["experiment=paper_1gpu", *overrides])
    finally:
        GlobalHydra.instance().clear()


def test_preset_is_the_probes_regime():
    c = _compose()
    assert (c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size, c.model.bias) == (12, 12, 768, 1024,
                                                                                                   False)
    assert (c.train.batch_size, c.train.grad_accum, c.train.warmup_steps, c.train.max_steps) == (16, 1, 1000, 6000)
    assert (c.train.grad_clip, c.train.precision, c.train.seed, c.data.seed) == (1.0, "bf16", 1337, 1337)
    assert (c.optimizer.name, list(c.optimizer.betas), c.optimizer.weight_decay) == ("adamw", [0.9, 0.95], 0.0)
    assert c.optimizer.lr == c.optimizer.min_lr == 1e-3  # constant after the warmup
    assert (c.attention.impl, c.attention.recipe, c.attention.block_q, c.attention.block_k) == ("flash", "paper_bf16",
                                                                                                128, 128)
    assert c.data.corpus == "debian_docs" and c.data.val_fraction == 0.01
    assert (c.train.ckpt_every, c.train.keep_checkpoints, c.train.eval_every) == (250, 0, 500)
    assert str(c.train.compile).lower() == "false"
    assert c.monitor.counters and c.monitor.max_logit


def test_schedule_is_constant_after_warmup():
    from flash_forensics.orchestrator.job.optim import lr_factor
    c = _compose()
    o, t = c.optimizer, c.train
    ratios = [lr_factor(s, t.warmup_steps, o.decay_steps or t.max_steps, o.min_lr / o.lr) for s in (1000, 3000, 5999)]
    assert ratios == pytest.approx([1.0, 1.0, 1.0])
    assert lr_factor(499, t.warmup_steps, t.max_steps, 1.0) == pytest.approx(0.5)


@pytest.fixture
def disk_is_not_the_question(monkeypatch):
    """The preset keeps every checkpoint (~37 GB for its 6,000 steps), so validating it checks this machine's free
    disk; the disk budget has its own tests (test_preflight_checks_the_runs_as_launched, test_validate_inputs), here
    the plans and knobs are."""
    from flash_forensics.orchestrator.config import budget
    monkeypatch.setattr(budget, "_free", lambda path: 1 << 50)


@pytest.mark.parametrize("name,iv,recipe,impl,precision", [
    ("fp32", "fp32", "fp32", "flash", "bf16"),  # THE FP32 reference: attention in FP32
    ("fp32_train", "fp32", "fp32", "flash", "fp32"),  # no autocast at all
    ("fa2", "baseline", "fa2", "flash", "bf16"),
    ("sdpa", "baseline", "paper_bf16", "sdpa", "bf16"),
])
def test_controls_compose_and_validate(name, iv, recipe, impl, precision, disk_is_not_the_question):
    jobs = dict(sweep_file_jobs(["paper_1gpu_controls"]))
    ov = jobs[f"paper_1gpu_controls-{['fp32', 'fp32_train', 'fa2', 'sdpa'].index(name)}"]
    assert ov == [f"+control={name}"]
    c = _compose(*CPU, *ov)
    validate_config(c, ov, check_store=False)  # data fits, knobs fit the implementation, ...
    assert c.intervention.name == iv and c.train.precision == precision and c.attention.impl == impl
    assert (c.intervention.get("recipe") or c.attention.recipe) == recipe
    assert c.model.n_layer == 12 and c.attention.block_q == 128  # the same model: a fork from the baseline


def test_stop_after_reaches_the_baseline(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(isolate.Pipeline, "_run_py", lambda self, ov, log=None, gpu=None: seen.append(list(ov)) or 1)
    plan = isolate.Plan(root=tmp_path, out=tmp_path / "r", uri="sqlite:///x.db", stop_after=300)
    with pytest.raises(isolate.PipelineError):
        isolate.Pipeline(plan).baseline()  # no result.json from the stub: the error path
    assert "train.early_stop=true" in seen[0] and "verdict.early_stop_after=300" in seen[0]
    assert "train.early_stop=false" not in seen[0]
    seen.clear()
    with pytest.raises(isolate.PipelineError):
        isolate.Pipeline(isolate.Plan(root=tmp_path, out=tmp_path, uri="sqlite:///x.db")).baseline()
    assert "train.early_stop=false" in seen[0] and not any(o.startswith("verdict.early_stop_after") for o in seen[0])


def test_stop_after_negative_is_refused(capsys):
    with pytest.raises(SystemExit):
        isolate.main(["--stop-after", "-1"])
    assert "--stop-after=-1 is not allowed" in capsys.readouterr().err


def test_plan_dry_run():
    env = dict(os.environ, DRY_RUN="1", ROOT="/tmp/ff-plan")
    r = subprocess.run(["bash", "scripts/paper_1gpu.sh", "train.compile=true"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cmd = "python -m flash_forensics.orchestrator.analysis.isolate"
    lines = {s: next(ln for ln in r.stdout.splitlines() if f"seed {s}: {cmd}" in ln) for s in (1337, 1, 2)}
    assert not Path("/tmp/ff-plan").exists()  # a dry run writes nothing
    for s, ln in lines.items():
        assert f"--root /tmp/ff-plan/seed{s} " in ln and f"--uri sqlite:////tmp/ff-plan/seed{s}/mlflow.db" in ln
        assert f"train.seed={s} data.seed={s}" in ln and "--stop-after 300" in ln and ln.endswith("train.compile=true")
    assert "--sweeps paper_1gpu_controls paper_isolation beta_sweep --" in lines[1337]
    for s in (1, 2):
        assert "--sweeps paper_1gpu_controls --" in lines[s] and "train.ckpt_every=500" in lines[s]
    assert "race:" not in r.stdout  # RACE=0 by default


def test_race_plan_dry_run():
    """RACE=1: every seed gets the first seed's plan (its sweeps, --per-gpu, the preset's checkpoint interval);
    OVERRIDES_<seed> reach that seed's isolate only, after the overrides of every run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERRIDES_")}
    env.update(DRY_RUN="1", ROOT="/tmp/ff-race-plan", SEEDS="2 1337", RACE="1",
               OVERRIDES_1337="train.ckpt_start=8500 train.compile=false")
    r = subprocess.run(["bash", "scripts/paper_1gpu.sh", "train.compile=true"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cmd = "python -m flash_forensics.orchestrator.analysis.isolate"
    lines = {s: next(ln for ln in r.stdout.splitlines() if f"seed {s}: {cmd}" in ln) for s in (2, 1337)}
    assert not Path("/tmp/ff-race-plan").exists()
    for s, ln in lines.items():
        assert "--sweeps paper_1gpu_controls paper_isolation beta_sweep --" in ln and "--per-gpu 2 " in ln, ln
        assert "train.ckpt_every=" not in ln and f"train.seed={s} data.seed={s}" in ln
    assert lines[2].endswith("train.compile=true") and "ckpt_start" not in lines[2]
    assert lines[1337].endswith("train.compile=true train.ckpt_start=8500 train.compile=false")
    assert "race: the first seed whose baseline diverges keeps the GPU; the others stop" in r.stdout


def test_a_key_given_twice_takes_its_last_value():
    """What OVERRIDES_<seed> relies on (scripts/paper_1gpu.sh's header): after the overrides of every run, a
    seed's own value of the same key wins."""
    c = _compose("train.ckpt_start=0", "train.max_steps=14", "debug.nan_at_step=8", "train.ckpt_start=8500",
                 "debug.nan_at_step=null", "train.max_steps=100000")
    assert (c.train.ckpt_start, c.debug.nan_at_step, c.train.max_steps) == (8500, None, 100000)


def test_scratch_plan_dry_run():
    """scripts/paper_scratch.sh: one run.py per run, each in its own job folder, one store, no checkpoints; the lr
    baselines keep the preset's constant schedule (min_lr = lr); a dry run writes nothing."""
    env = dict(os.environ, DRY_RUN="1", ROOT="/tmp/ff-scratch-plan", SEED="2", MAX_STEPS="4652", LRS="5e-4 2e-3")
    r = subprocess.run(["bash", "scripts/paper_scratch.sh", "train.compile=true"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    runs = {ln.split("] ", 1)[1].split(":", 1)[0]: ln for ln in r.stdout.splitlines() if ": python run.py " in ln}
    assert list(runs) == ["baseline", "fp32", "qk_norm", "gated_attn", "baseline_lr5e-4", "baseline_lr2e-3"]
    assert not Path("/tmp/ff-scratch-plan").exists()
    for name, ln in runs.items():
        assert ln.endswith(f"hydra.run.dir=/tmp/ff-scratch-plan/{name}"), ln
        for want in ("experiment=paper_1gpu", "train.seed=2 data.seed=2", "train.max_steps=4652", "train.ckpt_every=0",
                     "train.early_stop=true", "tracking.uri=sqlite:////tmp/ff-scratch-plan/mlflow.db",
                     "attention.fp32_gemm=tf32x3", "train.compile=true"):
            assert want in ln, (name, want)
    assert "intervention=qk_norm sweep_name=paper_scratch " in runs["qk_norm"]
    assert "intervention=baseline optimizer.lr=2e-3 optimizer.min_lr=2e-3 sweep_name=paper_scratch_lr" in \
        runs["baseline_lr2e-3"]
    empty = subprocess.run(["bash", "scripts/paper_scratch.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, ROOT="/tmp/ff-scratch-empty", INTERVENTIONS="", LRS=""))
    assert empty.returncode == 2 and "nothing to run" in empty.stdout


def test_scratch_plan_whose_runs_made_no_store_reports_without_one(tmp_path):
    """Runs that never opened the MLflow store (here refused at their config, so nothing launched) leave none: the
    reports then go without --tracking-uri, which report refuses when it cannot read it, and say what is missing (the
    job folder), not the store."""
    env = dict(os.environ, ROOT=str(tmp_path / "s"), INTERVENTIONS="baseline", LRS="", PROGRESS_EVERY="1",
               OVERRIDES_ALL="")
    r = subprocess.run(["bash", "scripts/paper_scratch.sh", "train.no_such_key=1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "no MLflow store at" in r.stdout and "baseline: FAILED" in r.stdout, r.stdout
    assert "train.no_such_key is not a config key" in (tmp_path / "s" / "baseline.log").read_text()
    report = (tmp_path / "s" / "report.log").read_text()
    assert "baseline: not a directory" in report and "tracking" not in report, report


TINY = ["data=default", "model=tiny", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
        "train.batch_size=2", "train.device=cpu", "tracking.writer=thread", "tracking.system_metrics=false",
        "train.max_steps=14", "train.warmup_steps=2", "train.ckpt_every=2", "debug.nan_at_step=8",
        "train.eval_every=0", "train.eval_batches=1", "monitor.wq_every=2", "monitor.log_every=2", "verdict.window=3",
        # not what these plans check, and a dozen CPU jobs' worth of cost: CPU autocast's BF16 GEMMs and the preset's
        # probe at every checkpoint (here every 2 steps); tests/integration/test_probes.py covers the probes, as in
        # the isolation script's end-to-end test
        "train.precision=fp32", "monitor.probes.enabled=false"]


def test_one_lease_plan_end_to_end_on_cpu(tmp_path):
    """Two seeds at once, each baseline NaN at step 8 and stopped 2 steps later (--stop-after), each forking the
    four controls from its checkpoint 2 steps before the divergence (--pick before-divergence --margin 2) on its own
    batches to the divergence + 6 steps, past the baseline's end (its seeded order continues), with the forks' own
    overrides (the fast FP32 GEMMs; no forced NaN), into its own root, report and MLflow store."""
    root = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES",)}
    env.update(ROOT=str(root), SEEDS="1337 1", ISOLATION_SWEEPS="", STOP_AFTER="2", PER_GPU_FIRST="2",
               PER_GPU_OTHERS="1", CKPT_EVERY_OTHERS="2", PROGRESS_EVERY="5", OMP_NUM_THREADS="1",
               PICK="before-divergence", MARGIN="2", PAST_DIVERGENCE="6", KEEP_CHECKPOINTS="4",
               FORK_OVERRIDES="attention.fp32_gemm=tf32x3 debug.nan_at_step=null")
    r = subprocess.run(["bash", "scripts/paper_1gpu.sh", *TINY, f"results_dir={tmp_path}/results"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    logs = "".join(f"\n--- {p}\n{p.read_text()[-2500:]}" for p in sorted(root.glob("seed*.log")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + logs
    assert "[paper_1gpu" in r.stdout and "all done" in r.stdout and (root / "progress.log").is_file()
    for s in (1337, 1):
        d = root / f"seed{s}"
        base = json.loads((d / "baseline" / "result.json").read_text())
        assert base["observed"] == "diverged" and base["divergence_step"] == 8
        assert base["steps_done"] == 8 + 2 + 1, base  # stopped 2 steps after the divergence, not at max_steps
        doc = json.loads((d / "report" / "verdicts.json").read_text())
        rows = {row["job"]: row for row in doc["runs"]}
        assert set(rows) == {"baseline"} | {f"forks/paper_1gpu_controls-{i}" for i in range(4)}, set(rows)
        assert all(row["observed"] != "failed" for row in rows.values()), [(j, x.get("error")) for j, x in
                                                                          rows.items()]
        assert rows["forks/paper_1gpu_controls-0"]["intervention"] == "fp32"
        assert "attention.fp32_gemm=tf32x3" in rows["forks/paper_1gpu_controls-0"]["overrides"]
        assert "attention.fp32_gemm=tf32x3" not in rows["baseline"]["overrides"]
        assert rows["forks/paper_1gpu_controls-0"]["expected"] == "stable"
        kept = sorted(int(p.stem.split("_")[1]) for p in (d / "baseline" / "checkpoints").glob("step_*.pt"))
        assert kept == [6, 8, 10, 11], kept  # KEEP_CHECKPOINTS=4: the newest four
        order = (d / "baseline" / "batch_order.bin").read_bytes()
        for i in range(4):
            fd = d / f"forks/paper_1gpu_controls-{i}"
            fres = json.loads((fd / "result.json").read_text())
            assert f"train.seed={s}" in rows[f"forks/paper_1gpu_controls-{i}"]["overrides"]
            assert fres["fork_step"] == 6  # the newest checkpoint at least 2 steps before the divergence
            assert fres["steps_done"] == 8 + 6 > base["steps_done"]  # to the divergence + 6, past the baseline's end
            assert fres["observed"] == "stable", fres  # its own overrides: no forced NaN
            log = (fd / "run.log").read_text()
            assert "continue its seeded order" in log and "reproduces all 11 recorded steps" in log
            mine = (fd / "batch_order.bin").read_bytes()  # the baseline's 11 steps, then 3 regenerated ones
            assert mine[64:len(order)] == order[64:] and len(mine) > len(order)
            assert not list((fd / "checkpoints").glob("*.pt"))  # freed
        assert (d / "mlflow.db").is_file()
        assert f"seed {s}: done" in r.stdout


def test_race_on_cpu_the_first_seed_to_diverge_keeps_the_machine(tmp_path):
    """RACE=1, two seeds at once: seed 1337's baseline NaNs at step 8 (its result.json says diverged at step 11) while
    seed 1's would run 100,000 steps without diverging (its own OVERRIDES_1, after the tiny overrides of every run: no
    forced NaN, and a loss spike must be 100 nats high; at the tiny's margin it spikes near step 170); seed 1 is
    stopped at once, as a race, not a failure, and seed 1337 forks the FP32 reference from its checkpoint. Without the
    race the plan would not end: the script is then stopped (its trap stops the isolates) and the test fails."""
    import time
    root = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" and not k.startswith("OVERRIDES_")}
    env.update(ROOT=str(root), SEEDS="1337 1", RACE="1", CONTROL_SWEEPS="paper_1gpu_fp32", ISOLATION_SWEEPS="",
               STOP_AFTER="2", PER_GPU_FIRST="1", PROGRESS_EVERY="5", OMP_NUM_THREADS="1", PICK="before-divergence",
               MARGIN="2", PAST_DIVERGENCE="6", KEEP_CHECKPOINTS="4",
               FORK_OVERRIDES="attention.fp32_gemm=tf32x3 debug.nan_at_step=null",
               # the stopped seed logs through the writer process, as the GPU presets do: the race's TERM reaches it
               OVERRIDES_1="debug.nan_at_step=null train.max_steps=100000 verdict.margin=100 tracking.writer=process")
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "scripts/paper_1gpu.sh", *TINY, f"results_dir={tmp_path}/results"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script's trap stops every isolate (each its own process group)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"the race did not end the plan in 600 s:\n{out[-3000:]}")
    took = time.monotonic() - t0
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    logs = "".join(f"\n--- {p}\n{p.read_text()[-2500:]}" for p in sorted(root.glob("seed*.log")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + logs
    win = root / "seed1337"
    base = json.loads((win / "baseline" / "result.json").read_text())
    assert base["observed"] == "diverged" and base["divergence_step"] == 8
    fork = json.loads((win / "forks" / "paper_1gpu_fp32-0" / "result.json").read_text())
    assert fork["fork_step"] == 6 and fork["observed"] == "stable", fork
    assert "seed 1337: done" in r.stdout and "seed 1337 forks/paper_1gpu_fp32-0" in r.stdout
    assert "seed 1: stopped by the race (seed 1337 diverged first at step 8)" in r.stdout, r.stdout[-3000:]
    assert "race: seed 1337 diverged first, at step 8; stopped: seed 1 at baseline checkpoint step " in r.stdout
    assert "FAILED" not in r.stdout
    # seed 1 stopped mid-baseline: no fork, no table; its run.py took the TERM as a preemption (a checkpoint where it
    # stopped, a result.json saying so, within the 90 s before the KILL), its MLflow writer process outliving the TERM
    one = root / "seed1"
    assert not (one / "forks").exists() and not (one / "report" / "verdicts.json").exists()
    stopped = json.loads((one / "baseline" / "result.json").read_text())
    assert stopped["observed"] != "diverged" and stopped["steps_done"] < 10_000, stopped
    assert stopped["error"].startswith("stopped by SIGTERM"), stopped["error"]
    assert checkpoint.load(one / "baseline" / "checkpoints" / "last.pt")["step"] == stopped["steps_done"]
    # OVERRIDES_1 reached seed 1 only, after the overrides of every run (Hydra: the last value of a key wins)
    cfg1, cfg1337 = ((root / f"seed{s}" / "baseline" / "config_resolved.yaml").read_text() for s in (1, 1337))
    assert "max_steps: 100000" in cfg1 and "nan_at_step: null" in cfg1
    assert "max_steps: 14" in cfg1337 and "nan_at_step: 8" in cfg1337
    # nothing of seed 1's is left running
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count(str(root / "seed1"))]
    assert not left, [_cmdline(p) for p in left]
    assert took < 550, took  # seed 1 alone would need 100,000 steps


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _baseline_with_checkpoints(tmp_path, steps, divergence, min_loss_step, done):
    from flash_forensics.orchestrator import record
    from flash_forensics.orchestrator.job import checkpoint
    job = tmp_path / "baseline"
    (job / "checkpoints").mkdir(parents=True)
    for s in steps:  # intact files: a pick passes over damaged ones
        checkpoint.save(job / "checkpoints" / f"step_{s}.pt", {"step": s})
    rec = record.RunRecord(intervention="baseline", observed="diverged", divergence_step=divergence,
                           min_loss_step=min_loss_step, steps_done=done)
    record.write(job, rec)
    return job, record.read(job)


@pytest.mark.parametrize("rule,margin,past,want", [
    ("at-min", 0, None, (8750, 9750)),  # the lowest loss at 8885: 1,000 steps of forks to the baseline's end
    ("before-divergence", 150, None, (9500, 9750)),
    ("before-divergence", 150, 310, (9500, 10007)),  # past the baseline's end: its seeded order continues
    ("at-min", 0, 310, (8750, 10007)),
])
def test_pick_rules_and_fork_end(tmp_path, rule, margin, past, want):
    job, rec = _baseline_with_checkpoints(tmp_path, [8500, 8750, 9000, 9250, 9500, 9750], 9697, 8885, 9750)
    plan = isolate.Plan(root=tmp_path, out=tmp_path / "r", uri="sqlite:///x.db", pick_rule=rule, margin=margin,
                        past_divergence=past)
    step, ckpt, end = isolate.Pipeline(plan).pick(job, rec)
    assert (step, end) == want and ckpt.name == f"step_{want[0]}.pt"


def test_a_baseline_that_did_not_diverge_is_said_in_the_pipelines_words(tmp_path):
    """It stopped with fork pick's 'no divergence step in result.json ...; give --before STEP' (no such flag here)."""
    job, rec = _baseline_with_checkpoints(tmp_path, [100, 200], None, None, 200)
    plan = isolate.Plan(root=tmp_path, out=tmp_path / "r", uri="sqlite:///x.db")
    with pytest.raises(isolate.PipelineError) as e:
        isolate.Pipeline(plan).pick(job, rec)
    assert "did not diverge in its 200 steps: there is no divergence to isolate" in str(e.value)
    assert "--before" not in str(e.value)


def test_fork_overrides_reach_forks_only_and_are_checked_before_the_baseline(tmp_path, monkeypatch, capsys,
                                                                             disk_is_not_the_question):
    seen = []
    monkeypatch.setattr(isolate.Pipeline, "_run_py", lambda self, ov, log=None, gpu=None: seen.append(list(ov)) or 0)
    plan = isolate.Plan(root=tmp_path, out=tmp_path / "r", uri="sqlite:///x.db", sweeps=("paper_1gpu_numerics",),
                        fork_overrides=["attention.fp32_gemm=tf32x3"], keep_checkpoints=3)
    with pytest.raises(isolate.PipelineError):
        isolate.Pipeline(plan).baseline()
    assert "train.keep_checkpoints=3" in seen[0] and "attention.fp32_gemm=tf32x3" not in seen[0]
    seen.clear()
    isolate.Pipeline(plan).forks(tmp_path / "ck.pt", 20, [])
    assert len(seen) == 2 and all("attention.fp32_gemm=tf32x3" in ov and "train.max_steps=20" in ov for ov in seen)
    # a bad value in a fork override is refused by the preflight, naming the job, before any run starts
    plan = isolate.Plan(root=tmp_path, out=tmp_path / "r", uri="sqlite:///x.db", experiment="paper_1gpu",
                        overrides=CPU, sweeps=("paper_1gpu_numerics",), fork_overrides=["attention.fp32_gemm=fast"])
    with pytest.raises(isolate.PipelineError, match=r"paper_1gpu_numerics-0 .*attention.fp32_gemm='fast' is not "
                                                    r"allowed: expected one of ieee, tf32x3"):
        isolate.preflight_configs(plan)
    with pytest.raises(SystemExit):
        isolate.main(["--fork-override", "nokey"])
    assert "--fork-override='nokey' is not allowed: expected KEY=VALUE" in capsys.readouterr().err


def test_memory_gate_waits_for_free_memory(tmp_path, monkeypatch):
    free = iter([3.0, 10.0, 30.0])
    monkeypatch.setattr(isolate, "gpu_free_gib", lambda gpu: next(free))
    monkeypatch.setattr(isolate.time, "sleep", lambda s: None)
    pipe = isolate.Pipeline(isolate.Plan(root=tmp_path, out=tmp_path, uri="sqlite:///x.db", fork_memory_gib=26))
    pipe.wait_for_memory("0", "job")
    with pytest.raises(StopIteration):
        next(free)  # asked until 30 >= 26, then started
    monkeypatch.setattr(isolate, "gpu_free_gib", lambda gpu: None)  # no nvidia-smi: no wait
    pipe.wait_for_memory("0", "job")


def test_preflight_checks_the_runs_as_launched():
    """The lease's plan (20K-step baseline keeping 3 checkpoints, stopped 20 steps after its divergence; forks with
    no periodic checkpoints) passes the preflight: it checks each run with the overrides the run gets. Without them
    the baseline would keep all ~80 checkpoints (~121 GB) and be refused, as it was once on a lent GPU."""
    plan = isolate.Plan(root=Path("/tmp/x"), out=Path("/tmp/x/r"), uri="sqlite:////tmp/x.db", experiment="paper_1gpu",
                        overrides=[*CPU, "train.max_steps=20000"], keep_checkpoints=3, stop_after=20,
                        sweeps=("paper_isolation", "paper_1gpu_numerics", "paper_1gpu_mechanism", "beta_sweep"),
                        fork_overrides=["attention.fp32_gemm=tf32x3"])
    assert isolate.preflight_configs(plan) == 1 + 11 + 2 + 1 + 4
    assert "train.keep_checkpoints=3" in isolate.baseline_overrides(plan)
    plan.keep_checkpoints = 0
    with pytest.raises(isolate.PipelineError, match=r"baseline .*the run would write ~1\d\d GB"):
        isolate.preflight_configs(plan)


def test_lease_wrapper_runs_start_wait_collect_in_one_call(tmp_path):
    """`gpu.sh paper-table run` (what a short lease calls once): the plan starts, `wait` returns once it ends, and
    `collect` packs the table, the logs and the MLflow export into $OUT in the same call, before its budget. Tiny, on
    the CPU: seed 1's baseline NaN at step 8, the FP32 reference forked from step 6 past the baseline's end."""
    import tarfile
    out, r_dir = tmp_path / "out", tmp_path / "lease"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES",)}
    env.update(R=str(r_dir), OUT=str(out), SEED="1", BENCH="0", TESTS="0", CAPTURES="0", CKPT_START="0",
               MAX_STEPS="14", STOP_AFTER="2", MARGIN="2", PAST_DIVERGENCE="6", FORK_MEMORY="", KEEP_CHECKPOINTS="0",
               CONTROL_SWEEPS="paper_1gpu_fp32", ISOLATION_SWEEPS="", OMP_NUM_THREADS="1",
               FORK_OVERRIDES="attention.fp32_gemm=tf32x3 debug.nan_at_step=null",
               OVERRIDES=" ".join(t for t in TINY if not t.startswith("train.max_steps")))
    r = subprocess.run(["bash", "scripts/gpu.sh", "paper-table", "run", "400"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "[paper-table] plan ended" in r.stdout and "run took" in r.stdout, r.stdout[-2000:]
    assert (out / "mlflow-seed1.json.gz").is_file() and (out / "paper-logs.tar.xz").is_file()
    with tarfile.open(out / "paper-reports.tar.xz") as tar:
        doc = json.load(tar.extractfile("./seed1/report/verdicts.json"))
    rows = {row["job"]: row for row in doc["runs"]}
    assert rows["baseline"]["observed"] == "diverged" and rows["baseline"]["divergence_step"] == 8
    assert rows["forks/paper_1gpu_fp32-0"]["intervention"] == "fp32", rows
    assert rows["forks/paper_1gpu_fp32-0"]["observed"] == "stable", rows


@pytest.mark.parametrize("env,needle", [
    (dict(RACE="yes"), "RACE=yes is not allowed: expected 0 or 1"),
    (dict(SEEDS="2 1337", OVERRIDES_7="train.ckpt_start=0"),
     'OVERRIDES_7 is set, but seed 7 is not in SEEDS="2 1337"'),
])
def test_plan_refuses_a_bad_race_or_a_seeds_overrides_for_no_seed(tmp_path, env, needle):
    r = subprocess.run(["bash", "scripts/paper_1gpu.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, ROOT=str(tmp_path / "plan"), **env))
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / "plan").exists() and r.stdout == ""  # nothing made, nothing started
