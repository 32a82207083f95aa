"""Tokens/s at equal KV memory (`retention bench --memory-budget MIB`): what retention buys a machine
of fixed memory is slots, not a faster step at the same slots.

Per arm (an engine variant of the equal-slot benchmark: scorer x accounting, with its state), the
KiB one sequence holds at its peak is read off that arm's equal-slot measurement (`cache_peak_kib`:
the meter's peak, i.e. the full arm's prompt + new tokens, a retention arm's `b + N` bound as it was
reached, a state's own bytes where it reports them) and the arm gets `floor(memory / peak)` slots
(capped at `max_slots`). Every arm then decodes the same number of sequences (default: the most slots
any arm got, so each arm fills its slots at least once) of the same prompt, EOS ignored, through the
batched engine at its own slot count, refilling freed slots as a run does; prefills count in its
time (`tokens_per_second`). `decode_tokens_per_second` leaves out the time of starting sequences
(prefills, prefill compactions, first tokens: `EngineStats.start_seconds`): the figure of a long
generation, where a prompt's start is a small share, measured with a long prompt instead of thousands
of generated tokens (a step's cost depends on the tokens held, not on where they came from). Copies of
one prompt share one prefill forward (`Engine.share_prefill`). The arms step in turn (one engine step
of each, round robin, until all are done) so that machine noise hits them alike; an arm's tokens/s is
its tokens over the seconds of its own steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from retention.runtime.engine import Engine, Request, SamplingConfig
from retention.runtime.syncs import synced_now


@dataclass(frozen=True)
class MemoryArm:
    """One arm at equal memory: its peak KiB per sequence and the slots `memory_mib` holds."""

    variant: str
    accounting: str | None
    peak_kib: float
    slots: int
    capped: bool  # the memory held more than `max_slots` slots


def slots_at_memory(memory_mib: float, peak_kib: float, max_slots: int) -> tuple[int, bool]:
    """Sequences whose peak cache is `peak_kib` KiB that `memory_mib` MiB holds (floor; at most
    `max_slots`), and whether the cap cut them. A float ratio a hair under a whole number (KiB
    figures summed in floating point) still counts that slot."""
    if peak_kib <= 0:
        raise ValueError(f"peak KiB per sequence must be positive, got {peak_kib}")
    fit = math.floor(memory_mib * 1024 / peak_kib * (1 + 1e-12))
    return min(fit, max_slots), fit > max_slots


def plan_arms(rows: list[dict], memory_mib: float, max_slots: int) -> list[MemoryArm]:
    """The engine arms of equal-slot `rows` (one per (variant, accounting); reference variants on
    transformers' own cache are not engine arms) with their slots at `memory_mib`."""
    arms, seen = [], set()
    for r in rows:
        key = (r["variant"], r["accounting"])
        if r["accounting"] is None or key in seen:
            continue
        seen.add(key)
        slots, capped = slots_at_memory(memory_mib, r["cache_peak_kib"], max_slots)
        arms.append(MemoryArm(r["variant"], r["accounting"], r["cache_peak_kib"], slots, capped))
    return arms


def equal_memory_rows(loaded, prompt: list[int], arms: list[MemoryArm], policy_of, new_tokens: int,
                      sequences: int | None = None) -> list[dict]:
    """Decode `sequences` copies of `prompt` (`new_tokens` each) under every arm at its own slots,
    round robin (module doc). `policy_of(arm)`: a fresh `RetentionPolicy` of the arm. Arms with no
    slot (the memory does not hold one sequence) get a row with no figures."""
    run = [a for a in arms if a.slots > 0]
    Q = sequences or max((a.slots for a in run), default=0)
    dev = torch.device(loaded.device)
    cfg = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
    engines, policies = {}, {}
    for a in run:
        policies[a] = pol = policy_of(a)
        engines[a] = Engine(loaded.model, [Request(i, prompt) for i in range(Q)], pol, cfg, set(),
                            loaded.geometry.kib_per_token, batch_size=a.slots)
    seconds = {a: 0.0 for a in run}
    started = set()
    with torch.inference_mode():
        while any(a not in started or not engines[a].done for a in run):
            for a in run:
                eng = engines[a]
                if a in started and eng.done:
                    continue
                t0 = synced_now(dev)
                with policies[a].attach(loaded.model):
                    if a in started:
                        eng.step()
                    else:
                        eng.fill()
                        started.add(a)
                seconds[a] += synced_now(dev) - t0
    out = []
    for a in arms:
        row = {"variant": a.variant, "accounting": a.accounting, "peak_kib_per_sequence": a.peak_kib,
               "slots": a.slots, "slots_capped": a.capped, "sequences": Q if a.slots else 0,
               "tokens": None, "seconds": None, "tokens_per_second": None, "decode_tokens_per_second": None}
        if a.slots:
            st = engines[a].stats
            decode_s = seconds[a] - st.start_seconds  # the steps' own time: starts are what a long prompt costs
            row.update(tokens=st.tokens, seconds=seconds[a], tokens_per_second=st.tokens / seconds[a],
                       prefill_seconds=st.prefill_seconds, start_seconds=st.start_seconds, steps=st.steps,
                       decode_tokens_per_second=(st.tokens - st.finished) / decode_s if decode_s > 0 else None)
        out.append(row)
    full = next((r for r in out if r["variant"] == "full" and r["tokens_per_second"]), None)
    for r in out:
        for key, ratio in (("tokens_per_second", "vs_full"), ("decode_tokens_per_second", "decode_vs_full")):
            r[ratio] = r[key] / full[key] if full is not None and r[key] and full[key] else None
    return out


def format_memory_table(memory_mib: float, rows: list[dict], equal_slot: list[dict]) -> str:
    """The equal-memory table beside the equal-slot figures of the same arms (one line per arm)."""
    same = {(r["variant"], r["accounting"]): r for r in equal_slot}
    full_same = next((r for r in equal_slot if r["variant"] == "full"), None)
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"equal memory: {memory_mib:g} MiB of KV cache per arm",
             f"{'arm':>22} {'KiB/seq':>9} | {'slots':>5} {'tok/s':>9} {'x full':>6} {'decode':>9} {'x full':>6} | "
             f"{'slots':>5} {'tok/s':>9} {'x full':>6}   (equal memory, all / decode steps only | equal slots)"]
    for r in rows:
        s = same[(r["variant"], r["accounting"])]
        x_same = s["tokens_per_second"] / full_same["tokens_per_second"] if full_same else None
        cap = "+" if r["slots_capped"] else " "
        lines.append(f"{r['variant'] + '/' + r['accounting']:>22} {r['peak_kib_per_sequence']:9.1f} | "
                     f"{r['slots']:>4}{cap} {fmt(r['tokens_per_second'], '9.1f')} {fmt(r['vs_full'], '6.2f')} "
                     f"{fmt(r['decode_tokens_per_second'], '9.1f')} {fmt(r['decode_vs_full'], '6.2f')} | "
                     f"{s['batch_size']:>5} {s['tokens_per_second']:9.1f} {fmt(x_same, '6.2f')}")
    if any(r["slots_capped"] for r in rows):
        lines.append("+: the memory holds more slots than --memory-max-slots; capped there")
    return "\n".join(lines)
