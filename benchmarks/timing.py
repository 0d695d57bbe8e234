"""Timed calls of a jitted function: one warm call (the compile), then the seconds of each of `calls` calls,
each waited for with `jax.block_until_ready`.

    ms = 1e3 * min(call_seconds(step, q, k, v, calls=3))
"""

from __future__ import annotations

import time

import jax


def call_seconds(fn, *args, calls: int) -> list[float]:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times
