"""Shared test setup: the repo on sys.path, GPU tests skipped on a CPU, and the grouping that lets the suite run
under pytest-xdist (`-n 2 --dist loadgroup`, the README's test command) without any test file knowing about it.

Grouping: every test without an explicit `xdist_group` is grouped by its file (its path under tests/), so a file's
module-scoped fixtures (a smoke sweep, an MLflow server, a SLURM sweep) are set up once, on one worker, as in a serial
run. Tests that must share one service across files say so: everything marked `slurm` or using the local SLURM cluster
shares the group "slurm" (one sweep on the one-node cluster at a time: its tests count the cluster's jobs and CPUs). A
new test file needs nothing: it runs on one worker, its own temporary folders (tmp_path is per worker) and free ports.
"""
import os
import sys

# One intra-op thread per process, set before torch starts its thread pool and inherited by every subprocess (run.py
# jobs, scripts, CLIs). The suite runs two xdist workers on two cores, and often several jobs at once per worker
# (isolate's forks, paper_1gpu's seeds, multirun launchers): with torch's default of one thread per core, N jobs
# oversubscribe the cores N-fold and spin in OpenMP barriers (three concurrent smoke jobs: 38 s wall, 75 s CPU with
# 2 threads each; 27 s, 52 s with 1). The tiny models gain nothing from a second thread. A value given is kept.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# The MLflow servers the tests start (scripts/mlflow_server.sh, `mlflow ui` as printed) track and serve artifacts and
# the UI; nothing here submits MLflow server jobs (GenAI judges, trace rollups). With job execution on (MLflow 3's
# default) each server also starts a job runner of seven huey consumers that import MLflow and then poll: ~20
# CPU-seconds at start and ~0.8 of a core for as long as the server lives (the dashboard, dashboard views and shared
# server files: 220 CPU-seconds with it, 133 without). A value given is kept.
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

if os.environ.get("TRITON_INTERPRET") == "1":  # the child pytests of the interpreter checks (tests/unit)
    from tests.helpers.triton_interp import skip_nested_lang_patches
    skip_nested_lang_patches()  # a fifth of their time: see its module

SLURM_GROUP = "slurm"
# files that submit to the local cluster (not all of their tests carry the mark)
SLURM_FILES = ("integration/test_slurm.py",)
TESTS = os.path.join(ROOT, "tests")


def _group(item) -> str:
    path = os.path.relpath(str(item.path), TESTS)  # by path: unit/test_x.py and integration/test_x.py are two groups
    if item.get_closest_marker("slurm") is not None or path in SLURM_FILES:
        return SLURM_GROUP
    return path


# The groups that take longest (CI, 2 cores: seconds of one worker), handed out first: xdist gives each worker the
# next group in collection order, so a long group collected last would run alone at the end while the other worker
# idles. Measured with `--durations`; a group not listed keeps its place after these.
# The unit files with a child interpreter pytest (~70-110 s each) are listed too: unlisted, they were collected last
# (unit/ after integration/) and one of them could run alone at the end.
HEAVY_FIRST = ("isolation_script", "integration/test_faults.py", SLURM_GROUP, "integration/test_paper_1gpu.py",
               "integration/test_multirun.py", "unit/test_triton.py", "integration/test_gpu_sh_patch_tests.py",
               "unit/test_triton_stabilizers.py", "integration/test_first_steps.py", "unit/test_ops.py",
               "integration/test_dashboard.py", "integration/test_record.py",
               "integration/test_train_loop.py", "integration/test_ddp.py", "integration/test_isolation_pipeline.py",
               "integration/test_resume.py", "integration/test_fork.py")


def _group_of(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", ""))


def pytest_configure(config):
    # xdist's loadgroup hands out groups by their number of tests unless told not to; HEAVY_FIRST's order needs
    # the collection order (the same as `--no-loadscope-reorder`, kept out of the README's command)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into node-id suffixes
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    rank = {g: i for i, g in enumerate(HEAVY_FIRST)}
    items[:] = sorted(items, key=lambda it: rank.get(_group_of(it), len(rank)))  # stable: a file's order is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def inductor_casts():
    """Set torch._inductor.config.emulate_precision_casts in a test (call it with the value); restored afterwards by
    assignment. Not monkeypatch.setattr: pytest 9.2 reads the old value from the module's __dict__, where inductor's
    config module keeps none, and its undo then deletes the setting for the rest of the session."""
    import torch._inductor.config as inductor
    before = inductor.emulate_precision_casts

    def set_(value: bool) -> None:
        inductor.emulate_precision_casts = value
    yield set_
    inductor.emulate_precision_casts = before
