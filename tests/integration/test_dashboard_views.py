"""The MLflow pages the printed links open, in headless Chromium, on a store of 12 runs made directly (no training,
so this runs in a minute): `mlflow ui` started exactly as printed with FF_MLFLOW_UI_URL on another port serves every
link; the verdicts view sorts the jobs as numbers (00 ... 11) and shows expected, verdict, matches_paper and cause
left of MLflow's assistant panel at 1600 px, under short names (cause, control: 'job 01' whole); a printed run link
opens the model-training UI, not GenAI; run.log is one click from the run page."""
import os
import shlex
import signal
import subprocess
import time
import urllib.request

import pytest

from flash_forensics.orchestrator import record
from flash_forensics.orchestrator.report import links, verdict_view
from flash_forensics.orchestrator.report import rows as R
from flash_forensics.orchestrator.tracking.store import get_or_create_experiment, make_client
from tests.helpers import screenshots
from tests.helpers.procs import free_port

N_JOBS = 12
LOG_LINE = "[job] step 10/10: train loss 4.1000, the log of job"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    why = screenshots.missing()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must drive a browser: {why}")
        pytest.skip(why)
    from mlflow.entities import Metric
    tmp = tmp_path_factory.mktemp("views")
    uri = f"sqlite:///{tmp}/mlflow.db"
    c = make_client(uri)
    exp = get_or_create_experiment(c, "views", uri)
    parent = c.create_run(exp, run_name="sweep", tags={"role": "sweep"}).info.run_id
    rows = []
    for j in range(N_JOBS):
        iv = {0: "baseline", 1: "fp32"}.get(j, f"iv{j}")
        expected, observed = ("diverges", "diverged") if j == 0 else ("stable", "stable")
        rid = c.create_run(exp, run_name=f"{iv} job{j}", tags={
            "mlflow.parentRunId": parent, "job": str(j), record.TAG_INTERVENTION: iv, record.TAG_EXPECT: expected,
            record.TAG_VERDICT: observed}).info.run_id
        c.log_batch(rid, metrics=[Metric("train/loss", 5.0 - 0.1 * s, 0, s) for s in range(10)])
        (tmp / f"log{j}").mkdir()
        (tmp / f"log{j}" / "run.log").write_text(f"{LOG_LINE} {j}\n")
        c.log_artifact(rid, str(tmp / f"log{j}" / "run.log"), "job")
        rows.append({"mlflow_run_id": rid, "job": str(j), "intervention": iv, "expected": expected,
                     "observed": observed, "divergence_step": 5 if j == 0 else None, "steps_done": 10,
                     "overrides": [f"intervention={iv}"], "setup": {"train.seed": "1"}})
    R.compare(rows)
    key = verdict_view.publish(c, rows, {**{r["mlflow_run_id"]: exp for r in rows}, parent: exp}, parent)
    port = free_port()
    os.environ[links.UI_URL_ENV] = f"http://127.0.0.1:{port}"
    try:
        printed = links.link_lines(uri, exp, parent, share_key=key)
        run_line = links.link_lines(uri, exp, rows[0]["mlflow_run_id"], run_label="run")[-1]
    finally:
        del os.environ[links.UI_URL_ENV]
    cmd = printed[0].removeprefix("MLflow: ").split("   (serves")[0]
    assert cmd.endswith(f"--port {port}"), printed[0]
    ui = subprocess.Popen(shlex.split(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)  # its own group: uvicorn's workers stop with it
    try:
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline and ui.poll() is None, f"{cmd} did not serve :{port}"
                time.sleep(1)
        yield {"printed": printed, "run": run_line.split(": ", 1)[1], "rows": rows}
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=60)


def _visible_right(d) -> float:
    """Where the runs table's visible part ends: the assistant panel's left edge when it is open, else the window."""
    return d.execute_script("""
        const p = [...document.querySelectorAll('div,aside,section')].filter(e => e.innerText &&
            e.innerText.startsWith('MLflow Assistant') && e.getBoundingClientRect().width > 200
            && e.getBoundingClientRect().width < window.innerWidth / 2);
        return p.length ? Math.min(...p.map(e => e.getBoundingClientRect().left)) : window.innerWidth;""")


def test_the_verdicts_view_as_printed(store):
    from selenium.webdriver.common.by import By
    view = next(line for line in store["printed"] if line.startswith("  verdicts: ")).split(": ", 1)[1]
    assert not any("runs table" in line for line in store["printed"])  # the plain table folds the runs
    d = screenshots.browser(1600, 1000)
    try:
        d.get(view)  # a fresh profile: MLflow opens its assistant panel on a first visit
        assert screenshots.wait_for_text(d, "matches_paper") and screenshots.wait_for_text(d, "iv11 job11")
        time.sleep(2)
        heads = d.execute_script("""return [...document.querySelectorAll('[role=columnheader]')].map(e => {
            const r = e.getBoundingClientRect(); return [e.innerText.trim(), r.right]})""")
        right = {name: x for name, x in heads if name}
        edge = _visible_right(d)
        for col in ("expected", "verdict", "matches_paper", "cause"):  # the verdict, readable without scrolling
            assert col in right and right[col] <= edge + 1, (col, right, edge)
        assert "verdict_cause" not in right and "verdict_control" not in right
        names = d.execute_script("""return [...document.querySelectorAll('[role=row][row-index]')]
            .sort((a, b) => a.getAttribute('row-index') - b.getAttribute('row-index'))
            .map(r => (r.querySelector('a') || {}).innerText).filter(t => t && t.includes(' job'))""")
        assert names == [r["intervention"] + f" job{i}" for i, r in enumerate(store["rows"])], names  # 0, 1, .. 11
        screenshots.close_mlflow_assistant(d)
        time.sleep(1)
        body = d.find_element(By.TAG_NAME, "body").text
        assert "job 01" in body  # the baseline's control, whole; its run id is the control_run tag
        d.save_screenshot(str(screenshots_dir() / "mlflow_verdicts_view_12.png"))
    finally:
        d.quit()


def test_a_printed_run_link_opens_model_training_and_run_log_is_one_click(store):
    from selenium.webdriver.common.by import By
    d = screenshots.browser(1600, 1000)
    try:
        d.get(store["run"])
        assert screenshots.wait_for_text(d, "Verdict:")
        body = d.find_element(By.TAG_NAME, "body").text
        assert "Evaluation runs" not in body and "Judges" not in body  # GenAI mode's sidebar
        before = d.window_handles
        d.find_element(By.LINK_TEXT, "run.log").click()  # in the run's description: one click
        time.sleep(2)
        if len(d.window_handles) > len(before):  # MLflow opens a description's links in a new tab
            d.switch_to.window(d.window_handles[-1])
        assert screenshots.wait_for_text(d, f"{LOG_LINE} 0"), d.current_url
        assert "Evaluation runs" not in d.find_element(By.TAG_NAME, "body").text  # still model training
    finally:
        d.quit()


def screenshots_dir():
    from pathlib import Path
    out = Path(__file__).resolve().parents[2] / "results" / "dashboard_ci"
    out.mkdir(parents=True, exist_ok=True)
    return out
