"""The static decode step: in bfloat16, a record is the same whatever shares its batch at a given
slot count (other request orders, other neighbours, slots refilled at other steps), fidelity figures
included. On the engine before the static step (rows dropped from the batch as the queue empties,
views as wide as the longest row) these records differ."""

import copy
import random

import pytest
import torch

from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.policy.composite import RetentionPolicy, cadence_for
from retention.policy.registry import make_scorer
from retention.policy.scoring.calibration import calibrate

SLOTS = 4
NEW = 120
# Ten prompts of 9..110 tokens and six other neighbours: long rows widen what a short one attends to.
_g = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(0, 256, (n,), generator=_g).tolist() for n in (9, 110, 23, 64, 15, 97, 40, 12, 75, 31)]
OTHERS = [torch.randint(0, 256, (n,), generator=_g).tolist() for n in (100, 5, 88, 60, 7, 120)]


@pytest.fixture(scope="module")
def tiny_bf16(tiny):
    return copy.deepcopy(tiny.model).to(torch.bfloat16)


@pytest.fixture(scope="module")
def stats_path(tiny_bf16, tmp_path_factory):
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    return str(calibrate(tiny_bf16, ids).save(tmp_path_factory.mktemp("stats") / "tiny.safetensors"))


def _policy(name, stats_path):
    sc = make_scorer(name, stats=stats_path)
    return RetentionPolicy(sc, cadence_for(sc, 24 if sc.evicts else None, 4 if sc.evicts else None))


def _records(model, policy, requests, eos, max_prompt, temperature):
    """{key: (tokens, finish, meter summary, fidelity summary)} of one engine run at SLOTS slots."""
    out = {}
    cfg = SamplingConfig(max_new_tokens=NEW, temperature=temperature, top_p=0.9)
    kw = {"max_prompt": max_prompt} if max_prompt is not None else {}
    run_engine(model, requests, policy, cfg, eos, 1.0, batch_size=SLOTS, fidelity=True,
               on_finish=lambda r, g: out.__setitem__(r.key, (g.token_ids, g.finish_reason, g.meter.summary(),
                                                               g.fidelity.summary())), **kw)
    return out


@pytest.mark.parametrize("name,temperature", [(n, 0.0) for n in ("full", "streaming", "triattention", "h2o", "alpha")]
                         + [("full", 0.8), ("alpha", 0.8)])
def test_bf16_records_do_not_depend_on_the_batch(tiny_bf16, stats_path, name, temperature):
    mine = [Request(("p", i), p, i) for i, p in enumerate(PROMPTS)]
    others = [Request(("o", i), p, 100 + i) for i, p in enumerate(OTHERS)]
    longest = max(len(p) for p in PROMPTS + OTHERS)  # the run's longest prompt sizes every row
    base = _records(tiny_bf16, _policy(name, stats_path), mine, set(), longest, temperature)
    # Token ids that end the first run's sequences at different steps: slots free and refill at other
    # steps in every composition below.
    eos = {toks[k] for (_, i), (toks, *_rest) in base.items() for k in (3 + 4 * i,) if i % 2 and k < len(toks)}
    base = _records(tiny_bf16, _policy(name, stats_path), mine, eos, longest, temperature)
    assert len({len(v[0]) for v in base.values()}) >= 3  # different lengths: refills at different steps
    shuffled = mine + others
    random.Random(1).shuffle(shuffled)
    for requests in (mine[::-1], shuffled, others[:3] + mine[5:] + others[3:] + mine[:5]):
        got = _records(tiny_bf16, _policy(name, stats_path), requests, eos, longest, temperature)
        for key, want in base.items():
            assert got[key] == want, (name, key)


def test_bf16_records_do_not_depend_on_the_width_block_a_neighbour_reaches(tiny_bf16, stats_path):
    """Rows longer than `WIDTH_BLOCK` widen the views a block at a time: a row that stays under 512
    tokens decodes the same whether its neighbours cross into the next block or not."""
    from retention.runtime.cache import WIDTH_BLOCK

    g = torch.Generator().manual_seed(9)
    short = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 330, 360)]
    long = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (470, 490, 20, 480)]
    mine = [Request(("s", i), p, i) for i, p in enumerate(short)]
    others = [Request(("l", i), p, 10 + i) for i, p in enumerate(long)]
    longest = max(len(p) for p in short + long)
    assert max(map(len, short)) + NEW < WIDTH_BLOCK < max(map(len, long)) + NEW  # only neighbours cross
    base = _records(tiny_bf16, _policy("full", stats_path), mine, set(), longest, 0.0)
    for requests in (mine[::-1] + others, [others[0], mine[1], others[1], mine[0], others[3], mine[2], others[2]]):
        got = _records(tiny_bf16, _policy("full", stats_path), requests, set(), longest, 0.0)
        for key, want in base.items():
            assert got[key] == want, key
