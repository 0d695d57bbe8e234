"""python benchmarks/envs.py

The environment layer's speed, one JSON line per figure:
    sandbox_start   `envs.sandbox` start latency of `true`: warm (zygote fork) vs cold (fresh interpreter),
                    p50/p99 ms. Targets: warm p50 <= 10 ms and >= 5x faster than cold.
    pool_overhead   `envs.EnvPool` with 2 workers on the `debug` domain: per-call overhead (round trip minus
                    time in the environment and behind earlier calls, from `EnvPool.stats()`) and the
                    caller-side round trip of one call at a time, p50/p99 ms. Target: overhead p50 <= 2 ms.
    episodes        per domain, 2 workers: reference solutions scored with `score_many`, episodes per second
                    (tasks spread over every level; the pool is warmed up first).
Figures whose module does not exist yet print {"skipped": reason}. Never imports JAX.

    python benchmarks/envs.py --calls=2000 --episodes=200
    python benchmarks/envs.py --domains=math,scene3d
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs import registry  # noqa: E402

WORKERS = 2


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _emit(record: dict) -> None:
    print(json.dumps(record, sort_keys=True), flush=True)


def sandbox_start(n: int) -> dict:
    try:
        from envs import sandbox
    except ImportError as e:
        return {"bench": "sandbox_start", "skipped": f"envs.sandbox: {e}"}
    figures = sandbox.start_latency(n)
    warm, cold = figures["warm_p50_ms"], figures["cold_p50_ms"]
    return {
        "bench": "sandbox_start",
        "isolation": sandbox.isolation_level(),
        "runs": n,
        **{k: round(v, 3) for k, v in figures.items()},
        "cold_over_warm_p50": round(cold / warm, 1),
        "target_met": warm <= 10.0 and cold >= 5 * warm,
    }


def pool_overhead(calls: int) -> dict:
    try:
        from envs.pool import EnvPool
    except ImportError as e:
        return {"bench": "pool_overhead", "skipped": f"envs.pool: {e}"}
    env = registry.make("debug")
    tasks = env.sample_tasks(0, calls)
    with EnvPool(WORKERS, domains=["debug"]) as pool:
        pool.score_many([(t, "ok") for t in tasks[:50]])  # warm-up, not counted in the caller figures
        round_trip = []
        for task in tasks:
            t0 = time.perf_counter()
            pool.submit("score", task, "ok").result()
            round_trip.append(1e3 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        pool.score_many([(t, "ok") for t in tasks])
        batch_s = time.perf_counter() - t0
        stats = pool.stats()
    return {
        "bench": "pool_overhead",
        "workers": WORKERS,
        "domain": "debug",
        "calls": stats["calls"],
        "overhead_p50_ms": round(stats["overhead_p50_ms"], 3),
        "overhead_p99_ms": round(stats["overhead_p99_ms"], 3),
        "round_trip_p50_ms": round(_pct(round_trip, 50), 3),
        "round_trip_p99_ms": round(_pct(round_trip, 99), 3),
        "batched_calls_per_s": round(calls / batch_s, 1),
        "target_met": stats["overhead_p50_ms"] <= 2.0,
    }


def episodes(domain: str, n: int) -> dict:
    try:
        from envs.pool import EnvPool
    except ImportError as e:
        return {"bench": "episodes", "domain": domain, "skipped": f"envs.pool: {e}"}
    try:
        env = registry.make(domain)
    except Exception as e:
        return {"bench": "episodes", "domain": domain, "skipped": f"{type(e).__name__}: {e}"}
    tasks = env.sample_tasks(1, n)
    items = [(t, env.reference_solution(t)) for t in tasks]
    env.close()
    with EnvPool(WORKERS, domains=[domain]) as pool:
        pool.score_many(items[: 2 * WORKERS])  # warm-up
        t0 = time.perf_counter()
        scores = pool.score_many(items)
        seconds = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for s in scores:
        statuses[s.status] = statuses.get(s.status, 0) + 1
    return {
        "bench": "episodes",
        "domain": domain,
        "workers": WORKERS,
        "episodes": n,
        "seconds": round(seconds, 3),
        "episodes_per_s": round(n / seconds, 1),
        "statuses": statuses,
    }


def _ready(domain: str) -> bool:
    module, cls = registry._DOMAINS[domain].split(":")
    try:
        return hasattr(importlib.import_module(module), cls)
    except ImportError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    parser.add_argument("--starts", type=int, default=200, help="sandbox starts per mode")
    parser.add_argument("--calls", type=int, default=1000, help="pool calls for the overhead figure")
    parser.add_argument("--episodes", type=int, default=100, help="episodes per domain")
    parser.add_argument("--domains", default="", help="comma-separated; default: every registered domain")
    args = parser.parse_args()
    _emit(sandbox_start(args.starts))
    _emit(pool_overhead(args.calls))
    domains = args.domains.split(",") if args.domains else [d for d in registry.names() if d != "debug"]
    for domain in domains:
        if domain in registry.names() and not _ready(domain):
            _emit({"bench": "episodes", "domain": domain, "skipped": "domain module not written yet"})
            continue
        _emit(episodes(domain, args.episodes))


if __name__ == "__main__":
    main()
