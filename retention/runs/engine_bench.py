"""`retention bench --engine hf,vllm,llamacpp`: full-cache decode of this project's engine, of vLLM and of
llama.cpp, side by side.

Every engine decodes the same prompt token ids (`context` tokens of real text, `bench.context_prompt`),
`S` copies per batch, EOS ignored, for `new_tokens` tokens, in the same dtype (llama.cpp: its GGUF's
own types) and on the same number of CPU threads; the figure of each is steady decode, aggregate
tokens/s over the batch, the first token (which comes from the prefill) left out on every side:

* hf: this project's batched engine with the `full` policy (`bench.speed_rows`, the figure of a
  plain `retention bench --scorer full`): `S * (N - 1)` tokens over the summed decode-step times.
* vllm: vLLM's offline `LLM` in its own environment (`.venv-vllm`, whose torch and transformers
  pins differ from this project's), driven through `retention.runs.engines.vllm_bench` in a child
  process: `S * (N - 1)` tokens over the time of `max_tokens=N` minus that of `max_tokens=1`.
* llamacpp: llama.cpp through llama-cpp-python in its own environment (`.venv-llamacpp`), on the
  model's GGUF file (`retention.runs.engine_llamacpp`, `retention.runs.engines.llamacpp_bench`): the
  `S` sequences decode as one batch per `llama_decode` step, `S * (N - 1)` tokens over the summed
  times of those steps. It computes on the GGUF's quantised weights whatever the dtype, so it runs
  once and its figure stands beside every dtype's row (docs/speed.md: its numerics).

With `arms` (`--scorer`), this project's side also decodes those variants (scorers at `budget`, or the
reference variants `dynamic-cache` and `ideal-crop`) at every point, in a second lockstep measurement
beside another pass of its full arm (`bench.speed_rows`), and the table gives each one's tokens/s and
its ratio to that full arm: vLLM has no eviction, so these are ratios within this engine, in the same
run as the cross-engine one. The cross-engine figure is the full arm's first pass, alone, as vLLM runs
alone: beside four arms it decoded 24% slower in one run and 3% in another (smollm2 bf16, 64 slots:
`results/engine-vs-vllm/`).

Threads: vLLM's child gets `OMP_NUM_THREADS` = this process's torch thread count and
`VLLM_CPU_OMP_THREADS_BIND=nobind`, so neither engine pins its threads to cores; llama.cpp's gets the
same count as its `n_threads` (and `OMP_NUM_THREADS`), unpinned as ggml leaves them. The engines run one
after the other (per dtype: this project's, then vLLM's; llama.cpp's last), never at the same time.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from retention.errors import RetentionError
from retention.models import load_model
from retention.models.loading import model_layout
from retention.runs.bench import REFERENCE_VARIANTS, context_prompt, speed_rows, variant_policy
from retention.runs.engine_llamacpp import extra_bufts_choice, llamacpp_figures, llamacpp_python, require_gguf
from retention.runs.engine_runs import resolve_weights
from retention.runs.engines.child import run_child
from retention.runs.engines.vllm_bench import BenchRequest, BenchResult, Point
from retention.versions import library_versions

ENGINES = ("hf", "vllm", "llamacpp")
FOREIGN = ("vllm", "llamacpp")  # the engines compared with this one ("hf"), in column order
VLLM_PYTHON_ENV = "RETENTION_VLLM_PYTHON"
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
ROOT = Path(__file__).resolve().parents[2]  # the checkout: .venv-vllm lies beside `retention/`


@dataclass(frozen=True)
class ArmFigure:
    """Another variant of this project's engine at one point of the table, beside its full arm."""

    name: str  # a scorer (at the run's budget) or a reference variant of `bench`
    tokens_per_second: float
    ratio_to_full: float | None  # > 1: faster than this engine's full arm in the same lockstep run


@dataclass(frozen=True)
class Comparison:
    """One row of the side-by-side table: aggregate steady-decode tokens/s of each engine."""

    dtype: str
    context: int
    batch_size: int
    hf_tokens_per_second: float | None
    vllm_tokens_per_second: float | None
    ratio_hf_vllm: float | None  # > 1: this project's engine is the faster
    arms: tuple[ArmFigure, ...] = ()
    lockstep_full_tokens_per_second: float | None = None  # the full arm beside the arms: their ratios' base
    llamacpp_tokens_per_second: float | None = None
    ratio_hf_llamacpp: float | None = None  # > 1: this project's engine is the faster


def parse_engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad or not names or len(set(names)) != len(names):
        raise RetentionError(f"--engine takes a comma list of distinct engines among {', '.join(ENGINES)}, got {text!r}")
    return [n for n in ENGINES if n in names]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def side_by_side(hf: dict[tuple, float], vllm: dict[tuple, float], keys: list[tuple],
                 arms: dict[tuple, dict[str, float]] | None = None,
                 llamacpp: dict[tuple, float] | None = None) -> list[Comparison]:
    """`keys` are (dtype, context, batch size) in table order; an engine not run has no entry.
    `arms`: per key, the tokens/s of the arms' lockstep measurement by variant, `full` (their base) first."""
    rows = []
    for key in keys:
        a, b, c = hf.get(key), vllm.get(key), (llamacpp or {}).get(key)
        step = dict((arms or {}).get(key, {}))
        base = step.pop("full", None)
        extra = tuple(ArmFigure(n, t, t / base if base else None) for n, t in step.items())
        rows.append(Comparison(*key, a, b, _ratio(a, b), extra, base, c, _ratio(a, c)))
    return rows


def format_table(rows: list[Comparison], engines: list[str] | None = None) -> str:
    """One line per row: this engine's tokens/s, then each other engine's and this one's ratio to it
    (`engines`: those run; default vllm, and llamacpp when a row has its figure); with arms, a column
    for the full arm beside them (`full*`), then two per arm: its tokens/s and its ratio to that full arm."""
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    if engines is None:
        engines = ["vllm"] + (["llamacpp"] if any(r.llamacpp_tokens_per_second is not None for r in rows) else [])
    foreign = [e for e in FOREIGN if e in engines]
    width = {e: max(10, len(e) + 6) for e in foreign}
    figure = {"vllm": lambda r: (r.vllm_tokens_per_second, r.ratio_hf_vllm),
              "llamacpp": lambda r: (r.llamacpp_tokens_per_second, r.ratio_hf_llamacpp)}
    names = list(dict.fromkeys(a.name for r in rows for a in r.arms))
    wide = {n: max(9, len(n) + 6) for n in names}
    head = (f" {'full* tok/s':>11}" if names else "") + "".join(
        f" {n + ' tok/s':>{wide[n]}} {n + '/full*':>{wide[n]}}" for n in names)
    lines = [f"{'dtype':<9} {'context':>7} {'batch':>5} {'hf tok/s':>9}"
             + "".join(f" {e + ' tok/s':>{width[e]}} {'hf/' + e:>{len(e) + 3}}" for e in foreign) + head]
    for r in rows:
        got = {a.name: a for a in r.arms}
        tail = (f" {fmt(r.lockstep_full_tokens_per_second, '11.1f')}" if names else "") + "".join(
            f" {fmt(got[n].tokens_per_second if n in got else None, f'{wide[n]}.1f')}"
            f" {fmt(got[n].ratio_to_full if n in got else None, f'{wide[n]}.2f')}" for n in names)
        cols = "".join(f" {fmt(figure[e](r)[0], f'{width[e]}.1f')} {fmt(figure[e](r)[1], f'{len(e) + 3}.2f')}"
                       for e in foreign)
        lines.append(f"{r.dtype:<9} {r.context:>7} {r.batch_size:>5} {fmt(r.hf_tokens_per_second, '9.1f')}{cols}{tail}")
    return "\n".join(lines)


def vllm_python() -> Path:
    """The python of vLLM's environment: $RETENTION_VLLM_PYTHON, else the checkout's `.venv-vllm`."""
    given = os.environ.get(VLLM_PYTHON_ENV)
    python = Path(given) if given else ROOT / ".venv-vllm" / "bin" / "python"
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise RetentionError(f"vLLM's environment is missing (no {python}): build it with `make .venv-vllm/.installed` "
                             f"(or `make bench-vllm`), or set {VLLM_PYTHON_ENV} to a python that has vllm")
    return python


def kv_cache_gib(kib_per_token: float, longest: int, batch_size: int) -> int:
    """Whole GiB of vLLM KV cache for `batch_size` sequences of `longest` tokens, with a quarter to spare."""
    return max(1, math.ceil(1.25 * kib_per_token * 1024 * longest * batch_size / 2**30))


def child_env(threads: int, kv_gib: int) -> dict[str, str]:
    """The environment of vLLM's child: this checkout first on the path, the same thread count, unpinned."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env.setdefault(KV_SPACE_ENV, str(kv_gib))  # a user's own setting wins
    return env


def run_vllm_child(python: Path, request: BenchRequest, env: dict[str, str], echo: Callable[[str], None]) -> BenchResult:
    """Run `retention.runs.engines.vllm_bench` under `python`; its own progress lines reach `echo`,
    the rest of vLLM's log is kept and its tail shown only if the child fails (`engines.child`)."""
    raw = run_child(python, "retention.runs.engines.vllm_bench", request.to_json(), env, ROOT, label="vLLM",
                    progress="vllm ", result_key="rows", echo=echo)
    return BenchResult.from_json(raw)


@dataclass(frozen=True)
class Arms:
    """This engine's variants beside its full arm (`--scorer`): names in column order, the budget and
    interval of the evicting ones, and the scorer parameters (`--stats`, `--lambda`) each takes."""

    names: tuple[str, ...] = ()
    budget: int | None = None
    interval: int | None = None
    params: tuple[tuple[str, object], ...] = ()


def hf_figures(model: str, dtype: str, device: str, prompts: dict[int, list[int]], batch_sizes: list[int],
               new_tokens: int, echo: Callable[[str], None], arms: Arms = Arms()) -> list[dict]:
    """`bench.speed_rows` of the `full` policy alone at every (context, batch size) (`pass: "alone"`),
    then, with `arms`, of the full policy and the arms in lockstep (`pass: "arms"`), after one short
    warm-up; one row per pass, variant and point."""
    loaded = load_model(model, dtype=dtype, device=device)
    first = next(iter(prompts.values()))
    variants, params = ["full", *arms.names], dict(arms.params)
    # first-call overheads (and each scorer's first compaction) land on no point
    speed_rows(loaded, first, variants, arms.budget, 8, ["mean"], 1, arms.interval, params, None)
    passes = [("alone", ["full"])] + ([("arms", variants)] if arms.names else [])
    rows = []
    for ctx, prompt in prompts.items():
        for bs in batch_sizes:
            for name, names in passes:
                for row in speed_rows(loaded, prompt, names, arms.budget, new_tokens, ["mean"], bs, arms.interval,
                                      params, ctx):
                    echo(f"hf {row['variant']} ({name}) {dtype} S={bs} ctx={len(prompt)}: "
                         f"{row['tokens_per_second']:.2f} tok/s (step {row['step_ms_median']:.1f} ms)")
                    rows.append(dict(row, dtype=dtype, **{"pass": name}))
    del loaded
    gc.collect()  # the model's memory is free again before vLLM starts
    return rows


def run_engine_bench(model: str, engines: list[str], dtypes: list[str], contexts: list[int], batch_sizes: list[int],
                     new_tokens: int, device: str, problems, *, enforce_eager: bool = False,
                     echo: Callable[[str], None] = print, arms: Arms = Arms()) -> dict:
    """Returns the JSON-ready figures (`comparison` is the table's rows; `hf` every variant's rows);
    `echo` receives progress and the table."""
    if new_tokens < 2:
        raise RetentionError("--max-new-tokens: the cross-engine bench times decode steps, so at least 2")
    python = vllm_python() if "vllm" in engines else None  # before anything is measured
    lpython = llamacpp_python() if "llamacpp" in engines else None
    if lpython is not None:
        require_gguf(model)
        extra_bufts_choice()
    for name in arms.names:  # each arm as `run` validates it (its statistics found, its reads provided)
        if name not in REFERENCE_VARIANTS:
            variant_policy(model, name, arms.budget, arms.interval, "mean", dict(arms.params))
    weights, model_id, revision = resolve_weights(model)
    tokenizer = AutoTokenizer.from_pretrained(weights)
    prompts = {c: context_prompt(tokenizer, problems, c) for c in contexts}
    threads = torch.get_num_threads()
    out = {"model": model, "model_id": model_id, "model_revision": revision, "weights": weights, "engines": engines,
           "dtypes": dtypes, "contexts": contexts, "batch_sizes": batch_sizes, "new_tokens": new_tokens,
           "device": device, "threads": threads, "versions": library_versions(), "hf": [], "vllm": [], "llamacpp": [],
           "arms": list(arms.names), "budget": arms.budget if arms.names else None,
           "decode": "aggregate tokens/s of steady decode: S * (new_tokens - 1) tokens, the prefill's first token left out"}
    hf, vl, lc, others = {}, {}, {}, {}
    for dtype in dtypes:
        if "hf" in engines:
            for row in hf_figures(model, dtype, device, prompts, batch_sizes, new_tokens, echo, arms):
                out["hf"].append(row)
                key = (dtype, row["context"], row["batch_size"])
                if row["pass"] == "alone":
                    hf[key] = row["tokens_per_second"]
                else:
                    others.setdefault(key, {})[row["variant"]] = row["tokens_per_second"]
        if python is not None:
            points = tuple(Point(c, bs, tuple(prompts[c])) for c in contexts for bs in batch_sizes)
            request = BenchRequest(weights, dtype, new_tokens, points, enforce_eager=enforce_eager)
            longest = max(len(p) for p in prompts.values()) + new_tokens
            env = child_env(threads, kv_cache_gib(model_layout(model, dtype).kib_per_token, longest, max(batch_sizes)))
            result = run_vllm_child(python, request, env, echo)
            if "hf" in engines and result.device != torch.device(device).type:
                raise RetentionError(f"vLLM ran on {result.device} and this project's engine on {device}: "
                                     f"the figures would not compare (pass --device {result.device})")
            out["vllm_run"] = {"python": str(python), "version": result.vllm_version, "device": result.device,
                               "enforce_eager": enforce_eager,
                               "env": {k: env[k] for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", KV_SPACE_ENV)}}
            for r in result.rows:
                out["vllm"].append(dict(asdict(r), dtype=dtype, decode_seconds=r.decode_seconds,
                                        tokens_per_second=r.tokens_per_second))
                vl[(dtype, r.context, r.batch_size)] = r.tokens_per_second
    if lpython is not None:  # once: llama.cpp computes on the GGUF's own blocks whatever the dtype
        out["llamacpp"], out["llamacpp_run"] = llamacpp_figures(lpython, model, prompts, batch_sizes, new_tokens,
                                                                threads, echo)
        for r in out["llamacpp"]:
            for dtype in dtypes:
                lc[(dtype, r["context"], r["batch_size"])] = r["tokens_per_second"]
    keys = [(d, c, bs) for d in dtypes for c in contexts for bs in batch_sizes]
    table = side_by_side(hf, vl, keys, others, lc)
    out["comparison"] = [asdict(r) for r in table]
    echo(format_table(table, engines))
    return out
