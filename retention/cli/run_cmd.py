"""`retention run`: generate under one or several retention policies on the dev split."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import click

from protocol.io import check_writable_dir, read_jsonl
from retention.runs.arms import validate_arm
from retention.cli.options import bounded, collect, splits_dir_option
from retention.errors import RetentionError
from retention.runs.jobs import execute
from retention.runs.settings import ENGINES, Budget, RunSettings
from retention.runtime.sampling import DEFAULT_SAMPLER, SAMPLERS

def _positive(name):
    def check(ctx, param, value):
        if value is not None and value <= 0:
            raise click.BadParameter(f"must be > 0, got {value}", param_hint=name)
        return value

    return check


def _scorer_list(value: tuple[str, ...]) -> list[str]:
    names = [n.strip() for v in value for n in v.split(",") if n.strip()]
    if not names:
        raise RetentionError("--scorer needs at least one scorer name")
    return list(dict.fromkeys(names))


def _settings(*, no_grade: bool, quiet: bool, **options) -> RunSettings:
    """The run settings of `run`'s options (`RunSettings.from_options` validates them)."""
    return RunSettings.from_options(grade=not no_grade, progress=not quiet, **options)


# `run`'s options, by the typed object each becomes (`retention.cli.options.collect`).
SETTINGS_OPTIONS = ("model", "split", "data_path", "dataset", "splits_dir", "limit", "samples", "max_new_tokens",
                    "temperature", "top_p", "sampler", "seed", "ignore_eos", "fidelity", "trace", "no_grade", "dtype",
                    "device", "isa_portable", "out", "batch_size", "quiet", "engine")
BUDGET_OPTIONS = ("budget", "budget_kib", "interval", "accounting", "sink", "recent", "protect_prompt", "prompt_rule")


@dataclass(frozen=True)
class ArmChoice:
    """The arms `run` lists: the scorers (and the baseline), their parameters and the other families'
    mechanisms, as given (`run_command` resolves them per scorer)."""

    scorers: tuple[str, ...]
    baseline: str | None
    params: tuple[str, ...]
    lam: float | None
    radius: float | None
    window: int | None
    cadence: str | None
    routing: str | None
    state: str | None
    decoding: str | None
    stats_path: str | None


@dataclass(frozen=True)
class ScaleChoice:
    """Where `run` generates: one shard (`--shard I/N|auto`) or Ray tasks (`--ray`, `--shards`, ...)."""

    shard_text: str | None
    ray_address: str | None
    shards: int | None
    gpus_per_shard: float | None
    cpus_per_shard: float | None
    retries: int | None

    def ray_options(self, device: str, shard):
        """The launcher options (None: no Ray launch), checked before any model or data is touched."""
        given = [f for f, v in (("--gpus-per-shard", self.gpus_per_shard), ("--cpus-per-shard", self.cpus_per_shard),
                                ("--retries", self.retries)) if v is not None]
        if given and self.ray_address is None:
            raise RetentionError(f"{', '.join(given)} only apply with --ray (they would be ignored)")
        if self.ray_address is None and self.shards is None:
            return None
        from retention.runs.scale.ray import ray_options

        return ray_options(device, address=self.ray_address, shards=self.shards, gpus_per_shard=self.gpus_per_shard,
                           cpus_per_shard=1.0 if self.cpus_per_shard is None else self.cpus_per_shard,
                           retries=3 if self.retries is None else self.retries, shard=shard)


@click.command("run")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Model alias (r1-distill-qwen-7b, r1-distill-llama-8b, smollm2-135m, qwen2.5-coder-0.5b, "
                   "qwen2.5-coder-1.5b, tiny-random; reference layout models tiny-kv, tiny-cla, tiny-mla, "
                   "tiny-qk-norm-mla, tiny-path-concat, tiny-path-residual, tiny-path-mla), a local folder or a "
                   "local .gguf file.")
@click.option("--scorer", "scorers", multiple=True, default=("alpha",), show_default=True,
              help="Retention scorer (a built-in, an installed plugin's name, package.module:Class or "
                   "path/to/file.py:Class: docs/plugins.md); several as a comma list or repeated option run over "
                   "the same problems.")
@click.option("--baseline", default=None, help="Also run this scorer as the baseline arm (same seeds, same problems).")
@click.option("--budget", type=int, callback=_positive("--budget"),
              help="Cache budget B in tokens per (layer, KV head); its meaning depends on --accounting.")
@click.option("--budget-bytes", "budget_kib", type=float, default=None,
              help="Cache budget in KiB per sequence instead of --budget: the tokens that many KiB of the model's "
                   "cache layout hold, so layouts compare at matched memory.")
@click.option("--interval", type=int, callback=_positive("--interval"),
              help="Compaction interval N (compact when the cache reaches b + N). Default: min(128, B).")
@click.option("--accounting", type=click.Choice(["mean", "prefill", "peak"]), default="mean", show_default=True,
              help="mean: B is the measured mean cache; peak: never above B; prefill: B right after compaction.")
@click.option("--sink", type=int, default=None, help="Protected first tokens (default: the scorer's, 4 for streaming).")
@click.option("--recent", type=int, default=None, help="Protected most recent tokens (default: the scorer's).")
@click.option("--protect-prompt", is_flag=True,
              help="The reference rule: prompt tokens are never evicted nor candidates; b + N applies to the "
                   "generated tokens (the meter still counts the prompt). The same as --prompt-rule keep-on-top.")
@click.option("--prompt-rule", type=click.Choice(["evict", "keep", "keep-on-top"]), default=None,
              help="What every listed arm does with the prompt: evict (an ordinary candidate), keep (protected and "
                   "counted inside b: the protocol's meter), keep-on-top (protected on top of b: the peers' "
                   "convention). Default: each scorer's own (random-pp: keep; the others: evict).")
@click.option("--param", "params", multiple=True, metavar="SCORER.NAME=VALUE",
              help="One scorer's parameter, e.g. --param alpha.lam=0.5 --param rkv.lam=0.1 (repeatable).")
@click.option("--lambda", "lam", type=float, default=None, help="alpha: redundancy penalty weight λ (default 0.5); rkv: mixing weight (default 0.1). Refused when both are listed, or with --param SCORER.lam.")
@click.option("--radius", type=float, default=None, help="alpha: cosine radius under which no penalty applies (default 0).")
@click.option("--window", type=int, default=None, help="snapkv/rkv/h2o: recent query/window size (default 8).")
@click.option("--cadence", default=None, metavar="NAME",
              help="When a compaction happens: fixed (every N tokens; default), newline (at the first line break "
                   "after b + N, at most max_wait later), or a plugin (docs/design-space.md).")
@click.option("--routing", default=None, metavar="NAME",
              help="Which kept set each layer follows: native (the scorer's own; default), shared or per-layer "
                   "(triattention/alpha: one kept set per KV head for all layers, or per layer), pyramidkv or "
                   "adakv (per-layer or per-head budgets with the same mean; --param pyramidkv.beta=20, "
                   "--param adakv.alpha=0.2), or a plugin.")
@click.option("--state", default=None, metavar="NAME",
              help="What a kept token is stored as: full (default), quant (int8/int4 tail, KIVI-style), merge "
                   "(evicted values merged into the nearest kept token), or a plugin.")
@click.option("--decoding", default=None, metavar="NAME",
              help="How generation behaves on the compressed cache: none (default), loop-guard (blocks a "
                   "repetition loop), or a plugin. Parameters of every family: --param NAME.KEY=VALUE.")
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False), default=None,
              help="triattention/alpha: calibration statistics (default: the model's default location).")
@click.option("--split", type=click.Choice(["dev", "confirm"]), default="dev", show_default=True,
              help="Problems of this frozen split (confirm only through `retention confirm --plan`).")
@click.option("--data", "data_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="MATH-500 JSONL (default: the copy shipped with the package); verified against the split manifest.")
@click.option("--dataset", type=click.Choice(["math500", "aime24", "aime25"]), default="math500", show_default=True,
              help="math500 (its dev split) or an AIME set (no dev split: all 30 problems, recorded as explored, so a "
                   "later confirmation on it is flagged).")
@splits_dir_option
@click.option("--limit", type=int, default=None, callback=_positive("--limit"), help="Only the first N problems of the split.")
@click.option("--samples", type=int, default=1, show_default=True, callback=_positive("--samples"), help="Samples k per problem.")
@click.option("--max-new-tokens", type=int, default=8192, show_default=True, callback=_positive("--max-new-tokens"))
@click.option("--temperature", type=float, default=0.6, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=0.95, show_default=True)
@click.option("--sampler", type=click.Choice(SAMPLERS), default=DEFAULT_SAMPLER, show_default=True,
              help="How a sampled token is drawn from the nucleus: inverse-cdf (one uniform number per row) or "
                   "multinomial (torch.multinomial, one exponential per vocabulary entry: what runs before this "
                   "option drew with; written by leaving the key out, so their run directories resume).")
@click.option("--seed", type=int, default=0, show_default=True, help="Base seed; each (problem, sample) derives its own.")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly --max-new-tokens (tests, benchmarks).")
@click.option("--fidelity", is_flag=True, help="Also decode with the full cache and record per-step KL and top-1 agreement.")
@click.option("--trace", is_flag=True,
              help="Record what each record's cache held (kept positions per compaction, layer group and KV head; "
                   "merged/quantised tokens; per-step KL with --fidelity) in trace.jsonl (docs/records.md). Not "
                   "part of the configuration hash; a run directory resumes only with its own setting.")
@click.option("--no-grade", is_flag=True, help="Do not grade records as they are written.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N, mps.")
@click.option("--isa-portable", is_flag=True,
              help="Records that do not depend on the CPU's instruction set: needs --dtype float32 on cpu and "
                   "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2,STRICT set before the start "
                   "(docs/reproducibility.md). The records' host fingerprint notes it.")
@click.option("--out", type=click.Path(file_okay=False), default="results", show_default=True, help="Parent folder of run directories.")
@click.option("--batch-size", type=int, default=None, callback=bounded("--batch-size", 1, 65536),
              help="Sequences decoded together, the slot count of every decode step (continuous batching; recorded, "
                   "and a resume keeps it). Default: as many as the caches fit in half the memory available "
                   "(at most 64 on a CPU, 256 on CUDA), printed.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--shard", "shard_text", default=None, metavar="I/N|auto",
              help="Generate only shard I of N of the (problem, sample) pairs, into records.shard-I-of-N.jsonl; "
                   "auto: from SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT or RANK/WORLD_SIZE. Merge with `retention merge`.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run --shards N shards as Ray tasks and merge them: alone, a private local cluster; "
                   "with ADDRESS (auto, ray://head:10001) an existing cluster. Needs `pip install 'retention[ray]'`.")
@click.option("--shards", type=int, default=None, help="With --ray: number of shards (e.g. one per GPU).")
@click.option("--gpus-per-shard", type=float, default=None, callback=bounded("--gpus-per-shard", 0, 1024),
              help="With --ray: GPUs per shard [default: 1 with --device cuda, else 0 (CPU workers)].")
@click.option("--cpus-per-shard", type=float, default=None, callback=bounded("--cpus-per-shard", 0, 1024, lo_open=True),
              help="With --ray: CPUs per shard [default: 1].")
@click.option("--retries", type=int, default=None, callback=bounded("--retries", 0, 100),
              help="With --ray: times a shard whose worker died is restarted (it resumes from its records) [default: 3].")
@click.option("--engine", type=click.Choice(ENGINES), default="hf", show_default=True,
              help="hf: this project's batched engine (every model and scorer; a DeepSeek-V2/V3 checkpoint "
                   "decodes on the reference MLA modules); vllm: vLLM's offline API for non-evicting arms (full).")
@collect("settings", _settings, SETTINGS_OPTIONS)
@collect("budget", Budget.from_options, BUDGET_OPTIONS, needs=("settings",))
@collect("arms", ArmChoice)
@collect("scale", ScaleChoice)
def run_command(settings: RunSettings, budget: Budget, arms: ArmChoice, scale: ScaleChoice):
    """Generate on the dev split under retention policies and write resumable run directories.

    Rerunning the same command resumes: finished records are skipped.
    """
    from retention.runs.shard import parse_shard

    shard = parse_shard(scale.shard_text)
    names = _scorer_list(arms.scorers)
    baseline = arms.baseline
    if baseline and baseline in names:  # the comparison would be of an arm with itself
        raise RetentionError(f"--baseline {baseline} is also a --scorer arm; the baseline must be another scorer")
    if baseline:
        names.append(baseline)
    if budget.tokens is not None:
        from retention.policy.registry import get_scorer_class

        if not any(get_scorer_class(n).evicts for n in names):  # the budget would be ignored, with no word
            flag = "--budget" if budget.kib is None else "--budget-bytes"
            raise RetentionError(f"{flag} is not used by {', '.join(names)} (no listed scorer evicts: the cache "
                                 "keeps every token); drop it, or list a retention scorer")
    from retention.runs.scorer_options import mechanism_options, resolve, scorer_fields

    routing = arms.routing
    chosen = {"cadence": arms.cadence, "routing": routing, "state": arms.state, "decoding": arms.decoding}
    params, mechanisms = mechanism_options(arms.params, chosen, names)
    if routing in ("shared", "per-layer") and not any("routing" in scorer_fields(n) for n in names):
        raise RetentionError(f"--routing {routing} is not a parameter of any listed scorer ({', '.join(names)})")
    shared = {"--lambda": arms.lam, "--radius": arms.radius, "--window": arms.window, "--stats": arms.stats_path}
    options = resolve(names, shared, params)  # per listed scorer; an option no listed scorer takes is an error
    # Validate every arm (the same function `preregister` and `confirm` use) before loading a
    # model or touching the output folder.
    arm_specs = [validate_arm(dict(scorer=name, scorer_params={k: v for k, v in options[name].items() if v is not None},
                                   **_mechanisms_for(name, mechanisms, baseline)), settings=settings, budget=budget)
                 for name in names]
    ray_opts = scale.ray_options(settings.device, shard)
    out = settings.output.out
    check_writable_dir(out, "--out")
    _announce_size(len(arm_specs), settings)
    before = {f: _output_tokens(_read_records(f)) for f in out.glob("*/records*.jsonl") if f.is_file()}
    t0 = time.perf_counter()
    if ray_opts is not None:
        from retention.runs.scale.ray import launch_from_cli

        run_dirs = launch_from_cli(settings, arm_specs, ray_opts)
        shard = None  # merged
    else:
        run_dirs = execute(settings, arm_specs, shard=shard)
    seconds = time.perf_counter() - t0
    made = 0
    for d in run_dirs:
        # the file this command's records of `d` end in (a Ray launch has merged its shards into records.jsonl)
        records = d / (shard.records_name if shard else "records.jsonl")
        recs = _read_records(records)
        click.echo(_summary_line(d, recs, shard))
        made += _output_tokens(recs) - before.get(records, 0)
    if made > 0:  # what this command generated, over its wall time (model loading included)
        click.echo(f"generated {made} output tokens in {seconds:.1f} s: {made / seconds:.1f} tok/s")


def _read_records(path: Path) -> list[dict]:
    return read_jsonl(path, "record").objects if path.is_file() else []


def _output_tokens(recs: list[dict]) -> int:
    return sum(int(r.get("output_tokens") or 0) for r in recs)


def _mechanisms_for(name: str, mechanisms: dict, baseline: str | None) -> dict:
    """The non-scoring mechanisms of arm `name`: every listed scorer's arm gets them, except the
    `--baseline` arm, which stays at the defaults (the comparison it is the baseline of); a `full`
    arm keeps the decoding mechanism only (the others act at compactions, which it never has)."""
    from retention.policy.registry import get_scorer_class

    from retention.runs.scorer_options import scorer_fields

    if name == baseline:
        return {}
    if not get_scorer_class(name).evicts:
        return {k: v for k, v in mechanisms.items() if k == "decoding"}
    if mechanisms.get("routing") in ("shared", "per-layer") and "routing" not in scorer_fields(name):
        return {k: v for k, v in mechanisms.items() if k != "routing"}  # as a shared option: for those that take it
    return mechanisms


def _summary_line(run_dir: Path, recs: list[dict], shard=None) -> str:
    """One line on the records `recs` of `run_dir` (of `shard`, when given)."""
    n = len(recs)
    correct = sum(1 for r in recs if r.get("verdict") is True)
    mean_cache = sum(r["cache_mean_tokens"] for r in recs) / n if n else 0.0
    tps = sum(r["tokens_per_second"] for r in recs) / n if n else 0.0  # each sequence's own pace
    over = sum(1 for r in recs if r["budget_exceeded"])
    where = f"{run_dir} (shard {shard})" if shard else f"{run_dir}"
    return (f"{where}: {n} records, accuracy {correct}/{n}, mean cache {mean_cache:.1f} tokens, "
            f"{tps:.1f} tok/s per sequence, budget exceeded in {over}")

def _announce_size(n_arms: int, settings: RunSettings) -> None:
    """On a CPU without --limit, say how much is about to be generated (a bare `run` is 201 problems
    x 8,192 tokens per arm: days on a laptop)."""
    p, max_new_tokens = settings.problems, settings.sampling.max_new_tokens
    if p.limit or not str(settings.device).startswith("cpu"):
        return
    from protocol.splits import COUNTS

    n = COUNTS.get(p.split if p.dataset == "math500" else p.dataset, 30)  # an AIME set: its 30 problems
    total = n * p.samples * n_arms * max_new_tokens
    click.echo(f"note: no --limit on a CPU: up to {n} problems x {p.samples} sample(s) x {n_arms} arm(s) x "
               f"{max_new_tokens:,} tokens = {total:,} tokens to generate (use --limit N to try a few)", err=True)


commands = [run_command]
