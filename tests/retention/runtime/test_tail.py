"""The engine's tail: once the queue is empty its last sequences move onto fewer rows, and no record
changes (tokens, finish reasons, meters, fidelity figures, every step's logits), in bfloat16,
float32 and float64, for every scorer; the linear probe refuses a row count whose products sum in
another order, and the step's own comparison refuses what the probe missed."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from retention.runtime import tail
from retention.policy.cadence.newline import NewlineCadence
from retention.runtime.engine import Engine, Request, SamplingConfig, run_engine
from retention.policy.registry import make_mechanism
from retention.policy.composite import RetentionPolicy, cadence_for
from retention.policy.registry import make_scorer
from retention.policy.scoring.calibration import calibrate

SLOTS = 8
# Sixteen prompts of 9..110 tokens for 8 slots (refills, then a tail); EOS ids that end the sampled
# answers at different steps.
_g = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(0, 256, (n,), generator=_g).tolist()
           for n in (9, 110, 23, 64, 15, 97, 40, 12, 75, 31, 50, 60, 70, 33, 44, 21)]
EOS = set(range(3, 256, 24))


@pytest.fixture(scope="module")
def models(tiny):
    return {dt: copy.deepcopy(tiny.model).to(dt) for dt in (torch.bfloat16, torch.float32, torch.float64)}


@pytest.fixture(scope="module")
def stats_path(models, tmp_path_factory):
    """The query statistics of each dtype's model (their rotary frequencies differ)."""
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    d = tmp_path_factory.mktemp("stats")
    return {dt: str(calibrate(m, ids).save(d / f"tiny-{str(dt)[6:]}.safetensors")) for dt, m in models.items()}


def _policy(name, stats_path, dtype=torch.float64):
    sc = make_scorer(name, stats=None if stats_path is None else stats_path[dtype])
    return RetentionPolicy(sc, cadence_for(sc, 24 if sc.evicts else None, 4 if sc.evicts else None))


def _records(model, policy, shrink, slots=SLOTS):
    out = {}
    cfg = SamplingConfig(max_new_tokens=60, temperature=0.8, top_p=0.9)
    stats = run_engine(model, [Request(i, p, i) for i, p in enumerate(PROMPTS)], policy, cfg, EOS, 1.0,
                       batch_size=slots, fidelity=True, keep_logits=True, shrink=shrink,
                       on_finish=lambda r, g: out.__setitem__(r.key, g))
    return {k: (g.token_ids, g.finish_reason, g.meter.summary(), g.fidelity.summary(), g.fidelity.kl,
                torch.stack(g.step_logits)) for k, g in out.items()}, stats


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        *head, la = a[k]
        *head_b, lb = b[k]
        assert head == head_b, k
        assert torch.equal(la, lb), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["full", "streaming", "triattention", "alpha", "snapkv", "h2o"])
def test_the_tail_changes_no_record(models, stats_path, dtype, name):
    model = models[dtype]
    off, st_off = _records(model, _policy(name, stats_path, dtype), shrink=False)
    on, st_on = _records(model, _policy(name, stats_path, dtype), shrink=True)
    _assert_same(on, off)
    assert len({len(v[0]) for v in off.values()}) >= 4  # answers of different lengths: a real tail
    assert st_off.narrowed == 0 and st_off.rows == SLOTS
    assert st_on.narrowed + st_on.narrow_refused >= 1  # the tail was reached and decided on
    assert st_on.tokens == st_off.tokens and st_on.steps == st_off.steps
    if st_on.narrowed:
        assert st_on.rows < SLOTS and st_on.padding_rows < st_off.padding_rows


MECHANISMS = [("routing", "adakv", {}), ("routing", "pyramidkv", {}), ("routing", "per-layer", {}),
              ("state", "quant", {"bits": 4, "residual": 8}), ("state", "quant", {"bits": 4, "residual": 8, "store": "simulated"}),
              ("state", "merge", {}),
              ("decoding", "loop-guard", {"ngram": 3, "max_repeats": 1, "window": 32}), ("cadence", "newline", {})]


@pytest.mark.parametrize("fam,name,params", MECHANISMS, ids=[f"{f}-{n}" for f, n, _ in MECHANISMS])
def test_the_tail_changes_no_record_in_the_other_families(models, stats_path, fam, name, params):
    """Per-sequence state of routing (ragged rows), state (quantised tails, merges), decoding (the
    guard's histories) and cadence moves with its sequence's row."""
    model = models[torch.float64]

    def policy():
        sc = make_scorer("triattention", stats=stats_path[torch.float64])
        if fam == "cadence":
            return RetentionPolicy(sc, cadence_for(sc, 24, 4, kind=NewlineCadence, params={"max_wait": 4}))
        return RetentionPolicy(sc, cadence_for(sc, 24, 4), **{fam: make_mechanism(fam, name, params)})

    off, st_off = _records(model, policy(), shrink=False)
    on, st_on = _records(model, policy(), shrink=True)
    _assert_same(on, off)
    assert st_on.narrowed + st_on.narrow_refused >= 1
    if not st_on.narrowed:
        pytest.skip("the probe refused every narrowing of this run on this host's kernels")


def test_the_tail_narrows_somewhere_on_this_host(models, stats_path):
    """The comparison above is not vacuous: on this host at least one dtype's tail ran narrower (else
    the host's kernels order every product by row count, and there is nothing to show here)."""
    got = {str(dt): _records(m, _policy("alpha", stats_path, dt), shrink=True)[1].narrowed for dt, m in models.items()}
    if not any(got.values()):
        pytest.skip(f"every narrowing refused on this host's kernels: {got}")
    assert max(got.values()) >= 1


def _split_linear(x, w, b=None):
    """A product that sums its inner dimension in two halves below 4 rows: another order."""
    if x.shape[0] >= 4:
        return F.linear(x, w, b)
    k = x.shape[-1] // 2
    y = F.linear(x[..., :k], w[:, :k]) + F.linear(x[..., k:], w[:, k:])
    return y if b is None else y + b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_the_probe_refuses_products_that_sum_in_another_order(tiny, dtype, monkeypatch):
    model = copy.deepcopy(tiny.model).to(dtype)
    probe = tail.TailProbe(model)
    assert {(k, n) for k, n, *_ in probe.shapes} >= {(64, 64), (64, 32), (64, 259)}
    # 4 rows of 8: the same path, where the host's own products agree at both counts (on some hosts
    # float32's product already parts between 8 and 4 rows, and the probe rightly says so).
    same_path = probe.exact(8, [0, 1, 2, 3], [0, 1, 2, 3])
    monkeypatch.setattr(tail, "F", SimpleNamespace(linear=_split_linear))
    assert probe.exact(8, [0, 1, 2, 3], [0, 1, 2, 3]) == same_path
    assert not probe.exact(8, [5, 2, 0], [5, 2])  # 3 rows: the halves
    monkeypatch.setattr(tail, "F", SimpleNamespace(linear=lambda x, w, b=None: F.linear(x, w, b) + (x.shape[0] < 4)))
    assert not probe.exact(8, [1, 0], [1])


def test_order_revealing_rows_expose_a_split_sum():
    """Ordinary rows mostly round to the same sums in either order; the probe's rows do not."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randint(0, 2, (64, 256), generator=g) * 2 - 1).float()
    x = tail.order_revealing((8, 1, 256), torch.float32, g)
    assert not torch.equal(_split_linear(x[:2], w), F.linear(x[:2], w))


def test_the_steps_own_comparison_refuses_what_the_probe_missed(models, stats_path, monkeypatch):
    """A forward whose narrow logits differ (a kernel the probe does not see): the tail keeps its rows
    and every record is the one of a run without the tail."""
    model = models[torch.float64]
    off, _ = _records(model, _policy("alpha", stats_path), shrink=False)
    monkeypatch.setattr(tail.TailProbe, "exact", lambda self, *a, **kw: True)
    real = Engine.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        fwd = self.adapter.forward

        def forward(ids, pos, cache, padded=False):
            lg = fwd(ids, pos, cache, padded)
            return lg + 1e-9 if padded and ids.shape[0] < self.S else lg  # decode steps on fewer rows
        self.adapter.forward = forward

    monkeypatch.setattr(Engine, "__init__", init)
    on, st = _records(model, _policy("alpha", stats_path), shrink=True)
    assert st.narrowed == 0 and st.narrow_refused == 1 and st.rows == SLOTS
    _assert_same(on, off)


def test_a_layout_model_keeps_its_rows():
    """A layout model's attention is the project's own matmul code, which the probe does not cover."""
    from retention.models.arch.configs import TINY
    from retention.models.arch.model import build_arch

    model = build_arch(TINY["tiny-mla"])
    eng = Engine(model, [], _policy("full", None), SamplingConfig(max_new_tokens=4), set(), 1.0, batch_size=4)
    assert not eng.shrink and eng._probe is None


def test_narrow_rows_halves_to_the_fewest_that_hold_the_sequences():
    busy = [False] * 64
    assert tail.narrow_rows([True] * 5 + [False] * 3) is None  # more than half busy
    for r in (40, 3, 17):
        busy[r] = True
    assert tail.narrow_rows(busy) == [3, 17, 40, 0]  # 64 -> 4: the sequences in order, then padding
    assert tail.narrow_rows([False, True, False, False]) == [1]
    assert tail.narrow_rows([True, False, True, False, False, False]) == [0, 2]  # 6 -> 3 -> 2
    assert tail.narrow_rows([True, True, False, False]) == [0, 1]
