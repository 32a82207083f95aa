#!/usr/bin/env python
"""GPU benchmark of the batched retention engine at the study's model shape (fits in ~8 minutes).

A random-weight Qwen2 with DeepSeek-R1-Distill-Qwen-7B's shape (28 layers, hidden 3584, 28 query
heads, 4 KV heads of 128, intermediate 18944, vocabulary 152064), bf16, on one CUDA device. For batch
sizes 1, 64 and the largest that fits, `alpha` at budget 128 (mean accounting) and `full`: a
512-token prompt (random ids), then 1,024 generated tokens per sequence (EOS ignored, greedy).
Printed and written as JSON: aggregate decode tokens/s, median step time, compaction share, peak
GPU memory, and how many steps were measured (a variant is stopped after `--step-seconds` of
decoding so that the whole script fits its time budget; its tokens/s is over the steps it ran).

On CUDA the engine's static decode forward (`S` rows over preallocated buffers, views of a width that
grows a 512-token block at a time: the same shapes and buffers at every step of a block) is captured
once per variant and width as a CUDA graph and replayed
(`GraphedStep`; `--no-graphs` decodes eagerly). Its first `CHECK_STEPS` replays are checked against
the engine's own eager forward (same logits, bit for bit); a capture that fails or a mismatch turns
the graph off for that variant and the row says why (`graphs`). On a CPU (`--device cpu --shape
tiny`) the same graph-safe forward runs eagerly and is checked at every step, which tests all but
the capture itself.

    python scripts/gpu_bench.py --out gpu_bench.json        # needs a CUDA device
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from retention.policy.scoring.calibration import calibrate  # noqa: E402
from retention.runtime.engine import Engine, Request, SamplingConfig  # noqa: E402
from retention.policy.composite import RetentionPolicy, cadence_for  # noqa: E402
from retention.policy.registry import make_scorer  # noqa: E402

SHAPE = dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
             intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768, rope_theta=10000.0,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
# A small shape of the same family, for a CPU smoke run of this script (`--shape tiny`).
TINY = dict(SHAPE, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512)


def build_model(device, shape=SHAPE):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def bytes_per_token(model) -> int:
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2  # K and V, bf16


def largest_batch(model, device, per_seq_tokens: int, cap: int) -> int:
    """Sequences whose caches fit in 80% of the free memory (activations get the rest), at most `cap`."""
    if device.type != "cuda":
        return cap
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(cap, int(0.8 * free / (per_seq_tokens * bytes_per_token(model)))))


CHECK_STEPS = 3  # replays compared with the eager forward before the graph is trusted


class GraphedStep:
    """The engine's decode forward over its main cache as a CUDA graph (a stand-in for
    `ModelAdapter.forward`; any other forward, a prefill, goes to the eager one).

    Inside the graph nothing depends on a host value: the new keys, values and positions are
    written at each row's length through device index tensors (`idx`, refreshed before each replay,
    like the padding mask, outside the graph), and the views the model attends to are the static
    cache's full-capacity views. The host bookkeeping the eager write does (each row's length, the
    write positions a scorer reads after the forward) is done here after each replay. The views'
    width grows a block at a time (`RetentionLayer.view_width`): one graph per width. A compaction or
    refill writes the same buffers in place; a buffer that moved (it cannot in a static cache: rows
    never outgrow the capacity) is captured again."""

    def __init__(self, eng, capture: bool):
        self.eng, self.cache, self.eager = eng, eng.cache, eng.adapter.forward
        self.capture, self.graphs = capture, {}  # width -> (graph, logits, mask, buffer pointers)
        self.checks = CHECK_STEPS if capture else 1 << 30  # on a CPU: every step
        self.status = "on" if capture else "off (no GPU: the graph-safe forward runs eagerly, checked)"
        self.failed = False
        c, dev = self.cache, eng.device
        self.rows = torch.arange(c.rows, device=dev)
        self.idx = torch.zeros(c.rows, dtype=torch.long, device=dev)
        self.mask = None  # the padding mask of this step's width (a static buffer per graph)
        self.kw = eng.adapter.cache_kw

    def _update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.cache.layers[layer_idx]
        r, idx = self.rows, self.idx
        layer.stores["k"][r, :, idx] = key_states[:, :, 0]
        layer.stores["v"][r, :, idx] = value_states[:, :, 0]
        layer.pbuf[r, :, idx] = self.eng._pos  # [S, 1]: every KV head
        for b in layer.extra.values():  # per-token state of a new token starts at zero
            b[r, :, idx] = 0
        return layer.keys, layer.values

    def _body(self):
        cache = self.cache
        cache.update = self._update  # an instance attribute: the model's attention calls this one
        try:
            cache.set_step_positions(self.eng._pos)
            return self.eng.model(input_ids=self.eng._ids, position_ids=self.eng._pos, use_cache=True,
                                  logits_to_keep=1, attention_mask=self.mask, **{self.kw: cache}).logits[:, -1]
        finally:
            del cache.update

    def _buffers(self):
        return [b.data_ptr() for layer in self.cache.layers for b in layer.buffers().values()]

    def _record(self, width: int):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (writes the same token at the same place: harmless)
            for _ in range(2):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._body()
        self.graphs[width] = (graph, out, self.mask, self._buffers())

    def __call__(self, ids, pos, cache, padded=False):
        lengths = list(cache.lengths)
        if cache is not self.cache or self.failed or max(lengths) + 1 > cache.layers[0].capacity:
            return self.eager(ids, pos, cache, padded)
        self.idx.copy_(torch.tensor(lengths, device=self.idx.device))
        mask = cache.attention_mask(1, self.eng.adapter.dtype)  # [S, 1, 1, w]: always one (static)
        width = mask.shape[-1]
        for layer in cache.layers:  # the views of this step's width (the eager write sets them itself)
            layer.set_width(width)
        got = self.graphs.get(width)
        if got is not None and got[3] == self._buffers():
            got[2].copy_(mask)
        else:
            got, self.mask = None, mask
        try:
            if not self.capture:
                out = self._body()
            else:
                if got is None:
                    self._record(width)
                    got = self.graphs[width]
                got[0].replay()
                out = got[1]
        except Exception as exc:  # noqa: BLE001 - any capture failure: decode eagerly, say why
            self.failed, self.status = True, f"off (capture failed: {type(exc).__name__}: {exc})"[:300]
            cache.lengths = lengths
            return self.eager(ids, pos, cache, padded)
        cache._write_at, cache.lengths = lengths, [n + 1 for n in lengths]
        if self.checks > 0:  # the engine's own forward again: the same writes and the reference logits
            self.checks -= 1
            wrote = self._written()
            cache.lengths = lengths
            ref = self.eager(ids, pos, cache, padded)
            same = all(torch.equal(a, b) for a, b in zip(wrote, self._written()))
            if not (same and torch.equal(ref, out)):
                diff = float((ref.float() - out.float()).abs().max())
                self.failed = True
                self.status = f"off (replay differs from the eager forward: logits by {diff:.3g}, cache writes same: {same})"
                return ref
        return out

    def _written(self) -> list[torch.Tensor]:
        """What the last forward wrote into every buffer (stores, positions, per-token state)."""
        return [b[self.rows, :, self.idx].clone() for layer in self.cache.layers for b in layer.buffers().values()]


def measure(model, policy, S, prompt_len, new_tokens, step_seconds, device, graphs: bool = True) -> dict:
    gen = torch.Generator().manual_seed(S)
    reqs = [Request(i, torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist(), i)
            for i in range(S)]
    cfg = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
    eng = Engine(model, reqs, policy, cfg, set(), bytes_per_token(model) / 1024, batch_size=S)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    with torch.inference_mode(), policy.attach(model):
        t0 = time.perf_counter()
        eng.fill()
        if cuda:
            torch.cuda.synchronize(device)
        prefill_s = time.perf_counter() - t0
        step = None
        if graphs and eng.cache is not None and S > 1:  # the static step (S = 1 runs the DynamicCache path)
            step = GraphedStep(eng, capture=cuda)
            eng.adapter.forward = step
        tokens0 = eng.stats.tokens
        t_dec = time.perf_counter()
        while eng.rows and time.perf_counter() - t_dec < step_seconds:
            t = time.perf_counter()
            eng.step()  # ends with the host read of the sampled tokens: the step is complete
            steps.append(time.perf_counter() - t)
        decode_s = time.perf_counter() - t_dec
    toks = eng.stats.tokens - tokens0
    return {"batch_size": S, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "steps_measured": len(steps),
            "completed": not eng.rows, "prefill_seconds": prefill_s, "decode_seconds": decode_s,
            "tokens_per_second": toks / decode_s if decode_s > 0 else 0.0,
            "step_ms_median": 1000 * statistics.median(steps) if steps else None,
            "compaction_share": eng.stats.compaction_seconds / decode_s if decode_s > 0 else 0.0,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "cache_allocated_gib": eng.stats.allocated_bytes / 2**30,
            "graphs": step.status if step is not None else "off"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--batch-sizes", default="1,64,max")
    ap.add_argument("--max-batch", type=int, default=1024, help="Upper bound of the 'max' batch size.")
    ap.add_argument("--step-seconds", type=float, default=40.0, help="Decode time per variant at most.")
    ap.add_argument("--shape", choices=["r1-qwen-7b", "tiny"], default="r1-qwen-7b",
                    help="tiny: a 2-layer model of the same family (a CPU smoke run of the script).")
    ap.add_argument("--no-graphs", action="store_true", help="Decode eagerly (no CUDA graph of the static step).")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("Error: no CUDA device: this benchmark needs a GPU (or --device cpu --shape tiny)", file=sys.stderr)
        return 2
    t_all = time.perf_counter()
    shape = TINY if args.shape == "tiny" else SHAPE
    model = build_model(device, shape)
    # TriAttention/alpha query statistics of this (random) model, from one forward over random ids.
    ids = torch.randint(0, model.config.vocab_size, (1024,), generator=torch.Generator().manual_seed(1))
    stats_path = Path("/tmp/gpu_bench_stats.safetensors")
    calibrate(model, ids.to(device)).save(stats_path)
    results = {"shape": shape, "dtype": "bfloat16",
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "rows": []}
    for scorer in ("alpha", "full"):
        sc = make_scorer(scorer, stats=str(stats_path))
        policy = RetentionPolicy(sc, cadence_for(sc, args.budget if sc.evicts else None))
        per_seq = (policy.cadence.nominal + policy.cadence.interval) if sc.evicts else args.prompt + args.new_tokens
        per_seq += args.prompt  # the prefill of a new sequence holds its whole prompt for a moment
        for bs in args.batch_sizes.split(","):
            S = largest_batch(model, device, per_seq, args.max_batch) if bs == "max" else int(bs)
            try:
                row = measure(model, policy, S, args.prompt, args.new_tokens, args.step_seconds, device,
                              graphs=not args.no_graphs)
            except torch.OutOfMemoryError:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                row = {"batch_size": S, "error": "out of memory"}
            row.update(scorer=scorer, budget=args.budget if sc.evicts else None, batch_label=bs)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    results["total_seconds"] = time.perf_counter() - t_all
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"total {results['total_seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
