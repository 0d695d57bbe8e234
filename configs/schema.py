"""Config fields: each one's type and allowed values, next to its default and its comment.

A table maps a dotted name to a `Field` (the tables themselves are in `configs/fields.py`). `build(table)`
gives the block's ConfigDict of defaults; `check(node, table, prefix)` raises a `ConfigError` naming the
first field of the wrong type, out of range, or unknown (a typo in a config file); `Field.describe()` says
what a field allows, in words (the README's field list). Rules that tie fields together (a divisor of the
batch, a domain named in two places) stay with the code that needs them (`model/config.py`,
`rl/validate.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import ml_collections

from configs.errors import UserError

KINDS = ("int", "float", "bool", "str", "choice", "registered", "names", "ints", "block")


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class Field:
    default: Any
    doc: str
    kind: str
    lo: float | None = None  # int / float / ints: smallest allowed value
    hi: float | None = None  # int / float: largest allowed value
    lo_open: bool = False  # float: lo itself not allowed
    hi_open: bool = False
    inf_ok: bool = False  # float: +inf allowed (e.g. "no limit")
    choices: tuple = ()  # choice / names: the allowed values; registered: the built-in names
    registry: str = ""  # registered: where names are registered (checked there by rl.validate)
    value: Field | None = None  # block: the field of every entry (keys are free, e.g. domain names)
    of: Mapping[str, Field] | None = None  # block: partial overrides of another table's fields

    def allowed(self) -> tuple:
        return tuple(self.choices)

    def describe(self) -> str:
        """The allowed values in words: 'int >= 1', 'float in (0, 1]', "one of 'a', 'b'"."""
        if self.kind in ("int", "float", "ints"):
            name = {"int": "int", "float": "float", "ints": "tuple of ints"}[self.kind]
            words = f"{name} {self._range()}".strip()
            return words + " or inf" if self.inf_ok else words
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.allowed())
        if self.kind == "registered":
            return (
                f"a name registered in {self.registry}: "
                + ", ".join(repr(c) for c in self.allowed())
                + ", ..."
            )
        if self.kind == "names":
            return "distinct names from " + ", ".join(repr(c) for c in self.allowed())
        if self.kind == "block":
            if self.of is not None:
                return "partial block of those fields"
            return f"mapping to {self.value.describe()}" if self.value else "mapping"
        return self.kind

    def _range(self) -> str:
        """'>= 0', 'in (0, 1]', '' (unbounded)."""
        if self.lo is not None and self.hi is not None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"in {left}{_num(self.lo)}, {_num(self.hi)}{right}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        return ""

    def check(self, path: str, v: Any) -> None:
        """Raises ConfigError('path=value must be ...') unless `v` is allowed."""
        if self.kind == "bool":
            if not isinstance(v, bool):
                raise ConfigError(f"{path}={v!r} must be True or False")
        elif self.kind in ("int", "float"):
            finite = _is_num(v) and (math.isfinite(v) or (self.inf_ok and v == math.inf))
            if not (_is_int(v) if self.kind == "int" else finite):
                raise ConfigError(
                    f"{path}={v!r} must be {'an int' if self.kind == 'int' else 'a finite number'}"
                )
            if not self._in_range(v):
                raise ConfigError(f"{path}={v!r} must be {self._range()}")
        elif self.kind == "str":
            if not isinstance(v, str):
                raise ConfigError(f"{path}={v!r} must be a string")
        elif self.kind == "registered":
            if not isinstance(v, str) or not v:
                raise ConfigError(f"{path}={v!r} must be a name registered in {self.registry}")
        elif self.kind == "choice":
            allowed = self.allowed()
            if v not in allowed or not isinstance(v, type(allowed[0])):
                raise ConfigError(f"{path}={v!r} is unknown; choose one of {list(allowed)}")
        elif self.kind == "names":
            allowed = self.allowed()
            if not isinstance(v, (tuple, list)) or not v or len(set(v)) != len(v):
                raise ConfigError(
                    f"{path}={v!r} must be a non-empty tuple of distinct names from {list(allowed)}"
                )
            for name in v:
                if name not in allowed:
                    raise ConfigError(
                        f"{path}={tuple(v)!r} names {name!r}, which is unknown; known: {list(allowed)}"
                    )
        elif self.kind == "ints":
            ok = isinstance(v, (tuple, list)) and v and all(_is_int(x) and self._in_range(x) for x in v)
            if not ok:
                raise ConfigError(f"{path}={v!r} must be a non-empty tuple of ints {self._range()}")
        elif self.kind == "block":
            if not isinstance(v, (Mapping, ml_collections.ConfigDict)):
                raise ConfigError(f"{path}={v!r} must be a block of fields (a ConfigDict)")
            if self.of is not None:
                check(v, self.of, path, partial=True)
            elif self.value is not None:
                for key in v:
                    self.value.check(f"{path}.{key}", v[key])
        else:
            raise AssertionError(self.kind)

    def _in_range(self, v) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def Int(default: int, doc: str, lo: int | None = None, hi: int | None = None) -> Field:
    return Field(default, doc, "int", lo=lo, hi=hi)


def Float(default: float, doc: str, lo=None, hi=None, *, lo_open=False, hi_open=False, inf_ok=False) -> Field:
    return Field(float(default), doc, "float", lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, inf_ok=inf_ok)


def Bool(default: bool, doc: str) -> Field:
    return Field(default, doc, "bool")


def Text(default: str, doc: str) -> Field:
    return Field(default, doc, "str")


def Choice(default, doc: str, choices: tuple) -> Field:
    return Field(default, doc, "choice", choices=choices)


def Registered(default: str, doc: str, builtin: tuple, registry: str) -> Field:
    """A name looked up in a registry at run time (`rl.validate.check_registries`): `builtin` are the names
    the package registers itself; a name registered by the user's code before the run is allowed too."""
    return Field(default, doc, "registered", choices=builtin, registry=registry)


def Names(default: tuple, doc: str, choices: tuple) -> Field:
    return Field(tuple(default), doc, "names", choices=choices)


def Ints(doc: str, lo: int = 0) -> Field:
    """A block's entry: a non-empty tuple of ints >= lo (e.g. a domain's difficulty levels)."""
    return Field((), doc, "ints", lo=lo)


def Block(doc: str, default: Mapping | None = None, *, value: Field | None = None, of=None) -> Field:
    """A block of free keys: every entry checked by `value`, or partial overrides of table `of`."""
    return Field(dict(default or {}), doc, "block", value=value, of=of)


def set_path(root: ml_collections.ConfigDict, dotted: str, value) -> None:
    """Sets `root.<dotted>` to `value`, making the missing blocks on the way; ValueError if a node on the
    way is not a ConfigDict, ml_collections' TypeError if the field exists with a value of another type."""
    *parents, leaf = dotted.split(".")
    node = root
    for i, key in enumerate(parents):
        if key not in node:
            node[key] = ml_collections.ConfigDict()
        node = node[key]
        if not isinstance(node, ml_collections.ConfigDict):
            raise ValueError(f"{'.'.join(parents[: i + 1])} is {node!r}, not a block of keys")
    node[leaf] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value


def build(table: Mapping[str, Field]) -> ml_collections.ConfigDict:
    """The ConfigDict of a table's defaults (dotted names make nested blocks)."""
    root = ml_collections.ConfigDict()
    for name, f in table.items():
        set_path(root, name, f.default)
    return root


def check(node, table: Mapping[str, Field], prefix: str, *, partial: bool = False) -> None:
    """Checks every field of `node` against `table`; unknown fields are refused. `partial`: fields may be
    missing (overrides)."""
    seen = set()
    for name, value in _leaves(node, table):
        path = f"{prefix}.{name}"
        if name not in table:
            known = sorted(n for n in table if n.rsplit(".", 1)[0] == name.rsplit(".", 1)[0] or "." not in n)
            raise ConfigError(f"{path} is not a field of {prefix}; known fields: {known}")
        table[name].check(path, value)
        seen.add(name)
    if not partial:
        missing = sorted(set(table) - seen)
        if missing:
            raise ConfigError(f"{prefix}.{missing[0]} is missing; start from the config file's get_config()")


def _leaves(node, table, parent: str = ""):
    """(dotted name, value) of every field: a sub-block is descended unless the table names it as a block."""
    for key in node:
        name = f"{parent}{key}"
        value = node[key]
        is_block = isinstance(value, (Mapping, ml_collections.ConfigDict))
        if is_block and not (name in table and table[name].kind == "block"):
            yield from _leaves(value, table, name + ".")
        else:
            yield name, value


def write_between(path: str, begin: str, end: str, body: str) -> None:
    """Replaces what lies between the `begin` and `end` marker lines of `path` (a README) with `body`."""
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{begin}\n{body}{end}{tail}")
