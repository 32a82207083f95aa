"""The shipped routing golden vectors (PyramidKV, AdaKV from kvpress) are well-formed and
self-consistent, and this project's allocations reproduce them (`retention conformance`).

The well-formedness tests read only the files (format: retention/data/golden/routing/README.md,
section 5); the conformance tests run `retention.policy.routing.allocation` on each case's scores and
require the reference's budgets, counts and kept slots exactly. Each rule is also shown to fail on a
damaged copy, so a file that passes really has the stated structure and a pass is not vacuous.
"""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from retention.runs.conformance import check_case, load_case, shipped_dir

ROUTING = shipped_dir() / "routing"  # checked by `retention conformance` with the scorer cases
PYRAMID = sorted(p.stem for p in ROUTING.glob("pyramidkv_case*.safetensors"))
ADA = sorted(p.stem for p in ROUTING.glob("adakv_case*.safetensors"))


def load(stem):
    return load_case(ROUTING / f"{stem}.safetensors")


def header_problems(side, t):
    """The sidecar describes the tensors that are there, with the shapes its parameters imply."""
    out = []
    if set(side["tensors"]) != set(t):
        out.append(f"sidecar lists {sorted(side['tensors'])}, file holds {sorted(t)}")
    for k, v in t.items():
        want = side["tensors"].get(k, {})
        if list(v.shape) != want.get("shape") or str(v.dtype).replace("torch.", "") != want.get("dtype"):
            out.append(f"{k}: {tuple(v.shape)} {v.dtype} != sidecar {want}")
    p = side["params"]
    L, G, n = p["num_layers"], p["num_kv_heads"], p["n"]
    if tuple(t["keys"].shape) != (L, 1, G, n, p["head_dim"]) or tuple(t["scores"].shape) != (L, 1, G, n):
        out.append("keys/scores shapes do not match the parameters")
    if "window_attn" in t:
        w = p["window_size"]
        if tuple(t["window_attn"].shape) != (L, 1, p["num_query_heads"], w, n - w):
            out.append("window_attn shape does not match the parameters")
    return out


def rows_problems(name, keep_sorted, counts, keep_mask, pad):
    """keep_sorted [L, G, m]: per row the first count slots ascending, distinct, in [0, n), the rest pad;
    and the same set as keep_mask [L, G, n]."""
    out = []
    L, G, n = keep_mask.shape
    for layer in range(L):
        for g in range(G):
            c = int(counts[layer, g])
            row = keep_sorted[layer, g]
            head, tail = row[:c], row[c:]
            if not bool((tail == pad).all()) or c > row.numel():
                out.append(f"{name}[{layer},{g}]: padding is not {pad} after {c} entries")
            elif c and not (bool((head[1:] > head[:-1]).all()) and int(head[0]) >= 0 and int(head[-1]) < n):
                out.append(f"{name}[{layer},{g}]: not ascending distinct slots in [0, {n})")
            elif keep_mask[layer, g].nonzero()[:, 0].tolist() != head.tolist():
                out.append(f"{name}[{layer},{g}]: differs from keep_mask")
    return out


def pyramid_problems(side, t):
    out = header_problems(side, t)
    if out:
        return out
    p = side["params"]
    L, G, n, w, pad = p["num_layers"], p["num_kv_heads"], p["n"], p["window_size"], p["pad_value"]
    budget = t["layer_budget"]
    counts = budget[:, None].expand(L, G)
    out += rows_problems("keep_sorted", t["keep_sorted"], counts, t["keep_mask"], pad)
    ref_sorted = torch.where(t["keep_ref_order"] == pad, n, t["keep_ref_order"]).sort(-1).values
    if not torch.equal(torch.where(ref_sorted == n, pad, ref_sorted), t["keep_sorted"]):
        out.append("keep_ref_order is not a reordering of keep_sorted")
    if not bool((budget[1:] <= budget[:-1]).all()) or int(budget.min()) < w or int(budget.max()) > n:
        out.append(f"layer budgets {budget.tolist()} are not non-increasing in [window, n]")
    # The mean budget is n (1 - ratio) up to each layer's rounding.
    if abs(float(budget.sum()) - L * n * (1 - p["compression_ratio"])) > L / 2:
        out.append(f"budgets sum to {int(budget.sum())}, not about L n (1 - ratio)")
    s, keep = t["scores"][:, 0], t["keep_mask"].bool()
    # kvpress pads each layer's window with one value (that layer's max + 1), so it is always kept.
    win, top = s[..., n - w:], s[:, :1, n - w:n - w + 1]  # [L, G, w], [L, 1, 1]
    if not (bool((win == top).all()) and bool((top > s[..., : n - w]).all())):
        out.append("the window slots do not all carry the one score (per layer) above every other slot")
    lowest_kept = torch.where(keep, s, torch.inf).amin(-1)
    best_dropped = torch.where(keep, -torch.inf, s).amax(-1)
    if not bool((lowest_kept > best_dropped).all()):
        out.append("a kept slot scores no higher than a dropped one (kept set is not the top-b)")
    return out


def ada_problems(side, t):
    out = header_problems(side, t)
    if out:
        return out
    p = side["params"]
    L, G, n, pad = p["num_layers"], p["num_kv_heads"], p["n"], p["pad_value"]
    n_kept, n_safe = p["n_kept"], p["n_safe"]
    if n_kept != max(1, int(n * (1 - p["compression_ratio"]))) or n_safe != max(1, int(n_kept * p["alpha_safeguard"])):
        out.append("n_kept / n_safe do not follow from n, compression_ratio and alpha_safeguard")
    keep, safe, counts = t["keep_mask"].bool(), t["safeguard_mask"].bool(), t["keep_count"]
    if not torch.equal(keep.sum(-1), counts):
        out.append("keep_count is not keep_mask's count")
    out += rows_problems("keep_sorted", t["keep_sorted"], counts, t["keep_mask"], pad)
    if counts.sum(-1).tolist() != [G * n_kept] * L:
        out.append(f"kept per layer {counts.sum(-1).tolist()} != G n_kept = {G * n_kept}")
    if not bool((safe.sum(-1) == n_safe).all()) or bool((safe & ~keep).any()) or int(counts.min()) < n_safe:
        out.append("safeguard: not n_safe slots per head, or a safeguarded slot was pruned")
    big = torch.finfo(t["scores"].dtype).max
    want = torch.where(safe[:, None], big, t["scores"])
    if not torch.equal(want, t["safeguarded_scores"]):
        out.append("safeguarded_scores is not scores with finfo.max at the safeguarded slots")
    pruned = torch.zeros(L, G * n, dtype=torch.bool)
    flat = t["pruned_flat_ref_order"]
    if flat.shape != (L, G * (n - n_kept)):
        return out + [f"pruned_flat_ref_order shape {tuple(flat.shape)}"]
    pruned.scatter_(-1, flat, True)
    if not (torch.equal(pruned, ~keep.reshape(L, -1)) and int(pruned.sum()) == flat.numel()):
        out.append("pruned_flat_ref_order is not the complement of keep_mask (or repeats a slot)")
    s = t["safeguarded_scores"][:, 0].reshape(L, -1)
    lowest_kept = torch.where(keep.reshape(L, -1), s, torch.inf).amin(-1)
    best_pruned = torch.where(keep.reshape(L, -1), -torch.inf, s).amax(-1)
    if not bool((lowest_kept > best_pruned).all()):
        out.append("the kept set is not the layer's global top G n_kept of the safeguarded scores")
    if side["checks"]["heads_at_safeguard_floor"] != int((counts == n_safe).sum()):
        out.append("checks.heads_at_safeguard_floor disagrees with keep_count")
    return out


def test_cases_are_shipped_with_their_sidecars():
    assert len(PYRAMID) >= 2 and len(ADA) >= 2
    for stem in PYRAMID + ADA:
        side, _ = load(stem)
        assert side["scorer"] == stem.split("_case")[0] and side["environment"]["kvpress"]
        assert all(r["file"].startswith("kvpress/") and len(r["git_blob_sha"]) == 40 for r in side["reference"])


@pytest.mark.parametrize("stem", PYRAMID)
def test_pyramidkv_case_is_consistent(stem):
    assert pyramid_problems(*load(stem)) == []


@pytest.mark.parametrize("stem", ADA)
def test_adakv_case_is_consistent(stem):
    assert ada_problems(*load(stem)) == []


def test_cases_cover_the_branches_they_claim():
    """PyramidKV: a clipped pyramid, a plain one and the uniform fallback; AdaKV: a case where the
    safeguard decides (some head held at n_safe) and one where it does not."""
    branches = {load(s)[0]["params"]["branch"] for s in PYRAMID}
    assert branches == {"pyramid", "pyramid (clipped)", "fallback"}
    floors = [load(s)[0]["checks"]["heads_at_safeguard_floor"] for s in ADA]
    assert min(floors) == 0 < max(floors)


def swap_kept(t, layer=0, head=0):
    """Drop the first kept slot of one (layer, head) and keep the first dropped one instead."""
    m = t["keep_mask"]
    kept, dropped = m[layer, head].nonzero()[0, 0], (m[layer, head] == 0).nonzero()[0, 0]
    m[layer, head, kept], m[layer, head, dropped] = 0, 1


@pytest.mark.parametrize("damage, expect", [
    (lambda t: swap_kept(t), "differs from keep_mask"),
    (lambda t: t["layer_budget"].__setitem__(0, t["layer_budget"][0] + 1), "padding"),
    (lambda t: t.__setitem__("scores", t["scores"].flip(-1)), "window slots"),
    (lambda t: t.pop("window_attn"), "sidecar lists"),
])
def test_pyramidkv_rules_fail_on_damaged_copies(damage, expect):
    side, t = load(PYRAMID[0])
    damage(t)
    assert any(expect in p for p in pyramid_problems(side, t))


@pytest.mark.parametrize("damage, expect", [
    (lambda t: swap_kept(t), "differs from keep_mask"),
    (lambda t: t["keep_count"][0].__setitem__(0, t["keep_count"][0, 0] - 1), "keep_count is not"),
    (lambda t: t["safeguarded_scores"].mul_(1.0001), "safeguarded_scores is not"),
    (lambda t: t["pruned_flat_ref_order"][0].__setitem__(0, t["pruned_flat_ref_order"][0, 1]), "complement"),
    (lambda t: t["keys"].unsqueeze_(0), "keys"),
])
def test_adakv_rules_fail_on_damaged_copies(damage, expect):
    side, t = load(ADA[-1])
    damage(t)
    assert any(expect in p for p in ada_problems(side, t))


def test_the_routing_cases_are_shipped():
    assert len(PYRAMID) == 4 and len(ADA) == 2


@pytest.mark.parametrize("stem", PYRAMID + ADA)
def test_the_allocations_reproduce_kvpress(stem):
    res = check_case(ROUTING / f"{stem}.safetensors")
    assert res.ok, res.line()
    assert {"keep_mask", "keep_sorted"} <= set(res.checks)
    assert ("layer_budget" if stem.startswith("pyramidkv") else "keep_count") in res.checks


def _copy(tmp_path, stem):
    for suffix in (".safetensors", ".json"):
        shutil.copy(ROUTING / (stem + suffix), tmp_path / (stem + suffix))
    return tmp_path / f"{stem}.safetensors"


def _edit_params(path, **params):
    side = path.with_suffix(".json")
    d = json.loads(side.read_text())
    d["params"].update(params)
    side.write_text(json.dumps(d))


def _edit_tensors(path, fn):
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k).clone() for k in f.keys()}
    fn(tensors)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize(("stem", "damage", "failing"), [
    ("pyramidkv_case1", lambda p: _edit_params(p, beta=3), "layer_budget"),
    ("pyramidkv_case3", lambda p: _edit_params(p, compression_ratio=0.52), "layer_budget"),
    ("pyramidkv_case0", lambda p: _edit_tensors(p, lambda t: swap_kept(t, 1, 1)), "keep_mask"),
    ("adakv_case1", lambda p: _edit_params(p, alpha_safeguard=0.25), "n_safe"),
    ("adakv_case0", lambda p: _edit_tensors(p, lambda t: t["scores"][1, 0, 1].mul_(-1)), "keep_count"),
])
def test_conformance_fails_on_damaged_routing_cases(tmp_path, stem, damage, failing):
    path = _copy(tmp_path, stem)
    damage(path)
    res = check_case(path)
    assert not res.ok and any(f.startswith(failing) for f in res.failures), res.line()
