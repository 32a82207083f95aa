"""The slot count of a run: how many sequences decode together (`--batch-size`).

The engine's static step (`retention.runtime.engine`) runs every decode step on all `S` slots, so a
record depends on `S` (in bfloat16 the kernels round differently for each row count) and on nothing
else that shares its batch. A run therefore fixes its slot count: `S` is the batch size, at most the
run's number of (problem, sample) pairs; it is written into the run directory's `config.json`
(`slots`, beside the hashed configuration) and into every record (`slots`), and a resumed run decodes
at the recorded count: an explicit `--batch-size` that asks for another one is refused, an automatic
choice takes the recorded one.

Without `--batch-size` the count is chosen for the device (`auto_batch_size`): as many slots as the
caches fit in a share of the memory available now (free GPU memory on CUDA, MemAvailable on a CPU),
capped, and said in one line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from protocol.io import load_json_object, write_json
from retention.errors import RetentionError
from retention.memory import available_bytes

MEMORY_SHARE = 0.5  # of the memory available when the run starts
MAX_SLOTS = {"cuda": 256, "cpu": 64}  # a CPU gains little past 64 rows, and a tail of padding rows costs more


@dataclass(frozen=True)
class SlotChoice:
    """An automatic slot count and the one line that says why."""

    slots: int
    why: str


def slot_kib(cadence, kib_per_token: float, longest_prompt: int, max_new_tokens: int, fidelity: bool) -> float:
    """KiB one slot's caches hold at most: the retained cache's capacity (`b + N`, the prompt on top
    with `protect_prompt`; prompt + new tokens for a policy that never evicts) and, with fidelity,
    the full cache decoded alongside."""
    full = longest_prompt + max_new_tokens
    if cadence.evicts:
        tokens = cadence.nominal + cadence.span + (longest_prompt if cadence.protect_prompt else 0)
    else:
        tokens = full
    return (tokens + (full if fidelity else 0)) * kib_per_token


def auto_batch_size(loaded, cadences, max_new_tokens: int, longest_prompt: int = 512,
                    fidelity: bool = False, pairs: int | None = None) -> SlotChoice:
    """The largest slot count whose caches (the largest of `cadences`' arms) fit in `MEMORY_SHARE`
    of the available memory, at most `MAX_SLOTS` for the device type and the run's `pairs`."""
    kind = torch.device(loaded.device).type
    cap = MAX_SLOTS.get(kind, MAX_SLOTS["cpu"])
    per_slot = max(slot_kib(c, loaded.geometry.kib_per_token, longest_prompt, max_new_tokens, fidelity)
                   for c in cadences)
    avail = available_bytes(loaded.device)
    few = f", as many as the run's {pairs} sequences" if pairs is not None and pairs < cap else ""
    if avail is None:
        slots = min(16, pairs or 16)
        return SlotChoice(slots, f"batch size {slots} (automatic for {kind}: available memory unknown{few}; "
                                 "set it with --batch-size)")
    fit = int(MEMORY_SHARE * avail / (per_slot * 1024))
    slots = max(1, min(cap, fit, pairs or cap))
    bound = f"{fit} fit" if fit < min(cap, pairs or cap) else (few[2:] if few else f"capped at {cap}")
    return SlotChoice(slots, f"batch size {slots} (automatic for {kind}: {per_slot:,.0f} KiB of cache per "
                             f"slot, {100 * MEMORY_SHARE:.0f}% of {avail / 2**30:.1f} GiB available, {bound}; "
                             "set it with --batch-size)")


def recorded_slots(run) -> int | None:
    """The slot count a run directory was decoded at: its `config.json`'s `slots`, else that of
    its records (written before the run directory recorded it), else None."""
    meta = load_json_object(run.path / "config.json", "run configuration")
    if isinstance(meta.get("slots"), int):
        return meta["slots"]
    seen = {r.get("slots") for r in run.records.done.values()} - {None}
    return seen.pop() if len(seen) == 1 else None


def resolve_slots(arms, batch_size: int, pairs: int, explicit: bool) -> list[int]:
    """Each arm's slot count, pinned into its run directory before anything is decoded: the batch
    size (at most `pairs`), or the count its run directory recorded. A recorded count that an
    explicit `--batch-size` contradicts is refused in one line naming both."""
    wanted = max(1, min(batch_size, pairs))
    out = []
    for arm in arms:
        got = recorded_slots(arm.run)
        if got is not None and got != wanted:
            if explicit:
                raise RetentionError(f"{arm.run.path} was decoded at {got} slots, --batch-size {batch_size} asks for "
                                     f"{wanted}: a record depends on the slot count, so resume with --batch-size {got} "
                                     "(or write to another --out)")
            print(f"{arm.run.path.name}: resuming at its recorded {got} slots", file=sys.stderr)
        out.append(wanted if got is None else got)
    for arm, slots in zip(arms, out):
        pin_slots(arm.run, slots)
    return out


def pin_slots(run, slots: int) -> None:
    """Write `slots` into the run directory's `config.json` (outside the hashed configuration)."""
    path = run.path / "config.json"
    meta = load_json_object(path, "run configuration")
    if meta.get("slots") != slots:
        write_json(path, dict(meta, slots=slots))
