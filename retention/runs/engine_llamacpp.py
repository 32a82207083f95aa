"""The llama.cpp column of `retention bench --engine hf,llamacpp`: this process's side of the child.

llama.cpp runs in its own environment (`.venv-llamacpp`, llama-cpp-python compiled from source, as
`make bench-llamacpp` builds it), through `retention.runs.engines.llamacpp_bench` in a child process,
on the model's GGUF file itself: the one this project's engine dequantises to its dtype (llama.cpp
computes on the quantised blocks whatever `--dtype` says, so it is measured once per run, and its
figure stands beside every dtype's row). The GGUF of a split model (`aliases.SPLIT_GGUFS`) exists
only as package parts: it is assembled into a temporary file, verified against its pinned sha256,
for the child's run and deleted after it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from retention.errors import RetentionError
from retention.models.aliases import SMOLLM2_PACKAGE, SPLIT_GGUFS, resolve_model
from retention.models.gguf import gguf_quant, locate_parts
from retention.models.weights_cache import smollm2_gguf_path
from retention.runs.engines.child import run_child
from retention.runs.engines.llamacpp_bench import LlamaCppRequest, LlamaCppResult
from retention.runs.engines.vllm_bench import Point

LLAMACPP_PYTHON_ENV = "RETENTION_LLAMACPP_PYTHON"
# "1" / "0": llama.cpp's extra weight buffers (AMX, repacked layouts) on / off whatever the host; unset:
# the child's choice, off where llama.cpp reports AMX (`llamacpp_bench` says why).
EXTRA_BUFTS_ENV = "RETENTION_LLAMACPP_EXTRA_BUFTS"
MODULE = "retention.runs.engines.llamacpp_bench"
ROOT = Path(__file__).resolve().parents[2]  # the checkout: .venv-llamacpp lies beside `retention/`


def llamacpp_python() -> Path:
    """The python of llama.cpp's environment: $RETENTION_LLAMACPP_PYTHON, else the checkout's `.venv-llamacpp`."""
    given = os.environ.get(LLAMACPP_PYTHON_ENV)
    python = Path(given) if given else ROOT / ".venv-llamacpp" / "bin" / "python"
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise RetentionError(f"llama.cpp's environment is missing (no {python}): build it with `make "
                             f".venv-llamacpp/.installed` (or `make bench-llamacpp`), or set {LLAMACPP_PYTHON_ENV} "
                             "to a python that has llama-cpp-python")
    return python


def require_gguf(model: str) -> None:
    """Refuse, before anything is measured, a model that has no GGUF file for llama.cpp to load."""
    ref = resolve_model(model)
    if ref.kind not in ("gguf", "gguf-file", "parts"):
        raise RetentionError(f"--engine llamacpp loads a GGUF file; {model} is a {ref.kind} model with none "
                             "(use smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b or a path to a .gguf file)")
    if ref.kind == "parts":  # deferred: importlib lookups of the part packages, only for such a model

        locate_parts(SPLIT_GGUFS[ref.source])


@contextmanager
def gguf_file(model: str) -> Iterator[Path]:
    """The model's GGUF file for the duration of the block (a split model's: assembled, verified,
    then deleted)."""
    require_gguf(model)
    ref = resolve_model(model)
    if ref.kind == "gguf-file":
        yield Path(ref.source)
        return
    if ref.kind == "gguf":
        if ref.source != SMOLLM2_PACKAGE:  # the one packaged GGUF alias today; a new one needs its lookup here
            raise RetentionError(f"no GGUF lookup for the package {ref.source!r}")

        yield smollm2_gguf_path()
        return

    spec = SPLIT_GGUFS[ref.source]
    with tempfile.TemporaryDirectory(prefix="retention-llamacpp-") as tmp:
        path = Path(tmp) / f"{spec.alias}.gguf"
        digest, size = hashlib.sha256(), 0
        with open(path, "wb") as out:
            for part in locate_parts(spec):
                with open(part, "rb") as src:
                    while block := src.read(8 << 20):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise RetentionError(f"{spec.alias}: the installed parts do not assemble to the pinned GGUF; reinstall "
                                 f"them with {spec.install_hint()}")
        yield path


def gguf_weight_types(path: Path) -> dict:
    """The GGUF's quantisation: its file type (`Q4_K_M`, ...) and how many tensors of each type
    (`Q4_K`, `Q6_K`, `F32`, ...) it holds: the blocks llama.cpp computes on."""
    # deferred: gguf reads the header only when a llama.cpp run is asked for
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(path))
    counts = Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors)
    return {"file_type": gguf_quant(path), "tensor_types": dict(sorted(counts.items()))}


def extra_bufts_choice() -> bool | None:
    """$RETENTION_LLAMACPP_EXTRA_BUFTS as the request's `extra_bufts` (None: unset)."""
    value = os.environ.get(EXTRA_BUFTS_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise RetentionError(f"{EXTRA_BUFTS_ENV} takes 1 or 0, got {value!r}")
    return None if value == "" else value == "1"


def llamacpp_env(threads: int) -> dict[str, str]:
    """The child's environment: this checkout first on the path, the thread count in OpenMP's variable
    too (ggml's CPU backend may be built with OpenMP; the request's `n_threads` is what it uses)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def llamacpp_figures(python: Path, model: str, prompts: dict[int, list[int]], batch_sizes: list[int],
                     new_tokens: int, threads: int, echo: Callable[[str], None]) -> tuple[list[dict], dict]:
    """(one JSON row per (context, batch size), the run's description) of llama.cpp on `model`'s GGUF:
    the same prompt ids, thread count and new tokens as this project's side."""
    points = tuple(Point(c, bs, tuple(prompt)) for c, prompt in prompts.items() for bs in batch_sizes)
    env, extra = llamacpp_env(threads), extra_bufts_choice()
    with gguf_file(model) as path:
        weights = gguf_weight_types(path)
        request = LlamaCppRequest(str(path), threads, new_tokens, points, extra_bufts=extra)
        raw = run_child(python, MODULE, request.to_json(), env, ROOT, label="llama.cpp", progress="llamacpp ",
                        result_key="rows", echo=echo)
    result = LlamaCppResult.from_json(raw)
    rows = [dict(asdict(r), tokens_per_second=r.tokens_per_second,
                 prefill_tokens_per_second=r.prefill_tokens_per_second) for r in result.rows]
    run = {"python": str(python), "version": result.version, "n_threads": threads, "flags": result.flags,
           "system_info": result.system_info, "gguf": dict(weights, temporary=resolve_model(model).kind == "parts"),
           "weights": "the GGUF's quantised blocks, whatever --dtype (this engine dequantises them to --dtype)",
           "env": {"OMP_NUM_THREADS": env["OMP_NUM_THREADS"]}}
    return rows, run
