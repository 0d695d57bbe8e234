"""python -m rl.plan --config=configs/base.py

Defaults shared by every config. Other files start from `base.get_config()` and change what differs.
The `model` block's fields, their defaults and allowed values are the table `configs.fields.MODEL`.

Layout:
  model.*       architecture (sizes, attention, rope, MoE, dtypes, scan/remat)
  mesh.shape    mesh axis sizes, in the fixed order data, fsdp, expert, tensor, sequence
  mesh.rules    logical axis name -> mesh axes (model code names logical axes only)
"""

from collections.abc import Callable, Mapping, Sequence

import ml_collections

from configs import schema
from configs.fields import MODEL

MESH_AXES = ("data", "fsdp", "expert", "tensor", "sequence")

# Logical axis -> mesh axes. Parameters use the bare names, activations the `act_` names, so a
# parameter dimension (FSDP-sharded `embed`) and an activation dimension (replicated `act_embed`)
# can map differently.
DEFAULT_RULES = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("exp", "expert"),
    ("layers", None),
    ("norm", None),
    # activations
    ("act_batch", ("data", "fsdp", "expert")),
    ("act_length", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_exp", "expert"),
    ("act_tokens", ("data", "fsdp")),
)


def model_defaults() -> ml_collections.ConfigDict:
    return schema.build(MODEL)


def mesh_defaults() -> ml_collections.ConfigDict:
    mesh = ml_collections.ConfigDict()
    # -1 on one axis means "all remaining devices". Sizes must multiply to the device count.
    mesh.shape = ml_collections.ConfigDict({a: 1 for a in MESH_AXES})
    mesh.shape.data = -1
    mesh.rules = DEFAULT_RULES
    return mesh


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    cfg = ml_collections.ConfigDict()
    cfg.model = model_defaults()
    cfg.mesh = mesh_defaults()
    cfg.seed = 0
    # Sizes used by the planner's activation estimate and by the demo.
    cfg.batch_size = 8
    cfg.seq_len = 64
    return cfg


def parse_arg(arg: str | None, file: str, known: Sequence[str]) -> list[tuple[str, str]]:
    """A config file's argument (`configs/small.py:dense,experts=32`) as (name, value) pairs in the order
    given; `known` lists what the file takes, "name" or "name=VALUE" (value "" for a bare name). Raises a
    ValueError naming the file and what it takes for anything else."""
    takes_value = {k.partition("=")[0]: bool(k.partition("=")[1]) for k in known}
    pairs = []
    for part in filter(None, (arg or "").split(",")):
        name, eq, value = part.partition("=")
        if takes_value.get(name) is not bool(eq):
            raise ValueError(f"configs/{file}: unknown argument {part!r}; use {', '.join(known)}")
        pairs.append((name, value))
    return pairs


# What the arguments every model file takes do to its `model` block.
MODEL_ARGS: dict[str, Callable[[ml_collections.ConfigDict, str], None]] = {
    "dense": lambda m, _: m.moe.update(num_experts=0),  # every MoE layer a dense SwiGLU of width d_ff
    "capacity": lambda m, _: m.moe.update(impl="capacity"),
}


def apply_model_args(
    cfg: ml_collections.ConfigDict,
    arg: str | None,
    file: str,
    more: Mapping[str, Callable[[ml_collections.ConfigDict, str], None]] | None = None,
) -> ml_collections.ConfigDict:
    """`cfg` with a model file's arguments applied to `cfg.model` in order: `MODEL_ARGS` and the file's own
    `more` (keyed "name" or "name=VALUE", called with the model block and the value)."""
    actions = {**MODEL_ARGS, **(more or {})}
    by_name = {k.partition("=")[0]: fn for k, fn in actions.items()}
    for name, value in parse_arg(arg, file, tuple(actions)):
        by_name[name](cfg.model, value)
    return cfg
