"""Runs through an external engine: `retention run --engine NAME` opens the run directories
(`execute_with_engine`) and generates every missing record through the engine (`run_engine_arms`),
building the requests from the problems exactly as `retention.runs.runner.run_arms` does (chat
template, seeds, shard filter, resume) and writing records with the same schema (`build_record`).
The engines themselves (`retention.runs.engines`) know nothing of runs.
"""

from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm
from transformers import GenerationConfig

from protocol import grading
from retention.errors import RetentionError
from retention.models import CacheGeometry, format_prompt, output_text
from retention.models import prompt_style as style_of  # `run_engine_arms` takes a `prompt_style` argument
from retention.models.aliases import ALIASES, SPLIT_GGUFS
from retention.models.gguf import locate_parts
from retention.models.loading import weights_reference
from retention.models.weights_cache import _read_marker, cache_root
from retention.runs.engines import engine_factory
from retention.runs.engines.base import Completion, Engine, Request, full_cache_meter, refuse_evicting
from retention.runs.merge import open_shard_run
from retention.runs.runner import Arm, derive_seed, make_record
from retention.runs.settings import RunSettings
from retention.runs.shard import shard_pairs


def build_record(c: Completion, *, config_hash: str, text: str, gold, cadence, kib_per_token: float,
                 batch_size: int, grader=None, problem: str | None = None) -> tuple[dict, tuple[list[int], list[float]]]:
    """The record of one completion (`retention.runs.runner.make_record`) and its cache trace."""
    meter = full_cache_meter(len(c.request.prompt_ids), len(c.token_ids), kib_per_token)
    record = make_record(config_hash=config_hash, problem_id=c.request.problem_id, sample=c.request.sample,
                         seed=c.request.seed, prompt_tokens=len(c.request.prompt_ids), token_ids=c.token_ids,
                         text=text, finish_reason=c.finish_reason, meter=meter, cadence=cadence,
                         wall_seconds=c.wall_seconds, batch_size=batch_size, gold=gold, grader=grader,
                         problem=problem)
    return record, meter.trace()


def run_engine_arms(engine: Engine, tokenizer, kib_per_token: float, arms, problems, settings: RunSettings, *,
                    eos_ids: set[int], shard=None, batch: int = 64, prompt_style: str = "chat") -> None:
    """Generate every missing (problem, sample) record of every arm through `engine`, `batch`
    requests at a time (records are flushed after each batch, so an interrupted run resumes).
    settings: the run's samples per problem, seed, sampling, grading and progress bar."""
    samples, base_seed, sampling = settings.problems.samples, settings.sampling.seed, settings.sampling.engine_args()
    grader = grading.grade if settings.output.grade else None
    pairs = [(problems[i], s) for i, s in shard_pairs(len(problems), samples, shard)]
    gold = {p.unique_id: getattr(p, "answer", None) for p, _ in pairs}
    text_of = {p.unique_id: getattr(p, "problem", None) for p, _ in pairs}
    prompts: dict[str, list[int]] = {}
    bar = tqdm(total=len(pairs) * len(arms), disable=not settings.output.progress, unit="gen", dynamic_ncols=True)
    for arm in arms:
        todo = [(p, s) for p, s in pairs if not arm.run.records.has(p.unique_id, s)]
        bar.update(len(pairs) - len(todo))
        for start in range(0, len(todo), batch):
            requests = [Request(p.unique_id, s, derive_seed(base_seed, p.unique_id, s),
                                prompts.setdefault(p.unique_id, format_prompt(tokenizer, p.problem, prompt_style)))
                        for p, s in todo[start:start + batch]]
            t0 = time.perf_counter()
            done = {(c.request.problem_id, c.request.sample): c for c in engine.complete(requests, sampling, eos_ids)}
            missing = [(r.problem_id, r.sample) for r in requests if (r.problem_id, r.sample) not in done]
            if missing:
                raise RetentionError(f"engine {engine.name} returned no completion for {missing[0]}")
            for c in (done[(r.problem_id, r.sample)] for r in requests):  # run order, whatever the engine's
                text = output_text(tokenizer, c.request.prompt_ids, c.token_ids)
                record, (steps, tokens) = build_record(c, config_hash=arm.run.hash, text=text,
                                                       gold=gold[c.request.problem_id], cadence=arm.spec.cadence,
                                                       kib_per_token=kib_per_token, batch_size=batch,
                                                       grader=grader, problem=text_of[c.request.problem_id])
                arm.run.append_trace(c.request.problem_id, c.request.sample, steps, tokens)
                arm.run.records.append(record)
                bar.update(1)
            bar.set_postfix_str(f"{arm.spec.name} on {engine.name}: {time.perf_counter() - t0:.1f} s per batch",
                                refresh=True)
    bar.close()


def resolve_weights(name: str) -> tuple[str, str, str]:
    """(folder or hub id for the engine, model_id, revision), as `retention.models.load_model`
    names them, so that the configuration matches a run of this project's engine.

    An engine's own environment (vLLM's `.venv-vllm`) need not hold the weight packages of a split
    GGUF model: when they are not installed, it loads the converted folder that this project's
    environment wrote, once that folder's marker says it was converted from the pinned GGUF (the
    parts were verified then). Installed parts are verified as `load_model` verifies them."""
    alias = ALIASES.get(name)
    if alias is not None and alias.kind == "parts":
        spec = SPLIT_GGUFS[alias.source]
        try:
            locate_parts(spec)
        except RetentionError as exc:
            converted = _converted_split_model(spec)
            if converted is None:
                raise RetentionError(f"{exc}; or convert it once with this project's environment "
                                     f"(`retention run --model {name} ...`) for another engine to load") from None
            return converted
    return weights_reference(name)


def _converted_split_model(spec) -> tuple[str, str, str] | None:
    """(folder, model_id, revision) of split GGUF model `spec` (`SplitGGUF`) from its conversion
    cache alone, or None when its folder was not converted from the pinned GGUF."""
    folder = cache_root() / "models" / spec.alias
    info = _read_marker(folder)
    if info is None or info.get("source_sha256") != spec.sha256:
        return None
    return str(folder), f"{spec.package_prefix}1..{spec.parts}=={spec.version}", spec.sha256


def execute_with_engine(settings: RunSettings, arm_specs, problems, *, extra_config=None, shard=None,
                        factory=None) -> list[Path]:
    """What `retention.runs.jobs.execute` does, through the engine `settings.engine` (non-evicting
    arms only). The engine's name and version join the configuration (so its runs never mix with
    this project's engine's) and `factory` (tests) replaces the registered engine class."""
    # deferred: transformers' Auto classes add ~0.3 s to CLI start-up (the CLI imports this module)
    from transformers import AutoConfig, AutoTokenizer

    engine_name, model, dtype, out = settings.engine, settings.model, settings.dtype, settings.output.out
    refuse_evicting(arm_specs, engine_name)
    if settings.fidelity:
        raise RetentionError(f"--fidelity compares with this project's cache and needs --engine hf, not {engine_name}")
    weights, model_id, revision = resolve_weights(model)
    tokenizer = AutoTokenizer.from_pretrained(weights)
    geometry = CacheGeometry.from_config(AutoConfig.from_pretrained(weights), dtype)
    engine = (factory or engine_factory(engine_name))(weights, dtype, settings.device)
    style = style_of(model, tokenizer)  # the prompt this project's engine gives the same model
    arms = []
    for spec in arm_specs:
        spec = spec.with_config(model_id=model_id, model_revision=revision, engine=engine.name,
                                engine_version=engine.version, **({} if style == "chat" else {"prompt": style}),
                                **(extra_config or {}))
        arms.append(Arm(open_shard_run(out, spec.config, shard), spec))
    eos = {i for i in [tokenizer.eos_token_id, *(_generation_eos(weights))] if isinstance(i, int)}
    run_engine_arms(engine, tokenizer, geometry.kib_per_token, arms, problems, settings, eos_ids=eos, shard=shard,
                    prompt_style=style)
    return [a.run.path for a in arms]


def _generation_eos(weights: str) -> list[int]:
    """EOS ids of the model's generation_config.json (what this project's engine stops on too)."""
    try:
        eos = GenerationConfig.from_pretrained(weights).eos_token_id
    except OSError:
        return []
    return [eos] if isinstance(eos, int) else list(eos or [])
