"""python -m benchmarks moe_decode

MoE at decode-size token counts: the small-token path (each token gathers its top-k experts' weights,
`model.moe.gather_max_tokens`) against the dispatch path (sort, grouped matmuls), on the peers' anchor
shapes (4 layers, d_model 256, 4/2 heads of 64, vocab 8192, 8 experts top-2 of d_ff 256). One JSON line
per measurement, each with the load average before and after (the machine is shared: compare the two
paths of one line, measured alternately, not lines of different runs):

- layer: one jitted MoE layer forward on [tokens, 1, 256] for several token counts, both paths.
- step: one jitted decode step of the whole model (batch 16, one token each, contiguous KV cache of 128
  positions half full), both paths.
- engine: `inference.Engine` tok/s, 16 x 32-token prompts, 64 new tokens, T=1, both paths (prefill
  chunks are above the threshold and take the dispatch either way).

    python -m benchmarks moe_decode --sections=layer,step --repeats=50
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import model
from benchmarks.common import (
    PEER_DIMS,
    PEER_MOE,
    chosen_sections,
    model_config,
    peer_engine_kwargs,
    random_prompts,
)
from benchmarks.record import emit, loadavg
from model.moe import layer as moe

SECTIONS = ("layer", "step", "engine")
PATHS = {"gather": 1 << 30, "dispatch": 0}  # gather_max_tokens of each path


def anchor_config(path: str):
    cfg = model_config(**PEER_DIMS, **PEER_MOE)
    cfg.model.moe.gather_max_tokens = PATHS[path]
    return cfg


def alternate(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, called in turn `repeats` times (after one warm call each), so
    that a change in the machine's load falls on both alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def gather_vs_dispatch(fns: dict, repeats: int, unit: str, digits: int) -> dict:
    """The two paths' median times (`alternate`) in `unit` ("us" or "ms"), their ratio and the load
    averages before and after."""
    before = loadavg()
    med = alternate(fns, repeats)
    scale = {"us": 1e6, "ms": 1e3}[unit]
    return {
        f"gather_{unit}": round(med["gather"] * scale, digits),
        f"dispatch_{unit}": round(med["dispatch"] * scale, digits),
        "dispatch_over_gather": round(med["dispatch"] / med["gather"], 2),
        "repeats": repeats,
        "loadavg_before": before,
        "loadavg_after": loadavg(),
    }


def section_layer(a) -> None:
    for tokens in [int(t) for t in a.tokens.split(",")]:
        x = jax.random.normal(jax.random.key(0), (tokens, 1, PEER_DIMS["d_model"]), jnp.float32)
        fns = {}
        for path in PATHS:
            cfg = anchor_config(path)
            block = moe.MoEBlock(cfg.model, tuple(cfg.mesh.rules), rngs=nnx.Rngs(params=0))
            graphdef, state = nnx.split(block)
            fwd = jax.jit(lambda state, x, g=graphdef: nnx.merge(g, state)(x)[0])
            fns[path] = lambda f=fwd, s=state, x=x: f(s, x)
        emit({"bench": "moe_decode_layer", "tokens": tokens, **gather_vs_dispatch(fns, a.repeats, "us", 1)})


def section_step(a) -> None:
    batch, max_len = 16, 128
    toks_B1 = jnp.asarray(np.random.default_rng(0).integers(3, PEER_DIMS["vocab"], (batch, 1)), jnp.int32)
    fns = {}
    for path in PATHS:
        m = model.build(anchor_config(path), seed=0)
        cache = m.init_cache(batch, max_len)
        cache = cache._replace(index=jnp.full((batch,), max_len // 2, jnp.int32))
        graphdef, state = nnx.split(m)

        def step(state, toks, cache, g=graphdef):
            logits, aux = nnx.merge(g, state)(toks, kv_cache=cache)
            return logits, aux["kv_cache"]  # the cache write is part of the step

        step = jax.jit(step)
        fns[path] = lambda f=step, s=state, c=cache: f(s, toks_B1, c)
    emit(
        {
            "bench": "moe_decode_step",
            "batch": batch,
            "cache_positions": f"{max_len // 2} of {max_len}",
            **gather_vs_dispatch(fns, a.repeats, "ms", 3),
        }
    )


def section_engine(a) -> None:
    from inference.engine import Engine, EngineConfig
    from inference.sampling import SamplingParams

    engines = {}
    for path in PATHS:
        cfg = anchor_config(path)
        params = nnx.state(model.build(cfg, seed=0), nnx.Param)
        engines[path] = Engine(cfg, params, EngineConfig(**peer_engine_kwargs()))
        engines[path].warmup()
    rng = np.random.default_rng(8)
    times = {path: [] for path in PATHS}
    before = loadavg()
    for r in range(a.engine_repeats):
        prompts = random_prompts(rng, 16, 32, PEER_DIMS["vocab"])  # fresh prompts: no prefix-cache hits
        for path, eng in engines.items():
            t0 = time.perf_counter()
            eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=r))
            times[path].append(time.perf_counter() - t0)
    tok_s = {path: 16 * 64 / statistics.median(ts) for path, ts in times.items()}
    emit(
        {
            "bench": "moe_decode_engine",
            "shapes": "16 x 32-token prompts, 64 new tokens, T=1",
            "gather_tok_s": round(tok_s["gather"], 1),
            "dispatch_tok_s": round(tok_s["dispatch"], 1),
            "gather_over_dispatch": round(tok_s["gather"] / tok_s["dispatch"], 2),
            "compiles_after_warmup": {p: e.stats()["compiles_after_warmup"] for p, e in engines.items()},
            "repeats": a.engine_repeats,
            "loadavg_before": before,
            "loadavg_after": loadavg(),
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--tokens", default="1,4,16,64,256", help="layer: token counts")
    p.add_argument("--repeats", type=int, default=30, help="layer, step: timed calls per path (median)")
    p.add_argument("--engine_repeats", type=int, default=3, help="engine: generate calls per path (median)")
    a = p.parse_args()
    chosen = chosen_sections(p, a.sections, SECTIONS)
    emit(
        {
            "bench": "moe_decode_setup",
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "cpus": os.cpu_count(),
        }
    )
    run = {"layer": section_layer, "step": section_step, "engine": section_engine}
    for name in chosen:
        run[name](a)


if __name__ == "__main__":
    main()
