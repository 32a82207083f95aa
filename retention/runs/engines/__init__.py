"""Engines other than this project's own decode loop, behind one small interface (`base.Engine`).

An engine turns (prompt token ids, seed) requests into completions; `retention.runs.engine_runs`
(above this package) turns those into the same records, in the same run directories, as `retention.runs.runner.run_arms`.
Only non-evicting arms (`full`) may run on another engine: eviction happens inside this project's
cache, which another engine does not have. Engines are optional extras, imported lazily.
"""

from __future__ import annotations

import importlib

from retention.errors import RetentionError

# name -> "module:factory"; the factory takes (model_folder, dtype, device) and returns an Engine.
ENGINES = {"vllm": "retention.runs.engines.vllm:VllmEngine"}
DEFAULT = "hf"  # this project's engine (transformers + the retention cache): not listed above


def engine_factory(name: str):
    if name not in ENGINES:
        raise RetentionError(f"unknown engine {name!r}; choose {DEFAULT} or one of {sorted(ENGINES)}")
    module, _, attr = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)
