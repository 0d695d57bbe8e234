"""python benchmarks/small_dots.py [--sections=matmul,engine] [--repeats=5]

XLA:CPU's two dot kernels at decode-size row counts, behind `inference.steps.dot_options` (engine steps of at
most `steps.SMALL_DOT_ROWS` matmul rows compile with YNN fusions off, so XLA:CPU's Eigen kernels run their
dots). One JSON line per section:

- `matmul`: 8 dependent [M, 512] x [512, 2048] matmuls (each output cut back to 512 columns and fed on), one
  jitted program per kernel choice, M from 1 to 128: median ms over 40 calls, the two programs timed
  alternately (so both see the same machine).
- `engine`: the engine as the product runs it, built twice in one process (SMALL_DOT_ROWS 0: YNNPACK
  everywhere; the default: Eigen at decode sizes), calls alternated: decode tok/s on the peer anchor shapes
  (`decode.PEER_DIMS`, dense and `PEER_MOE`, batch 16, 16 x 32-token prompts, 64 new tokens, T=1, 8 steps
  per call), and ms per call of plain decoding and of a speculative step (k = 4) on `decode.TARGET_DIMS` /
  `DRAFT_DIMS` at batch 1 and 4 (random weights: per-call cost only, not acceptance).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from decode import (
    DRAFT_DIMS,
    PEER_DIMS,
    PEER_MOE,
    TARGET_DIMS,
    Engines,
    emit,
    model_config,
    peer_engine_kwargs,
    random_prompts,
    run,
)
from flax import nnx

from inference import SamplingParams, steps
from inference.drafters import ModelDrafter
from model import transformer as model


def _median_ms(fn, *args, calls: int = 40) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def section_matmul() -> dict:
    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (512, 2048)) / 512**0.5 for i in range(8)]

    def chain(ws, x_MD):
        for w in ws:
            x_MD = jnp.tanh(x_MD @ w)[:, :512]
        return x_MD

    programs = {"ynnpack": jax.jit(chain), "eigen": jax.jit(chain, compiler_options=steps.NO_YNN)}
    by_m = {}
    for m in (1, 2, 4, 8, 16, 32, 64, 128):
        x = jnp.ones((m, 512))
        times = {name: [] for name in programs}
        for _ in range(3):  # alternate the two programs
            for name, fn in programs.items():
                times[name].append(_median_ms(fn, ws, x))
        by_m[m] = {name: round(min(t), 3) for name, t in times.items()}
        by_m[m]["eigen_speedup"] = round(by_m[m]["ynnpack"] / by_m[m]["eigen"], 2)
    return {"bench": "small_dots_matmul", "shape": "8 x [M, 512] @ [512, 2048]", "ms_by_rows": by_m}


def _make(engines: Engines, name: str, limit: int, *args, **kwargs):
    steps.SMALL_DOT_ROWS = limit
    steps.jitted.cache_clear()  # the steps are built anew under this limit
    return engines.make(name, *args, **kwargs)


def section_engine(repeats: int) -> dict:
    default = steps.SMALL_DOT_ROWS
    engines, out = Engines(), {"bench": "small_dots_engine", "small_dot_rows": default}
    for arch in ("qwen3", "qwen3moe"):
        cfg = model_config(**PEER_DIMS, **(PEER_MOE if arch == "qwen3moe" else {}))
        params = nnx.state(model.build(cfg, seed=0), nnx.Param)
        kw = dict(peer_engine_kwargs(), decode_steps=8)
        engs = {limit: _make(engines, f"{arch}_{limit}", limit, cfg, params, **kw) for limit in (0, default)}
        rng = np.random.default_rng(8)
        warm = random_prompts(rng, 16, 32, PEER_DIMS["vocab"])
        for eng in engs.values():
            run(eng, warm, SamplingParams(temperature=1.0, max_new_tokens=64, seed=99))
        times = {limit: [] for limit in engs}
        for r in range(repeats):
            prompts = random_prompts(rng, 16, 32, PEER_DIMS["vocab"])
            for limit, eng in engs.items():
                times[limit].append(
                    run(eng, prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=r))[1]
                )
        tok_s = {limit: 16 * 64 / statistics.median(t) for limit, t in times.items()}
        out[f"decode_{arch}_tok_s"] = {"ynnpack": round(tok_s[0], 1), "eigen": round(tok_s[default], 1)}
        out[f"decode_{arch}_eigen_speedup"] = round(tok_s[default] / tok_s[0], 3)
    tcfg, dcfg = model_config(**TARGET_DIMS), model_config(**DRAFT_DIMS)
    tparams = nnx.state(model.build(tcfg, seed=0), nnx.Param)
    dparams = nnx.state(model.build(dcfg, seed=1), nnx.Param)
    for batch in (1, 4):
        kw = dict(max_batch=batch, max_seq_len=136, prefill_chunk=32, prefill_batch=batch, min_bucket=32)
        engs = {}
        for limit in (0, default):
            engs[("plain", limit)] = _make(engines, f"plain_b{batch}_{limit}", limit, tcfg, tparams, **kw)
            engs[("spec", limit)] = _make(
                engines,
                f"spec_b{batch}_{limit}",
                limit,
                tcfg,
                tparams,
                draft=ModelDrafter(dcfg, dparams),
                **kw,
            )
        prompts = np.random.default_rng(0).integers(3, TARGET_DIMS["vocab"], (batch, 32)).tolist()
        sp = SamplingParams(temperature=1.0, max_new_tokens=96, seed=5)
        for eng in engs.values():
            eng.generate(prompts, sp)
        best, calls = {k: float("inf") for k in engs}, {}
        for _ in range(repeats):
            for k, eng in engs.items():
                _, seconds, delta = run(eng, prompts, sp)
                best[k] = min(best[k], seconds)
                calls[k] = delta.get("spec_steps") or delta.get("decode_steps")
        for kind in ("plain", "spec"):
            ms = {
                name: round(1e3 * best[(kind, lim)] / calls[(kind, lim)], 2)
                for name, lim in (("ynnpack", 0), ("eigen", default))
            }
            out[f"{kind}_b{batch}_ms_per_call"] = ms
    steps.SMALL_DOT_ROWS = default
    steps.jitted.cache_clear()
    out["recompiles_after_warmup"] = engines.recompiles()["total"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--sections", default="matmul,engine")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    if jax.default_backend() != "cpu":
        sys.exit("small_dots.py compares XLA:CPU's dot kernels: run it on the CPU backend")
    load = [round(x, 2) for x in os.getloadavg()]
    for name in a.sections.split(","):
        line = section_matmul() if name == "matmul" else section_engine(a.repeats)
        emit({**line, "loadavg_start": load, "loadavg_end": [round(x, 2) for x in os.getloadavg()]})
        load = [round(x, 2) for x in os.getloadavg()]


if __name__ == "__main__":
    main()
