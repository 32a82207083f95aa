"""`retention bench`: speed, compaction cost, measured cache and agreement figures as JSON; with
`--layouts`, decode step time against context for the study's 124M layouts (`retention.models.arch.bench`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import click
from click.core import ParameterSource

from retention.cli.options import collect, splits_dir_option
from retention.errors import RetentionError

# Options both benchmarks read; every other option belongs to one of them (`_LAYOUT_ONLY` or the scorer benchmark).
_SHARED = {"contexts", "batch_sizes", "dtype", "device", "threads", "out"}
_LAYOUT_ONLY = {"layouts", "steps"}
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BenchArms:
    """What the scorer benchmark measures: the scorers and reference variants (a comma list), at one
    budget (tokens, or KiB per sequence), interval and comma list of accounting modes, with their
    statistics and λ."""

    scorers: str
    budget: int
    budget_kib: float | None
    interval: int | None
    accounting: str
    stats_path: str | None
    lam: float | None


@dataclass(frozen=True)
class BenchShape:
    """How much is measured: batch sizes and contexts (comma lists), tokens per measurement, dev
    problems and tokens for the agreement with `full`, and timed steps per point (--layouts)."""

    batch_sizes: str | None
    contexts: str | None
    new_tokens: int
    problems: int
    agreement_tokens: int | None
    steps: int | None


@dataclass(frozen=True)
class MemoryChoice:
    """--memory-budget: tokens/s at equal KV memory (MiB, sequences per arm, most slots per arm)."""

    memory_mib: float | None
    memory_sequences: int | None
    memory_max_slots: int


@click.command("bench")
@click.option("--model", default="smollm2-135m", show_default=True, help="Model alias or local folder.")
@click.option("--scorer", "--scorers", "scorers", default="full,streaming,random", show_default=True,
              help="Comma list of scorers and reference variants (dynamic-cache: plain transformers DynamicCache; "
                   "ideal-crop: DynamicCache cut to the budget after every step, no scoring); SCORER+STATE adds a "
                   "state at its defaults (triattention+quant: the packed int8 store). --scorers: old name.")
@click.option("--layouts", default=None,
              help="Comma list of the 124M study layouts (mha, gqa, mqa, mla, mla-materialised): time one decode "
                   "step against context on random weights instead of the scorer benchmark.")
@click.option("--batch-sizes", default=None, help="Comma list of batch sizes (sequences per step) [default: 1; 8 with --layouts].")
@click.option("--context", "contexts", default=None,
              help="Comma list of context lengths C: decode after C tokens of real text instead of a MATH prompt "
                   "[with --layouts: tokens pre-filled, default 512,2048,8192].")
@click.option("--steps", type=click.IntRange(min=1, max=10_000), default=None,
              help="With --layouts: timed decode steps per point, after one warm-up (median reported) [default: 3].")
@click.option("--budget", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--budget-bytes", "budget_kib", type=float, default=None,
              help="Cache budget in KiB per sequence instead of --budget: the tokens that many KiB of the model's "
                   "cache layout hold (as in `retention run`).")
@click.option("--interval", type=click.IntRange(min=1), default=None, help="Default: min(128, budget).")
@click.option("--accounting", default="mean", show_default=True, help="Comma list of accounting modes to measure.")
@click.option("--max-new-tokens", "--new-tokens", "new_tokens", type=click.IntRange(min=1, max=1 << 20), default=512,
              show_default=True, help="Tokens generated per measurement (--new-tokens: old name).")
@click.option("--problems", type=click.IntRange(min=0, max=201), default=5, show_default=True,
              help="Dev problems for the agreement-with-full measurement (0 = skip).")
@click.option("--agreement-tokens", type=click.IntRange(min=1, max=1 << 20), default=None,
              help="Tokens per agreement generation (default: --new-tokens).")
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False), default=None, help="Calibration stats for triattention/alpha.")
@click.option("--lambda", "lam", type=click.FloatRange(min=0, max=1e6), default=None,
              help="alpha/rkv redundancy weight.")
@click.option("--dtype", default="float32", show_default=True,
              help="float32, bfloat16 or float16. With --layouts the default is bfloat16 (the study's); with "
                   "--engine hf,vllm: a comma list (e.g. bfloat16,float32), default bfloat16 (llama.cpp computes on "
                   "the GGUF's quantised weights whatever the dtype: it runs once, its figure beside every dtype).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", type=click.IntRange(min=1, max=1024), default=None,
              help="torch CPU threads, at most the CPU count (default: torch's choice).")
@click.option("--engine", "engines", default="hf", show_default=True,
              help="hf,vllm: full-cache decode of this project's engine and of vLLM side by side (same prompts, "
                   "dtype, threads; vLLM in its own environment, $RETENTION_VLLM_PYTHON or .venv-vllm, as `make "
                   "bench-vllm` builds it) [defaults there: --batch-sizes 1,16,64 --context 256 --max-new-tokens 256]; "
                   "with --scorer, this engine's other arms (at --budget) beside its full one, as ratios to it; "
                   "vllm alone: vLLM only. llamacpp (e.g. hf,llamacpp or hf,vllm,llamacpp): llama.cpp on the model's "
                   "GGUF file, the sequences decoded as one batch per step (llama-cpp-python in its own environment, "
                   "$RETENTION_LLAMACPP_PYTHON or .venv-llamacpp, as `make bench-llamacpp` builds it).")
@click.option("--vllm-eager", is_flag=True, default=False,
              help="With --engine ...vllm: run vLLM without torch.compile (as `retention run --engine vllm` does).")
@click.option("--memory-budget", "memory_mib", type=click.FloatRange(min=0, min_open=True, max=1 << 30), default=None,
              help="Also measure tokens/s at equal KV memory: each engine arm gets as many slots as this many MiB "
                   "hold at its measured peak KiB per sequence (the full arm: prompt + new tokens; a retention arm: "
                   "its budget) and decodes the same number of sequences (docs/speed.md).")
@click.option("--memory-sequences", type=click.IntRange(min=1, max=1 << 20), default=None,
              help="With --memory-budget: sequences each arm decodes [default: the most slots any arm gets].")
@click.option("--memory-max-slots", type=click.IntRange(min=1, max=4096), default=256, show_default=True,
              help="With --memory-budget: the most slots an arm gets (a small budget can fit thousands).")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Also write the figures to this JSON file (replaced atomically); they always go to stdout.")
@splits_dir_option
@click.pass_context
@collect("arms", BenchArms)
@collect("shape", BenchShape)
@collect("memory", MemoryChoice)
def bench_command(ctx, model, layouts, dtype, device, threads, engines, vllm_eager, out, splits_dir,
                  arms: BenchArms, shape: BenchShape, memory: MemoryChoice):
    """Measure decode tokens/s, compaction vs decode-step time, measured cache and agreement with `full`;
    with --layouts, decode step time against context for the 124M study layouts (random weights); with
    --engine hf,vllm,llamacpp (any of them), full-cache decode of this project's engine against vLLM's and
    llama.cpp's."""
    # The helpers below take the values one by one (each benchmark reads its own few).
    scorers, budget, budget_kib, interval, accounting, stats_path, lam = (
        arms.scorers, arms.budget, arms.budget_kib, arms.interval, arms.accounting, arms.stats_path, arms.lam)
    batch_sizes, contexts, new_tokens, problems, agreement_tokens, steps = (
        shape.batch_sizes, shape.contexts, shape.new_tokens, shape.problems, shape.agreement_tokens, shape.steps)
    # Explicit means typed on the command line: an environment default (--splits-dir) is not a choice.
    given = {p.name: p.opts[0] for p in ctx.command.params
             if ctx.get_parameter_source(p.name) is ParameterSource.COMMANDLINE}
    from retention.runs.engine_bench import parse_engines

    dtypes, engine_names = _dtype_list(dtype), parse_engines(engines)
    if engine_names != ["hf"]:
        if layouts is not None:
            raise RetentionError(f"--engine {engines} measures a model's full-cache decode, not --layouts")
        if "vllm" not in engine_names:
            _refuse_foreign(given, {"vllm_eager"}, "only with --engine ...vllm")
        _engine_bench(model, engine_names, given, dtypes, contexts, batch_sizes, new_tokens, device, threads,
                      vllm_eager, out, splits_dir, scorers, budget, interval, stats_path, lam)
        return
    if len(dtypes) != 1:
        raise RetentionError(f"--dtype takes one dtype here, got {dtype!r} (a comma list only with --engine ...vllm)")
    dtype = dtypes[0]
    _refuse_foreign(given, {"vllm_eager"}, "only with --engine ...vllm")
    if layouts is not None:
        _layout_bench(layouts, given, contexts, batch_sizes, steps, dtype, device, threads, out)
        return
    _refuse_foreign(given, _LAYOUT_ONLY, "only with --layouts")
    from retention.models import resolve_model

    if resolve_model(model).kind == "arch":  # its own cache and decode loop, not the batched engine
        raise RetentionError(f"{model} is a reference layout model: time its family with `retention bench --layouts`, "
                             f"generate with `retention run --model {model}`")
    from protocol.splits import load_split
    from retention.runs.bench import run_bench
    from retention.policy.cadence.base import ACCOUNTING_MODES
    from retention.runs.settings import tokens_for_kib
    from retention.models import load_model

    names = _variant_names(scorers)
    sizes = _int_list(batch_sizes or "1", "--batch-sizes")
    ctxs = _int_list(contexts, "--context") if contexts else [None]
    if not sizes:
        raise RetentionError("--batch-sizes needs at least one entry")
    modes = [a.strip() for a in accounting.split(",") if a.strip()]
    bad = [m for m in modes if m not in ACCOUNTING_MODES] or ([] if modes else ["(none)"])
    if bad:
        raise RetentionError(f"--accounting: {', '.join(bad)} is not one of {', '.join(ACCOUNTING_MODES)}")
    if budget_kib is not None:  # the same conversion (and refusals) as `retention run --budget-bytes`
        budget = tokens_for_kib(model, dtype, budget if "budget" in given else None, budget_kib)
    _check_variants(names, budget, interval, modes, stats_path, lam)
    if memory.memory_mib is None:
        _refuse_foreign(given, {"memory_sequences", "memory_max_slots"}, "only with --memory-budget")
    _check_out(out)
    torch = _set_threads(threads)
    loaded = load_model(model, dtype=dtype, device=device)
    dev = load_split("dev", splits_dir=splits_dir)
    params = {k: v for k, v in {"stats": stats_path, "lam": lam}.items() if v is not None}
    figures = run_bench(loaded, dev, names, budget, new_tokens, modes, problems, interval=interval, params=params,
                        agreement_tokens=agreement_tokens, echo=lambda msg: click.echo(msg, err=True),
                        batch_sizes=sizes, contexts=ctxs, memory_mib=memory.memory_mib,
                        memory_sequences=memory.memory_sequences, memory_max_slots=memory.memory_max_slots)
    # The budget in both units: tokens per (layer, KV head) and the KiB per sequence they hold.
    figures["budget_kib"] = budget * loaded.geometry.kib_per_token
    if budget_kib is not None:
        figures["budget_kib_requested"] = budget_kib
    figures["threads"] = torch.get_num_threads()
    _emit(figures, out)


def _layout_bench(layouts, given, contexts, batch_sizes, steps, dtype, device, threads, out) -> None:
    """`--layouts`: validate, then time (`retention.models.arch.bench.run_layout_bench`)."""
    from retention.models.arch import bench
    from retention.models import resolve_device

    names = bench.parse_layouts(layouts)
    _refuse_foreign(given, set(given) - _SHARED - _LAYOUT_ONLY, "only for the scorer benchmark, not with --layouts")
    ctxs = _int_list(contexts or ",".join(map(str, bench.STUDY_CONTEXTS)), "--context")
    sizes = _int_list(batch_sizes or str(bench.STUDY_BATCH), "--batch-sizes")
    if not ctxs or not sizes:
        raise RetentionError("--context and --batch-sizes need at least one entry")
    device = resolve_device(device)
    if "dtype" not in given:  # the study's precision, unless asked otherwise
        dtype = "bfloat16"
    _check_out(out)
    _set_threads(threads)
    figures = bench.run_layout_bench(names, ctxs, sizes, steps=steps or bench.DEFAULT_STEPS, dtype=dtype,
                                     device=device, echo=lambda msg: click.echo(msg, err=True))
    _emit(figures, out)


def _variant_names(scorers: str) -> list[str]:
    """The comma list of `--scorer`: scorers and reference variants, each name known."""
    from retention.runs.bench import REFERENCE_VARIANTS, split_variant
    from retention.policy.registry import get_scorer_class, mechanism_class

    names = [s.strip() for s in scorers.split(",") if s.strip()]
    if not names:
        raise RetentionError("--scorer needs at least one scorer name")
    for n in names:
        if n not in REFERENCE_VARIANTS:
            scorer, state = split_variant(n)
            get_scorer_class(scorer)  # fail fast on an unknown name
            if state is not None:
                mechanism_class("state", state)
    return names


def _check_variants(names, budget, interval, modes, stats_path, lam) -> None:
    """What `run` refuses, refused before the model loads: an option no listed scorer takes, a file
    that is not statistics, a cadence a scorer cannot run (in every accounting mode)."""
    from retention.runs.bench import REFERENCE_VARIANTS, split_variant
    from retention.runs.scorer_options import resolve
    from retention.policy.composite import cadence_for
    from retention.policy.registry import make_scorer

    if lam is not None and lam != lam:  # click's FloatRange lets nan through
        raise click.BadParameter("nan is not a number", param_hint="'--lambda'")
    scorer_names = [split_variant(n)[0] for n in names if n not in REFERENCE_VARIANTS]
    if scorer_names:
        resolve(scorer_names, {"--stats": stats_path, "--lambda": lam})
    if stats_path is not None:
        from retention.runs.arms import check_stats_file

        check_stats_file(Path(stats_path))
    for n in scorer_names:
        for mode in modes:
            cadence_for(make_scorer(n), budget, interval, mode)


def _engine_bench(model, engines, given, dtypes, contexts, batch_sizes, new_tokens, device, threads, vllm_eager, out,
                  splits_dir, scorers, budget, interval, stats_path, lam) -> None:
    """`--engine hf,vllm,llamacpp` (or any of them): validate, then measure (`retention.runs.engine_bench`).
    With `--scorer`, this engine's other variants run beside its full arm (`engine_bench.Arms`)."""
    from protocol.splits import load_split
    from retention.models import resolve_device
    from retention.runs.engine_bench import Arms, run_engine_bench

    arm_options = {"scorers", "budget", "interval", "stats_path", "lam"}
    allowed = {"model", "engines", "vllm_eager", "contexts", "batch_sizes", "new_tokens", "dtype", "device", "threads",
               "out", "splits_dir"} | arm_options
    _refuse_foreign(given, set(given) - allowed, f"not with --engine {','.join(engines)}")
    arms = Arms()
    if "scorers" in given:
        if "hf" not in engines:
            raise RetentionError(f"--scorer with --engine {','.join(engines)}: another engine runs the full cache "
                                 "only (add hf to measure arms)")
        names = [n for n in _variant_names(scorers) if n != "full"]  # full is always measured: the ratios' base
        _check_variants(names, budget, interval, ["mean"], stats_path, lam)
        params = tuple((k, v) for k, v in (("stats", stats_path), ("lam", lam)) if v is not None)
        arms = Arms(tuple(dict.fromkeys(names)), budget, interval, params)
    else:
        _refuse_foreign(given, arm_options, "only with --scorer (this engine's arms beside its full cache)")
    if "dtype" not in given:
        dtypes = ["bfloat16"]
    ctxs = _int_list(contexts or "256", "--context")
    sizes = _int_list(batch_sizes or "1,16,64", "--batch-sizes")
    if not ctxs or not sizes:
        raise RetentionError("--context and --batch-sizes need at least one entry")
    device = resolve_device(device)
    _check_out(out)
    _set_threads(threads)
    figures = run_engine_bench(model, engines, dtypes, ctxs, sizes, new_tokens if "new_tokens" in given else 256,
                               device, load_split("dev", splits_dir=splits_dir), enforce_eager=vllm_eager,
                               echo=lambda msg: click.echo(msg, err=True), arms=arms)
    _emit(figures, out)


def _dtype_list(text: str) -> list[str]:
    names = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in names if d not in _DTYPES]
    if bad or not names or len(set(names)) != len(names):
        raise RetentionError(f"--dtype takes distinct dtypes among {', '.join(_DTYPES)}, got {text!r}")
    return names


def _refuse_foreign(given: dict[str, str], names: set[str], why: str) -> None:
    """One line naming the explicitly given options among `names` (the other benchmark's), which
    would otherwise be silently ignored."""
    foreign = [opt for name, opt in given.items() if name in names]
    if foreign:
        raise RetentionError(f"{', '.join(foreign)}: {why}")


def _check_out(out) -> None:
    from protocol.io import check_writable

    if out:
        check_writable(Path(out), "--out")


def _set_threads(threads):
    import torch

    if threads:
        if threads > (os.cpu_count() or 1):  # far more threads than CPUs crashed torch
            raise RetentionError(f"--threads {threads} is more than the {os.cpu_count()} CPUs of this machine")
        torch.set_num_threads(threads)
    return torch


def _emit(figures: dict, out) -> None:
    """The figures as JSON on stdout and, with --out, into that file (replaced atomically)."""
    from protocol.io import dumps, ensure_dir, write_atomic
    from protocol.report import json_safe

    text = dumps(json_safe(figures), indent=2) + "\n"
    click.echo(text, nl=False)
    if out:
        ensure_dir(Path(out).parent, "output folder")
        write_atomic(Path(out), text)
        click.echo(f"wrote {out}", err=True)


def _int_list(text: str, option: str) -> list[int]:
    from retention.errors import RetentionError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RetentionError(f"{option} takes a comma list of positive integers, got {text!r}") from None
    if any(v <= 0 for v in vals):
        raise RetentionError(f"{option} takes a comma list of positive integers, got {text!r}")
    return vals


commands = [bench_command]
