"""python -m benchmarks restart_compile [--config=configs/grpo.py:test] [--pairs=2] [--min_compile_s=1,0]

What JAX's persistent compilation cache saves a second run (or a restart after preemption) of the main job.
Each run is `python -m rl.train --config=CONFIG --workdir=<fresh dir> --eval=false` in its own process, on
this host's devices with the product's XLA defaults and `JAX_COMPILATION_CACHE_DIR` set: a `cold` run gets an
empty cache directory, the `warm` run after it the directory the cold run filled. Pairs alternate cold, warm,
cold, warm, per `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` value (JAX's default is 1 s: programs that
compile faster are not written; 0 writes every program).

One `restart_compile` JSON line per run: wall seconds of the process, seconds from its start to its first
SFT step and to its first GRPO step record in metrics.jsonl (the steps' own times are not in these), and
the cache's files and bytes after it; then a summary line per threshold with the medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.record import emit, loadavg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _first_times(metrics_path: str) -> tuple[float | None, float | None]:
    """Epoch times of the first SFT record and the first GRPO step record."""
    sft = grpo = None
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if sft is None and any(k.startswith("sft/") for k in record):
                sft = record["time"]
            if grpo is None and "train/loss" in record:
                grpo = record["time"]
    return sft, grpo


def _cache_size(cache_dir: str) -> tuple[int, int]:
    files = [os.path.join(d, f) for d, _, fs in os.walk(cache_dir) for f in fs]
    return len(files), sum(os.path.getsize(f) for f in files)


def run_once(config: str, workdir: str, cache_dir: str, min_compile_s: str) -> dict:
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=cache_dir,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=min_compile_s,
    )
    command = [sys.executable, "-m", "rl.train", f"--config={config}", f"--workdir={workdir}", "--eval=false"]
    load_start = loadavg()
    t0 = time.time()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, timeout=3600)
    wall = time.time() - t0
    sft, grpo = _first_times(os.path.join(workdir, "metrics.jsonl"))
    files, size = _cache_size(cache_dir)
    return {
        "wall_s": round(wall, 2),
        "to_first_sft_step_s": None if sft is None else round(sft - t0, 2),
        "to_first_grpo_step_s": None if grpo is None else round(grpo - t0, 2),
        "cache_files": files,
        "cache_mb": round(size / 2**20, 2),
        "loadavg_start": load_start,
    }


def summary(config: str, threshold: float, runs: dict[str, list[dict]]) -> dict:
    """Medians per side and the cold / warm ratios."""
    keys = ("wall_s", "to_first_grpo_step_s")
    median = {
        side: {k: round(statistics.median(r[k] for r in rs), 2) for k in keys} for side, rs in runs.items()
    }
    ratio = {k: round(median["cold"][k] / median["warm"][k], 2) for k in keys}
    return {
        "bench": "restart_compile_summary",
        "config": config,
        "min_compile_s": threshold,
        "median": median,
        "wall_ratio_cold_over_warm": ratio["wall_s"],
        "first_grpo_step_ratio_cold_over_warm": ratio["to_first_grpo_step_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--config", default="configs/grpo.py:test")
    p.add_argument("--pairs", type=int, default=2, help="cold/warm pairs per threshold")
    p.add_argument("--min_compile_s", default="1,0", help="JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS values")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="restart_compile_") as root:
        for threshold in a.min_compile_s.split(","):
            runs = {"cold": [], "warm": []}
            for pair in range(a.pairs):
                cache = os.path.join(root, f"cache_{threshold}_{pair}")
                for side in ("cold", "warm"):
                    workdir = os.path.join(root, f"run_{threshold}_{pair}_{side}")
                    line = {"bench": "restart_compile", "config": a.config, "min_compile_s": float(threshold)}
                    line.update(side=side, pair=pair, **run_once(a.config, workdir, cache, threshold))
                    runs[side].append(emit(line))
            emit(summary(a.config, float(threshold), runs))


if __name__ == "__main__":
    sys.exit(main())
