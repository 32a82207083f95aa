"""The llama.cpp side of `retention bench --engine hf,llamacpp`, run in its own environment (`.venv-llamacpp`).

`retention.runs.engine_llamacpp` spawns `python -m retention.runs.engines.llamacpp_bench` there, writes
one `LlamaCppRequest` as JSON on its stdin, and reads one JSON object from its stdout: `LlamaCppResult`,
or `{"error": "..."}` (exit status 2) for a failure the child can name; the protocol of
`retention.runs.engines.vllm_bench`. llama.cpp logs to stderr; descriptor 1 is pointed at stderr all
the same (as the vLLM child does), so that nothing but the result can reach the parent's stdout.

llama.cpp runs through llama-cpp-python's low-level bindings (`llama_cpp.llama_cpp`), not its
`Llama` class, because that class decodes one sequence at a time: here `S` sequences decode together,
one token each per `llama_decode` call, as this project's engine decodes its batch.

* Weights: the GGUF memory-mapped, without llama.cpp's extra weight buffers (`use_extra_bufts =
  false`, llama-cli's `--no-repack`) where its CPU backend reports AMX: its AMX matrix product
  segfaults at the first batched product on such hosts (llama.cpp issue 20824, open; here on the
  first prefill), and the extra buffers are AMX's and the repacked (interleaved Q4_0/Q4_K/...)
  layouts together. Elsewhere they stay on (llama.cpp's default); the request can force either.
* One context per point, sized to it: `n_seq_max = S`, `n_ctx = S * (prompt + new tokens)`, and a
  KV cache split per sequence (`kv_unified = false`: each sequence attends to its own cells only, as
  in this project's engine; a unified cache would attend over every sequence's cells, masked).
* Prefill: each of the `S` copies of the prompt in its own `llama_decode` call (the prompt chunked
  by `n_batch`), logits for its last token only: `S` prefills, as this project's engine and vLLM do.
* Sampling: greedy (`llama_sampler_init_greedy`, an argmax in C over the vocabulary), EOS ignored
  (nothing stops a sequence): every sequence gets exactly `new_tokens` tokens, the first from its
  prefill.
* Decode: `new_tokens - 1` steps, each one `llama_decode` of the `S` last tokens (one `seq_id` per
  sequence, logits for all) and `S` greedy picks. Each step is timed on its own and the steps
  summed, so steady decode is `S * (N - 1) / decode_seconds`: the figure the vLLM child obtains by
  subtracting a `max_tokens=1` generation from a `max_tokens=N` one, and this project's bench by
  summing its decode steps, measured here directly (prefill and first token left out on all three).

Imports the standard library, `llama_cpp` (inside `measure`, in the child only) and the shared
`Point` of the vLLM child (standard library only): the parent imports this module for its dataclasses
without llama_cpp installed.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

from retention.errors import RetentionError
from retention.runs.engines.vllm_bench import Point, PointsRequest, serve_one

GREEDY = "greedy"  # the sampling of every point (the only one measured)
AMX_FEATURE = "AMX_INT8 = 1"  # in `llama_print_system_info` where ggml's CPU backend would use AMX
WARMUP_TOKENS = 8  # one short generation first, so that paging in the weights lands on no point


@dataclass(frozen=True)
class LlamaCppRequest(PointsRequest):
    """What to measure: a GGUF file, the thread count, new tokens per sequence and the points."""

    gguf: str  # the model's GGUF file itself (llama.cpp computes on its quantised weights)
    n_threads: int
    new_tokens: int
    points: tuple[Point, ...]
    n_batch: int = 2048  # llama.cpp's defaults: tokens per llama_decode call ...
    n_ubatch: int = 512  # ... and per compute graph
    extra_bufts: bool | None = None  # llama.cpp's extra weight buffers; None: on unless AMX (module doc)


@dataclass(frozen=True)
class LlamaCppRow:
    """What one point measured on llama.cpp (wall seconds)."""

    context: int
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float  # the S prefills and each one's first (greedy) token
    decode_seconds: float  # the sum of the N - 1 decode steps
    generated_tokens: int  # over the S sequences: S * N (each sequence is checked to have N)
    distinct_outputs: int  # distinct token sequences among the S copies (1: batching changed no greedy pick)

    @property
    def tokens_per_second(self) -> float:
        """Steady decode, aggregate over the batch: `S * (N - 1)` tokens in the decode time."""
        return self.batch_size * (self.new_tokens - 1) / self.decode_seconds

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.batch_size * self.prompt_tokens / self.prefill_seconds


@dataclass(frozen=True)
class LlamaCppResult:
    version: str  # llama-cpp-python's (it pins the llama.cpp it vendors)
    system_info: str  # llama.cpp's `llama_print_system_info`: backends and the CPU features it uses
    flags: dict  # the context parameters every point shared
    rows: tuple[LlamaCppRow, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: dict) -> LlamaCppResult:
        return cls(str(raw["version"]), str(raw["system_info"]), dict(raw["flags"]),
                   tuple(LlamaCppRow(**r) for r in raw["rows"]))


class _Batch:
    """A `llama_batch` of up to `size` tokens, one sequence id per token, freed on close."""

    def __init__(self, lib, size: int):
        self.lib, self.size = lib, size
        self.raw = lib.llama_batch_init(size, 0, 1)

    def fill(self, tokens: list[int], positions: list[int], seq_ids: list[int], logits: list[bool]) -> None:
        b = self.raw
        for i, (tok, pos, seq, want) in enumerate(zip(tokens, positions, seq_ids, logits)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(want)
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)

    def close(self) -> None:
        self.lib.llama_batch_free(self.raw)


def _decode(lib, ctx, batch: _Batch) -> None:
    rc = lib.llama_decode(ctx, batch.raw)
    if rc != 0:  # 1: no KV slot for the batch; < 0: an error (llama.cpp's log above says which)
        raise RetentionError(f"llama_decode returned {rc} for {batch.raw.n_tokens} tokens")


def _context_params(lib, request: LlamaCppRequest, batch_size: int, longest: int):
    params = lib.llama_context_default_params()
    params.n_ctx = batch_size * longest
    params.n_seq_max = batch_size
    params.n_batch, params.n_ubatch = request.n_batch, request.n_ubatch
    params.n_threads = params.n_threads_batch = request.n_threads
    params.kv_unified = False  # each sequence its own cells (module doc)
    params.no_perf = True
    return params


def use_extra_bufts(request: LlamaCppRequest, system_info: str) -> tuple[bool, str]:
    """(llama.cpp's `use_extra_bufts`, why): the request's choice, else off where AMX would be used."""
    if request.extra_bufts is not None:
        return request.extra_bufts, "as requested"
    if AMX_FEATURE in system_info:
        return False, "AMX reported: its matrix product segfaults (llama.cpp issue 20824); repacking is off with it"
    return True, "llama.cpp's default"


def flags(lib, request: LlamaCppRequest, extra: tuple[bool, str]) -> dict:
    """The context parameters of the run, as llama.cpp names them (flash attention: llama.cpp's
    default `auto`, which enables it where the backend supports it: the CPU backend does)."""
    params = _context_params(lib, request, 1, 1)
    return {"use_extra_bufts": extra[0], "use_extra_bufts_why": extra[1], "n_threads": params.n_threads, "n_threads_batch": params.n_threads_batch, "n_batch": params.n_batch,
            "n_ubatch": params.n_ubatch, "kv_unified": bool(params.kv_unified),
            "flash_attn_type": lib.llama_flash_attn_type_name(params.flash_attn_type).decode(),
            "type_k": int(params.type_k), "type_v": int(params.type_v), "sampling": GREEDY,
            "n_ctx": "batch_size * (prompt + new tokens)", "n_seq_max": "batch_size", "use_mmap": True}


def _generate(lib, model, request: LlamaCppRequest, prompt: tuple[int, ...], batch_size: int,
              new_tokens: int) -> tuple[float, float, int, int]:
    """(prefill seconds, decode seconds, tokens generated, distinct outputs) of `batch_size` greedy
    copies of `prompt` in a fresh context sized to them."""
    ctx = lib.llama_init_from_model(model, _context_params(lib, request, batch_size, len(prompt) + new_tokens))
    if not ctx:
        raise RetentionError(f"llama.cpp could not create a context for {batch_size} sequences (its log says why)")
    sampler = lib.llama_sampler_init_greedy()
    prefill = _Batch(lib, min(len(prompt), request.n_batch))
    step = _Batch(lib, batch_size)
    try:
        outputs: list[list[int]] = [[] for _ in range(batch_size)]
        t0 = time.perf_counter()
        for seq in range(batch_size):
            for start in range(0, len(prompt), request.n_batch):
                chunk = prompt[start:start + request.n_batch]
                last = start + len(chunk) == len(prompt)
                prefill.fill(list(chunk), list(range(start, start + len(chunk))), [seq] * len(chunk),
                             [last and i == len(chunk) - 1 for i in range(len(chunk))])
                _decode(lib, ctx, prefill)
            outputs[seq].append(lib.llama_sampler_sample(sampler, ctx, -1))  # the last output: the prompt's end
        prefill_seconds = time.perf_counter() - t0
        seqs, wants = list(range(batch_size)), [True] * batch_size
        decode_seconds = 0.0
        for pos in range(len(prompt), len(prompt) + new_tokens - 1):
            t0 = time.perf_counter()
            step.fill([out[-1] for out in outputs], [pos] * batch_size, seqs, wants)
            _decode(lib, ctx, step)
            for seq in seqs:  # output i of the batch is sequence i's
                outputs[seq].append(lib.llama_sampler_sample(sampler, ctx, seq))
            decode_seconds += time.perf_counter() - t0
    finally:
        step.close()
        prefill.close()
        lib.llama_sampler_free(sampler)
        lib.llama_free(ctx)
    if sorted({len(o) for o in outputs}) != [new_tokens]:
        raise RetentionError(f"llama.cpp generated {sorted({len(o) for o in outputs})} tokens; asked {new_tokens}")
    return prefill_seconds, decode_seconds, sum(map(len, outputs)), len({tuple(o) for o in outputs})


def measure(request: LlamaCppRequest) -> LlamaCppResult:
    """Load the GGUF once, warm up, then time every point in a context of its own."""
    # deferred: llama-cpp-python is installed in the child's environment only (module doc)
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    if not request.points:
        raise RetentionError("no points to measure")
    lib.llama_backend_init()
    info = lib.llama_print_system_info()  # bytes (a C string)
    system_info = (info.decode() if isinstance(info, bytes) else str(info)).strip()
    extra = use_extra_bufts(request, system_info)
    mparams = lib.llama_model_default_params()
    mparams.use_extra_bufts = extra[0]
    model = lib.llama_model_load_from_file(request.gguf.encode(), mparams)
    if not model:
        raise RetentionError(f"llama.cpp could not load {request.gguf} (its log says why)")
    try:
        _generate(lib, model, request, request.points[0].prompt_ids, 1, WARMUP_TOKENS)
        rows = []
        for p in request.points:
            pre, dec, made, distinct = _generate(lib, model, request, p.prompt_ids, p.batch_size, request.new_tokens)
            row = LlamaCppRow(p.context, p.batch_size, len(p.prompt_ids), request.new_tokens, pre, dec, made, distinct)
            print(f"llamacpp S={p.batch_size} ctx={row.prompt_tokens}: {row.tokens_per_second:.2f} tok/s "
                  f"(prefill {pre:.2f} s, {row.prefill_tokens_per_second:.0f} tok/s; decode {dec:.2f} s; "
                  f"{distinct} distinct outputs)", file=sys.stderr, flush=True)
            rows.append(row)
        return LlamaCppResult(str(getattr(llama_cpp, "__version__", "unknown")), system_info,
                              flags(lib, request, extra), tuple(rows))
    finally:
        lib.llama_model_free(model)


def main() -> int:
    # OSError: the bindings' shared library or the model file failed to load
    return serve_one(LlamaCppRequest, measure, (RetentionError, ImportError, OSError))


if __name__ == "__main__":
    sys.exit(main())
