"""Conformance of the `random-pp` preset with Random Attention's `random_pp` (arXiv 2609.03430).

The cases (`retention/data/golden/random/`, README there) hold the reference's kept positions at
every eviction event of a short decode, per layer, batch row and KV head. The draws come from
another generator (the reference's global torch RNG), so the kept sets cannot match token for token;
what must match is their structure, checked on the reference's own outputs (so that the conventions
written in docs/random-control.md are the reference's) and on this project's scorer, run through its
own cadence, protection rule and selector on the same caches:

* which positions can be kept: only positions the cache held before the event;
* which must be kept: the first `min(prompt_len, K - 1)` positions (the prompt, capped so that one
  scored slot is left) and the `residual_length` newest (the window), in every head;
* how many: `token_budget` per (layer, row, head), of which `K - pl` drawn from the other tokens;
* independence: the drawn parts differ between the KV heads of a layer, between layers, between rows;
* when: the events fall where the reference's fall (the cache reaching `token_budget +
  residual_length` on a multiple of `residual_length`), except that this project compacts a prompt
  longer than the budget at prefill where the reference waits for the first decode event.

Shapes: E events, L layers, B rows, G KV heads, W the widest pre-event cache, T = token_budget.
"""

from __future__ import annotations

import math

import torch

from retention.policy.composite import cadence_for
from retention.policy.scoring.random_pp import REFERENCE_WINDOW, RandomPP
from retention.runs.conformance_case import CaseResult
from retention.runtime.cache import CacheView, protected_positions

RANDOM = ("random_pp",)
# The reference launcher's setting for MATH-500 (scripts/run_cell.sh): --token_budget 1024 --residual_length 64.
LAUNCHER_BUDGET = 1024
COINCIDENCE = 1e-6


def _member(kept: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`[..., m]` bool: whether each of `pos` (`[..., m]`, -1 never) is among `kept` (`[..., k]`)."""
    return (pos[..., :, None] == kept[..., None, :]).any(-1) & (pos >= 0)


def _structure(res: CaseResult, who: str, kept: torch.Tensor, before: torch.Tensor, at: torch.Tensor,
               pl: int, R: int, T: int) -> None:
    """The structural checks on one side's kept positions `[E, L, B, G, T]` (module doc)."""
    K = T - R
    checks = {}
    checks["kept per head"] = kept.shape[-1] == T and bool((kept.sort(-1).values.diff(dim=-1) > 0).all())
    checks["kept only what the cache held"] = bool(_member(before, kept).all())
    forced = (before >= 0) & ((before < pl) | (before >= at.view(-1, 1, 1, 1, 1) - R))  # [E, L, B, G, W]
    checks["prompt and window kept"] = bool((_member(kept, before) | ~forced).all())
    checks[f"prompt cap min(prompt_len, K - 1) = {pl}, window {R}"] = bool(
        (forced.sum(-1) == pl + R).all())
    drawn = kept.masked_fill(_member(before.masked_fill(~forced, -1), kept), -1)  # the random part, -1 elsewhere
    checks[f"{K - pl} drawn per head"] = bool(((drawn >= 0).sum(-1) == K - pl).all())
    pool = ((before >= 0) & ~forced).sum(-1)  # [E, L, B, G] candidates the draw chooses from
    # Where two independent draws coincide with probability 1 / C(pool, K - pl) below COINCIDENCE;
    # small pools (a long prompt leaves one slot to draw) can coincide by chance and are not tested.
    informative = pool.apply_(lambda n: math.comb(n, K - pl) > 1 / COINCIDENCE).bool()
    for axis, name in ((3, "KV heads"), (1, "layers"), (2, "rows")):
        if kept.shape[axis] < 2:
            continue
        same = (drawn == drawn.narrow(axis, 0, 1)).all(-1)  # [E, L, B, G]: equal to the first along `axis`
        differ = ~same.narrow(axis, 1, kept.shape[axis] - 1).all(axis)  # some member differs
        ok_where = informative.all(axis)
        if bool(ok_where.any()):  # else nothing on this case can tell independent draws from shared ones
            checks[f"draws differ between {name}"] = bool((differ | ~ok_where).all())
    for what, ok in checks.items():
        res.checks.append(f"{who}: {what}")
        if not ok:
            res.fail(f"{who}: {what} does not hold")


def _project_kept(before: torch.Tensor, at: torch.Tensor, P: int, R: int, T: int, seed: int) -> torch.Tensor:
    """This project's `random-pp` on the reference's pre-event caches: `[E, L, B, G, T]` kept positions.
    The cadence is the preset's at the reference's numbers (prefill accounting: b = the budget)."""
    E, L, B, G, W = before.shape
    cadence = cadence_for(RandomPP(), T, interval=R, accounting="prefill", recent=R)
    sc = RandomPP()
    for b in range(B):
        sc.reset_slot(b, seed + b)
    out = []
    for e in range(E):
        p = before[e]  # [L, B, G, W]
        valid = p >= 0
        below = torch.full((B,), cadence.protected_prompt(P, cadence.nominal), dtype=torch.long)
        nxt = torch.full((B,), int(at[e]), dtype=torch.long)
        prot = [protected_positions(p[i], nxt, cadence.sink, cadence.recent, below) & valid[i] for i in range(L)]
        view = CacheView([], [], list(p), prot, nxt, list(valid), torch.full((B,), P), torch.arange(B))
        keep = sc.select(sc.score(view), view, cadence.nominal)  # [L, B, G, T] slots
        out.append(torch.gather(p, -1, keep))
    return torch.stack(out)


def _cadence_events(res: CaseResult, P: int, R: int, T: int, steps: int, at: torch.Tensor) -> None:
    """The preset's cadence fires where the reference's events are (module doc: a long prompt aside)."""
    cadence = cadence_for(RandomPP(), T, interval=R, accounting="prefill", recent=R)
    stored, events = P, []
    if cadence.due(stored, True, P):
        stored = cadence.keep(P)
    for s in range(steps):
        stored += 1
        if cadence.due(stored, False, P):
            events.append(P + s + 1)
            stored = cadence.keep(P)
    res.checks.append("cadence: events where the reference's are")
    if events != at.tolist():
        res.fail(f"cadence: events at {events[:6]}..., the reference's at {at.tolist()[:6]}...")


def check_random_pp(p: dict, t: dict, res: CaseResult) -> None:
    res.exact = True
    res.summary = "kept-set structure as the reference's (the draws differ by generator)"
    P, T, R = int(p["prompt_len"]), int(p["token_budget"]), int(p["residual_length"])
    pl = min(P, T - R - 1)
    if "prompt_protected" in p and int(p["prompt_protected"]) != pl:
        res.fail(f"the sidecar protects {p['prompt_protected']} prompt tokens, min(prompt_len, K - 1) = {pl}")
    before, kept, at = t["positions_before"].long(), t["kept_positions"].long(), t["event_next_position"].long()
    _structure(res, "reference", kept, before, at, pl, R, T)
    ours = _project_kept(before, at, P, R, T, seed=int(p.get("seed", 0)) if "seed" in p else 0)
    _structure(res, "random-pp", ours, before, at, pl, R, T)
    _cadence_events(res, P, R, T, int(p["decode_steps"]), at)
    preset = cadence_for(RandomPP(), LAUNCHER_BUDGET, accounting="prefill")
    res.checks.append("preset: the launcher's window and interval, prompt counted")
    if (preset.recent, preset.interval, preset.nominal, preset.prompt_rule) != (
            REFERENCE_WINDOW, REFERENCE_WINDOW, LAUNCHER_BUDGET, "keep"):
        res.fail(f"preset: recent {preset.recent}, interval {preset.interval}, b {preset.nominal}, prompt "
                 f"{preset.prompt_rule}; the launcher's: 64, 64, {LAUNCHER_BUDGET}, keep")


CHECKERS = {"random_pp": check_random_pp}
