"""Domain registry: `make(name, **kwargs) -> Environment`, `names()`, `check_kwargs(name, kwargs)`.

A domain name (an entry of `rl.domains`) is one of
  - a built-in name (`math`, `code`, ...: `BUILTIN`) or a name given to `register(name, "module:attr")` in
    this process;
  - the name of an entry point of group `moe_post_train.environments` (`ENTRY_POINT_GROUP`) of an installed
    package: `[project.entry-points."moe_post_train.environments"] countdown = "my_pkg.envs:Countdown"`;
  - an import path "package.module:attr" itself (importable from the job's sys.path: run from the
    directory that holds the package, put it on PYTHONPATH, or install it).
`attr` is an `Environment` subclass or a factory (any other callable) returning an `Environment`; its
keyword arguments are the domain's options (`rl.env.<domain>`).

The name is the domain's name everywhere in a run, as written: task streams, the worker pool, curriculum
weights, metrics (`reward/<name>`), and keys of rl.levels, rl.env, rl.static_weights, rl.sft.weights.
`make(name)` sets `env.name = name`, so tasks built with `domain=self.name` (the default `sample_tasks`
does) carry it. An import path cannot be such a key (ml_collections refuses dots in keys): a domain that
needs options, levels or weights in the config gets a short name from an entry point. An entry point that
takes a built-in's name is an error, never silently one or the other. Workers of an `EnvPool` get the
parent's sys.path and working directory (multiprocessing's spawn preparation) and the parent's
resolution of each name (`target`), so they import exactly what the main process imports.

Domains resolve lazily, so importing the registry loads no domain (workers load only the domains they serve)
and nothing here imports JAX.

Environment options come from the main job's config, `rl.env.<domain>.<kwarg>`, and are passed to that
domain's constructor in every worker and in the main process. `check_kwargs` checks them against the
constructor's signature without making the environment and returns them as plain values (ConfigDicts as
dicts, tuples as lists, paths as strings: what `config.json` reads back, and cheap to send to workers).
A keyword annotated with a dataclass type (`limits: sandbox.Limits | None`) takes a dict of that dataclass's
fields in the config; `make` turns such a dict into the dataclass.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from envs.base import Environment

ENTRY_POINT_GROUP = "moe_post_train.environments"

# name -> "module:Class"; the built-in domains, imported only when made.
BUILTIN: dict[str, str] = {
    "math": "envs.domains.math_env:MathEnvironment",
    "code": "envs.domains.code.env:CodeEnvironment",
    "terminal": "envs.domains.terminal.env:TerminalEnvironment",
    "scene3d": "envs.domains.scene3d:Scene3DEnvironment",
    "finance": "envs.domains.finance.env:FinanceEnvironment",
    "arith": "envs.domains.arith:ArithEnvironment",  # toy sizes for the CPU demo
    "strings": "envs.domains.strings:StringsEnvironment",  # toy sizes for the CPU demo
    "debug": "envs.domains.debug:DebugEnvironment",  # sleeps / crashes / errors on request: pool tests
}
_DOMAINS: dict[str, str] = dict(BUILTIN)  # and what `register` adds

_IDENT = r"[A-Za-z_]\w*"
_IMPORT_PATH = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")
_WHERE_TO_IMPORT = "run from the directory that holds the package, put it on PYTHONPATH, or pip install it"


class DomainError(ValueError):
    """A domain name that does not resolve to an environment; the message says why, in one line. (An
    unknown name is a KeyError, as `make` has always raised.)"""


def reason(error: Exception) -> str:
    """The one-line message of a DomainError or of the KeyError of an unknown name (unquoted)."""
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)


def register(name: str, target: str) -> None:
    """Registers `target` ("package.module:ClassName") under `name`; re-registering replaces it."""
    if ":" not in target:
        raise ValueError(f"register({name!r}, {target!r}): target must look like 'package.module:ClassName'")
    _DOMAINS[name] = target


def names() -> list[str]:
    """The built-in names and those given to `register` (entry points: `installed()`)."""
    return sorted(_DOMAINS)


def is_import_path(name: str) -> bool:
    """Whether `name` reads as "package.module:attr"."""
    return bool(_IMPORT_PATH.match(name))


def installed() -> dict[str, list[str]]:
    """name -> ["module:attr (package)", ...] of the entry points of `ENTRY_POINT_GROUP` in the packages on
    sys.path (imports none of them; more than one entry per name is a clash `target` reports)."""
    return {name: [f"{value} ({dist})" for value, dist in found] for name, found in _entry_points().items()}


def _entry_points() -> dict[str, list[tuple[str, str]]]:
    return _entry_points_on(tuple(sys.path))


@functools.lru_cache(maxsize=8)
def _entry_points_on(path: tuple[str, ...]) -> dict[str, list[tuple[str, str]]]:
    """Entry points of the group on this sys.path (scanning the installed packages takes milliseconds)."""
    out: dict[str, list[tuple[str, str]]] = {}
    seen = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        if (ep.name, ep.value, dist) not in seen:  # a package on sys.path twice is listed twice
            seen.add((ep.name, ep.value, dist))
            out.setdefault(ep.name, []).append((ep.value, dist))
    return out


def target(name: str) -> str:
    """The "module:attr" `name` stands for (see the module docstring), without importing it. Raises
    KeyError for an unknown name, DomainError for an entry point that clashes with a built-in or another
    one."""
    found = _entry_points().get(name, []) if not is_import_path(name) else []
    if name in BUILTIN and found:
        packages = ", ".join(dist for _, dist in found)
        raise DomainError(
            f"domain {name!r} is both built in ({BUILTIN[name]}) and an entry point of group "
            f"{ENTRY_POINT_GROUP!r} in {packages}; rename the entry point in that package"
        )
    if name in _DOMAINS:
        return _DOMAINS[name]
    if len(found) > 1:
        listed = "; ".join(f"{value} ({dist})" for value, dist in found)
        raise DomainError(
            f"domain {name!r} is an entry point of group {ENTRY_POINT_GROUP!r} in several packages "
            f"({listed}); uninstall or rename all but one"
        )
    if found:
        return found[0][0]
    if is_import_path(name):
        return name
    points = sorted(_entry_points())
    raise KeyError(
        f"unknown domain {name!r}; registered: {names()}; entry points of group {ENTRY_POINT_GROUP!r}: "
        f"{points or 'none installed'}; or give an import path 'package.module:Class'"
    )


def resolve(name: str) -> Callable[..., Any]:
    """The class or factory `name` stands for, imported, not called. Raises KeyError for an unknown name
    and DomainError naming the target and the cause: a module that does not import, a missing attribute,
    an object that is neither an `Environment` subclass nor callable."""
    obj = _imported(name)
    path = target(name)
    if isinstance(obj, type):
        if not issubclass(obj, Environment):
            raise DomainError(
                f"{path} is a class that does not subclass envs.Environment; derive it from "
                "envs.Environment (or envs.SingleTurnEnvironment)"
            )
    elif not callable(obj):
        raise DomainError(
            f"{path} is a {type(obj).__name__}, not an envs.Environment subclass or a factory returning one"
        )
    return obj


def _imported(name: str) -> Any:
    """What `target(name)` names, imported (DomainError: the module does not import, no such attribute)."""
    path = target(name)
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of the user's module is the same mistake to report
        first = (str(e).strip().splitlines() or [""])[0]
        fix = _WHERE_TO_IMPORT if isinstance(e, ModuleNotFoundError) else "fix the module"
        raise DomainError(
            f"{path}: module {module_name!r} does not import ({type(e).__name__}: {first}); {fix}"
        ) from None
    module = obj
    for part in attr.split("."):
        if not hasattr(obj, part):
            envs = sorted(
                n
                for n, v in vars(module).items()
                if isinstance(v, type) and issubclass(v, Environment) and v.__module__ == module.__name__
            )
            listed = f" (its environments: {', '.join(envs)})" if envs else ""
            raise DomainError(f"{path}: module {module_name!r} has no attribute {attr!r}{listed}")
        obj = getattr(obj, part)
    return obj


def make(name: str, **kwargs) -> Environment:
    """Makes environment `name` (its `name` attribute set to `name`); a dict given for a dataclass-typed
    keyword becomes that dataclass."""
    obj = resolve(name)
    records = _record_types(obj)
    kwargs = {k: _record(records[k], v, k) if k in records else v for k, v in kwargs.items()}
    env = obj(**kwargs)
    if not isinstance(env, Environment):
        raise DomainError(f"{target(name)} returned a {type(env).__name__}, not an envs.Environment")
    if env.name != name:
        env.name = name
    return env


def check_kwargs(name: str, kwargs: Mapping[str, Any], *, where: str = "rl.env") -> dict[str, Any]:
    """`kwargs` for domain `name`'s constructor, checked against its signature (the environment is not made)
    and returned as plain values (see the module docstring). Raises ValueError naming `<where>.<name>.<kwarg>`
    for an unknown domain, an unknown keyword, a missing required one, or an unknown dataclass field."""
    try:
        obj = _imported(name)  # its signature is the question here; `resolve` checks what it is
    except (KeyError, DomainError) as e:
        raise ValueError(f"{where}.{name}: {reason(e)}") from None
    plain = _plain(kwargs)
    if not isinstance(plain, dict):
        raise ValueError(f"{where}.{name}: expected keyword -> value, got {type(kwargs).__name__}")
    params = list(inspect.signature(obj).parameters.values())
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    accepted = sorted(p.name for p in named)
    for key in plain:
        if key not in accepted and not open_ended:
            raise ValueError(
                f"{where}.{name}.{key}: unknown keyword for domain {name!r}; accepted: {accepted}"
            )
    missing = [p.name for p in named if p.default is p.empty and p.name not in plain]
    if missing:
        hint = (
            "; a domain named by import path takes no options from the config (no key can name it): give "
            f"them defaults, or a short name with an entry point (group {ENTRY_POINT_GROUP!r})"
            if is_import_path(name)
            else ""
        )
        raise ValueError(f"{where}.{name}: domain {name!r} needs keywords {missing}{hint}")
    for key, record in _record_types(obj).items():
        if key in plain:
            _record(record, plain[key], f"{where}.{name}.{key}")
    return plain


def _plain(value: Any) -> Any:
    """ConfigDicts (anything with `to_dict`) and mappings as dicts, tuples as lists, paths as strings."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _record_types(obj: Callable[..., Any]) -> dict[str, type]:
    """Keywords of a class's constructor or a factory annotated with one dataclass type (optionally
    `| None`): keyword -> dataclass."""
    try:
        hints = typing.get_type_hints(obj.__init__ if isinstance(obj, type) else obj)
    except Exception:  # an annotation that does not resolve at runtime: no conversions for this class
        return {}
    out = {}
    for key, hint in hints.items():
        is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        options = typing.get_args(hint) if is_union else (hint,)
        records = [t for t in options if isinstance(t, type) and dataclasses.is_dataclass(t)]
        if len(records) == 1:
            out[key] = records[0]
    return out


def _record(record: type, value: Any, where: str) -> Any:
    """`value` as a `record` dataclass when it is a mapping of its fields; anything else unchanged."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        return value
    fields = sorted(f.name for f in dataclasses.fields(record) if f.init)
    for key in value:
        if key not in fields:
            raise ValueError(f"{where}.{key}: unknown field of {record.__name__}; accepted: {fields}")
    return record(**value)
