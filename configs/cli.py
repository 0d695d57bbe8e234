"""Command-line overrides inside a config's blocks of free keys (`schema.Block`).

ml_collections' `--config.a.b=v` sets a field the loaded config already has. A block (rl.levels,
rl.static_weights, rl.env, rl.draft_model, rl.sft.weights, rl.sft.optim) starts with its defaults only, so
`--config.rl.levels.math='(1, 2)'` or `--config.rl.env.math.train_jsonl=gsm8k.jsonl` would stop absl's flag
parsing with a bare KeyError. A CLI that takes a config therefore calls `take_block_overrides(sys.argv)`
before absl parses the command line (it removes those flags from argv and keeps them), then
`with_block_overrides(cfg)` on the loaded config: the keys and sub-blocks they name are created, each value
read as config_flags reads a literal (a Python literal, `true` / `false`, else the string itself). What the
values may be is checked where every config is checked (`configs.schema.check`), with the field's name.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence

import ml_collections

from configs import schema

_TAKEN: list[tuple[str, str]] = []  # (dotted path under the config, raw value), in command-line order


def block_paths() -> tuple[str, ...]:
    """The dotted paths of every block field of the GRPO config (e.g. "rl.sft.weights")."""
    from configs import grpo

    return tuple(f"rl.{name}" for name, field in grpo.RL.items() if field.kind == "block")


def _inside_block(path: str, blocks: Sequence[str]) -> bool:
    return any(path.startswith(b + ".") for b in blocks)


def config_given(argv: Sequence[str], name: str = "config") -> bool:
    """Whether `argv` names the config file itself (`--NAME=FILE` or `--NAME FILE`)."""
    return any(re.match(rf"^--?{re.escape(name)}(=|$)", arg) for arg in argv[1:])


def take_block_overrides(
    argv: list[str], name: str = "config", *, every: bool = False
) -> list[tuple[str, str]]:
    """Removes `--NAME.<block>.<key...>=VALUE` (or `--NAME.<path> VALUE`) from `argv` in place, for paths
    inside a block (`every`: for every path, e.g. overrides of a run's saved config.json, which no
    config_flags flag holds); returns them (and keeps them for `with_block_overrides`). Other overrides
    stay for config_flags."""
    pattern = re.compile(rf"^--?{re.escape(name)}\.([\w.]+)(?:=(.*))?$", re.S)
    blocks, kept, taken, i = block_paths(), [], [], 0
    while i < len(argv):
        match = pattern.match(argv[i])
        if match and (every or _inside_block(match.group(1), blocks)):
            path, value = match.group(1), match.group(2)
            if value is None:
                if i + 1 >= len(argv):
                    raise SystemExit(f"--{name}.{path} needs a value: --{name}.{path}=VALUE")
                value, i = argv[i + 1], i + 1
            taken.append((path, value))
        else:
            kept.append(argv[i])
        i += 1
    argv[:] = kept
    _TAKEN[:] = taken
    return taken


def taken() -> list[tuple[str, str]]:
    """The overrides the last `take_block_overrides` took."""
    return list(_TAKEN)


def literal(text: str):
    """A command-line value as config_flags reads an untyped one: a Python literal, else the string (the
    rule of ml_collections' private `config_flags._LiteralParser`)."""
    if text in ("true", "false"):
        return text == "true"
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        return text


def with_block_overrides(
    cfg: ml_collections.ConfigDict | None, overrides: Sequence[tuple[str, str]] | None = None
) -> ml_collections.ConfigDict | None:
    """`cfg` with the block overrides set (default: those `take_block_overrides` took), in order."""
    overrides = list(_TAKEN if overrides is None else overrides)
    if not overrides:
        return cfg
    if cfg is None:
        raise SystemExit(
            f"--config.{overrides[0][0]} overrides a config, but no --config was given; pass --config=FILE "
            "with it"
        )
    with cfg.unlocked():
        for path, raw in overrides:
            try:
                schema.set_path(cfg, path, literal(raw))
            except ValueError as e:
                raise SystemExit(f"--config.{path}: config.{e}") from None
            except TypeError as e:  # the key exists with a value of another type
                raise SystemExit(f"--config.{path}={raw}: {e}") from None
    return cfg
