"""python -m benchmarks decode_floor [--tunix_python=TUNIX_VENV/bin/python --tunix_script=PATH]

The matmul floor of one decode step on the peer anchor shapes (`decode.PEER_DIMS`, `PEER_MOE`: 4 layers,
d_model 256, 4 query / 2 kv heads of 64, vocab 8192; dense d_ff 1024 or 8 experts of d_ff 256, every expert
on every token as the engine's decode path and Tunix both run them), batch 16, f32: only the weight matmuls
of a decode step (q, k, v, o, the MLP or the experts' stacked matmuls with the router, the unembedding) and
the RMSNorms between them, no attention, KV cache, sampling or host work, as one jitted `fori_loop` of
--steps dependent steps (each step's input is the last one's output, so XLA cannot overlap steps).

Two layouts: `separate` (one matmul per weight, as the model stores them) and `fused` (q|k|v and gate|up
concatenated: one matmul each, the layout a fused-projection model would keep). The floor bounds what any
decode engine on this machine's XLA:CPU matmuls can reach at these shapes: tok/s = 16 / (seconds per step).

One `decode_floor` JSON line per arch; with --tunix_python (a venv with google-tunix) and --tunix_script (the
peer's tunix_sampler_bench.py; neither is part of this repository) also the Tunix sampler's tok/s (prefill
included, as in decode.py's peer section) run right after in this session, and the floor over it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.common import PEER_DIMS, PEER_MOE, check_peers, run_peer
from benchmarks.record import emit

BATCH = 16


def weights(arch: str, fused: bool, seed: int = 0) -> dict:
    """Random f32 weights of the anchor model's matmuls, per layer, in the `fused` or `separate` layout."""
    d, n, kv, h = PEER_DIMS["d_model"], PEER_DIMS["heads"], PEER_DIMS["kv_heads"], PEER_DIMS["head_dim"]
    ffn = PEER_MOE["experts"] * PEER_MOE["expert_ffn"] if arch == "qwen3moe" else PEER_DIMS["ffn"]
    keys = iter(jax.random.split(jax.random.key(seed), 16 * PEER_DIMS["layers"] + 1))
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32) * shape[0] ** -0.5
    layers = []
    for _ in range(PEER_DIMS["layers"]):
        w = {"o": normal(n * h, d), "down": normal(ffn, d)}
        if fused:
            w.update(qkv=normal(d, (n + 2 * kv) * h), gate_up=normal(d, 2 * ffn))
        else:
            w.update(q=normal(d, n * h), k=normal(d, kv * h), v=normal(d, kv * h))
            w.update(gate=normal(d, ffn), up=normal(d, ffn))
        if arch == "qwen3moe":
            w["router"] = normal(d, PEER_MOE["experts"])
        layers.append(w)
    return {"layers": layers, "unembed": normal(d, PEER_DIMS["vocab"])}


def _rms(x_BD: jax.Array) -> jax.Array:
    return x_BD * jax.lax.rsqrt(jnp.mean(x_BD * x_BD, axis=-1, keepdims=True) + 1e-6)


def step(w: dict, x_BD: jax.Array, moe: bool) -> jax.Array:
    """One decode step's matmuls; attention is replaced by an elementwise mix of q, k and v."""
    nh, kvh = PEER_DIMS["heads"] * PEER_DIMS["head_dim"], PEER_DIMS["kv_heads"] * PEER_DIMS["head_dim"]
    for layer in w["layers"]:
        h_BD = _rms(x_BD)
        if "qkv" in layer:
            qkv = h_BD @ layer["qkv"]
            q, k, v = qkv[:, :nh], qkv[:, nh : nh + kvh], qkv[:, nh + kvh :]
        else:
            q, k, v = h_BD @ layer["q"], h_BD @ layer["k"], h_BD @ layer["v"]
        mixed = q * jnp.tile(k + v, nh // kvh)
        x_BD = x_BD + mixed @ layer["o"]
        h_BD = _rms(x_BD)
        if "gate_up" in layer:
            g, u = jnp.split(h_BD @ layer["gate_up"], 2, axis=-1)
        else:
            g, u = h_BD @ layer["gate"], h_BD @ layer["up"]
        a = jax.nn.silu(g) * u
        if moe:  # the top-k routing weights scale each expert's slice (zero for the experts not chosen)
            gates_BE = jax.nn.softmax(h_BD @ layer["router"], axis=-1)
            a = (a.reshape(BATCH, PEER_MOE["experts"], -1) * gates_BE[..., None]).reshape(BATCH, -1)
        x_BD = x_BD + a @ layer["down"]
    logits_BV = _rms(x_BD) @ w["unembed"]
    return x_BD + 1e-3 * logits_BV[:, : x_BD.shape[1]]


def seconds_per_step(arch: str, fused: bool, steps: int, repeats: int) -> dict:
    w = weights(arch, fused)
    moe = arch == "qwen3moe"
    run = jax.jit(lambda w, x: jax.lax.fori_loop(0, steps, lambda i, x: step(w, x, moe), x))
    x_BD = jax.random.normal(jax.random.key(1), (BATCH, PEER_DIMS["d_model"]), jnp.float32)
    run(w, x_BD).block_until_ready()  # compile and warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(w, x_BD).block_until_ready()
        times.append((time.perf_counter() - t0) / steps)
    median = statistics.median(times)
    return {"ms_per_step": round(1e3 * median, 3), "tok_s": round(BATCH / median, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--archs", default="qwen3,qwen3moe")
    p.add_argument("--steps", type=int, default=64, help="decode steps per timed call (the peers' 64 tokens)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tunix_python", default="", help="interpreter of a venv with google-tunix (none: skip)")
    p.add_argument("--tunix_script", default="", help="PATH of the peer's tunix_sampler_bench.py")
    p.add_argument("--peer_repeats", type=int, default=3)
    a = p.parse_args()
    check_peers(p, {"tunix_python": "tunix_script"}, a)
    for arch in a.archs.split(","):
        line = {"bench": "decode_floor", "arch": arch, "batch": BATCH, "loadavg_start": os.getloadavg()}
        for layout in ("separate", "fused"):
            line[layout] = seconds_per_step(arch, layout == "fused", a.steps, a.repeats)
        if a.tunix_python:
            line.update(run_peer("tunix", a.tunix_python, a.tunix_script, arch, a.peer_repeats))
            if "tunix_tok_s" in line:
                for layout in ("separate", "fused"):
                    line[f"{layout}_floor_vs_tunix"] = round(line[layout]["tok_s"] / line["tunix_tok_s"], 2)
        line["loadavg_end"] = os.getloadavg()
        emit(line)


if __name__ == "__main__":
    sys.exit(main())
