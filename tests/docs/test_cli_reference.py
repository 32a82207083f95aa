"""docs/cli.md is the commands' own help: regenerate it when an option changes."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cli_reference.py"


def test_cli_reference_is_current():
    spec = importlib.util.spec_from_file_location("cli_reference", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.DOC.read_text(encoding="utf-8") == mod.render(), (
        "docs/cli.md is stale: run `python scripts/cli_reference.py`")
