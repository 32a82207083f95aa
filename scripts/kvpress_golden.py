"""Golden vectors for routing (PyramidKV per-layer budgets, AdaKV per-head budgets) from NVIDIA kvpress.

kvpress pins transformers < 5.3, this project needs 5.24, so this script runs in a separate venv and
is never imported by the package or the tests:

    python3 -m venv /work/venv-kvpress
    /work/venv-kvpress/bin/pip install torch==2.13.0 && /work/venv-kvpress/bin/pip install kvpress
    /work/venv-kvpress/bin/python scripts/kvpress_golden.py [--out retention/data/golden]

Each case builds a tiny seeded random Llama (float32, CPU, sdpa attention), runs one prefill forward
inside the kvpress press's own context manager (`with press(model): model(ids, past_key_values=...)`)
and records, per layer, what the press saw and what it decided. Nothing is re-implemented here:
* the press's `compress`, its scorer's `score` and SnapKV's `compute_window_attention` are wrapped on
  the instances, and SnapKV's module-level `get_prerope_query_states` for the duration of the forward,
  to record inputs and outputs; the originals run unchanged;
* PyramidKV's kept slots are recovered by matching the compressed cache's key rows with the input
  key rows (all rows are distinct), in the order the reference stores them;
* AdaKV's kept slots are the complement of the `module.masked_key_indices` it sets, and its
  safeguarded slots are read from the score tensor it overwrites in place with finfo.max.
A few `checks` recompute a top-k from the recorded scores: assertions on the data, not its source.

Outputs `<press>_case<K>.safetensors` + `<press>_case<K>.json` (format: retention/data/golden/README.md).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvpress
import kvpress.presses.snapkv_press as snapkv_module
from kvpress import AdaKVPress, KnormPress, PyramidKVPress, SnapKVPress

ROOT = Path(__file__).resolve().parent.parent
PAD = -1  # padding of the variable-length kept-index tensors


@dataclass(frozen=True)
class ModelSpec:
    """The tiny random Llama a case runs on (weights from torch.manual_seed(seed))."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    n: int  # prefill length = k_len the press sees
    seed: int
    init_std: float = 0.2  # larger than the default 0.02 so scores are well separated
    loud_kv_head: int | None = None  # this head's k_proj rows are scaled by loud_factor (AdaKV: starves it)
    loud_factor: float = 1.0


@dataclass(frozen=True)
class PyramidCase:
    name: str
    model: ModelSpec
    compression_ratio: float
    window_size: int
    kernel_size: int
    beta: int
    note: str


@dataclass(frozen=True)
class AdaCase:
    name: str
    model: ModelSpec
    scorer: str  # "snapkv" or "knorm" (the inner ScorerPress)
    compression_ratio: float
    alpha_safeguard: float
    window_size: int = 0  # snapkv only
    kernel_size: int = 0  # snapkv only
    note: str = ""


WINDOW_DOC = {
    "window_queries_prerope": "get_prerope_query_states output inside compute_window_attention (recorded): q_proj of "
                              "the last w hidden states, before RoPE [L,1,Hq,w,d]",
    "window_cos": "position_embeddings[0][:, -w:] the press rotates those queries with (recorded) [L,1,w,d]",
    "window_sin": "position_embeddings[1][:, -w:] (recorded) [L,1,w,d]; post-RoPE q = q cos + rotate_half(q) sin",
    "window_attn": "SnapKVPress.compute_window_attention output (recorded): softmax over all n keys of the last w "
                   "post-RoPE queries (causal inside the window), float32, sliced to the first n-w keys [L,1,Hq,w,n-w]",
}
SNAPKV_SCORES_DOC = ("SnapKVPress.score output (recorded): window_attn mean over the w queries, avg_pool1d(kernel, "
                     "stride 1, padding kernel//2, zero padding counted), mean over the Hq/G query heads of each KV "
                     "head, then the w window slots padded with (max over that layer's heads and slots) + 1 [L,1,G,n]")

CASES = (
    PyramidCase("pyramidkv_case0", ModelSpec(4, 4, 2, 16, 48, 7000), 0.5, 4, 5, 20,
                "pyramid clipped at the top: max_num reaches n - window"),
    PyramidCase("pyramidkv_case1", ModelSpec(6, 4, 2, 16, 64, 7001), 0.5, 4, 5, 2,
                "unclipped pyramid, non-integer steps rounded per layer"),
    PyramidCase("pyramidkv_case2", ModelSpec(3, 4, 2, 32, 40, 7002), 0.75, 8, 7, 20,
                "fallback branch: min_num < window, every layer keeps round(n (1 - ratio))"),
    PyramidCase("pyramidkv_case3", ModelSpec(3, 4, 2, 16, 50, 7003), 0.5, 4, 5, 2,
                "budgets 37.5, 25, 12.5 before rounding: Python round() is half-to-even (38, 25, 12)"),
    AdaCase("adakv_case0", ModelSpec(2, 4, 2, 16, 48, 8000), "snapkv", 0.5, 0.2, 4, 5,
            "AdaKV over SnapKV scores (observation window 4)"),
    AdaCase("adakv_case1", ModelSpec(3, 8, 4, 16, 40, 8001, loud_kv_head=1, loud_factor=3.0), "knorm", 0.7, 0.5,
            note="AdaKV over key-norm scores; KV head 1 has 3x larger keys, so the safeguard binds there"),
)


def build_model(spec: ModelSpec) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """A seeded tiny Llama and its prefill ids [1, n]."""
    torch.manual_seed(spec.seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=spec.q_heads * spec.head_dim, intermediate_size=96,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.q_heads,
                      num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, max_position_embeddings=256,
                      initializer_range=spec.init_std, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).float().eval()
    if spec.loud_kv_head is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                rows = slice(spec.loud_kv_head * spec.head_dim, (spec.loud_kv_head + 1) * spec.head_dim)
                layer.self_attn.k_proj.weight[rows] *= spec.loud_factor
    ids = torch.randint(0, cfg.vocab_size, (1, spec.n), generator=torch.Generator().manual_seed(spec.seed))
    return model, ids


def record(press, scorer, rec: dict):
    """Wrap press.compress, scorer.score (and SnapKV's window attention and query projection); each
    call stores its tensors in rec[name][layer_idx]. Returns the function that undoes the one
    module-level wrap (the instance wraps die with the press)."""
    orig_compress, orig_score = press.compress, scorer.score

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        rec.setdefault("keys", {})[module.layer_idx] = keys.detach().clone()
        rec.setdefault("module", {})[module.layer_idx] = module
        k2, v2 = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        rec.setdefault("keys_out", {})[module.layer_idx] = k2.detach().clone()
        return k2, v2

    def score(module, *args, **kw):
        s = orig_score(module, *args, **kw)
        rec.setdefault("scores", {})[module.layer_idx] = s.detach().clone()
        rec.setdefault("scores_live", {})[module.layer_idx] = s  # AdaKV overwrites it in place
        return s

    press.compress, scorer.score = compress, score
    if not isinstance(scorer, SnapKVPress):
        return lambda: None
    orig_queries, orig_window = snapkv_module.get_prerope_query_states, scorer.compute_window_attention

    def queries(module, hidden_states):
        q = orig_queries(module, hidden_states)
        rec.setdefault("window_queries_prerope", {})[module.layer_idx] = q.detach().clone()
        return q

    def window(module, hidden_states, keys, window_size, position_embeddings):
        a = orig_window(module, hidden_states, keys, window_size, position_embeddings)
        rec.setdefault("window_attn", {})[module.layer_idx] = a.detach().clone()
        cos, sin = position_embeddings  # [1, n, d]: the RoPE tables the press rotates the queries with
        rec.setdefault("window_cos", {})[module.layer_idx] = cos[:, -window_size:].detach().clone()
        rec.setdefault("window_sin", {})[module.layer_idx] = sin[:, -window_size:].detach().clone()
        return a

    scorer.compute_window_attention = window
    snapkv_module.get_prerope_query_states = queries  # a module-level name: undone after the forward
    return lambda: setattr(snapkv_module, "get_prerope_query_states", orig_queries)


def run_press(press, scorer, spec: ModelSpec) -> tuple[dict, torch.Tensor]:
    model, ids = build_model(spec)
    rec: dict = {}
    restore = record(press, scorer, rec)
    try:
        with torch.no_grad(), press(model):
            model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    finally:
        restore()
    assert sorted(rec["keys"]) == list(range(spec.layers)), "the press did not run on every layer"
    return rec, ids


def stack(rec: dict, name: str) -> torch.Tensor:  # per-layer records -> one tensor [L, ...]
    return torch.stack([rec[name][i] for i in sorted(rec[name])])


def window_tensors(rec: dict) -> dict:
    """SnapKV's observation window: pre-RoPE queries [L,1,Hq,w,d], the RoPE tables it rotates them
    with [L,1,w,d] and the attention it computes [L,1,Hq,w,n-w] (empty for a scorer without one)."""
    if "window_attn" not in rec:
        return {}
    return {k: stack(rec, k) for k in ("window_queries_prerope", "window_cos", "window_sin", "window_attn")}


def match_rows(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Slot of every compressed key row. inp [1, G, n, d], out [1, G, b, d] -> [G, b] (storage order)."""
    eq = (out[0][:, :, None, :] == inp[0][:, None, :, :]).all(-1)  # [G, b, n]
    assert bool((eq.sum(-1) == 1).all()), "a compressed row matches no input row or several"
    return eq.float().argmax(-1)


def padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.full((len(rows), width), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def boundary(sorted_desc: torch.Tensor, k: int) -> dict:
    """The k-th and (k+1)-th largest of one row of scores (descending) and their margin."""
    kth, nxt = float(sorted_desc[k - 1]), float(sorted_desc[k])
    return {"kth_value": kth, "next_value": nxt, "margin": kth - nxt, "boundary_tie": kth == nxt}


def pyramid(case: PyramidCase) -> tuple[dict, dict, dict]:
    spec = case.model
    press = PyramidKVPress(compression_ratio=case.compression_ratio, window_size=case.window_size,
                           kernel_size=case.kernel_size, beta=case.beta)
    rec, ids = run_press(press, press, spec)
    L, G, n, w = spec.layers, spec.kv_heads, spec.n, case.window_size
    budgets = [press.get_layer_budget(rec["module"][i], n) for i in range(L)]
    keep_ref = [match_rows(rec["keys"][i], rec["keys_out"][i]) for i in range(L)]  # [G, b_l] each
    scores = stack(rec, "scores")  # [L, 1, G, n]
    checks: dict = {"layer_budget_sum": sum(budgets), "n_times_layers_times_keep_fraction": n * L * (1 - case.compression_ratio),
                    "every_budget_at_least_window": all(b >= w for b in budgets), "boundaries": {}}
    for i in range(L):
        assert keep_ref[i].shape == (G, budgets[i]), f"layer {i}: kept {tuple(keep_ref[i].shape)} != budget {budgets[i]}"
        # recomputed cross-check: the recovered slots are the top-b of the recorded scores
        top = scores[i, 0].topk(budgets[i], dim=-1).indices
        assert torch.equal(top.sort(-1).values, keep_ref[i].sort(-1).values), f"layer {i}: kept set != top-b"
        srt = scores[i, 0].sort(-1, descending=True).values
        checks["boundaries"][f"layer_{i}"] = [boundary(srt[g], budgets[i]) for g in range(G)]
        assert not any(c["boundary_tie"] for c in checks["boundaries"][f"layer_{i}"]), "a tie at a top-b boundary"
    bmax = max(budgets)
    keep_sorted = torch.stack([padded(list(k.sort(-1).values), bmax) for k in keep_ref])  # [L, G, bmax]
    keep_order = torch.stack([padded(list(k), bmax) for k in keep_ref])
    keep_mask = torch.zeros(L, G, n, dtype=torch.uint8)
    for i in range(L):
        keep_mask[i].scatter_(-1, keep_ref[i], 1)
    tensors = {"input_ids": ids, "keys": stack(rec, "keys"), "scores": scores,
               **window_tensors(rec), "layer_budget": torch.tensor(budgets, dtype=torch.long),
               "keep_sorted": keep_sorted, "keep_ref_order": keep_order, "keep_mask": keep_mask}
    params = {"num_layers": L, "num_query_heads": spec.q_heads, "num_kv_heads": G, "head_dim": spec.head_dim,
              "n": n, "compression_ratio": case.compression_ratio, "window_size": w,
              "kernel_size": case.kernel_size, "beta": case.beta, "pad_value": PAD, "dtype": "float32",
              "branch": pyramid_branch(budgets, n, w)}
    derivation = {
        "keys": "keys the press's compress received for each layer (post-RoPE prefill cache) [L,1,G,n,d]",
        **WINDOW_DOC, "scores": SNAPKV_SCORES_DOC,
        "layer_budget": "PyramidKVPress.get_layer_budget(module, n) per layer (called on the recorded modules); "
                        "equals the kept count per head of that layer, window included",
        "keep_ref_order": "slots of the compressed cache rows in stored order (topk order: descending score, "
                          "window first), recovered by matching key rows; padded with -1 to max budget",
        "keep_sorted": "keep_ref_order sorted ascending per (layer, head), padded with -1",
        "keep_mask": "1 where the slot is kept, per (layer, KV head, slot)",
    }
    files = ["presses/pyramidkv_press.py", "presses/snapkv_press.py", "presses/base_press.py", "utils.py"]
    return tensors, params, {"derivation": derivation, "checks": checks, "files": files}


def pyramid_branch(budgets: list[int], n: int, window: int) -> str:
    """A label for the README, read from the recorded budgets: which branch of get_layer_budget ran."""
    if len(set(budgets)) == 1 and len(budgets) > 1:
        return "fallback"
    return "pyramid (clipped)" if budgets[0] == n - window else "pyramid"


def ada(case: AdaCase) -> tuple[dict, dict, dict]:
    spec = case.model
    if case.scorer == "snapkv":
        inner = SnapKVPress(compression_ratio=case.compression_ratio, window_size=case.window_size,
                            kernel_size=case.kernel_size)
    else:
        inner = KnormPress(compression_ratio=case.compression_ratio)
    press = AdaKVPress(press=inner, alpha_safeguard=case.alpha_safeguard)
    rec, ids = run_press(press, inner, spec)
    L, G, n = spec.layers, spec.kv_heads, spec.n
    n_kept = kvpress.utils.compute_n_kept(n, case.compression_ratio)
    scores = stack(rec, "scores")  # [L, 1, G, n], before the safeguard
    live = stack(rec, "scores_live")  # after AdaKV's in-place scatter of finfo.max
    safe_mask = (live == torch.finfo(live.dtype).max)[:, 0].to(torch.uint8)  # [L, G, n]
    keep_mask = torch.ones(L, G, n, dtype=torch.uint8)
    pruned_flat = []
    for i in range(L):
        b_idx, h_idx, s_idx = rec["module"][i].masked_key_indices
        assert bool((b_idx == 0).all())
        keep_mask[i, h_idx, s_idx] = 0
        pruned_flat.append(h_idx * n + s_idx)  # topk order of the bottom-k over the flattened [G*n]
    counts = keep_mask.sum(-1).long()  # [L, G]
    keep_sorted = torch.stack([padded([keep_mask[i, g].nonzero()[:, 0] for g in range(G)], int(counts.max()))
                               for i in range(L)])
    n_safe = int(safe_mask[0, 0].sum())
    checks: dict = {"kept_per_layer": counts.sum(-1).tolist(), "G_times_n_kept": G * n_kept,
                    "min_head_count": int(counts.min()), "heads_at_safeguard_floor": int((counts == n_safe).sum()),
                    "layers": {}}
    for i in range(L):
        assert int(counts[i].sum()) == G * n_kept and bool((safe_mask[i].bool() <= keep_mask[i].bool()).all())
        flat = live[i, 0].reshape(-1).sort().values  # ascending; the first G*(n-n_kept) are pruned
        k = G * (n - n_kept)
        margin = float(flat[k] - flat[k - 1])
        # recomputed: the same global top-k without the safeguard, to show whether it changed the set
        plain = torch.zeros(G * n, dtype=torch.bool)
        plain[scores[i, 0].reshape(-1).topk(G * n_kept).indices] = True
        checks["layers"][f"layer_{i}"] = {"prune_boundary_margin": margin, "boundary_tie": margin == 0.0,
                                          "slots_kept_only_by_safeguard": int((keep_mask[i].reshape(-1).bool() & ~plain).sum())}
        assert margin > 0, "a tie at the global pruning boundary"
    tensors = {"input_ids": ids, "keys": stack(rec, "keys"), "scores": scores,
               "safeguarded_scores": live.clone(), "safeguard_mask": safe_mask, "keep_mask": keep_mask,
               "keep_count": counts, "keep_sorted": keep_sorted, "pruned_flat_ref_order": torch.stack(pruned_flat)}
    tensors.update(window_tensors(rec))
    params = {"num_layers": L, "num_query_heads": spec.q_heads, "num_kv_heads": G, "head_dim": spec.head_dim,
              "n": n, "scorer": case.scorer, "compression_ratio": case.compression_ratio,
              "alpha_safeguard": case.alpha_safeguard, "n_kept": n_kept, "n_safe": n_safe,
              "n_pruned_per_layer": G * (n - n_kept), "pad_value": PAD, "dtype": "float32"}
    if case.scorer == "snapkv":
        params.update(window_size=case.window_size, kernel_size=case.kernel_size)
    scorer_doc = SNAPKV_SCORES_DOC if case.scorer == "snapkv" else "KnormPress.score output (recorded): minus the L2 norm of each key, float32"
    derivation = {
        "keys": "keys the press's compress received for each layer (post-RoPE prefill cache) [L,1,G,n,d]",
        "scores": scorer_doc + "; before AdaKV's safeguard",
        "safeguarded_scores": "the same tensor after AdaKV wrote finfo(float32).max into each head's top n_safe slots "
                              "(recorded: AdaKV scatters in place into the tensor score returned)",
        "safeguard_mask": "1 where safeguarded_scores == finfo(float32).max [L,G,n]",
        "keep_mask": "complement of module.masked_key_indices set by AdaKVPress.compress (recorded) [L,G,n]",
        "keep_count": "keep_mask summed per (layer, KV head) [L,G]",
        "keep_sorted": "kept slots ascending per (layer, KV head), padded with -1 to the largest count [L,G,max]",
        "pruned_flat_ref_order": "masked (head * n + slot) in the order AdaKV's topk of -scores returned them [L,G*(n-n_kept)]",
    }
    if "window_attn" in tensors:
        derivation.update(WINDOW_DOC)
    files = ["presses/adakv_press.py", f"presses/{case.scorer}_press.py", "presses/base_press.py", "utils.py"]
    return tensors, params, {"derivation": derivation, "checks": checks, "files": files}


# kvpress source files used and the symbols of each that a case runs.
REFERENCE = {
    "presses/pyramidkv_press.py": ["PyramidKVPress.get_layer_budget", "PyramidKVPress.compress"],
    "presses/adakv_press.py": ["AdaKVPress.compress"],
    "presses/snapkv_press.py": ["SnapKVPress.score", "SnapKVPress.compute_window_attention"],
    "presses/knorm_press.py": ["KnormPress.score"],
    "presses/base_press.py": ["BasePress.forward_hook (prefill only)", "BasePress.__call__ (context manager)"],
    "utils.py": ["compute_n_kept", "get_prerope_query_states"],
}


def provenance(files: list[str]) -> list[dict]:
    """One entry per kvpress source file used: its sha256 (as the wheel's RECORD writes it) and git blob sha."""
    base = Path(kvpress.__file__).parent
    version = md.version("kvpress")
    out = []
    for rel in files:
        data = (base / rel).read_bytes()
        sha = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        out.append({"package": "kvpress", "version": version, "source": f"PyPI wheel kvpress-{version}-py3-none-any.whl",
                    "file": f"kvpress/{rel}", "record_sha256": sha, "git_blob_sha": blob, "symbols": REFERENCE[rel]})
    return out


def write_case(case, out_dir: Path) -> str:
    press = case.name.split("_case")[0]
    tensors, params, extra = pyramid(case) if press == "pyramidkv" else ada(case)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    side = {"scorer": press, "case": int(case.name.rsplit("_case", 1)[1]), "split": "public",
            "seed": case.model.seed, "params": params, "note": case.note,
            "model": {"class": "transformers LlamaForCausalLM, random init", **asdict(case.model),
                      "vocab_size": 97, "intermediate_size": 96, "attn_implementation": "sdpa", "rope_theta": "default"},
            "reference": provenance(extra["files"]),
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": md.version("transformers"), "kvpress": md.version("kvpress")},
            "how_run": f"with {type(case).__name__.replace('Case', '')}KVPress(...)(model): model(input_ids, past_key_values=DynamicCache()) -- one "
                       "prefill forward of the seeded model, float32 CPU, inside the press's own context manager. "
                       "The press's compress and its scorer's score (and SnapKV's compute_window_attention and "
                       "get_prerope_query_states) were wrapped to record inputs and outputs; the originals ran unchanged.",
            "derivation": extra["derivation"], "checks": extra["checks"],
            "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in tensors.items()}}
    (out_dir / f"{case.name}.json").write_text(json.dumps(side, indent=1) + "\n")
    save_file(tensors, str(out_dir / f"{case.name}.safetensors"), metadata={"scorer": press, "sidecar": f"{case.name}.json"})
    return f"{case.name}: " + (f"layer budgets {tensors['layer_budget'].tolist()}" if press == "pyramidkv" else
                               f"kept per head {tensors['keep_count'].tolist()} (n_kept {params['n_kept']}, "
                               f"n_safe {params['n_safe']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "retention" / "data" / "golden" / "routing")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        print(write_case(case, args.out))


if __name__ == "__main__":
    main()
