"""python -m benchmarks weight_sync [--config small] [--steps 5] [--out results/weight_sync.jsonl]
python -m benchmarks weight_sync --processes 2 [--config test] [--out results/weight_sync_hosts.jsonl]

Weight-sync seconds and bytes per step from a trainer holding the params FSDP-sharded (the training rules) to
the sampler's engines on their inference layout.

One process (`inference.weight_sync.WeightSync.push`, `--config` a configs/ module, default `small`), on 8
devices (8 fake CPU devices unless XLA_FLAGS says otherwise):

- colocated: trainer fsdp=8 and engine data=4 x tensor=2 on the same 8 devices (one jitted reshard);
- disaggregated: trainer fsdp=4 on devices 0-3, engine data=2 x tensor=2 on devices 4-7 (a jitted reshard on
  the trainer's devices, then device-to-device copies of the engine's shards);
- beside both, a plain `jax.device_put` of the params to the engine's shardings (between different
  partitionings it reads each array through the host);
- delta: both modes with `delta_threshold` in --thresholds, over synthetic updates (below).

Across processes (`--processes N`: N child processes of this script, `--child`, of 4 fake CPU devices each,
joined by `rl.distributed.initialize` with gloo CPU collectives; `--config` a `configs/grpo.py` argument,
default `test`): the main job's push (`rl/train.py`'s `_weight_sync` across processes:
`rl.sampler.Layout.push` of `rl.train_state.weights(state)` to every engine's layout in one jitted reshard,
then `Engine.update_params(..., placed=True)`) from a state of `rl.train_state.init_state` on the trainer's
mesh (`rl.distributed.trainer_mesh`), for each sampler layout in `HOST_LAYOUTS` (`rl.engine.mesh`,
`rl.sampler_devices`):

- engine_each_data: an engine per process, data-parallel (expert 1, tensor 1: each engine device holds all
  the weights);
- engine_each_e2t2: an engine per process, expert 2 x tensor 2 over its 4 devices;
- one_engine_e2t2: one engine over every process (processes=0), expert 2 x tensor 2 (data N);
- disaggregated_each: rl.sampler_devices=1 (each process's last device is its engine's, the trainer takes the
  other 3 of each);
- disaggregated_each_t2: rl.sampler_devices=2, each engine tensor 2 over its process's last 2 devices.

The trainer's mesh is the first of fsdp n, then data n/f x fsdp f (f the divisors of n, largest first) over
the trainer's n devices that the model's dimensions (`model.config.validate`) and the batch geometry
(`rl.validate.check_mesh`) allow: fsdp 8 when colocated. A layout no mesh or engine shape allows (the test
config's 8 rows do not divide over 6 trainer devices, nor d_model 64 over fsdp 6 or 3) prints a line with the
reasons instead of figures. Per layout: `sync_s` (push through `update_params` until the engine's weights are
ready) median and min, `push_s_median` (until `update_params` returned: the copies are asynchronous), the
bytes `Layout.push` moved to engine devices that lacked them per step (summed over engines), the largest
bytes the engine's weights hold on one of process 0's devices (`rl.memory.per_device`), the param bytes, and
`memory/device_bytes` (`rl.memory.device_bytes`: the largest bytes of live arrays on one local device: the
trainer state, the engine's weights and KV pages) after the steps, beside the planner's figure for the same
meshes (`plan_device_bytes`: `rl.plan.memory.device_bytes`'s total). After each timed push, untimed, the
main job's `gc.collect(1)` (`gc_s_median`; without it the replaced engine weights stay live in nnx's
reference cycles: one more engine copy per device). Process 0's lines are printed, with every process's
`sync_s` median beside (`sync_s_median_by_process`).

Each step applies a synthetic optimizer update on the trainer's devices: every leaf moves by
`lr * s_leaf * (+-1 per element)`, with a fixed per-leaf scale s_leaf log-uniform in [0.01, 1] (some leaves
move fast, most slowly), so a threshold sends a leaf once its largest element drift since it was last sent
exceeds it. One warm push (compiles) precedes the timed steps. Per step: `push_s` (until `push` returned: the
transfer is asynchronous), `sync_s` (until the engine's weights are ready), bytes sent to engine devices that
lacked them, leaves sent. One JSON line per mode and threshold (per layout across processes), with the load
average before and after.
"""

from __future__ import annotations

import os
import sys

from benchmarks import hosts
from benchmarks.record import emit, loadavg

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import gc
import importlib
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import model
from configs.schema import ConfigError
from inference.drafters import model_weights
from inference.engine import Engine, EngineConfig
from inference.weight_sync import WeightSync
from model import sharding

ENGINE = EngineConfig(max_batch=1, max_seq_len=16, page_size=16, num_pages=4, prefill_chunk=16, min_bucket=16)


def trainer_params(cfg, devices, seed: int = 0):
    """The params as the trainer holds them: built on an FSDP mesh of `devices` with the training rules."""
    return nnx.state(
        model.build(cfg, seed=seed, mesh=sharding.make_mesh({"fsdp": len(devices)}, devices)), nnx.Param
    )


def make_update(params, lr: float, seed: int):
    """A jitted synthetic optimizer step on the trainer's devices (see the module docstring)."""
    leaves = jax.tree.leaves(params)
    scales = np.exp(np.random.default_rng(seed).uniform(np.log(0.01), 0.0, len(leaves))).astype(np.float32)

    @jax.jit
    def update(params, key):
        flat, treedef = jax.tree.flatten(params)
        keys = jax.random.split(key, len(flat))
        moved = [
            a + (lr * s * jnp.where(jax.random.bernoulli(k, 0.5, a.shape), 1.0, -1.0)).astype(a.dtype)
            for a, s, k in zip(flat, scales, keys)
        ]
        return treedef.unflatten(moved)

    return update


def run(name, cfg, train_devices, engine_mesh, mode, threshold, steps, lr, naive=False) -> dict:
    params = trainer_params(cfg, train_devices)
    engine = Engine(cfg, params, ENGINE, mesh=engine_mesh)
    sync = WeightSync(engine, mode, delta_threshold=threshold)
    update = make_update(params, lr, seed=1)
    targets = jax.tree.map(lambda a: a.sharding, engine.params)
    before = loadavg()
    key = jax.random.key(0)
    params = update(params, jax.random.fold_in(key, 0))
    sync.push(params)  # warm: compiles (and a delta sync's first push sends everything)
    jax.block_until_ready(engine.params)
    rows = []
    for step in range(1, steps + 1):
        params = jax.block_until_ready(update(params, jax.random.fold_in(key, step)))
        t0 = time.perf_counter()
        metrics = sync.push(params)
        t1 = time.perf_counter()
        jax.block_until_ready(engine.params)
        rows.append(
            {
                "push_s": t1 - t0,
                "sync_s": time.perf_counter() - t0,
                "bytes": metrics["sync/bytes"],
                "leaves_sent": metrics["sync/leaves_sent"],
            }
        )
    out = {
        "bench": "weight_sync",
        "name": name,
        "mode": mode,
        "delta_threshold": threshold,
        "params_m": round(sum(a.size for a in jax.tree.leaves(params)) / 1e6, 2),
        "param_bytes": int(sum(a.nbytes for a in jax.tree.leaves(params))),
        "engine_bytes": int(
            sum(sum(s.data.nbytes for s in a.addressable_shards) for a in jax.tree.leaves(engine.params))
        ),
        "trainer_mesh": {"fsdp": len(train_devices)},
        "engine_mesh": {k: v for k, v in engine_mesh.shape.items() if v > 1},
        "leaves": metrics["sync/leaves"],
        "steps": steps,
        "lr": lr,
        "sync_s_median": float(np.median([r["sync_s"] for r in rows])),
        "push_s_median": float(np.median([r["push_s"] for r in rows])),
        "bytes_per_step": [r["bytes"] for r in rows],
        "leaves_sent_per_step": [r["leaves_sent"] for r in rows],
        "gb_per_s": float(np.sum([r["bytes"] for r in rows]) / np.sum([r["sync_s"] for r in rows]) / 1e9),
    }
    if naive:  # a plain device_put to the engine's shardings, for comparison (through the host if need be)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(jax.device_put(params, targets))
            times.append(time.perf_counter() - t0)
        out["plain_device_put_s_median"] = float(np.median(times))
    out.update(loadavg_before=before, loadavg_after=loadavg())
    return out


# --- Across processes -------------------------------------------------------------------------------------

DEVICES_EACH = 4  # fake CPU devices per child process
# name -> (rl.engine.mesh.processes, rl.engine.mesh.expert, rl.engine.mesh.tensor, rl.sampler_devices)
HOST_LAYOUTS = {
    "engine_each_data": (1, 1, 1, 0),
    "engine_each_e2t2": (1, 2, 2, 0),
    "one_engine_e2t2": (0, 2, 2, 0),
    "disaggregated_each": (1, 1, 1, 1),
    "disaggregated_each_t2": (1, 1, 2, 2),
}


def trainer_shape(cfg, processes: int, n: int) -> tuple[dict[str, int] | None, list[str]]:
    """The trainer's mesh shape over its `n` devices (the module docstring's order; set on `cfg.mesh.shape`),
    or None, with why each shape tried before was refused."""
    from model import config as model_config
    from rl import distributed, train_state, validate

    refused = []
    for f in sorted((f for f in range(1, n + 1) if n % f == 0), reverse=True):
        shape = {"data": n // f, "fsdp": f}
        cfg.mesh.shape.update(shape)
        try:
            model_config.validate(cfg, n)
            mesh = distributed.trainer_mesh(cfg)
            validate.check_mesh(cfg, processes, batch_shards=train_state.batch_shard_count(cfg, mesh))
            return shape, refused
        except ConfigError as e:
            refused.append(f"{_sizes(shape)}: {e}")
    return None, refused


def _sizes(shape) -> dict[str, int]:
    return {k: int(v) for k, v in dict(shape).items() if v != 1} or {"devices": 1}


def host_layout(config: str, name: str, steps: int, lr: float) -> dict:
    """One layout's line (see the module docstring), on every process; the pushes are collectives."""
    from configs import grpo
    from rl import distributed, memory, sampler, train_state, validate
    from rl.plan import memory as plan_memory

    per, expert, tensor, sampler_devices = HOST_LAYOUTS[name]
    processes = jax.process_count()
    cfg = grpo.get_config(config)
    cfg.rl.sampler_devices = sampler_devices
    cfg.rl.engine.mesh.update(processes=per, expert=expert, tensor=tensor)
    head = {"bench": "weight_sync_hosts", "name": name, "config": config, "processes": processes}
    head["sampler_devices"] = sampler_devices
    shape, refused = trainer_shape(cfg, processes, processes * (DEVICES_EACH - sampler_devices))
    if shape is None:
        return {**head, "skipped": "no trainer mesh fits: " + "; ".join(refused)}
    mesh = distributed.trainer_mesh(cfg)
    _, state = train_state.init_state(cfg, mesh=mesh, seed=0)
    engine_cfg = validate.engine_config(cfg)
    try:  # the layout's errors name the field (an engine shape, rl.sampler_devices against the trainer's)
        place = sampler.layout(cfg, mesh)
        weights = place.engine_weights(train_state.weights(state), cfg, engine_cfg)
    except ConfigError as e:
        return {**head, "skipped": str(e)}
    engine = Engine(cfg, weights, engine_cfg, mesh=place.mesh, placed=place.placed)
    del weights

    def push(weights) -> int:  # rl/train.py's _weight_sync across processes (push_placed), less its metrics
        weights = model_weights("params", weights, engine.params, keep=engine.params)
        local, moved = place.push(weights, engine.weight_shardings())
        engine.update_params(local, placed=True)
        return moved

    update = make_update(state.params, lr, seed=1)
    before = loadavg()
    key = jax.random.key(0)
    state = state.replace(params=update(state.params, jax.random.fold_in(key, 0)))
    push(train_state.weights(state))  # warm: compiles
    jax.block_until_ready(engine.params)
    rows = []
    for step in range(1, steps + 1):
        state = state.replace(
            params=jax.block_until_ready(update(state.params, jax.random.fold_in(key, step)))
        )
        t0 = time.perf_counter()
        moved = push(train_state.weights(state))
        t1 = time.perf_counter()
        jax.block_until_ready(engine.params)
        t2 = time.perf_counter()
        # As rl/train.py after each push: nnx's tree flattening leaves reference cycles that hold the replaced
        # engine weights (a second copy on every engine device) until Python's next cyclic collection.
        gc.collect(1)
        row = {"push_s": t1 - t0, "sync_s": t2 - t0, "gc_s": time.perf_counter() - t2, "bytes": int(moved)}
        rows.append(row)
    sync_s = [r["sync_s"] for r in rows]
    planned = plan_memory.device_bytes(
        cfg,
        dict(mesh.shape),
        {a: int(place.mesh.shape[a]) for a in ("data", "expert", "tensor")},
        colocated=not sampler_devices,
    )
    by_process = distributed.allgather([float(np.median(sync_s))])[:, 0]
    leaves = jax.tree.leaves(train_state.weights(state))
    engine_bytes = memory.per_device(jax.tree.leaves(engine.params))
    return {
        **head,
        "trainer_mesh": _sizes(mesh.shape),
        "engines": len(place.engines),
        "engine_processes": len(place.members),
        "engine_mesh": _sizes(place.mesh.shape),
        "steps": steps,
        "lr": lr,
        "params_m": round(sum(a.size for a in leaves) / 1e6, 3),
        "param_bytes": int(sum(a.size * a.dtype.itemsize for a in leaves)),
        "engine_bytes_per_device": int(max(engine_bytes.values())),
        "bytes_per_step": [r["bytes"] for r in rows],
        "sync_s_median": float(np.median(sync_s)),
        "sync_s_min": float(np.min(sync_s)),
        "push_s_median": float(np.median([r["push_s"] for r in rows])),
        "sync_s_median_by_process": [round(float(v), 4) for v in by_process],
        "gc_s_median": float(np.median([r["gc_s"] for r in rows])),
        "memory/device_bytes": memory.device_bytes(),
        "plan_device_bytes": planned["total"],
        "loadavg_before": before,
        "loadavg_after": loadavg(),
    }


def child(args) -> None:
    """One of the `--processes` children: every layout in turn; process 0 prints a RESULT line for each."""
    from rl import distributed

    index, _ = distributed.initialize()  # JAX_COORDINATOR_ADDRESS etc. from the parent; gloo on CPU
    for name in HOST_LAYOUTS:
        out = host_layout(args.config or "test", name, args.steps, args.lr)
        gc.collect()  # the layout's engine and state go before the next one's device_bytes
        if index == 0:
            print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def across_processes(args) -> list[dict]:
    """Starts the children, waits for them (stopping the others when one fails); process 0's lines."""
    argv = [
        sys.executable,
        "-m",
        "benchmarks",
        "weight_sync",
        "--child",
        "--steps",
        str(args.steps),
        "--lr",
        str(args.lr),
    ]
    argv += ["--config", args.config] if args.config else []
    with tempfile.TemporaryDirectory() as tmp:
        procs, paths = hosts.start(argv, processes=args.processes, devices=DEVICES_EACH, log_dir=tmp)
        failed = hosts.wait(procs, args.timeout)
        texts = [path.read_text() for path in paths]
    if failed is not None:
        sys.exit(f"child process {failed} failed (rc {procs[failed].returncode}):\n{texts[failed][-4000:]}")
    return [json.loads(x[len("RESULT ") :]) for x in texts[0].splitlines() if x.startswith("RESULT ")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        default="",
        help="a configs/ module (default small); with --processes a configs/grpo.py argument (default test)",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4, help="synthetic update size (largest leaf scale)")
    p.add_argument("--thresholds", default="0,3e-5,1e-4", help="delta_threshold values, comma-separated")
    p.add_argument(
        "--processes", type=int, default=1, help="> 1: the layouts across that many child processes"
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds the children may take (--processes)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help="append the JSON lines to this file too")
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.processes > 1:
        start = loadavg()
        devices = f"{args.processes} processes x {DEVICES_EACH} fake CPU devices, gloo collectives"
        lines = [{**out, "devices": devices, "loadavg_start": start} for out in across_processes(args)]
    else:
        lines = one_process(args)
    for out in lines:
        emit(out, out=args.out)


def one_process(args) -> list[dict]:
    cfg = importlib.import_module(f"configs.{args.config or 'small'}").get_config()
    devices = jax.devices()
    if len(devices) != 8:
        sys.exit(f"needs 8 devices, found {len(devices)}")
    colocated = sharding.make_mesh({"data": 4, "tensor": 2}, devices)
    apart = sharding.make_mesh({"data": 2, "tensor": 2}, devices[4:])
    runs = [
        ("colocated", devices, colocated, "colocated", None, True),
        ("disaggregated", devices[:4], apart, "disaggregated", None, True),
    ]
    for t in (float(x) for x in args.thresholds.split(",") if x):
        runs.append((f"colocated_delta_{t:g}", devices, colocated, "colocated", t, False))
        runs.append((f"disaggregated_delta_{t:g}", devices[:4], apart, "disaggregated", t, False))
    return [
        run(name, cfg, train, mesh, mode, threshold, args.steps, args.lr, naive)
        for name, train, mesh, mode, threshold, naive in runs
    ]


if __name__ == "__main__":
    main()
