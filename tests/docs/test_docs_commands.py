"""The commands in docs/ are checked by running them.

A fenced block right after the line `<!-- checked -->` in a docs page is a terminal session: each
`$ ` line (with its `\\` continuation lines) is a command, the lines after it until the next `$ `
are output it must print. The block's commands run in order, in one fresh folder per page, through
bash with `retention` bound to this checkout's CLI, with the registry and model cache of the test.
An output line matches when some printed line equals it with every number, hash or run id read as
a wildcard (figures depend on the machine; words, order and structure do not) and `…` as any text.
A command exits 0 unless its first output line starts with `Error:`, then it exits 1 with that line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKER = "<!-- checked -->"
# A token holding a digit (numbers, hashes, run ids like b40-0c0a0ca072) is a figure, not a word.
FIGURE = re.compile(r"[0-9A-Fa-f+−-]*\d[\w.,+−%×-]*")


@dataclass(frozen=True)
class Command:
    line: str  # the command as written, continuation lines joined
    expected: tuple[str, ...]  # output lines it must print


def blocks(text: str) -> list[list[Command]]:
    """Every checked block of a page as its commands, in order."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() != MARKER:
            i += 1
            continue
        assert lines[i + 1].startswith("```"), f"{MARKER} must sit right above a fenced block (line {i + 2})"
        i += 2
        body = []
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        out.append(parse(body))
    return out


def parse(body: list[str]) -> list[Command]:
    cmds: list[Command] = []
    cmd, expected, cont = None, [], False
    for raw in body:
        if cont:
            cmd += " " + raw.strip().removesuffix("\\").strip()
            cont = raw.rstrip().endswith("\\")
        elif raw.startswith("$ "):
            if cmd is not None:
                cmds.append(Command(cmd, tuple(expected)))
            cmd, expected = raw[2:].strip().removesuffix("\\").strip(), []
            cont = raw.rstrip().endswith("\\")
        elif raw.strip():
            expected.append(raw.strip())
    if cmd is not None:
        cmds.append(Command(cmd, tuple(expected)))
    return cmds


def pattern(line: str) -> re.Pattern:
    parts = []
    for piece in re.split(r"(\s+|…)", line):
        if not piece:
            continue
        if piece.isspace():
            parts.append(r"\s+")
        elif piece == "…":
            parts.append(".*")
        else:
            pos, rx = 0, []
            for m in FIGURE.finditer(piece):
                rx.append(re.escape(piece[pos:m.start()]) + r"\S*?")
                pos = m.end()
            rx.append(re.escape(piece[pos:]))
            parts.append("".join(rx))
    return re.compile("".join(parts))


def printed(expected: str, output: str) -> bool:
    rx = pattern(expected)
    return any(rx.fullmatch(line.strip()) for line in output.splitlines())


PAGES = sorted(p for p in DOCS.glob("*.md") if MARKER in p.read_text())


def test_the_docs_have_checked_blocks():
    names = {p.name for p in PAGES}
    assert {"walkthrough.md", "budget.md", "cluster.md", "layouts.md", "commands.md"} <= names, names


def test_the_matcher_reads_figures_as_wildcards_and_nothing_else():
    assert printed("runs/tiny-random-alpha-b40-013eb100dd: 2 records, mean cache 27.0 tokens",
                   "runs/tiny-random-alpha-b40-94a5071c9a: 12 records, mean cache 31.5 tokens")
    assert not printed("2 records, accuracy 0/2", "2 problems, accuracy 0/2")
    assert printed("wrote 13 file(s) to dev-report: …", "wrote 12 file(s) to dev-report: a.csv, b.png")
    assert not printed("Error: x", "x")
    assert parse(["$ retention a \\", "    --b 1", "out 1", "$ retention c"]) == [
        Command("retention a --b 1", ("out 1",)), Command("retention c", ())]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_page_commands_print_what_the_page_says(page, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", RETENTION_CACHE_DIR=str(tmp_path / "cache"), RETENTION_SPLITS_DIR=str(ROOT / "splits"))
    # `retention` as the user types it, bound to this interpreter and checkout
    shim = f'retention() {{ "{sys.executable}" -m retention.cli "$@"; }}\n'
    for block in blocks(page.read_text()):
        for cmd in block:
            res = subprocess.run(["bash", "-c", shim + cmd.line], cwd=tmp_path, env=env, capture_output=True, text=True)
            output = res.stdout + res.stderr
            fails = cmd.expected[:1] and cmd.expected[0].startswith("Error:")
            assert res.returncode == (1 if fails else 0), f"{page.name}: `{cmd.line}` exited {res.returncode}:\n{output}"
            if fails:
                assert res.stderr.count("\n") == 1, res.stderr
            for line in cmd.expected:
                assert printed(line, output), f"{page.name}: `{cmd.line}` did not print\n  {line}\nit printed:\n{output}"
