"""Mistakes a user makes on the command line come back as one line `error: ...` naming the flag, field or
path and the fix, with exit status 2, from real CLI processes; `--verbosity=1` shows the traceback."""

import os
import socket
import subprocess
import sys

import pytest
import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_all(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Every command at once (each imports JAX for a few seconds), as `python -m ...` from the repo root."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_env.child_flags(1))
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def test_cli_mistakes_are_one_line_with_exit_2(tmp_path):
    run = tmp_path / "run"
    missing = tmp_path / "nothing"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        results = _run_all(
            {
                "typo": [
                    "rl.train",
                    "--config=configs/grpo.py:test",
                    "--config.rl.stpes=3",
                    f"--workdir={run}",
                ],
                "no_file": ["rl.train", "--config=configs/nope.py:test", f"--workdir={run}"],
                "domain": [
                    "rl.train",
                    "--config=configs/grpo.py:test",
                    "--config.rl.domains=('nope',)",
                    f"--workdir={run}",
                ],
                "evaluate": ["rl.evaluate", f"--workdir={missing}"],
                "serve_port": ["inference.serve", "--config=configs/tiny.py", f"--port={port}"],
                "verbose": ["rl.train", "--config=configs/nope.py:test", f"--workdir={run}", "--verbosity=1"],
            }
        )
    expected = {
        "typo": "error: --config.rl.stpes: rl has no field 'stpes'; did you mean --config.rl.steps?",
        "no_file": "error: --config=configs/nope.py:test: the config did not load: [Errno 2] No such file",
        "domain": "error: rl.domains=('nope',) names 'nope'",
        "evaluate": f"error: --workdir={missing} is not a run of rl.train",
        "serve_port": f"error: --host=127.0.0.1 --port={port} cannot be bound",
    }
    for name, start in expected.items():
        r = results[name]
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and lines and lines[-1].startswith(start), (
            name,
            r.returncode,
            r.stderr[-2000:],
        )
        assert "Traceback" not in r.stderr, (name, r.stderr[-2000:])
    assert not run.exists()  # a refused run leaves nothing on disk
    verbose = results["verbose"]
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr


def test_override_errors_name_the_flag_and_keep_the_suggestion():
    """ml_collections' refusals as config_flags raises them: an AttributeError around a KeyError whose text
    carries 'Did you mean', or a bare KeyError (no close name)."""
    from configs import cli

    argv = ["x", "--config=configs/grpo.py:test", "--config.rl.lora.rank=8", "--config.rl.stpes=3"]
    bare = KeyError("'lora'")
    assert cli._override_error(bare, argv) == (
        "--config.rl.lora.rank: rl has no field 'lora' (python -m configs.fields lists them)"
    )
    suggested = AttributeError(KeyError('\'stpes\'\nDid you mean "steps" instead of "stpes"?'))
    assert cli._override_error(suggested, argv).startswith(
        "--config.rl.stpes: rl has no field 'stpes'; did you mean --config.rl.steps?"
    )
    assert cli._override_error(KeyError("'other'"), argv) is None  # not an override's key: not ours to word


@pytest.mark.parametrize(
    "argv, level",
    [(["x"], 0), (["x", "--verbosity=1"], 1), (["x", "-v", "2"], 2), (["x", "--v=-1"], -1)],
)
def test_verbosity_is_read_before_absl(argv, level):
    from configs import cli

    assert cli.verbosity(argv) == level
