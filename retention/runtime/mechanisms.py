"""The registry of the four non-scoring families (scorers have theirs in `retention.scorers`).

A mechanism is named like a scorer: a built-in name, a name installed in the family's entry-point
group (`retention.cadences`, `retention.routings`, `retention.states`, `retention.decodings`),
`package.module:Class` or `path/to/file.py:Class`. Its public dataclass fields are its parameters
(`--param NAME.KEY=VALUE`, a plan arm's `{"name": ..., "params": {...}}`). The default of each family
is today's behaviour: `fixed`, `native`, `full`, `none`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from retention.errors import RetentionError
from retention.plugins import class_identity, entry_point_names, load_plugin
from retention.runtime.cadence import Cadence, NewlineCadence
from retention.runtime.decoding import Decoding, LoopGuard
from retention.runtime.routing import AdaKV, PerLayer, PyramidKV, Routing, Shared
from retention.runtime.state import Merge, Quant, State


@dataclass(frozen=True)
class Family:
    """One intervention family: its base class, built-ins, default and entry-point group."""

    name: str
    base: type
    builtins: dict[str, type]
    default: str

    @property
    def group(self) -> str:
        return f"retention.{self.name}s"


FAMILIES = {
    "cadence": Family("cadence", Cadence, {"fixed": Cadence, "newline": NewlineCadence}, "fixed"),
    "routing": Family("routing", Routing, {"native": Routing, "shared": Shared, "per-layer": PerLayer,
                                           "pyramidkv": PyramidKV, "adakv": AdaKV}, "native"),
    "state": Family("state", State, {"full": State, "merge": Merge, "quant": Quant}, "full"),
    "decoding": Family("decoding", Decoding, {"none": Decoding, "loop-guard": LoopGuard}, "none"),
}
# Fields of the cadence base class: the run configuration's own keys (budget, --interval, ...), not
# a cadence's parameters.
CADENCE_BASE_FIELDS = frozenset(f.name for f in dataclasses.fields(Cadence))


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise RetentionError(f"unknown family {name!r}; families: scorer, {', '.join(FAMILIES)}")
    return FAMILIES[name]


def mechanism_class(fam: str, name: str) -> type:
    """The class of a built-in name, an entry-point name, `package.module:Class` or `file.py:Class`."""
    f = family(fam)
    if name in f.builtins:
        return f.builtins[name]
    cls = load_plugin(name, f.base, f.group, fam)
    if cls is None:
        installed = entry_point_names(f.group)
        more = f"; installed plugins: {', '.join(installed)}" if installed else ""
        raise RetentionError(f"unknown {fam} {name!r}; known: {', '.join(f.builtins)}{more} "
                             "(a plugin is named package.module:Class or path/to/file.py:Class)")
    return cls


def is_builtin(fam: str, name: str) -> bool:
    return name in family(fam).builtins


def mechanism_fields(fam: str, name: str) -> dict[str, dataclasses.Field]:
    """The settable parameters of a mechanism (public init fields; a cadence's own beyond `fixed`'s)."""
    cls = mechanism_class(fam, name)
    skip = CADENCE_BASE_FIELDS if fam == "cadence" else frozenset()
    return {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_") and f.name not in skip}


def mechanism_identity(fam: str, name: str) -> dict | None:
    """A plugin's identity (spec, distribution, version, source sha256), None for a built-in."""
    if is_builtin(fam, name):
        return None
    return class_identity(mechanism_class(fam, name), name)


def make_mechanism(fam: str, name: str, params: dict, **base):
    """An instance of mechanism `name` with `params` (validated by its constructor); `base`: a
    cadence's run-configuration fields (budget, interval, ...). A plugin's failure is one line."""
    cls = mechanism_class(fam, name)
    try:
        return cls(**base, **params)
    except RetentionError:
        raise
    except TypeError as exc:
        raise RetentionError(f"{fam} {name!r}: bad parameter ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - a plugin's constructor: whatever it raises is one line
        raise RetentionError(f"{fam} plugin {name!r} failed to construct: {type(exc).__name__}: {exc}") from None
