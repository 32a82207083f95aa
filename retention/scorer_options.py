"""Scorer parameters from the command line, without collisions between scorers.

Two forms:

* `--param SCORER.NAME=VALUE` (repeatable) sets one parameter of one listed scorer, e.g.
  `--param alpha.lam=0.5 --param rkv.lam=0.1`. The scorer must be listed and must take `NAME`.
* The shared options (`--lambda`, `--radius`, `--window`, `--routing`, `--stats`) go to every listed
  scorer that takes them, and are an error when no listed scorer does. `--lambda` is a deprecated
  alias: it means a penalty weight for alpha and a mixing weight for rkv, so it is refused when it
  would reach scorers that read it differently (both alpha and rkv listed).

A `--param` value wins over a shared option for its scorer.
"""

from __future__ import annotations

import dataclasses

from retention.errors import RetentionError

# Shared option -> the scorer parameter it sets.
SHARED = {"--lambda": "lam", "--radius": "radius", "--window": "window", "--routing": "routing", "--stats": "stats"}
# What `lam` means per scorer: one shared --lambda must not reach two different meanings.
LAMBDA_MEANING = {"alpha": "redundancy penalty weight", "rkv": "importance mixing weight"}


def scorer_fields(name: str) -> dict[str, dataclasses.Field]:
    """The settable parameters of scorer `name` (its public dataclass fields)."""
    from retention.scorers import get_scorer_class

    return {f.name: f for f in dataclasses.fields(get_scorer_class(name))
            if f.init and not f.name.startswith("_") and f.name != "seed"}


def _convert(field: dataclasses.Field, raw: str, where: str):
    kind = str(field.type)
    try:
        if "float" in kind:
            return float(raw)
        if "int" in kind:
            return int(raw)
    except ValueError:
        raise RetentionError(f"{where}: {raw!r} is not a {'number' if 'float' in kind else 'whole number'}") from None
    return raw


def parse_params(values: tuple[str, ...], names: list[str]) -> dict[str, dict]:
    """`--param` values -> {scorer: {param: value}} for the listed scorers `names`."""
    out: dict[str, dict] = {n: {} for n in names}
    for item in values:
        key, sep, raw = item.partition("=")
        scorer, dot, param = key.strip().partition(".")
        if not sep or not dot or not scorer or not param:
            raise RetentionError(f"--param {item!r}: expected SCORER.NAME=VALUE, e.g. alpha.lam=0.5")
        if scorer not in out:
            raise RetentionError(f"--param {item!r}: scorer {scorer!r} is not listed (listed: {', '.join(names)})")
        fields = scorer_fields(scorer)
        if param not in fields:
            raise RetentionError(f"--param {item!r}: scorer {scorer!r} has no parameter {param!r}; "
                                 f"it takes {', '.join(sorted(fields)) or 'none'}")
        out[scorer][param] = _convert(fields[param], raw.strip(), f"--param {item!r}")
    return out


def resolve(names: list[str], shared: dict[str, object], params: tuple[str, ...] = ()) -> dict[str, dict]:
    """Per-scorer options for the listed scorers.

    shared: {option flag (a key of SHARED): value or None}; params: the `--param` values.
    """
    per = parse_params(params, names)
    for flag, value in shared.items():
        if value is None:
            continue
        field = SHARED[flag]
        takers = [n for n in names if field in scorer_fields(n)]
        if not takers:
            raise RetentionError(f"{flag} is not a parameter of any listed scorer ({', '.join(names)})")
        if flag == "--lambda":
            meanings = {LAMBDA_MEANING.get(n, n) for n in takers if field not in per[n]}
            if len(meanings) > 1:
                raise RetentionError(
                    f"--lambda would set {' and '.join(f'{n} ({LAMBDA_MEANING.get(n, n)})' for n in takers)}; "
                    f"give each its own: {' '.join(f'--param {n}.lam=...' for n in takers)}")
        for n in takers:
            per[n].setdefault(field, value)
    return per
