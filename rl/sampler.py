"""Where the sampler runs across processes, and how the trainer's weights reach it.

The sampler layout (`rl.engine.mesh`): the processes are cut into engine groups of `processes` consecutive
processes each (1: an engine per process; 0: one engine over every process). An engine's devices are its
processes' sampler devices (`rl.sampler_devices` of each, else its devices of the trainer's mesh), laid out
data x expert x tensor (`expert` and `tensor` of each engine; 0 takes `mesh.shape`'s); data, the rest, holds
replicas of the weights inside one engine (rows split over it). Every process of a group runs the same engine
program in lockstep (multi-controller JAX): the same scheduler decisions follow from the same inputs, so the
group's processes roll out the same tasks with the same seeds (`rl.distributed.TaskShard` gives a group one
slice) and read the environment's results from the group's first process (`SharedPool`).

Dimension key: G engines (groups), P processes, t / s a process's trainer / sampler device counts.

The weight push (`Layout.push`) is one jitted reshard of the trainer's arrays to every engine's layout
at once, on the trainer's devices: a "stage" mesh of the trainer's devices shaped (copies, G, *engine
mesh), where position (0, g, i) is a trainer device of the same process as device i of engine g
(colocated: that device itself, copies 1; disaggregated: copies = t / s). Each weight keeps its engine
spec there (replicated over copies and engines only), so no device holds more than its engine's share;
then each process copies its staged shards to its engine's devices (nothing to copy when colocated) and
views them as the engine's arrays (`jax.make_array_from_single_device_arrays`). No process materialises
replicated weights unless the engine layout itself replicates them (data-parallel sampling: `expert` =
`tensor` = 1).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import math
import pickle
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from configs.schema import ConfigError
from inference import GroupDrafter, ModelDrafter, MTPDrafter, NgramDrafter
from inference import weights as inference_weights
from inference.drafters import model_weights
from inference.weight_sync import WeightSync, moved_bytes
from model.sharding import make_mesh
from rl import distributed


@dataclasses.dataclass(frozen=True)
class Layout:
    """The sampler layout of one run, as every process sees it (the same on all)."""

    group: int  # this process's engine group
    members: tuple[int, ...]  # the processes of this group, first = its leader
    engines: tuple  # [G] each engine's Mesh (model.sharding.MESH_AXES), group order
    trainer: Any  # the trainer's Mesh

    @property
    def mesh(self):
        """This process's engine mesh."""
        return self.engines[self.group]

    @property
    def leader(self) -> bool:
        return jax.process_index() == self.members[0]

    @property
    def lockstep(self) -> bool:
        """One engine over several processes."""
        return len(self.members) > 1

    def describe(self) -> str:
        shape = {k: v for k, v in self.mesh.shape.items() if v > 1} or {"devices": 1}
        span = f"{len(self.members)} process(es)" if self.lockstep else "its process"
        return f"{len(self.engines)} engine(s), each over {span}, mesh {shape}"

    def share(self, samples: list, groups_each: int) -> list:
        """This process's part of its group's samples: the `groups_each` task groups (GRPO groups) at its
        place among the group's processes, in group id order (fewer when the rollout came back short)."""
        import jax

        ids = sorted({s.group for s in samples})
        k = self.members.index(jax.process_index())
        mine = set(ids[k * groups_each : (k + 1) * groups_each])
        return [s for s in samples if s.group in mine]

    def engine_weights(self, weights, model_cfg, engine_cfg):
        """`weights` (the trainer's `train_state.weights`, of the model `model_cfg`) for an `Engine(...,
        mesh=self.mesh, placed=self.placed)` to be built with `engine_cfg` (`to_engine`)."""
        if not self.placed:
            return weights
        return self.to_engine(weights, inference_weights.weight_shardings(model_cfg, engine_cfg, self.mesh))

    def to_engine(self, weights, targets):
        """`weights` for an engine whose weights are placed at `targets` (`Engine.weight_shardings()`):
        one process, as they are (the engine moves them); several, pushed to this process's engine layout
        (`push`)."""
        return self.push(weights, targets)[0] if self.placed else weights

    @property
    def placed(self) -> bool:
        """Whether the engine takes weights already in its layout (`Engine(..., placed=True)`): across
        processes, where the trainer's arrays span hosts the engine's may not."""
        import jax

        return jax.process_count() > 1

    def push(self, tree, targets) -> tuple[Any, int]:
        """(`tree` in this process's engine layout `targets` (a tree of NamedShardings on `self.mesh`,
        matching `tree`), bytes that landed on engine devices which lacked them, summed over engines)."""
        import jax

        leaves, treedef = jax.tree.flatten(tree)
        local = treedef.flatten_up_to(targets)
        staged_shardings = [self._staged(t.spec) for t in local]
        staged = _resharder(tuple(staged_shardings))(leaves)
        out = [self._unstage(x, t) for x, t in zip(staged, local)]
        moved = sum(_moved(x, s, self._colocated) for x, s in zip(leaves, staged_shardings))
        return treedef.unflatten(out), moved

    @functools.cached_property
    def _colocated(self) -> bool:
        return {d for m in self.engines for d in m.devices.flat} == set(self.trainer.devices.flat)

    @functools.cached_property
    def _stage_mesh(self):
        """The trainer's devices as (copies, G, *engine mesh): see the module docstring."""
        engine_grid = np.stack([m.devices for m in self.engines])  # [G, *engine mesh]
        trainer = list(self.trainer.devices.flat)
        if self._colocated:
            grid = engine_grid[None]
        else:
            by_process: dict[int, list] = {}
            for d in sorted(trainer, key=lambda d: d.id):
                by_process.setdefault(d.process_index, []).append(d)
            samplers: dict[int, list] = {}
            for d in sorted(engine_grid.flat, key=lambda d: d.id):
                samplers.setdefault(d.process_index, []).append(d)
            counts = {len(by_process.get(p, [])) // max(len(s), 1) for p, s in samplers.items()}
            copies = min(counts)
            if copies < 1 or any(len(by_process[p]) != copies * len(s) for p, s in samplers.items()):
                raise ConfigError(
                    "rl.sampler_devices: each process's trainer devices must be a multiple of its sampler "
                    f"devices (trainer {[len(v) for v in by_process.values()]}, sampler "
                    f"{[len(v) for v in samplers.values()]}); change rl.sampler_devices"
                )
            source = {}
            for p, s in samplers.items():
                for j, d in enumerate(s):
                    source[d] = [by_process[p][k * len(s) + j] for k in range(copies)]
            grid = np.empty((copies,) + engine_grid.shape, dtype=object)
            for pos in np.ndindex(*engine_grid.shape):
                for k in range(copies):
                    grid[(k,) + pos] = source[engine_grid[pos]][k]
        names = ("copies", "engines") + tuple(self.engines[0].axis_names)
        return Mesh(grid, names, axis_types=self.trainer.axis_types[:1] * len(names))

    def _staged(self, spec):
        return NamedSharding(self._stage_mesh, spec)

    def _unstage(self, staged, target):
        """This process's shards of `staged` on its engine's devices (copied from the stage's first row of
        copies), assembled as one array with the engine's sharding."""
        import jax

        grid = self._stage_mesh.devices[0, self.group]  # engine position -> its stage device
        source = dict(zip(self.mesh.devices.flat, grid.flat))
        by_device = {s.device: s.data for s in staged.addressable_shards}
        wanted = list(target.addressable_devices_indices_map(staged.shape))
        arrays = [by_device[source[d]] for d in wanted]
        if not self._colocated:
            arrays = jax.device_put(arrays, wanted)
        return jax.make_array_from_single_device_arrays(staged.shape, target, arrays)


@functools.lru_cache(maxsize=16)
def _resharder(shardings: tuple):
    return distributed.Together(jax.jit(lambda xs: list(xs), out_shardings=list(shardings)), "weight-push")


def _moved(x, staged, colocated: bool) -> int:
    """Bytes the engines' devices receive: what their stage devices lacked under `x`'s sharding (colocated),
    or every byte of their shards (disaggregated: all of it crosses to other devices)."""
    shape, size = tuple(x.shape), x.dtype.itemsize
    if colocated:
        return moved_bytes(x.sharding, staged, shape, size)
    return _first_copy_elements(staged, shape) * size


@functools.lru_cache(maxsize=4096)
def _first_copy_elements(staged, shape: tuple) -> int:
    """Elements the stage's first row of copies holds of an array of `shape` (what the engines receive)."""
    per_device = staged.devices_indices_map(shape)
    first = staged.mesh.devices[0].flat
    return sum(math.prod(len(range(n)[sl]) for sl, n in zip(per_device[d], shape)) for d in first)


def layout(cfg, trainer) -> Layout:
    """The run's sampler layout from `rl.engine.mesh`, `rl.sampler_devices` and the trainer's mesh; errors
    name the field."""
    spec = cfg.rl.engine.mesh
    count = jax.process_count()
    per = int(spec.processes) or count
    if count % per:
        raise ConfigError(
            f"rl.engine.mesh.processes={spec.processes} does not divide the {count} processes; give a "
            f"divisor of {count} (1: an engine per process, 0: one engine over all)"
        )
    n = int(cfg.rl.sampler_devices)
    engines = []
    for g in range(count // per):
        devices = []
        for p in range(g * per, (g + 1) * per):
            local = distributed.local_devices_of(p)
            mine = [d for d in trainer.devices.flat if d.process_index == p]
            devices += local[len(local) - n :] if n else mine
        engines.append(make_mesh(_engine_shape(cfg, trainer, len(devices), per), devices))
    group = jax.process_index() // per
    out = Layout(group, tuple(range(group * per, (group + 1) * per)), tuple(engines), trainer)
    out._stage_mesh  # noqa: B018 - a disaggregated layout that cannot stage is refused now, not at a push
    return out


def _engine_shape(cfg, trainer, n: int, per: int) -> dict[str, int]:
    shape = {"data": -1}
    for axis in ("expert", "tensor"):
        given = int(cfg.rl.engine.mesh[axis])
        size = given or int(trainer.shape[axis])
        field = f"rl.engine.mesh.{axis}" if given else f"mesh.shape.{axis} (rl.engine.mesh.{axis}=0 takes it)"
        if size > 1:
            if (n // shape.get("expert", 1)) % size:
                raise ConfigError(
                    f"{field}={size} does not divide an engine's {n} devices ({per} process(es) of "
                    f"rl.engine.mesh.processes, rl.sampler_devices={cfg.rl.sampler_devices}); pick sizes "
                    "that divide them"
                )
            shape[axis] = size
    return shape


class SharedPool:
    """An `EnvPool` whose results every process of an engine group shares: the group's first process steps
    the environments, the others read its results (the coordination service's key-value store), so every
    process of the group feeds its engine the same observations. Any other attribute is the pool's."""

    def __init__(self, pool, layout: Layout):
        self.pool, self.layout = pool, layout
        self._calls = 0
        self._client = None

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def score_many(self, items):
        return self._shared("score_many", items)

    def run_episodes(self, items):
        return self._shared("run_episodes", items)

    def _shared(self, method: str, items):
        from jax._src import distributed as jax_distributed

        client = jax_distributed.global_state.client
        self._calls += 1
        key = lambda call: f"rl.sampler/{self.layout.group}/{call}"  # noqa: E731
        if not self.layout.leader:
            return pickle.loads(base64.b64decode(client.blocking_key_value_get(key(self._calls), 3_600_000)))
        out = getattr(self.pool, method)(items)
        client.key_value_set(key(self._calls), base64.b64encode(pickle.dumps(out)).decode("ascii"))
        # The group's engine ran a collective since the previous call, which every member joined after
        # reading that call's results: its key can go.
        if self._calls > 1:
            client.key_value_delete(key(self._calls - 1))
        return out


def make_drafter(engine_cfg, draft_cfg, draft_state, sampler_weights):
    kind = engine_cfg.draft
    if kind == "mtp":
        return MTPDrafter()
    if kind == "ngram":
        return NgramDrafter(engine_cfg.draft_ngram)
    if kind == "group":
        return GroupDrafter(engine_cfg.draft_ngram)
    if kind == "model":
        return ModelDrafter(draft_cfg, sampler_weights(draft_state, draft=True))
    return None


def weight_push(cfg, engine, place, processes: int):
    """`push(weights) -> metrics`: the trainer's weights to the engine after each update. One process: the
    engine is on the trainer's devices (colocated: one jitted reshard to the inference layout) or on its own
    (rl.sampler_devices: disaggregated, device to device), every leaf or, with rl.weight_sync_delta >= 0, the
    changed ones (`inference.WeightSync`). Across processes: one jitted push to every engine's layout at once
    (`rl.sampler.Layout.push`), taken by the engine as it is."""
    rl = cfg.rl
    if processes > 1:

        def push_placed(weights) -> dict:
            t0 = time.perf_counter()
            weights = model_weights("params", weights, engine.params, keep=engine.params)
            local, moved = place.push(weights, engine.weight_shardings())
            engine.update_params(local, placed=True)
            return {"sync/seconds": time.perf_counter() - t0, "sync/bytes": float(moved)}

        return push_placed
    mode = "disaggregated" if rl.sampler_devices else "colocated"
    delta = float(rl.weight_sync_delta) if rl.weight_sync_delta >= 0 else None
    sync = WeightSync(engine, mode, delta_threshold=delta)
    return lambda weights: {k: float(v) for k, v in sync.push(weights).items()}
