"""`retention run --engine NAME`: open the run directories and generate through an external engine."""

from __future__ import annotations

from pathlib import Path

from transformers import GenerationConfig

from retention.errors import RetentionError
from retention.models import CacheGeometry, prompt_style
from retention.models.aliases import ALIASES, SPLIT_GGUFS
from retention.models.gguf import locate_parts
from retention.models.loading import weights_reference
from retention.models.weights_cache import _read_marker, cache_root
from retention.runs.engines import engine_factory
from retention.runs.engines.base import refuse_evicting, run_engine_arms
from retention.runs.runner import Arm
from retention.runs.merge import open_shard_run


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


def execute_with_engine(engine_name: str, model: str, dtype: str, device: str, arm_specs, problems, *,
                        samples: int, seed: int, sampling: dict, fidelity: bool, grade: bool, out: Path,
                        progress: bool = True, extra_config=None, shard=None, factory=None) -> list[Path]:
    """What `retention.cli.run_cmd.execute` does, through the engine `engine_name` (non-evicting
    arms only). The engine's name and version join the configuration (so its runs never mix with
    this project's engine's) and `factory` (tests) replaces the registered engine class."""
    # deferred: transformers' Auto classes add ~0.3 s to CLI start-up (the CLI imports this module)
    from transformers import AutoConfig, AutoTokenizer

    refuse_evicting(arm_specs, engine_name)
    if fidelity:
        raise RetentionError(f"--fidelity compares with this project's cache and needs --engine hf, not {engine_name}")
    weights, model_id, revision = resolve_weights(model)
    tokenizer = AutoTokenizer.from_pretrained(weights)
    geometry = CacheGeometry.from_config(AutoConfig.from_pretrained(weights), dtype)
    engine = (factory or engine_factory(engine_name))(weights, dtype, device)
    style = prompt_style(model, tokenizer)  # the prompt this project's engine gives the same model
    arms = []
    for spec in arm_specs:
        spec = spec.with_config(model_id=model_id, model_revision=revision, engine=engine.name,
                                engine_version=engine.version, **({} if style == "chat" else {"prompt": style}),
                                **(extra_config or {}))
        arms.append(Arm(open_shard_run(out, spec.config, shard), spec))
    eos = {i for i in [tokenizer.eos_token_id, *(_generation_eos(weights))] if isinstance(i, int)}
    run_engine_arms(engine, tokenizer, geometry.kib_per_token, arms, problems, samples=samples, base_seed=seed,
                    sampling=sampling, eos_ids=eos, grade=grade, shard=shard, progress=progress, prompt_style=style)
    return [a.run.path for a in arms]


def _generation_eos(weights: str) -> list[int]:
    """EOS ids of the model's generation_config.json (what this project's engine stops on too)."""
    try:
        eos = GenerationConfig.from_pretrained(weights).eos_token_id
    except OSError:
        return []
    return [eos] if isinstance(eos, int) else list(eos or [])
