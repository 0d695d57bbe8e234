"""python benchmarks/weight_sync.py [--config small] [--steps 5] [--out results/weight_sync.jsonl]

Weight-sync seconds and bytes per step (`inference.weight_sync.WeightSync.push`) from a trainer holding the
params FSDP-sharded (the training rules) to an `inference.Engine` on its inference layout, on 8 devices (8
fake CPU devices unless XLA_FLAGS says otherwise):

- colocated: trainer fsdp=8 and engine data=4 x tensor=2 on the same 8 devices (one jitted reshard);
- disaggregated: trainer fsdp=4 on devices 0-3, engine data=2 x tensor=2 on devices 4-7 (a jitted reshard on
  the trainer's devices, then device-to-device copies of the engine's shards);
- beside both, a plain `jax.device_put` of the params to the engine's shardings (between different
  partitionings it reads each array through the host);
- delta: both modes with `delta_threshold` in --thresholds, over synthetic updates (below).

Each step applies a synthetic optimizer update on the trainer's devices: every leaf moves by
`lr * s_leaf * (+-1 per element)`, with a fixed per-leaf scale s_leaf log-uniform in [0.01, 1] (some leaves
move fast, most slowly), so a threshold sends a leaf once its largest element drift since it was last sent
exceeds it. One warm push (compiles) precedes the timed steps. Per step: `push_s` (until `push` returned: the
transfer is asynchronous), `sync_s` (until the engine's weights are ready), bytes sent to engine devices that
lacked them, leaves sent. One JSON line per mode and threshold, with the load average before and after.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import importlib
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import model
from inference.engine import Engine, EngineConfig
from inference.weight_sync import WeightSync
from model import sharding

ENGINE = EngineConfig(max_batch=1, max_seq_len=16, page_size=16, num_pages=4, prefill_chunk=16, min_bucket=16)


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", help="a configs/ module name")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4, help="synthetic update size (largest leaf scale)")
    p.add_argument("--thresholds", default="0,3e-5,1e-4", help="delta_threshold values, comma-separated")
    p.add_argument("--out", default="", help="append the JSON lines to this file too")
    args = p.parse_args()
    cfg = importlib.import_module(f"configs.{args.config}").get_config()
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
    for name, train, mesh, mode, threshold, naive in runs:
        line = json.dumps(run(name, cfg, train, mesh, mode, threshold, args.steps, args.lr, naive))
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
