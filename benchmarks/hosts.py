"""Several processes of one multi-controller JAX program on this machine, for the benchmarks that measure the
main job across hosts (weight_sync.py --processes, memory_layouts.py, rss_slope.py): each process gets its
own fake CPU devices and joins the others at 127.0.0.1 (gloo collectives), its output in its own log file.

    procs, logs = hosts.start(argv, processes=2, devices=4, log_dir=tmp)
    failed = hosts.wait(procs, timeout=1800)   # None, or the index of the first that failed or ran over
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOIN_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int, port: int, index: int, processes: int) -> dict:
    """Process `index` of `processes` on CPU with `devices` fake devices (the caller's other XLA_FLAGS
    kept) and the repository's compilation cache; one process joins nothing."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join([f"--xla_force_host_platform_device_count={devices}"] + kept)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".jax_cache"))
    for k in JOIN_VARS:
        env.pop(k, None)
    if processes > 1:
        env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
        env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"] = str(processes), str(index)
    return env


def start(argv: list[str], *, processes: int, devices: int, log_dir) -> tuple[list, list[pathlib.Path]]:
    """Starts `argv` as `processes` processes (in the repository root); (the processes, their log files)."""
    port, procs, logs = free_port(), [], []
    for i in range(processes):
        logs.append(pathlib.Path(log_dir) / f"process{i}.log")
        with open(logs[-1], "w") as log:  # the child writes to its own copy of the descriptor
            env = process_env(devices, port, i, processes)
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs, logs


def wait(procs: list, timeout: float) -> int | None:
    """Waits for every process; on the first that fails or runs past `timeout` seconds (its index is
    returned), the others are stopped (`stop`)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is None and time.monotonic() > deadline:
            failed = codes.index(None)
        if failed is not None or all(c == 0 for c in codes):
            break
        time.sleep(0.5)
    for p in procs:
        stop(p)
    return failed


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stops `proc` if it still runs: SIGTERM, then SIGKILL after `grace` seconds (a process stuck in a
    collective with a failed peer may not end on SIGTERM)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
