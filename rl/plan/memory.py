"""python -m rl.plan --config=configs/grpo.py:test --mesh=data:2,fsdp:4 --sampler=data:2,expert:2,tensor:2

What the main job holds between steps, per device, predicted from the config: the same parts as its
`memory/*` metrics (`rl/memory.py`, logged per logged step), each the largest bytes any one device holds.
From abstract shapes only (`nnx.eval_shape`, `jax.eval_shape`); the meshes are dicts of axis sizes laid out
as `jax.sharding.AbstractMesh`es, so the shardings come from the functions the job itself uses.

  params           the trainer's `nnx.Param`s in their dtypes (param_dtype; routers f32), each split over
                   the mesh axes of its logical axes (`cfg.mesh.rules`, `model.sharding.mesh_spec`)
  optimizer        `rl.train_state.make_optimizer`'s state, as `optimizer.init` builds it: AdamW mu and nu
                   in the params' dtypes (optax's default), sharded like the params, and two int32 counts
                   (clipping and the schedule hold nothing else), replicated
  reference        with rl.loss.kl_kind != none: `rl.train_state.reference_weights`, the params in
                   rl.reference_dtype ("": theirs) plus the selection biases, sharded like the params
  sampler_weights  the engine's weights (params and selection biases) in the engine's layout
                   (`inference.weights.weight_shardings`: `inference.layout`'s rules, replicated over data,
                   split over expert and tensor where a dim divides), plus a draft model's (engine.draft
                   = model)
  kv_pages         the engine's page pool (`Transformer.init_paged_cache` for `EngineConfig.pool_pages`
                   pages of `page_size`, in cache_dtype or compute_dtype), the routing record with
                   rl.routing_replay, a draft model's or the MTP module's pages; sharded by
                   `inference.layout.page_shardings` (K/V over tensor when kv heads divide, else and MLA's
                   latent replicated)
  other            the step and rng key, two copies of the selection biases (the state's and its graph
                   definition's), a trained draft model's state and biases (engine.draft = model), and with
                   rl.weight_sync_delta >= 0 the delta sync's copy of the sampler's weights in the
                   trainer layout
  total            colocated (rl.sampler_devices = 0): every part on one device; disaggregated: the larger
                   of a trainer device's (params, optimizer, reference, other) and a sampler device's

Not counted: the train step's gradients and activations (`model.plan.plan` estimates those) and XLA's scratch,
rollout batches and metrics, the host-tier prefix cache (host memory). Dims that do not divide their mesh
axes count rounded up (training refuses them; the engine keeps such a weight dim whole, as counted).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec
from ml_collections import ConfigDict

from configs import schema
from configs.fields import RL
from configs.schema import ConfigError
from inference import layout, routing
from inference.drafters import split_weights
from inference.weights import graph_config, weight_shardings
from model import config as config_lib
from model import sharding
from model.plan import mesh_sizes
from model.transformer import Transformer
from rl import train_state, validate

PARTS = ("params", "optimizer", "reference", "sampler_weights", "kv_pages", "other")
SAMPLER_AXES = ("data", "expert", "tensor")


def abstract_mesh(sizes: Mapping[str, int]) -> AbstractMesh:
    """An AbstractMesh of `model.sharding.MESH_AXES` (absent axes 1): shardings without devices."""
    shape = tuple(int(sizes.get(a, 1)) for a in sharding.MESH_AXES)
    return AbstractMesh(shape, sharding.MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


def _local_bytes(shape, dtype, spec: PartitionSpec, sizes: Mapping[str, int]) -> int:
    """One device's bytes of an array of `shape` split by `spec` (a dim rounded up when uneven)."""
    local = 1
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        local *= -(-dim // math.prod(sizes.get(a, 1) for a in axes))
    return local * _itemsize(dtype)


def _itemsize(dtype) -> int:
    """Bytes of one element: a numpy or JAX key dtype's own, else `jnp.dtype`'s ('bfloat16')."""
    return getattr(dtype, "itemsize", None) or jnp.dtype(dtype).itemsize


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=_is_var)


def trainer_bytes(tree, rules, sizes: Mapping[str, int], dtype: str | None = None) -> int:
    """Per-device bytes of an abstract tree in the trainer's layout (`rl.train_state.tree_shardings`):
    variables by their logical axes, every other leaf replicated; `dtype` overrides the variables'."""
    mesh, total = abstract_mesh(sizes), 0
    for leaf in _leaves(tree):
        if _is_var(leaf):
            value = sharding.variable_value(leaf)
            spec = sharding.mesh_spec(sharding.logical_axes_of(leaf), rules, mesh)
            total += _local_bytes(value.shape, dtype or value.dtype, spec, sizes)
        elif leaf is not None:
            total += _local_bytes(leaf.shape, leaf.dtype, PartitionSpec(), sizes)
    return total


def _placed_bytes(abstract, shardings, sizes: Mapping[str, int]) -> int:
    """Per-device bytes of an abstract tree placed at a matching tree of NamedShardings."""
    total = 0
    for value, placed in zip(_leaves(abstract), _leaves(shardings)):
        value = sharding.variable_value(value) if _is_var(value) else value
        placed = sharding.variable_value(placed) if _is_var(placed) else placed
        total += _local_bytes(value.shape, value.dtype, placed.spec, sizes)
    return total


def with_rl(cfg: ConfigDict) -> ConfigDict:
    """`cfg` with an `rl` block: a model file's config (configs/moe_1t.py) gets configs/grpo.py's defaults."""
    if "rl" in cfg:
        return cfg
    out = cfg.copy_and_resolve_references()
    with out.unlocked():  # a config from --config is locked
        out.rl = schema.build(RL)
    return out


def sampler_sizes(cfg: ConfigDict, trainer: Mapping[str, int], sampler: Mapping[str, int] | None) -> dict:
    """The engine's mesh sizes: `sampler` as given ({data, expert, tensor}), or the main job's layout
    (`rl.sampler.layout`): rl.engine.mesh.expert / tensor, 0 taking the trainer mesh's, and data the rest
    of the trainer's devices (it changes no per-device figure: weights and pages are replicated over it)."""
    if sampler is not None:
        extra = {a: s for a, s in sampler.items() if a not in SAMPLER_AXES and int(s) > 1}
        if extra:
            raise ConfigError(
                f"--sampler: the engine's mesh has axes {SAMPLER_AXES}; {extra} is not one of them"
            )
        return mesh_sizes({a: int(sampler.get(a, 1)) for a in SAMPLER_AXES})
    spec = cfg.rl.engine.get("mesh", ConfigDict())
    out = {a: int(spec.get(a, 0)) or int(trainer.get(a, 1)) for a in ("expert", "tensor")}
    devices = math.prod(int(s) for s in trainer.values())
    out["data"] = max(1, devices // (out["expert"] * out["tensor"]))
    return mesh_sizes(out)


def _train_state(cfg: ConfigDict):
    """(abstract params, abstract optimizer state, abstract non-Param state) of `cfg`'s train state."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    opt = jax.eval_shape(train_state.make_optimizer(cfg.rl.optim).init, params)
    return params, opt, rest


def _engine_parts(cfg: ConfigDict, sizes: dict[str, int], ecfg, *, mtp: bool = False) -> tuple[int, int]:
    """(weight bytes, page bytes) per device of an engine over a mesh of `sizes` for `cfg`'s model (the
    target's, or a draft model's), as `inference.Engine.__init__` builds them; `mtp`: with the MTP
    drafter's pages."""
    mesh = abstract_mesh(sizes)
    _, abstract = split_weights(graph_config(cfg, ecfg, mesh))
    weights = _placed_bytes(abstract, weight_shardings(cfg, ecfg, mesh), sizes)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    dtype = ecfg.cache_dtype or cfg.model.compute_dtype
    kv_heads = model.cache_rows()[1]
    pages = jax.eval_shape(lambda: model.init_paged_cache(ecfg.pool_pages, ecfg.page_size, dtype))
    num_moe = config_lib.layer_counts(cfg.model)[1]
    if ecfg.record_routing and num_moe:
        e = cfg.model.moe
        pages["experts"] = jax.eval_shape(
            lambda: routing.init_pages(num_moe, ecfg.pool_pages, ecfg.page_size, e.top_k, e.num_experts)
        )
    page_bytes = _placed_bytes(pages, layout.page_shardings(pages, mesh, kv_heads), sizes)
    if mtp:
        pages = jax.eval_shape(lambda: model.init_mtp_paged_cache(ecfg.pool_pages, ecfg.page_size, dtype))
        page_bytes += _placed_bytes(pages, layout.page_shardings(pages, mesh, kv_heads), sizes)
    return weights, page_bytes


def device_bytes(
    cfg: ConfigDict,
    trainer_mesh: Mapping[str, int],
    sampler: Mapping[str, int] | None = None,
    *,
    colocated: bool | None = None,
) -> dict[str, int]:
    """The largest bytes one device holds in each part of the main job's live arrays (module docstring:
    `PARTS`) and in all of them ("total"), for `cfg` (a GRPO config; a model file's gets configs/grpo.py's
    rl defaults) on a trainer mesh of `trainer_mesh` axis sizes and an engine mesh of `sampler` sizes
    ({data, expert, tensor}; None: the main job's own, `sampler_sizes`). `colocated` (default:
    rl.sampler_devices = 0) puts both on the same devices. Keys: params, optimizer, reference,
    sampler_weights, kv_pages, other, total."""
    cfg = with_rl(cfg)
    rl = cfg.rl
    sizes = mesh_sizes(trainer_mesh)
    rules = tuple(cfg.mesh.rules)
    ecfg = validate.engine_config(cfg)
    params, opt, rest = _train_state(cfg)
    out = dict.fromkeys(PARTS, 0)
    out["params"] = trainer_bytes(params, rules, sizes)
    out["optimizer"] = trainer_bytes(opt, rules, sizes)
    rest_bytes = trainer_bytes(rest, rules, sizes)
    if rl.loss.kl_kind != "none":
        out["reference"] = trainer_bytes(params, rules, sizes, rl.reference_dtype or None) + rest_bytes
    step_and_key = 4 + _itemsize(jax.eval_shape(jax.random.key, 0).dtype)
    out["other"] = step_and_key + 2 * rest_bytes
    if rl.weight_sync_delta >= 0:  # WeightSync's copy of what the engine holds, in the trainer's layout
        out["other"] += out["params"] + rest_bytes
    engine_sizes = sampler_sizes(cfg, sizes, sampler)
    draft = rl.engine.draft
    mtp = draft == "mtp" and bool(cfg.model.mtp_layers)
    out["sampler_weights"], out["kv_pages"] = _engine_parts(cfg, engine_sizes, ecfg, mtp=mtp)
    if draft == "model":
        draft_cfg = validate.draft_model_config(cfg)
        d_params, d_opt, d_rest = _train_state(draft_cfg)
        d_state = trainer_bytes(d_params, rules, sizes) + trainer_bytes(d_opt, rules, sizes)
        out["other"] += d_state + 2 * trainer_bytes(d_rest, rules, sizes) + step_and_key
        d_weights, d_pages = _engine_parts(draft_cfg, engine_sizes, ecfg)
        out["sampler_weights"] += d_weights
        out["kv_pages"] += d_pages
    colocated = int(rl.sampler_devices) == 0 if colocated is None else colocated
    trainer_side = out["params"] + out["optimizer"] + out["reference"] + out["other"]
    sampler_side = out["sampler_weights"] + out["kv_pages"]
    out["total"] = trainer_side + sampler_side if colocated else max(trainer_side, sampler_side)
    return out
