"""A run directory and what is in it: the config rl.train ran with, the checkpointed tree, restore, the flags
every run CLI shares, and what a signal does to a running job.

  <workdir>/config.json        the run's config (`configs.runs.read_config`)
  <workdir>/checkpoints/<step> orbax items `state` (the tree of `pack`) and `meta` (`rl.checkpoint`)
  <workdir>/eval_*.json        the held-out evaluations (`read_json`)

The checkpointed tree is the train state alone, or {"train": state, "reference": weights, "draft": state}
when the run keeps a frozen KL reference (rl.loss.kl_kind) or a draft model (rl.engine.draft="model").
`inference.serve.load` reads the weights of the same tree without importing rl.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import ml_collections

from configs.errors import UserError
from rl import checkpoint, train_state, validate


class Preempted(Exception):
    """Raised by the signal handler while an evaluation runs: there is nothing to save mid-evaluation."""


class Phase:
    """What a signal does now: in an evaluation it raises `Preempted` (nothing to save there); elsewhere the
    preemption handle's flag is read at the next step boundary."""

    def __init__(self, say=None):
        self._interruptible = False
        self._say = say

    def on_signal(self, signum: int) -> None:
        if self._say is not None:
            self._say(
                f"{signal.Signals(signum).name}: saving at the next step boundary "
                "(again: quit without saving)"
            )
        if self._interruptible:
            raise Preempted(signum)

    def interruptible(self):
        phase = self

        class _Scope:
            def __enter__(self):
                phase._interruptible = True

            def __exit__(self, *exc):
                phase._interruptible = False

        return _Scope()


def define_flags(config_default: str | None, *, config_help: str, workdir_help: str):
    """(--config, --workdir) flag holders; each run CLI calls this in its own `__main__` (no CLI imports
    another to share them)."""
    from absl import flags
    from ml_collections import config_flags

    config = config_flags.DEFINE_config_file("config", config_default, config_help)
    workdir = flags.DEFINE_string("workdir", None, workdir_help)
    return config, workdir


def sft_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`cfg` with the SFT optimizer (rl.sft.optim over rl.optim)."""
    out = ml_collections.ConfigDict(cfg.to_dict())
    out.rl.optim.update(dict(cfg.rl.sft.optim))
    return out


def sft_state(cfg, seed: int, *, params=None, model_state=None, mesh=None):
    """(model def, train state) with the SFT optimizer."""
    return train_state.init_state(
        sft_config(cfg), mesh=mesh, seed=seed, params=params, model_state=model_state
    )


def pack(state, ref_params, draft_state):
    """The checkpointed tree: the train state alone, or with the reference and the draft state."""
    if ref_params is None and draft_state is None:
        return state
    tree = {"train": state}
    if ref_params is not None:
        tree["reference"] = ref_params
    if draft_state is not None:
        tree["draft"] = draft_state
    return tree


def unpack(tree):
    """(train state, reference weights or None, draft state or None) of a checkpointed tree."""
    if not isinstance(tree, dict):
        return tree, None, None
    return tree["train"], tree.get("reference"), tree.get("draft")


def checkpoint_target(cfg, state, meta: dict):
    """The restore target of a checkpoint with `meta`: the train state, with the reference and the draft
    state when the run keeps them (shapes from `cfg`; values are placeholders)."""
    rl = cfg.rl
    in_sft = meta.get("sft_step", rl.sft.steps) < rl.sft.steps
    draft_state = None
    if rl.engine.draft == "model":
        draft_state = sft_state(validate.draft_model_config(cfg), rl.seed)[1]
    ref = (
        None
        if in_sft or rl.loss.kl_kind == "none"
        else train_state.reference_weights(state, rl.reference_dtype)
    )
    return pack(state, ref, draft_state)


def read_json(workdir: str, name: str):
    """`<workdir>/<name>` parsed, or None when the run has not written it."""
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def restore_state(
    cfg: Any, workdir: str, step: int | None = None, *, mesh: Any = None
) -> tuple[Any, dict[str, Any]]:
    """(train state, meta) of the run in `workdir`: its checkpoint at `step` (default: the latest), restored
    for `cfg`, the run's config (the model config rl.train checkpoints with: a checkpoint of another model
    is refused, by field), on `mesh` (the trainer's, `rl.distributed.trainer_mesh`) or one device.
    `rl.export` writes the state as a Hugging Face checkpoint."""
    _, state = train_state.init_state(cfg, mesh=mesh, seed=cfg.rl.seed)
    ckpt_dir = os.path.abspath(os.path.join(workdir, "checkpoints"))
    ckpt = checkpoint.Checkpointer(ckpt_dir, save_every=1, model_config=cfg.model, mesh=mesh)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise UserError(f"--workdir={workdir} has no checkpoint in {ckpt_dir}: train first (rl.train)")
        if step is not None and step not in steps:
            raise UserError(f"--step={step}: {ckpt_dir} holds checkpoints of steps {sorted(steps)}")
        meta = ckpt.read_meta(step)
        tree, meta = ckpt.restore(step, target_state=checkpoint_target(cfg, state, meta))
    finally:
        ckpt.close()
    return unpack(tree)[0], meta
