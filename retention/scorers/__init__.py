"""Scorer registry: the public scorer interface, the built-in scorers and plugins.

Built-in scorers are one module each in this package, named in `BUILTINS` (name -> module and class,
loaded on first use; the modules never import this package, so the registry has no import cycle). Scorers from
outside the package (`package.module:Class`, `path/to/file.py:Class`, or a name installed in the
entry-point group `retention.scorers`) are resolved by `retention.plugins`. Everything a scorer author
needs is exported here: `Scorer` (the interface, documented with tensor shapes in
`retention.scorers.base`), `WindowScorer`, `CacheView` and `topk_keep`.
"""

from __future__ import annotations

import importlib

from retention.errors import RetentionError
from retention.plugins import class_identity, entry_point_names, load_plugin
from retention.runtime.cache import CacheView
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

# name -> (module of this package, class), in the order refusals list the scorers a model can run.
BUILTINS = {
    "full": ("full", "Full"),
    "random": ("random", "RandomScorer"),
    "random-pp": ("random_pp", "RandomPP"),
    "streaming": ("streaming", "Streaming"),
    "h2o": ("h2o", "H2O"),
    "snapkv": ("snapkv", "SnapKV"),
    "rkv": ("rkv", "RKV"),
    "triattention": ("triattention", "TriAttention"),
    "alpha": ("alpha", "Alpha"),
}
_REGISTRY: dict[str, type[Scorer]] = {}


def _load_all() -> None:
    if len(_REGISTRY) < len(BUILTINS):
        for name, (module, cls) in BUILTINS.items():
            _REGISTRY[name] = getattr(importlib.import_module(f"retention.scorers.{module}"), cls)


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
    cls = load_plugin(name, Scorer)
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
    return class_identity(get_scorer_class(name), name)  # one error line for an unknown name


def reads_refusal(name: str, reads, provides: frozenset[str], cache_name: str) -> str | None:
    """The one line that refuses scorer `name` (reading one of the alternatives `reads`) on a
    model that provides `provides` (its cache named `cache_name`), or None when one alternative is
    provided. It names what is missing and lists the built-ins that would run."""
    if any(alt <= provides for alt in reads):
        return None
    _load_all()
    usable = [n for n in BUILTINS if any(alt <= provides for alt in _REGISTRY[n].reads)]
    wanted = " or ".join(" + ".join(sorted(alt)) for alt in reads)
    closest = min(reads, key=lambda a: (len(a - provides), sorted(a)))
    return (f"{name} cannot score the {cache_name} cache: it reads {wanted}, and this model provides "
            f"{', '.join(sorted(provides))} ({', '.join(sorted(closest - provides))} missing); "
            f"use {', '.join(usable)}")


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


__all__ = ["READS", "reads_refusal", "CacheView", "Scorer", "WindowScorer", "available", "get_scorer_class", "make_scorer",
           "scorer_identity", "is_builtin", "topk_keep"]
