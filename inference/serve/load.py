"""What `inference.serve` serves: a run's checkpoint, a Hugging Face directory or random weights, the mesh
its engines run on (`--mesh`) and the drafter of its fast variant.

With a mesh, `load_hf` reads each parameter straight into the engine's layout
(`inference.weights.weight_shardings`, through `model.io.hf.load(shardings=...)`): every device's block read
once from its slices of the safetensors, no parameter whole on one device first, and the engines take the
weights as they are (`Loaded.placed`). A run's checkpoint and random weights are made as without a mesh and
moved by the engine.

`load_run` reads a training run's config (`<workdir>/config.json`) and only the weights of its checkpoint
(`<workdir>/checkpoints/<step>/state`, written by `rl.checkpoint`): abstract targets from the model, an
orbax partial restore, no optimizer state read and no import of `rl`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

import model as model_lib
from configs.engine import EngineConfig
from configs.errors import UserError, require
from configs.runs import read_config
from inference.drafters import WEIGHTS, MTPDrafter, NgramDrafter
from inference.layout import check_mesh
from inference.weights import weight_shardings
from model import sharding
from model.io.tokenizer import Tokenizer, load_tokenizer

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


def load_run(
    workdir: str,
    step: int | None = None,
    *,
    tokenizer: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    engine_cfg: EngineConfig | None = None,
) -> Loaded:
    """A training run's weights at its latest checkpoint (or `step`), with the run's config and tokenizer.

    Reads only the weights of the checkpoint's `state` item (an orbax partial restore): the train state's
    `params` and `model_state` (the sigmoid routers' selection biases), under `train` when the run also
    checkpoints a reference or a draft model, merged into one state as the trainer hands them to its
    engine. Without `mesh` they land on the first device; with it, in the layout of an engine of
    `engine_cfg` on it (`Loaded.placed`)."""
    cfg = read_config(workdir)
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    manager = ocp.CheckpointManager(directory, item_handlers=handlers)
    try:
        steps = list(manager.all_steps())
        if not steps:
            raise UserError(f"--workdir={workdir} has no checkpoint in {directory}: train first (rl.train)")
        if step is not None and step not in steps:
            raise UserError(f"--step={step}: {directory} holds checkpoints of steps {sorted(steps)}")
        step = manager.latest_step() if step is None else step
        tree = manager.item_metadata(step).state
        tree = getattr(tree, "tree", tree)
        _, params, rest = nnx.split(nnx.eval_shape(lambda: model_lib.build(cfg)), nnx.Param, ...)
        weights = {"params": params, "model_state": rest}
        target = {"train": weights} if "train" in tree else weights
        shardings = _restore_shardings(cfg, nnx.merge_state(params, rest), mesh, engine_cfg)
        restored = manager.restore(step, args=ocp.args.Composite(state=_partial_restore(target, shardings)))
    finally:
        manager.close()
    state = restored.state.get("train", restored.state)
    tok = load_tokenizer(tokenizer or cfg.rl.tokenizer or None, vocab_size=cfg.model.vocab_size)
    weights = nnx.merge_state(state["params"], state["model_state"])
    return Loaded(cfg, weights, tok, _name(workdir), placed=mesh is not None)


def _restore_shardings(cfg, abstract: nnx.State, mesh, engine_cfg) -> nnx.State:
    """Where each restored weight goes: the engine's layout on `mesh`, else the first device."""
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: one, abstract)
    return weight_shardings(cfg, engine_cfg or EngineConfig(), mesh)


def _partial_restore(target: dict, shardings: nnx.State) -> ocp.args.PyTreeRestore:
    """Restore arguments that read the leaves of `target` (abstract weights, by the checkpoint's paths)
    into `shardings` (the merged weights' tree) and skip the rest of the checkpointed tree."""
    by_path = dict(jax.tree.leaves_with_path(shardings))
    placed = lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=by_path[_weights_path(path)])
    item = jax.tree.map_with_path(placed, target)
    restore_args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype), item
    )
    return ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)


def _weights_path(path: tuple) -> tuple:
    """The path of a target leaf in the merged weights: without the `train` / `params` / `model_state`
    keys in front."""
    keys = [getattr(k, "key", None) for k in path]
    start = keys.index("params") if "params" in keys else keys.index("model_state")
    return path[start + 1 :]


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
    require("safetensors", "--hf_dir (a Hugging Face checkpoint)")
    from model.io import hf

    if mesh is None:
        cfg, weights = hf.load_model(directory)
    else:
        targets = weight_shardings(hf.read_config(directory), engine_cfg or EngineConfig(), mesh)
        cfg, weights = hf.load(directory, variables=WEIGHTS, shardings=targets)
    tok = load_tokenizer(tokenizer or directory, vocab_size=cfg.model.vocab_size)
    return Loaded(cfg, weights, tok, _name(directory), placed=mesh is not None)


def load_random(cfg, *, name: str, seed: int = 0, tokenizer: str | None = None) -> Loaded:
    """Random weights for `cfg` (a model config, or a main-job config whose rl.tokenizer is used)."""
    if tokenizer is None and "rl" in cfg:
        tokenizer = cfg.rl.tokenizer or None
    return Loaded(
        cfg, model_lib.build(cfg, seed=seed), load_tokenizer(tokenizer, vocab_size=cfg.model.vocab_size), name
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
