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
from jax import lax
from jax.sharding import Mesh, NamedSharding

from inference.drafters import model_weights
from inference.layout import Tree

MODES = ("colocated", "disaggregated")


def to_layout(tree, shardings, *, current=None, send=None, copy: bool = True) -> tuple:
    """(`tree` moved to `shardings`, bytes moved): see the module docstring. With `send` (a bool per leaf,
    in `jax.tree.leaves` order) and `current` (the engine's weights now), only the leaves sent move and
    the others keep `current`'s values: one jitted program whatever the subset (a `lax.cond` per leaf), so
    a delta sync never compiles again. Host (numpy) leaves are put straight to their target. `copy=False`:
    a tree already placed exactly at `shardings` is returned as it is (no copy, 0 bytes moved)."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    if not copy and send is None and all(getattr(x, "sharding", None) == t for x, t in zip(leaves, targets)):
        return tree, 0
    if send is None:
        host = [not isinstance(x, jax.Array) for x in leaves]
        out = list(leaves)
        for i in (i for i, h in enumerate(host) if h):
            out[i] = jax.device_put(leaves[i], targets[i])
        device = [i for i, h in enumerate(host) if not h]
        for i, y in zip(device, _move([leaves[i] for i in device], [targets[i] for i in device])):
            out[i] = y
        sent = range(len(leaves))
    else:
        send = np.asarray(send, bool).reshape(len(leaves))
        out = _move_some(leaves, targets, treedef.flatten_up_to(current), send)
        sent = np.flatnonzero(send)
    moved = sum(
        moved_bytes(
            getattr(leaves[i], "sharding", None), targets[i], np.shape(leaves[i]), leaves[i].dtype.itemsize
        )
        for i in sent
    )
    return treedef.unflatten(out), moved


def _move(leaves: list, targets: list) -> list:
    if not leaves:
        return []
    src, dst = _device_set(leaves), _device_set(targets)
    if src == dst:
        return _copier(targets)(leaves)
    if src.isdisjoint(dst):
        staged = _copier([_shadow(_named(s), src) for s in targets])(leaves)
        return _copy_shards(staged, targets, range(len(leaves)))
    if all(len(x.sharding.device_set) == 1 for x in leaves):  # e.g. weights built on the default device
        return jax.device_put(leaves, targets, may_alias=False)  # slices on device, no host round trip
    raise ValueError(_overlap(src, dst))


def _move_some(leaves: list, targets: list, current: list, send: np.ndarray) -> list:
    src, dst = _device_set(leaves), _device_set(targets)
    if src == dst:
        return _copier(targets, masked=True)(leaves, current, send)
    if src.isdisjoint(dst):
        staged = _copier([_shadow(_named(s), src) for s in targets], masked=True)(leaves, None, send)
        out = list(current)
        for i, y in zip(np.flatnonzero(send), _copy_shards(staged, targets, np.flatnonzero(send))):
            out[i] = y
        return out
    if all(len(x.sharding.device_set) == 1 for x in leaves):
        return [
            jax.device_put(x, s, may_alias=False) if keep else c
            for x, s, c, keep in zip(leaves, targets, current, send)
        ]
    raise ValueError(_overlap(src, dst))


def _overlap(src: set, dst: set) -> str:
    return (
        f"weights on devices {sorted(d.id for d in src)} partly overlap the engine's "
        f"{sorted(d.id for d in dst)}; place them on exactly the engine's devices (colocated) or on "
        "devices disjoint from them (disaggregated)."
    )


def _device_set(arrays_or_shardings) -> set:
    return {d for x in arrays_or_shardings for d in getattr(x, "sharding", x).device_set}


@functools.lru_cache(maxsize=256)
def _copier_for(targets, masked: bool):
    out = targets.tree
    if not masked:
        return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=out)

    def some(new, current, send):
        """Leaf i: `new[i]` resharded where send[i], else `current[i]` (zeros without `current`); the
        reshard sits inside the taken branch, so an unsent leaf runs no collective."""
        pick = lambda i, s: lax.cond(
            send[i],
            lambda: lax.with_sharding_constraint(new[i], s),
            lambda: lax.with_sharding_constraint(
                jnp.zeros_like(new[i]) if current is None else current[i], s
            ),
        )
        return [pick(i, s) for i, s in enumerate(out)]

    return jax.jit(some, out_shardings=out)


def _copier(targets: list, masked: bool = False):
    """A jitted copy of a list of arrays to `targets` (cached per targets); `masked`: `some` above."""
    return _copier_for(Tree(list(targets)), masked)


def _copy_shards(staged: list, targets: list, which) -> list:
    """Engine arrays of `targets` for leaves `which`, each shard copied device to device from the
    staged leaf's shard on the source device at the same mesh position (`_shadow`)."""
    arrays, devices, counts = [], [], []
    for i in which:
        x, s = staged[i], _named(targets[i])
        by_device = {shard.device: shard.data for shard in x.addressable_shards}
        source = dict(zip(s.mesh.devices.flat, x.sharding.mesh.devices[0].flat))
        here = list(s.addressable_devices_indices_map(x.shape))
        counts.append(len(here))
        arrays += [by_device[source[d]] for d in here]
        devices += here
    copies = jax.device_put(arrays, devices) if arrays else []
    out, k = [], 0
    for i, n in zip(which, counts):
        out.append(jax.make_array_from_single_device_arrays(staged[i].shape, targets[i], copies[k : k + n]))
        k += n
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
    returns at once. Every delta push runs the same executables, whatever leaves it sends.

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
        self._copy = jax.jit(lambda t: [jnp.copy(a) for a in t])
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
        if self._reference is None:  # nothing sent before: everything goes
            send = np.ones(len(leaves), bool)
            change = np.full(len(leaves), np.inf, np.float32)
            self._reference = self._keep(leaves, self._copy(leaves), send)
        else:
            change = np.asarray(jax.device_get(self._changes(leaves, self._reference)))
            send = change > self.threshold
            self._reference = self._keep(leaves, self._reference, send)
        self.engine.update_params(treedef.unflatten(leaves), send=send)
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
