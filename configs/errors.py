"""Errors a user causes and can fix, and the optional dependencies (extras) that a feature needs.

A `UserError` is a mistake in a config value, a path, a flag or the installed extras: every CLI prints it as
one line `error: <message>` and exits 2 (`configs.cli.run`); the traceback only with `--verbosity=1`.
Its message names what is wrong (the field, flag or path) and how to fix it. Anything else that escapes a
CLI is a bug and keeps its traceback.

JAX-free and dependency-free: `envs` (whose workers never import JAX) raises these too.
"""

from __future__ import annotations

import importlib
import types

# module -> the pyproject extra that installs it (`pip install -e '.[<extra>]'`).
EXTRAS = {
    "safetensors": "hf",
    "tokenizers": "hf",
    "jinja2": "hf",
    "tiktoken": "hf",
    "huggingface_hub": "hf",
    "tensorboardX": "tensorboard",
    "fastapi": "serve",
    "uvicorn": "serve",
    "matplotlib": "plot",
}


class UserError(Exception):
    """A mistake the user can fix; the message names what and how."""


class MissingExtra(UserError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def install_hint(extra: str) -> str:
    return f"pip install -e '.[{extra}]'"


def require(module: str, purpose: str) -> types.ModuleType:
    """Imports `module`, or raises `MissingExtra` naming `purpose` and the extra (EXTRAS) that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        extra = EXTRAS.get(top)
        hint = f"install it with {install_hint(extra)}" if extra else f"pip install {top}"
        raise MissingExtra(
            f"{purpose} needs the Python package {top!r}, which is not installed; {hint}"
        ) from e
