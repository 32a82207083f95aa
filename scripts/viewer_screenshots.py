"""Screenshots of a viewer site in headless Chromium (Debian's chromium + chromium-driver, selenium):
the index and one problem page, as committed beside a results folder's viewer.

    python scripts/viewer_screenshots.py SITE_DIR OUT_DIR [--problem I]

Also prints what the pages show (the index's arms and its problem count, the problem page's arms with
their compaction count, mean cache and first divergence), read from the DOM the browser test checks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By


def driver() -> webdriver.Chrome:
    os.environ["SE_OFFLINE"] = "true"  # never download a driver or a browser
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1100"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def wait(drv, script: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not drv.execute_script(script):
        if time.monotonic() > end:
            raise TimeoutError(script)
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("site", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--problem", type=int, default=0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    drv = driver()
    try:
        index = (a.site / "index.html").resolve().as_uri()
        drv.get(index)
        wait(drv, "return document.querySelector('#problems tbody tr') !== null")
        drv.save_screenshot(str(a.out / "index.png"))
        rows = len(drv.find_elements(By.CSS_SELECTOR, "#problems tbody tr"))
        print(json.dumps({"page": "index", "problem_rows": rows}))
        drv.set_window_size(1400, 2400)  # tall enough for the first arm's text, KL strip and cache map
        drv.get(index + f"#/p/{a.problem}")
        wait(drv, f"return document.querySelector('#problem') && document.querySelector('#problem').dataset.i === "
                  f"'{a.problem}' && document.querySelectorAll('section.arm').length > 0")
        time.sleep(0.5)  # canvases draw after the data script
        drv.save_screenshot(str(a.out / "problem.png"))
        for sec in drv.find_elements(By.CSS_SELECTOR, "section.arm"):
            cmap = sec.find_elements(By.CSS_SELECTOR, "canvas.cachemap")
            marks = sec.find_elements(By.CSS_SELECTOR, "mark.divmark")
            print(json.dumps({"page": "problem", "arm": sec.get_attribute("data-arm"),
                              "first_divergence_token": marks[0].get_attribute("data-token") if marks else None,
                              **({k: cmap[0].get_attribute(f"data-{k}") for k in
                                  ("compactions", "stored-mean", "prompt-held-final", "prompt-evicted-step")}
                                 if cmap else {})}))
    finally:
        drv.quit()


if __name__ == "__main__":
    main()
