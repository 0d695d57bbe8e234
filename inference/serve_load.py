"""What `inference.serve` serves: a run's checkpoint, a Hugging Face directory or random weights, the mesh
its engines run on (`--mesh`) and the drafter of its fast variant.

With a mesh, `load_hf` reads each parameter straight into the engine's layout
(`inference.engine.weight_shardings`, through `model.hf.load(shardings=...)`): every device's block read once
from its slices of the safetensors, no parameter whole on one device first, and the engines take the
weights as they are (`Loaded.placed`). A run's checkpoint and random weights are made as without a mesh and
moved by the engine.

`load_run` restores a training run as `rl.evaluate` does (`rl.evaluate.load_run_config` and `restore_state`:
the run's config, its latest checkpoint or a given step, the selection biases with the params) and is the
only place `inference` imports `rl`, inside the function: the server of a run needs the run's formats.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from configs.errors import UserError
from inference.drafters import WEIGHTS, MTPDrafter, NgramDrafter
from inference.engine import weight_shardings
from inference.engine_config import EngineConfig
from inference.layout import check_mesh
from model import sharding
from model.tokenizer import Tokenizer, load_tokenizer

DRAFTS = ("auto", "ngram", "mtp", "none")


@dataclasses.dataclass
class Loaded:
    """What the server serves: the model config, its weights (a module or the engine's weight state), the
    tokenizer and the served name. `placed`: the weights are already in the layout of an engine on the
    serve mesh (`Engine(..., placed=True)` takes them without a copy)."""

    cfg: Any
    weights: Any
    tokenizer: Tokenizer
    name: str
    placed: bool = False


def parse_mesh(text: str | None, devices=None) -> jax.sharding.Mesh | None:
    """The engines' mesh of `--mesh` (`expert:2,tensor:2`: axes of `model.sharding.MESH_AXES`, `data` the
    rest unless given) over `devices` (default: this process's), or None for no flag (one device). A value
    that cannot work raises a `UserError` naming the flag."""
    if not text:
        return None
    devices = jax.local_devices() if devices is None else list(devices)
    flag = f"--mesh={text}"
    shape: dict[str, int] = {}
    for item in text.split(","):
        axis, sep, size = (part.strip() for part in item.partition(":"))
        if axis in shape:
            raise UserError(f"{flag}: the axis {axis!r} is given twice")
        if not sep or axis not in sharding.MESH_AXES:
            raise UserError(
                f"{flag}: expected axis:size pairs, e.g. --mesh=expert:2,tensor:2, over the axes "
                f"{', '.join(sharding.MESH_AXES)} ({item.strip()!r} is not one)"
            )
        try:
            shape[axis] = int(size)
        except ValueError:
            raise UserError(f"{flag}: the size of {axis!r} is {size!r}, not an integer") from None
    shape.setdefault("data", -1)
    try:
        mesh = sharding.make_mesh(shape, devices)
        check_mesh(mesh)
    except ValueError as e:
        raise UserError(f"{flag} over {len(devices)} devices: {e}") from None
    return mesh


def load_run(workdir: str, step: int | None = None, *, tokenizer: str | None = None) -> Loaded:
    """A training run's checkpoint (latest, or `step`) with the run's config and tokenizer."""
    from rl import evaluate, train_step

    cfg = evaluate.load_run_config(workdir)
    state, _ = evaluate.restore_state(cfg, workdir, step)
    tok = load_tokenizer(tokenizer or cfg.rl.tokenizer or None, vocab_size=cfg.model.vocab_size)
    return Loaded(cfg, train_step.weights(state), tok, _name(workdir))


def load_hf(
    directory: str,
    *,
    tokenizer: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    engine_cfg: EngineConfig | None = None,
) -> Loaded:
    """A Hugging Face checkpoint directory; its tokenizer unless `tokenizer` names another ("byte": ours).
    With `mesh`: the weights in the layout of an engine of `engine_cfg` on it, read block by block (see the
    module docstring)."""
    from configs.errors import require

    require("safetensors", "--hf_dir (a Hugging Face checkpoint)")
    from model import hf

    if mesh is None:
        cfg, weights = hf.load_model(directory)
    else:
        targets = weight_shardings(hf.read_config(directory), engine_cfg or EngineConfig(), mesh)
        cfg, weights = hf.load(directory, variables=WEIGHTS, shardings=targets)
    tok = load_tokenizer(tokenizer or directory, vocab_size=cfg.model.vocab_size)
    return Loaded(cfg, weights, tok, _name(directory), placed=mesh is not None)


def load_random(cfg, *, name: str, seed: int = 0, tokenizer: str | None = None) -> Loaded:
    """Random weights for `cfg` (a model config, or a main-job config whose rl.tokenizer is used)."""
    import model

    if tokenizer is None and "rl" in cfg:
        tokenizer = cfg.rl.tokenizer or None
    return Loaded(
        cfg, model.build(cfg, seed=seed), load_tokenizer(tokenizer, vocab_size=cfg.model.vocab_size), name
    )


def _name(path: str) -> str:
    return os.path.basename(os.path.normpath(path)) or "model"


def make_drafter(cfg, kind: str = "auto", *, ngram: int = 3):
    """The fast variant's drafter: `auto` is the MTP head when the model has one, else `NgramDrafter(ngram)`;
    `none` serves no fast variant."""
    if kind not in DRAFTS:
        raise ValueError(f"--draft={kind!r} is not one of {DRAFTS}.")
    if kind == "auto":
        kind = "mtp" if cfg.model.mtp_layers else "ngram"
    if kind == "mtp":
        return MTPDrafter()
    return NgramDrafter(ngram) if kind == "ngram" else None
