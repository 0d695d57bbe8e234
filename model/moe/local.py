"""The dropless MoE on a data / FSDP mesh: each batch shard dispatches its own tokens.

Dimension key: B sequences, T positions, D model width, k experts per token, S batch shards.

Under GSPMD the ragged dispatch (`moe_dispatch.ragged_dispatch`) sorts the flattened batch's assignments by
expert in one `argsort`, and XLA does not split a sort over the batch: every device of a data / FSDP mesh
then routes and computes the *global* batch's tokens (S times the work and the buffers). Tokens are
independent of each other in a dropless layer, so the same output comes from each shard dispatching its own
B / S sequences: `local_ragged` runs `ragged_dispatch` inside a `jax.shard_map` over the batch axes, with
the expert weights replicated into it (GSPMD gathers FSDP shards at the boundary, as it does for any FSDP
matmul) and their gradients summed over the shards by the shard_map's transpose.

Used when the experts are not sharded (with an expert axis, `model.moe.parallel`'s all-to-all path runs)
and the batch divides over the batch axes; otherwise the global dispatch runs as before.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

from model import sharding
from model.moe.dispatch import ragged_dispatch


def batch_axes(rules, sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that `act_batch` maps to."""
    spec = sharding.logical_to_spec(("act_batch",), rules)
    names = spec[0] if len(spec) else None
    names = (names,) if isinstance(names, str) else tuple(names or ())
    return tuple(a for a in names if sizes.get(a, 1) > 1)


def applies(rules, sizes: dict[str, int], batch: int) -> bool:
    axes = batch_axes(rules, sizes)
    return bool(axes) and batch % math.prod(sizes[a] for a in axes) == 0


def local_ragged(x_BTD, idx_BTk, w_BTk, gate_EDF, up_EDF, down_EFD, rules) -> jax.Array:
    """`ragged_dispatch` of every batch shard's own tokens -> [B, T, D] (see the module docstring)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    axes = batch_axes(rules, sizes)
    rows = PartitionSpec(axes)

    def shard(x_btd, idx_btk, w_btk, gate, up, down):
        # The weights enter every shard whole; typed as varying, the kernels' custom VJPs may return their
        # cotangents per shard, and the transpose of the cast sums them (the full batch's gradient).
        gate, up, down = (_varying(p, axes) for p in (gate, up, down))
        b, t, d = x_btd.shape
        y_td = ragged_dispatch(
            x_btd.reshape(b * t, d), idx_btk.reshape(b * t, -1), w_btk.reshape(b * t, -1), gate, up, down
        )
        return y_td.reshape(b, t, d)

    whole = PartitionSpec()
    return jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(rows, rows, rows, whole, whole, whole),
        out_specs=rows,
        axis_names=frozenset(axes),
    )(x_BTD, idx_BTk, w_BTk, gate_EDF, up_EDF, down_EFD)


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`x` (the same on every shard) typed as varying over `axes` (`pcast` in new JAX, `pvary` before)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    if hasattr(jax.lax, "pvary"):
        return jax.lax.pvary(x, axes)
    return x
