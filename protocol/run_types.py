"""What a report or the viewer reads from a run directory, typed: a number field holds a number.

A run directory is input like any other: `config.json` and `records.jsonl` may have been edited or
written by another engine. A string where a number belongs (`compactions`, `config.budget`) is refused
in one line naming the file and the record, before any figure is computed or any page written
(`check_run`: called by `protocol.report.report_from_runs` and `protocol.viewer.extract.site_data`).
"""

from __future__ import annotations

import math

from protocol.errors import ProtocolError

# Configuration keys that are numbers when present (None allowed: "full", unset).
CONFIG_NUMBERS = ("budget", "budget_kib", "interval", "sink", "recent", "samples", "seed", "max_new_tokens",
                  "temperature", "top_p", "limit", "nominal_b")
# Record keys that are numbers when present.
RECORD_NUMBERS = ("sample", "seed", "prompt_tokens", "output_tokens", "cache_mean_tokens", "cache_peak_tokens",
                  "cache_final_tokens", "cache_mean_kib", "cache_mean_buffer_tokens", "kib_per_token", "compactions",
                  "prompt_evicted_step", "prompt_held_final", "wall_seconds", "tokens_per_second", "budget",
                  "banned_tokens")
FIDELITY_NUMBERS = ("kl_mean", "kl_max", "top1_agreement", "first_divergence_step")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(where: str, obj: dict, keys) -> None:
    for key in keys:
        value = obj.get(key)
        if value is not None and not _is_number(value):
            raise ProtocolError(f"{where}: {key} is {value!r}, not a number")
        if isinstance(value, float) and math.isinf(value):
            raise ProtocolError(f"{where}: {key} is {value!r}, not a finite number")


def check_run(run) -> None:
    """Refuse, in one line naming the file and the record, a run whose number fields are not numbers."""
    _check(f"{run.path / 'config.json'}: config", run.config, CONFIG_NUMBERS)
    for rec in run.records:
        where = f"{run.path / 'records.jsonl'}: record {rec.get('problem_id')!r} sample {rec.get('sample')!r}"
        _check(where, rec, RECORD_NUMBERS)
        if isinstance(rec.get("fidelity"), dict):
            _check(f"{where} fidelity", rec["fidelity"], FIDELITY_NUMBERS)
