"""Cross-engine agreement: do two runs of the same prompts produce the same tokens?

A reference row from another engine is trusted only once it is shown to agree with this
project's engine. For greedy runs the tokens of a (problem, sample) agree up to the first position
where the two engines pick different tokens; in bf16 a near-tie of the top two logits is enough to
make them part, after which the texts diverge for good, so the statistic is the number of tokens
before the first divergence, per pair, and how many pairs agree over their whole length.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from retention.errors import RetentionError

# Keys that name the engine and its environment, not the experiment: they may differ between the
# two runs. `model_id` is where the weights lie (a path inside each environment); the weights
# themselves are `model_revision` (their sha256 or hub commit), which must match. `sampler` is how
# this project's engine draws a sampled token (retention.runtime.sampling); another engine draws its
# own way and records none.
ENGINE_KEYS = {"engine", "engine_version", "device", "model_id", "sampler"}


@dataclass(frozen=True)
class PairAgreement:
    problem_id: str
    sample: int
    length_a: int
    length_b: int
    first_divergence: int | None  # index of the first differing token; None when identical

    @property
    def agreed_tokens(self) -> int:
        """Tokens before the first divergence (the common length when one is a prefix of the other)."""
        if self.first_divergence is not None:
            return self.first_divergence
        return min(self.length_a, self.length_b)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ, counting a length difference; None if equal."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    if differ.size:
        return int(differ[0])
    return None if len(a) == len(b) else n


def compare_records(records_a: list[dict], records_b: list[dict]) -> list[PairAgreement]:
    """Per shared (problem, sample) pair, in the order of `records_a`."""
    by_key = {(r["problem_id"], r["sample"]): r for r in records_b}
    out = []
    for ra in records_a:
        rb = by_key.get((ra["problem_id"], ra["sample"]))
        if rb is None:
            continue
        ta, tb = list(ra["output_token_ids"]), list(rb["output_token_ids"])
        out.append(PairAgreement(ra["problem_id"], ra["sample"], len(ta), len(tb), first_divergence(ta, tb)))
    if not out:
        raise RetentionError("the two runs share no (problem, sample) pair")
    return out


def config_differences(config_a: dict, config_b: dict) -> list[str]:
    """Experiment keys (not engine keys) whose values differ: such runs are not comparable."""
    keys = (set(config_a) | set(config_b)) - ENGINE_KEYS
    return sorted(k for k in keys if config_a.get(k) != config_b.get(k))


def summarize(pairs: list[PairAgreement]) -> dict:
    identical = sum(p.first_divergence is None for p in pairs)
    agreed = [p.agreed_tokens for p in pairs]
    return {"pairs": len(pairs), "identical": identical, "median_agreed_tokens": statistics.median(agreed),
            "min_agreed_tokens": min(agreed), "mean_agreed_tokens": sum(agreed) / len(agreed)}


def verdict(config: dict, summary: dict) -> str:
    """One sentence on what the agreement of two runs of `config` means (printed by `retention agree`).

    Greedy float32 runs of the same prompts agree over their whole length (measured: 8/8 pairs on
    qwen2.5-coder-0.5b and on smollm2-135m, README "vLLM for the `full` arm"), so a divergence there
    points at a difference in prompt, template, stop tokens or sampling. In bfloat16/float16 the
    engines round logits differently, and they part where the top two logits are within one rounding
    step of each other (each tie goes to the lower token id), so divergence there is expected."""
    if float(config.get("temperature", 0)) != 0:
        return "sampled runs: agreement is not expected"
    dtype = config.get("dtype", "float32")
    parted = summary["pairs"] - summary["identical"]
    if dtype == "float32":
        if not parted:
            return "float32 greedy: identical, as expected"
        return (f"float32 greedy: {parted} pair(s) parted, which float32 runs are not expected to do; compare the "
                "prompt token ids, stop tokens and sampling settings of the two engines")
    return (f"{dtype} greedy: the engines part where the top two logits are within one {dtype} rounding step; "
            "run both in float32 to check for any other difference")
