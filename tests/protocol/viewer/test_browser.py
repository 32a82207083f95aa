"""The viewer in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`, driven
through selenium with the system chromedriver; nothing is downloaded) over the site `report --html`
writes for a tiny traced run with fidelity (tiny-random: streaming vs h2o at budget 40, and the full
cache). It opens the index from file://, checks the report's rows, filters and keyboard navigation,
follows a problem and checks, for every arm, that the divergence marker, the KL strip and the cache
map show the records' and traces' own figures (read here from the run directories). Screenshots go
to the test's tmp folder, or to $RETENTION_VIEWER_SCREENSHOTS.

Without chromium/chromedriver (or selenium) the test is skipped with one line saying which is missing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from retention.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SHOTS_ENV = "RETENTION_VIEWER_SCREENSHOTS"
ARGS = ["--model", "tiny-random", "--limit", "3", "--samples", "2", "--max-new-tokens", "24", "--temperature", "0.7",
        "--fidelity", "--trace", "--quiet"]

pytestmark = pytest.mark.slow


def cli(*args) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.output


def _driver():
    missing = [name for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if path is None]
    if missing:
        pytest.skip(f"viewer browser test skipped: {' and '.join(missing)} not found (apt-get install chromium "
                    "chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("viewer browser test skipped: selenium is not installed (pip install 'selenium>=4.10')")
    os.environ["SE_OFFLINE"] = "true"  # selenium manager: never download a driver or a browser
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _runs(runs: Path) -> dict[str, tuple[dict, dict, dict]]:
    """scorer -> ({(pid, sample): record}, {(pid, sample): trace line}, config.json)."""
    out = {}
    for d in runs.iterdir():
        meta = json.loads((d / "config.json").read_text())
        key = lambda r: (r["problem_id"], r["sample"])  # noqa: E731
        out[meta["config"]["scorer"]] = ({key(r): r for r in _jsonl(d / "records.jsonl")},
                                         {key(t): t for t in _jsonl(d / "trace.jsonl")}, meta)
    return out


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("viewer")
    runs = tmp / "runs"
    cli("run", *ARGS, "--scorer", "streaming", "--baseline", "h2o", "--budget", 40, "--interval", 8, "--out", runs)
    cli("run", *ARGS, "--scorer", "full", "--out", runs)
    out = cli("report", runs, "--baseline", "h2o", "--boot", 2000, "--out", tmp / "report", "--html")
    assert f"viewer: {tmp / 'report' / 'viewer' / 'index.html'}" in out
    return tmp, runs, tmp / "report" / "viewer"


@pytest.fixture(scope="module")
def browser():
    driver = _driver()
    yield driver
    driver.quit()


def _shots(tmp: Path) -> Path:
    where = Path(os.environ.get(SHOTS_ENV) or tmp / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


def _wait(driver, script: str, timeout: float = 10.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: d.execute_script(script))


def test_index_filters_and_keyboard(browser, site):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    tmp, runs, viewer = site
    data = _runs(runs)
    browser.get((viewer / "index.html").as_uri())
    _wait(browser, "return document.querySelector('#count') !== null")
    browser.save_screenshot(str(_shots(tmp) / "index.png"))
    # the report's rows: one comparison (streaming vs h2o), three arms
    report_rows = (tmp / "report" / "report.csv").read_text().splitlines()[1:]
    cmp_rows = browser.find_elements(By.CSS_SELECTOR, "#comparisons tr.cmp")
    assert len(cmp_rows) == len(report_rows) == 1 and "streaming vs h2o" in cmp_rows[0].text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#arms tr.armrow")) == 3
    count = lambda: int(browser.find_element(By.ID, "count").get_attribute("data-count"))  # noqa: E731

    # default arm: the first with a full reference (h2o, labels sort); every (problem, sample) is listed
    recs, _, _ = data["h2o"]
    full = data["full"][0]
    assert count() == len(recs) == 6
    # filter: answers changed against the full cache, then the same ones; they split the list
    Select(browser.find_element(By.ID, "f-ch")).select_by_value("1")
    changed = sum(r.get("extracted") != full[k].get("extracted") for k, r in recs.items())
    _wait(browser, f"return Number(document.querySelector('#count').dataset.count) === {changed}")
    Select(browser.find_element(By.ID, "f-ch")).select_by_value("0")
    _wait(browser, f"return Number(document.querySelector('#count').dataset.count) === {len(recs) - changed}")
    Select(browser.find_element(By.ID, "f-ch")).select_by_value("")
    # filter: ungradable verdicts of the streaming arm
    Select(browser.find_element(By.ID, "f-arm")).select_by_value(_key_of(browser, "streaming"))
    Select(browser.find_element(By.ID, "f-v")).select_by_value("ungradable")
    ungradable = sum(r["verdict"] is None for r in data["streaming"][0].values())
    _wait(browser, f"return Number(document.querySelector('#count').dataset.count) === {ungradable}")
    Select(browser.find_element(By.ID, "f-v")).select_by_value("")
    _wait(browser, "return Number(document.querySelector('#count').dataset.count) === 6")
    # a comparison row links to the problems where the two arms' verdicts differ
    browser.execute_script("window.scrollTo(0, 0)")
    browser.find_element(By.CSS_SELECTOR, "#comparisons tr.cmp a").click()
    differ = sum((r["verdict"] is True) != (data["h2o"][0][k]["verdict"] is True) for k, r in data["streaming"][0].items())
    _wait(browser, f"return location.hash.includes('vs=') && "
                   f"Number(document.querySelector('#count').dataset.count) === {differ}")

    # keyboard: j j k j and down move the selection to the fourth row, Enter opens it, n goes to the next, Esc back
    browser.get((viewer / "index.html").as_uri() + "#/")
    _wait(browser, "return document.querySelector('#problems tbody tr') !== null")
    body = browser.find_element(By.TAG_NAME, "body")
    for key in "jjkj":
        body.send_keys(key)
    body.send_keys(Keys.ARROW_DOWN)
    rows = browser.find_elements(By.CSS_SELECTOR, "#problems tbody tr")
    assert [r.get_attribute("class").split() for r in rows].index(["prow", "sel"]) == 3
    fourth, fifth = (rows[n].get_attribute("data-i") for n in (3, 4))
    body.send_keys(Keys.ENTER)
    _wait(browser, f"return location.hash.startsWith('#/p/{fourth}/') && document.querySelector('#problem') !== null")
    browser.find_element(By.TAG_NAME, "body").send_keys("n")
    _wait(browser, f"return document.querySelector('#problem') && document.querySelector('#problem').dataset.i === '{fifth}'")
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    _wait(browser, "return document.querySelector('#count') !== null")
    # everything the page loads comes from the site folder (the page's CSP allows nothing else)
    urls = browser.execute_script("return [...document.querySelectorAll('script[src], link[href], img[src]')]"
                                  ".map(e => e.src || e.href)")
    assert urls and all(u.startswith(viewer.as_uri() + "/") for u in urls), urls
    csp = browser.find_element(By.CSS_SELECTOR, "meta[http-equiv='Content-Security-Policy']").get_attribute("content")
    assert "default-src 'none'" in csp


def _key_of(browser, scorer: str) -> str:
    return browser.execute_script(f"return RV.state.index.arms.find(a => a.scorer === '{scorer}').key")


def test_problem_page_matches_records(browser, site):
    from selenium.webdriver.common.by import By

    tmp, runs, viewer = site
    data = _runs(runs)
    full_recs = data["full"][0]
    browser.get((viewer / "index.html").as_uri())
    _wait(browser, "return document.querySelector('#problems tbody tr') !== null")
    rows = browser.execute_script("return RV.state.index.problems.map(r => [r[0], r[1], r[2]])")
    for i, pid, sample in rows:
        browser.get((viewer / "index.html").as_uri() + f"#/p/{i}")
        _wait(browser, f"return document.querySelector('#problem') && document.querySelector('#problem').dataset.i === '{i}'"
                       " && document.querySelectorAll('section.arm').length === 3")
        if i == 0:
            browser.save_screenshot(str(_shots(tmp) / "problem.png"))
        for scorer, (recs, traces, _meta) in data.items():
            rec, line = recs[(pid, sample)], traces[(pid, sample)]
            cache = line["cache"]
            sec = browser.find_element(By.CSS_SELECTOR, f"section.arm[data-arm='{_key_of(browser, scorer)}']")
            # divergence marker: the first output token differing from the full cache's, in both texts
            marks = sec.find_elements(By.CSS_SELECTOR, "mark.divmark")
            if scorer == "full":
                assert marks == []
            else:
                div = _first_difference(rec["output_token_ids"], full_recs[(pid, sample)]["output_token_ids"])
                assert div is not None and [m.get_attribute("data-token") for m in marks] == [str(div)] * 2
                assert all(m.get_attribute("data-exact") == "1" for m in marks)  # tiny-random's tokenizer is at hand
            # KL strip: one column per step of the trace, the record's mean KL
            kl = sec.find_element(By.CSS_SELECTOR, "canvas.kl")
            assert int(kl.get_attribute("data-steps")) == len(cache["kl"]) == rec["fidelity"]["steps"]
            assert float(kl.get_attribute("data-kl-mean")) == pytest.approx(rec["fidelity"]["kl_mean"], rel=5e-3, abs=1e-3)
            assert int(kl.get_attribute("data-top1-disagree")) == cache["top1"].count("0")
            # cache map: the compactions, the mean stored tokens and the meter's per-step counts
            cmap = sec.find_element(By.CSS_SELECTOR, "canvas.cachemap")
            assert int(cmap.get_attribute("data-compactions")) == rec["compactions"] == len(cache["compactions"])
            assert float(cmap.get_attribute("data-stored-mean")) == pytest.approx(rec["cache_mean_tokens"], abs=1e-9)
            stored = browser.execute_script("return arguments[0].rvStored", cmap)
            assert len(stored) == rec["decode_steps"]
            assert [stored[s] for s in line["steps"]] == pytest.approx(line["tokens"], abs=1e-9)
            held = cmap.get_attribute("data-prompt-held-final")
            assert (held == "") == (rec["prompt_held_final"] is None)
            if held:
                assert float(held) == pytest.approx(rec["prompt_held_final"], abs=1e-12)
            evicted = cmap.get_attribute("data-prompt-evicted-step")
            assert evicted == ("" if rec["prompt_evicted_step"] is None else str(rec["prompt_evicted_step"]))
            # the map was drawn: prompt positions in their colour
            painted = browser.execute_script(
                "const c = arguments[0], d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;"
                "for (let k = 0; k < d.length; k += 4) if (d[k] === 37 && d[k + 1] === 99 && d[k + 2] === 235) n++;"
                "return n", cmap)
            assert painted > 0
            assert sec.find_elements(By.CSS_SELECTOR, ".map-absent") == []


def test_untraced_runs_render_with_a_note(browser, site, tmp_path):
    """Runs written without --trace (their trace lines hold no `cache`), viewed with --tokenizer none: the
    texts, answers and divergence marker (where the texts first differ) render; map and strip say why not."""
    from selenium.webdriver.common.by import By

    _tmp, runs, _viewer = site
    plain = tmp_path / "runs"
    for d in runs.iterdir():
        meta = json.loads((d / "config.json").read_text())
        if meta["config"]["scorer"] == "h2o":
            continue
        shutil.copytree(d, plain / d.name)
        meta["trace"] = False
        (plain / d.name / "config.json").write_text(json.dumps(meta))
        lines = [{k: v for k, v in t.items() if k != "cache"} for t in _jsonl(d / "trace.jsonl")]
        (plain / d.name / "trace.jsonl").write_text("".join(json.dumps(t) + "\n" for t in lines))
    out = cli("view", plain, "--out", tmp_path / "site", "--tokenizer", "none", "--boot", 1000)
    assert "6 problem page(s)" in out
    data = _runs(plain)
    browser.get((tmp_path / "site" / "index.html").as_uri() + "#/p/0")
    _wait(browser, "return document.querySelectorAll('section.arm').length === 2")
    browser.save_screenshot(str(_shots(tmp_path) / "untraced.png"))
    pid, sample = browser.execute_script("return [RV.state.records[0].pid, RV.state.records[0].sample]")
    for scorer in ("streaming", "full"):
        sec = browser.find_element(By.CSS_SELECTOR, f"section.arm[data-arm='{_key_of(browser, scorer)}']")
        assert "no trace" in sec.find_element(By.CSS_SELECTOR, ".map-absent").text
        assert "no per-step KL" in sec.find_element(By.CSS_SELECTOR, ".kl-absent").text
        texts = sec.find_elements(By.CSS_SELECTOR, "pre.text")
        assert texts and texts[0].get_attribute("textContent") == data[scorer][0][(pid, sample)]["text"]
    sec = browser.find_element(By.CSS_SELECTOR, f"section.arm[data-arm='{_key_of(browser, 'streaming')}']")
    marks = sec.find_elements(By.CSS_SELECTOR, "mark.divmark")
    assert len(marks) == 2 and all(m.get_attribute("data-exact") == "0" for m in marks)
    a, b = data["streaming"][0][(pid, sample)]["text"], data["full"][0][(pid, sample)]["text"]
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    before = browser.execute_script("const m = arguments[0]; const r = document.createRange();"
                                    "r.setStart(m.parentNode, 0); r.setEndBefore(m); return r.toString()", marks[0])
    assert before == a[:common]
