"""Time `retention view` on a synthetic confirm-sized study (docs/viewer.md quotes its output).

Writes three run directories (two arms at a budget and the full cache; 299 confirm problems x k
samples each, with `--trace`-style cache traces and per-step KL) whose records and traces follow the
schema of docs/records.md, then builds the viewer over them and prints the time and sizes. The
"model" is a 28-layer, 4-KV-head geometry with shared routing (one eviction group), a budget of
`--budget` tokens kept per head at compactions every `--interval` generated tokens (sink + recent
window + tokens drawn at random per head), outputs of 256..`--max-tokens` tokens.

    python scripts/viewer_bench.py --out /tmp/viewer-bench [--samples 4] [--max-tokens 4096]
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import time
from pathlib import Path

import numpy as np

from protocol.splits import split_ids
from protocol.viewer import view_runs

HEADS, LAYERS, SINK, RECENT = 4, 28, 4, 32


def pack(bits: np.ndarray) -> str:
    return base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode("ascii")


def trace_of(rng, P: int, T: int, budget: int | None, interval: int) -> tuple[dict, float, int, int | None, float | None]:
    """(cache object, mean stored over decode steps, compactions, prompt evicted step, prompt held final)."""
    n, steps = P + T, T - 1
    comps, stored, held, evicted = [], [], np.ones((HEADS, P), dtype=bool), None
    last_kept, last_step = None, 0
    for d in range(steps):
        count = (P + d + 1) if last_kept is None else last_kept + (d - last_step + 1)
        if budget is not None and count > budget + interval - 1:  # compact before feeding token d
            exist = P + d
            kept = np.zeros((HEADS, n), dtype=bool)
            kept[:, :SINK] = True
            kept[:, exist - RECENT:exist] = True
            for h in range(HEADS):
                free = np.flatnonzero(~kept[h, :exist])
                kept[h, rng.choice(free, budget - SINK - RECENT, replace=False)] = True
            comps.append({"step": d, "before": count - 1, "kept": [kept.sum(-1).tolist()],
                          "positions": [[pack(k) for k in kept]]})
            held = kept[:, :P]
            if evicted is None and not held.all():
                evicted = d
            last_kept, last_step = budget, d
            count = budget + 1
        stored.append(count)
    cache = {"version": 1, "prompt_tokens": P, "n_positions": n, "kv_heads": HEADS, "groups": 1, "layers": LAYERS,
             "prefill_stored": P, "compactions": comps, "steps": steps,
             "kl": [float(f"{x:.3g}") for x in rng.gamma(0.5, 0.2 if budget else 0.0001, T)],
             "top1": "".join("1" if x else "0" for x in rng.random(T) > (0.1 if budget else 0.0))}
    return cache, float(np.mean(stored)), len(comps), evicted, (float(held.mean()) if comps else None)


def write_run(root: Path, scorer: str, budget: int | None, problems, samples: int, args, seed: int) -> None:
    rng = np.random.default_rng(seed)
    config = {"model": "r1-distill-qwen-7b", "scorer": scorer, "scorer_params": {}, "budget": budget,
              "split": "confirm", "accounting": "mean", "interval": args.interval, "temperature": 0.6, "seed": 0,
              "max_new_tokens": args.max_tokens, "dtype": "bfloat16", "fidelity": True}
    h = f"bench-{scorer}-{budget}"
    d = root / f"bench-{scorer}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"run_id": d.name, "config_hash": h, "config": config, "trace": True}))
    base = np.random.default_rng(1)  # the same "full" tokens for every arm until they diverge
    with open(d / "records.jsonl", "w") as recs, open(d / "trace.jsonl", "w") as traces:
        for pid in problems:
            P = int(base.integers(80, 300))
            for s in range(samples):
                T = int(base.integers(256, args.max_tokens + 1))
                full_ids = base.integers(0, 150_000, T)
                ids = full_ids.copy()
                if budget is not None:
                    cut = int(rng.integers(1, T))
                    ids[cut:] = rng.integers(0, 150_000, T - cut)
                cache, mean, ncomp, evicted, held = trace_of(rng, P, T, budget, args.interval)
                text = " ".join(f"w{i % 997}" for i in ids)[: 4 * T]
                answer = str(int(base.integers(0, 3)))  # the full cache's; every arm draws it (same stream)
                if budget is not None:
                    answer = str(int(rng.integers(0, 3)))
                rec = {"config_hash": h, "problem_id": pid, "sample": s, "seed": s, "prompt_tokens": P,
                       "output_token_ids": ids.tolist(), "output_tokens": T, "text": text, "finish_reason": "eos",
                       "cache_mean_tokens": mean, "compactions": ncomp, "decode_steps": T - 1, "gold": "1",
                       "extracted": answer, "verdict": answer == "1", "reason": None, "rule": "boxed",
                       "prompt_evicted_step": evicted, "prompt_held_final": held,
                       "fidelity": {"kl_mean": float(np.mean(cache["kl"])), "steps": T,
                                    "top1_agreement": cache["top1"].count("1") / T, "first_divergence_step": None}}
                traces.write(json.dumps({"problem_id": pid, "sample": s, "steps": [0], "tokens": [0.0],
                                         "cache": cache}) + "\n")
                recs.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--problems", type=int, default=299)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--interval", type=int, default=128)
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    problems = sorted(split_ids("confirm"))[: args.problems]
    start = time.perf_counter()
    for i, (scorer, budget) in enumerate((("alpha", args.budget), ("triattention", args.budget), ("full", None))):
        write_run(args.out / "runs", scorer, budget, problems, args.samples, args, seed=10 + i)
    trace_bytes = sum(p.stat().st_size for p in (args.out / "runs").rglob("trace.jsonl"))
    records = 3 * len(problems) * args.samples
    print(f"synthetic runs: {records} records in {time.perf_counter() - start:.1f} s; trace.jsonl "
          f"{trace_bytes / 2**20:.1f} MiB ({trace_bytes / records / 1024:.1f} KiB per record)")
    start = time.perf_counter()
    summary = view_runs([args.out / "runs"], args.out / "viewer", baseline="triattention")
    took = time.perf_counter() - start
    index = (args.out / "viewer" / "data" / "index.js").stat().st_size
    print(f"view: {took:.1f} s; index.js {index / 1024:.0f} KiB; {summary['records']} problem files, "
          f"{summary['record_bytes'] / 2**20:.1f} MiB ({summary['record_bytes'] / summary['records'] / 1024:.1f} KiB "
          f"per (problem, sample) file, {summary['record_bytes'] / records / 1024:.1f} KiB per record)")


if __name__ == "__main__":
    main()
