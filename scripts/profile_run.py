#!/usr/bin/env python
"""Where a real run's time goes: `retention run ...` with the engine's counters printed per arm.

    python scripts/profile_run.py run --model qwen2.5-coder-0.5b --scorer triattention --budget 128 ...

Takes the arguments of the `retention` CLI. After each arm's engine run it prints one `PROF` line to
stderr: decode steps, output tokens, seconds of decode forwards, prefills, compactions and the
fidelity pass (the engine's own `EngineStats`), padding row-steps (decoded for an empty slot: what
the run's tail costs), the seconds spent drawing tokens (`retention.runtime.sampling.draw`, timed by
wrapping it) and the engine run's wall time; at exit the command's wall time. The records written
are the same as without the wrapper (it only reads clocks). With `PROFILE_MMAP_BLOCKS=1` the engine
leaves glibc's thresholds alone (`retention.runtime.host_memory`): what keeping large blocks buys;
with `PROFILE_NO_TAIL=1` the tail keeps every row (`shrink=False`): what narrowing it buys; with
`PROFILE_BATCH_PREFILL=1` the prompts that start together are prefilled together
(`batch_prefill=True`, opt-in: docs/speed.md): what that buys.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import retention.runs.runner as runner
import retention.runtime.engine as engine
from retention.cli import main

_DRAWN = {"seconds": 0.0, "calls": 0}
_draw, _run_engine = engine.draw, runner.run_engine


def _timed_draw(*args, **kwargs):
    t = time.perf_counter()
    out = _draw(*args, **kwargs)
    _DRAWN["seconds"] += time.perf_counter() - t
    _DRAWN["calls"] += 1
    return out


def _profiled_run_engine(*args, **kwargs):
    drawn = dict(_DRAWN)
    if os.environ.get("PROFILE_NO_TAIL") == "1":
        kwargs["shrink"] = False
    if os.environ.get("PROFILE_BATCH_PREFILL") == "1":
        kwargs["batch_prefill"] = True
    st = _run_engine(*args, **kwargs)
    print(f"PROF steps {st.steps} tokens {st.tokens} decode {st.decode_seconds:.1f}s prefill {st.prefill_seconds:.1f}s "
          f"({st.prefill_batches} forwards) "
          f"compaction {st.compaction_seconds:.1f}s fidelity {st.fidelity_seconds:.1f}s padding_rows {st.padding_rows} "
          f"narrowed {st.narrowed} (refused {st.narrow_refused}, last rows {st.rows}, {st.tail_seconds:.1f}s) "
          f"draw {_DRAWN['seconds'] - drawn['seconds']:.1f}s ({_DRAWN['calls'] - drawn['calls']} calls) "
          f"wall {time.perf_counter() - st.t_start:.1f}s", file=sys.stderr)
    return st


if __name__ == "__main__":
    engine.draw, runner.run_engine = _timed_draw, _profiled_run_engine
    if os.environ.get("PROFILE_MMAP_BLOCKS") == "1":
        engine.keep_large_blocks = lambda: False
    t0 = time.perf_counter()
    atexit.register(lambda: print(f"PROF command wall {time.perf_counter() - t0:.1f}s", file=sys.stderr))
    main(sys.argv[1:])
