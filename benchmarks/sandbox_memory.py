"""python -m benchmarks sandbox_memory [--runs=30] [--load=2] [--watch_nice_below=10]
    [--watch_slice_ns=100000]

How far past its total memory a sandboxed run gets before the sandbox stops it, on a busy machine: the
quality gate's `many_procs_memory` escape probe (`envs.qa.escape`: 12 processes that together fault in
twice the total, each under its own limit) run `--runs` times in one sandbox with the default `Limits`
(2 GiB total), while `--load` processes keep the cores busy the way the test suite does (each compiles and
runs small XLA programs in a loop). Where the total is the watchdog's (`Isolation.resources == "watchdog"`:
no cgroup v2 delegated), the overshoot is how long the watchdog waits for a core, times how fast the run
faults memory in (`envs.sandbox.watchdog.raise_priority`). The run's processes are sampled from here every
2 ms (anonymous + shared resident memory, as the probe's own sampler counts it), so a peak is a lower bound.

One JSON line per run ({"run", "over_mib": peak - total, "killed": memory_exceeded, "s"}), then a summary
({"max_over_mib", "p90_over_mib", "median_over_mib", the isolation, this process's nice value, the load}).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
import uuid

from benchmarks.record import emit
from envs.qa import escape as qa_escape
from envs.sandbox import box as sandbox


def _load(stop, seed: int) -> None:
    """Compiles and runs a new small XLA program over and over (a test worker's kind of work)."""
    import jax
    import jax.numpy as jnp

    n = 0
    x = jnp.ones((256, 256), jnp.float32)
    while not stop.is_set():
        n += 1
        f = jax.jit(lambda a, k=n + seed: jnp.tanh(a @ a.T + k).sum(axis=k % 2))
        f(x).block_until_ready()


def _peak_over(token: str, total: int, done: threading.Event, out: list) -> None:
    peak = 0
    while not done.wait(0.002):
        peak = max(peak, sum(rss for _, rss in qa_escape._tagged(token, -1)))
    out.append(peak - total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--load", type=int, default=2, help="processes keeping the cores busy")
    nice_help = "0: the watchdog at the run's nice value"
    parser.add_argument("--watch_nice_below", type=int, default=sandbox.WATCH_NICE_BELOW, help=nice_help)
    parser.add_argument("--watch_slice_ns", type=int, default=sandbox.WATCH_SLICE_NS, help="0: the default")
    args = parser.parse_args()
    sandbox.WATCH_NICE_BELOW, sandbox.WATCH_SLICE_NS = args.watch_nice_below, args.watch_slice_ns
    ctx = mp.get_context("forkserver")
    stop = ctx.Event()
    loads = [ctx.Process(target=_load, args=(stop, 1000 * i)) for i in range(args.load)]
    for p in loads:
        p.start()
    time.sleep(5.0 if loads else 0.0)  # the load's interpreters and JAX up
    limits = sandbox.Limits()
    overs = []
    try:
        with sandbox.Sandbox(limits=limits) as box:
            for i in range(args.runs):
                token = "sbmem" + uuid.uuid4().hex[:10]
                box.write("probe.py", f"_TOKEN, _GOAL = {token!r}, {2 * limits.total_memory_bytes}\n"
                          + qa_escape.ESCAPE_PROBES["many_procs_memory"])  # fmt: skip
                done, out = threading.Event(), []
                watched = (token, limits.total_memory_bytes, done, out)
                sampler = threading.Thread(target=_peak_over, args=watched)
                sampler.start()
                start = time.monotonic()
                run = box.run(["python3", "probe.py"], limits=limits)
                done.set()
                sampler.join()
                overs.append(out[0] / 2**20)
                line = {"run": i, "over_mib": round(overs[-1], 1), "killed": run.memory_exceeded}
                emit({**line, "s": round(time.monotonic() - start, 2)})
    finally:
        stop.set()
        for p in loads:
            p.join()
    ranked = sorted(overs)
    emit({
        "bench": "sandbox_memory",
        "runs": args.runs,
        "load_processes": args.load,
        "watch_nice_below": args.watch_nice_below,
        "watch_slice_ns": args.watch_slice_ns,
        "max_over_mib": round(ranked[-1], 1),
        "p90_over_mib": round(ranked[int(0.9 * (len(ranked) - 1))], 1),
        "median_over_mib": round(statistics.median(ranked), 1),
        "total_mib": limits.total_memory_bytes >> 20,
        "resources": sandbox.isolation().resources,
        "host_nice": os.getpriority(os.PRIO_PROCESS, 0),
        "root": os.geteuid() == 0,
    })  # fmt: skip


if __name__ == "__main__":
    main()
