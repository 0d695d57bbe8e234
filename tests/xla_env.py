"""What the tests' child processes (main jobs, hosts, notebook kernels) run with: `child_flags`, the parent's
XLA_FLAGS (the quick backend `conftest.py` sets, anything the caller gave) with the child's own fake-device
count (None: none, the child's default); `process_env`, the environment of one process of a multi-process
JAX program on CPU (gloo), with the tests' compilation cache; `free_port` for its coordinator."""

import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOIN_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def child_flags(devices: int | None) -> str:
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    return " ".join(count + kept)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int, port: int | None = None, index: int = 0, count: int = 2, **extra) -> dict:
    """A child's environment: CPU, `devices` fake devices, the tests' compilation cache, and with a `port`
    process `index` of `count` joined at 127.0.0.1:port (without one, none of the join variables)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=child_flags(devices),
        JAX_COMPILATION_CACHE_DIR=os.path.join(ROOT, ".jax_cache"),
        **extra,
    )
    for k in JOIN_VARS:
        env.pop(k, None)
    if port is not None:
        env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
        env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"] = str(count), str(index)
    return env
