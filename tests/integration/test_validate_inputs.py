"""Inputs checked before anything starts: text-file corpora that are empty, binary or not UTF-8, and a run too big
for the disk (10^12 steps), each named in one ConfigError; a sweep with one is refused before its first job."""
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import flash_forensics.orchestrator.config.schema  # noqa: F401
from flash_forensics.orchestrator.config.budget import estimate
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[2]


def check(tmp_path, *overrides):
    ov = ["experiment=smoke", f"tracking.uri=sqlite:///{tmp_path}/m.db", f"results_dir={tmp_path}/results",
          *overrides]
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=ov)
    GlobalHydra.instance().clear()
    return validate_config(cfg, ov, check_store=False)


@pytest.mark.parametrize("content, needle", [
    (b"", "is empty"),
    (b"   \n\n  \t\n", "holds no text"),
    (b"some text\x00\x01\x02binary", "is a binary file"),
    ("caf\u00e9 cr\u00e8me\n".encode("latin-1"), "is not UTF-8 text"),
])
def test_bad_text_files_are_refused(tmp_path, content, needle):
    f = tmp_path / "corpus.txt"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match=needle) as e:
        check(tmp_path, "data.corpus=text_files", f"data.files=[{f}]")
    assert str(f) in str(e.value)


def test_good_text_file_passes(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("caf\u00e9 " * 1000, encoding="utf-8")
    check(tmp_path, "data.corpus=text_files", f"data.files=[{f}]")


def test_a_run_too_big_for_the_disk_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train.max_steps=1000000000000 is not allowed: the run would write ~"):
        check(tmp_path, "train.max_steps=1000000000000")
    obj, _ = check(tmp_path)
    est = estimate(obj)
    assert est["batch order"] == 20 * 2 * 4 * 8 and est["checkpoints"] > 0  # smoke: 20 steps of 2 x 4 sequences


def test_a_sweep_with_a_bad_file_starts_no_job(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"\xff\xfe\x00binary")
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "experiment=smoke", "intervention=baseline,fp32",
                           "data.corpus=text_files", f"data.files=[{f}]", f"results_dir={tmp_path}/results",
                           f"tracking.uri=sqlite:///{tmp_path}/m.db", "sweep_name=bad"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "is a binary file" in proc.stdout + proc.stderr
    assert not list((tmp_path / "results").rglob("result.json"))  # refused before any job


def test_a_results_dir_that_cannot_be_made_is_refused(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match=r"results_dir=.*is not allowed: .*a_file is a file, not a folder"):
        check(tmp_path, f"results_dir={tmp_path / 'a_file' / 'results'}")
    assert not list(tmp_path.glob("**/.ff-write-test-*"))
