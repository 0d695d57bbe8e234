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
import difflib
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence

import ml_collections

from configs import schema
from configs.errors import UserError
from configs.fields import RL

_TAKEN: list[tuple[str, str]] = []  # (dotted path under the config, raw value), in command-line order


def block_paths() -> tuple[str, ...]:
    """The dotted paths of every block field of the GRPO config (e.g. "rl.sft.weights")."""
    return tuple(f"rl.{name}" for name, field in RL.items() if field.kind == "block")


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
                    exit_with(f"--{name}.{path} needs a value: --{name}.{path}=VALUE")
                value, i = argv[i + 1], i + 1
            taken.append((path, value))
        else:
            kept.append(argv[i])
        i += 1
    argv[:] = kept
    _TAKEN[:] = taken
    return taken


def exit_with(message: str) -> None:
    """A command-line mistake found before absl runs (`take_block_overrides` runs at import): one line,
    exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


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
        raise UserError(
            f"--config.{overrides[0][0]} overrides a config, but no --config was given; pass --config=FILE "
            "with it"
        )
    with cfg.unlocked():
        for path, raw in overrides:
            try:
                schema.set_path(cfg, path, literal(raw))
            except ValueError as e:
                raise UserError(f"--config.{path}: config.{e}") from None
            except TypeError as e:  # the key exists with a value of another type
                raise UserError(f"--config.{path}={raw}: {e}") from None
    return cfg


# ---- One-line errors ---------------------------------------------------------------------------------------

_VERBOSITY = re.compile(r"^--?(?:verbosity|v)(?:=(-?\d+))?$")


def verbosity(argv: Sequence[str]) -> int:
    """The --verbosity (or -v) an argv asks for, read before absl parses it (0 when absent)."""
    for i, arg in enumerate(argv[1:], 1):
        match = _VERBOSITY.match(arg)
        if match:
            value = (
                match.group(1) if match.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
            )
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _override_error(error: Exception, argv: Sequence[str], name: str = "config") -> str | None:
    """One line for ml_collections' refusal of a `--config.<path>=` override (an unknown field, with its
    'did you mean'), naming the flag; None when no override of argv names the missing key."""
    inner: object = error
    while isinstance(inner, BaseException) and inner.args:  # AttributeError(KeyError("'key'\nDid you..."))
        inner = inner.args[0]
    key = str(inner).split("\n")[0].strip("'\" ")
    pattern = re.compile(rf"^--?{re.escape(name)}\.([\w.]+)")
    for arg in argv[1:]:
        match = pattern.match(arg)
        if not match or key not in match.group(1).split("."):
            continue
        path = match.group(1).split(".")
        parent = ".".join(path[: path.index(key)])
        where = parent or "the config"
        suggested = re.search(r'Did you mean "([\w.]+)"', str(inner))
        close = [suggested.group(1)] if suggested else _close_fields(name, path[: path.index(key)], key)
        hint = f"; did you mean --{name}.{parent + '.' if parent else ''}{close[0]}?" if close else ""
        return (
            f"{arg.split('=')[0]}: {where} has no field {key!r}{hint} (python -m configs.fields lists them)"
        )
    return None


def _close_fields(name: str, parent: Sequence[str], key: str) -> list[str]:
    """Fields of the config flag `name` under `parent` spelt like `key` (none when it cannot be read)."""
    from absl import flags

    try:
        node = flags.FLAGS[name].value
        for part in parent:
            node = node[part]
        return difflib.get_close_matches(key, list(node.keys()), n=1)
    except Exception:  # noqa: BLE001 - no suggestion when the config cannot be walked
        return []


def _config_load_error(error: Exception, argv: Sequence[str], name: str) -> str:
    """One line for a config file that did not load: its flag and the reason (the loader's last line)."""
    given = next((a for a in argv[1:] if re.match(rf"^--?{re.escape(name)}=", a)), f"--{name}")
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    reason = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{given}: the config did not load: {reason[-1] if reason else type(cause).__name__}"


class _ParseError(Exception):
    """A command-line mistake found while absl parses the flags (message: one line)."""


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with the mistakes it meets (and the --config file's loading) as `_ParseError`s."""
    from absl import flags

    try:
        args = flags.FLAGS(argv)
    except flags.Error as e:  # an unknown flag, a value of the wrong type, a config file that failed
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        message = lines[0] if "Traceback" not in str(e) else f"{lines[0]} {lines[-1]}"
        raise _ParseError(message.replace("flag --", "--", 1)) from e
    except (AttributeError, KeyError) as e:  # ml_collections: an override of a field that does not exist
        line = _override_error(e, argv)
        if line is None:
            raise
        raise _ParseError(line) from e
    if "config" in flags.FLAGS:  # config files load lazily: a missing or broken one is reported now
        try:
            value = flags.FLAGS["config"].value
            if value is not None:
                value.keys()  # a config that failed to load raises on first use
        except (OSError, ValueError, SyntaxError, ImportError, AttributeError, TypeError) as e:
            raise _ParseError(_config_load_error(e, argv, "config")) from e
    return args


def run(
    main: Callable[[list[str]], int | None],
    *,
    argv: Sequence[str] | None = None,
) -> None:
    """`absl.app.run(main)`, with the mistakes a user can make as one line on stderr and exit status 2:
    a `configs.errors.UserError` (a config value, a path, a checkpoint, a missing extra), an unknown flag or
    config field (ml_collections' 'did you mean' kept), a config file that does not load. Ctrl-C that
    `main` did not handle exits 130. With --verbosity=1 (or more) the traceback is shown instead."""
    from absl import app

    verbose = verbosity(sys.argv if argv is None else argv) >= 1
    try:
        app.run(main, argv=None if argv is None else list(argv), flags_parser=_parse_flags)
    except (UserError, _ParseError) as e:
        if verbose:
            raise
        first, *rest = str(e).splitlines() or [type(e).__name__]
        print(f"error: {first}", *rest, sep="\n  ", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if verbose:
            raise
        print("error: interrupted before anything was saved", file=sys.stderr)
        sys.exit(130)


# ---- Console -----------------------------------------------------------------------------------------------


class _LogFile(logging.FileHandler):
    """A log file whose directory is made at the first record (a refused run leaves no directory behind)."""

    def _open(self):
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        return super()._open()


def quiet_console(log_dir: str | None = None) -> None:
    """Library INFO logs (orbax, absl, JAX) off the console: into `<log_dir>/log.txt` when given (the run
    directory), else nowhere; the console keeps warnings and what the CLI prints. An explicit --verbosity
    keeps them on stderr too."""
    from absl import flags
    from absl import logging as absl_logging

    if log_dir is not None:
        handler = _LogFile(os.path.join(os.path.abspath(log_dir), "log.txt"), delay=True)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
    if not flags.FLAGS["verbosity"].present:
        absl_logging.get_absl_handler().setLevel(logging.WARNING)


def require_or_exit(modules: Sequence[str], purpose: str) -> None:
    """For a CLI module's top, before it imports optional packages: a missing one ends the process with
    one line naming the extra that installs it (exit 2)."""
    from configs.errors import MissingExtra, require

    for module in modules:
        try:
            require(module, purpose)
        except MissingExtra as e:
            exit_with(str(e))


def check_port(host: str, port: int) -> None:
    """Raises UserError when `host:port` cannot be bound (in use, or not this machine's address): a server
    checks before it loads weights, not after."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(
                f"--host={host} --port={port} cannot be bound ({e.strerror}); pick a free --port"
            ) from None
