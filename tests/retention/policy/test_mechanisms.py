"""The non-scoring families: cadence, routing, state, decoding (retention.policy.*, retention.runs.spec).

Each test holds an invariant of one mechanism on tiny random models; the contract kit
(`retention check FAMILY:NAME`) is exercised on every built-in and on broken examples."""

from __future__ import annotations

import json

import pytest
import torch

from retention.contract.families import run_family_checks
from retention.errors import RetentionError
from retention.models import load_model
from retention.runs.arms import validate_arm
from retention.policy.cadence.newline import NewlineCadence
from retention.policy.decoding.loop_guard import LoopGuard
from retention.models.loading import model_layout
from retention.runtime.engine import Engine, Request, SamplingConfig, run_engine
from retention.policy.registry import FAMILIES
from retention.policy.state.quant import Quant, _quantise_keys, _quantise_values

BASE = {"model": "tiny-random", "scorer": "streaming", "budget": 24}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def _decode(tiny, spec, prompts, new=48, batch=4, newline_ids=None):
    policy = spec.policy()
    policy.prepare(tiny.tokenizer)
    if newline_ids is not None:
        policy.cadence._newlines.clear()
        policy.cadence._newlines.update(newline_ids)
    out = {}
    run_engine(tiny.model, [Request(i, p, i) for i, p in enumerate(prompts)], policy,
               SamplingConfig(max_new_tokens=new, temperature=0.0, ignore_eos=True), set(), tiny.geometry.kib_per_token,
               batch_size=batch, on_finish=lambda r, g: out.__setitem__(r.key, g))
    return out, policy


PROMPTS = [list(range(5 + i, 30 + 6 * i)) for i in range(6)]


def test_defaults_spelled_out_are_the_same_arm():
    """A family at its default, named or not, is the same configuration (and hash) as today's."""
    plain = validate_arm(BASE)
    named = validate_arm(dict(BASE, cadence="fixed", routing="native", state="full", decoding="none"))
    assert plain.hash == named.hash and plain.config == named.config
    assert not any(k in plain.config for k in FAMILIES)


def test_canonical_form_records_every_parameter():
    """{"state": "quant"} and {"state": {"name": "quant", "params": {"bits": 8}}} are one arm: the
    configuration holds every parameter with its resolved value."""
    a = validate_arm(dict(BASE, state="quant"))
    b = validate_arm(dict(BASE, state={"name": "quant", "params": {"bits": 8}}))
    assert a.hash == b.hash
    assert a.config["state"] == {"name": "quant", "params": {"bits": 8, "group": 16, "keys": "channel", "residual": 32}}
    c = validate_arm(dict(BASE, state={"name": "quant", "params": {"bits": 4}}))
    assert c.hash != a.hash


@pytest.mark.parametrize(("cfg", "message"), [
    ({"state": "zip"}, "unknown state 'zip'; known: full, merge, quant"),
    ({"state": {"name": "quant", "params": {"bitz": 4}}}, "state 'quant' has no parameter(s) ['bitz']"),
    ({"state": {"name": "quant", "params": {"bits": 3}}}, "quant.bits must be 8 or 4"),
    ({"decoding": {"name": "loop-guard", "params": {"ngram": 1}}}, "loop-guard.ngram must be at least 2"),
    ({"cadence": {"name": "newline", "params": {"max_wait": -1}}}, "newline.max_wait must be >= 0"),
    ({"routing": "shared"}, "routing 'shared' chooses a scorer's kept-set structure (triattention, alpha); "
                            "scorer 'streaming' has one of its own"),
    ({"state": ["quant"]}, "state must be a name or"),
    ({"scorer": "full", "budget": None, "state": "merge"}, "--state merge act(s) at compactions"),
    ({"model": "tiny-mla", "state": "quant"}, "state 'quant' stores per-layer keys and values"),
])
def test_bad_mechanisms_are_refused_in_one_line(cfg, message):
    with pytest.raises(RetentionError) as exc:
        validate_arm(dict(BASE, **cfg))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_structure_routing_needs_a_scorer_with_a_choice():
    """`--routing per-layer` sets the kept-set structure of a scorer that offers two (triattention,
    alpha: `tests/retention/runs/test_canonical.py` holds its spellings to one hash); a scorer with one
    structure of its own is refused in one line."""
    base = dict(BASE, scorer="h2o")
    with pytest.raises(RetentionError, match="routing 'per-layer' chooses a scorer's kept-set structure"):
        validate_arm(dict(base, routing="per-layer"))


def test_loop_guard_blocks_the_repetition_it_targets():
    """A history that repeats a 4-gram twice: the token completing its third occurrence is banned, and
    only that token; below the count nothing is."""
    g = LoopGuard(ngram=4, max_repeats=2, window=64)
    g.reset_slot(0, 0)
    loop = [7, 8, 9, 10]
    hist = [1, 2] + loop * 2 + loop[:3]  # the prefix (8, 9, 10)... completes 7-8-9-10? the last 3 are 7 8 9
    logits = torch.zeros(1, 32)
    out = g.adjust(logits, [0], [hist])
    assert torch.isinf(out[0, 10]) and int(torch.isinf(out).sum()) == 1
    g.reset_slot(1, 0)
    assert torch.equal(g.adjust(logits, [1], [[1, 2] + loop + loop[:3]]), logits)  # seen once: allowed


def test_loop_guard_output_never_repeats_an_ngram_past_the_limit(tiny):
    """Greedy tiny-random repeats bigrams (4 times in 200 tokens); under the guard no n-gram occurs
    more than max_repeats times within the window in any output."""
    n, r = 2, 2
    plain, _ = _decode(tiny, validate_arm(BASE), PROMPTS, new=200)
    guarded, _ = _decode(tiny, validate_arm(dict(BASE, decoding={"name": "loop-guard", "params": {
        "ngram": n, "max_repeats": r, "window": 512}})), PROMPTS, new=200)

    def worst(tokens):
        grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
        return max(grams.count(x) for x in grams)

    assert max(worst(g.token_ids) for g in plain.values()) > r  # the unguarded model loops
    assert max(worst(g.token_ids) for g in guarded.values()) <= r


def test_newline_cadence_compacts_at_line_breaks_and_holds_the_mean(tiny):
    """Compactions happen when the written token is a line break (after b + N) or at b + N + max_wait;
    the measured mean never exceeds B (the span rule)."""
    spec = validate_arm(dict(BASE, interval=8, cadence={"name": "newline", "params": {"max_wait": 6}}))
    c = spec.cadence
    assert isinstance(c, NewlineCadence) and c.nominal == 24 - (8 + 6) // 2 - 1
    newline = set(range(0, 259, 3))  # a third of the vocabulary ends a "line": both rules fire
    gens, policy = _decode(tiny, spec, PROMPTS, new=80, newline_ids=newline)
    for g in gens.values():
        assert g.meter.mean <= 24 and g.meter.peak <= c.nominal + c.span
        assert g.meter.compactions > 1
    c = policy.cadence  # the run's own copy, which read the line breaks
    assert not c.due(c.nominal + 7, False, 0, token=0)  # below b + N: never
    assert not c.due(c.nominal + 8, False, 0, token=1) and c.due(c.nominal + 8, False, 0, token=0)
    assert c.due(c.nominal + 14, False, 0, token=1)  # b + N + max_wait: whatever the token
    assert not spec.cadence._newlines  # the spec itself never changes


def test_quantisation_error_is_within_half_a_step():
    """Per-channel key chunks and per-token value groups: |x - deq(x)| <= (max - min) / (2^bits - 1) / 2."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 20, 16, generator=g, dtype=torch.float64)
    new = torch.ones(1, 2, 20, dtype=torch.bool)
    cidx = (torch.arange(20) // 8).expand(1, 2, 20)
    for bits in (8, 4):
        k = _quantise_keys(x, new, cidx, bits).double()
        for c in range(3):
            grp = x[:, :, cidx[0, 0] == c]
            step = (grp.amax(2, keepdim=True) - grp.amin(2, keepdim=True)) / (2 ** bits - 1)
            assert bool(((k[:, :, cidx[0, 0] == c] - grp).abs() <= step / 2 + 1e-12).all())
        v = _quantise_values(x, 8, bits).double().view(1, 2, 20, 2, 8)
        xv = x.view(1, 2, 20, 2, 8)
        step = (xv.amax(-1, keepdim=True) - xv.amin(-1, keepdim=True)) / (2 ** bits - 1)
        assert bool(((v - xv).abs() <= step / 2 + 1e-12).all())
        assert not torch.equal(k, x)  # it did quantise


@pytest.mark.parametrize("bits", [8, 4])
def test_quant_state_stores_fewer_bytes_for_the_same_tokens(tiny, bits):
    """At the same token budget the quantised tail stores fewer KiB than full precision (int4 fewer
    than int8), tokens are metered identically, and the meter equals the buffers' recount."""
    full, _ = _decode(tiny, validate_arm(BASE), PROMPTS)
    spec = validate_arm(dict(BASE, state={"name": "quant", "params": {"bits": bits, "residual": 4, "group": 8}}))
    quant, policy = _decode(tiny, spec, PROMPTS)
    for k in full:
        assert quant[k].meter.mean == full[k].meter.mean
        assert quant[k].meter.mean_kib < full[k].meter.mean_kib
    if bits == 4:
        eight, _ = _decode(tiny, validate_arm(dict(BASE, state={"name": "quant", "params": {
            "bits": 8, "residual": 4, "group": 8}})), PROMPTS)
        assert all(quant[k].meter.mean_kib < eight[k].meter.mean_kib for k in quant)


def test_quant_state_holds_more_tokens_at_the_same_bytes():
    """--budget-bytes: the KiB of 256 full-precision tokens hold more tokens in the quantised tail
    (int4 more than int8), and the full-precision arm keeps the budget `run` converted."""
    kib = 256 * model_layout("tiny-random", "float32").bytes_per_token / 1024
    full = validate_arm(dict(BASE, budget=256, budget_kib=kib))
    q8 = validate_arm(dict(BASE, budget=256, budget_kib=kib, state="quant"))
    q4 = validate_arm(dict(BASE, budget=256, budget_kib=kib, state={"name": "quant", "params": {"bits": 4}}))
    assert full.cadence.budget == 256 < q8.cadence.budget < q4.cadence.budget
    with pytest.raises(RetentionError, match="holds no token"):
        validate_arm(dict(BASE, budget=1, budget_kib=1e-6, state="quant"))


def test_merge_state_conserves_the_tokens_it_represents(tiny):
    """With threshold -1 every evicted token merges into a kept one: in every (layer, head) the kept
    tokens' represented counts add up to every token the sequence has written."""
    spec = validate_arm(dict(BASE, state={"name": "merge", "params": {"threshold": -1.0}}))
    policy = spec.policy()
    prompt = PROMPTS[2]
    eng = Engine(tiny.model, [Request(0, prompt, 0)], policy, SamplingConfig(max_new_tokens=60, ignore_eos=True),
                 set(), 1.0)
    with torch.inference_mode(), policy.attach(tiny.model):
        eng.fill()
        while len(eng.rows[0].out) < 50:
            eng.step()
    st, cache = eng.rows[0], eng.cache
    written = len(prompt) + len(st.out) - 1  # the newest sampled token is not in the cache yet
    assert st.meter.compactions >= 2 and cache.lengths[0] < written
    for layer in cache.layers:
        represented = 1 + layer.extra["merge.count"][0, :, :cache.lengths[0]]
        assert torch.allclose(represented.sum(-1), torch.full((represented.shape[0],), float(written)))


def test_mechanism_plugins_from_a_file_run_and_are_identified(tmp_path):
    """A decoding plugin given as file.py:Class runs; its identity (source sha256) is in the
    configuration, and a changed file is refused against the registered identity."""
    plugin = tmp_path / "guard.py"
    plugin.write_text("from dataclasses import dataclass\nfrom retention.policy.decoding.base import Decoding\n\n"
                      "@dataclass\nclass Quiet(Decoding):\n    name = 'quiet'\n    ban: int = 3\n\n"
                      "    def adjust(self, logits, rows, histories):\n        out = logits.clone()\n"
                      "        out[:, self.ban] = float('-inf')\n        return out\n")
    spec = validate_arm(dict(BASE, decoding={"name": f"{plugin}:Quiet", "params": {"ban": 5}}))
    rec = spec.config["decoding"]
    assert rec["params"] == {"ban": 5} and rec["plugin"]["sources_sha256"]
    registered = json.loads(json.dumps(rec))
    plugin.write_text(plugin.read_text().replace("ban: int = 3", "ban: int = 4"))
    from retention.plugins import _loaded

    _loaded.clear()
    with pytest.raises(RetentionError, match="the decoding plugin changed since it was registered"):
        validate_arm(dict(BASE, decoding=registered))


@pytest.mark.parametrize(("target", "params"), [
    ("state:quant", {}), ("state:merge", {}), ("decoding:loop-guard", {}),
    ("cadence:newline", {"max_wait": 4}), ("cadence:newline", {}), ("routing:pyramidkv", {}), ("routing:adakv", {}),
])
def test_every_builtin_mechanism_passes_its_checks(target, params):
    family, name = target.split(":")
    results = run_family_checks(family, name, params)
    assert all(r.ok is not False for r in results), [r.line() for r in results if r.ok is False]
    names = {r.name for r in results}
    assert {"batch invariance", "resume", "default exact", "mean budget held"} <= names
    if family == "routing":  # the allocating routings: they allocate, and their trivial member is checked
        assert {"routing allocation", "trivial member exact"} <= names


BROKEN = {
    # A state whose meter reports what its buffers do not hold.
    "liar.py": ("from dataclasses import dataclass\nfrom retention.policy.state.base import State\n\n@dataclass\n"
                "class Liar(State):\n    name = 'liar'\n    def row_kib(self, cache, row, kib_per_token):\n"
                "        return 0.5 * cache.lengths[row] * kib_per_token\n", "state", "Liar", "physical eviction"),
    # A decoding mechanism that claims a trivial member but changes the output under it.
    "noisy.py": ("from dataclasses import dataclass\nfrom retention.policy.decoding.base import Decoding\n\n@dataclass\n"
                 "class Noisy(Decoding):\n    name = 'noisy'\n    strength: float = 0.0\n    @classmethod\n"
                 "    def trivial(cls):\n        return {'strength': 0.0}\n    def adjust(self, logits, rows, histories):\n"
                 "        out = logits.clone()\n        out[:, 1] += 1e3\n        return out\n",
                 "decoding", "Noisy", "trivial member exact"),
    # A decoding mechanism whose output depends on the other rows of the batch.
    "coupled.py": ("from dataclasses import dataclass\nfrom retention.policy.decoding.base import Decoding\n\n@dataclass\n"
                   "class Coupled(Decoding):\n    name = 'coupled'\n    def adjust(self, logits, rows, histories):\n"
                   "        return logits + logits.mean(0, keepdim=True)[:, :1] * 0 + (len(rows) > 1) * logits.roll(1, -1)\n",
                   "decoding", "Coupled", "batch invariance"),
    # An allocating routing whose counts depend on the other rows of the view.
    "pooled.py": ("from dataclasses import dataclass\nimport torch\nfrom retention.policy.routing.adakv import AdaKV\n\n"
                  "@dataclass\nclass Pooled(AdaKV):\n    name = 'pooled'\n    def allocate(self, scores, view, k):\n"
                  "        pooled = torch.nan_to_num(scores, posinf=0.0, neginf=0.0).mean(1, keepdim=True)\n"
                  "        return super().allocate(pooled.expand_as(scores), view, k)\n",
                  "routing", "Pooled", "batch invariance"),
    # An allocating routing that keeps one token more than the uniform mean in every row.
    "greedy.py": ("from dataclasses import dataclass\nfrom retention.policy.routing.adakv import AdaKV\n\n@dataclass\n"
                  "class Greedy(AdaKV):\n    name = 'greedy'\n    def allocate(self, scores, view, k):\n"
                  "        counts = super().allocate(scores, view, k).clone()\n        counts[0] += 1\n"
                  "        return counts\n", "routing", "Greedy", "kept count"),
}


@pytest.mark.parametrize("file", sorted(BROKEN))
def test_broken_mechanisms_fail_the_right_check(tmp_path, file):
    text, family, cls, check = BROKEN[file]
    path = tmp_path / file
    path.write_text(text)
    results = run_family_checks(family, f"{path}:{cls}", {})
    failed = {r.name for r in results if r.ok is False}
    assert check in failed, [r.line() for r in results]


def test_a_record_over_its_byte_budget_is_flagged(tiny):
    """Per-channel key chunks thin out under eviction, so the estimate can be exceeded: the meter
    measures the bytes and flags a record whose mean KiB is over --budget-bytes; per-token keys cost
    a fixed amount and hold it."""
    kib = 24 * tiny.geometry.kib_per_token
    for keys in ("channel", "token"):
        spec = validate_arm(dict(BASE, budget=24, budget_kib=kib, interval=4,
                                 state={"name": "quant", "params": {"residual": 2, "group": 8, "keys": keys}}))
        gens, _ = _decode(tiny, spec, PROMPTS, new=64)
        for g in gens.values():
            assert g.meter.exceeded == (g.meter.mean_kib > kib * (1 + 1e-12) or g.meter.mean > spec.cadence.budget)
        if keys == "token":
            assert not any(g.meter.exceeded for g in gens.values())
            assert spec.cadence.budget > 24  # more tokens for the same bytes
