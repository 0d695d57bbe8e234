"""python -m rl.sft --config=configs/grpo.py:test --workdir=runs/test

The main job's SFT warm start alone (`rl.train.train(..., sft_only=True)`): `cfg.rl.sft.steps` steps on tasks
of the train split of `cfg.rl.domains` (`rl.warm_start`), saved as the checkpoint of step 0 in
`<workdir>/checkpoints`, which `python -m rl.train` resumes from.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from configs import cli
from configs.errors import UserError
from rl import run, train


def main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {list(argv[1:])}; flags look like --workdir=DIR")
    if not _WORKDIR.value:
        raise UserError("--workdir is required: the run directory (checkpoints, metrics)")
    cli.quiet_console(_WORKDIR.value)
    train.train(cli.with_block_overrides(_CONFIG.value), _WORKDIR.value, sft_only=True)
    return 0


if __name__ == "__main__":
    cli.take_block_overrides(sys.argv)  # before --config: its default is read (and overridden) when defined
    _CONFIG, _WORKDIR = run.define_flags(
        "configs/grpo.py:test", config_help="GRPO config file.", workdir_help="Run directory (checkpoints)."
    )
    cli.run(main)
