"""Run another engine's bench child (`python -m <module>` in that engine's own environment).

The protocol every child follows (`vllm_bench`, `llamacpp_bench`): one JSON request on stdin; one
JSON object, the last line of stdout, either the result or `{"error": "..."}`; everything else
(the engine's log, the child's progress lines) on stderr. Standard library only: the parent's side,
importable anywhere.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from retention.errors import RetentionError

LOG_TAIL = 20  # lines of a child's log shown when it fails


def run_child(python: Path, module: str, request_json: str, env: dict[str, str], cwd: Path, *, label: str,
              progress: str, result_key: str, echo: Callable[[str], None]) -> dict:
    """The child's result object (it has `result_key`). Lines of its stderr that start with `progress`
    reach `echo` as they come; the rest of its log is kept and its tail shown only if it fails, which
    ends in one `RetentionError` line: the child's own error, else its log's last line."""
    proc = subprocess.Popen([str(python), "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    proc.stdin.write(request_json)
    proc.stdin.close()
    log = []
    for line in proc.stderr:  # stdout holds one line, written last: reading stderr first cannot block
        log.append(line.rstrip("\n"))
        if line.startswith(progress):
            echo(line.rstrip("\n"))
    out = proc.stdout.read()
    rc = proc.wait()
    try:
        raw = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
    except ValueError:
        raw = None
    if rc == 0 and isinstance(raw, dict) and result_key in raw:
        return raw
    for line in log[-LOG_TAIL:]:
        echo(line)
    if isinstance(raw, dict) and "error" in raw:
        raise RetentionError(f"{label} bench: {raw['error']}")
    last = next((ln for ln in reversed(log) if ln.strip()), "no output")
    raise RetentionError(f"{label} bench failed (exit {rc}, {python}): {last.strip()}")
