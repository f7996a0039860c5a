"""`scripts/gpu.sh patch-tests` on a CPU: a branch's tests run in a copy with its patch applied, beside this tree's,
and a patch that does not apply stops it with the reason (on a CPU the gpu-marked tests skip; the GPU run is the
lease's)."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

NEW_TEST = '''import pytest


@pytest.mark.gpu
def test_only_the_patched_copy_has_me():
    assert True
'''


def _patch(path: Path, body: str) -> Path:
    lines = body.splitlines()
    path.write_text("diff --git a/tests/unit/test_zz_patched.py b/tests/unit/test_zz_patched.py\nnew file mode 100644\n"
                    "--- /dev/null\n+++ b/tests/unit/test_zz_patched.py\n"
                    f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{x}\n" for x in lines))
    return path


def _run(tmp_path, patch, *tests):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATCHED=str(tmp_path / "patched"), WORKERS="1")
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "patch-tests", str(patch), *tests], env=env,
                          capture_output=True, text=True, timeout=600)


def test_patch_tests_runs_the_branch_tests_in_a_patched_copy(tmp_path):
    tests = ("tests/unit/test_zz_patched.py", "tests/unit/test_knobs.py")  # test_knobs has no gpu test: not a failure
    p = _run(tmp_path, _patch(tmp_path / "ok.patch", NEW_TEST), *tests)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "patched" / "tests" / "unit" / "test_zz_patched.py").read_text() == NEW_TEST
    assert not (ROOT / "tests" / "unit" / "test_zz_patched.py").exists()  # this tree is left alone
    logs = tmp_path / "out" / "patch-tests"
    # this tree runs what it has (the new file is the patch's), the copy runs both
    assert "test_zz_patched" not in p.stdout.split("[patch-tests] patched copy")[0].split("this tree:")[1]
    assert "no tests ran" in (logs / "pytest_here.log").read_text()
    assert "test_zz_patched.py" in (logs / "pytest_patched.log").read_text()
    assert "[patch-tests] exit 0" in p.stdout


def test_a_patch_that_does_not_apply_stops_with_the_reason(tmp_path):
    bad = tmp_path / "bad.patch"
    bad.write_text("--- a/run.py\n+++ b/run.py\n@@ -1,1 +1,1 @@\n-this line is not in run.py\n+nor this\n")
    p = _run(tmp_path, bad, "tests/unit/test_knobs.py")
    assert p.returncode != 0 and "does not apply here" in p.stderr
    p = _run(tmp_path, tmp_path / "missing.patch")
    assert p.returncode != 0 and "no patch file" in p.stderr


def test_skip_here_runs_only_the_patched_copy(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATCHED=str(tmp_path / "patched"), WORKERS="1", SKIP_HERE="1")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "patch-tests",
                        str(_patch(tmp_path / "ok.patch", NEW_TEST)), "tests/unit/test_zz_patched.py",
                        "tests/unit/test_knobs.py"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "this tree's tests skipped (SKIP_HERE=1" in p.stdout
    logs = tmp_path / "out" / "patch-tests"
    assert not (logs / "pytest_here.log").exists() and "test_zz_patched.py" in (logs / "pytest_patched.log").read_text()
