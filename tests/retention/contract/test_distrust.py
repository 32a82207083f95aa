"""The contract kit trusts no self-report (issue 46): each broken mechanism of
`tests/retention/data/broken_mechanisms.py` fails a named check of `retention check`, and the run
refuses it in one line at its first compaction (`retention.policy.guard.GuardedPolicy`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retention.contract.families import run_family_checks
from retention.errors import RetentionError
from retention.runs.arms import validate_arm
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.policy.guard import GuardedPolicy, logits_refusal, stored_kib_floor

BROKEN = Path(__file__).parents[1] / "data" / "broken_mechanisms.py"

# (family, class, the check that must fail, words its line must hold)
CASES = [
    ("state", "ClaimsInt4", "bytes recounted", "buffers need at least"),
    ("state", "NanBytes", "bytes recounted", "not a finite number"),
    ("routing", "KeepsThreeMore", "kept count", "the routing kept"),
    ("decoding", "OneColumnShort", "decoding output", "returned logits"),
    ("cadence", "NeverDue", "mean budget held", "outgrow its buffers"),
]
# The whole kit per case (3-8 s each): the cheapest stays in the fast tier, the others are slow.
FAST_CASE = "NeverDue"


@pytest.mark.parametrize("family,cls,check,words", [
    pytest.param(*c, id=c[1], marks=() if c[1] == FAST_CASE else pytest.mark.slow) for c in CASES])
def test_broken_mechanism_fails_a_named_check(family, cls, check, words):
    results = run_family_checks(family, f"{BROKEN}:{cls}", {}, share=False)
    named = {r.name: r for r in results}
    assert check in named, [r.line() for r in results]
    assert named[check].ok is False and words in named[check].detail, named[check].line()


@pytest.mark.parametrize("family,cls,words", [
    ("state", "ClaimsInt4", "buffers need at least"),
    ("state", "NanBytes", "not a finite number"),
    ("routing", "KeepsThreeMore", "kept at a compaction to k"),
    ("decoding", "OneColumnShort", "returned logits"),
    ("cadence", "NeverDue", "outgrow"),
], ids=["ClaimsInt4", "NanBytes", "KeepsThreeMore", "OneColumnShort", "NeverDue"])
def test_run_refuses_a_broken_plugin_at_its_first_compaction(tiny, family, cls, words):
    spec = validate_arm({"model": "tiny-random", "scorer": "snapkv", "budget": 24, "interval": 4,
                         family: f"{BROKEN}:{cls}"})
    policy = spec.policy()
    assert isinstance(policy, GuardedPolicy)
    reqs = [Request(i, list(range(3 + i, 40 + 3 * i)), i) for i in range(3)]
    with pytest.raises(RetentionError, match=words) as err:
        run_engine(tiny.model, reqs, policy, SamplingConfig(max_new_tokens=40, ignore_eos=True), set(), 1.0,
                   batch_size=3)
    assert "\n" not in str(err.value)


def test_honest_builtins_run_unguarded_and_the_floor_holds_for_quant(tiny):
    spec = validate_arm({"model": "tiny-random", "scorer": "snapkv", "budget": 24, "interval": 4, "state": "quant"})
    assert not isinstance(spec.policy(), GuardedPolicy)  # built-ins are checked by the kit, not per run
    floors = []

    class Watch(GuardedPolicy):
        def after_forward(self, cache, next_position, meter, prefill, tokens=None):
            did = super().after_forward(cache, next_position, meter, prefill, tokens)
            for r in range(cache.rows):
                m = meter[r] if isinstance(meter, list) else meter
                if m is not None:
                    floors.append((stored_kib_floor(cache, r, self.state, m.kib_per_token),
                                   self.state.row_kib(cache, r, m.kib_per_token), cache.lengths[r] * m.kib_per_token))
            return did

    p = spec.policy()
    policy = Watch(p.scorer, p.cadence, p.routing, p.state, p.decoding, plugins=("state:quant",))
    model = tiny.model.to(torch.float64)
    try:
        reqs = [Request(i, list(range(3 + i, 40 + 3 * i)), i) for i in range(3)]
        run_engine(model, reqs, policy, SamplingConfig(max_new_tokens=40, ignore_eos=True), set(), 1.0, batch_size=3)
    finally:
        tiny.model.to(torch.float32)
    assert floors and all(metered >= floor * (1 - 1e-9) for floor, metered, _ in floors)
    assert any(floor < full * 0.9 for floor, _, full in floors)  # quantised values were recognised as codes


def test_logits_refusal_lines():
    x = torch.zeros(2, 5)
    assert logits_refusal("d", x, x) is None
    assert "returned logits (2, 4)" in logits_refusal("d", x, x[:, :-1])
    assert "NaN" in logits_refusal("d", x, x.clone().fill_(float("nan")))
    assert "banned every token" in logits_refusal("d", x, x.clone().fill_(float("-inf")))
    assert "returned logits (2, 5) torch.float64" in logits_refusal("d", x, x.double())
