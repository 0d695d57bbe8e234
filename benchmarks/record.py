"""The one record every benchmark writes: JSON lines, each a header (the command, the commit, the machine,
the load average and the date) and the benchmark's own fields, printed and, with `out`, appended to a file.

    record.emit({"bench": "decode_cache", "speedup": 12.5}, out=args.out)

A result names a run directory or an output file only as a path relative to the repository root; a path
outside the repository (a temporary directory, a home directory) names a machine, not a result, and is
written as `<outside>/` plus its last component (tests/test_repo_paths.py checks the committed results).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def portable(path: str) -> str:
    """`path` relative to the repository root when it lies inside it, else `<outside>/<last component>`;
    "" stays ""."""
    if not path:
        return path
    full = os.path.abspath(path)
    if full == ROOT or full.startswith(ROOT + os.sep):
        return os.path.relpath(full, ROOT)
    return "<outside>/" + os.path.basename(full.rstrip(os.sep))


def portable_list(paths: str) -> str:
    """A comma-separated list of paths, each `portable`."""
    return ",".join(portable(p) for p in paths.split(",") if p)


def command(argv: list[str] | None = None) -> str:
    """The command that ran this process, as a reader would type it again from the repository root:
    `python -m benchmarks NAME FLAGS` (the runner puts `python -m benchmarks NAME` in argv[0]; a benchmark run
    as a script gets the same form), with absolute paths in the flags `portable`."""
    argv = sys.argv if argv is None else argv
    head = argv[0]
    if head.endswith(".py"):
        head = "python -m benchmarks " + os.path.basename(head)[: -len(".py")]
    flags = []
    for arg in argv[1:]:
        key, eq, value = arg.partition("=")
        if eq and value.startswith("/"):
            arg = f"{key}={portable(value)}"
        elif arg.startswith("/"):
            arg = portable(arg)
        flags.append(arg)
    return " ".join([head, *flags])


@functools.cache
def commit() -> str:
    """The checked-out commit, `+dirty` when tracked files differ from it; "unknown" outside a checkout."""
    try:
        run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, check=True)
        head = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


@functools.cache
def machine() -> str:
    """The CPU model, its core count and the OS; with JAX imported, the kind and count of its devices."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    parts = [cpu, f"{os.cpu_count()} cores", f"{platform.system()} {platform.release()}"]
    jax = sys.modules.get("jax")  # only a benchmark that imported JAX has devices to name
    if jax is not None:
        with contextlib.suppress(RuntimeError):
            parts.append(f"{jax.devices()[0].device_kind} x{jax.device_count()}")
    return ", ".join(parts)


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def header() -> dict:
    """The fields every result line starts with."""
    return {
        "command": command(),
        "commit": commit(),
        "machine": machine(),
        "load": loadavg(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def emit(fields: dict, out: str | None = None, **dumps) -> dict:
    """Prints one result line (the header, then `fields`) and appends it to `out` when given; the line.
    `dumps` goes to json.dumps (e.g. `default=str`)."""
    head = header()
    taken = sorted(head.keys() & fields.keys())
    if taken:
        raise ValueError(f"result fields {taken} are the header's: name them for what they measure")
    line = {**head, **fields}
    text = json.dumps(line, **dumps)
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
    return line
