"""The `quant` state's packed store against its simulated one (retention.policy.state.quant): which
configurations run which store, records on tiny random models, bytes from the tensors, and the
contract kit's check of them (`retention check state:quant`)."""

from __future__ import annotations

import pytest
import torch

import retention.policy.state.quant as quant_mod
from retention.contract.families import run_family_checks
from retention.models import load_model
from retention.policy.registry import new_run_entry
from retention.policy.state.quant import Quant
from retention.runs.arms import validate_arm
from retention.runs.scorer_options import mechanism_options
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.runtime.packed_kv import PackSpec, decode, encode, grid

BASE = {"model": "tiny-random", "scorer": "streaming", "budget": 24, "interval": 4}
PROMPTS = [list(range(5 + i, 30 + 6 * i)) for i in range(6)]
WRITTEN = {"bits": 8, "group": 16, "keys": "channel", "residual": 32}  # a configuration before `store`


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def test_a_configuration_without_store_is_the_simulated_store_with_its_hash():
    """Absent means simulated (recorded as absent: the hash it had); `store: simulated` is the same
    arm; packed is recorded; the entry points of new runs name packed."""
    old = validate_arm(dict(BASE, state={"name": "quant", "params": WRITTEN}))
    same = validate_arm(dict(BASE, state={"name": "quant", "params": dict(WRITTEN, store="simulated")}))
    new = validate_arm(dict(BASE, state={"name": "quant", "params": dict(WRITTEN, store="packed")}))
    assert old.config["state"] == {"name": "quant", "params": WRITTEN} and old.hash == same.hash
    assert new.config["state"]["params"] == dict(WRITTEN, store="packed") and new.hash != old.hash
    assert old.policy().state.store == "simulated" and new.policy().state.store == "packed"
    assert new_run_entry("state", "quant") == {"name": "quant", "params": {"store": "packed"}}
    assert new_run_entry("state", {"name": "quant", "params": {"store": "simulated"}})["params"] == {"store": "simulated"}
    assert new_run_entry("state", "merge") == "merge"
    _, entries = mechanism_options(("quant.bits=4",), {"state": "quant"}, ["streaming"])  # `retention run --state quant`
    assert entries["state"] == {"name": "quant", "params": {"bits": 4, "store": "packed"}}
    with pytest.raises(Exception, match="quant.store must be packed or simulated"):
        validate_arm(dict(BASE, state={"name": "quant", "params": {"store": "zip"}}))


def _decode(tiny, state, scorer="streaming", new=48, dtype=torch.float64, batch=4):
    model = tiny.model.to(dtype)
    spec = validate_arm(dict(BASE, scorer=scorer, state=state))
    policy = spec.policy()
    out = {}
    run_engine(model, [Request(i, p, i) for i, p in enumerate(PROMPTS)], policy,
               SamplingConfig(max_new_tokens=new, temperature=0.0, ignore_eos=True), set(), 1.0,
               batch_size=batch, keep_logits=True, on_finish=lambda r, g: out.__setitem__(r.key, g))
    tiny.model.to(torch.float32)
    return out


def _packed_grid_minmax(x, lo, hi, bits):
    """The simulated store's quantise-dequantise on the packed store's float16 grid (`packed_kv.grid`)."""
    g = grid(lo, hi, bits)
    return encode(x, g, bits).float() * g[..., 0].float() + g[..., 1].float()


@pytest.mark.parametrize("scorer,bits,keys", [("streaming", 8, "channel"), ("streaming", 4, "token"),
                                              ("h2o", 4, "channel"), ("snapkv", 8, "token")])
def test_packed_records_are_the_simulated_ones_on_the_same_grid(tiny, monkeypatch, scorer, bits, keys):
    """float64, several quantisation events and compactions per sequence, 6 sequences in 4 slots:
    where the arithmetic is the same (the simulated store given the packed store's float16 grid),
    the packed store's tokens and meters are the simulated store's and its logits within 1e-9
    (what is left: the chunked attention's summation order); a scorer that reads keys (H2O, SnapKV)
    reads them dequantised."""
    params = {"residual": 4, "group": 8, "bits": bits, "keys": keys}
    packed = _decode(tiny, {"name": "quant", "params": dict(params, store="packed")}, scorer)
    monkeypatch.setattr(quant_mod, "_minmax_quantise", _packed_grid_minmax)
    simulated = _decode(tiny, {"name": "quant", "params": dict(params, store="simulated")}, scorer)
    for k, g in packed.items():
        s = simulated[k]
        assert g.token_ids == s.token_ids and g.meter.summary() == s.meter.summary()
        assert g.meter.compactions >= 4
        worst = max(float((a - b).abs().max()) for a, b in zip(g.step_logits, s.step_logits))
        assert worst < 1e-9, worst


def test_packed_against_simulated_records_the_same_bytes_and_a_bounded_difference(tiny):
    """On its own grid (float16 scales, the simulated store's float32) the packed store quantises
    the same tokens at the same steps, so the meters are equal; each dequantised element differs
    from the simulated one by at most one step of its group (both round to the nearest code of
    grids a float16 rounding apart), and the logits stay as close to the full cache as the
    simulated store's (float32)."""
    params = {"residual": 4, "group": 8, "bits": 8}
    got = {s: _decode(tiny, {"name": "quant", "params": dict(params, store=s)}, dtype=torch.float32)
           for s in ("packed", "simulated")}
    full = _decode(tiny, None, dtype=torch.float32)
    for k in got["packed"]:
        assert got["packed"][k].meter.summary() == got["simulated"][k].meter.summary()
    def deviation(g):  # the largest logit error against the full cache while the tokens are the full cache's
        out = 0.0
        for k in g:
            n = next((i for i, (a, b) in enumerate(zip(g[k].token_ids, full[k].token_ids)) if a != b), len(g[k].token_ids))
            out = max([out] + [float((a - b).abs().max()) for a, b in zip(g[k].step_logits[:n], full[k].step_logits[:n])])
        return out

    dev = {s: deviation(g) for s, g in got.items()}  # measured: packed 0.202, simulated 0.157
    assert dev["packed"] < 2 * dev["simulated"], dev
    x = torch.randn(4, 2, 64, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4
    for bits in (8, 4):
        g = x.view(4, 2, 64, 2, 8)
        lo, hi = g.amin(-1, keepdim=True).float(), g.amax(-1, keepdim=True).float()
        sim = quant_mod._minmax_quantise(g.float(), lo, hi, bits).double()
        gr = grid(lo[..., 0], hi[..., 0], bits)[..., None, :].expand(*g.shape, 2)
        pk = decode(encode(g, gr, bits), gr, PackSpec(bits, 8, "token", 12, torch.float64))
        step = (hi - lo).double() / (2 ** bits - 1)
        assert bool(((pk - sim).abs() <= step * (1 + 2 ** -7) + 1e-12).all())


def test_the_packed_cache_holds_codes_and_the_meter_its_tensor_bytes(tiny):
    """After a run's steps the batch cache holds no model-dtype K/V buffer and every row's metered
    KiB are the bytes its packed tensors hold (`Quant.stored_kib` recounts them)."""
    from retention.runtime.engine import Engine

    spec = validate_arm(dict(BASE, state={"name": "quant", "params": {"residual": 4, "group": 8, "store": "packed"}}))
    policy = spec.policy()
    eng = Engine(tiny.model, [Request(i, p, i) for i, p in enumerate(PROMPTS)], policy,
                 SamplingConfig(max_new_tokens=40, ignore_eos=True), set(), tiny.geometry.kib_per_token, batch_size=4)
    checked = 0
    with torch.inference_mode(), policy.attach(tiny.model):
        eng.fill()
        for _ in range(30):
            eng.step()
            cache = eng.cache
            assert all("k" not in ly.stores and ly.packed is not None for ly in cache.layers)
            for r, st in enumerate(eng.slots):
                if st is None:
                    continue
                kpt = tiny.geometry.kib_per_token
                metered = policy.row_kib(cache, r, kpt)
                metered = cache.lengths[r] * kpt if metered is None else metered
                assert metered == pytest.approx(policy.state.stored_kib(cache, r, kpt), rel=1e-12)
                checked += 1
    assert checked > 60
    assert isinstance(policy.state, Quant) and policy.state.store == "packed"


BROKEN_METER = ("from dataclasses import dataclass\nfrom retention.policy.state.quant import Quant\n\n@dataclass\n"
                "class Overcount(Quant):\n    name = 'overcount'\n    def row_kib(self, cache, row, kib_per_token):\n"
                "        return super().row_kib(cache, row, kib_per_token) + 0.25 * kib_per_token\n")


def test_retention_check_recounts_packed_bytes_and_fails_a_broken_meter(tmp_path):
    results = {r.name: r for r in run_family_checks("state", "quant", {})}
    assert results["packed bytes"].ok is True and results["physical eviction"].ok is True, results["packed bytes"].line()
    path = tmp_path / "overcount.py"
    path.write_text(BROKEN_METER)
    bad = {r.name: r for r in run_family_checks("state", f"{path}:Overcount", {})}
    assert bad["packed bytes"].ok is False and "packed tensors hold" in bad["packed bytes"].detail
    assert bad["physical eviction"].ok is False


def test_a_packed_cache_attends_only_through_the_packed_attention(tiny):
    """Outside `Quant.attach` a packed cache's handles reach the model's own attention and give NaN
    logits (never a plausible token); inside, finite logits; the model's implementation is restored."""
    from retention.runtime.adapter import ModelAdapter
    from retention.runtime.cache import RetentionCache

    ad, state = ModelAdapter(tiny.model), Quant(residual=4, group=8)
    prompt = list(range(5, 40))
    with torch.inference_mode():
        cache = RetentionCache(len(tiny.model.model.layers), capacity=64)
        cache.slots, cache.prompt_lengths = [0], [len(prompt)]
        ad.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
        state.after_step(cache, [len(prompt)], 1.0)
        assert cache.layers[0].packed is not None and "k" not in cache.layers[0].stores
        ids, pos = torch.tensor([[7]]), torch.tensor([[len(prompt)]])
        assert bool(ad.forward(ids, pos, cache).isnan().all())
        cache.lengths = [len(prompt)]  # the NaN step's token forgotten (its ring entry is overwritten below)
        with state.attach(tiny.model):
            assert tiny.model.config._attn_implementation == "retention_packed"
            assert bool(ad.forward(ids, pos, cache).isfinite().all())
    assert tiny.model.config._attn_implementation == "sdpa"
