#!/usr/bin/env python
"""A small run at the bench's pace? The engine on the first `--problems` dev problems (the prompts a
run builds, sampling as a run samples), EOS honoured, at `--slots` slots with the prompts that start
together prefilled together and one at a time, and at batch 1, in one process, each configuration
`--repeats` times in turn (ABCABC: a shared host's noise hits all alike). Prints per configuration
the tokens, wall seconds (prefill included), prefill seconds and forwards, tokens/s, and the steady
decode rate of the slots-wide run (slots / median decode step while every slot is busy); then the
ratios, and whether the records of the two prefills agree (token ids of every sequence).

    python scripts/small_run_bench.py --model smollm2-135m --problems 16 --slots 16 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from protocol.splits import load_split
from retention.models import format_prompt, load_model
from retention.runs.bench import variant_policy
from retention.runtime.engine import Request, SamplingConfig, run_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-batch-1", action="store_true", help="skip the batch-1 configuration")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    loaded = load_model(a.model, dtype=a.dtype, device="cpu")
    probs = load_split("dev")[:a.problems]
    prompts = [format_prompt(loaded.tokenizer, p.problem, getattr(loaded, "prompt", "chat")) for p in probs]
    eos = {loaded.tokenizer.eos_token_id} if loaded.tokenizer.eos_token_id is not None else set()
    cfg = SamplingConfig(max_new_tokens=a.max_new_tokens)  # a run's default sampling (seeded per request)
    configs = [("together", a.slots, True), ("alone", a.slots, False)]
    configs += [] if a.no_batch_1 else [("batch-1", 1, True)]
    runs: dict[str, list[dict]] = {c[0]: [] for c in configs}
    print(f"{a.model} {a.dtype}, {len(prompts)} problems, prompts {min(map(len, prompts))}..{max(map(len, prompts))} "
          f"tokens, max {a.max_new_tokens} new, threads {torch.get_num_threads()}", flush=True)
    for _ in range(a.repeats):
        for name, S, together in configs:
            gens = {}
            t0 = time.perf_counter()
            st = run_engine(loaded.model, [Request(i, p, 1000 + i) for i, p in enumerate(prompts)],
                            variant_policy(loaded.name, "full", None, None, "mean", {}), cfg, eos,
                            loaded.geometry.kib_per_token, batch_size=S, batch_prefill=together,
                            max_prompt=max(map(len, prompts)), on_finish=lambda r, g: gens.__setitem__(r.key, g))
            wall = time.perf_counter() - t0
            busy = min(len(g.decode_seconds) for g in gens.values())  # steps while every sequence still decoded
            steps = [s for g in gens.values() for s in g.decode_seconds[:busy]]
            r = {"tokens": st.tokens, "wall": wall, "prefill": st.prefill_seconds, "forwards": st.prefill_batches,
                 "tps": st.tokens / wall, "steady": S / statistics.median(steps) if steps else float("nan"),
                 "ids": {k: g.token_ids for k, g in gens.items()}}
            runs[name].append(r)
            print(f"{name:>9} S={S:<3}: {r['tokens']} tokens in {wall:.1f} s = {r['tps']:.1f} tok/s; prefill "
                  f"{r['prefill']:.1f} s in {r['forwards']} forwards; steady decode {r['steady']:.1f} tok/s",
                  flush=True)
    best = {k: max(v, key=lambda r: r["tps"]) for k, v in runs.items()}
    t, o = best["together"], best["alone"]
    print(f"together / alone (tok/s, prefill included): {t['tps'] / o['tps']:.2f}x; prefill seconds "
          f"{o['prefill']:.1f} -> {t['prefill']:.1f}; together at {100 * t['tps'] / t['steady']:.0f}% of its steady "
          f"decode rate (alone: {100 * o['tps'] / o['steady']:.0f}%)")
    if "batch-1" in best:
        print(f"S={a.slots} over batch 1: together {t['tps'] / best['batch-1']['tps']:.2f}x, "
              f"alone {o['tps'] / best['batch-1']['tps']:.2f}x")
    same = sum(t["ids"][k] == o["ids"][k] for k in o["ids"])
    print(f"records: {same} of {len(o['ids'])} sequences have the same token ids with both prefills")


if __name__ == "__main__":
    main()
