"""`scripts/gpu.sh queue` on a CPU: tasks run one after another in the background from a copy of the tree, each with
its own environment and output folder; a failing task is said and the next one runs; `wait` brings back what
finished; an item that names no task is refused before anything starts."""
import os
import subprocess
import tarfile
from pathlib import Path

from tests.integration.test_gpu_sh_patch_tests import NEW_TEST, _patch

ROOT = Path(__file__).resolve().parents[2]


def _q(tmp_path, *args, timeout=600):
    env = dict(os.environ, Q=str(tmp_path / "q"), OUT=str(tmp_path / "out"))
    (tmp_path / "out").mkdir(exist_ok=True)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "queue", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_queue_runs_tasks_in_turn_says_failures_and_collects(tmp_path):
    patch = _patch(tmp_path / "ok.patch", NEW_TEST)
    # a task that fails at once (no such patch), then patch-tests of the patched copy only (SKIP_HERE=1; BITS=0:
    # the kernel bits are a GPU step, tested in test_gpu_sh_patch_tests.py)
    p = _q(tmp_path, "start", f"patch-tests {tmp_path / 'missing.patch'}",
           f"SKIP_HERE=1 BITS=0 WORKERS=1 PATCHED='{tmp_path / 'patched dir'}' patch-tests {patch} "
           "tests/unit/test_zz_patched.py tests/unit/test_knobs.py")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[queue] started 2 tasks" in p.stdout
    p = _q(tmp_path, "wait", "500")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[queue] ended" in p.stdout and "queue ended at" in p.stdout
    assert "1-patch-tests: exit 1 after" in p.stdout  # it failed, and the queue went on
    assert "2-patch-tests: exit 0 after" in p.stdout
    # the item's own environment, a quoted value with its space
    assert (tmp_path / "patched dir" / "tests" / "unit" / "test_zz_patched.py").is_file()
    with tarfile.open(tmp_path / "out" / "queue-out.tar.xz") as t:
        names = t.getnames()
    assert "out/2-patch-tests/patch-tests/pytest_patched.log" in names and "out/1-patch-tests.log" in names
    assert "out/2-patch-tests/patch-tests/pytest_here.log" not in names  # SKIP_HERE: this tree's tests not run
    assert "this tree's tests skipped (SKIP_HERE=1" in (tmp_path / "q" / "out" / "2-patch-tests.log").read_text()
    assert "status" in names
    assert not (ROOT / "tests" / "unit" / "test_zz_patched.py").exists()
    # each item's $OUT is made before it runs, as a lent machine's is: paper-table start copies into it unmade
    assert (tmp_path / "q" / "out" / "1-patch-tests").is_dir()


def test_queue_refuses_an_item_without_a_task_and_a_wait_without_a_queue(tmp_path):
    p = _q(tmp_path, "start", "tests", "SPEED_PARTS=host nonsense")
    assert p.returncode != 0 and "queue item 'SPEED_PARTS=host nonsense': no gpu.sh task in it" in p.stderr
    assert not (tmp_path / "q").exists()  # nothing started
    p = _q(tmp_path, "start", "queue wait")
    assert p.returncode != 0 and "no gpu.sh task" in p.stderr
    p = _q(tmp_path, "start", "check", "stop")  # it would end the queue that runs it
    assert p.returncode != 0 and "no gpu.sh task" in p.stderr
    p = _q(tmp_path, "start", "X='unbalanced tests")
    assert p.returncode != 0 and "not shell words" in p.stderr
    p = _q(tmp_path, "wait", "1")
    assert p.returncode != 0 and "no queue in" in p.stderr


def test_queue_refuses_odd_items_and_a_folder_in_the_tree(tmp_path):
    for item, needle in (("nonsense $(touch f)", "no $( ), backticks or newlines"),
                         ("check\ncheck", "no $( ), backticks or newlines"),
                         ("chec.", "no gpu.sh task in it")):  # a task name is matched exactly, not as a pattern
        p = _q(tmp_path, "start", item)
        assert p.returncode != 0 and needle in p.stderr, (item, p.stderr)
    assert not (ROOT / "f").exists() and not (tmp_path / "q").exists()
    env = dict(os.environ, Q=str(ROOT / "results" / "q_here"), OUT=str(tmp_path / "out"))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "queue", "start", "check"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "is inside the tree it copies" in p.stderr
    assert not (ROOT / "results" / "q_here").exists()


def test_queue_says_a_dead_runner_keeps_the_last_queue_and_names_what_stays(tmp_path):
    p = _q(tmp_path, "start", "FOO='a|b&c' check", "check")  # | and & in a value: the status stays readable
    assert p.returncode == 0, p.stderr
    pid = int((tmp_path / "q" / "queue.pid").read_text())
    os.killpg(pid, 9)  # as when a machine ends its processes
    p = _q(tmp_path, "wait", "30")
    assert p.returncode == 1 and "[queue] the runner DIED: 1 task interrupted, 1 never started" in p.stdout, p.stdout
    assert "1-check: started" in p.stdout and "(FOO='a|b&c' check)" in p.stdout
    (tmp_path / "q" / "out" / "big.bin").write_bytes(b"\0" * (13 * 2**20))
    p = _q(tmp_path, "collect")
    assert "left on the machine (12 MB or more, or a checkpoint): out/big.bin" in p.stdout, p.stdout
    p = _q(tmp_path, "start", "check")
    assert p.returncode == 0 and "moved to" in p.stdout and (tmp_path / "q.prev" / "out" / "big.bin").exists()
    os.killpg(int((tmp_path / "q" / "queue.pid").read_text()), 9)  # nothing more to see: not left running


def test_stop_ends_a_plan_with_the_runs_it_started_and_leaves_the_rest(tmp_path):
    """`gpu.sh stop`: a plan (its own process group, as paper-table starts it) ends with the run it started; a pid
    file of a process that is gone, or of none, is passed over; no queue or plan running is said."""
    import time
    paper, scratch = tmp_path / "paper", tmp_path / "scratch"
    paper.mkdir()
    scratch.mkdir()
    (scratch / "plan.pid").write_text("999999999")  # no such process
    plan = subprocess.Popen(["setsid", "bash", "-c", f"sleep 300 & echo $! > {tmp_path / 'run.pid'}; wait"])
    for _ in range(50):
        if (tmp_path / "run.pid").is_file() and (tmp_path / "run.pid").read_text().strip():
            break
        time.sleep(0.1)
    (paper / "plan.pid").write_text(str(plan.pid))
    run_pid = int((tmp_path / "run.pid").read_text())
    env = dict(os.environ, Q=str(tmp_path / "q"), ROUND_R=str(tmp_path / "round"), PAPER_R=str(paper),
               SCRATCH_R=str(scratch), PATH="/usr/bin:/bin")  # no nvidia-smi: the GPU lines are left out
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "stop"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"[stop] ended {paper / 'plan.pid'} (pid {plan.pid}" in p.stdout and "999999999" not in p.stdout
    assert plan.wait(timeout=10) is not None
    for _ in range(50):  # the run it started went with its group
        try:
            os.kill(run_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the plan's run {run_pid} is still alive")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "stop"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "nothing of a queue or plan was running" in p.stdout


def _bounded(tmp_path, secs, *cmd):
    """gpu.sh's `bounded` alone (its definition read from the script, so the test runs the shipped function)."""
    src = (ROOT / "scripts" / "gpu.sh").read_text()
    body = src[src.index("bounded() {"):]
    body = body[:body.index("\n}\n") + 3]
    log = tmp_path / "b.log"
    p = subprocess.run(["bash", "-c", body + f'bounded {secs} "$0" "$@"', str(log), *cmd], capture_output=True,
                       text=True, timeout=60)
    return p.returncode, log.read_text()


def test_a_benchmark_killed_by_its_limit_says_so_in_its_log(tmp_path):
    """probes was killed by `timeout 90` mid-progress-bar on 2026-12-06 and its log ended there, saying nothing."""
    rc, log = _bounded(tmp_path, 1, "bash", "-c", "echo started; sleep 20")
    assert rc == 124 and log.startswith("started") and "[gpu.sh] stopped by its 1 s limit (timeout 1)" in log
    rc, log = _bounded(tmp_path, 10, "bash", "-c", "echo done; exit 3")
    assert rc == 3 and log == "done\n"  # its own failure: its rc, nothing added
