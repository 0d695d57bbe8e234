"""A run's saved config: `rl.train` writes `<workdir>/config.json` when a run starts; the CLIs that read a
run (`rl.evaluate`, `rl.export`, `inference.serve --workdir`) take its config from there."""

from __future__ import annotations

import json
import os

import ml_collections

from configs.errors import UserError

CONFIG_FILE = "config.json"


def read_config(workdir: str) -> ml_collections.ConfigDict:
    """The config `rl.train` saved in `<workdir>/config.json`, as an ml_collections ConfigDict."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise UserError(
            f"--workdir={workdir} is not a run of rl.train ({path} not found: rl.train writes it when a run "
            "starts); point --workdir at a run directory"
        )
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))
