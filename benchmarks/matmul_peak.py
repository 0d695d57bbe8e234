"""python -m benchmarks matmul_peak

The yardstick for MFU: the best f32 GFLOP/s of one jitted square matmul on the default JAX device.
`benchmarks/train_step.py` calls `measure` in its own process, so the peak and the step times come from
the same machine state (thread pool, clock). Prints one JSON line when run alone.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.record import emit


def measure(sizes: tuple[int, ...] = (2048, 4096), repeats: int = 5) -> dict:
    """Best-of-`repeats` FLOP/s of `a @ b` ([n, n] f32) for each n; `peak` is the best over sizes."""
    matmul = jax.jit(lambda a, b: a @ b)
    per_size = {}
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.float32)
        b = jax.random.normal(kb, (n, n), jnp.float32)
        matmul(a, b).block_until_ready()  # compile
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            matmul(a, b).block_until_ready()
            best = min(best, time.perf_counter() - t0)
        per_size[n] = 2 * n**3 / best
    return {"peak_flops": max(per_size.values()), "per_size": per_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--sizes", default="2048,4096", help="comma-separated matrix sizes")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    r = measure(tuple(int(s) for s in a.sizes.split(",")), a.repeats)
    emit(
        {
            "bench": "matmul_peak",
            "backend": jax.default_backend(),
            "peak_gflops": round(r["peak_flops"] / 1e9, 1),
            "gflops_by_size": {str(n): round(f / 1e9, 1) for n, f in r["per_size"].items()},
        }
    )


if __name__ == "__main__":
    main()
