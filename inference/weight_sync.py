"""Weights from the trainer to the engine: reshards within a device set, sends between device sets, deltas.

`to_layout(tree, shardings)` moves a tree of arrays in any layout to `shardings` (the engine's) without a
host round trip, and counts the bytes that land on devices that did not hold them:

- the same devices (colocated: e.g. the trainer's FSDP layout to the engine's tensor-parallel one): one
  jitted identity with `out_shardings` (XLA's collectives move the shards; the result is a fresh copy, so the
  trainer may donate its params to the next step);
- single-device weights (built on the default device) to devices that include theirs: `jax.device_put`,
  which slices them on their device;
- disjoint devices (disaggregated: the engine on its own sub-mesh): a jitted reshard on the trainer's devices
  to the engine's partitioning (over a mesh of the trainer's devices shaped like the engine's, replicated
  over a leading `copies` axis), then one device-to-device copy per engine shard (`jax.device_put` of
  single-device shards, batched) assembled with `jax.make_array_from_single_device_arrays`. A `device_put`
  straight to the engine's sharding would read the array through the host whenever the two partitionings
  differ. The trainer's device count must be a multiple of the engine's.

Everything is dispatched asynchronously: `to_layout` returns before the bytes move, and the engine's next
step waits on them through data dependence.

`WeightSync(engine, mode, delta_threshold=None).push(params)` is what the main job calls after each update:
a full sync through `Engine.update_params`, or a delta sync that sends only the leaves whose largest change
since they were last sent exceeds `delta_threshold` (`0.0`: every leaf that changed at all). The reference
(what the engine holds) is a copy kept in the trainer's layout, so the engine never drifts more than the
threshold from the trainer, per element, however many small changes accumulate.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from inference.drafters import model_weights

MODES = ("colocated", "disaggregated")


def to_layout(tree, shardings, *, current=None) -> tuple:
    """(`tree` moved to `shardings`, bytes moved): see the module docstring. Leaves of `tree` that are the
    very arrays of `current` (the engine's weights now) are kept as they are; when there are none the whole
    tree moves in one jitted transfer, else each other leaf in its own (a delta sync). Host (numpy) leaves
    are put straight to their target."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    held = [None] * len(leaves) if current is None else treedef.flatten_up_to(current)
    own = [x is c for x, c in zip(leaves, held)]
    host = [not isinstance(x, jax.Array) for x in leaves]
    moves = [i for i in range(len(leaves)) if not (own[i] or host[i])]
    out = list(leaves)
    for i in (i for i in range(len(leaves)) if host[i] and not own[i]):
        out[i] = jax.device_put(leaves[i], targets[i])
    if len(moves) == len(leaves):  # the common case: one transfer for the whole tree
        out = _move(leaves, targets)
    else:
        for i in moves:
            out[i] = _move([leaves[i]], [targets[i]])[0]
    moved = sum(
        moved_bytes(
            None if host[i] else leaves[i].sharding, targets[i], np.shape(leaves[i]), leaves[i].dtype.itemsize
        )
        for i in range(len(leaves))
        if not own[i]
    )
    return treedef.unflatten(out), moved


def _move(leaves: list, targets: list) -> list:
    src = _device_set(leaves)
    dst = {d for s in targets for d in s.device_set}
    if src == dst:
        return _copier(targets)(leaves)
    if src.isdisjoint(dst):
        return _across(leaves, targets, src)
    if all(len(x.sharding.device_set) == 1 for x in leaves):  # e.g. weights built on the default device
        return jax.device_put(leaves, targets, may_alias=False)  # slices on device, no host round trip
    raise ValueError(
        f"weights on devices {sorted(d.id for d in src)} partly overlap the engine's "
        f"{sorted(d.id for d in dst)}; place them on exactly the engine's devices (colocated) or on "
        "devices disjoint from them (disaggregated)."
    )


def _device_set(leaves) -> set:
    return {d for x in leaves for d in x.sharding.device_set}


@functools.lru_cache(maxsize=256)
def _copier_for(targets):
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=targets.tree)


def _copier(targets: list):
    """A jitted copy of a list of arrays to `targets` (cached per targets)."""
    from inference.layout import Tree

    return _copier_for(Tree(list(targets)))


def _across(leaves, targets, src_devices) -> list:
    """Disjoint device sets: reshard on the source devices to the targets' partitioning, then copy each
    engine shard from the source device that holds the same block."""
    targets = [_named(s) for s in targets]
    staged = _copier([_shadow(s, src_devices) for s in targets])(leaves)
    arrays, devices, counts = [], [], []
    for x, s in zip(staged, targets):
        by_device = {shard.device: shard.data for shard in x.addressable_shards}
        source = dict(zip(s.mesh.devices.flat, x.sharding.mesh.devices[0].flat))
        here = list(s.addressable_devices_indices_map(x.shape))
        counts.append(len(here))
        arrays += [by_device[source[d]] for d in here]
        devices += here
    copies = jax.device_put(arrays, devices)
    out, i = [], 0
    for x, s, n in zip(staged, targets, counts):
        out.append(jax.make_array_from_single_device_arrays(x.shape, s, copies[i : i + n]))
        i += n
    return out


def _named(s: jax.sharding.Sharding) -> NamedSharding:
    if isinstance(s, NamedSharding):
        return s
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return NamedSharding(Mesh(np.asarray(list(s.device_set)), ("one",)), jax.sharding.PartitionSpec())
    raise TypeError(f"cannot send weights to a {type(s).__name__}; place the engine's weights by mesh.")


def _shadow(target: NamedSharding, src_devices: set) -> NamedSharding:
    """`target`'s partitioning over the source devices: a mesh of them shaped (copies, *target mesh shape)
    with `target`'s spec, so mesh position (0, *p) holds what the target device at p holds."""
    return _shadow_cached(target, tuple(sorted(src_devices, key=lambda d: d.id)))


@functools.lru_cache(maxsize=256)
def _shadow_cached(target: NamedSharding, src: tuple) -> NamedSharding:
    n_dst = target.mesh.devices.size
    if len(src) % n_dst:
        raise ValueError(
            f"disaggregated weight sync: the trainer's {len(src)} devices are not a multiple of the "
            f"engine's {n_dst}; give the engine a divisor of the trainer's device count."
        )
    grid = np.asarray(src, dtype=object).reshape((len(src) // n_dst,) + target.mesh.devices.shape)
    return NamedSharding(Mesh(grid, ("copies",) + tuple(target.mesh.axis_names)), target.spec)


def moved_bytes(src: jax.sharding.Sharding, dst: jax.sharding.Sharding, shape: tuple, itemsize: int) -> int:
    """Bytes that the devices of `dst` must receive to hold their shards: each device's block minus what
    it already holds under `src` (None: on the host; replicated blocks count once per device needing them)."""
    return _moved_elements(src, dst, tuple(shape)) * itemsize


@functools.lru_cache(maxsize=4096)
def _moved_elements(src, dst, shape: tuple) -> int:
    have = {} if src is None else src.devices_indices_map(shape)
    total = 0
    for device, index in dst.devices_indices_map(shape).items():
        want = _box(index, shape)
        total += _volume(want) - (_volume(_meet(want, _box(have[device], shape))) if device in have else 0)
    return total


def _box(index: tuple, shape: tuple) -> list[tuple[int, int]]:
    return [sl.indices(n)[:2] for sl, n in zip(index, shape)]


def _meet(a, b):
    return [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b)]


def _volume(box) -> int:
    return math.prod(max(hi - lo, 0) for lo, hi in box)


# --- The main job's side --------------------------------------------------------------------------------


class WeightSync:
    """Pushes the trainer's weights to an `Engine` after each update.

    `mode`: "colocated" (the params live on exactly the engine's devices, in any layout) or
    "disaggregated" (on devices disjoint from the engine's); a push in the other placement is refused.
    `delta_threshold`: None sends every leaf on every push; a number >= 0 sends only the leaves whose
    largest absolute change since they were last sent exceeds it (the first push sends all). A delta push
    reads one float per leaf to the host to decide (it waits for the params to be computed); a full push
    returns at once.

    `push(params)` returns metrics: `sync/seconds` (until the push returned; the transfer itself may still
    run), `sync/bytes` (bytes sent to engine devices that lacked them), `sync/leaves_sent`, `sync/leaves`,
    and with a threshold `sync/max_unsent_change` (the largest change of a leaf not sent)."""

    def __init__(self, engine, mode: str = "colocated", *, delta_threshold: float | None = None):
        if mode not in MODES:
            raise ValueError(f"WeightSync(mode={mode!r}): choose one of {MODES}.")
        if delta_threshold is not None and not delta_threshold >= 0:
            raise ValueError(f"WeightSync(delta_threshold={delta_threshold!r}) must be None or >= 0.")
        self.engine, self.mode, self.threshold = engine, mode, delta_threshold
        self._reference = None  # delta mode: what the engine holds, in the trainer's layout
        self._changes = jax.jit(lambda new, ref: jnp.stack([_max_abs(a, b) for a, b in zip(new, ref)]))
        self._keep = jax.jit(
            lambda new, ref, send: [jnp.where(send[i], a, b) for i, (a, b) in enumerate(zip(new, ref))],
            donate_argnums=1,
        )

    def push(self, params) -> dict:
        t0 = time.perf_counter()
        params = model_weights("params", params, self.engine.params, keep=self.engine.params)
        leaves, treedef = jax.tree.flatten(params)
        self._check_placement(leaves)
        before = self.engine.stats().get("weight_bytes", 0)
        if self.threshold is None:
            self.engine.update_params(params)
            sent, metrics = len(leaves), {}
        else:
            sent, metrics = self._push_delta(leaves, treedef)
        metrics.update(
            {
                "sync/seconds": time.perf_counter() - t0,
                "sync/bytes": self.engine.stats()["weight_bytes"] - before,
                "sync/leaves_sent": sent,
                "sync/leaves": len(leaves),
            }
        )
        return metrics

    def _push_delta(self, leaves, treedef) -> tuple[int, dict]:
        if self._reference is None:
            send = np.ones(len(leaves), bool)
            change = np.full(len(leaves), np.inf, np.float32)
            self._reference = jax.jit(lambda t: [jnp.copy(a) for a in t])(leaves)
        else:
            change = np.asarray(jax.device_get(self._changes(leaves, self._reference)))
            send = change > self.threshold
            self._reference = self._keep(leaves, self._reference, send)
        current = jax.tree.leaves(self.engine.params)
        mixed = [new if s else old for new, old, s in zip(leaves, current, send)]
        self.engine.update_params(treedef.unflatten(mixed))
        unsent = change[~send]
        return int(send.sum()), {"sync/max_unsent_change": float(unsent.max()) if unsent.size else 0.0}

    def _check_placement(self, leaves) -> None:
        src = _device_set(leaves)
        dst = self.engine.devices
        ok = src == dst if self.mode == "colocated" else src.isdisjoint(dst)
        if not ok:
            raise ValueError(
                f"WeightSync(mode={self.mode!r}): the params are on devices {sorted(d.id for d in src)}, "
                f"the engine on {sorted(d.id for d in dst)}; "
                + (
                    "colocated needs exactly the engine's devices (use mode='disaggregated' for others)."
                    if self.mode == "colocated"
                    else "disaggregated needs devices disjoint from the engine's (use mode='colocated')."
                )
            )


def _max_abs(a, b):
    return jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)), initial=0.0)
