"""scripts/lease_aside.sh: the committed results a GPU task never reads wait outside the tree during a lease (what
travels is capped at 64 MiB), results/bench/ stays, and `back` puts them back without overwriting anything."""
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _repo(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "lease_aside.sh", repo / "scripts" / "lease_aside.sh")
    for f, text in (("results/paper/plot.png", "png"), ("results/paper/deep/export.json", "{}"),
                    ("results/bench/kernel-bits-h100.json", "bits"), ("code.py", "x = 1")):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text(text)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True, env=env)
    (repo / "results" / "new.txt").write_text("written during the lease, untracked")
    return repo


def _sh(repo, *args, aside):
    return subprocess.run(["bash", str(repo / "scripts" / "lease_aside.sh"), *args], capture_output=True, text=True,
                          env=dict(os.environ, ASIDE=str(aside)), timeout=60)


def test_out_moves_committed_results_but_bench_and_back_restores(tmp_path):
    repo, aside = _repo(tmp_path), tmp_path / "aside"
    p = _sh(repo, "size", aside=aside)
    assert p.returncode == 0 and "MiB of 64" in p.stdout, p.stderr
    p = _sh(repo, "out", aside=aside)
    assert p.returncode == 0 and "2 committed result files moved" in p.stdout, p.stderr
    assert not (repo / "results" / "paper" / "plot.png").exists()
    assert (aside / "results" / "paper" / "deep" / "export.json").read_text() == "{}"
    assert (repo / "results" / "bench" / "kernel-bits-h100.json").is_file()  # gpu.sh bits reads it
    assert (repo / "results" / "new.txt").is_file() and (repo / "code.py").is_file()
    p = _sh(repo, "out", aside=aside)  # a second 'out' would mix two sets: refused
    assert p.returncode != 0 and "exists" in p.stderr
    p = _sh(repo, "back", aside=aside)
    assert p.returncode == 0 and "2 files put back" in p.stdout, p.stderr
    assert (repo / "results" / "paper" / "plot.png").read_text() == "png" and not aside.exists()
    assert subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True,
                          text=True).stdout.strip() == "?? results/new.txt"


def test_back_never_overwrites_and_refusals(tmp_path):
    repo, aside = _repo(tmp_path), tmp_path / "aside"
    assert _sh(repo, "out", aside=aside).returncode == 0
    (repo / "results" / "paper").mkdir(parents=True, exist_ok=True)
    (repo / "results" / "paper" / "plot.png").write_text("new")  # written at the same path meanwhile
    p = _sh(repo, "back", aside=aside)
    assert p.returncode != 0 and "results/paper/plot.png was written meanwhile: kept" in p.stderr
    assert (repo / "results" / "paper" / "plot.png").read_text() == "new"
    assert (aside / "results" / "paper" / "plot.png").read_text() == "png"  # nothing lost
    assert (repo / "results" / "paper" / "deep" / "export.json").is_file()  # the rest went back
    p = _sh(repo, "out", aside=repo / "results" / "x")
    assert p.returncode != 0 and "inside the tree" in p.stderr
    p = _sh(repo, "back", aside=tmp_path / "none")
    assert p.returncode != 0 and "nothing set aside" in p.stderr
    p = _sh(repo, "nonsense", aside=aside)
    assert p.returncode != 0 and "usage" in p.stderr
