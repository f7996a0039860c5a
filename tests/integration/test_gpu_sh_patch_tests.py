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


def _run(tmp_path, patch, *tests):  # BITS=0: the kernels' bits have their own test below
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATCHED=str(tmp_path / "patched"), WORKERS="1", BITS="0")
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



def _kernel_patch(path: Path) -> Path:
    """A patch to kernels/ that changes the backward's bits (its softmax scale by 1e-4), made against this tree's file
    so that it applies whatever else the file holds."""
    import difflib
    rel = "kernels/triton_launch.py"
    old = (ROOT / rel).read_text().splitlines(keepends=True)
    line = "    scale = 1.0 / math.sqrt(D)\n"
    assert old.count(line) == 1, "the backward's scale line moved: update this test"
    new = [x.replace("1.0 /", "1.0001 /") if x == line else x for x in old]
    path.write_text("".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}")))
    return path


def test_patch_tests_compares_the_kernels_bits_and_fails_on_a_change(tmp_path):
    """patch-tests records the kernels' outputs in this tree and in the patched copy (scripts/kernel_bits.py, here on
    Triton's interpreter) and fails when they differ: a patch that changes the backward's scale passes the selected
    tests but not the bits. It also proves each record came from its own tree (same trees would be identical)."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATCHED=str(tmp_path / "patched"), WORKERS="1",
               SKIP_HERE="1", BITS_DEVICE="cpu")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "patch-tests",
                        str(_kernel_patch(tmp_path / "k.patch")), "tests/unit/test_knobs.py"],
                       env=env, capture_output=True, text=True, timeout=600)
    logs = tmp_path / "out" / "patch-tests"
    bits = (logs / "kernel_bits.log").read_text() if (logs / "kernel_bits.log").exists() else "(no kernel_bits.log)"
    assert p.returncode == 1 and "[patch-tests] exit 1" in p.stdout, p.stdout + p.stderr + bits
    assert "no tests ran" in (logs / "pytest_patched.log").read_text()  # not a failure (5): the bits decided
    for case in ("paper_bf16", "fa2_sfa", "fp32_keypad"):  # the backward changed in every case, the forward in none
        row = next(x for x in bits.splitlines() if x.strip().startswith(f"{case}:"))
        assert "DIFFERENT" in row and "dq (" in row and "elements differ" in row and "o (" not in row, row
    assert "0 of 3 cases identical" in bits, bits
    assert (logs / "bits_here.json").is_file() and (logs / "bits_patched.json").is_file()
    assert not list(logs.glob("*.pt"))  # the outputs stay beside the copy: only the JSONs come back


def test_bits_task_compares_with_a_reference_and_exits_1_when_a_bit_moved(tmp_path):
    """`gpu.sh bits` (here BITS_DEVICE=cpu, the interpreter) records this tree and compares it with REF: a reference
    whose paper_bf16 O hash differs fails the task, names that output, and lists the cases REF lacks."""
    import json
    spec = next(c for c in _small_cases() if c[0] == "paper_bf16")
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"env": {"gpu": "cpu (Triton interpreter)"}, "cases": {"paper_bf16": {
        "knobs": spec[1], "shape": list(spec[2]), "layout": spec[3], "outputs": {"o": {"sha256": "0" * 64}}}}}))
    env = dict(os.environ, OUT=str(tmp_path / "out"), BITS_DEVICE="cpu", REF=str(ref))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "bits"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "paper_bf16: DIFFERENT: o (differs)" in p.stdout and "only in B (not compared): fa2_sfa, fp32_keypad" \
        in p.stdout, p.stdout
    rec = json.loads((tmp_path / "out" / "bits" / "kernel-bits-cpu.json").read_text())
    assert set(rec["cases"]) == {c[0] for c in _small_cases()}


def _small_cases():
    import importlib.util
    spec = importlib.util.spec_from_file_location("kernel_bits", ROOT / "scripts" / "kernel_bits.py")
    kb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kb)
    return kb.SMALL
