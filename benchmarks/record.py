"""What the benchmarks write into their committed JSON lines besides figures: paths a reader can use.

A result names a run directory or an output file only as a path relative to the repository root; a path
outside the repository (a temporary directory, a home directory) names a machine, not a result, and is
written as `<outside>/` plus its last component (tests/test_repo_paths.py checks the committed results).
"""

from __future__ import annotations

import os

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
