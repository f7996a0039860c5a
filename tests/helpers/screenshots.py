"""Headless-Chromium screenshots of what a reader sees: the MLflow UI's runs table and run pages, verdicts.html.

Debian's `chromium` + `chromium-driver` driven by selenium, with the driver's Debian path so that nothing is
downloaded at run time (selenium's own driver manager would fetch one). Used by tests/integration/test_dashboard*.py
and by hand:

    python -m tests.helpers.screenshots OUT.png URL [--wait-text TEXT] [--width 1800 --height 1100]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def missing() -> Optional[str]:
    """Why a browser cannot be driven here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (.ci/run installs it)"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).exists() or shutil.which(Path(path).name)):
            return f"{path} not found (apt-get install -y chromium chromium-driver)"
    return None


def browser(width: int = 1800, height: int = 1100):
    """A headless Chromium (selenium WebDriver) at the given window size."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              f"--window-size={width},{height}", "--hide-scrollbars"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(CHROMEDRIVER if Path(CHROMEDRIVER).exists()
                                            else shutil.which("chromedriver")), options=opts)


def wait_for_text(driver, text: str, timeout_s: float = 60.0) -> bool:
    """Until `text` is on the page (single-page apps render after load); False on timeout."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.5).until(
            lambda d: text in d.find_element(By.TAG_NAME, "body").text)
        return True
    except TimeoutException:
        return False


def close_mlflow_assistant(driver) -> None:
    """MLflow 3.17 opens an assistant side panel that covers a third of the page: close it when present."""
    from selenium.webdriver.common.by import By
    for el in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close'], button[aria-label='close']"):
        try:
            if el.is_displayed():
                el.click()
                time.sleep(0.5)
        except Exception:
            pass


def shoot(driver, url: str, out: Path, wait_text: Optional[str] = None, settle_s: float = 2.0) -> bool:
    """Open url, wait for wait_text, save a PNG; returns whether the text appeared (the PNG is saved either way)."""
    driver.get(url)
    ok = wait_for_text(driver, wait_text) if wait_text else True
    close_mlflow_assistant(driver)
    time.sleep(settle_s)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.helpers.screenshots", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("url")
    ap.add_argument("--wait-text", default=None)
    ap.add_argument("--width", type=int, default=1800)
    ap.add_argument("--height", type=int, default=1100)
    ap.add_argument("--keep-assistant", action="store_true", help="leave MLflow's assistant panel open")
    a = ap.parse_args(argv)
    why = missing()
    if why:
        print(f"screenshots: {why}", file=sys.stderr)
        return 2
    d = browser(a.width, a.height)
    try:
        d.get(a.url)
        ok = wait_for_text(d, a.wait_text) if a.wait_text else True
        if not a.keep_assistant:
            close_mlflow_assistant(d)
        time.sleep(2.0)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        d.save_screenshot(str(a.out))
    finally:
        d.quit()
    print(f"wrote {a.out}" + ("" if ok else f" (text {a.wait_text!r} did not appear)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
