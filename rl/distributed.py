"""Many hosts, one program: multi-controller JAX for the main job (no Pathways).

Every host runs the same command; each process owns its local devices, its own environment pool and its share
of every step's prompts. What the processes share is the trainer's mesh (all devices but the sampler's) and
the collectives over it.

    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python -m rl.train ...

`initialize()` joins the processes when those three variables are set, or when JAX's own cluster detection
applies (TPU pod slices, SLURM with more than one task: `jax.distributed.initialize()` reads their
environment); on CPU the collectives are gloo's. One process (no variables) is the same code path with a
process count of 1.

Dimension key: B rows of the global batch, P processes.

- Prompts: every process draws the same global task list (the streams and the curriculum are replicated and
  deterministic) and rolls out its slice (`TaskShard`); group ids, and so sampling keys, are global.
- The batch: each process's rows become one global array (`global_batch`,
  `jax.make_array_from_process_local_data`); row order is process order, which is the mesh's device order.
- Weights to the sampler: `rl.sampler` (engines per process or spanning several, one jitted reshard).
- Small host values (curriculum counts, the preemption flag) are exchanged with `allgather`.
- Process 0 alone writes metrics, samples, evaluation files and the final table (`is_primary`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _cluster_detected() -> bool:
    """A multi-task SLURM job or a multi-host TPU slice: JAX's own detection knows how to join them."""
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1


def initialize() -> tuple[int, int]:
    """Joins the other processes (once; later calls return at once). Returns (process index, count)."""
    import jax

    if _initialized():
        return jax.process_index(), jax.process_count()
    given = [v for v in ENV_VARS if os.environ.get(v)]
    if given and len(given) != len(ENV_VARS):
        missing = sorted(set(ENV_VARS) - set(given))
        raise ValueError(f"multi-host run: {given} are set but {missing} are not; set all three or none")
    if not given and not _cluster_detected():
        return process()  # one process, or a TPU runtime that joins its hosts by itself
    if _on_cpu():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if given:
        jax.distributed.initialize(
            os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    logging.info("process %d of %d joined", jax.process_index(), jax.process_count())
    return jax.process_index(), jax.process_count()


def _initialized() -> bool:
    try:
        from jax._src import distributed

        return distributed.global_state.client is not None
    except (ImportError, AttributeError):  # a JAX that moved it: initialize() raises if called twice
        return False


def _on_cpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "") or os.environ.get("JAX_PLATFORM_NAME", "")
    if platforms:
        return platforms.split(",")[0] == "cpu"
    try:
        import jax

        return jax.config.jax_platforms in ("cpu",)
    except AttributeError:
        return False


def process() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


def is_primary() -> bool:
    import jax

    return jax.process_index() == 0


def allgather(values: Sequence[float]) -> np.ndarray:
    """[P, len(values)] float64: every process's values, on every process (one collective)."""
    import jax

    row = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return row[None]
    from jax.experimental import multihost_utils

    # f32 on the wire (x64 is off); counts and seconds of one step are far below 2**24.
    out = multihost_utils.process_allgather(row.astype(np.float32))
    return np.asarray(out, np.float64).reshape(jax.process_count(), len(row))


def any_process(flag: bool) -> bool:
    """True on every process when it is True on any (a preemption seen by one host stops them all)."""
    return bool(allgather([float(flag)]).max() > 0)


def global_batch(local: dict[str, np.ndarray], shardings: dict[str, Any], row_axis: dict[str, int]) -> dict:
    """Global arrays from each process's rows: `row_axis[k]` is the row dimension of entry k (process order
    along it, each process holding B / P rows)."""
    import jax

    count = jax.process_count()
    out = {}
    for k, v in local.items():
        shape = list(v.shape)
        shape[row_axis.get(k, 0)] *= count
        out[k] = jax.make_array_from_process_local_data(shardings[k], np.asarray(v), tuple(shape))
    return out


def sampler_devices(cfg) -> list:
    """This process's devices kept for the engine (`rl.sampler_devices`, its last local ones), or []."""
    import jax

    n = int(cfg.rl.sampler_devices)
    local = jax.local_devices()
    if n >= len(local):
        raise ValueError(
            f"rl.sampler_devices={n} leaves the trainer none of this process's {len(local)} devices; "
            f"use at most {len(local) - 1} (0: the engine shares the trainer's devices)"
        )
    return local[len(local) - n :] if n else []


def trainer_mesh(cfg):
    """The trainer's mesh from `cfg.mesh` over every device of every process but the engines' (one device:
    a mesh of 1)."""
    import jax

    from model.sharding import make_mesh

    n = len(sampler_devices(cfg))  # every process keeps its last n local devices for its engine
    kept = set()
    for p in range(jax.process_count()) if n else ():
        local = local_devices_of(p)
        kept |= {d.id for d in local[len(local) - n :]}
    return make_mesh(cfg.mesh.shape, [d for d in jax.devices() if d.id not in kept])


def local_devices_of(process_index: int) -> list:
    import jax

    return [d for d in jax.devices() if d.process_index == process_index]


class TaskShard:
    """One process's part of each rollout round: every process asks for what it still misses, one global
    draw of the sum is made (the same on every process: replicated streams), and process p takes the slice
    after the needs of processes 0..p-1. `draw` returns (tasks, global id of the first one's group).

    `members` > 1: processes come in groups of that many consecutive ones sharing one engine (`rl.sampler`);
    every member of a group asks for the group's need and gets the group's slice (the slices follow the
    groups' first processes' needs)."""

    def __init__(self, next_tasks, members: int = 1):
        self.next_tasks, self.members = next_tasks, members
        self.base = 0  # groups drawn so far in this batch's rounds, over all processes (one shard per batch)

    def draw(self, need: int) -> tuple[list, int]:
        index, _ = process()
        needs = allgather([need])[:: self.members, 0].astype(int)  # one need per group: its first process's
        total = int(needs.sum())
        tasks = self.next_tasks(total) if total else []
        start = int(needs[: index // self.members].sum())
        first = self.base + start
        self.base += len(tasks)
        return tasks[start : start + need], first

    def all_done(self, done: bool) -> bool:
        return not any_process(not done)


def barrier(name: str, timeout_s: float = 1800.0) -> None:
    """Every process waits here (the coordination service, not a collective: no gloo context needed)."""
    import jax

    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed

    jax_distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


class Together:
    """A jitted function whose every new executable is compiled first, then run once all processes have
    compiled it. Gloo connects a collective's peers when it first runs and gives up after a fixed timeout;
    a process that compiled 30 s faster than another (a loaded host) would fail there. One process: the
    jitted function itself."""

    _count = 0

    def __init__(self, jitted, name: str):
        self.jitted, self.name = jitted, name
        self._compiled: dict = {}

    def __call__(self, *args):
        import jax

        if jax.process_count() == 1:
            return self.jitted(*args)
        return self._executable(args)(*args)

    def compile(self, *args) -> None:
        """Compiles the executable a call with `args` (arrays, or `jax.ShapeDtypeStruct`s with the shardings
        the call will see) runs, without running it: that call then compiles nothing."""
        import jax

        if jax.process_count() == 1:
            self.jitted.lower(*args).compile()  # jit's compilation cache keeps it for the call
        else:
            self._executable(args)

    def _executable(self, args):
        import jax

        leaves, treedef = jax.tree.flatten(args)
        key = (treedef, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves))
        exe = self._compiled.get(key)
        if exe is None:
            exe = self._compiled[key] = self.jitted.lower(*args).compile()
            Together._count += 1
            barrier(f"{self.name}:{Together._count}")
        return exe
