"""The planner's per-device bytes against XLA's: compile the real GRPO train step, allocate nothing.

`python -m rl.plan --config=configs/tiny.py --mesh=data:2,fsdp:4 --xla` (on a CPU, 8 fake devices:
`XLA_FLAGS=--xla_force_host_platform_device_count=8`) lowers and compiles `rl.train_step.make_train_step`
for the mesh from ShapeDtypeStructs (`jax.jit(...).lower(...).compile()`: no parameter, moment or batch
is ever allocated) and prints `memory_analysis()` per device beside the planner's estimate:

  arguments  XLA: the train state and the batch.      estimate: params + AdamW mu, nu + batch
  outputs    XLA: the new state and the metrics.       estimate: params + mu + nu
  aliased    XLA: outputs written over donated inputs.  estimate: the state (it is donated)
  temp       XLA: every intermediate of the step.      estimate: f32 gradients + `activation_bytes_per_device`
  peak       arguments + outputs - aliased + temp       (the planner's total_bytes_per_device + batch)

Arguments, outputs and aliases are exact quantities: the estimate leaves out only scalars (the step,
optax's two counts and the rng key, 20 bytes; ~180 f32 metrics), 0.1% of the tiny config's state.

Temp is where the two differ. XLA:CPU, f32, remat none, GRPO step, bytes per device (commit of this
docstring; `python -m rl.plan --config=configs/X.py --mesh=M --xla`):

  config          mesh            XLA temp      estimate     ratio
  tiny            one device       9,084,304    4,599,296     1.98
  tiny            data 2, fsdp 4   2,881,504      691,200     4.17
  tiny:capacity   data 2, fsdp 4   1,920,640      691,200     2.78
  tiny:dense      data 2, fsdp 4     890,680      402,944     2.21
  small           one device       2.50e9        1.91e9       1.31
  small           data 2, fsdp 4   6.28e8        2.86e8       2.19
  small:capacity  data 2, fsdp 4   7.40e8        2.86e8       2.59

What the estimate leaves out, read off XLA's buffer assignment at the peak (XLA_FLAGS=--xla_dump_to=DIR:
`*memory-usage-report.txt`, `*live-range.txt` list the buffers live there):
- More per layer than the activation model's named intermediates: autodiff also keeps RMSNorm's and
  qk_norm's inputs and scales, RoPE's rotated halves, silu's sigmoid, the chunked attention kernel's
  per-block queries and statistics. tiny:dense on one device stacks 1,812 values per token per layer
  against the model's 896 (2.0x); XLA's temp grows by 667,392 bytes per row, the model's by 294,912.
- The dropless (ragged) MoE sorts all of the step's tokens at once (`jnp.argsort` over the flattened
  batch), which GSPMD does not split over data/fsdp: on such a mesh every device runs the MoE layers
  over the global batch (tiny on data 8: [640, 96] expert buffers, 256 tokens x top-2 + a 128-row
  window, on a device that holds 32 tokens; small on data 2 x fsdp 4: [8320, 384] on a device of 512
  tokens). The estimate assumes each device's own rows, which the capacity impl keeps ([16, 80, 384]).
- Weights held for the backward pass: under FSDP the all-gathered weights of every layer stay live
  until their backward (small on data 2 x fsdp 4, either impl: all routed experts in f32, 0.30e9
  bytes, where the device owns a quarter), and on one device the dropless CPU kernel's custom VJP keeps
  copies of the expert weights (small: 0.30e9 bytes).
- The f32 gradient accumulator is counted; optimizer temporaries and layout copies are not.
So on XLA:CPU the estimate's temp is a lower bound, by the ratios above for these configs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from model import config as config_lib
from model import plan as plan_lib
from model import seeds, sharding
from model.transformer import Transformer
from rl import train_state, train_step
from rl.plan.memory import with_rl

# Batch entries the GRPO step reads (rl.train_state.BATCH_AXES): int32 ids, everything else f32.
INT_KEYS = ("tokens_BT", "positions_BT", "expert_indices")


class XlaMemory(NamedTuple):
    """`memory_analysis()` of a compiled step, bytes per device."""

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp


def _batch_shape(key: str, cfg: ConfigDict, batch: int, seq_len: int) -> tuple[int, ...]:
    m = cfg.model
    if key == "expert_indices":  # [L_moe, B, T, k]
        return (config_lib.layer_counts(m)[1], batch, seq_len, m.moe.top_k)
    dims = {"act_batch": batch, "act_length": seq_len}
    return tuple(dims[a] for a in train_state.BATCH_AXES[key])


def abstract_batch(cfg: ConfigDict, batch: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The GRPO step's batch (`rl.train_step.grpo_batch_keys(cfg)`) as ShapeDtypeStructs."""
    return {
        k: jax.ShapeDtypeStruct(
            _batch_shape(k, cfg, batch, seq_len), jnp.int32 if k in INT_KEYS else jnp.float32
        )
        for k in train_step.grpo_batch_keys(cfg)
    }


def batch_bytes_per_device(cfg: ConfigDict, mesh_shape: Mapping[str, int], batch: int, seq_len: int) -> int:
    """Bytes of one device's rows of the GRPO batch: each dim split over its mesh axes (rounded up)."""
    sizes, rules = plan_lib.mesh_sizes(mesh_shape), tuple(cfg.mesh.rules)
    total = 0
    for k, x in abstract_batch(cfg, batch, seq_len).items():
        spec = sharding.logical_to_spec(train_state.BATCH_AXES[k], rules)
        local = math.prod(-(-d // plan_lib._num_shards(e, sizes)) for d, e in zip(x.shape, spec))
        total += local * x.dtype.itemsize
    return total


def _abstract_state(cfg: ConfigDict):
    """(graph definition, TrainState of ShapeDtypeStructs): the step's input, as `init_state` makes it."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = train_state.make_optimizer(cfg.rl.optim)
    step = jax.ShapeDtypeStruct((), jnp.int32)
    state = train_state.TrainState(
        params, jax.eval_shape(optimizer.init, params), step, jax.eval_shape(lambda: seeds.key(0)), rest
    )
    return graphdef, state


def _state_shardings(state, mesh, rules):
    """Variables (params, moments, biases) by their logical axes; the scalars replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    is_var = lambda x: isinstance(x, nnx.Variable)
    return jax.tree.map(
        lambda x: sharding.state_shardings(x, mesh, rules) if is_var(x) else replicated, state, is_leaf=is_var
    )


def mesh_devices(mesh_shape: Mapping[str, int]) -> list:
    """The first prod(mesh sizes) devices, or an error that says how to get more on a CPU."""
    sizes = plan_lib.mesh_sizes(mesh_shape)
    n, devices = math.prod(sizes.values()), jax.devices()
    if n > len(devices):
        raise ValueError(
            f"--xla compiles for real devices: the mesh {sizes} needs {n}, JAX sees {len(devices)} "
            f"({devices[0].platform}); on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
            "(and JAX_PLATFORMS=cpu), or pass a smaller --mesh"
        )
    return devices[:n]


def train_step_memory(cfg: ConfigDict, mesh_shape: Mapping[str, int], batch: int, seq_len: int) -> XlaMemory:
    """XLA's per-device memory of the GRPO train step (`rl.train_step.make_train_step`) on the mesh.

    The step is jitted as the trainer jits it on a mesh: state in its parameter shardings and donated,
    the batch over act_batch/act_length, metrics replicated. Compiling is the cost: ~10-60 s for the tiny
    config on a CPU, minutes for small.
    """
    cfg = with_rl(cfg)
    sizes = plan_lib.mesh_sizes(mesh_shape)
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if batch % shards or seq_len % sizes["sequence"]:
        raise ValueError(
            f"--xla: batch {batch} must divide over data*fsdp*expert = {shards} and seq_len {seq_len} "
            f"over sequence = {sizes['sequence']}; change --batch/--seq_len or --mesh"
        )
    mesh = sharding.make_mesh(sizes, mesh_devices(sizes))
    rules = tuple(cfg.mesh.rules)
    graphdef, state = _abstract_state(cfg)
    batch_in = abstract_batch(cfg, batch, seq_len)
    batch_shardings = train_state.batch_shardings(cfg, tuple(batch_in), mesh, batch)
    state_shardings = _state_shardings(state, mesh, rules)
    # The step without a mesh is the pure jitted step; jitting it again with the mesh's shardings
    # gives the program the trainer runs on that mesh (its memory_analysis is identical).
    step = train_step.make_train_step(cfg, graphdef)
    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )
    with jax.set_mesh(mesh):
        compiled = jitted.lower(state, batch_in).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(f"the {mesh.devices.flat[0].platform} backend gives no memory_analysis()")
    return XlaMemory(
        stats.argument_size_in_bytes,
        stats.output_size_in_bytes,
        stats.alias_size_in_bytes,
        stats.temp_size_in_bytes,
        stats.generated_code_size_in_bytes,
    )


def estimate(p: dict, batch_bytes: int) -> XlaMemory:
    """The planner's figures (a `plan.plan` result) in XlaMemory's terms."""
    state = p["param_bytes_per_device"] + p["adamw_bytes_per_device"]
    temp = p["grad_bytes_per_device"] + p["activation_bytes_per_device"]
    return XlaMemory(state + batch_bytes, state, state, temp, 0)


def compare(xla: XlaMemory, est: XlaMemory) -> list[tuple[str, int, int]]:
    """(row, XLA bytes, estimated bytes) per device, the peak last."""
    rows = [(name, getattr(xla, name), getattr(est, name)) for name in XlaMemory._fields]
    return rows + [("peak", xla.peak, est.peak)]


def xla_plan(cfg: ConfigDict, mesh_shape: Mapping[str, int], batch: int, seq_len: int, p: dict) -> dict:
    """JSON-ready XLA rows for the planner's output `p` (same config, mesh, batch, seq_len)."""
    xla = train_step_memory(cfg, mesh_shape, batch, seq_len)
    est = estimate(p, batch_bytes_per_device(with_rl(cfg), mesh_shape, batch, seq_len))
    return {f"xla_{name}": {"xla": a, "estimate": b} for name, a, b in compare(xla, est)}
