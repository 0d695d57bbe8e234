"""python -m benchmarks env_throughput

The environment layer's speed, one JSON line per figure:
    sandbox_start   `envs.sandbox` start latency of `true`: warm (zygote, children made ahead) vs cold
                    (fresh interpreter), p50/p99 ms, runs back to back (`pause_ms` 0: making the next
                    children ahead competes with each run) and `--start_pause_ms` apart (as runs of real
                    work would be). Targets: warm p50 <= 10 ms and >= 5x faster than cold.
    pool_overhead   `envs.EnvPool` with 2 workers on the `debug` domain: per-call overhead (round trip minus
                    time in the environment and behind earlier calls, from `EnvPool.stats()`) and the
                    caller-side round trip of one call at a time, p50/p99 ms. Target: overhead p50 <= 2 ms.
    episodes        per domain, 2 workers: reference solutions scored with `score_many`, episodes per second
                    (tasks spread over every level; the pool is warmed up first).
    load            code and terminal, 2 workers: realistic completions, a quarter each correct, wrong,
                    looping and crashing, all submitted at once (at most 2 outstanding per worker):
                    episodes per second, and latency from submit to result p50/p99 ms, overall and per
                    kind. A looping completion costs what the domain's limits let it run.
Figures whose module does not exist yet print {"skipped": reason}. Never imports JAX.

    python -m benchmarks env_throughput --calls=2000 --episodes=200
    python -m benchmarks env_throughput --domains=math,scene3d
    python -m benchmarks env_throughput --only=sandbox_start,load --load_episodes=40
"""

from __future__ import annotations

import argparse
import importlib
import math
import time

from benchmarks.record import emit
from envs import registry

WORKERS = 2


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def sandbox_start(n: int, pause_ms: float = 0.0) -> dict:
    try:
        from envs.sandbox import box as sandbox
    except ImportError as e:
        return {"bench": "sandbox_start", "skipped": f"envs.sandbox: {e}"}
    figures = sandbox.start_latency(n, pause_s=pause_ms / 1e3)
    warm, cold = figures["warm_p50_ms"], figures["cold_p50_ms"]
    return {
        "bench": "sandbox_start",
        "isolation": sandbox.isolation_level(),
        "backend": sandbox.isolation().backend,
        "resources": sandbox.isolation().resources,
        "runs": n,
        "pause_ms": pause_ms,
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


def _load_completions(env, task) -> dict[str, str]:
    """kind -> completion: correct, wrong, looping, crashing (python for code, shell for terminal)."""
    if env.max_turns > 1:
        return {
            "correct": env.reference_solution(task),
            "wrong": "ls -la\necho 42\nsubmit",
            "looping": "while true; do :; done\nsubmit",
            "crashing": "python3 -c 'import os; os.abort()'\nkill -SEGV $$\nsubmit",
        }
    from envs.qa import probes as qa

    functions = qa._function_names(env.reference_solution(task))
    fenced = lambda src: f"```python\n{src}```"  # noqa: E731
    return {
        "correct": env.reference_solution(task),
        "wrong": fenced(qa.code_probe_source("", "pass", functions)),
        "looping": fenced(qa.code_probe_source("", "while True:\n    pass", functions)),
        "crashing": fenced(qa.code_probe_source("", "import os\nos.abort()", functions)),
    }


def load(domain: str, n: int) -> dict:
    from envs.pool import EnvPool

    env = registry.make(domain)
    tasks = env.sample_tasks(2, n)
    kinds = ("correct", "wrong", "looping", "crashing")
    items = [(kinds[i % 4], t, _load_completions(env, t)[kinds[i % 4]]) for i, t in enumerate(tasks)]
    env.close()
    with EnvPool(WORKERS, domains=[domain], timeout_s=60.0) as pool:
        pool.score_many([(t, c) for _, t, c in items[:WORKERS]])  # warm-up
        latency: dict[str, list[float]] = {k: [] for k in kinds}
        statuses: dict[str, dict[str, int]] = {k: {} for k in kinds}
        t0 = time.perf_counter()
        futures = []
        for kind, task, completion in items:
            sent = time.perf_counter()
            future = pool.submit("score", task, completion)
            done = lambda f, k=kind, t=sent: latency[k].append(1e3 * (time.perf_counter() - t))  # noqa: E731
            future.add_done_callback(done)
            futures.append((kind, future))
        for kind, future in futures:
            status = future.result().status
            statuses[kind][status] = statuses[kind].get(status, 0) + 1
        seconds = time.perf_counter() - t0
    every = [x for values in latency.values() for x in values]
    return {
        "bench": "load",
        "domain": domain,
        "workers": WORKERS,
        "episodes": n,
        "seconds": round(seconds, 3),
        "episodes_per_s": round(n / seconds, 2),
        "latency_p50_ms": round(_pct(every, 50), 1),
        "latency_p99_ms": round(_pct(every, 99), 1),
        "per_kind": {
            k: {"p50_ms": round(_pct(v, 50), 1), "p99_ms": round(_pct(v, 99), 1), "statuses": statuses[k]}
            for k, v in latency.items()
            if v
        },
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
    parser.add_argument("--start_pause_ms", type=float, default=20.0, help="the spaced sandbox_start figure")
    parser.add_argument("--calls", type=int, default=1000, help="pool calls for the overhead figure")
    parser.add_argument("--episodes", type=int, default=100, help="episodes per domain")
    parser.add_argument("--domains", default="", help="comma-separated; default: every registered domain")
    parser.add_argument("--load_episodes", type=int, default=40, help="episodes per domain under load")
    parser.add_argument("--only", default="", help="comma-separated figures (default: all)")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else {"sandbox_start", "pool_overhead", "episodes", "load"}
    if "sandbox_start" in only:
        for pause_ms in (0.0, args.start_pause_ms):
            emit(sandbox_start(args.starts, pause_ms))
    if "pool_overhead" in only:
        emit(pool_overhead(args.calls))
    domains = args.domains.split(",") if args.domains else [d for d in registry.names() if d != "debug"]
    for domain in domains if "episodes" in only else []:
        if domain in registry.names() and not _ready(domain):
            emit({"bench": "episodes", "domain": domain, "skipped": "domain module not written yet"})
            continue
        emit(episodes(domain, args.episodes))
    for domain in ("code", "terminal") if "load" in only else ():
        emit(load(domain, args.load_episodes))


if __name__ == "__main__":
    main()
