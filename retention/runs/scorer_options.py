"""Scorer parameters from the command line, without collisions between scorers.

Two forms:

* `--param SCORER.NAME=VALUE` (repeatable) sets one parameter of one listed scorer, e.g.
  `--param alpha.lam=0.5 --param rkv.lam=0.1`. The scorer must be listed and must take `NAME`. A
  plugin is named as listed (`--param mypkg.mod:KeyNorm.k=4`: NAME is what follows the last dot) or by
  its class's `name` attribute (`--param keynorm.k=4`).
* The shared options (`--lambda`, `--radius`, `--window`, `--stats`) go to every listed
  scorer that takes them, and are an error when no listed scorer does. `--lambda` is the study's
  name for alpha's penalty weight; it also means rkv's mixing weight, so it is refused when it would
  reach scorers that read it differently (both alpha and rkv listed).

Contradictions are refused, never resolved silently: a shared option and a `--param` that set the
same parameter, or the same `--param` given twice.
"""

from __future__ import annotations

import dataclasses

from retention.errors import RetentionError
from retention.policy.registry import (FAMILIES, get_scorer_class, is_builtin, mechanism_class, mechanism_fields,
                                       new_run_entry, scorer_parameters)
from retention.policy.scoring.base import Scorer

# Shared option -> the scorer parameter it sets.
SHARED = {"--lambda": "lam", "--radius": "radius", "--window": "window", "--stats": "stats"}
# What `lam` means per scorer: one shared --lambda must not reach two different meanings.
LAMBDA_MEANING = {"alpha": "redundancy penalty weight", "rkv": "importance mixing weight"}


def scorer_fields(name: str) -> dict[str, dataclasses.Field]:
    """The settable parameters of scorer `name` (`retention.policy.registry.scorer_parameters`)."""
    return scorer_parameters(get_scorer_class(name))


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


def _listed(scorer: str, names: list[str]) -> str:
    """A listed scorer named as given, or by its class's `name` (`--param keynorm.k=4` for
    `--scorer mypkg.scorers:KeyNorm`, whose class says `name = "keynorm"`)."""
    if scorer in names:
        return scorer
    if scorer == Scorer.name:  # a plugin that names itself nothing inherits the base class's placeholder
        return scorer
    by_name = [n for n in names if not is_builtin("scorer", n) and getattr(get_scorer_class(n), "name", None) == scorer]
    return by_name[0] if len(by_name) == 1 else scorer


def parse_params(values: tuple[str, ...], names: list[str]) -> dict[str, dict]:
    """`--param` values -> {scorer: {param: value}} for the listed scorers `names`."""
    out: dict[str, dict] = {n: {} for n in names}
    for item in values:
        key, sep, raw = item.partition("=")
        scorer, dot, param = key.strip().rpartition(".")  # a plugin spec may hold dots; a parameter never
        if not sep or not dot or not scorer or not param:
            raise RetentionError(f"--param {item!r}: expected SCORER.NAME=VALUE, e.g. alpha.lam=0.5")
        scorer = _listed(scorer, names)
        if scorer not in out:
            raise RetentionError(f"--param {item!r}: scorer {scorer!r} is not listed (listed: {', '.join(names)})")
        fields = scorer_fields(scorer)
        if param not in fields:
            raise RetentionError(f"--param {item!r}: scorer {scorer!r} has no parameter {param!r}; "
                                 f"it takes {', '.join(sorted(fields)) or 'none'}")
        if param in out[scorer]:  # the last one would silently win
            raise RetentionError(f"--param {scorer}.{param} is given twice; give it once")
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
        both = [n for n in takers if field in per[n]]
        if both:  # one of the two would silently win
            raise RetentionError(f"{flag} and --param {both[0]}.{field} both set {both[0]}'s {field}; give one")
        if flag == "--lambda":
            meanings = {LAMBDA_MEANING.get(n, n) for n in takers}
            if len(meanings) > 1:
                raise RetentionError(
                    f"--lambda would set {' and '.join(f'{n} ({LAMBDA_MEANING.get(n, n)})' for n in takers)}; "
                    f"give each its own: {' '.join(f'--param {n}.lam=...' for n in takers)}")
        for n in takers:
            per[n][field] = value
    return per


def mechanism_options(params: tuple[str, ...], chosen: dict[str, str | None], scorers: list[str]
                      ) -> tuple[tuple[str, ...], dict[str, object]]:
    """Split `--param` values between the chosen mechanisms of the non-scoring families and the scorers.

    chosen: family -> the name given with `--cadence`/`--routing`/`--state`/`--decoding` (None: the
    default). `--param NAME.KEY=VALUE` whose NAME is a chosen mechanism (or its class's `name`) sets
    that mechanism's parameter; the rest are scorer parameters (`parse_params`). Returns (the scorer
    `--param` values, family -> the arm configuration's entry: a name or `{"name", "params"}`)."""
    names = {}
    for fam, name in chosen.items():
        if name is None or name == FAMILIES[fam].default:
            continue
        names[name] = fam
        alias = getattr(mechanism_class(fam, name), "name", None)
        if isinstance(alias, str) and alias not in names:
            names[alias] = fam
    per: dict[str, dict] = {fam: {} for fam in chosen}
    rest = []
    for item in params:
        key, sep, raw = item.partition("=")
        owner, dot, param = key.strip().rpartition(".")
        fam = names.get(owner) if sep and dot else None
        if fam is None:
            rest.append(item)
            continue
        if owner in scorers:
            raise RetentionError(f"--param {item!r}: {owner!r} names both a listed scorer and the {fam}; "
                                 "give the mechanism as package.module:Class to tell them apart")
        fields = mechanism_fields(fam, chosen[fam])
        if param not in fields:
            raise RetentionError(f"--param {item!r}: {fam} {chosen[fam]!r} has no parameter {param!r}; "
                                 f"it takes {', '.join(sorted(fields)) or 'none'}")
        if param in per[fam]:
            raise RetentionError(f"--param {owner}.{param} is given twice; give it once")
        per[fam][param] = _convert(fields[param], raw.strip(), f"--param {item!r}")
    entries = {fam: new_run_entry(fam, {"name": name, "params": per[fam]} if per[fam] else name)
               for fam, name in chosen.items() if name is not None}
    return tuple(rest), entries
