"""python -m benchmarks memory_layouts [--out benchmarks/results/memory_layouts.jsonl]

Per-device live bytes of the main job, measured and planned, per sampler layout: `python -m rl.train
--config=configs/grpo.py:test --eval=false --config.rl.steps=2 --config.rl.sft.steps=2` on a trainer mesh of
fsdp 8 (`--config.mesh.shape.data=1 --config.mesh.shape.fsdp=8`), as one process of 8 fake CPU devices and
as two processes of 4 (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, gloo collectives), for
each layout in `LAYOUTS` (`rl.engine.mesh.{processes,expert,tensor}`, `rl.sampler_devices`):

- data: an engine per process, data-parallel (expert 1, tensor 1: every engine device holds all the weights);
- each_e2t2: an engine per process, expert 2 x tensor 2;
- one_e2t2: one engine over every process (processes=0), expert 2 x tensor 2; on one process that is
  each_e2t2's layout (`rl.sampler.layout`: processes 0 spans the 1 process there is), so its line is marked
  `same_as` and carries each_e2t2's measured figures (`--run-same`: run it anyway);
- disaggregated: each process keeps its last `rl.sampler_devices` devices for its engine (tensor 2), the
  trainer's mesh takes the rest as fsdp -1. The first sampler_devices of 2, 4, ... whose trainer mesh the
  config allows (`model.config.validate`, and across processes `rl.validate.check_mesh`) is used; the
  ones refused are in the row with why (one process: 2 leaves fsdp 6, which d_model 64 does not divide).

Per run, one JSON line: the layout, processes x devices, the trainer mesh, the sampler layout (the dict given
to the planner and the main job's own "sampler: ..." line), the main job's `memory/*` at its last logged step
(`rl/memory.py`: each the largest over every device of every process), `rl.plan.memory.device_bytes` for
the same trainer mesh, one engine's {data, expert, tensor} and `colocated` as the run, measured / planned of
the total, the model's full f32 parameter bytes, the command line and the load average before and after.
A run that fails gives a line with its exit status and the end of its log instead of figures. Each run's
workdir is under a temporary directory; compiled programs are cached in .jax_cache (as the tests do), which
changes no byte counted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time

from benchmarks import hosts
from benchmarks.record import emit, loadavg
from configs import grpo, schema
from configs.schema import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/grpo.py:test"
RUN = {"rl.steps": 2, "rl.sft.steps": 2}
TRAINER = {"mesh.shape.data": 1, "mesh.shape.fsdp": 8}
HOSTS = ((1, 8), (2, 4))  # (processes, fake CPU devices each)
# name -> rl.engine.mesh.{processes, expert, tensor} and rl.sampler_devices (None: the first that fits)
LAYOUTS = {
    "data": {"processes": 1, "expert": 1, "tensor": 1, "sampler_devices": 0},
    "each_e2t2": {"processes": 1, "expert": 2, "tensor": 2, "sampler_devices": 0},
    "one_e2t2": {"processes": 0, "expert": 2, "tensor": 2, "sampler_devices": 0},
    "disaggregated": {"processes": 1, "expert": 1, "tensor": 2, "sampler_devices": None},
}
MEASURED = (
    "device_bytes",
    "params_bytes",
    "optimizer_bytes",
    "reference_bytes",
    "sampler_weights_bytes",
    "kv_pages_bytes",
    "peak_rss_bytes",
)


def layout_flags(name: str, sampler_devices: int) -> dict:
    spec = LAYOUTS[name]
    flags = {f"rl.engine.mesh.{k}": spec[k] for k in ("processes", "expert", "tensor")}
    flags["rl.sampler_devices"] = sampler_devices
    if sampler_devices:  # the trainer takes what is left: fsdp over all of it
        flags["mesh.shape.fsdp"] = -1
    return {**RUN, **TRAINER, **flags}


def config(flags: dict):
    """configs/grpo.py:test with `flags` set as the command line sets them, batch geometry as rl/train.py."""
    cfg = grpo.get_config("test")
    for dotted, value in flags.items():
        schema.set_path(cfg, dotted, value)
    cfg.batch_size = cfg.rl.prompts_per_step * cfg.rl.group_size
    cfg.seq_len = cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
    return cfg


def trainer_mesh(cfg, processes: int, devices: int) -> dict[str, int]:
    """The trainer's resolved mesh sizes over its devices; ConfigError when the config refuses it."""
    from model import config as model_config
    from rl import train_state, validate
    from rl.plan import memory as plan_memory

    n = processes * (devices - int(cfg.rl.sampler_devices))
    sizes = model_config.validate(cfg, n)
    if processes > 1:
        mesh = plan_memory.abstract_mesh(sizes)
        validate.check_mesh(cfg, processes, batch_shards=train_state.batch_shard_count(cfg, mesh))
    return sizes


def plan_layout(name: str, processes: int, devices: int) -> dict:
    """The run's flags, config, trainer mesh and one engine's sizes; for `disaggregated` the first
    sampler_devices that fits, with the refused ones and why."""
    spec, refused = LAYOUTS[name], []
    choices = [spec["sampler_devices"]] if spec["sampler_devices"] is not None else range(2, devices, 2)
    for sampler_devices in choices:
        flags = layout_flags(name, sampler_devices)
        cfg = config(flags)
        try:
            sizes = trainer_mesh(cfg, processes, devices)
        except ConfigError as e:
            refused.append({"sampler_devices": sampler_devices, "why": str(e)})
            continue
        members = processes if spec["processes"] == 0 else spec["processes"]
        per_process = sampler_devices or math.prod(sizes.values()) // processes
        expert = spec["expert"] or sizes["expert"]
        tensor = spec["tensor"] or sizes["tensor"]
        engine = {"data": members * per_process // (expert * tensor), "expert": expert, "tensor": tensor}
        out = {"flags": flags, "cfg": cfg, "trainer_mesh": sizes, "engine": engine}
        return {**out, "sampler_devices": sampler_devices, "refused": refused}
    raise ConfigError(f"{name} on {processes} x {devices}: no sampler_devices fits: {refused}")


def full_param_bytes(cfg) -> int:
    """The model's parameters at f32, whole."""
    import jax
    from flax import nnx

    from model.transformer import Transformer

    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    return 4 * sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def train(argv: list[str], processes: int, devices: int, logs: pathlib.Path, timeout: float) -> tuple:
    """Runs the main job as `processes` processes; (exit status of the first that failed or 0, logs)."""
    procs, paths = hosts.start(argv, processes=processes, devices=devices, log_dir=logs)
    failed = hosts.wait(procs, timeout)
    rc = 0 if failed is None else procs[failed].returncode if procs[failed].returncode else "timeout"
    return rc, [path.read_text() for path in paths]


def run(name: str, processes: int, devices: int, tmp: str, timeout: float) -> dict:
    from rl.plan import memory as plan_memory

    plan = plan_layout(name, processes, devices)
    cfg, sizes = plan["cfg"], plan["trainer_mesh"]
    workdir = pathlib.Path(tmp) / f"{name}_{processes}x{devices}"
    workdir.mkdir()
    argv = [sys.executable, "-m", "rl.train", f"--config={CONFIG}", f"--workdir={workdir}", "--eval=false"]
    argv += [f"--config.{k}={v}" for k, v in plan["flags"].items()]
    colocated = plan["sampler_devices"] == 0
    row = {
        "bench": "memory_layouts",
        "layout": name,
        "hosts": f"{processes}x{devices}",
        "processes": processes,
        "devices_per_process": devices,
        "trainer_mesh": {k: v for k, v in sizes.items() if v != 1},
        "sampler": {k: LAYOUTS[name][k] for k in ("processes", "expert", "tensor")},
        "sampler_devices": plan["sampler_devices"],
        "engine_mesh": plan["engine"],
        "colocated": colocated,
    }
    if plan["refused"]:
        row["sampler_devices_refused"] = plan["refused"]
    before = loadavg()
    t0 = time.perf_counter()
    rc, logs = train(argv, processes, devices, workdir, timeout)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["loadavg_before"], row["loadavg_after"] = before, loadavg()
    row["job_command"] = " ".join(["python", "-m", "rl.train", *argv[3:]]).replace(str(workdir), "<workdir>")
    if processes > 1:
        row["job_command"] = f"JAX_NUM_PROCESSES={processes} JAX_PROCESS_ID=<i> ... " + row["job_command"]
    row["job_command"] = f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} " + row["job_command"]
    said = [x.strip() for x in logs[0].splitlines() if "sampler: " in x]
    row["sampler_log"] = said[0] if said else None
    if rc:
        return {**row, "error": {"rc": rc, "log_tail": [log[-3000:] for log in logs]}}
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "memory/device_bytes" in r][-1]
    planned = plan_memory.device_bytes(cfg, sizes, plan["engine"], colocated=colocated)
    measured = {k: int(last[f"memory/{k}"]) for k in MEASURED if f"memory/{k}" in last}
    row["step"] = last["step"]
    row["measured"] = measured
    row["planned"] = planned
    row["ratio_total"] = round(measured["device_bytes"] / planned["total"], 5)
    row["parts_differ"] = {  # measured - planned of each part both have, where they differ
        p: measured[f"{p}_bytes"] - planned[p]
        for p in ("params", "optimizer", "reference", "sampler_weights", "kv_pages")
        if f"{p}_bytes" in measured and measured[f"{p}_bytes"] != planned[p]
    }
    row["full_f32_param_bytes"] = full_param_bytes(cfg)
    return row


def same_row(each: dict) -> dict:
    """one_e2t2's line on one process from each_e2t2's run there: the same engine mesh and devices."""
    row = {**each, "layout": "one_e2t2", "sampler": {**each["sampler"], "processes": 0}}
    row["same_as"] = "each_e2t2"
    row["job_command"] = each["job_command"].replace("mesh.processes=1", "mesh.processes=0")
    row["not_run"] = "rl.engine.mesh.processes=0 on 1 process is each_e2t2's layout; its run's figures"
    for key in ("seconds", "loadavg_before", "loadavg_after"):
        row.pop(key, None)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/memory_layouts.jsonl"))
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    p.add_argument("--hosts", default="1x8,2x4", help="processes x devices each, comma-separated")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--run-same", action="store_true", help="run one_e2t2 on one process too (= each_e2t2)")
    args = p.parse_args()
    hosts = [tuple(int(x) for x in h.split("x")) for h in args.hosts.split(",") if h]
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS] + [h for h in hosts if len(h) != 2]
    if unknown:
        sys.exit(f"unknown --layouts / --hosts {unknown}; layouts are {list(LAYOUTS)}, hosts like 2x4")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for processes, devices in hosts:
            for name in names:
                same = rows.get(("each_e2t2", processes, devices))
                try:
                    if name == "one_e2t2" and processes == 1 and same and not args.run_same:
                        row = same_row(same)
                    else:
                        row = run(name, processes, devices, tmp, args.timeout)
                except ConfigError as e:
                    row = {"bench": "memory_layouts", "layout": name, "hosts": f"{processes}x{devices}"}
                    row["skipped"] = str(e)
                rows[name, processes, devices] = row
                emit(row, out=args.out)


if __name__ == "__main__":
    main()
