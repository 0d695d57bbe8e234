"""python -m benchmarks train_step

Training-step throughput on the default JAX device (one device, no mesh). One JSON line per config:
step time (median of --steps timed steps, after the compiling step and one warm step), tokens/s,
achieved FLOP/s from `model.plan.flops_per_token(cfg, seq_len, training=True)`, and MFU against the
f32 matmul peak measured in this process (`matmul_peak.measure`, re-measured before each config; the
best figure so far is the peak, so a slow moment of the machine never inflates MFU). Then one line with
the step-time ratio when the expert count doubles at fixed top-k (capacity dispatch).

A step is forward + backward + optax AdamW with global-norm clipping, jitted once with the train state
donated; loss = next-token cross-entropy + aux['moe_loss'].

    python -m benchmarks train_step --configs=small_moe,expert_doubling --steps=3
    python -m benchmarks train_step --configs=tiny --batch=16 --seq_len=64
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

import model
from benchmarks import matmul_peak
from benchmarks.record import emit
from model import plan

# --configs name -> (configs/<file>.py, argument)
CONFIGS = {
    "tiny": ("tiny", ""),
    "small_dense": ("small", "dense"),
    "small_moe": ("small", ""),
    "small_capacity": ("small", "capacity"),
}
# Same top-k and expert width, twice the experts: the step should cost about the same.
DOUBLING = (("small", "capacity,experts=16"), ("small", "capacity,experts=32"))
DOUBLING_TARGET = 1.15


def make_train_step(graphdef, optimizer: optax.GradientTransformation):
    """Jitted `step(state, tokens_BT) -> (state, loss)`, state = (params, opt_state, rest), donated."""

    def loss_fn(params, rest, tokens_BT):
        logits_BTV, aux = nnx.merge(graphdef, params, rest)(tokens_BT)
        return model.next_token_loss(logits_BTV, tokens_BT) + aux["moe_loss"]

    def step(state, tokens_BT):
        params, opt_state, rest = state
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, tokens_BT)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, rest), loss

    return jax.jit(step, donate_argnums=0)


def time_steps(cfg: ml_collections.ConfigDict, steps: int) -> dict:
    """Builds model and optimizer, compiles, runs one warm step, then times `steps` steps."""
    graphdef, params, rest = nnx.split(model.build(cfg, seed=0), nnx.Param, ...)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
    state = (params, optimizer.init(params), rest)
    step = make_train_step(graphdef, optimizer)
    shape = (cfg.batch_size, cfg.seq_len)
    tokens_BT = jax.random.randint(jax.random.key(1), shape, 0, cfg.model.vocab_size, jnp.int32)

    times = []
    for _ in range(steps + 2):  # the first compiles, the second warms up
        t0 = time.perf_counter()
        state, loss = step(state, tokens_BT)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
    return {"compile_s": times[0], "times": times[2:], "loss": float(loss)}


class Bench:
    """Runs configs once each (a config reached twice under two names is reused) and prints them."""

    def __init__(self, steps: int, batch: int | None, seq_len: int | None):
        self.steps, self.batch, self.seq_len = steps, batch, seq_len
        self.peak = 0.0
        self.step_s: dict[str, float] = {}

    def run(self, file: str, arg: str) -> float:
        cfg = importlib.import_module(f"configs.{file}").get_config(arg)
        cfg.batch_size = self.batch or cfg.batch_size
        cfg.seq_len = self.seq_len or cfg.seq_len
        key = cfg.to_json()
        if key in self.step_s:
            return self.step_s[key]
        self.peak = max(self.peak, matmul_peak.measure()["peak_flops"])
        r = time_steps(cfg, self.steps)
        step_s = statistics.median(r["times"])
        tokens = cfg.batch_size * cfg.seq_len
        flops = plan.flops_per_token(cfg, cfg.seq_len, training=True) * tokens / step_s
        counts = plan.count_params(cfg)
        m = cfg.model
        line = {
            "bench": "train_step",
            "config": f"configs/{file}.py" + (f":{arg}" if arg else ""),
            "moe_impl": m.moe.impl if m.moe.num_experts else "dense",
            "params_total_m": round(counts["total"] / 1e6, 2),
            "params_active_m": round(counts["active"] / 1e6, 2),
            "batch": cfg.batch_size,
            "seq_len": cfg.seq_len,
            "step_s": round(step_s, 4),
            "step_s_min": round(min(r["times"]), 4),
            "tokens_per_s": round(tokens / step_s, 1),
            "achieved_gflops": round(flops / 1e9, 1),
            "peak_gflops": round(self.peak / 1e9, 1),
            "mfu": round(flops / self.peak, 4),
            "compile_s": round(r["compile_s"], 1),
            "steps": self.steps,
            "loss": round(r["loss"], 4),
        }
        emit(line)
        self.step_s[key] = step_s
        return step_s

    def doubling(self) -> None:
        base_s, doubled_s = self.run(*DOUBLING[0]), self.run(*DOUBLING[1])
        ratio = doubled_s / base_s
        line = {
            "bench": "train_step_expert_doubling",
            "base": "configs/{}.py:{}".format(*DOUBLING[0]),
            "doubled": "configs/{}.py:{}".format(*DOUBLING[1]),
            "step_s": [round(base_s, 4), round(doubled_s, 4)],
            "step_time_ratio": round(ratio, 4),
            "target": DOUBLING_TARGET,
            "met": ratio < DOUBLING_TARGET,
        }
        emit(line)


def main() -> None:
    names = [*CONFIGS, "expert_doubling"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--configs", default=",".join(names), help=f"comma-separated subset of {names}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per config (median reported)")
    p.add_argument("--batch", type=int, default=None, help="override cfg.batch_size")
    p.add_argument("--seq_len", type=int, default=None, help="override cfg.seq_len")
    a = p.parse_args()
    chosen = [n for n in a.configs.split(",") if n]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        p.error(f"unknown --configs {unknown}; choose from {names}")
    bench = Bench(a.steps, a.batch, a.seq_len)
    for name in chosen:
        if name == "expert_doubling":
            bench.doubling()
        else:
            bench.run(*CONFIGS[name])


if __name__ == "__main__":
    main()
