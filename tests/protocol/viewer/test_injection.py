"""A run directory cannot change the viewer's page (issue 46), in headless Chromium: strings where
numbers belong are refused in one line naming the file and the record (`view` and `report` alike);
strings where strings belong reach the page as text (no `<base>`, no link, no element of theirs); a
traced run whose trace is missing or cut short says so on the page."""

from __future__ import annotations

import json

import pytest


from tests.protocol.test_report import edit_config
from tests.protocol.viewer.test_site import PIDS, hand_cache, invoke, rec, write_run
from tests.protocol.viewer.test_browser import _driver, _wait

pytestmark = pytest.mark.slow

BASE = '<base href="https://evil.example/">'
LINK = '<a id="injected" href="https://evil.example/">click</a>'


@pytest.fixture(scope="module")
def browser():
    driver = _driver()
    yield driver
    driver.quit()


def _runs(root, **changes):
    write_run(root, "full", None, [rec(PIDS[0], [1, 2, 3], "1", True), rec(PIDS[1], [4, 5], "2", False)])
    streaming = [rec(PIDS[0], [1, 2, 9], "7", False), rec(PIDS[1], [4, 5], "2", False)]
    for key, value in changes.items():
        streaming[0][key] = value
    write_run(root, "streaming", 4, streaming,
              traces=[{"problem_id": PIDS[0], "sample": 0, "steps": [0], "tokens": [7.0], "cache": hand_cache()}],
              trace_flag=True)
    return root


@pytest.mark.parametrize("field,value", [("compactions", LINK), ("cache_mean_tokens", BASE), ("output_tokens", "7"),
                                         ("prompt_held_final", [1])])
def test_a_string_in_a_number_field_is_refused_in_one_line(tmp_path, field, value):
    runs = _runs(tmp_path / "runs", **{field: value})
    for cmd in (["view", runs, "--out", tmp_path / "site", "--tokenizer", "none"],
                ["report", runs, "--boot", 200, "--out", tmp_path / "rep"]):
        res = invoke(*cmd)
        lines = res.output.strip().splitlines()
        assert res.exit_code == 1 and len(lines) == 1, res.output
        assert "records.jsonl: record 'test/algebra/1004.json' sample 0" in lines[0]
        assert f"{field} is {value!r}, not a number" in lines[0] and "(a bug)" not in lines[0]
    assert not (tmp_path / "site" / "index.html").exists()


def test_a_string_in_the_configuration_budget_is_refused(tmp_path):
    runs = _runs(tmp_path / "runs")
    path = runs / "run-streaming" / "config.json"
    edit_config(path.parent, budget=BASE)  # the hash recomputed, as a hostile writer would: the viewer must refuse
    res = invoke("view", runs, "--out", tmp_path / "site", "--tokenizer", "none")
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert f"config.json: config: budget is {BASE!r}, not a number" in res.output


def test_strings_reach_the_page_as_text_and_gaps_in_the_trace_are_said(browser, tmp_path):
    from selenium.webdriver.common.by import By

    runs = _runs(tmp_path / "runs", finish_reason=BASE, rule=LINK, extracted=LINK)
    # The second record's trace line is lost: the traced run says so instead of "no trace".
    path = runs / "run-streaming" / "config.json"
    edit_config(path.parent, model=f"tiny{LINK}", accounting=BASE)
    res = invoke("view", runs, "--out", tmp_path / "site", "--tokenizer", "none", "--boot", 200)
    assert res.exit_code == 0, res.output
    checks = "return [document.querySelectorAll('base').length, document.querySelectorAll('#injected').length," \
             " document.baseURI.startsWith('file:')]"
    browser.get((tmp_path / "site" / "index.html").as_uri())
    _wait(browser, "return document.querySelectorAll('#arms tbody tr').length === 2")
    assert browser.execute_script(checks) == [0, 0, True]
    assert LINK in browser.find_element(By.ID, "arms").text  # shown, as text
    for i in (0, 1):
        browser.get((tmp_path / "site" / "index.html").as_uri() + f"#/p/{i}")
        _wait(browser, "return document.querySelectorAll('section.arm').length === 2")
        assert browser.execute_script(checks) == [0, 0, True]
    sec = browser.find_element(By.CSS_SELECTOR, "section.arm[data-arm='a1']")
    assert "trace missing" in sec.find_element(By.CSS_SELECTOR, ".map-absent").text
    # Cut short: a half-written last line.
    (runs / "run-streaming" / "trace.jsonl").write_text(
        json.dumps({"problem_id": PIDS[0], "sample": 0, "steps": [0], "tokens": [7.0], "cache": hand_cache()})
        + '\n{"problem_id": "test/alg')
    res = invoke("view", runs, "--out", tmp_path / "site2", "--tokenizer", "none", "--boot", 200)
    assert res.exit_code == 0, res.output
    browser.get((tmp_path / "site2" / "index.html").as_uri() + "#/p/1")
    _wait(browser, "return document.querySelectorAll('section.arm').length === 2")
    sec = browser.find_element(By.CSS_SELECTOR, "section.arm[data-arm='a1']")
    assert "trace truncated" in sec.find_element(By.CSS_SELECTOR, ".map-absent").text


def test_the_page_escapes_numbers_it_is_handed_as_strings(browser, tmp_path):
    """Past the validation (a data file edited by hand): the page still escapes every field."""
    runs = _runs(tmp_path / "runs")
    res = invoke("view", runs, "--out", tmp_path / "site", "--tokenizer", "none", "--boot", 200)
    assert res.exit_code == 0, res.output
    index_js = tmp_path / "site" / "data" / "index.js"
    data = json.loads(index_js.read_text()[len("RV.index("):-3])
    for arm in data["arms"]:
        arm.update(budget=BASE, n_records=LINK)
    for row in data["comparisons"]:
        row.update(budget=BASE, n=LINK, k=LINK)
    for row in data["problems"]:
        row[2] = LINK
    index_js.write_text("RV.index(" + json.dumps(data) + ");\n")
    page = tmp_path / "site" / "data" / "r" / "0.js"
    text = page.read_text()
    payload = json.loads(text[text.index(",") + 1:-3])
    for rec_view in payload["arms"].values():
        rec_view.update(n_tokens=LINK, compactions=BASE)
    payload["sample"] = LINK
    page.write_text(text[:text.index(",") + 1] + json.dumps(payload) + ");\n")
    checks = "return [document.querySelectorAll('base').length, document.querySelectorAll('#injected').length]"
    browser.get((tmp_path / "site" / "index.html").as_uri())
    _wait(browser, "return document.querySelectorAll('#arms tbody tr').length === 2")
    assert browser.execute_script(checks) == [0, 0]
    browser.get((tmp_path / "site" / "index.html").as_uri() + "#/p/0")
    _wait(browser, "return document.querySelectorAll('section.arm').length === 2")
    assert browser.execute_script(checks) == [0, 0]
    assert LINK in browser.find_element("id", "app").text
