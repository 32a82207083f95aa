"""scripts/tail_simulation.py: the slot schedule it replays, against schedules worked by hand."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tail_simulation.py"
spec = importlib.util.spec_from_file_location("tail_simulation", SCRIPT)
sim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim)


def test_steps_follow_the_slot_schedule():
    assert sim.steps([], 2) == 0
    assert sim.steps([5], 3) == 5
    # 2 slots: 1 and 1 start, the third (4) takes the first free slot at step 1 -> ends at 5
    assert sim.steps([1, 1, 4], 2) == 5
    # longest first: 4 on one slot, 1 and 1 one after the other on the other -> ends at 4
    assert sim.steps([4, 1, 1], 2) == 4
    assert sim.share([{"output_tokens": n} for n in (4, 1, 1)], 2) == 6 / 8


def test_cli_prints_every_order(tmp_path):
    def write(name, lengths):
        d = tmp_path / name
        d.mkdir()
        recs = [{"problem_id": f"p{i}", "sample": 0, "output_tokens": n, "prompt_tokens": 10 + i, "slots": 2}
                for i, n in enumerate(lengths)]
        (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return d / "records.jsonl"

    a, b = write("a", [1, 1, 4]), write("b", [1, 1, 9])
    out = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "a (3 records, 2 slots): fifo 60%, by prompt 75%, by b 75%, oracle 75%"
    assert lines[1] == "b (3 records, 2 slots): fifo 55%, by prompt 61%, by a 61%, oracle 61%"  # 11/20, 11/18
