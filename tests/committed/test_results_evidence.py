"""`results/` holds evidence (records, traces, reports, READMEs), not builds: no viewer site or other
generated page assets are committed there, and the README of a folder that shows a site names the
command that builds it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILT = (".js", ".css", ".html", ".htm", ".map")


def _tracked() -> list[str]:
    res = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip("not a git checkout: the committed files cannot be listed")
    return res.stdout.splitlines()


def test_no_viewer_site_or_page_asset_is_committed():
    files = _tracked()
    assert files, "git lists no file under results/"
    built = [f for f in files if "viewer" in Path(f).parts or f.endswith(BUILT)]
    assert not built, f"generated files committed under results/ (build them with `retention view`): {built[:5]}"


def test_git_ignores_a_viewer_built_into_results():
    probe = "results/real-signal-qwen0.5b/traced/report/viewer/index.html"
    res = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
    assert res.returncode == 0, f"{probe} is not ignored: a built site could be committed"


def test_readmes_that_mention_a_site_name_the_command_that_builds_it():
    for readme in sorted((ROOT / "results").glob("**/README.md")):
        text = readme.read_text()
        if "viewer/index.html" in text:
            assert "retention view" in text or "--html" in text, readme
