"""Domain registry: `make(name, **kwargs) -> Environment`, `names()`.

Domains register lazily by module path, so importing the registry loads no domain (workers load only
the domains they serve) and nothing here imports JAX.
"""

from __future__ import annotations

import importlib

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


def make(name: str, **kwargs) -> Environment:
    if name not in _DOMAINS:
        raise KeyError(f"unknown environment {name!r}; registered: {names()}")
    module, cls = _DOMAINS[name].split(":")
    env = getattr(importlib.import_module(module), cls)(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"{_DOMAINS[name]} is not an envs.Environment")
    return env
