"""Child processes that a test starts and collects, and that never outlive it; a free port for what they serve."""
import multiprocessing as mp
import socket
import time
from typing import List

# What the forkserver imports once, before it forks: its children start with MLflow, the tracker and their targets
# (below, not in the test files, whose own imports are heavy) loaded, instead of each importing them (four or eight
# interpreters' worth of CPU on a 2-core machine). Only the test that starts this worker's forkserver applies it;
# every test names the same modules.
FORKSERVER_PRELOAD = ["mlflow.tracking", "flash_forensics.orchestrator.tracking.tracker", "tests.helpers.procs"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forkserver():
    """A context whose children fork from a fresh single-threaded server, never from this pytest worker: a fork of the
    worker copies locks its other threads hold (earlier tests' MLflow and metrics threads), and a child hung on one
    for good (a flock holder in a futex, the other three waiting on it; one of eight MLflow writers)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def gather(procs: List, queue, timeout: float) -> List:
    """Start procs, take one result each from queue (`timeout` seconds for each), join them; a child still alive
    after that is killed, so a hung one fails its test instead of keeping the worker from exiting."""
    for p in procs:
        p.start()
    try:
        got = [queue.get(timeout=timeout) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


# ------------------------------------------------------------------------------------------------ targets
def open_store(uri, barrier, i, results):
    """Open a (fresh) sqlite store at the same moment as the others, then one run with one point in it."""
    try:
        from flash_forensics.orchestrator.tracking.tracker import get_or_create_experiment, make_client, retry
        barrier.wait(timeout=120)  # imports done: everyone opens the fresh store at the same moment
        client = make_client(uri)
        exp = get_or_create_experiment(client, "race", uri)
        # later writes retried while another writer holds sqlite's lock, as the Tracker does: the test is about
        # creating the store, not about write contention
        run = retry(client.create_run, exp, run_name=f"w{i}")
        retry(client.log_metric, run.info.run_id, "train/loss", 1.0 + i, step=0)
        retry(client.set_terminated, run.info.run_id)
        results.put((i, "ok", run.info.run_id))
    except BaseException as e:  # noqa: BLE001  reported to the test, which names it
        results.put((i, "error", f"{type(e).__name__}: {e}"[:2000]))


def write_metrics(uri, idx, barrier, out, steps, keys):
    """A Tracker logging `steps` points of each key at the same time as the others; its run id and count out."""
    from flash_forensics.orchestrator.tracking.tracker import Tracker, TrackingConfig

    tr = Tracker(TrackingConfig(uri=uri, flush_interval_s=0.2), run_name=f"writer-{idx}", experiment="concurrency",
                 discover_parent=False)
    barrier.wait()  # every writer logs at the same time
    for step in range(steps):
        tr.log_metrics({k: float(idx * 100000 + step) for k in keys}, step=step)
        if step % 10 == 0:
            time.sleep(0.002)
    tr.close()
    out.put((idx, tr.run_id, tr.points_logged))
