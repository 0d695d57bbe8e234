"""The train state and what it is laid out by: parameters, optimizer, batch entries, shardings.

Dimension key: B sequences, T token positions, L MoE layers, k experts per token.

Batch (dict of arrays; rows right-padded), each entry with its logical axes (`BATCH_AXES`):
  tokens_BT          int32  prompt + completion
  positions_BT       int32
  mask_BT            f32    1 on the completion tokens trained on
  advantages_B       f32    (GRPO)
  behaviour_logp_BT  f32    the sampler's log-prob of each completion token, 0 elsewhere (GRPO)
  ref_logp_BT        f32    reference log-probs; needed when rl.loss.kl_kind != "none"
  proximal_logp_BT   f32    the policy's log-probs before the first update of this rollout batch; needed
                            when rl.ppo_epochs * rl.mini_batches > 1 (else the current policy is proximal)
  expert_indices     int32  [L, B, T, k] experts the sampler chose; needed when rl.routing_replay
  domain_B           int32  the row's index in rl.domains (-1: padding); needed when rl.gradient_projection

With a mesh, parameters and optimizer moments are sharded by their logical axes
(`model.sharding.state_shardings`), batch entries by `act_batch` / `act_length`, the step and key
replicated. `TrainState.model_state` holds the model's non-Param variables (the sigmoid routers' selection
biases, moved by the step outside the gradient).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from configs import schema
from configs.fields import OPTIM
from model import seeds, sharding
from model.transformer import Transformer, build
from rl import distributed

Batch = dict[str, jax.Array]

BT = ("act_batch", "act_length")


BATCH_AXES = {
    "tokens_BT": BT,
    "positions_BT": BT,
    "mask_BT": BT,
    "advantages_B": ("act_batch",),
    "behaviour_logp_BT": BT,
    "ref_logp_BT": BT,
    "proximal_logp_BT": BT,
    "expert_indices": (None, "act_batch", "act_length", None),
    "domain_B": ("act_batch",),
}


SFT_KEYS = ("tokens_BT", "positions_BT", "mask_BT")


# The row dimension of each batch entry (axis 1 of expert_indices [L, B, T, k], axis 0 of the rest).
ROW_AXIS = {k: axes.index("act_batch") for k, axes in BATCH_AXES.items()}


@struct.dataclass
class TrainState:
    params: nnx.State  # nnx.State of nnx.Param
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: updates applied so far
    rng: jax.Array  # typed key; `fold_in(rng, step)` is the key of a step that needs randomness
    # The model's non-Param variables, changed by the step outside the gradient: the sigmoid routers'
    # selection biases (`model.moe.ExpertBias`). Empty for softmax routers and dense models.
    model_state: nnx.State = struct.field(default_factory=lambda: nnx.State({}))


def weights(state: TrainState) -> nnx.State:
    """What the sampler runs on: the params with the selection biases (`inference.Engine.update_params`)."""
    return nnx.merge_state(state.params, state.model_state)


def reference_weights(state: TrainState, dtype: str = "") -> nnx.State:
    """The frozen KL reference: a copy of `weights(state)` (the step-0 policy whole: params and the sigmoid
    routers' selection biases, which the steps go on moving), the params in `dtype` ("" keeps theirs; the
    biases keep theirs: routing is chosen by them). For a model without non-Param state it has the params'
    structure. `make_grpo_update`'s `ref_params`; the checkpoint's "reference"."""
    params = jax.tree.map(lambda p: jnp.array(p, dtype=dtype or p.dtype, copy=True), state.params)
    rest = jax.tree.map(lambda x: jnp.array(x, copy=True), state.model_state)
    return nnx.merge_state(params, rest)


class ModelDef(NamedTuple):
    """The static half of the model: graph definition plus the non-parameter state it was built with (its own
    copy; the train state carries the current one, e.g. selection biases the steps move)."""

    graphdef: nnx.GraphDef
    rest: nnx.State

    def merge(self, params: nnx.State, rest: nnx.State | None = None) -> Transformer:
        """The model with `params` and `rest` (the current non-Param state; default: the one kept here)."""
        return nnx.merge(self.graphdef, params, self.rest if rest is None else rest)


def as_model_def(graphdef: ModelDef | nnx.GraphDef) -> ModelDef:
    return graphdef if isinstance(graphdef, ModelDef) else ModelDef(graphdef, nnx.State({}))


def check_optim(o: ml_collections.ConfigDict, prefix: str = "rl.optim") -> None:
    schema.check(o, OPTIM, prefix)
    if not o.total_steps > o.warmup_steps:
        raise schema.ConfigError(
            f"{prefix}.total_steps={o.total_steps!r} must be > {prefix}.warmup_steps={o.warmup_steps}"
        )


def make_schedule(optim_cfg: ml_collections.ConfigDict) -> optax.Schedule:
    """lr * (s + 1) / warmup for s < warmup, then cosine to min_lr_ratio * lr at total_steps, held after."""
    check_optim(optim_cfg)
    lr, warmup, total = optim_cfg.lr, optim_cfg.warmup_steps, optim_cfg.total_steps
    low = lr * optim_cfg.min_lr_ratio

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = lr * jnp.minimum(1.0, (s + 1.0) / max(warmup, 1))
        frac = jnp.clip((s - warmup) / (total - warmup), 0.0, 1.0)
        cosine = low + (lr - low) * 0.5 * (1.0 + jnp.cos(math.pi * frac))
        return jnp.where(s < warmup, warm, cosine)

    return schedule


def make_optimizer(optim_cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the warmup + cosine schedule of `make_schedule`."""
    o = optim_cfg
    return optax.chain(
        optax.clip_by_global_norm(o.max_grad_norm),
        optax.adamw(make_schedule(o), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
    )


def tree_shardings(tree: Any, mesh: jax.sharding.Mesh, rules) -> Any:
    """Variables (params, Adam moments) by their logical axes; every other leaf replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(
        lambda x: sharding.state_shardings(x, mesh, rules) if isinstance(x, nnx.Variable) else replicated,
        tree,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def rule_batch_shardings(keys, mesh, rules, rows: int | None = None) -> dict[str, NamedSharding]:
    """Batch entries by their logical axes; with `rows`, the row dimension keeps only the leading mesh axes
    whose sizes divide it (a mini-batch of 4 rows on 8 data shards is split over what divides 4)."""
    out = {}
    for k in keys:
        spec = sharding.mesh_spec(BATCH_AXES[k], rules, mesh)
        if rows is not None:
            spec = _fit_rows(spec, ROW_AXIS[k], rows, mesh)
        out[k] = NamedSharding(mesh, spec)
    return out


def _fit_rows(spec: PartitionSpec, axis: int, rows: int, mesh) -> PartitionSpec:
    entries = list(spec) + [None] * (axis + 1 - len(spec))
    names = entries[axis]
    names = (names,) if isinstance(names, str) else tuple(names or ())
    kept, size = [], 1
    for name in names:
        if rows % (size * mesh.shape[name]):
            break
        kept.append(name)
        size *= mesh.shape[name]
    entries[axis] = tuple(kept) if len(kept) > 1 else (kept[0] if kept else None)
    return PartitionSpec(*entries)


def batch_shardings(cfg, keys, mesh, rows: int) -> dict[str, NamedSharding]:
    """The shardings the train step takes a batch of `rows` rows in (`rl.distributed.global_batch`)."""
    return rule_batch_shardings(keys, mesh, tuple(cfg.mesh.rules), rows)


def batch_shard_count(cfg, mesh) -> int:
    """Mesh devices the batch rows are split over (act_batch): rollout batches must divide by it."""
    spec = sharding.mesh_spec(BATCH_AXES["tokens_BT"], tuple(cfg.mesh.rules), mesh)
    names = spec[0] if len(spec) else None
    names = (names,) if isinstance(names, str) else tuple(names or ())
    return int(np.prod([mesh.shape[n] for n in names])) if names else 1


def init_state(
    cfg: ml_collections.ConfigDict,
    *,
    mesh: jax.sharding.Mesh | None = None,
    seed: int = 0,
    params: nnx.State | None = None,
    model_state: nnx.State | None = None,
) -> tuple[ModelDef, TrainState]:
    """Builds the model (or takes `params`, and `model_state`: its non-Param variables, e.g. trained
    selection biases) and the optimizer state, sharded like the params on `mesh`."""
    make = lambda: Transformer(cfg, rngs=nnx.Rngs(params=seeds.key(seed)))
    if params is None:
        graphdef, params, rest = nnx.split(build(cfg, seed=seed, mesh=mesh), nnx.Param, ...)
    else:
        graphdef, _, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
        if jax.tree.leaves(rest):  # e.g. a sigmoid router's selection bias: its initial value
            rest = jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[2])()
    if model_state is not None:
        rest = model_state
    # The ModelDef keeps its own copy: the train step donates the state, `rest` included.
    model_rest = lambda: jax.tree.map(lambda x: jnp.array(x, copy=True), rest)  # noqa: E731
    optimizer = make_optimizer(cfg.rl.optim)
    step, rng = jnp.zeros((), jnp.int32), seeds.key(seed)
    if mesh is None:
        return ModelDef(graphdef, model_rest()), TrainState(params, optimizer.init(params), step, rng, rest)
    rules = cfg.mesh.rules
    if jax.process_count() > 1:  # one process's arrays (e.g. a loaded checkpoint) cannot move to others
        params, rest = _host_local(params), _host_local(rest)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, tree_shardings(params, mesh, rules))
        rest = jax.device_put(rest, tree_shardings(rest, mesh, rules))
        opt_shardings = tree_shardings(jax.eval_shape(optimizer.init, params), mesh, rules)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        # Made on the mesh (a typed key has no host form to place on devices of other processes).
        scalars = lambda: (jnp.zeros((), jnp.int32), seeds.key(seed))  # noqa: E731
        step, rng = jax.jit(scalars, out_shardings=NamedSharding(mesh, PartitionSpec()))()
    return ModelDef(graphdef, model_rest()), TrainState(params, opt_state, step, rng, rest)


def _host_local(tree: Any) -> Any:
    """Arrays held by this process alone, as host arrays (every process holds the same values)."""
    local = lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x  # noqa: E731
    return jax.tree.map(local, tree)


def abstract_state(cfg, optimizer) -> TrainState:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    step, key = jax.ShapeDtypeStruct((), jnp.int32), jax.eval_shape(jax.random.key, 0)
    return TrainState(params, jax.eval_shape(optimizer.init, params), step, key, rest)


def sft_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`cfg` with the SFT optimizer (rl.sft.optim over rl.optim)."""
    out = ml_collections.ConfigDict(cfg.to_dict())
    out.rl.optim.update(dict(cfg.rl.sft.optim))
    return out


def sft_state(cfg, seed: int, *, params=None, model_state=None, mesh=None):
    """(model def, train state) with the SFT optimizer (rl.sft.optim over rl.optim)."""
    return init_state(sft_config(cfg), mesh=mesh, seed=seed, params=params, model_state=model_state)


def load_pretrained(cfg, mesh=None, say=None, logger=None) -> dict:
    """`init_state`'s params and model_state (the sigmoid routers' selection biases) from the rl.init_from
    checkpoint, laid out by cfg's runtime model fields and read slice by slice straight into the trainer's
    shardings on `mesh` (each process reads only what its devices hold; init_state then moves nothing), or
    onto the default device. The bytes each process read are said and logged (`init_from/*`, step 0)."""
    from model.io import hf  # the hf extra: imported when a run loads a checkpoint

    params, model_state, stats = hf.load_sharded(cfg.rl.init_from, cfg, mesh)
    read = distributed.allgather([stats.bytes_read])[:, 0]
    if say is not None:
        said = ", ".join(f"{int(n):,}" for n in read)
        say(f"rl.init_from: read {said} of the checkpoint's {stats.tensor_bytes:,} bytes (per process)")
    if logger is not None:
        logger.log(
            0,
            {
                "init_from/bytes_read_max": float(read.max()),
                "init_from/bytes_read_total": float(read.sum()),
                "init_from/checkpoint_bytes": float(stats.tensor_bytes),
            },
            progress=False,
        )
    return {"params": params, "model_state": model_state}
