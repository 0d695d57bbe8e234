"""No reference leaves the repository: no tracked file names a machine's absolute path,
and nothing points at what happens to sit beside a checkout.

Every tracked text file (`git ls-files`; binary files are skipped, and of a notebook only its cells' sources
are read, never its outputs) is checked for:
  absolute      a path under the filesystem root's work, home or root folders (`ABSOLUTE`: the pattern the
                project's before-stop hook checks);
  temporary     a quoted `/tmp/<name>` in benchmarks/results/ and README.md (results and the README's
                examples name paths a reader can use; code and tests create their own temporary files);
  outside       a path up out of the checkout to the folders beside it (`..` then `/shared`, `/venv*`,
                `/peers`, `/seeds`, `/hooks`, `/DESIGN.md`, `/STYLE.md`) and the `os.path.join` form that
                climbs two levels (".." twice) from a module of a top-level package. A flag documented with a
                placeholder (`--peer_script=PATH`) is not a default and passes.
Nothing is excluded: a line that must name such a path takes a flag or a placeholder instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABSOLUTE = re.compile(r"(^|[^A-Za-z0-9_.])/(work|home|root)/")
TEMPORARY = re.compile(r"\"/tmp/[A-Za-z0-9_.-]+")
TEMPORARY_IN = ("benchmarks/results/", "README.md")
OUTSIDE = re.compile(
    r"\.\./(\.\./)*(shared|venv|peers|seeds|hooks|DESIGN\.md|STYLE\.md)"
    r"|[\"']\.\.[\"']\s*,\s*[\"']\.\.[\"']"
)


def _lines(path: str, text: str) -> list[str]:
    """The lines of `text` to check: a notebook's cell sources only (its outputs echo a machine)."""
    if not path.endswith(".ipynb"):
        return text.splitlines()
    cells = json.loads(text).get("cells", [])
    return [line for cell in cells for line in "".join(cell.get("source", "")).splitlines()]


def findings(path: str, text: str) -> list[str]:
    """`path:line: kind: the line` for every offending line of `text`, the contents of tracked file `path`
    (relative to the repository root)."""
    checks = [("absolute path", ABSOLUTE), ("outside the repository", OUTSIDE)]
    if path.startswith(TEMPORARY_IN):
        checks.append(("temporary path", TEMPORARY))
    out = []
    for number, line in enumerate(_lines(path, text), 1):
        for kind, pattern in checks:
            if pattern.search(line):
                out.append(f"{path}:{number}: {kind}: {line.strip()[:160]}")
    return out


def tracked_texts():
    """(path, text) of every tracked file present in the working tree that is text (no NUL byte, UTF-8)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for path in sorted(p for p in listed.decode().split("\0") if p):
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):  # deleted in the working tree, not yet committed
            continue
        with open(full, "rb") as f:
            data = f.read()
        if b"\0" in data:
            continue
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def test_tracked_files_name_nothing_outside_the_repository():
    checked, bad = 0, []
    for path, text in tracked_texts():
        checked += 1
        bad += findings(path, text)
    assert checked > 100, f"only {checked} tracked text files read: is this a git checkout?"
    assert not bad, "paths outside the repository (take a flag, or write a placeholder):\n" + "\n".join(bad)


# The planted lines are assembled from pieces so that this file itself holds none of them.
DOTS, TMP = "." * 2, '"/' + "tmp/"


@pytest.mark.parametrize(
    "path, line",
    [
        ("benchmarks/x.py", f'PEER = os.path.join(HERE, "{DOTS}", "{DOTS}", "shared", "peers", "x.py")'),
        ("benchmarks/decode.py", f'p.add_argument("--hf_python", default="{DOTS}/venv-hf/bin/python")'),
        (
            "benchmarks/decode.py",
            f"    python benchmarks/decode.py --tunix_python={DOTS}/{DOTS}/venv-tunix/bin/python",
        ),
        ("rl/train.py", f'The main job, one step as in {DOTS}/DESIGN.md ("One GRPO step, as data").'),
        ("README.md", f"peer scripts ({DOTS}/shared/peers/)"),
        ("benchmarks/results/curriculum.jsonl", '{"bench": "curriculum", "workdir": ' + TMP + 'demo19"}'),
        ("README.md", "hf.save(cfg, params, " + TMP + 'export")'),
        ("configs/x.py", 'RUNS = "/' + 'work/main/runs"'),
        ("rl/x.py", 'CKPT = "/' + 'home/alice/ckpt"'),
        ("tests/x.py", "cache = /" + "root/.cache/jax"),
        ("notebooks/x.ipynb", json.dumps({"cells": [{"source": ["!cd /" + "work/main\n", "x = 1"]}]})),
    ],
)
def test_checker_flags_a_planted_line(path, line):
    assert findings(path, line), line


@pytest.mark.parametrize(
    "path, line",
    [
        ("benchmarks/decode.py", "    python benchmarks/decode.py --sections=peer --peer_script=PATH"),
        ("benchmarks/grpo_step.py", "--tunix_python=TUNIX_VENV/bin/python --peer_script=PEERS/x.py"),
        ("benchmarks/results/grpo_step.jsonl", '{"command": "--tunix_python=<tunix-venv>/bin/python"}'),
        ("benchmarks/results/learning.jsonl", '{"out": "<outside>/sum.jsonl"}'),
        ("envs/qa/probes.py", "for _path in (" + TMP + '" + _TOKEN, "/var/tmp/" + _TOKEN):'),
        ("tests/envs/test_sandbox.py", f'sb.write("{DOTS}/escaped", "x")'),
        (
            "benchmarks/sandbox_memory.py",
            f'sys.path.insert(0, os.path.join(os.path.dirname(HERE), "{DOTS}"))',
        ),
        ("README.md", "python -m rl.train --workdir=runs/tiny"),
        (
            "notebooks/x.ipynb",
            json.dumps({"cells": [{"source": ["x = 1"], "outputs": [{"text": "/" + "root/x"}]}]}),
        ),
    ],
)
def test_checker_passes_a_fine_line(path, line):
    assert not findings(path, line), line
