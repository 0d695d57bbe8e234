"""python -m benchmarks small_dots [--sections=matmul,engine] [--repeats=5]

XLA:CPU's two dot kernels at decode-size row counts, behind `inference.steps.dot_options` (on an x86-64 CPU
without AVX-512, engine steps of `steps.SMALL_DOT_MIN_ROWS` to `SMALL_DOT_ROWS` matmul rows compile with YNN
fusions off, so XLA:CPU's Eigen kernels run their dots). One JSON line per section, each naming the CPU and
the rule this host gets (`steps.eigen_small_dots`):

- `matmul`: 8 dependent [M, 512] x [512, 2048] matmuls (each output cut back to 512 columns and fed on), one
  jitted program per kernel choice, M from 1 to 128: median ms over 40 calls, the two programs timed
  alternately (so both see the same machine).
- `engine`: the engine as the product runs it, built twice in one process (`steps.EIGEN_SMALL_DOTS` False:
  YNNPACK everywhere; True: Eigen at decode sizes), calls alternated: decode tok/s on the peer anchor shapes
  (`decode.PEER_DIMS`, dense and `PEER_MOE`, batch 16, 16 x 32-token prompts, 64 new tokens, T=1, 8 steps
  per call), and ms per call of plain decoding and of a speculative step (k = 4) on `decode.TARGET_DIMS` /
  `DRAFT_DIMS` at batch 1 and 4 (random weights: per-call cost only, not acceptance).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import (
    DRAFT_DIMS,
    PEER_DIMS,
    PEER_MOE,
    TARGET_DIMS,
    Engines,
    model_config,
    peer_engine_kwargs,
    random_prompts,
    run,
)
from benchmarks.record import emit, loadavg
from benchmarks.timing import call_seconds
from inference import SamplingParams, steps
from inference.drafters import ModelDrafter
from model import transformer as model


def _median_ms(fn, *args, calls: int = 40) -> float:
    return 1e3 * statistics.median(call_seconds(fn, *args, calls=calls))


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


def _make(engines: Engines, name: str, eigen: bool, *args, **kwargs):
    steps.EIGEN_SMALL_DOTS = eigen
    steps.jitted.cache_clear()  # the steps are built anew under this rule
    return engines.make(name, *args, **kwargs)


def cpu() -> dict:
    """The host CPU's model name and the rule it gets."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": name, "host_rule_eigen_small_dots": steps.eigen_small_dots()}


def section_engine(repeats: int) -> dict:
    engines = Engines()
    out = {"bench": "small_dots_engine", "small_dot_rows": [steps.SMALL_DOT_MIN_ROWS, steps.SMALL_DOT_ROWS]}
    sides = (("ynnpack", False), ("eigen", True))
    for arch in ("qwen3", "qwen3moe"):
        cfg = model_config(**PEER_DIMS, **(PEER_MOE if arch == "qwen3moe" else {}))
        params = nnx.state(model.build(cfg, seed=0), nnx.Param)
        kw = dict(peer_engine_kwargs(), decode_steps=8)
        engs = {side: _make(engines, f"{arch}_{side}", eigen, cfg, params, **kw) for side, eigen in sides}
        rng = np.random.default_rng(8)
        warm = random_prompts(rng, 16, 32, PEER_DIMS["vocab"])
        for eng in engs.values():
            run(eng, warm, SamplingParams(temperature=1.0, max_new_tokens=64, seed=99))
        times = {side: [] for side in engs}
        for r in range(repeats):
            prompts = random_prompts(rng, 16, 32, PEER_DIMS["vocab"])
            for side, eng in engs.items():
                times[side].append(
                    run(eng, prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=r))[1]
                )
        tok_s = {side: 16 * 64 / statistics.median(t) for side, t in times.items()}
        out[f"decode_{arch}_tok_s"] = {side: round(v, 1) for side, v in tok_s.items()}
        out[f"decode_{arch}_eigen_speedup"] = round(tok_s["eigen"] / tok_s["ynnpack"], 3)
    tcfg, dcfg = model_config(**TARGET_DIMS), model_config(**DRAFT_DIMS)
    tparams = nnx.state(model.build(tcfg, seed=0), nnx.Param)
    dparams = nnx.state(model.build(dcfg, seed=1), nnx.Param)
    for batch in (1, 4):
        kw = dict(max_batch=batch, max_seq_len=136, prefill_chunk=32, prefill_batch=batch, min_bucket=32)
        engs = {}
        for side, eigen in sides:
            engs[("plain", side)] = _make(engines, f"plain_b{batch}_{side}", eigen, tcfg, tparams, **kw)
            engs[("spec", side)] = _make(
                engines,
                f"spec_b{batch}_{side}",
                eigen,
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
            ms = {side: round(1e3 * best[(kind, side)] / calls[(kind, side)], 2) for side, _ in sides}
            out[f"{kind}_b{batch}_ms_per_call"] = ms
    steps.EIGEN_SMALL_DOTS = None
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
    load = loadavg()
    for name in a.sections.split(","):
        line = section_matmul() if name == "matmul" else section_engine(a.repeats)
        emit({**line, **cpu(), "loadavg_start": load, "loadavg_end": loadavg()})
        load = loadavg()


if __name__ == "__main__":
    main()
