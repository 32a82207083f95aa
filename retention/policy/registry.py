"""The one registry of the five families: a name resolved once into a `MechanismSpec`.

A mechanism of any family (scorer, cadence, routing, state, decoding) is named by a built-in name,
a name an installed distribution registers in the family's entry-point group (`retention.scorers`,
`retention.cadences`, `retention.routings`, `retention.states`, `retention.decodings`),
`package.module:Class` or `path/to/file.py:Class` (`retention.plugins` loads the last three). Its
public dataclass fields are its parameters (`--param NAME.KEY=VALUE`, a plan arm's `{"name": ...,
"params": {...}}`). The default of each family is today's behaviour: `full`, `fixed`, `native`,
`full`, `none`.

`resolve(family, name)` looks the name up once; the `MechanismSpec` it starts (class, canonical
parameters, plugin identity) is what the arm carries from then on (`retention.runs.spec.ArmSpec`),
so nothing downstream looks a name up again: it builds from `spec.cls` (`MechanismSpec.build`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from retention.errors import RetentionError
from retention.plugins import class_identity, entry_point_names, load_plugin
from retention.policy.cadence.base import Cadence
from retention.policy.cadence.newline import NewlineCadence
from retention.policy.decoding.base import Decoding
from retention.policy.decoding.loop_guard import LoopGuard
from retention.policy.routing.adakv import AdaKV
from retention.policy.routing.base import Routing
from retention.policy.routing.per_layer import PerLayer
from retention.policy.routing.pyramidkv import PyramidKV
from retention.policy.routing.shared import Shared
from retention.policy.scoring.alpha import Alpha
from retention.policy.scoring.base import Scorer
from retention.policy.scoring.full import Full
from retention.policy.scoring.h2o import H2O
from retention.policy.scoring.random import RandomScorer
from retention.policy.scoring.random_pp import RandomPP
from retention.policy.scoring.rkv import RKV
from retention.policy.scoring.snapkv import SnapKV
from retention.policy.scoring.streaming import Streaming
from retention.policy.scoring.triattention import TriAttention
from retention.policy.state.base import State
from retention.policy.state.merge import Merge
from retention.policy.state.quant import Quant


@dataclass(frozen=True)
class Family:
    """One intervention family: its base class, built-ins (in the order refusals list them), default,
    entry-point group and the word its refusals use for it."""

    name: str
    base: type
    builtins: dict[str, type]
    default: str
    group: str
    noun: str = ""  # "scorer" for the scoring family's messages; the family name otherwise

    def label(self) -> str:
        return self.noun or self.name


SCORING = Family("scorer", Scorer, {"full": Full, "random": RandomScorer, "random-pp": RandomPP,
                                    "streaming": Streaming, "h2o": H2O, "snapkv": SnapKV, "rkv": RKV,
                                    "triattention": TriAttention, "alpha": Alpha}, "full", "retention.scorers")
# The four families beside scoring: the run configuration's keys (a non-default one is recorded
# under its family's name).
FAMILIES = {
    "cadence": Family("cadence", Cadence, {"fixed": Cadence, "newline": NewlineCadence}, "fixed", "retention.cadences"),
    "routing": Family("routing", Routing, {"native": Routing, "shared": Shared, "per-layer": PerLayer,
                                           "pyramidkv": PyramidKV, "adakv": AdaKV}, "native", "retention.routings"),
    "state": Family("state", State, {"full": State, "merge": Merge, "quant": Quant}, "full", "retention.states"),
    "decoding": Family("decoding", Decoding, {"none": Decoding, "loop-guard": LoopGuard}, "none",
                       "retention.decodings"),
}
ALL_FAMILIES = {"scorer": SCORING, **FAMILIES}
# Fields of the cadence base class: the run configuration's own keys (budget, --interval, ...), not
# a cadence's parameters.
CADENCE_BASE_FIELDS = frozenset(f.name for f in dataclasses.fields(Cadence))


def family(name: str) -> Family:
    if name not in ALL_FAMILIES:
        raise RetentionError(f"unknown family {name!r}; families: {', '.join(ALL_FAMILIES)}")
    return ALL_FAMILIES[name]


def mechanism_class(fam: str, name: str) -> type:
    """The class of a built-in name, an entry-point name, `package.module:Class` or `file.py:Class`:
    the one lookup of every family."""
    f = family(fam)
    if name in f.builtins:
        return f.builtins[name]
    cls = load_plugin(name, f.base, f.group, fam)
    if cls is None:
        installed = entry_point_names(f.group)
        more = f"; installed plugins: {', '.join(installed)}" if installed else ""
        known = "known scorers" if fam == "scorer" else "known"
        raise RetentionError(f"unknown {fam} {name!r}; {known}: {', '.join(f.builtins)}{more} "
                             "(a plugin is named package.module:Class or path/to/file.py:Class)")
    return cls


def is_builtin(fam: str, name: str) -> bool:
    return name in family(fam).builtins


def class_fields(fam: str, cls: type) -> dict[str, dataclasses.Field]:
    """The settable parameters of a mechanism class (public init fields; a cadence's own beyond
    `fixed`'s)."""
    skip = CADENCE_BASE_FIELDS if fam == "cadence" else frozenset()
    return {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_") and f.name not in skip}


def mechanism_fields(fam: str, name: str) -> dict[str, dataclasses.Field]:
    return class_fields(fam, mechanism_class(fam, name))


def mechanism_identity(fam: str, name: str, cls: type | None = None) -> dict | None:
    """A plugin's identity (spec, distribution, version, source sha256), None for a built-in."""
    if is_builtin(fam, name):
        return None
    return class_identity(cls or mechanism_class(fam, name), name)


def construct(fam: str, name: str, cls: type, params: dict, builtin: bool | None = None, **base):
    """An instance of `cls` (mechanism `name`) with `params` (validated by its constructor); `base`:
    a cadence's run-configuration fields (budget, interval, ...); builtin: whether `name` is a
    built-in (None: asked of the family). A plugin's failure is one line."""
    if fam == "scorer":  # a built-in scorer raises as it is; a plugin's failure is one line naming it
        if is_builtin(fam, name) if builtin is None else builtin:
            return cls(**base, **params)
        try:
            return cls(**base, **params)
        except RetentionError as exc:
            raise RetentionError(f"scorer plugin {name!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001
            raise RetentionError(f"scorer plugin {name!r} failed to construct: {type(exc).__name__}: {exc}") from None
    try:
        return cls(**base, **params)
    except RetentionError:
        raise
    except TypeError as exc:
        raise RetentionError(f"{fam} {name!r}: bad parameter ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - a plugin's constructor: whatever it raises is one line
        raise RetentionError(f"{fam} plugin {name!r} failed to construct: {type(exc).__name__}: {exc}") from None


def new_run_entry(fam: str, entry):
    """A family's entry (a name or `{"name", "params"}`) of a run being started now (the CLI, the API,
    a new plan, the contract kit), with the parameters its class gives new runs where the entry sets
    none (`new_run_params`: `quant.store` packed; a written configuration without them ran otherwise,
    so `validate_arm` itself adds nothing). Entries of other mechanisms come back unchanged."""
    if entry is None or fam not in ALL_FAMILIES or fam == "scorer":
        return entry
    name = entry if isinstance(entry, str) else entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name:
        return entry
    try:
        cls = mechanism_class(fam, name)
    except RetentionError:
        return entry  # refused with its own line by validation
    extra = cls.new_run_params()
    if not extra:
        return entry
    params = dict(entry.get("params") or {}) if isinstance(entry, dict) else {}
    out = dict(entry) if isinstance(entry, dict) else {"name": name}
    out["params"] = {**extra, **params}
    return out


def new_run_config(cfg: dict) -> dict:
    """An arm configuration being started now with `new_run_entry` applied to each family's entry."""
    return {k: new_run_entry(k, v) for k, v in cfg.items()}


def make_mechanism(fam: str, name: str, params: dict, **base):
    """An instance of mechanism `name` of family `fam` with `params`."""
    return construct(fam, name, mechanism_class(fam, name), params, **base)


@dataclass(frozen=True)
class MechanismSpec:
    """One mechanism of one family, resolved once: its name as given, its class, its resolved
    parameters (sorted) and, for a plugin, its identity (canonical JSON)."""

    family: str
    name: str
    params: tuple[tuple[str, object], ...] = ()
    plugin: str | None = None
    # The resolved class (not compared: the name and identity say which class it is).
    cls: type | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, family: str, name: str, params: dict | None = None, plugin: dict | None = None,
           klass: type | None = None) -> MechanismSpec:
        items = tuple(sorted((params or {}).items()))
        return cls(family, name, items, None if plugin is None else json.dumps(plugin, sort_keys=True),
                   klass if klass is not None else mechanism_class(family, name))

    def __reduce__(self):
        # A plugin class loaded from a file is not importable by its qualified name: a spec sent to
        # another process (Ray) resolves its name again there.
        return (_restore, (self.family, self.name, self.params, self.plugin))

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    @property
    def is_default(self) -> bool:
        return self.family in ALL_FAMILIES and self.name == ALL_FAMILIES[self.family].default

    def build(self, **base):
        """A fresh instance (per-run state never leaks between runs)."""
        # A parameter the record leaves out at the value it ran with (`Quant.store`): `written_params`.
        kwargs = (scorer_kwargs(self.cls, self.kwargs) if self.family == "scorer"
                  else self.cls.written_params(self.kwargs))
        return construct(self.family, self.name, self.cls, kwargs, self.plugin is None, **base)

    def record(self) -> dict:
        """The configuration's form: `{"name", "params"}` (+ `"plugin"`)."""
        out = {"name": self.name, "params": self.kwargs}
        if self.plugin is not None:
            out["plugin"] = json.loads(self.plugin)
        return out


def _restore(family: str, name: str, params: tuple, plugin: str | None) -> MechanismSpec:
    return MechanismSpec(family, name, params, plugin, mechanism_class(family, name))


# ------------------------------------------------------------------------------- the scoring family

# What a scorer may read (`Scorer.reads`) and a cache layout plus its model may provide:
READS = {
    "positions": "absolute positions of the stored tokens (every cache)",
    "keys": "post-RoPE per-head keys of each layer",
    "values": "per-head values of each layer",
    "queries": "the per-head post-RoPE queries the model computes at each step",
    "attention": "the attention mass each stored token receives at each step",
    "latent": "an MLA latent, its RoPE key and the model's up-projections",
    "calibration": "per-head query statistics from `retention calibrate`",
}


def available() -> list[str]:
    return sorted(SCORING.builtins)


def get_scorer_class(name: str) -> type[Scorer]:
    """The class of scorer `name` (`mechanism_class("scorer", name)`)."""
    return mechanism_class("scorer", name)


def scorer_identity(name: str, cls: type | None = None) -> dict | None:
    """What identifies a scorer beyond its name, for the run configuration (and so its hash).

    None for the built-in scorers (the code version covers them). A plugin scorer returns its spec,
    its distribution name and version when installed, and the sha256 of its source file(s), so that
    a changed plugin never resumes or confirms a run of the old one.
    """
    return mechanism_identity("scorer", name, cls)


def scorer_kwargs(cls: type, params: dict) -> dict:
    """The parameters of `params` that scorer class `cls` declares, unset (None) ones left out (the
    CLI passes --lambda, --window, ... to every scorer; those that do not use them ignore them)."""
    fields = getattr(cls, "__dataclass_fields__", {})
    return {k: v for k, v in params.items() if k in fields and v is not None}


def make_scorer(name: str, **params) -> Scorer:
    """Instantiate scorer `name` with the parameters its dataclass declares; others are ignored, but
    `routing` (a kept-set structure as configurations write it, `STRUCTURE_PARAM`) sets the
    structure of a scorer that offers several (`Scorer.structured`)."""
    cls = get_scorer_class(name)
    scorer = construct("scorer", name, cls, scorer_kwargs(cls, params))
    structure = params.get("routing") if cls.structures else None
    return scorer if structure is None else scorer.structured(structure)


def reads_refusal(name: str, reads, provides: frozenset[str], cache_name: str) -> str | None:
    """The one line that refuses scorer `name` (reading one of the alternatives `reads`) on a
    model that provides `provides` (its cache named `cache_name`), or None when one alternative is
    provided. It names what is missing and lists the built-ins that would run."""
    if any(alt <= provides for alt in reads):
        return None
    usable = [n for n, c in SCORING.builtins.items() if any(alt <= provides for alt in c.reads)]
    wanted = " or ".join(" + ".join(sorted(alt)) for alt in reads)
    closest = min(reads, key=lambda a: (len(a - provides), sorted(a)))
    return (f"{name} cannot score the {cache_name} cache: it reads {wanted}, and this model provides "
            f"{', '.join(sorted(provides))} ({', '.join(sorted(closest - provides))} missing); "
            f"use {', '.join(usable)}")


# ------------------------------------------------------- the kept-set structure: a routing's choice

@dataclass
class _Spelling:
    routing: str = "shared"


# `scorer_params.routing`: how configurations written before routing was a family only name the
# kept-set structure of a scorer that offers several (TriAttention, alpha). It is read as the routing
# family's choice and written back in that place, so that those configurations keep their hashes.
STRUCTURE_PARAM = dataclasses.fields(_Spelling)[0]


def scorer_parameters(cls: type) -> dict[str, dataclasses.Field]:
    """What a configuration may set of scorer class `cls`: its public init fields (`seed` aside) and,
    for a scorer with a choice of kept-set structure, `routing` (`STRUCTURE_PARAM`)."""
    out = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_") and f.name != "seed"}
    if cls.structures:
        out["routing"] = STRUCTURE_PARAM
    return out


def routing_given(scorer: str, cls: type, written, given: tuple[str, dict, dict | None]):
    """The routing an arm names, `given` (name, params, registered identity), with the structure
    `written` as the scorer's `routing` (None: not written) folded in; refused in one line where the
    two disagree."""
    if written is None or not cls.structures:
        return given
    if written not in cls.structures:
        raise RetentionError(f"--routing must be one of {', '.join(cls.structures)}, got {written!r}")
    name, params, _ = given
    if name == FAMILIES["routing"].default and not params:
        return written, {}, None
    routing = mechanism_class("routing", name)
    if routing.structure_for(cls) != written:
        if routing.allocates:
            raise RetentionError(f"routing {name!r} allocates per layer; {scorer}.routing={written} shares one kept set "
                                 "over the layers (leave it unset)")
        raise RetentionError(f"--routing {name} and {scorer}.routing={written} disagree; give one")
    return given


def canonical_routing(spec: MechanismSpec, cls: type, structure: str | None) -> MechanismSpec:
    """The routing of an arm whose scorer (class `cls`) scores in `structure`, in canonical form: on a
    scorer with a choice of structure, `native` for its default structure (`shared` is `native`
    there) and the structure's own routing (`per-layer`) otherwise, where the routing given is a
    structure or resolved to `native` (an allocation at a trivial setting keeps its per-layer sets)."""
    if not cls.structures or not (spec.is_default or spec.cls.structure is not None):
        return spec
    name = FAMILIES["routing"].default if structure == cls.structures[0] else structure
    return spec if spec.name == name else MechanismSpec.of("routing", name, {})


def structure_recorded(spec: MechanismSpec) -> bool:
    """Whether a routing is recorded as the scorer's `routing` rather than under the family's key."""
    return spec.cls.structure is not None and not spec.cls.allocates
