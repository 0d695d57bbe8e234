"""Expert parallelism as an explicit `jax.shard_map`: routed tokens travel to the shard that holds their
expert by an all-to-all, are computed there by the grouped matmul, and come back the same way.

Dimension key: B batch, T tokens, D model width, F expert width, E experts, J expert shards (the size of
the mesh axis that `exp` maps to), X = E / J experts of one shard, k experts per token, A assignments of
one shard's tokens, C slots of one (sender, receiver) pair, R = J * C rows of a send or receive buffer.

Routing (router, top-k, capacity drops, losses) runs before, under GSPMD, on each token where it lives;
only the dispatch runs inside the shard_map, on every device of the mesh at once:
1. Sender: the local assignments sorted by expert, hence by destination (shard j holds experts
   [j X, (j + 1) X)); row j * C + c of the send buffer is the c-th assignment to shard j (expert order,
   then token order), so the buffer is `moe_dispatch`'s capacity layout with shards for experts.
2. The counts [J, X] (assignments per destination and expert) go by a small all-to-all, the rows by the
   padded all-to-all (`jax.lax.all_to_all`, every slot sent) or the ragged one
   (`jax.lax.ragged_all_to_all`, only the filled slots: chunk j lands at offset (sender) * C of shard j).
   `model.moe.ep_exchange`: auto is the padded one on every backend. The ragged one has never run: XLA:CPU
   lacks it ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter", jax 0.10.2) and no
   accelerator has run `tests/model/test_expert_parallel.py::test_ragged_exchange_on_accelerator` (marked
   `accelerator`) yet; auto may pick it on a backend only once that test has passed there.
3. Receiver: rows [J * C, D] from each sender in turn, each sender's sorted by expert; a row's local
   expert comes from the counts (X: an empty slot); `ragged_dispatch` (one row = one assignment of
   weight 1) computes them, empty rows out as zero.
4. The reverse all-to-all returns each row to its sender's slot; `combine_rows` weighs and sums over k.
   A psum over the mesh axes of the expert width (`mlp`, e.g. tensor) completes the down projection.

Slots C: dropless, every assignment a shard's T' tokens can send one receiver, T' * min(k, X) (a token's
experts are distinct). With `moe.impl = capacity` the drops are decided before, exactly as the GSPMD
capacity path decides them (`capacity_rows`), and C is also at most (local sequences) * X * (capacity per
sequence and expert). The expert-parallel output therefore equals the GSPMD path's, dropless or not.

The dropless C sizes the padded buffers for the worst case (every assignment to one receiver):
configs/moe_1t.py at 4,096 tokens per device on expert 64 has C = 4096 * 6 and a [64 * C, 7168] bf16
buffer of 21 GiB. With
`model.moe.ep_capacity_factor` f > 0 the exchange has

    C = min(dropless C, max(1, ceil(f * T' * k / J)))

slots per (sender, receiver) pair (f = 1: the balanced load T' * k / J), and a sender keeps, for each
receiver, its first C assignments in token order (a token's k assignments in the order of its top-k);
the rest are dropped (contribute zero, like the capacity impl's drops) and counted: the layer's
`dropped_tokens` / `dropped_fraction` (the main job's `moe/dropped_fraction`). These drops are not the GSPMD
path's, so with them the outputs differ from it; f = 0 (the default) leaves C and the program as they were.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from model import sharding
from model.moe.dispatch import (
    combine_rows,
    gather_rows,
    invert_rows,
    ragged_dispatch,
    sort_by_expert,
    vary_like,
)
from model.notes import note_path

MODES = ("auto", "shard_map", "gspmd")
# Default of `model.moe.expert_parallel` until configs/base.py carries the field.
DEFAULT_MODE = "auto"
# `model.moe.ep_exchange`. auto -> padded on every backend: the ragged exchange has not run anywhere yet
# (module docstring); make auto pick it on a backend only after the accelerator test has passed there.
EXCHANGES = ("auto", "padded", "ragged")


class Layout(NamedTuple):
    """How one MoE layer's dispatch runs inside the shard_map (static: shapes are known at trace time)."""

    axis: str  # the mesh axis of the experts
    shards: int  # J
    batch_axes: tuple[str, ...]  # mesh axes of the token batch dimension inside the shard_map
    length_axes: tuple[str, ...]  # mesh axes of the token length dimension
    mlp_axes: tuple[str, ...]  # mesh axes of the expert width (psum after the down projection)
    slots: int  # C
    local_tokens: int  # T' = tokens of one shard
    ragged: bool = False  # the ragged all-to-all (`model.moe.ep_exchange`), else the padded one
    capped: bool = False  # C is the ep_capacity_factor bound: senders drop past it (module docstring)


def _axes(logical: str, rules, sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that one logical name maps to."""
    entry = sharding.logical_to_spec((logical,), rules)[0]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in axes if sizes.get(a, 1) > 1)


def _weight_axes(rules, sizes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(experts' mesh axes, expert width's mesh axes) of an expert weight ('exp', 'embed', 'mlp')."""
    spec = sharding.logical_to_spec(("exp", "embed", "mlp"), rules)

    def axes(entry):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        return tuple(a for a in names if sizes.get(a, 1) > 1)

    return axes(spec[0]), axes(spec[2])


def experts_sharded(rules, sizes: dict[str, int]) -> bool:
    """Whether the expert weights are split over a mesh axis of size > 1 on this mesh."""
    return bool(sizes) and bool(_weight_axes(rules, sizes)[0])


def mode_of(moe_cfg) -> str:
    mode = moe_cfg.expert_parallel
    if mode not in MODES:
        raise ValueError(f"model.moe.expert_parallel={mode!r}; choose one of {MODES}")
    return mode


def exchange_of(moe_cfg) -> str:
    """'padded' or 'ragged': the all-to-all `model.moe.ep_exchange` picks (auto: padded, on every backend).
    Said once per process at INFO (`note_path`). Ragged on CPU fails to compile (XLA:CPU lacks it)."""
    choice = moe_cfg.get("ep_exchange", "auto")
    if choice not in EXCHANGES:
        raise ValueError(f"model.moe.ep_exchange={choice!r}; choose one of {EXCHANGES}")
    chosen = "padded" if choice == "auto" else choice
    note_path(f"model.moe.ep_exchange={choice}: the expert-parallel exchange is the {chosen} all-to-all")
    return chosen


def capacity_factor_of(moe_cfg) -> float:
    """`model.moe.ep_capacity_factor` (0: dropless); a negative one is refused by name."""
    factor = float(moe_cfg.get("ep_capacity_factor", 0.0))
    if factor < 0:
        raise ValueError(f"model.moe.ep_capacity_factor={factor} must be >= 0 (0: dropless)")
    return factor


def capped_slots(factor: float, local_tokens: int, top_k: int, shards: int) -> int:
    """The ep_capacity_factor bound on C: max(1, ceil(factor * T' * k / J))."""
    return max(1, math.ceil(factor * local_tokens * top_k / shards))


def layout(
    moe_cfg,
    rules,
    sizes: dict[str, int],
    shape_BT: tuple[int, int],
    cap: int | None,
    *,
    mode: str | None = None,
    ep_capacity_factor: float | None = None,
) -> Layout | None:
    """The shard_map layout of one MoE layer, or None for the GSPMD / one-device path.

    `sizes` are the mesh axis sizes ({} without a mesh), `shape_BT` the layer's token shape and `cap`
    the capacity per sequence and expert (None: dropless). With `model.moe.expert_parallel` = auto the
    shard_map runs whenever the experts are sharded and the layout allows it; = shard_map it must (else
    a ValueError says why); = gspmd it never runs. `mode` and `ep_capacity_factor` override the config's
    fields."""
    mode = mode or mode_of(moe_cfg)
    factor = capacity_factor_of(moe_cfg) if ep_capacity_factor is None else float(ep_capacity_factor)
    if mode == "gspmd" or not experts_sharded(rules, sizes):
        return None
    exp_axes, mlp_axes = _weight_axes(rules, sizes)
    batch_axes, length_axes = _axes("act_batch", rules, sizes), _axes("act_length", rules, sizes)
    b, t = shape_BT
    nb = math.prod(sizes[a] for a in batch_axes)
    nl = math.prod(sizes[a] for a in length_axes)
    problem = None
    if len(exp_axes) != 1:
        problem = f"mesh.rules maps 'exp' to {exp_axes}; the all-to-all needs one mesh axis"
    elif exp_axes[0] not in batch_axes + length_axes:
        problem = (
            f"the tokens ('act_batch', 'act_length') are not split over the experts' axis {exp_axes[0]!r}"
        )
    elif set(mlp_axes) & set(batch_axes + length_axes + exp_axes):
        problem = f"the expert width's axes {mlp_axes} also split the tokens or the experts"
    elif b % nb or t % nl:
        problem = f"tokens [{b}, {t}] do not divide over the mesh axes {batch_axes} x {length_axes}"
    if problem is not None:
        if mode == "shard_map":
            raise ValueError(
                f"model.moe.expert_parallel=shard_map: {problem}; set it to auto (GSPMD there) or gspmd, "
                "or change mesh.rules / the batch"
            )
        note_path(f"model.moe.expert_parallel=auto: GSPMD dispatch for tokens [{b}, {t}]: {problem}")
        return None
    axis = exp_axes[0]
    shards = sizes[axis]
    per_shard = moe_cfg.num_experts // shards
    local_tokens = (b // nb) * (t // nl)
    slots = local_tokens * min(moe_cfg.top_k, per_shard)
    if cap is not None:
        slots = min(slots, (b // nb) * per_shard * cap)
    capped = False
    if factor > 0:
        bound = capped_slots(factor, local_tokens, moe_cfg.top_k, shards)
        slots, capped = min(slots, bound), bound < slots
    ragged = exchange_of(moe_cfg) == "ragged"
    return Layout(axis, shards, batch_axes, length_axes, mlp_axes, slots, local_tokens, ragged, capped)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def dispatch(
    x_BTD, idx_BTk, w_BTk, kept_BTk, gate_EDF, up_EDF, down_EFD, lay: Layout, *, ragged: bool | None = None
) -> tuple[jax.Array, jax.Array]:
    """(the routed experts' output [B, T, D], the int32 count of kept assignments the exchange dropped)
    by the shard_map dispatch of `lay` (under `jax.set_mesh`).

    `kept_BTk` marks the assignments to compute (all of them when dropless); the count is 0 unless
    `lay.capped`. `ragged` picks the ragged all-to-all (default: `lay.ragged`)."""
    ragged = lay.ragged if ragged is None else ragged
    tokens = PartitionSpec(_entry(lay.batch_axes), _entry(lay.length_axes))
    mlp = _entry(lay.mlp_axes)
    w_in, w_out = PartitionSpec(lay.axis, None, mlp), PartitionSpec(lay.axis, mlp, None)
    local = functools.partial(_local, lay=lay, ragged=ragged)
    specs = (tokens, tokens, tokens, tokens, w_in, w_in, w_out)
    return jax.shard_map(local, in_specs=specs, out_specs=(tokens, PartitionSpec()))(
        x_BTD, idx_BTk, w_BTk, kept_BTk, gate_EDF, up_EDF, down_EFD
    )


def _local(x_BTD, idx_BTk, w_BTk, kept_BTk, gate_XDF, up_XDF, down_XFD, *, lay: Layout, ragged: bool):
    """One shard's part: send, compute its experts, send back, combine."""
    # Every operand varies over every axis in play: the tokens' copies on the expert-width axes each
    # compute a part of the output (summed below), so their gradients must be summed too (the
    # transpose of this cast), as must the weights' over the token axes.
    axes = tuple(dict.fromkeys(lay.batch_axes + lay.length_axes + (lay.axis,) + lay.mlp_axes))
    operands = (x_BTD, idx_BTk, w_BTk, kept_BTk, gate_XDF, up_XDF, down_XFD)
    everywhere = jnp.zeros((), jnp.int32)
    everywhere = jax.lax.pcast(everywhere, axes, to="varying")
    x_BTD, idx_BTk, w_BTk, kept_BTk, gate_XDF, up_XDF, down_XFD = (vary_like(a, everywhere) for a in operands)
    b, t, d = x_BTD.shape
    k = idx_BTk.shape[-1]
    j, c, x = lay.shards, lay.slots, gate_XDF.shape[0]
    n, num_rows = j * x, j * c
    # Sender: the kept assignments sorted by expert (group n: the dropped ones, last).
    key_A = jnp.where(kept_BTk, idx_BTk, n).reshape(-1).astype(jnp.int32)
    dropped = jnp.zeros((), jnp.int32)
    if lay.capped:  # each receiver's first C assignments in token order; the rest drop here
        kept_count = jnp.sum(key_A < n, dtype=jnp.int32)
        _, _, rank_A = sort_by_expert(jnp.where(key_A < n, key_A // x, j), j + 1)
        key_A = jnp.where(rank_A < c, key_A, n)
        dropped = _total(kept_count - jnp.sum(key_A < n, dtype=jnp.int32), lay)
    _, sizes_G, pos_A = sort_by_expert(key_A, n + 1)
    start_G = jnp.cumsum(sizes_G) - sizes_G
    dest_A = jnp.minimum(key_A // x, j - 1)
    slot_A = start_G[key_A] - start_G[dest_A * x] + pos_A  # position among the assignments to dest
    # Slots past C cannot occur when a token's experts are distinct (route's are); were they to (a
    # replayed routing with repeats), those assignments would drop, uncounted, rather than collide.
    sent_A = (key_A < n) & (slot_A < c)
    row_A = jnp.where(sent_A, dest_A * c + slot_A, num_rows)
    assign_R = invert_rows(row_A, num_rows)
    send_RD = gather_rows(x_BTD.reshape(b * t, d), assign_R, row_A, k)
    send_JX = jnp.bincount(jnp.where(sent_A, key_A, n), length=n + 1)[:n].reshape(j, x).astype(jnp.int32)
    recv_JX = jax.lax.all_to_all(send_JX, lay.axis, 0, 0, tiled=True)  # [senders, X]
    send_J, recv_J = send_JX.sum(1), recv_JX.sum(1)
    exchange = functools.partial(_exchange, axis=lay.axis, slots=c, ragged=ragged)
    recv_RD = exchange(send_RD, send_J, recv_J)
    # Receiver: a row's local expert from the counts of its sender (X past them: an empty slot).
    slot_C = jnp.arange(c, dtype=jnp.int32)
    ends_JX = jnp.cumsum(recv_JX, axis=1)
    e_JC = jax.vmap(lambda ends: jnp.searchsorted(ends, slot_C, side="right"))(ends_JX)
    ones_R1 = vary_like(jnp.ones((num_rows, 1), x_BTD.dtype), recv_RD)
    y_RD = ragged_dispatch(
        recv_RD, e_JC.reshape(num_rows, 1).astype(jnp.int32), ones_R1, gate_XDF, up_XDF, down_XFD
    )
    back_RD = exchange(y_RD, recv_J, send_J)
    y_TD = combine_rows(back_RD, w_BTk.reshape(b * t, k), assign_R, row_A)
    if lay.mlp_axes:
        y_TD = jax.lax.psum(y_TD, lay.mlp_axes)
    return y_TD.reshape(b, t, d), dropped


def _total(count, lay: Layout):
    """A per-shard count summed over the token shards, once: every copy of a token over the expert width's
    axes counted the same assignments, so those copies agree (pmax) rather than add."""
    if lay.mlp_axes:
        count = jax.lax.pmax(count, lay.mlp_axes)
    return jax.lax.psum(count, tuple(dict.fromkeys(lay.batch_axes + lay.length_axes)))


def _exchange(rows_RD, send_J, recv_J, *, axis: str, slots: int, ragged: bool):
    """Rows [J * C, D] laid out by peer (chunk j for peer j) -> rows from each peer at chunk (peer).
    `send_J` / `recv_J`: the filled slots of each chunk sent / received (the ragged all-to-all sends
    only those; the padded one every slot)."""
    if not ragged:
        return jax.lax.all_to_all(rows_RD, axis, 0, 0, tiled=True)
    j = send_J.shape[0]
    offsets_J = jnp.arange(j, dtype=jnp.int32) * slots
    mine_J = jnp.full((j,), jax.lax.axis_index(axis) * slots, jnp.int32)  # where my chunk lands at each peer
    out_RD = vary_like(jnp.zeros(rows_RD.shape, rows_RD.dtype), rows_RD)  # varies as the rows it receives
    return jax.lax.ragged_all_to_all(
        rows_RD, out_RD, offsets_J, send_J.astype(jnp.int32), mine_J, recv_J.astype(jnp.int32), axis_name=axis
    )


class AllToAllBytes(NamedTuple):
    """All-to-all traffic and buffers of one MoE layer's forward on one device (a training step's backward
    sends as much again). Dispatch and return each send (J - 1) of a device's J chunks to other devices.
    Four buffers of `buffer_bytes` (send, receive, and the same for the return) live around the layer."""

    shards: int  # J
    slots: int  # C under model.moe.ep_capacity_factor
    buffer_bytes: int  # one send or receive buffer: J * C * D * bytes
    padded_bytes: int  # padded all-to-all: 2 * (J - 1) * C * D * bytes + counts 4 * (J - 1) * X
    ragged_balanced_bytes: int  # ragged, balanced routing: 2 * (J - 1) / J * T' * k * D * bytes + counts
    dropless_slots: int  # C with ep_capacity_factor = 0: T' * min(k, X) (capacity impl: its bound too)
    dropless_buffer_bytes: int  # J * dropless C * D * bytes


def all_to_all_bytes(cfg, mesh_sizes: dict[str, int], batch: int, seq_len: int) -> AllToAllBytes | None:
    """The expert-parallel all-to-all bytes per layer and device for a forward over [batch, seq_len]
    tokens on a mesh of `mesh_sizes`, from the config alone (what `model.plan` prints); None where the
    dispatch would not run as a shard_map (no expert axis, `expert_parallel = gspmd`, or a layout it
    refuses). T' = batch * seq_len / (token shards); C as in `layout` (with the config's
    ep_capacity_factor, and without: the dropless buffer); bytes of `model.compute_dtype`."""
    m = cfg.model
    e = m.moe
    if not e.num_experts:
        return None
    sizes = {a: int(mesh_sizes.get(a, 1)) for a in sharding.MESH_AXES}
    cap = None
    if e.impl == "capacity":
        cap = max(1, math.ceil(e.capacity_factor * seq_len * e.top_k / e.num_experts))
    if mode_of(e) == "gspmd":
        return None
    rules, shape = tuple(cfg.mesh.rules), (batch, seq_len)
    lay = layout(e, rules, sizes, shape, cap, mode="auto")  # refused: None
    if lay is None:
        return None
    dropless = layout(e, rules, sizes, shape, cap, mode="auto", ep_capacity_factor=0.0).slots
    item = jnp.dtype(m.compute_dtype).itemsize
    j, c, d = lay.shards, lay.slots, m.d_model
    counts = 4 * (j - 1) * (e.num_experts // j)  # int32 [J, X], sent once (the return reuses them)
    padded = 2 * (j - 1) * c * d * item + counts
    ragged = round(2 * (j - 1) / j * lay.local_tokens * e.top_k * d * item) + counts
    return AllToAllBytes(j, c, j * c * d * item, padded, ragged, dropless, j * dropless * d * item)
