"""The contract kit for the non-scoring families: `retention check FAMILY:NAME`.

A mechanism is checked inside an arm (a reference scorer, `triattention` by default, at the kit's
budget on `tiny-random` in float64), so every invariant of the scorer contract applies to the arm it
makes (`retention.contract.checks`: kept count, batch invariance, physical eviction, the mean budget,
determinism, resume, host reads; the stored memory the meter counts equals the state's recount from
the buffers after every forward). On top, per family:

* trivial member exact: the mechanism with its `trivial()` parameters decodes exactly what the
  family's default decodes (tokens, finish reasons, meters): it changes nothing it claims not to;
* the family's default decodes exactly what an arm without the family key decodes;
* routing allocation (the allocating routings, `Routing.allocates`): some compaction gave heads
  different counts, every row's summing to `L x G x k` (`retention.contract.checks`); their trivial
  member is compared with `per-layer` when the scorer has a `routing` parameter (they set it);
* budget held in bytes (states): no sequence's measured mean KiB is above what the same tokens
  cost in full precision at the budget (`B x kib_per_token`);
* dequantisation error bound (the `quant` state and its subclasses): on seeded keys and values the stored
  values are within the stated bound of the originals (the packed store: half a step of its float16
  grid, `retention.runtime.packed_kv`);
* packed bytes (`quant` with `store="packed"`): after every forward the cache holds no model-dtype
  K/V buffer, and every row's metered KiB equal the bytes of the codes, grids, ring entries and live
  key chunks it holds, recounted here from the tensors (`_tensor_kib`, independent of the state's
  own figures); and the buffers a slot allocates per token of capacity (codes, grids, slots, key
  chunks) are smaller than the model-dtype cache's, the ring's `residual + group` full-precision
  entries coming on top (at the kit's tiny capacity they can outweigh the saving: reported).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from retention.contract.checks import PROMPTS, CheckResult, _guard, _Kit, run_checks
from retention.contract.probe import Probe
from retention.errors import RetentionError
from retention.policy.registry import FAMILIES, get_scorer_class, mechanism_class, new_run_entry
from retention.policy.state.quant import Quant, _quantise_keys, _quantise_values
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.runtime.packed_kv import chunk_grid, decode, encode, PackSpec, token_grid

DEFAULT_SCORER = "triattention"


def parse_target(target: str) -> tuple[str, str]:
    """`FAMILY:NAME` -> (family, name); a bare name is a scorer. A plugin spec keeps its own colon:
    `state:pkg.mod:Class`."""
    fam, sep, name = target.partition(":")
    if sep and fam in FAMILIES:
        return fam, name
    return "scorer", target


def run_family_checks(family: str, name: str, params: dict | None = None, *, scorer: str = DEFAULT_SCORER,
                      share: bool = False, context: int = 8192) -> list[CheckResult]:
    """Every check of mechanism `name` of `family` (with `params`) in an arm of `scorer`; share:
    also the compaction share of decode time at a `context`-token prompt under this arm."""
    cls = mechanism_class(family, name)  # one error line for an unknown or broken plugin
    entry = new_run_entry(family, {"name": name, "params": dict(params or {})})  # a new run's (`quant.store` packed)
    results = run_checks(scorer, {}, share=share, context=context, mechanisms={family: entry})
    if any(r.name == "set-up" for r in results):
        return results
    with tempfile.TemporaryDirectory(prefix="retention-check-") as tmp:
        tmp = Path(tmp)
        results.append(_guard("default exact", lambda: _default_exact(family, scorer, tmp)))
        trivial = cls.trivial()
        if trivial is not None:
            results.append(_guard("trivial member exact",
                                  lambda: _trivial_exact(family, name, trivial, scorer, tmp)))
        if family == "state":
            results.append(_guard("budget held in bytes", lambda: _bytes_held(family, entry, scorer, tmp)))
            if issubclass(cls, Quant):
                results.append(_guard("dequantisation error bound", lambda: _error_bound(name, entry["params"])))
                if Quant.written_params(entry["params"]).get("store") == "packed":
                    results.append(_guard("packed bytes", lambda: _packed_bytes(family, entry, scorer, tmp)))
    return results


def _decode(family: str, entry, scorer: str, tmp: Path, tag: str, as_named: bool = False):
    kit = _Kit(scorer, {}, tmp / tag, None if entry is None else {family: entry}, as_named)
    gens, _, _, _ = kit.decode(8, checks=False)
    return gens


def _differ(a: dict, b: dict) -> str | None:
    for k in sorted(a):
        ga, gb = a[k], b.get(k)
        if gb is None or ga.token_ids != gb.token_ids or ga.finish_reason != gb.finish_reason:
            return f"sequence {k}: tokens differ"
        if ga.meter.summary() != gb.meter.summary():
            return f"sequence {k}: meters differ"
    return None


def _default_exact(family: str, scorer: str, tmp: Path) -> CheckResult:
    default = FAMILIES[family].default
    diff = _differ(_decode(family, None, scorer, tmp, "absent"), _decode(family, default, scorer, tmp, "default"))
    return CheckResult("default exact", diff is None, diff or f"--{family} {default} decodes what no {family} key does")


def _trivial_exact(family: str, name: str, trivial: dict, scorer: str, tmp: Path) -> CheckResult:
    # An allocating routing sets a scorer with a choice of kept-set structure to per-layer: its
    # trivial member is the per-layer routing (one kept set per layer, no allocation).
    per_layer = (family == "routing" and mechanism_class(family, name).allocates
                 and "per-layer" in get_scorer_class(scorer).structures)
    base = _decode(family, "per-layer" if per_layer else None, scorer, tmp, "base")
    # As named: a run records a trivial setting as the default, so only the mechanism itself tests the claim.
    got = _decode(family, {"name": name, "params": trivial}, scorer, tmp, "trivial", as_named=True)
    diff = _differ(base, got)
    default = "per-layer" if per_layer else FAMILIES[family].default
    return CheckResult("trivial member exact", diff is None,
                       diff or f"{name} with {trivial} decodes exactly what {default} does")


def _bytes_held(family: str, entry: dict, scorer: str, tmp: Path) -> CheckResult:
    kit = _Kit(scorer, {}, tmp / "bytes", {family: entry})
    gens, _, _, _ = kit.decode(8, checks=False)
    limit = kit.budget * 1.0  # the kit decodes at 1 KiB per full-precision token
    over = [f"sequence {k}: mean {g.meter.mean_kib:.3f} KiB > {limit:.3f}" for k, g in sorted(gens.items())
            if not g.meter.mean_kib <= limit + 1e-9]  # a NaN figure fails too
    worst = max(g.meter.mean_kib for g in gens.values())
    return CheckResult("budget held in bytes", not over, "; ".join(over[:3]) or
                       f"largest mean {worst:.3f} KiB <= {limit:.3f} KiB (budget {kit.budget} tokens in full precision)")


def _error_bound(name: str, params: dict) -> CheckResult:
    state = mechanism_class("state", name)(**params)
    if not isinstance(state, Quant):
        raise RetentionError(f"no dequantisation check for state {name!r}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 64, generator=g, dtype=torch.float64) * torch.linspace(0.1, 8, 64, dtype=torch.float64)
    new = torch.rand(2, 3, 40, generator=g) < 0.7
    cidx = torch.where(new, (new.long().cumsum(-1) - 1) // state.group, 0)
    if state.store == "packed":
        return _packed_error_bound(state, x, new, cidx)
    keys = _quantise_keys(x, new, cidx, state.bits).double()
    worst = 0.0
    for b, h in zip(*torch.nonzero(new.any(-1), as_tuple=True), strict=True):
        for c in cidx[b, h][new[b, h]].unique():
            sel = new[b, h] & (cidx[b, h] == c)
            grp = x[b, h][sel]
            bound = state.error_bound(grp, grp.amin(0), grp.amax(0)) + 1e-6 * grp.abs().amax(0)
            err = (keys[b, h][sel] - grp).abs()
            if bool((err > bound).any()):
                return CheckResult("dequantisation error bound", False, f"a key error {float(err.max()):.4g} exceeds "
                                   f"half a step of its chunk")
            worst = max(worst, float((err / bound.clamp_min(1e-12)).max()))
    v = x.view(2, 3, 40, 64 // state.group, state.group)
    vals = _quantise_values(x, state.group, state.bits).double().view_as(v)
    vbound = state.error_bound(v, v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)) + 1e-6 * v.abs()
    ok = bool(((vals - v).abs() <= vbound).all())
    return CheckResult("dequantisation error bound", ok,
                       f"keys (per channel, chunks of {state.group}) and values (per token, groups of {state.group}) "
                       f"within half a quantisation step at {state.bits} bits (largest key error {worst:.3f} of it)")


def _packed_error_bound(state: Quant, x: torch.Tensor, new: torch.Tensor, cidx: torch.Tensor) -> CheckResult:
    """The packed store's codes decode to within half a step of their float16 grid (keys per channel
    over chunks, or per token; values per token over channel groups), float64 values."""
    spec = PackSpec(state.bits, state.group, state.keys, state.residual + state.group, torch.float64)
    worst = 0.0
    if state.keys == "channel":
        grids = chunk_grid(x, new, cidx, int(cidx.max()) + 1, state.bits)
        kg = torch.gather(grids, 2, cidx[..., None, None].expand(*cidx.shape, *grids.shape[3:]))
    else:
        kg = token_grid(x, state.group, state.bits).repeat_interleave(state.group, dim=-2)
    for what, grid, mask in (("key", kg, new[..., None]),
                             ("value", token_grid(x, state.group, state.bits).repeat_interleave(state.group, dim=-2),
                              torch.ones_like(new)[..., None])):
        err = (decode(encode(x, grid, state.bits), grid, spec) - x).abs()
        bound = grid[..., 0].double() / 2 + 1e-6 * x.abs()
        if bool(((err > bound) & mask).any()):
            return CheckResult("dequantisation error bound", False, f"a {what} error {float(err.max()):.4g} exceeds "
                               "half a step of its float16 grid")
        worst = max(worst, float(torch.where(mask, err / grid[..., 0].double().clamp_min(1e-12), 0.0).max()) * 2)
    return CheckResult("dequantisation error bound", True,
                       f"packed codes (keys {state.keys}-wise, values per token, groups of {state.group}) within half a "
                       f"step of their float16 grid at {state.bits} bits (largest error {worst:.3f} of it)")


def _tensor_kib(cache, row: int, kib_per_token: float) -> float:
    """Row `row`'s KiB recounted from the packed tensors alone: quantised entries (`slot > 0`) x
    the `nbytes` of one entry of every code and grid store, full-precision ring entries x a ring
    entry's `nbytes`, distinct key chunks x a table entry's `nbytes`; in the meter's unit."""
    total = full = 0
    w = cache.widths[row]
    for ly in cache.layers:
        st, pk = ly.stores, ly.packed
        pos, slot = ly.pbuf[row, :, :w], st["slot"][row, :, :w]
        quant = (slot > 0) & (pos >= 0)
        entry = sum(b[row, 0, 0].nbytes for name, b in st.items() if name in ("qk", "qv", "sv", "sk"))
        ring = pk.ring_k[row, 0, 0].nbytes + pk.ring_v[row, 0, 0].nbytes
        total += int(quant.sum()) * entry + int((pk.ring_pos[row] >= 0).sum()) * ring
        if pk.table is not None:
            total += sum(len(set(slot[g][quant[g]].tolist())) for g in range(slot.shape[0])) * pk.table[row, 0, 0].nbytes
        full += pk.ring_k[0, :, 0].nbytes + pk.ring_v[0, :, 0].nbytes
    return total * kib_per_token / full


def _packed_bytes(family: str, entry: dict, scorer: str, tmp: Path) -> CheckResult:
    kit = _Kit(scorer, {}, tmp / "packed", {family: entry})
    policy = kit.policy(Probe(kit.make(), checks=False), checked=False)
    bad, seen = [], {"forwards": 0, "rows": 0, "alloc": 0, "plain": 0, "ring": 0}
    inner = policy.after_forward

    def after_forward(cache, next_position, meter, prefill, tokens=None):
        did = inner(cache, next_position, meter, prefill, tokens)
        seen["forwards"] += 1
        if any("k" in ly.stores or ly.packed is None for ly in cache.layers):
            bad.append("a forward left model-dtype K/V buffers in the cache")
            return did
        meters = meter if isinstance(meter, list) else [meter] * cache.rows
        for r, m in enumerate(meters):
            if m is None:
                continue
            kpt = m.kib_per_token
            metered = policy.row_kib(cache, r, kpt)
            metered = cache.lengths[r] * kpt if metered is None else metered
            recount = _tensor_kib(cache, r, kpt)
            seen["rows"] += 1
            if abs(metered - recount) > 1e-9 * max(1.0, recount) and len(bad) < 3:
                bad.append(f"the meter counts {metered:.6g} KiB in a row whose packed tensors hold {recount:.6g} KiB")
        if cache.rows > 1:
            ly = cache.layers[0]
            S, G, cap = ly.pbuf.shape
            plain = sum(S * G * cap * (x.ring_k.shape[-1] + x.ring_v.shape[-1]) * x.ring_k.element_size()
                        for x in (layer.packed for layer in cache.layers))
            ring = sum(layer.packed.ring_k.nbytes + layer.packed.ring_v.nbytes for layer in cache.layers)
            seen.update(alloc=cache.allocated_bytes() - ring, plain=plain, ring=ring)
            if seen["alloc"] >= plain and len(bad) < 3:
                bad.append(f"the packed cache allocates {seen['alloc']} bytes besides its ring, the model-dtype one {plain}")
        return did

    policy.after_forward = after_forward
    reqs = [Request(i, p, i) for i, p in enumerate(PROMPTS)]
    run_engine(kit.m64, reqs, policy, SamplingConfig(max_new_tokens=kit.new_tokens), set(), 1.0, batch_size=4)
    if not seen["rows"]:
        bad.append("no row was checked")
    return CheckResult("packed bytes", not bad, "; ".join(bad) or
                       f"{seen['forwards']} forwards, {seen['rows']} rows: metered KiB = the bytes of the packed tensors "
                       f"(recounted from them); {seen['alloc']} bytes allocated by capacity against {seen['plain']} in "
                       f"the model's dtype, plus {seen['ring']} of ring")
