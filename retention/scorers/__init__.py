"""Scorer registry: the public scorer interface, the built-in scorers and plugins.

Built-in scorers are one module each in this package, registering their class by name. Scorers from
outside the package (`package.module:Class`, `path/to/file.py:Class`, or a name installed in the
entry-point group `retention.scorers`) are resolved by `retention.plugins`. Everything a scorer author
needs is exported here: `Scorer` (the interface, documented with tensor shapes in
`retention.scorers.base`), `WindowScorer`, `CacheView` and `topk_keep`.
"""

from __future__ import annotations

import importlib

from retention.errors import RetentionError
from retention.cache import CacheView
from retention.scorers.base import Scorer, WindowScorer, topk_keep

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

_REGISTRY: dict[str, type[Scorer]] = {}
# In the order refusals list the scorers a model can run.
_MODULES = ("full", "random", "streaming", "h2o", "snapkv", "rkv", "triattention", "alpha")
# What built-ins whose modules do not declare `reads` read (their modules may declare it instead).
# (alpha first: it subclasses triattention and must not inherit triattention's default.)
_DEFAULT_READS = {
    "alpha": (frozenset({"keys", "values", "calibration"}),),
    "triattention": (frozenset({"keys", "calibration"}),),
}
_loaded = False


def register(name: str):
    """Class decorator: make a `Scorer` subclass addressable as `--scorer name`."""

    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_all() -> None:
    global _loaded
    if not _loaded:
        for mod in _MODULES:
            importlib.import_module(f"retention.scorers.{mod}")
        for name, reads in _DEFAULT_READS.items():
            if _REGISTRY[name].reads is Scorer.reads:
                _REGISTRY[name].reads = reads
        _loaded = True


def available() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def is_builtin(name: str) -> bool:
    """Whether `name` is a scorer of this package (not a plugin)."""
    _load_all()
    return name in _REGISTRY


def get_scorer_class(name: str) -> type[Scorer]:
    """The class of a built-in name, an entry-point name, `package.module:Class` or `file.py:Class`."""
    _load_all()
    if name in _REGISTRY:
        return _REGISTRY[name]
    from retention.plugins import entry_point_names, load_plugin

    cls = load_plugin(name)
    if cls is None:
        installed = entry_point_names()
        more = f"; installed plugins: {', '.join(installed)}" if installed else ""
        raise RetentionError(f"unknown scorer {name!r}; known scorers: {', '.join(available())}{more} "
                             "(a plugin is named package.module:Class or path/to/file.py:Class)")
    return cls


def scorer_identity(name: str) -> dict | None:
    """What identifies a scorer beyond its name, for the run configuration (and so its hash).

    None for the built-in scorers (the code version covers them). A plugin scorer returns its spec,
    its distribution name and version when installed, and the sha256 of its source file(s), so that
    a changed plugin never resumes or confirms a run of the old one.
    """
    _load_all()
    if name in _REGISTRY:
        return None
    from retention.plugins import plugin_identity

    get_scorer_class(name)  # one error line for an unknown name
    return plugin_identity(name)


# Kinds a per-head scorer reads that a reference layout model's view does not expose.
_PER_HEAD = frozenset({"keys", "values", "queries", "calibration"})


def reads_refusal(name: str, reads, provides: frozenset[str], cache_name: str, reference: bool) -> str | None:
    """The one line that refuses scorer `name` (reading one of the alternatives `reads`) on a
    model that provides `provides` (its cache named `cache_name`; `reference`: a reference layout
    model), or None when one alternative is provided. It lists the built-ins that would run."""
    if any(alt <= provides for alt in reads):
        return None
    _load_all()
    usable = [n for n in _MODULES if any(alt <= provides for alt in _REGISTRY[n].reads)]
    if reference and all(alt & _PER_HEAD for alt in reads):
        what = "it scores per-head post-RoPE keys, which a latent or shared-storage cache does not store"
    else:
        alt = min(reads, key=lambda a: (len(a - provides), sorted(a)))
        what = (f"it reads {', '.join(sorted(alt))}, and {', '.join(sorted(alt - provides))} is not provided "
                f"(the model provides {', '.join(sorted(provides))})")
    return f"{name} cannot score the {cache_name} cache: {what}; use {', '.join(usable)}"


def make_scorer(name: str, **params) -> Scorer:
    """Instantiate scorer `name` with the parameters its dataclass declares; others are ignored
    (the CLI passes --lambda, --window, ... to every scorer; those that do not use them ignore them)."""
    cls = get_scorer_class(name)
    fields = getattr(cls, "__dataclass_fields__", {})
    kwargs = {k: v for k, v in params.items() if k in fields and v is not None}
    if name in _REGISTRY:
        return cls(**kwargs)
    try:  # a plugin's constructor: whatever it raises is one error line naming it
        return cls(**kwargs)
    except RetentionError as exc:
        raise RetentionError(f"scorer plugin {name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001
        raise RetentionError(f"scorer plugin {name!r} failed to construct: {type(exc).__name__}: {exc}") from None


__all__ = ["READS", "reads_refusal", "CacheView", "Scorer", "WindowScorer", "register", "available", "get_scorer_class", "make_scorer",
           "scorer_identity", "is_builtin", "topk_keep"]
