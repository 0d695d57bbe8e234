"""python -m benchmarks profile_ops TRACE_DIR [--top 20]

Summarises a `jax.profiler` trace (the newest *.trace.json.gz under TRACE_DIR, e.g. from
`python -m benchmarks grpo_step --trace_dir=DIR`) as one JSON line: the XLA ops' thread time by kind (the
op name without its `.N` suffix: `ynn_fusion` is XLA:CPU's matmul library call, `while` a loop, the rest
elementwise / copy fusions), the busiest single ops, and the busy time of each thread against the traced
span. Thread time counts ops that run at once on two threads twice, so kinds are compared with each other,
not with the wall clock.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os

from benchmarks.record import emit

# Host-side events of the runtime and of Python (`$file.py:line fn`), not XLA ops.
HOST_PREFIXES = ("$", "Thunk", "Pjit", "np.", "Slinky", "CommonPjRt", "ParseArguments", "ArrayImpl", "end: ")


def newest_trace(trace_dir: str) -> str:
    found = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise SystemExit(f"no *.trace.json.gz under {trace_dir} (run with --trace_dir first)")
    return max(found, key=os.path.getmtime)


def summarise(events: list[dict], top: int = 20) -> dict:
    ops = [e for e in events if e.get("ph") == "X" and not e["name"].startswith(HOST_PREFIXES)]
    by_kind, by_op, by_thread = collections.Counter(), collections.Counter(), collections.Counter()
    for e in ops:
        by_kind[e["name"].split(".")[0]] += e["dur"]
        by_op[e["name"]] += e["dur"]
        by_thread[e["tid"]] += e["dur"]
    total = sum(by_kind.values())
    span = max((e["ts"] + e["dur"] for e in ops), default=0) - min((e["ts"] for e in ops), default=0)
    ms = lambda us: round(us / 1e3, 3)
    return {
        "bench": "profile_ops",
        "op_thread_ms": ms(total),
        "span_ms": ms(span),
        "kinds": {k: {"ms": ms(v), "share": round(v / total, 4)} for k, v in by_kind.most_common()},
        "top_ops_ms": {k: ms(v) for k, v in by_op.most_common(top)},
        "thread_busy_ms": sorted((ms(v) for v in by_thread.values()), reverse=True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args()
    path = newest_trace(a.trace_dir)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    emit(dict(summarise(events, a.top), trace=os.path.relpath(path, a.trace_dir)))


if __name__ == "__main__":
    main()
