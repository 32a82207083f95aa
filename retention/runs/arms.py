"""Arm configurations: the one place that turns options into a validated run configuration.

`run`, `preregister`, `confirm` and the Ray launcher all build and check arms here, so what a plan
registers is exactly what `run` would run (docs/records.md names every key).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from protocol.prereg import ARMS, arm_config

from retention.errors import RetentionError
from retention.models import model_layout, resolve_model
from retention.plugins import check_registered
from retention.runs.canonical import canonical_values, is_trivial, typed_params
from protocol.io import canonical_json
from protocol.numbers import canonical_value
from retention.runs.settings import Budget, RunSettings
from retention.runs.spec import ArmSpec, MechanismSpec
from retention.runtime.adapter import provides
from retention.policy.cadence.base import REFERENCE_INTERVAL
from retention.policy.composite import cadence_for
from retention.policy.registry import (FAMILIES, canonical_routing, class_fields, construct, get_scorer_class,
                                       mechanism_class, mechanism_identity, reads_refusal, routing_given,
                                       scorer_identity, scorer_kwargs, scorer_parameters, structure_recorded)
from retention.policy.scoring.calibration import default_stats_path
from retention.policy.scoring.calibration_latent import read_stats_file
from retention.runtime.sampling import LEGACY_SAMPLER

def build_arm_config(base: dict, scorer: str, options: dict, mechanisms: dict | None = None,
                     head_dims: tuple[int, int] | None = None, as_named: bool = False, cls: type | None = None) -> ArmSpec:
    """The `ArmSpec` of one arm: its scorer, its four other mechanisms, and its configuration.

    options: the scorer's parameters (a statistics path; `routing`: a structure as configurations
    wrote it); mechanisms: family -> a name, or `{"name", "params"[, "plugin"]}` (absent: the
    family's default); head_dims: (d_k, d_v) of the model's per-layer K/V cache (None on a latent or
    shared-store layout); as_named: build every mechanism as named even at a trivial setting (the
    contract kit's "trivial member exact" must run the mechanism itself to test its claim); cls: the
    scorer's class when the caller resolved it (else it is looked up here). The configuration records
    the scorer's parameters with the statistics named by their sha256, and every non-default
    mechanism in canonical form (every parameter with its resolved value)."""
    return _build(base, scorer, options, mechanisms, head_dims, as_named, cls)[0]


def _build(base: dict, scorer: str, options: dict, mechanisms: dict | None, head_dims, as_named: bool,
           cls: type | None):
    """(`ArmSpec`, the validated scorer instance) of one arm (`build_arm_config`)."""
    cls = cls if cls is not None else get_scorer_class(scorer)
    base = dict(base)
    counted = _prompt_counted(cls, base.pop("protect_prompt_counted", None), bool(base.get("protect_prompt")))
    fields = {f.name for f in dataclasses.fields(cls)} - {"seed"}
    params = {k: v for k, v in options.items() if k in fields and v is not None}
    given = {fam: _mechanism_arg(fam, (mechanisms or {}).get(fam)) for fam in FAMILIES}
    # The kept-set structure is the routing family's; a configuration may still write it as the
    # scorer's `routing` (read here, written back below: the same arm, the same hash).
    given["routing"] = routing_given(scorer, cls, options.get("routing"), given["routing"])
    routing_name = given["routing"][0]
    structure = mechanism_class("routing", routing_name).structure_for(cls)
    params = typed_params(cls, params, scorer)
    identity = scorer_identity(scorer, cls)
    scorer_obj = construct("scorer", scorer, cls, scorer_kwargs(cls, params), identity is None)  # validated now
    if structure is not None:
        scorer_obj.structured(structure)
    unset = set(getattr(cls, "unrecorded_when_unset", ()))  # newer parameters: recorded once set
    params = canonical_values({k: getattr(scorer_obj, k) for k in sorted(fields)
                               if not k.startswith("_") and not (k in unset and getattr(scorer_obj, k) is None)}, scorer)
    extra = {}
    if "stats" in params:
        params["stats"], extra["stats_sha256"] = _resolve_stats(params["stats"], base["model"])
    if cls.evicts and base["budget"] is None:
        raise RetentionError(f"--budget is required for scorer {scorer!r}")
    specs, objs = {}, {}
    for fam, (name, mparams, registered) in given.items():
        if fam == "cadence":
            continue
        specs[fam], objs[fam] = _resolve_mechanism(fam, name, mparams, registered, as_named)
    specs["routing"] = canonical_routing(specs["routing"], cls, structure)
    cname, cparams, cregistered = given["cadence"]
    cspec, _ = _resolve_mechanism("cadence", cname, cparams, cregistered, as_named)
    _check_families(scorer, cls.evicts, {**specs, "cadence": cspec})
    objs["state"].check(head_dims)
    if cls.evicts:
        objs["routing"].check(scorer_obj, head_dims)
    if objs["routing"].allocates and not specs["state"].is_default:
        raise RetentionError(f"routing {routing_name!r} stores heads of different lengths; state "
                             f"{specs['state'].name!r} counts the same tokens in every head (use --state full)")
    budget = base["budget"]
    if base.get("budget_kib") is not None and specs["state"].name != "full" and cls.evicts:
        budget = _state_budget(objs["state"], base, scorer_obj, cspec.cls, cspec.kwargs, head_dims)
    cadence = cadence_for(scorer_obj, budget, base["interval"], base["accounting"], base["sink"], base["recent"],
                          protect_prompt=bool(base.get("protect_prompt")), kind=cspec.cls,
                          params=cspec.kwargs, prompt_counted=counted)
    if identity is not None:  # a plugin: its code is part of what the arm is
        extra["scorer_plugin"] = identity
    # The configuration (hashed: run id, resume, labels, baseline matching) names the statistics by
    # content, never by path: the same file under another cache root is the same arm, and the two
    # models of a study, each with its own statistics, are one arm each with its own identity.
    recorded = dict(params, stats=f"sha256:{extra['stats_sha256']}") if "stats" in params else dict(params)
    if structure is not None and cls.structures:  # the structure, where configurations have always written it
        recorded["routing"] = structure
    families = {fam: m.record() for fam, m in {**specs, "cadence": cspec}.items()
                if not m.is_default and not (fam == "routing" and structure_recorded(m))}
    config = dict(base, scorer=scorer, scorer_params=recorded, budget=cadence.budget, interval=cadence.interval,
                  sink=cadence.sink, recent=cadence.recent, nominal_b=cadence.nominal, **extra, **families)
    # The counted prompt rule is recorded where it is set, and always for a preset whose own rule
    # is not "evict" (so that its canonical form names the rule that ran); absent: as before the key.
    if cadence.prompt_counted or cls.default_prompt != "evict":
        config["protect_prompt_counted"] = bool(cadence.prompt_counted)
    spec = ArmSpec(MechanismSpec.of("scorer", scorer, params, identity, cls), cadence, cspec, specs["routing"],
                   specs["state"], specs["decoding"], canonical_json(config))
    return spec, scorer_obj


def _prompt_counted(cls, given, on_top: bool) -> bool:
    """Whether the prompt is protected inside b: `given` (a configuration's `protect_prompt_counted`,
    None when unset) or the scorer's own rule (`default_prompt`) unless the prompt is kept on top."""
    if given is None:
        return cls.default_prompt == "keep" and not on_top
    if not isinstance(given, bool):
        raise RetentionError(f"protect_prompt_counted must be true or false, got {given!r}")
    if given and on_top:
        raise RetentionError("the prompt is either kept on top of b (--protect-prompt) or counted inside b "
                             "(--prompt-rule keep), not both")
    return given


def _mechanism_arg(fam: str, value) -> tuple[str, dict, dict | None]:
    """(name, params, registered plugin identity) of a family's entry in an arm configuration."""
    if value is None:
        return FAMILIES[fam].default, {}, None
    if isinstance(value, str) and value:
        return value, {}, None
    if isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"]:
        unknown = sorted(set(value) - {"name", "params", "plugin"})
        params = value.get("params") or {}
        if unknown or not isinstance(params, dict):
            raise RetentionError(f"{fam} must be a name or {{\"name\": ..., \"params\": {{...}}}}, got {value!r}")
        return value["name"], dict(params), value.get("plugin")
    raise RetentionError(f"{fam} must be a name or {{\"name\": ..., \"params\": {{...}}}}, got {value!r}")


def _resolve_mechanism(fam: str, name: str, params: dict, registered: dict | None, as_named: bool = False):
    """(canonical MechanismSpec, instance) of one mechanism, its class looked up once; its parameters
    checked by name and by its constructor, every parameter recorded with its resolved value."""
    cls = mechanism_class(fam, name)
    fields = class_fields(fam, cls)
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise RetentionError(f"{fam} {name!r} has no parameter(s) {unknown}; it takes {sorted(fields) or 'none'}")
    params = cls.written_params(params)  # a configuration written before a parameter existed: what it ran with
    params = typed_params(cls, params, name)
    build = {"budget": None, "interval": 1} if fam == "cadence" else {}  # a cadence is built at its budget later
    identity = mechanism_identity(fam, name, cls)
    obj = construct(fam, name, cls, params, identity is None, **build)
    check_registered(registered, identity, fam)
    rec = obj  # checked as given (its refusals stand), recorded as what it behaves as
    if name != FAMILIES[fam].default and not as_named and is_trivial(obj):  # the cell of the default it behaves as
        name = FAMILIES[fam].default
        cls = FAMILIES[fam].builtins[name]
        fields, rec, identity = class_fields(fam, cls), construct(fam, name, cls, {}, True, **build), None
    unrecorded = type(rec).unrecorded()  # a value the configuration says by leaving it out
    resolved = canonical_values({k: getattr(rec, k) for k in sorted(fields)
                                 if k not in unrecorded or getattr(rec, k) != unrecorded[k]}, name)
    return MechanismSpec.of(fam, name, resolved, identity, cls), obj


def _check_families(scorer: str, evicts: bool, specs: dict) -> None:
    """Refuse, in one line, mechanisms that act on compactions for a scorer that never compacts."""
    if evicts:
        return
    idle = [f"--{fam} {m.name}" for fam, m in specs.items() if fam in ("cadence", "state", "routing")
            and not m.is_default]
    if idle:
        raise RetentionError(f"{', '.join(idle)} act(s) at compactions, and {scorer!r} never compacts; "
                             "use them with a retention scorer")


def _state_budget(state, base: dict, scorer_obj, kind, cparams: dict, head_dims) -> int:
    """The token budget a state holds within `--budget-bytes` (`State.tokens_for_kib`), refused
    when it holds no token."""
    layout = model_layout(base["model"], str(base.get("dtype", "float32")))
    kib = float(base["budget_kib"])
    span = base["interval"] or REFERENCE_INTERVAL
    budget = state.tokens_for_kib(kib, layout.bytes_per_token / 1024, head_dims, layout.layers, layout.kv_heads, span)
    for _ in range(3):  # the default interval depends on the budget; settle both
        if budget < 1:
            raise RetentionError(f"--budget-bytes {kib:g} KiB holds no token of {base['model']} under state "
                                 f"{state.name!r}")
        c = cadence_for(scorer_obj, budget, base["interval"], base["accounting"], base["sink"], base["recent"],
                        kind=kind, params=cparams)
        budget = state.tokens_for_kib(kib, layout.bytes_per_token / 1024, head_dims, layout.layers,
                                      layout.kv_heads, c.span)
    return budget


def _resolve_stats(path: str | None, model: str) -> tuple[str, str]:
    """The calibration statistics file a scorer will use (given, or the model's default) and its
    sha256, so that the configuration hash names the statistics and not just a path."""

    resolved = Path(path) if path else default_stats_path(model)
    if not resolved.is_file():
        hint = "" if path else f" (the default for {model})"
        raise RetentionError(f"no calibration statistics at {resolved}{hint}; run `retention calibrate "
                             f"--model {model}` first or pass --stats FILE")
    return str(resolved.resolve()), hashlib.sha256(resolved.read_bytes()).hexdigest()


# Keys a pre-registered arm configuration may set (the rest come from the plan: model, budget,
# samples, seed, max_new_tokens, split). Names are those of the run configuration (docs/records.md)
# so that `confirm` can compare what was planned with what ran, key by key.
_ARM_KEYS = {"scorer", "scorer_params", "stats_sha256", "scorer_plugin", "interval", "accounting", "sink", "recent",
             "protect_prompt", "protect_prompt_counted", "temperature", "top_p", "dtype", "device", "data", "limit",
             "fidelity", "ignore_eos",
             "engine", "dataset", "cadence", "routing", "state", "decoding", "sampler"}


# Names a user may write for a scorer parameter (CLI spelling -> field name).
PARAM_ALIASES = {"lambda": "lam"}


def normalize_arm(cfg: dict, cls: type | None = None) -> dict:
    """An arm configuration with parameter aliases resolved (`scorer_params.lambda` -> `lam`) and
    no `sampler` key where it would say nothing (the legacy sampler, or a greedy arm); cls: the
    scorer's class where the caller resolved it."""
    cfg = dict(cfg)
    params = cfg.get("scorer_params")
    if isinstance(params, dict):
        cfg["scorer_params"] = {PARAM_ALIASES.get(k, k): v for k, v in params.items()}
    # Absent means the legacy sampler (every sampled record before the key), and a greedy arm draws
    # nothing: both spellings of such an arm are one arm, with the hash it had before the key.
    if cfg.get("sampler") == LEGACY_SAMPLER or (cfg.get("sampler") is not None and cfg.get("temperature", 0.6) == 0):
        del cfg["sampler"]
    for key in ("temperature", "top_p", "budget_kib"):  # -0.0 is 0.0, 0.6000000000000001 is 0.6
        if isinstance(cfg.get(key), float):
            try:
                cfg[key] = canonical_value(cfg[key])
            except ValueError as exc:
                raise RetentionError(f"{key}: {exc}") from None
    if isinstance(cfg.get("scorer"), str) and cfg["scorer"] and "scorer_plugin" not in cfg:
        identity = scorer_identity(cfg["scorer"], cls)
        if identity is not None:
            cfg["scorer_plugin"] = identity
    return cfg


def check_scorer_reads(scorer: str, ref, dtype: str, reads=None) -> None:
    """Refuse, in one line naming what is missing, a scorer (built-in or plugin) that reads what
    the model does not provide (`Scorer.reads` against `retention.runtime.engine.provides`): before any
    model is loaded (the layout of a reference layout model or a DeepSeek checkpoint comes from
    its configuration)."""

    layout, reference = None, False
    if ref.kind in ("arch", "local"):
        layout = model_layout(ref.name, dtype)
        reference = ref.kind == "arch" or layout.family == "mla"  # DeepSeek: the reference MLA
    reads = get_scorer_class(scorer).reads if reads is None else reads
    refusal = reads_refusal(scorer, reads, provides(layout, reference),
                            layout.name if layout is not None else ref.name)
    if refusal is not None:
        raise RetentionError(refusal)


def validate_arm(cfg: dict, as_named: bool = False, settings: RunSettings | None = None,
                 budget: Budget | None = None):
    """Validate one arm's complete run configuration exactly as `run` will run it.

    The one validation of `run`, `preregister` (each arm of each cell) and `confirm` (before any
    generation): sampling numbers (finite, in range), model alias, dtype, device, split, scorer and
    its parameters, statistics file, budget/interval/accounting/sink/recent combination, and that
    the model provides what the scorer reads (`check_scorer_reads`). cfg uses
    the run-configuration keys of docs/records.md (`run` resolves each listed scorer's own
    parameters first: `retention.runs.scorer_options`), plus the families' keys `cadence`, `routing`,
    `state`, `decoding` (a name or `{"name", "params"}`; absent: the default). Returns the `ArmSpec`.
    as_named: see `build_arm_config` (the contract kit only). settings: the run's settings, already
    validated (`RunSettings`): their configuration keys join cfg's (which then holds the arm's own keys
    only); None: cfg holds them, checked here by building the settings they name. budget: the same for
    the arm's `Budget` (its keys join cfg's; None: checked here from cfg's).
    """
    if settings is not None:
        cfg = dict(settings.config(), **cfg)
    if budget is not None:
        cfg = dict(budget.config(), **cfg)
    scorer = cfg.get("scorer")
    # The arm's one lookup of its scorer by name: the class travels from here (into its spec).
    cls = get_scorer_class(scorer) if isinstance(scorer, str) and scorer else None
    cfg = normalize_arm(cfg, cls)
    if not isinstance(cfg.get("scorer"), str) or not cfg["scorer"]:
        raise RetentionError("an arm configuration needs a 'scorer' name")
    if settings is None:
        settings = RunSettings.from_config(cfg)  # every run setting checked, in one line each
    if budget is None:
        Budget.from_config(cfg)  # every budget value checked, in one line each
    ref = resolve_model(settings.model)
    engine = cfg.get("engine", "hf")
    check_scorer_reads(cfg["scorer"], ref, settings.dtype, cls.reads)
    params = cfg.get("scorer_params") or {}
    if not isinstance(params, dict):
        raise RetentionError(f"scorer_params must be an object, got {params!r}")
    fields = set(scorer_parameters(cls))
    unknown = sorted(set(params) - fields)
    if unknown:
        raise RetentionError(f"scorer {cfg['scorer']!r} has no parameter(s) {unknown}; it takes "
                             f"{sorted(fields)}" + (" (lambda is spelled lam or lambda)" if "lam" in fields else ""))
    options = {k: v for k, v in params.items() if k in fields}
    if "stats" in options and options["stats"] is not None and not isinstance(options["stats"], str):
        raise RetentionError(f"--stats must be a file path, got {options['stats']!r}")
    base = {k: v for k, v in cfg.items()
            if k not in ("scorer", "scorer_params", "stats_sha256", "scorer_plugin", *FAMILIES)}
    base.setdefault("interval", None)
    base.setdefault("accounting", "mean")
    base.setdefault("sink", None)
    base.setdefault("recent", None)
    base.setdefault("budget", None)
    layout = model_layout(settings.model, settings.dtype)
    head_dims = (layout.head_dim, layout.head_dim) if layout.family == "kv" else None
    try:
        spec, scorer_obj = _build(base, cfg["scorer"], options, {f: cfg.get(f) for f in FAMILIES}, head_dims, as_named,
                                  cls)
    except TypeError as exc:  # a parameter of the wrong type reached the scorer's constructor
        raise RetentionError(f"scorer {cfg['scorer']!r}: bad parameter ({exc})") from None
    built, config = spec.scorer_params, spec.config
    refusal = engine_refusal(engine, spec)
    if refusal is not None:
        raise RetentionError(refusal)
    # Again with the parameters given (e.g. snapkv's rule keeps one of its alternatives).
    check_scorer_reads(cfg["scorer"], ref, settings.dtype, scorer_obj.reading())
    if built.get("stats"):
        check_stats_file(Path(built["stats"]))
    check_registered(cfg.get("scorer_plugin"), config.get("scorer_plugin"))  # a changed plugin is refused
    registered = cfg.get("stats_sha256")
    if registered is not None and registered != config.get("stats_sha256"):
        raise RetentionError(f"the calibration statistics of {cfg['model']} changed since registration: "
                             f"registered sha256 {str(registered)[:12]}, {built.get('stats')} has "
                             f"{str(config.get('stats_sha256'))[:12]}")
    return spec


def engine_refusal(engine: str, spec: ArmSpec) -> str | None:
    """Why `engine` cannot run arm `spec` (one line), or None. This project's engine runs every
    mechanism; another engine (vLLM) has no retention cache and no decoding hook, so a mechanism it
    would never receive (any non-default cadence, routing, state or decoding) is refused rather than
    recorded as if it ran."""
    if engine == "hf":
        return None
    unsupported = [f"--{fam} {spec.mechanisms[fam].name}" for fam in spec.non_default()]
    if unsupported:  # (an evicting scorer is refused in its own words: `engines.base.refuse_evicting`)
        return (f"--engine {engine} cannot run {', '.join(unsupported)}: it would be recorded but never reach the "
                "engine; run this arm with --engine hf")
    return None


def check_stats_file(path: Path) -> None:
    """Read a statistics file now: one that is not statistics fails here, not mid-run."""
    try:
        read_stats_file(path)  # per-head or latent (MLA) statistics
    except RetentionError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise RetentionError(f"{path} is not a retention statistics file (safetensors: {exc})") from None


def validate_plan_arm(name: str, arm: dict) -> None:
    """The keys of a plan's arm configuration (the rest come from the plan and its cells)."""
    if not isinstance(arm, dict):
        raise RetentionError(f"the {name} configuration must be a JSON object")
    unknown = sorted(set(arm) - _ARM_KEYS)
    if unknown:
        raise RetentionError(f"{name} configuration has unknown key(s) {unknown}; allowed: {sorted(_ARM_KEYS)}")


def validate_plan(plan: dict) -> dict[str, dict[str, str | None]]:
    """Every arm of every cell of a plan, validated as `run` validates an arm (`validate_arm`).

    Returns the calibration statistics each arm of each cell resolves to, by content:
    {cell id: {arm: stats sha256 or None}} (each model of a study has its own statistics)."""
    for arm in ARMS:
        validate_plan_arm(arm, plan[arm])
    resolved: dict[str, dict[str, str | None]] = {}
    for cell in plan["cells"]:
        for arm in ARMS:
            try:
                config = validate_arm(arm_config(plan, "0" * 64, cell, arm)).config
            except RetentionError as exc:
                raise RetentionError(f"{arm} of cell {cell['id']}: {exc}") from None
            resolved.setdefault(cell["id"], {})[arm] = config.get("stats_sha256")
    return resolved

