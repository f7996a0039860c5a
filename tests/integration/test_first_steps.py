"""scripts/first_steps.py: the paper regime's first losses, against those recorded per GPU and commit."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import first_steps as fs  # noqa: E402

TINY = ["model=tiny", "data=default", "train.device=cpu", "train.precision=fp32", "train.batch_size=2",
        "monitor.probes.enabled=false"]


def _run(name, first, losses):
    return {"name": name, "metrics": {fs.LOSS: [[first + i, v, 0] for i, v in enumerate(losses)]}}


def test_the_run_from_step_0_is_read_and_compared_step_by_step():
    runs = [_run("baseline seed=1", 0, [10.5, 10.25, None]), _run("baseline fork@2000", 2000, [3.0]),
            _run("fp32", 0, [9.0])]
    got = fs.losses_of(runs, "baseline")
    assert got[:2] == [10.5, 10.25] and got[2] != got[2]  # the export's null is NaN
    assert fs.losses_of(runs, "baseline", steps=2) == [10.5, 10.25]
    with pytest.raises(SystemExit, match="found 2"):
        fs.losses_of(runs + [_run("baseline again", 0, [1.0])], "baseline")
    with pytest.raises(SystemExit, match="has no step 1"):
        fs.losses_of([{"name": "b", "metrics": {fs.LOSS: [[0, 1.0], [2, 1.0]]}}], "b")
    rec = {"gpu": "NVIDIA H200", "commit": "fa3c407", "losses": [10.5, 10.25, 10.0]}
    assert fs.compare([10.5, 10.25], rec) == "bit for bit as NVIDIA H200 fa3c407 at steps 0-1"
    assert fs.compare([10.5, 10.250000000000002], rec) == (
        "differs from NVIDIA H200 fa3c407 at step 1: 10.250000000000002 against 10.25")


def test_record_adds_and_replaces_by_gpu_commit_and_seed(tmp_path):
    export = tmp_path / "e.json.gz"
    with gzip.open(export, "wt") as f:
        json.dump({"runs": [_run("baseline x", 0, [10.0 + i for i in range(12)]), _run("baseline f", 50, [1.0])]}, f)
    ref = tmp_path / "ref.json"
    args = ["record", str(export), "--gpu", "G", "--commit", "c1", "--source", "e", "--ref", str(ref)]
    assert fs.main(args) == 0 and fs.main(args + ["--steps", "3"]) == 0  # the same key: replaced, not doubled
    assert fs.main(args[:5] + ["c2"] + args[6:]) == 0
    recs = json.loads(ref.read_text())["records"]
    assert [(r["commit"], r["seed"], len(r["losses"])) for r in recs] == [("c1", 1, 3), ("c2", 1, 10)]


def test_run_trains_the_first_steps_and_names_the_record_it_repeats(tmp_path, capsys):
    """A tiny CPU stand-in for the GPT-2S preset (overrides after --): the run stops after its first 2 steps (a NaN
    forced at step 2) and each record of its seed is named: the same bits, or the step where they part."""
    out = tmp_path / "fs"
    assert fs.main(["run", "--steps", "2", "--out", str(out), "--ref", str(tmp_path / "none.json"), "--", *TINY]) == 0
    doc = json.loads((out / "first_steps.json").read_text())
    losses = doc["losses"]
    assert len(losses) == 2 and all(x == x for x in losses) and doc["gpu"] == "cpu"
    assert "debug.nan_at_step=2" in doc["command"] and "no record of seed 1" in capsys.readouterr().out
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"records": [
        {"gpu": "same", "commit": "a", "seed": 1, "losses": losses + [1.0]},
        {"gpu": "other", "commit": "b", "seed": 1, "losses": [losses[0], losses[1] + 1e-6]},
        {"gpu": "seed2", "commit": "c", "seed": 2, "losses": losses}]}))
    assert fs.main(["run", "--steps", "2", "--out", str(out), "--ref", str(ref), "--", *TINY]) == 0
    assert "replacing the earlier" in capsys.readouterr().out  # the same --out: a fresh run, not a resumed one
    doc = json.loads((out / "first_steps.json").read_text())
    assert doc["losses"] == losses  # the same machine repeats itself bit for bit
    assert doc["against"][0] == "bit for bit as same a at steps 0-1"
    assert doc["against"][1].startswith("differs from other b at step 1") and len(doc["against"]) == 2
    # check: the same comparison read from a run's store (gpu.sh paper-table, while its baseline trains)
    capsys.readouterr()
    store = f"sqlite:///{out / 'mlflow.db'}"
    assert fs.main(["check", store, "--run-prefix", "", "--steps", "2", "--ref", str(ref)]) == 0
    said = capsys.readouterr().out
    assert "bit for bit as same a at steps 0-1" in said and "differs from other b at step 1" in said
    assert fs.main(["check", store, "--run-prefix", "", "--steps", "500", "--ref", str(ref)]) == 2
    assert "of 500 steps logged so far" in capsys.readouterr().out
    assert fs.main(["check", store, "--run-prefix", "nothing", "--ref", str(ref)]) == 2  # no such run yet


def test_a_failed_run_says_why(tmp_path):
    with pytest.raises(SystemExit, match="the run failed"):
        fs.main(["run", "--steps", "2", "--out", str(tmp_path / "x"), "--", *TINY, "train.batch_size=-1"])


def test_gpu_sh_first_steps_passes_its_overrides_to_the_run(tmp_path):
    """`gpu.sh first-steps OVERRIDES...` (how a lease asks whether train.compile=true keeps the preset's bits): the
    overrides reach run.py, after the preset's."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), STEPS="2", SEEDS="2", PYTHONPATH=str(ROOT))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "first-steps", *TINY, "model.n_embd=32"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads((tmp_path / "out" / "first-steps" / "seed2" / "first_steps.json").read_text())
    assert doc["command"].endswith(" ".join([*TINY, "model.n_embd=32"])) and len(doc["losses"]) == 2, doc
    assert "train.seed=2" in doc["command"]


def test_known_says_per_seed_where_it_diverged_on_this_gpu_model(tmp_path, capsys):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"records": [
        {"gpu": "G1", "commit": "a", "seed": 1, "divergence": 2288, "losses": [1.0]},
        {"gpu": "G1", "commit": "b", "seed": 1, "divergence": None, "note": "stopped at step 1,869", "losses": [1.0]},
        {"gpu": "G2", "commit": "c", "seed": 1, "divergence": None, "note": "not diverged by 7,610", "losses": [2.0]},
        {"gpu": "G2", "commit": "c", "seed": 1337, "divergence": 8064, "losses": [3.0]}]}))
    assert fs.known("G1", ref) == ["seed 1: diverged at step 2,288 (a, b)"]
    assert fs.known("G2", ref) == ["seed 1: no divergence recorded (not diverged by 7,610; c)",
                                   "seed 1337: diverged at step 8,064 (c)"]
    assert fs.known("G3", ref)[0].startswith("no paper_1gpu run is recorded on G3")
    assert fs.main(["known", "--gpu", "G2", "--ref", str(ref)]) == 0
    assert "seed 1337: diverged at step 8,064" in capsys.readouterr().out


def test_ckpt_start_is_a_lead_before_the_earliest_divergence_recorded_on_this_gpu_model(tmp_path, capsys):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"records": [
        {"gpu": "G2", "commit": "a", "seed": 1337, "divergence": 8064, "losses": [3.0]},
        {"gpu": "G2", "commit": "b", "seed": 1337, "divergence": 8190, "losses": [3.0]},  # the earlier one wins
        {"gpu": "G2", "commit": "a", "seed": 1, "divergence": None, "note": "not diverged by 7,610", "losses": [2.0]},
        {"gpu": "G2", "commit": "a", "seed": 2, "divergence": 700, "losses": [2.0]},
        {"gpu": "G1", "commit": "c", "seed": 1337, "divergence": 9697, "losses": [3.0]}]}))
    assert fs.ckpt_start("G1", [1337], ref)[0] == 8500  # the H200's: 9,697 - 1,000, down to a multiple of 250
    step, why = fs.ckpt_start("G2", [1337], ref)
    assert step == 7000 and "seed 1337 diverged at step 8,064 on G2" in why[0], why  # a fixed 8,500 had no fork
    assert fs.ckpt_start("G2", [1337], ref, lead=0, every=500)[0] == 8000
    assert fs.ckpt_start("G2", [2], ref)[0] == 0  # diverged within the lead: from step 0
    step, why = fs.ckpt_start("G2", [1337, 1], ref)  # seed 1's divergence here is unknown: every checkpoint
    assert step == 0 and "seed 1: no divergence recorded on G2" in why[1], why
    assert fs.ckpt_start("G3", [1337], ref)[0] == 0
    assert fs.main(["ckpt-start", "--gpu", "G2", "--seeds", "1337", "--ref", str(ref)]) == 0
    out = capsys.readouterr()
    assert out.out == "7000\n" and "checkpoints from 7,000" in out.err  # the number alone on stdout
    for bad, msg in ((["--seeds", "1337 x"], "--seeds '1337 x' is not allowed"),
                     (["--every", "0"], "--every 0 is not allowed")):
        with pytest.raises(SystemExit, match=msg):
            fs.main(["ckpt-start", "--ref", str(ref), *bad])


def test_gpu_sh_baseline_time_keeps_checkpoints_from_this_gpu_models_step(tmp_path):
    """gpu.sh baseline-time (and paper-table, through the same function) on a GPU model whose records know seed
    1337's divergence: train.ckpt_start 1,000 steps before it; a bad CKPT_START is refused before anything runs."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")  # the GPU model the run sees
    (fake / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CKPT_START", "SEED", "STEP")}
    env.update(PATH=f"{fake}:{env['PATH']}", BT_R=str(tmp_path / "r"), OUT=str(tmp_path / "out"))
    gpu_sh = ["bash", str(ROOT / "scripts" / "gpu.sh"), "baseline-time"]
    p = subprocess.run(gpu_sh, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    # the records: seed 1337 diverged at 8,064 on an H100 (the run itself then stops here: no CUDA on this machine)
    assert "[baseline-time] train.ckpt_start=7000\n" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    p = subprocess.run(gpu_sh, cwd=ROOT, env={**env, "CKPT_START": "8,500"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1 and "CKPT_START=8,500 is not allowed: expected an integer >= 0" in p.stderr, p.stderr
    assert "[baseline-time]" not in p.stdout  # refused before the run
