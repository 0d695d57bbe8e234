"""The main job as a child process, as the CLI tests run it: the test config, no held-out evaluation."""

import sys


def command(workdir) -> list[str]:
    """`python -m rl.train` on configs/grpo.py:test in `workdir` without the evaluations; add flags after."""
    return [
        sys.executable,
        "-m",
        "rl.train",
        "--config=configs/grpo.py:test",
        f"--workdir={workdir}",
        "--eval=false",
    ]
