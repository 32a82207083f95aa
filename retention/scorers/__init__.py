"""Scorer registry: one module per scorer, each registering its class by name."""

from __future__ import annotations

import importlib

from retention.errors import RetentionError
from retention.scorers.base import Scorer, topk_keep

_REGISTRY: dict[str, type[Scorer]] = {}
_MODULES = ("full", "random", "streaming", "triattention", "alpha", "snapkv", "rkv", "h2o")
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
        _loaded = True


def available() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def get_scorer_class(name: str) -> type[Scorer]:
    _load_all()
    if name not in _REGISTRY:
        raise RetentionError(f"unknown scorer {name!r}; known scorers: {', '.join(available())}")
    return _REGISTRY[name]


def scorer_identity(name: str) -> dict | None:
    """What identifies a scorer beyond its name, for the run configuration (and so its hash).

    None for the built-in scorers (the code version covers them). A plugin scorer returns its spec,
    its distribution name and version when installed, and the sha256 of its source file(s), so that
    a changed plugin never resumes or confirms a run of the old one.
    """
    get_scorer_class(name)
    return None


def make_scorer(name: str, **params) -> Scorer:
    """Instantiate scorer `name` with the parameters its dataclass declares; others are ignored
    (the CLI passes --lambda, --window, ... to every scorer; those that do not use them ignore them)."""
    cls = get_scorer_class(name)
    fields = getattr(cls, "__dataclass_fields__", {})
    return cls(**{k: v for k, v in params.items() if k in fields and v is not None})


__all__ = ["Scorer", "register", "available", "get_scorer_class", "make_scorer", "scorer_identity", "topk_keep"]
