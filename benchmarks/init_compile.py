"""python -m benchmarks init_compile [--configs=test,demo] [--repeats=3]

Compile time of the main job's parameter init (`model.transformer._sharded_init`: one jitted program that
makes every parameter with its sharding) on this host's devices, as the product compiles it ("auto": at
backend optimization level 0 on a CPU mesh, `transformer.INIT_CPU_OPTIONS`) and at XLA's defaults ("xla").
One JSON line per config of `configs/grpo.py`: median compile seconds of each (fresh programs, persistent
cache off, the two alternated so both see the same machine), their ratio, run milliseconds, and how far the
two programs' parameters are apart (elements that differ, the largest difference in units in the last place).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import numpy as np

from benchmarks.record import emit
from configs import grpo  # noqa: E402
from model import seeds, sharding, transformer  # noqa: E402


def _compile_and_run(cfg, mesh, options: str) -> tuple[float, float, list[np.ndarray]]:
    # A fresh program each time (past the lru_cache), so every compile is cold.
    _, init = transformer._sharded_init.__wrapped__(transformer.model_config(cfg), mesh, options == "xla")
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        compiled = init.lower(seeds.key(0)).compile()
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        state = jax.block_until_ready(compiled(seeds.key(0)))
        run_s = time.perf_counter() - start
    return compile_s, run_s, [np.asarray(x) for x in jax.tree.leaves(state)]


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    if not np.issubdtype(a.dtype, np.floating) or np.array_equal(a, b):
        return 0
    spacing = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(a.dtype))
    return int(np.max(np.abs(a.astype(np.float64) - b) / spacing.astype(np.float64)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--configs", default="test,demo")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    for name in args.configs.split(","):
        cfg = grpo.get_config(name)
        mesh = sharding.make_mesh(cfg.mesh.shape)
        times: dict[str, list[tuple[float, float]]] = {"auto": [], "xla": []}
        values = {}
        load = os.getloadavg()[0]
        for r in range(args.repeats):
            for options in ("auto", "xla") if r % 2 == 0 else ("xla", "auto"):
                compile_s, run_s, values[options] = _compile_and_run(cfg, mesh, options)
                times[options].append((compile_s, run_s))
        med = {
            k: (statistics.median(c for c, _ in v), statistics.median(r for _, r in v))
            for k, v in times.items()
        }
        pairs = list(zip(values["auto"], values["xla"], strict=True))
        emit(
            {
                "bench": "init_compile",
                "config": name,
                "platform": mesh.devices.flat[0].platform,
                "mesh": dict(cfg.mesh.shape),
                "params": int(sum(a.size for a, _ in pairs)),
                "auto_options": transformer.init_compiler_options(mesh) or {},
                "compile_s_median": {k: round(v[0], 3) for k, v in med.items()},
                "compile_s_each": {k: [round(c, 3) for c, _ in v] for k, v in times.items()},
                "xla_over_auto": round(med["xla"][0] / med["auto"][0], 2),
                "run_ms_median": {k: round(1e3 * v[1], 2) for k, v in med.items()},
                "elements_differing": int(sum((a != b).sum() for a, b in pairs)),
                "max_ulps_apart": max(_ulps(a, b) for a, b in pairs),
                "repeats": args.repeats,
                "cpu_count": os.cpu_count(),
                "loadavg_1m_at_start": round(load, 2),
                "versions": {"jax": jax.__version__},
            }
        )


if __name__ == "__main__":
    main()
