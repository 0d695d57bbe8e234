"""python -m benchmarks metrics_diff RUN_A RUN_B [--out FILE]

Whether two runs of the main job computed the same numbers: every value of `metrics.jsonl` and of the
held-out evaluations (`eval_*.json`), compared exactly, step by step. Values that depend on the wall clock or
on when an asynchronous checkpoint save finished differ between two runs of the same code on the same
config, and are left out by name: times and rates (`time`, `*_s`, `*seconds*`, throughput), the curriculum's
compute cost and the score derived from it (`curriculum/*/cost`, `score`, `score_se`: its cost counts
sandbox seconds), peak RSS, and `memory/device_bytes` (a step logged while a save is in flight holds its
copy). Prints one JSON line: values compared, the differences (the first 20 named).
"""

from __future__ import annotations

import argparse
import json
import os
import re

from benchmarks import record

CLOCKED = re.compile(
    r"(^time$|_s$|seconds|per_s|rss|throughput|_per_second|eta|"
    r"^curriculum/.*/(cost|score|score_se)$|^memory/device_bytes$)"
)
EVALS = ("eval_before.json", "eval_after.json", "eval_before_greedy.json", "eval_after_greedy.json")


def _rows(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _flat(x, prefix: str = "") -> dict:
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _flat(val, f"{prefix}{key}/").items()}
    return {prefix.rstrip("/"): x}


def compare(a: str, b: str) -> dict:
    """{"compared": n, "differences": [...]}: exact comparison of every kept value of the two runs."""
    rows_a, rows_b = _rows(a), _rows(b)
    diffs, n = [], 0
    if len(rows_a) != len(rows_b):
        diffs.append(f"metrics.jsonl: {len(rows_a)} records against {len(rows_b)}")
    for ra, rb in zip(rows_a, rows_b):
        keys_a = {k for k in ra if not CLOCKED.search(k)}
        keys_b = {k for k in rb if not CLOCKED.search(k)}
        diffs += [f"step {ra.get('step')}: {k} in one run only" for k in sorted(keys_a ^ keys_b)]
        for k in sorted(keys_a & keys_b):
            n += 1
            if ra[k] != rb[k]:
                diffs.append(f"step {ra.get('step')}: {k} {ra[k]!r} != {rb[k]!r}")
    for name in EVALS:
        paths = [os.path.join(run, name) for run in (a, b)]
        if not all(map(os.path.exists, paths)):
            continue
        flat = []
        for path in paths:
            with open(path) as f:
                flat.append(
                    {k: v for k, v in _flat(json.load(f)).items() if not CLOCKED.search(k.split("/")[-1])}
                )
        for k in sorted(set(flat[0]) | set(flat[1])):
            n += 1
            if flat[0].get(k) != flat[1].get(k):
                diffs.append(f"{name}: {k} {flat[0].get(k)!r} != {flat[1].get(k)!r}")
    return {"compared": n, "differences": diffs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--out", default="", help="also append the JSON line to this file")
    args = p.parse_args()
    out = compare(args.run_a, args.run_b)
    record.emit(
        {
            "bench": "metrics_diff",
            "run_a": record.portable(args.run_a),
            "run_b": record.portable(args.run_b),
            "compared": out["compared"],
            "differences": len(out["differences"]),
            "first_differences": out["differences"][:20],
        },
        out=args.out,
    )


if __name__ == "__main__":
    main()
