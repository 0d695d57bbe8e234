"""python -m benchmarks grpo_ab [--sections=window,warmup] [--calls=8] [--pairs=2]

A/B checks behind two of the GRPO step's changes, on `grpo_step.py`'s anchor shapes (dense, 16 rows of 32 +
64 tokens), one JSON line per section:

- `window`: the update (`rl.train_step.make_grpo_update`: reference log-probs, then the train step) built
  twice in one process, with the logit window (`losses.logit_window`, 64 of 96 positions) and without
  (every position's logits), called alternately on one random batch (mask on the 64 completion positions);
  median seconds over the calls after the first, and the largest difference of any scalar metric.
- `warmup`: the main job's warm-up (`rl.train_step.warm_up`: the engine's warmup in a thread beside the
  update's compile) against the two one after the other (the same function, its thread run inline), each
  in a fresh process (cold compile caches on both sides), the two kinds alternated `--pairs` times; wall
  seconds of the warm-up and the process's CPU seconds in it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace
from unittest import mock

import jax
import numpy as np

from benchmarks import record
from benchmarks.grpo_step import grpo_cfg
from benchmarks.record import emit, loadavg
from inference import Engine
from rl import batch as batch_lib
from rl import distributed, losses, sampler, train_state, train_step, validate

ARCH = "qwen3"


def _setup():
    cfg = grpo_cfg(ARCH)
    mesh = distributed.trainer_mesh(cfg)
    model_def, state = train_state.init_state(cfg, mesh=mesh, seed=0)
    return cfg, mesh, model_def, state, train_state.reference_weights(state, cfg.rl.reference_dtype)


def _random_batch(cfg, mesh):
    """A rollout-shaped batch of random ids, trained on the completion positions."""
    local = batch_lib.empty_batch(cfg.batch_size, cfg.seq_len)
    rng = np.random.default_rng(0)
    prompt = cfg.rl.max_prompt_len
    local["tokens_BT"][:] = rng.integers(3, cfg.model.vocab_size, local["tokens_BT"].shape)
    local["mask_BT"][:, prompt:] = 1
    local["advantages_B"][:] = rng.normal(size=cfg.batch_size)
    local["behaviour_logp_BT"][:, prompt:] = -9.0
    shardings = train_state.batch_shardings(cfg, tuple(local), mesh, cfg.batch_size)
    return distributed.global_batch(local, shardings, train_state.ROW_AXIS)


class _InlineThread:
    """threading.Thread's surface as `rl.train_step.warm_up` uses it, running the target at start(): the
    serial warm-up through the main job's own code (the engine's warmup, then the update's compile)."""

    def __init__(self, target, **_):
        self._target = target

    def start(self):
        self._target()

    def join(self):
        pass


def section_window(calls: int) -> dict:
    cfg, mesh, model_def, state, ref = _setup()
    batch = _random_batch(cfg, mesh)
    updates, real = {}, losses.logit_window
    for name in ("every_position", "window"):
        window = real if name == "window" else (lambda cfg, length: 0)
        with mock.patch.object(train_step, "logit_window", window):
            updates[name] = train_step.make_grpo_update(cfg, model_def, mesh=mesh)
            updates[name].compile(state, batch, ref_params=ref)  # traced under its own window rule
    seconds = {name: [] for name in updates}
    metrics = {}
    for _ in range(calls):
        for name, update in updates.items():
            start = jax.tree.map(lambda x: x.copy(), state)  # the update donates its state
            jax.block_until_ready(start)
            t0 = time.perf_counter()
            new, m = update(start, batch, ref_params=ref)
            jax.block_until_ready(new.params)
            seconds[name].append(time.perf_counter() - t0)
            metrics[name] = {k: float(v) for k, v in m.items() if np.ndim(v) == 0}
    median = {name: round(statistics.median(s[1:]), 4) for name, s in seconds.items()}
    diff = max(abs(metrics["window"][k] - metrics["every_position"][k]) for k in metrics["window"])
    return {
        "bench": "grpo_ab_window",
        "arch": ARCH,
        "window": losses.logit_window(cfg, cfg.seq_len),
        "seq_len": cfg.seq_len,
        "update_s_median": median,
        "update_s_all": {name: [round(x, 4) for x in s] for name, s in seconds.items()},
        "speedup": round(median["every_position"] / median["window"], 3),
        "max_scalar_metric_diff": diff,
        "metrics_compared": len(metrics["window"]),
    }


def child(kind: str) -> None:
    """One warm-up of `kind` in this fresh process; prints {"wall_s", "cpu_s"}."""
    cfg, mesh, model_def, state, ref = _setup()
    engine = Engine(
        cfg,
        train_state.weights(state),
        validate.engine_config(cfg),
        mesh=sampler.layout(cfg, mesh).mesh,
    )
    update = train_step.make_grpo_update(cfg, model_def, mesh=mesh)
    wall, cpu = time.perf_counter(), time.process_time()
    inline = mock.patch("rl.train_step.threading", SimpleNamespace(Thread=_InlineThread))
    with inline if kind == "serial" else contextlib.nullcontext():
        train_step.warm_up(cfg, engine, update, mesh, state, ref, cfg.batch_size)
    print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}))


def section_warmup(pairs: int) -> dict:
    runs = {"serial": [], "thread": []}
    for _ in range(pairs):
        for kind in runs:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks", "grpo_ab", f"--child={kind}"],
                cwd=record.ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[kind].append(json.loads(out.strip().splitlines()[-1]))
    wall = {k: [round(r["wall_s"], 2) for r in v] for k, v in runs.items()}
    return {
        "bench": "grpo_ab_warmup",
        "arch": ARCH,
        "wall_s": wall,
        "cpu_s": {k: [round(r["cpu_s"], 2) for r in v] for k, v in runs.items()},
        "saved_s_median": round(statistics.median(wall["serial"]) - statistics.median(wall["thread"]), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--sections", default="window,warmup")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child)
    for name in a.sections.split(","):
        load = loadavg()
        line = section_window(a.calls) if name == "window" else section_warmup(a.pairs)
        line.update(loadavg_start=load, loadavg_end=loadavg())
        emit(line)


if __name__ == "__main__":
    main()
