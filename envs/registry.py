"""Domain registry: `make(name, **kwargs) -> Environment`, `names()`, `check_kwargs(name, kwargs)`.

Domains register lazily by module path, so importing the registry loads no domain (workers load only
the domains they serve) and nothing here imports JAX.

Environment options come from the main job's config, `rl.env.<domain>.<kwarg>`, and are passed to that
domain's constructor in every worker and in the main process. `check_kwargs` checks them against the
constructor's signature without making the environment and returns them as plain values (ConfigDicts as
dicts, tuples as lists, paths as strings: what `config.json` reads back, and cheap to send to workers).
A keyword annotated with a dataclass type (`limits: sandbox.Limits | None`) takes a dict of that dataclass's
fields in the config; `make` turns such a dict into the dataclass.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

from envs.base import Environment

# name -> "module:Class"; the built-in domains, imported only when made.
_DOMAINS: dict[str, str] = {
    "math": "envs.domains.math_env:MathEnvironment",
    "code": "envs.domains.code_env:CodeEnvironment",
    "terminal": "envs.domains.terminal_env:TerminalEnvironment",
    "scene3d": "envs.domains.scene3d:Scene3DEnvironment",
    "finance": "envs.domains.finance:FinanceEnvironment",
    "arith": "envs.domains.arith:ArithEnvironment",  # toy sizes for the CPU demo
    "strings": "envs.domains.strings:StringsEnvironment",  # toy sizes for the CPU demo
    "debug": "envs.domains.debug:DebugEnvironment",  # sleeps / crashes / errors on request: pool tests
}


def register(name: str, target: str) -> None:
    """Registers `target` ("package.module:ClassName") under `name`; re-registering replaces it."""
    if ":" not in target:
        raise ValueError(f"register({name!r}, {target!r}): target must look like 'package.module:ClassName'")
    _DOMAINS[name] = target


def names() -> list[str]:
    return sorted(_DOMAINS)


def environment_class(name: str) -> type:
    """The class registered under `name`, imported but not instantiated (KeyError for an unknown name)."""
    if name not in _DOMAINS:
        raise KeyError(f"unknown environment {name!r}; registered: {names()}")
    module, cls = _DOMAINS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make(name: str, **kwargs) -> Environment:
    """Makes environment `name`; a dict given for a dataclass-typed keyword becomes that dataclass."""
    cls = environment_class(name)
    records = _record_types(cls)
    kwargs = {k: _record(records[k], v, k) if k in records else v for k, v in kwargs.items()}
    env = cls(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"{_DOMAINS[name]} is not an envs.Environment")
    return env


def check_kwargs(name: str, kwargs: Mapping[str, Any], *, where: str = "rl.env") -> dict[str, Any]:
    """`kwargs` for domain `name`'s constructor, checked against its signature (the environment is not made)
    and returned as plain values (see the module docstring). Raises ValueError naming `<where>.<name>.<kwarg>`
    for an unknown domain, an unknown keyword, a missing required one, or an unknown dataclass field."""
    if name not in _DOMAINS:
        raise ValueError(f"{where}.{name}: unknown domain {name!r}; registered: {names()}")
    cls = environment_class(name)
    plain = _plain(kwargs)
    if not isinstance(plain, dict):
        raise ValueError(f"{where}.{name}: expected keyword -> value, got {type(kwargs).__name__}")
    params = list(inspect.signature(cls).parameters.values())
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
        raise ValueError(f"{where}.{name}: domain {name!r} needs keywords {missing}")
    for key, record in _record_types(cls).items():
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


def _record_types(cls: type) -> dict[str, type]:
    """Constructor keywords annotated with one dataclass type (optionally `| None`): keyword -> dataclass."""
    try:
        hints = typing.get_type_hints(cls.__init__)
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
