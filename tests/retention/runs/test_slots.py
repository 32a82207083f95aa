"""`--batch-size auto`: the largest slot count whose caches fit in a stated share of the memory
available, capped, said in one line."""

from types import SimpleNamespace

import pytest

from retention.runs import slots
from retention.policy.composite import cadence_for
from retention.policy.registry import make_scorer

KIB = 36.0  # KiB per token (e.g. a 24-layer model, 2 KV heads of 64, bf16: 24 x 2 x 2 x 64 x 2 B)


def loaded(device="cpu"):
    return SimpleNamespace(device=device, geometry=SimpleNamespace(kib_per_token=KIB))


def cadence(name, budget=128, protect_prompt=False):
    sc = make_scorer(name)
    return cadence_for(sc, budget if sc.evicts else None, protect_prompt=protect_prompt)


def test_slot_kib_counts_the_capacity_and_the_fidelity_cache():
    c = cadence("streaming")
    assert slots.slot_kib(c, KIB, 200, 768, False) == (c.nominal + c.span) * KIB
    assert slots.slot_kib(c, KIB, 200, 768, True) == (c.nominal + c.span + 968) * KIB
    assert slots.slot_kib(cadence("streaming", protect_prompt=True), KIB, 200, 768, False) == \
        (c.nominal + c.span + 200) * KIB
    assert slots.slot_kib(cadence("full"), KIB, 200, 768, False) == 968 * KIB


@pytest.mark.parametrize("gib,fidelity,want", [(64.0, False, 64), (0.5, False, 7), (0.5, True, 3), (0.0001, True, 1)])
def test_auto_picks_the_largest_count_that_fits(monkeypatch, gib, fidelity, want):
    monkeypatch.setattr(slots, "available_bytes", lambda device: int(gib * 2**30))
    cs = [cadence("streaming"), cadence("full")]  # the largest arm's caches decide
    per_slot = max(slots.slot_kib(c, KIB, 200, 768, fidelity) for c in cs) * 1024
    choice = slots.auto_batch_size(loaded(), cs, 768, 200, fidelity)
    assert choice.slots == want == max(1, min(64, int(slots.MEMORY_SHARE * gib * 2**30 / per_slot)))
    assert choice.why.startswith(f"batch size {want} (automatic for cpu: ")
    assert f"{per_slot / 1024:,.0f} KiB of cache per slot, 50% of" in choice.why
    assert ("capped at 64" in choice.why) == (want == 64)


def test_cuda_cap_and_unknown_memory(monkeypatch):
    monkeypatch.setattr(slots, "available_bytes", lambda device: 10**15)
    assert slots.auto_batch_size(loaded("cuda"), [cadence("streaming")], 768, 200).slots == 256
    monkeypatch.setattr(slots, "available_bytes", lambda device: None)
    choice = slots.auto_batch_size(loaded(), [cadence("streaming")], 768, 200)
    assert choice.slots == 16 and "available memory unknown" in choice.why


def test_available_memory_is_read_on_this_cpu():
    got = slots.available_bytes("cpu")
    assert got is None or got > 0


def test_auto_says_when_the_run_is_smaller_than_what_fits(monkeypatch):
    monkeypatch.setattr(slots, "available_bytes", lambda device: 64 * 2**30)
    choice = slots.auto_batch_size(loaded(), [cadence("streaming")], 768, 200, pairs=6)
    assert choice.slots == 6 and "as many as the run's 6 sequences" in choice.why
    monkeypatch.setattr(slots, "available_bytes", lambda device: 2**20)  # memory binds before the pairs do
    assert slots.auto_batch_size(loaded(), [cadence("full")], 768, 200, pairs=6).slots == 1
