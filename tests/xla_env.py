"""XLA_FLAGS for the tests' child processes (main jobs, hosts, notebook kernels): the parent's flags (the
quick backend `conftest.py` sets, anything the caller gave) with the child's own fake-device count (None:
none, the child's default)."""

import os


def child_flags(devices: int | None) -> str:
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    return " ".join(count + kept)
