"""Scorer plugins: scorers that live outside this package.

`--scorer` (and a plan's `"scorer"`) names a scorer in one of four ways, tried in this order:

* a built-in name (`alpha`, `h2o`, ...: `retention.policy.registry.available()`);
* a name an installed distribution registers in the entry-point group `retention.scorers`
  (`[project.entry-points."retention.scorers"] keynorm = "keynorm_scorer:KeyNorm"`);
* `package.module:Class`, imported from `sys.path`;
* `path/to/file.py:Class`, loaded from that file.

A plugin is a subclass of `retention.scorers.Scorer` (the interface is documented in
`retention.scorers.base`). Its identity is part of the arm: `class_identity` gives the spec, the
distribution and version when the module belongs to an installed distribution, the sha256 of its
source file(s) (the module's file, or every `*.py` file of the module's own package folder, and every
module its import loaded that belongs to no installed distribution and not to this project, wherever it
lives), so the configuration hash changes when the plugin's code does, and `code_sha256` (its class
and those contents, without names): what a plan's cell names it by, so one plugin under two names
is one cell. A plugin that fails to import, or names no
such class, or whose class is not a `Scorer`, is one `RetentionError` naming the plugin.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
from importlib import metadata
from pathlib import Path

from protocol.io import load_json_object
from retention.errors import RetentionError

GROUP = "retention.scorers"
# Keys of a plugin's identity that may change between code versions of the same plugin: they are in
# the configuration hash (a changed plugin is refused) but not in the run id (so the refusal fires
# on the existing run directory instead of a fresh one being started silently).
VOLATILE_KEYS = ("version", "sources_sha256", "code_sha256")
MAX_SOURCE_FILES = 200

_loaded: dict[str, type] = {}
# Module name of a plugin class -> files of the outside modules its import loaded (`_outside_files`).
_imported: dict[str, set[Path]] = {}


def is_spec(name: str) -> bool:
    """Whether `name` is a `module:Class` or `file.py:Class` spec (not a registered name)."""
    return ":" in name


def _entry_point(name: str, group: str = GROUP):
    for ep in metadata.entry_points(group=group):
        if ep.name == name:
            return ep
    return None


def entry_point_names(group: str = GROUP) -> list[str]:
    """Names installed distributions register in entry-point group `group` (`retention.scorers`,
    `retention.cadences`, `retention.routings`, `retention.states`, `retention.decodings`)."""
    return sorted({ep.name for ep in metadata.entry_points(group=group)})


def _import_file(path: Path):
    """Import a Python file as a module of its own (named after its resolved path, so two files
    with the same name never collide)."""
    if not path.is_file():
        raise RetentionError(f"no such file {path}")
    mod_name = "retention_plugin_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module


def _target(name: str, group: str = GROUP) -> tuple[str, str]:
    """(`module or file:Class` target, how it was named) of a plugin name or spec."""
    if is_spec(name):
        return name, "spec"
    ep = _entry_point(name, group)
    if ep is None:
        return "", ""
    return ep.value, "entry point"


def load_plugin(name: str, base: type, group: str = GROUP, family: str = "scorer") -> type | None:
    """The subclass of `base` (the family's interface: `retention.scorers.Scorer` for a scorer) a
    plugin name or spec stands for,
    looked up in entry-point group `group`; None when `name` is neither a spec nor an installed
    entry-point name. Errors (import, missing class, not a subclass) are one `RetentionError` naming
    the plugin and its family."""
    key = name if family == "scorer" else f"{family}:{name}"
    if key in _loaded:
        return _loaded[key]
    target, how = _target(name, group)
    if not target:
        return None
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise RetentionError(f"{family} plugin {name!r}: expected package.module:Class or path/to/file.py:Class")
    before = set(sys.modules)
    try:
        module = _import_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
        cls = module
        for part in attr.split("."):
            cls = getattr(cls, part)
    except RetentionError as exc:
        raise RetentionError(f"{family} plugin {name!r} ({how} {target}): {exc}") from None
    except AttributeError:
        raise RetentionError(f"{family} plugin {name!r} ({how} {target}): {where} has no {attr!r}") from None
    except BaseException as exc:  # noqa: BLE001 - whatever the plugin's import raises is one error line
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise RetentionError(f"{family} plugin {name!r} ({how} {target}) failed to import: "
                             f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise RetentionError(f"{family} plugin {name!r} ({how} {target}) is not a {_base_name(base, family)} subclass")
    _loaded[key] = cls
    _imported.setdefault(cls.__module__, set()).update(_outside_files(set(sys.modules) - before))
    return cls


@functools.lru_cache(maxsize=1)
def _installed_tops() -> frozenset[str]:
    """Top-level names of installed distributions' modules (read once per process)."""
    return frozenset(metadata.packages_distributions())


def loaded_outside_since(before: set[str]) -> list[Path]:
    """Source files of outside modules (`_outside_files`) imported since `before` (a `set(sys.modules)`
    taken before a run): code a plugin loaded while decoding, which its identity did not cover."""
    return sorted(_outside_files(set(sys.modules) - before) - {f for fs in _imported.values() for f in fs})


def _outside_files(names) -> set[Path]:
    """Source files of modules `names` that belong to no installed distribution, not to this project
    and not to the standard library: code a plugin pulled in from anywhere (`PYTHONPATH`, the working
    directory) that decides what it computes as much as its own file does."""
    skip = _installed_tops() | {"retention", "protocol"} | set(sys.stdlib_module_names)
    files = set()
    for name in names:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if not path or name.partition(".")[0] in skip or name.startswith("retention_plugin_") or not path.endswith(".py"):
            continue
        files.add(Path(path).resolve())
    return files


def _base_name(base: type, family: str) -> str:
    """How errors name a family's interface (a scorer's as `retention.scorers` exports it)."""
    return f"{'retention.scorers' if family == 'scorer' else base.__module__}.{base.__qualname__}"


def _distribution(module) -> tuple[str | None, str | None]:
    """(distribution name, version) that installed `module`'s top-level package, if any."""
    top = module.__name__.partition(".")[0]
    names = metadata.packages_distributions().get(top) or []
    for dist_name in names:
        try:
            return dist_name, metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            continue
    return None, None


def source_files(cls: type) -> tuple[Path, list[Path]]:
    """(root, files): the source file(s) a plugin class's behaviour comes from. A module that is part
    of a package: every `*.py` file of its package folder (recursively; at most 200); a lone module
    or file: itself. Keys of `sources_sha256` are the files relative to `root`."""
    module = sys.modules.get(cls.__module__)
    file = Path(getattr(module, "__file__", "") or "")
    if not file.is_file():
        return Path(), []  # defined in a notebook or an interactive session: `class_identity` hashes its source
    file = file.resolve()
    if module.__name__.startswith("retention_plugin_") or not getattr(module, "__package__", ""):
        return file.parent, helper_files(file)
    folder = file.parent
    files = sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)
    if len(files) > MAX_SOURCE_FILES:
        raise RetentionError(f"scorer plugin package {folder} has {len(files)} Python files; a plugin's own "
                             f"package should be small (at most {MAX_SOURCE_FILES})")
    return folder.parent, files


def helper_files(file: Path) -> list[Path]:
    """A lone module or file plugin and every module imported so far from its folder or below it
    (a helper beside it changes the plugin as much as the plugin's own file), except modules of
    installed distributions and of this project (a checkout's own packages: their code is the code
    version). Imports a plugin makes only later, while decoding, are not seen."""
    folder = file.parent
    skip = _installed_tops() | {"retention", "protocol"}
    files = {file}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name.partition(".")[0] in skip or not path.endswith(".py"):
            continue
        path = Path(path).resolve()
        if folder in path.parents:
            files.add(path)
    if len(files) > MAX_SOURCE_FILES:
        raise RetentionError(f"scorer plugin {file} has {len(files)} Python files loaded from {folder}; a plugin's "
                             f"own sources should be few (at most {MAX_SOURCE_FILES})")
    return sorted(files)


def class_identity(cls: type, spec: str) -> dict:
    """The identity of plugin class `cls` named `spec`: `{"spec", "distribution", "version",
    "sources_sha256": {file: sha256}}` (the module doc). A class without a source file (defined in a
    notebook) is hashed from its source text, keyed `module:qualname`."""
    root, files = source_files(cls)
    module = sys.modules.get(cls.__module__)
    # Outside modules its import loaded, and those its namespace refers to (loaded before it, by
    # another name of the same plugin): both decide what it computes.
    refs = {getattr(v, "__name__", "") if inspect.ismodule(v) else getattr(v, "__module__", "") or ""
            for v in vars(module).values()} if module is not None else set()
    extra = sorted((_imported.get(cls.__module__, set()) | _outside_files(refs)) - set(files)) if files else []
    dist, version = (None, None) if module is None or module.__name__.startswith("retention_plugin_") or not files \
        else _distribution(module)
    shas = {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    # Modules its import loaded from elsewhere, by their real path (they have no place under root).
    shas.update({p.as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in extra})
    if not files:  # no file: the class's own source text is what identifies it
        try:
            text = inspect.getsource(cls)
        except (OSError, TypeError):  # a notebook cell's class: its methods' source is still at hand
            methods = []
            for _, fn in sorted(vars(cls).items()):
                try:  # methods dataclasses generate have no source; the class's own have
                    methods.append(inspect.getsource(fn) if inspect.isfunction(fn) else "")
                except (OSError, TypeError):
                    continue
            if not any(methods):
                raise RetentionError(f"scorer class {cls.__qualname__} has neither a source file nor source text "
                                     "to identify it by; define it in a module") from None
            fields = sorted((k, repr(v)) for k, v in vars(cls).items() if not callable(v) and not k.startswith("__"))
            text = "\n".join([repr(fields), *methods])
        shas = {f"{cls.__module__}:{cls.__qualname__}": hashlib.sha256(text.encode()).hexdigest()}
    return {"spec": spec, "distribution": dist, "version": version, "sources_sha256": shas,
            "code_sha256": code_sha256(cls.__qualname__, shas)}


def code_sha256(qualname: str, sources: dict[str, str]) -> str:
    """What a plugin runs, whatever it is named by: its class's name and the contents of its source
    files (not their names or folder: the same file reached by an entry point and by its path is one
    plugin, so one cell of a plan: `protocol.plans.cell_identity`)."""
    body = json.dumps({"class": qualname, "sources": sorted(sources.values())})
    return hashlib.sha256(body.encode()).hexdigest()


def register_class(cls: type, base: type) -> str:
    """A name for a scorer class (a subclass of `base`, `retention.scorers.Scorer`) given as an object
    (`retention.api`): its importable `module:qualname` spec when importing that gives this very class,
    else the same text registered for this process only (a class defined in a notebook); its identity
    hashes its source either way."""
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise RetentionError(f"{cls!r} is not a {_base_name(base, 'scorer')} subclass")
    name = f"{cls.__module__}:{cls.__qualname__}"
    try:
        found = load_plugin(name, base)
    except RetentionError:
        found = None
    if found is not cls:
        _loaded[name] = cls
    return name


def stable_identity(identity: dict) -> dict:
    """A plugin identity without the keys that change with its code (for the run id)."""
    return {k: v for k, v in identity.items() if k not in VOLATILE_KEYS}


def differing_keys(a, b, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON-like objects (nested dicts compared key by key)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            sub = f"{prefix}.{key}" if prefix else str(key)
            if key not in a or key not in b:
                out.append(sub)
            else:
                out += differing_keys(a[key], b[key], sub)
        code = f"{prefix}.code_sha256" if prefix else "code_sha256"
        if code in out and any(k.startswith(code.replace("code_sha256", "sources_sha256")) for k in out):
            out.remove(code)  # derived from the sources: the files that differ say more
        return out
    return [] if a == b and type(a) is type(b) else [prefix or "(value)"]


def check_registered(registered, current, family: str = "scorer") -> None:
    """Refuse a plugin (of `family`) whose identity differs from the one registered in a plan or run,
    naming what changed."""
    if isinstance(registered, dict) and isinstance(current, dict) and "code_sha256" not in registered:
        current = {k: v for k, v in current.items() if k != "code_sha256"}  # registered before the key
    if registered is None or registered == current:
        return
    keys = differing_keys({f"{family}_plugin": registered}, {f"{family}_plugin": current})
    raise RetentionError(f"the {family} plugin changed since it was registered ({', '.join(keys)} differ); "
                         "register the new code as a new plan or run it in a new --out")


def refuse_other_code(run_dir: Path, config: dict) -> None:
    """A new run of a scorer plugin next to a run of the same plugin from other code is refused:
    a changed plugin's code can change more than its identity (its default sink, say, and so the
    run id), and one results folder must not mix two versions of one mechanism."""
    plugin = config.get("scorer_plugin")
    if not isinstance(plugin, dict):
        return
    for other in sorted(run_dir.parent.glob("*/config.json")):
        if other.parent == run_dir:
            continue
        try:
            theirs = load_json_object(other, "run configuration").get("config", {}).get("scorer_plugin")
        except Exception:  # noqa: BLE001 - an unreadable neighbour is not this run's business
            continue
        if isinstance(theirs, dict) and theirs.get("spec") == plugin.get("spec") and theirs != plugin:
            keys = differing_keys({"scorer_plugin": theirs}, {"scorer_plugin": plugin})
            raise RetentionError(f"{other.parent} holds a run of scorer plugin {plugin.get('spec')!r} from other "
                                 f"code ({', '.join(keys)} differ); run the changed plugin in a new --out")
