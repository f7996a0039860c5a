"""Installable beside other packages: the project's code imports as flash_forensics.* only (kernels/, models/,
orchestrator/ stay top-level folders), so the `kernels` package of transformers[kernels] and a user's own `models`
are never shadowed, from a checkout or from a wheel."""
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"flash_forensics": "flash_forensics", "flash_forensics.kernels": "kernels",
           "flash_forensics.models": "models", "flash_forensics.orchestrator": "orchestrator"}


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_package_list_matches_the_folders():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == FOLDERS
    found = set()
    for pkg, folder in FOLDERS.items():
        for init in [ROOT / folder, *(p.parent for p in (ROOT / folder).rglob("*.py"))]:
            rel = init.relative_to(ROOT / folder)
            found.add(".".join((pkg, *rel.parts)))
    assert set(cfg["packages"]) == found


def test_the_import_names_are_links_to_the_folders():
    for pkg, folder in FOLDERS.items():
        if pkg != "flash_forensics":
            link = ROOT / "flash_forensics" / pkg.split(".")[1]
            assert link.is_symlink() and os.readlink(link) == f"../{folder}", link
            assert link.resolve() == ROOT / folder


def test_a_static_reader_follows_the_import_names():
    """jedi (an editor's go-to-definition engine) given the checkout alone, no editable install and no import run:
    flash_forensics.kernels / .models / .orchestrator resolve to the top-level folders' files."""
    jedi = pytest.importorskip("jedi", reason="jedi is a dev dependency (pyproject [dev])")
    project = jedi.Project(str(ROOT), sys_path=[str(ROOT)], smart_sys_path=False, added_sys_path=[])
    for module, name, path in (("flash_forensics.kernels.emulator", "flash_attention", "kernels/emulator.py"),
                               ("flash_forensics.models.gpt", "GPT", "models/gpt.py"),
                               ("flash_forensics.orchestrator.launch.task", "run_job", "orchestrator/launch/task.py")):
        script = jedi.Script(f"from {module} import {name}\n{name}\n", path=str(ROOT / "x.py"), project=project)
        found = script.goto(2, 1, follow_imports=True)
        assert found and found[0].module_path.resolve() == ROOT / path, (module, found)


def test_no_top_level_package_of_ours_shadows_others():
    """kernels/, models/, orchestrator/ have no __init__.py: from the repo root `import kernels` is not ours."""
    for folder in ("kernels", "models", "orchestrator"):
        assert not (ROOT / folder / "__init__.py").exists(), folder


def _inside(path, folder) -> bool:
    """path lies in folder, compared as paths: a venv at <dir>/p-venv is not inside a checkout at <dir>/p."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def test_inside_compares_paths_not_prefixes(tmp_path):
    (tmp_path / "p").mkdir()
    venv = tmp_path / "p-venv" / "lib" / "site-packages" / "kernels" / "__init__.py"
    assert str(venv).startswith(str(tmp_path / "p"))  # what the string test took for "inside the checkout"
    assert not _inside(venv, tmp_path / "p") and _inside(tmp_path / "p" / "kernels" / "x.py", tmp_path / "p")


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _installed("kernels"),
                    reason="the `kernels` package (transformers[kernels]) is not installed; .ci/run installs it")
@pytest.mark.parametrize("where", ["repo root", "elsewhere"])
def test_beside_the_kernels_package(where, tmp_path):
    cwd = ROOT if where == "repo root" else tmp_path
    r = _python("import kernels, flash_forensics.kernels.emulator as e, flash_forensics.models.gpt as g\n"
                "print(kernels.__file__); print(e.__file__); print(g.__file__)", cwd)
    assert r.returncode == 0, r.stderr
    theirs, emulator, gpt = r.stdout.split()
    assert "site-packages" in theirs and not _inside(theirs, ROOT), theirs
    assert Path(emulator).resolve() == ROOT / "kernels" / "emulator.py"  # through flash_forensics/kernels -> ../kernels
    assert Path(gpt).resolve() == ROOT / "models" / "gpt.py"


def test_wheel_holds_everything_under_flash_forensics(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools builds in the source tree (build/, *.egg-info)
    src.mkdir()
    for name in ("pyproject.toml", "README.md", *FOLDERS.values()):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("flash_forensics-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"flash_forensics"}, tops
    for want in ("flash_forensics/kernels/emulator.py", "flash_forensics/models/gpt.py",
                 "flash_forensics/orchestrator/launch/task.py", "flash_forensics/cli.py"):
        assert want in names, want
