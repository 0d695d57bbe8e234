"""The benchmarks' runner and their one results record: `python -m benchmarks` knows every benchmark module,
runs one with its own flags, and every result line starts with the same header."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import __main__ as runner
from benchmarks import record

HELPERS = {"__init__", "__main__", "record", "hosts", "common", "timing"}


def test_every_module_is_a_listed_benchmark_or_a_helper():
    files = os.listdir(os.path.join(record.ROOT, "benchmarks"))
    names = {f[: -len(".py")] for f in files if f.endswith(".py")}
    assert names - HELPERS == set(runner.BENCHMARKS)


def test_runner_lists_and_runs_a_benchmark_with_its_flags():
    def run(*argv):
        command = [sys.executable, "-m", "benchmarks", *argv]
        return subprocess.run(command, cwd=record.ROOT, capture_output=True, text=True, timeout=120)

    listing = run()
    assert listing.returncode == 0 and all(name in listing.stdout for name in runner.BENCHMARKS)
    usage = run("curriculum", "--help")
    assert usage.returncode == 0 and "--workdir" in usage.stdout
    unknown = run("no_such_benchmark")
    assert unknown.returncode == 2 and "no_such_benchmark" in unknown.stderr


def test_emit_writes_the_header_then_the_fields(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m benchmarks x", "--out=/elsewhere/out.jsonl", "--n=2"])
    out = tmp_path / "out.jsonl"
    line = record.emit({"bench": "x", "figure": 1.5}, out=str(out))
    assert list(line)[:5] == ["command", "commit", "machine", "load", "date"]
    assert line["command"] == "python -m benchmarks x --out=<outside>/out.jsonl --n=2"
    assert line["bench"] == "x" and line["figure"] == 1.5 and len(line["load"]) == 3
    assert json.loads(capsys.readouterr().out) == line == json.loads(out.read_text())


def test_a_field_named_like_the_header_is_refused():
    with pytest.raises(ValueError, match="machine"):
        record.emit({"machine": "v5p-256"})


def test_a_script_path_in_argv_reads_as_the_runner_command():
    assert record.command(["benchmarks/decode.py", "--quick"]) == "python -m benchmarks decode --quick"
