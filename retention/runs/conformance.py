"""Conformance of this project's scorers with the outputs of the published reference code.

A case is a safetensors file of seeded inputs and the reference implementation's outputs on them,
plus a JSON sidecar with its parameters (format: `retention/data/golden/README.md`, a copy of the
golden vectors shipped with the package). `check_case` runs this project's scorer math (the pure
functions the scorer classes call, and the classes themselves where they can run on the case) in
the reference configuration the sidecar gives, and compares:

* scores within the README's tolerances (max absolute error; TriAttention's raw scores relative to
  their largest magnitude);
* the allocating routings' budgets and kept slots exactly (PyramidKV, AdaKV from kvpress:
  `retention.runs.conformance_routing`, cases in `routing/`);
* kept sets exactly, in slot terms and ascending (the reference stores its compacted cache in score
  order; this project in position order, so only the set is comparable). Where the case gives
  boundary classes (`keep_class`, `tie_quota`), a kept set passes when it keeps every class-2 slot,
  no class-0 slot and exactly `tie_quota` class-1 slots (ties at the top-k boundary are broken
  arbitrarily by the reference's `torch.topk`); slots without a class (the window) must match.

Shapes follow the README: batch 1, head axes before the token axis.

(Over 400 lines: one checker per published reference, TriAttention, SnapKV, R-KV and H2O, beside
the case loader and the tolerance and boundary-class rules they share; split, one comparison
contract would be spread over five files.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from retention.errors import RetentionError
from retention.policy.scoring.base import topk_keep
from retention.policy.scoring.calibration import QueryStats
from retention.policy.scoring.h2o import H2O, attention_mass
from retention.policy.scoring.rkv import RKV, key_redundancy, rkv_scores
from retention.policy.scoring.snapkv import (SnapKV, group_max_logits, pool_candidates, window_attention_mean,
                                             window_importance)
from retention.policy.scoring.triattention import (OFFSETS, TriAttention, global_union_keep, head_scores, query_weights,
                                                   zscore_rows)
from retention.runs.conformance_case import CaseResult
from retention.runs.conformance_random import CHECKERS as RANDOM_CHECKERS
from retention.runs.conformance_random import RANDOM
from retention.runs.conformance_routing import CHECKERS as ROUTING_CHECKERS
from retention.runs.conformance_routing import ROUTINGS
from retention.runtime.cache import CacheView

SCORERS = ("triattention_score", "snapkv_decode", "rkv", "h2o")
# README tolerances (absolute unless noted).
TRI_RAW_REL = 2e-4  # times max |raw_head_scores|
TRI_Z_FLOOR = 1e-6  # z-scores: per head TRI_RAW_REL * max|raw| / sigma_head + this (`tri_z_tolerance`)
WINDOW_ATOL = 1e-6  # SnapKV / R-KV scores
H2O_ATOL = 1e-5


def shipped_dir() -> Path:
    """The golden vectors shipped with the package."""
    return Path(__file__).resolve().parent.parent / "data" / "golden"


def case_files(directory: Path) -> list[Path]:
    """The case files (`*.safetensors`) of a directory, sorted by name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise RetentionError(f"no such case directory: {directory}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise RetentionError(f"no case files (*.safetensors) in {directory}")
    return files


def load_case(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(sidecar, tensors) of one case. The sidecar is the file the safetensors metadata names, else
    the `.json` beside it with the same stem."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise RetentionError(f"{path.name}: not a readable safetensors file ({exc})") from None
    sidecar = path.with_name(meta.get("sidecar") or path.with_suffix(".json").name)
    try:
        side = json.loads(sidecar.read_text())
    except (OSError, ValueError) as exc:
        raise RetentionError(f"{path.name}: unreadable sidecar {sidecar.name} ({exc})") from None
    if not isinstance(side, dict) or not isinstance(side.get("params"), dict):
        raise RetentionError(f"{sidecar.name}: the sidecar needs a 'params' object")
    return side, tensors


def check_case(path: Path) -> CaseResult:
    """Run the matching scorer on one case file and compare with the reference outputs."""
    path = Path(path)
    try:
        side, t = load_case(path)
    except RetentionError as exc:
        res = CaseResult(path.stem, "?")
        res.fail(str(exc))
        return res
    scorer = str(side.get("scorer") or (path.stem.rsplit("_case", 1)[0]))
    res = CaseResult(path.stem, scorer)
    checker = _CHECKERS.get(scorer)
    if checker is None:
        res.fail(f"unknown scorer {scorer!r} (known: {', '.join(SCORERS + ROUTINGS + RANDOM)})")
        return res
    try:
        checker(side["params"], t, res)
    except KeyError as exc:
        res.fail(f"the case lacks {exc.args[0]!r}")
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # inconsistent shapes or parameters
        res.fail(f"could not run the scorer on this case: {exc}")
    return res


def check_dir(directory: Path | None = None) -> list[CaseResult]:
    """Every case of `directory`; by default the shipped scorer cases, the routing cases (PyramidKV,
    AdaKV, in their own folder `routing/`) and the random control's (Random Attention, `random/`)."""
    if directory is not None:
        return [check_case(p) for p in case_files(directory)]
    return [check_case(p) for p in case_files(shipped_dir()) + case_files(shipped_dir() / "routing")
            + case_files(shipped_dir() / "random")]


# --------------------------------------------------------------------------------------------
# One checker per scorer
# --------------------------------------------------------------------------------------------


def _check_triattention(p: dict, t: dict, res: CaseResult) -> None:
    keys = t["keys_postrope"].float()  # [L, 1, G, n, d]
    L, _, G, n, _ = keys.shape
    b = int(p["budget"])
    t_next = int(t["round_start"].reshape(-1)[0])
    qm = torch.complex(t["q_mean_real"].float(), t["q_mean_imag"].float())  # [L, Hq, F]
    Hq = qm.shape[1]
    offsets = tuple(float(o) for o in t["offsets"].tolist())
    scale = t.get("freq_scale_sq")
    trig, norm = query_weights(qm, t["q_abs_mean"].float(), t["inv_freq"].float(), t_next, G, scale, offsets)
    raw = torch.stack([head_scores(keys[l], trig[l], norm[l]).reshape(Hq, n) for l in range(L)])  # [L, Hq, n]
    want_raw = t["raw_head_scores"]
    res.close("raw_head_scores", raw, want_raw, TRI_RAW_REL * float(want_raw.abs().max()))
    # The reference pins the first prefix_length slots (the prompt) and z-scores only the others.
    prefix = int(p.get("prefix_length", 0))
    cand = torch.arange(n) >= prefix
    z = zscore_rows(raw, cand)  # [L, Hq, n]
    z_tol = tri_z_tolerance(want_raw, cand)  # [L, Hq, 1]
    agg_tol = float(z_tol.max())  # an aggregate of heads: the largest head tolerance
    if "zscore_head_scores" in t:
        res.close("zscore_head_scores", z[..., cand], t["zscore_head_scores"][..., cand], z_tol)
    if p.get("score_aggregation", "mean") != "mean" or not p.get("normalize_scores", True):
        res.fail("only score_aggregation='mean' with normalize_scores=true is implemented")
        return
    agg = z.reshape(L, G, Hq // G, n).amax(dim=2).mean(dim=0)  # [G, n]
    pinned = (~cand).expand(G, n)
    if "agg_scores" in t:
        res.close("agg_scores", agg[:, cand], t["agg_scores"][:, cand], agg_tol)
    if "keep_per_head" in t:
        res.kept("keep_per_head", topk_keep(agg, pinned, b), t["keep_per_head"], *_classes(t, "keep_class", "tie_quota"))
    if "keep_per_head_noise_seed0" in t and "tiebreak_noise_seed0_cpu" in t:
        zn = z + t["tiebreak_noise_seed0_cpu"].float()
        aggn = zn.reshape(L, G, Hq // G, n).amax(dim=2).mean(dim=0)
        res.kept("keep_per_head_noise_seed0", topk_keep(aggn, pinned, b), t["keep_per_head_noise_seed0"])
    if "global_combined_scores" in t:
        res.close("global_combined_scores", z.reshape(-1, n).amax(0)[cand], t["global_combined_scores"][cand],
                  agg_tol)
    if "keep_global_union" in t:
        rows = z.reshape(1, L * Hq, n)
        if prefix:
            rows = rows[..., prefix:]
            got = torch.cat([torch.arange(prefix), global_union_keep(rows, cand[None, prefix:], b - prefix)[0] + prefix])
        else:
            got = global_union_keep(rows, cand[None], b)[0]
        res.kept("keep_global_union", got, t["keep_global_union"])
    _tri_class_check(p, t, res, keys, qm, b, prefix, agg_tol)


def tri_z_tolerance(raw: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """The README's z-score tolerance per head: the raw-score tolerance (TRI_RAW_REL * max|raw|)
    divided by the head's spread (population standard deviation of its raw scores over the candidate
    slots `cand`, `[n]` bool), plus TRI_Z_FLOOR. raw: the reference's `[L, Hq, n]`; returns `[L, Hq, 1]`."""
    raw = raw.double()
    sigma = raw[..., cand].std(dim=-1, unbiased=False, keepdim=True)
    return TRI_RAW_REL * float(raw.abs().max()) / sigma + TRI_Z_FLOOR


def _tri_class_check(p, t, res, keys, qm, b, prefix, agg_tol) -> None:
    """The `triattention` scorer class itself on this case, when the case uses its fixed
    configuration (the 17 default offsets, unit frequency weights, no pinned prefix)."""
    scale = t.get("freq_scale_sq")
    if (prefix or "keep_per_head" not in t or tuple(t["offsets"].tolist()) != tuple(float(o) for o in OFFSETS)
            or (scale is not None and not bool((scale == 1).all()))):
        return
    L, _, G, n, _ = keys.shape
    sc = TriAttention()
    sc.bind(QueryStats(qm, t["q_abs_mean"].float(), t["inv_freq"].float(), {}), t["inv_freq"].float())
    pos = t["key_positions"].reshape(1, G, n)
    view = CacheView(list(keys), list(keys), [pos] * L, [torch.zeros(1, G, n, dtype=torch.bool)] * L,
                     int(t["round_start"].reshape(-1)[0]))
    scores = sc.score(view)
    res.close("triattention scorer: agg_scores", scores[0], t["agg_scores"], agg_tol)
    res.kept("triattention scorer: kept", sc.select(scores, view, b)[0], t["keep_per_head"],
             *_classes(t, "keep_class", "tie_quota"))


def _classes(t: dict, cls: str, quota: str):
    return t.get(cls), t.get(quota)


def _window_case(p: dict, t: dict):
    """Inputs common to SnapKV and R-KV: keys `[1, G, n, d]`, queries `[1, H, w, d]`, the candidate
    mask (the first n - w slots), the logit scale, and a `CacheView` of the case (positions = slots)."""
    keys, queries = t["keys"].float(), t["window_queries"].float()
    _, G, n, d = keys.shape
    w = int(p["window"])
    if queries.shape[2] != w:
        raise ValueError(f"window_queries hold {queries.shape[2]} queries, the window is {w}")
    cand = (torch.arange(n) < n - w).expand(1, G, n)
    pos = torch.arange(n).expand(1, G, n)
    view = CacheView([keys], [t["values"].float() if "values" in t else keys], [pos], [~cand], n)
    return keys, queries, cand, 1.0 / math.sqrt(d), view


def _check_snapkv(p: dict, t: dict, res: CaseResult) -> None:
    keys, queries, cand, scaling, view = _window_case(p, t)
    n_c = int(cand[0, 0].sum())
    kernel, b = int(p["kernel_size"]), int(p["budget"])
    logits = group_max_logits(queries, keys, scaling)
    if "group_max_logits" in t:
        # Logits are not bounded like probabilities: compare relative to their magnitude.
        res.close("group_max_logits", logits, t["group_max_logits"],
                  WINDOW_ATOL * max(1.0, float(t["group_max_logits"].abs().max())))
    mean = window_attention_mean(logits, cand)
    res.close("window_attn_mean", mean[..., :n_c], t["window_attn_mean"], WINDOW_ATOL)
    res.close("importance_scores", pool_candidates(mean, cand, kernel)[..., :n_c], t["importance_scores"],
              WINDOW_ATOL)
    sc = SnapKV(window=int(p["window"]), kernel=kernel)
    sc._queries, sc._scaling = [queries], scaling
    scores = sc.score(view)  # [1, 1, G, n]
    res.close("snapkv scorer: importance", scores[0][..., :n_c], t["importance_scores"], WINDOW_ATOL)
    res.kept("keep_sorted", sc.select(scores, view, b)[0], t["keep_sorted"], *_classes(t, "keep_class", "tie_quota"))


def _check_rkv(p: dict, t: dict, res: CaseResult) -> None:
    if p.get("retain_direction", "last") != "last":
        res.fail(f"retain_direction {p['retain_direction']!r}: only 'last' is implemented")
        return
    keys, queries, cand, scaling, view = _window_case(p, t)
    n_c = int(cand[0, 0].sum())
    kernel, b, thr = int(p["kernel_size"]), int(p["budget"]), float(p.get("similarity_threshold", 0.5))
    imp = window_importance(queries, keys, cand, scaling, kernel)
    if "importance_scores" in t:
        res.close("importance_scores", imp[..., :n_c], t["importance_scores"], WINDOW_ATOL)
    red = key_redundancy(keys, torch.ones_like(cand), thr)  # [1, G, n]
    if "redundancy_full" in t:
        res.close("redundancy_full", red[0], t["redundancy_full"], WINDOW_ATOL)
    if "redundancy" in t:
        res.close("redundancy", red[0, :, :n_c], t["redundancy"], WINDOW_ATOL)
    variants = p.get("mix_lambda_variants") or {}
    if not variants:
        res.fail("the sidecar names no mix_lambda_variants")
    for tag, lam in variants.items():
        lam = float(lam)
        final = rkv_scores(imp, red, cand, lam)
        if f"final_score_lam{tag}" in t:
            res.close(f"final_score_lam{tag}", final[..., :n_c], t[f"final_score_lam{tag}"], WINDOW_ATOL)
        sc = RKV(window=int(p["window"]), kernel=kernel, lam=lam, threshold=thr)
        sc._queries, sc._scaling = [queries], scaling
        scores = sc.score(view)
        res.close(f"rkv scorer lam={lam}: score", scores[0][..., :n_c], t[f"final_score_lam{tag}"], WINDOW_ATOL)
        res.kept(f"keep_lam{tag}_sorted", sc.select(scores, view, b)[0], t[f"keep_lam{tag}_sorted"],
                 *_classes(t, f"keep_lam{tag}_class", f"keep_lam{tag}_tie_quota"))


def _check_h2o(p: dict, t: dict, res: CaseResult) -> None:
    """Stateful: the `h2o` scorer accumulates over the prefill and `T` decode steps, evicting
    whenever the cache holds more than `hh + recent` slots, on its own kept cache."""
    q, k = t["queries"].float(), t["keys"].float()  # [1, H, N, d]
    _, H, N, d = k.shape
    P, T = int(p["prefill_len"]), int(p["decode_steps"])
    hh, recent = int(p["hh_size"]), int(p["recent_size"])
    C = hh + recent
    if P + T > N:
        raise ValueError(f"prefill {P} + {T} steps exceed the {N} tokens given")
    scaling = 1.0 / math.sqrt(d)
    sc = H2O(window=recent)
    keys, pos = k[:, :, :P], torch.arange(P).expand(1, H, P)
    acc = torch.zeros(1, H, 0)  # the accumulated mass of the kept slots (what the cache stores for h2o)

    def step(first: int, count: int) -> torch.Tensor:
        """Append `count` tokens (decode) and add the mass their queries give; returns the added mass."""
        nonlocal keys, pos, acc
        if first:  # decode: append the new token to the kept cache
            keys = torch.cat([keys, k[:, :, first:first + count]], dim=2)
            pos = torch.cat([pos, torch.arange(first, first + count).expand(1, H, count)], dim=2)
        acc = torch.cat([acc, acc.new_zeros(1, H, keys.shape[2] - acc.shape[2])], -1)  # new tokens start at 0
        added = attention_mass(q[:, :, first:first + count], keys, pos, pos[:, 0, -count:], scaling)
        acc = acc + added
        return added

    def evict() -> None:
        nonlocal keys, pos, acc
        if keys.shape[2] <= C:
            return
        view = CacheView([keys], [keys], [pos], [torch.zeros_like(pos, dtype=torch.bool)], int(pos.max()) + 1,
                         extra=[{H2O.EXTRA: acc}])
        keep = sc.select(sc.score(view), view, C)[0]  # [1, H, C]
        acc = torch.gather(acc, 2, keep)
        keys = torch.gather(keys, 2, keep[..., None].expand(-1, -1, -1, d))
        pos = torch.gather(pos, 2, keep)

    step(0, P)
    res.close("prefill_hh_score", acc[0], t["prefill_hh_score"], H2O_ATOL)
    evict()
    res.kept("kept_positions[0]", pos[0], t["kept_positions"][0])
    res.close("hh_score_post_evict[0]", acc[0], t["hh_score_post_evict"][0], H2O_ATOL)
    for s in range(T):
        added = step(P + s, 1)
        res.close(f"decode_attn[{s}]", added[0], t["decode_attn"][s], H2O_ATOL)
        res.close(f"decode_hh_score_pre_evict[{s}]", acc[0], t["decode_hh_score_pre_evict"][s], H2O_ATOL)
        evict()
        res.kept(f"kept_positions[{s + 1}]", pos[0], t["kept_positions"][s + 1])
        if "heavy_positions" in t:  # heavy hitters are older than the recent part: the first hh kept
            res.kept(f"heavy_positions[{s + 1}]", pos[0, :, :hh], t["heavy_positions"][s + 1])
        # Position order on both sides, so the scores align slot by slot.
        res.close(f"hh_score_post_evict[{s + 1}]", acc[0], t["hh_score_post_evict"][s + 1], H2O_ATOL)


_CHECKERS = {"triattention_score": _check_triattention, "snapkv_decode": _check_snapkv, "rkv": _check_rkv,
             "h2o": _check_h2o, **ROUTING_CHECKERS, **RANDOM_CHECKERS}
