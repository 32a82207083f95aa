"""The canonical form of what a plan registers: its models by content and its arms fully resolved.

A cell's identity (`protocol.plans.cell_identity`) is computed from the plan's JSON, so two spellings of
one comparison must be written the same way before a plan is hashed and registered:

* an arm: every scorer parameter with its resolved value (`alpha` without `lam` and `alpha` with
  `"lam": 0.5, "radius": 0.0` are one arm), and a cadence setting (`interval`, `sink`, `recent`)
  written at the value it resolves to anyway in every cell is left out (absent means that value);
* a model: an alias by its name (its content is pinned by the code: `aliases.SPLIT_GGUFS`, the
  package-shipped SmolLM2 file, a seeded random model); a GGUF file whose sha256 is an alias's, by
  that alias; any other folder or file by its real path (symlinks, `..`, a trailing slash resolved)
  with its weights' sha256 pinned as the model revision, and its content (weights, configuration,
  tokenizer: `retention.models.content`) in the plan's `model_contents`, which names its cells: a
  copied folder is the same model, so the same cell.

`retention preregister` writes plans in this form; `retention confirm` also checks a plan registered
before it existed against the registry under the canonical identity of its cells.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from protocol.plans import ARMS, arm_config, build_plan, cell_identity, cell_key
from retention.errors import RetentionError
from retention.models.aliases import SPLIT_GGUFS, TINY_RANDOM_SEED, resolve_model
from retention.models.content import content_sha256
from retention.models.loading import _folder_revision
from retention.models.weights_cache import sha256_files, smollm2_gguf_path
from retention.runs.arms import normalize_arm, validate_arm
from retention.policy.registry import FAMILIES

# Cadence keys of an arm whose default depends on the cell (the budget) and the scorer.
_CADENCE_KEYS = ("interval", "sink", "recent")


@dataclass(frozen=True)
class ModelIdentity:
    """How a plan names a model: `name` (an alias or a real path), the revision to pin (a content
    digest; None when the alias itself pins the content, or for a hub model, named by its id) and, for
    a model named by path, the digest of its weights and configuration (`content`) its cells are named by."""

    name: str
    revision: str | None
    content: str | None = None


def _smollm2_file() -> Path | None:
    try:
        return smollm2_gguf_path()
    except RetentionError:
        return None


def model_identity(name: str) -> ModelIdentity:
    """The canonical name of model `name` and the content digest a plan pins for it (reads the weights
    of a local folder or GGUF file once: seconds per GB)."""
    ref = resolve_model(name)
    if ref.kind == "gguf-file":
        path = Path(os.path.realpath(ref.source))
        sha = sha256_files([path])
        for alias, spec in SPLIT_GGUFS.items():
            if spec.sha256 == sha:
                return ModelIdentity(alias, None)
        smol = _smollm2_file()
        if smol is not None and smol.stat().st_size == path.stat().st_size and sha256_files([smol]) == sha:
            return ModelIdentity("smollm2-135m", None)
        return ModelIdentity(str(path), sha, sha)
    if ref.kind == "local":
        path = Path(os.path.realpath(ref.source))
        return ModelIdentity(str(path), _folder_revision(path), content_sha256(path))
    return ModelIdentity(ref.name, None)  # an alias (hub ids of aliases resolve to the alias)


def canonical_models(models, revisions: dict[str, str],
                     contents: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The plan's models by canonical name and the revisions to pin, keyed by those names; `contents`
    (when given) receives {name: content digest} of the models named by path.

    A given revision (`--model-revision MODEL=REV`, MODEL as written) must be the model's content: a
    differing one is refused; for a content-pinned alias it is left out (the name already pins it); a
    hub model's is kept (its commit is checked when it loads)."""
    names, pinned = [], {}
    unknown = sorted(set(revisions) - set(models))
    if unknown:
        raise RetentionError(f"--model-revision given for a model not in the plan: {unknown}")
    for model in models:
        ident = model_identity(model)
        given = revisions.get(model)
        kind = resolve_model(model).kind
        if given is not None and kind != "hub":
            actual = ident.revision if ident.revision is not None else _alias_revision(ident.name)
            if given != actual:
                raise RetentionError(f"--model-revision {model}={given} is not that model's content "
                                     f"(its revision is {actual})")
        names.append(ident.name)
        if contents is not None and ident.content is not None:
            contents[ident.name] = ident.content
        if ident.revision is not None:
            pinned[ident.name] = ident.revision
        elif given is not None and kind == "hub":
            pinned[ident.name] = given
    return names, pinned


def _alias_revision(alias: str) -> str:
    """The revision a content-pinned alias loads as (`LoadedModel.revision`), without loading it."""
    ref = resolve_model(alias)
    if ref.kind == "parts":
        return SPLIT_GGUFS[ref.source].sha256
    if ref.kind == "gguf":
        smol = _smollm2_file()
        return sha256_files([smol]) if smol is not None else "unknown"
    return f"random-seed-{TINY_RANDOM_SEED}"


def _resolved(plan: dict, cell: dict, arm: str, cfg: dict) -> dict:
    plan = dict(plan, **{arm: cfg})
    try:
        return validate_arm(arm_config(plan, "0" * 64, cell, arm)).config
    except RetentionError as exc:
        raise RetentionError(f"{arm} of cell {cell['id']}: {exc}") from None


def canonical_arm(plan: dict, arm: str) -> dict:
    """Arm `arm` of `plan` in canonical form (module docstring), validated in every cell."""
    cfg = normalize_arm(plan[arm])
    configs = [_resolved(plan, cell, arm, cfg) for cell in plan["cells"]]
    params = [{k: v for k, v in c["scorer_params"].items() if k != "stats"} for c in configs]
    out = dict(cfg)
    if all(p == params[0] for p in params):  # parameters never depend on the cell; if they did, keep them as given
        given = (cfg.get("scorer_params") or {})
        out["scorer_params"] = dict(params[0], **({"stats": given["stats"]} if given.get("stats") else {}))
    for key in _CADENCE_KEYS:
        if key in out and out[key] is not None:
            without = {k: v for k, v in out.items() if k != key}
            if all(_resolved(plan, cell, arm, without)[key] == c[key] for cell, c in zip(plan["cells"], configs)):
                del out[key]  # absent resolves to the same value in every cell
    for fam in FAMILIES:  # a mechanism in canonical form (every parameter, a plugin's identity); a default: absent
        records = [c.get(fam) for c in configs]
        if all(r == records[0] for r in records):
            if records[0] is None:
                out.pop(fam, None)
            else:
                out[fam] = records[0]
    if not out.get("scorer_params"):
        out.pop("scorer_params", None)
    return out


def canonical_plan(**plan_args) -> dict:
    """`protocol.prereg.build_plan(**plan_args)` with canonical models, revisions and arms; a
    treatment that is the baseline spelled differently is refused there."""
    contents: dict[str, str] = {}
    models, revisions = canonical_models(plan_args.pop("models"), plan_args.pop("model_revisions", None) or {},
                                         contents)
    draft = build_plan(models=models, model_revisions=revisions, model_contents=contents, **plan_args)
    arms = {arm: canonical_arm(draft, arm) for arm in ARMS}
    return build_plan(models=models, model_revisions=revisions, model_contents=contents, **dict(plan_args, **arms))


def canonical_cell_keys(plan: dict) -> dict[str, str]:
    """{cell id: key of the cell's canonical identity} for the cells of a registered plan whose
    canonical identity differs from the one it was registered with (a plan written before plans were
    canonical); empty for a canonical plan."""
    models = list(dict.fromkeys(c["model"] for c in plan["cells"]))
    try:
        contents: dict[str, str] = {}
        names, revisions = canonical_models(models, {m: r for m, r in (plan.get("model_revisions") or {}).items()
                                                     if m in models}, contents)
    except RetentionError:
        return {}  # a model that no longer resolves: confirm refuses it in its own words
    rename = dict(zip(models, names))
    canon = dict(plan, cells=[dict(c, model=rename[c["model"]]) for c in plan["cells"]],
                 model_revisions={**{rename[m]: r for m, r in (plan.get("model_revisions") or {}).items()
                                     if m in rename}, **revisions})
    if contents:
        canon["model_contents"] = contents
    canon.update({arm: canonical_arm(canon, arm) for arm in ARMS})
    keys = {}
    for cell, ccell in zip(plan["cells"], canon["cells"]):
        key = cell_key(cell_identity(canon, ccell))
        if key != cell_key(cell_identity(plan, cell)):
            keys[cell["id"]] = key
    return keys
