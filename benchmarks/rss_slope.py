"""python -m benchmarks rss_slope [--d_ff 1024 4096] [--out benchmarks/results/rss_slope.jsonl]

How a process's memory grows with the model, measured as a new user would: two `python -m rl.train`
processes of 4 fake CPU devices each, the test config (`configs/grpo.py:test`) with its routed experts made
wider (`model.moe.d_ff`, two sizes), random init, trainer mesh fsdp 8, one SFT and one GRPO step, no
evaluation. Per run: P (the model's f32 parameter bytes), the largest peak RSS of the two processes and the
largest live bytes of one device (`memory/peak_rss_bytes`, `memory/device_bytes` from metrics.jsonl), for
each sampler layout (`rl.engine.mesh`):

- one_e2t2: one engine over both processes, expert 2 x tensor 2 (x data 2);
- each_data: an engine per process, data-parallel (every engine device holds the whole weights: the
  layout a user picks for a small model, where weights are replicated by choice).

The slope d(peak RSS) / dP is what a process adds per byte of parameters. A process's share of the
trainer's arrays is (params + Adam's two moments) / 2 processes = 1.5 P, plus the train step's transient
gradients (0.5 P) and its engine weights: on fake devices every device of a process lives in its memory, so
one_e2t2 adds 8 devices x P/4 / 2 processes ~ P and each_data 4 devices x P = 4 P. What the train step's
XLA temporaries add depends on `model.scan_layers`: unscanned (the test config's setting), every layer's
FSDP-gathered weights and gradients are live at once; `--scan` sets scan_layers=True and remat=full (the pod
configs' setting), which gathers one layer at a time. One JSON line per run and one per layout with the
slope, appended to --out; the command and load average in each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks import hosts
from benchmarks.record import ROOT, emit

LAYOUTS = {
    "one_e2t2": {"rl.engine.mesh.processes": 0, "rl.engine.mesh.expert": 2, "rl.engine.mesh.tensor": 2},
    "each_data": {"rl.engine.mesh.processes": 1, "rl.engine.mesh.expert": 1, "rl.engine.mesh.tensor": 1},
}


def _param_bytes(d_ff: int) -> int:
    import jax
    from flax import nnx

    from configs import grpo
    from model.transformer import Transformer

    cfg = grpo.get_config("test")
    cfg.model.moe.d_ff = d_ff
    state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0))), nnx.Param)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def _run(workdir: str, d_ff: int, layout: dict, scan: bool) -> dict:
    flags = {
        "model.moe.d_ff": d_ff,
        **({"model.scan_layers": True, "model.remat": "full"} if scan else {}),
        "mesh.shape.data": 1,
        "mesh.shape.fsdp": 8,
        "rl.steps": 1,
        "rl.sft.steps": 1,
        **layout,
    }
    cmd = [sys.executable, "-m", "rl.train", "--config=configs/grpo.py:test", f"--workdir={workdir}"]
    cmd += ["--eval=false"] + [f"--config.{k}={v}" for k, v in flags.items()]
    procs, logs = hosts.start(cmd, processes=2, devices=4, log_dir=os.path.dirname(workdir))
    failed = hosts.wait(procs, timeout=3600)
    if failed is not None:
        raise SystemExit("\n".join(log.read_text()[-3000:] for log in logs))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f if '"memory/device_bytes"' in line][-1]
    return {
        "peak_rss_bytes": int(last["memory/peak_rss_bytes"]),
        "device_bytes": int(last["memory/device_bytes"]),
        "flags": flags,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d_ff", type=int, nargs=2, default=[1024, 4096])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--scan", action="store_true", help="model.scan_layers=True, remat=full (the pod configs' setting)"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "rss_slope.jsonl"))
    args = parser.parse_args()
    for name in args.layouts:
        layout = LAYOUTS[name]
        runs = []
        for d_ff in args.d_ff:
            load = os.getloadavg()
            with tempfile.TemporaryDirectory() as tmp:
                r = _run(os.path.join(tmp, "run"), d_ff, layout, args.scan)
            r.update(
                bench="rss_slope",
                layout=name,
                d_ff=d_ff,
                scan_layers=args.scan,
                param_bytes=_param_bytes(d_ff),
                loadavg=[load, os.getloadavg()],
            )
            runs.append(emit(r, out=args.out))
        dp = runs[1]["param_bytes"] - runs[0]["param_bytes"]
        slope = {
            "bench": "rss_slope",
            "layout": name,
            "scan_layers": args.scan,
            "rss_per_param_byte": (runs[1]["peak_rss_bytes"] - runs[0]["peak_rss_bytes"]) / dp,
            "device_bytes_per_param_byte": (runs[1]["device_bytes"] - runs[0]["device_bytes"]) / dp,
            "param_bytes": [r["param_bytes"] for r in runs],
        }
        emit(slope, out=args.out)


if __name__ == "__main__":
    main()
