"""Per-run cgroup v2 limits for `envs.sandbox`, where the host delegates a cgroup to this process.

`find(choice)` picks the parent directory per-run cgroups are made in:
    "auto"   this process's own cgroup v2, when it already hands the memory and pids controllers to child
             cgroups (its cgroup.subtree_control lists them) and this user may create children in it;
    a path   that directory (ENVS_SANDBOX_CGROUP=/sys/fs/cgroup/...): it must offer memory and pids, this
             user must be able to create children in it, and it must hold no processes of its own (cgroup
             v2 refuses controllers to a cgroup with processes); the controllers are enabled if they are not;
    "none"   no cgroups.
A run then gets its own child cgroup: memory.max (all its processes and their tmpfs pages together), no swap,
the whole run killed on OOM (memory.oom.group), pids.max and, where the cpu controller is there, cpu.max.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time

NEEDED = ("memory", "pids")
_names = itertools.count()


@dataclasses.dataclass(frozen=True)
class Delegation:
    parent: str | None  # where per-run cgroups go; None: no cgroup limits here
    reason: str  # where, or why none


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _mounts() -> dict[str, list[str]]:
    """fstype -> mount points, and for cgroup v1 each controller -> its mount point (as "cgroup:NAME")."""
    found: dict[str, list[str]] = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        point, (fstype, _, options) = left.split()[4], right.split()[:3]
        found.setdefault(fstype, []).append(point)
        if fstype == "cgroup":
            for option in options.split(","):
                found.setdefault(f"cgroup:{option}", []).append(point)
    return found


def _own_path() -> str:
    for line in _read("/proc/self/cgroup").splitlines():
        if line.startswith("0::"):
            return line[3:].rstrip("\n")
    return ""


def _usable(parent: str) -> str:
    """'' when per-run cgroups can be made in `parent`; else why not."""
    try:
        probe = os.path.join(parent, f"envs-probe-{os.getpid()}")
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        return f"cannot create a child cgroup in {parent}: {e.strerror}"
    return ""


def find(choice: str = "auto") -> Delegation:
    """Where per-run cgroups go (see the module docstring); ValueError for an unusable explicit path."""
    if choice == "none":
        return Delegation(None, "cgroups switched off (ENVS_SANDBOX_CGROUP=none)")
    mounts = _mounts()
    if choice != "auto":
        return _explicit(choice)
    if not mounts.get("cgroup2"):
        return Delegation(None, "no cgroup v2 mounted")
    own = os.path.join(mounts["cgroup2"][0], _own_path().lstrip("/"))
    offered = _read(os.path.join(own, "cgroup.controllers")).split()
    missing = [c for c in NEEDED if c not in offered]
    if missing:
        v1 = [c for c in missing if f"cgroup:{c}" in mounts]
        held = f" (cgroup v1 holds {', '.join(v1)})" if v1 else ""
        return Delegation(None, f"cgroup v2 at {own} offers no {', '.join(missing)} controller{held}")
    delegated = _read(os.path.join(own, "cgroup.subtree_control")).split()
    if any(c not in delegated for c in NEEDED):
        return Delegation(
            None,
            f"this process's cgroup {own} does not hand memory and pids to child cgroups; set "
            "ENVS_SANDBOX_CGROUP to a delegated cgroup v2 directory that holds no processes",
        )
    why = _usable(own)
    return Delegation(None, why) if why else Delegation(own, f"per-run cgroups under {own}")


def _explicit(parent: str) -> Delegation:
    fix = "set ENVS_SANDBOX_CGROUP to a cgroup v2 directory you may create children in, or to auto/none"
    offered = _read(os.path.join(parent, "cgroup.controllers")).split()
    missing = [c for c in NEEDED if c not in offered]
    if not os.path.isdir(parent) or missing:
        raise ValueError(f"ENVS_SANDBOX_CGROUP={parent}: not a cgroup v2 directory offering {NEEDED}; {fix}")
    wanted = [c for c in (*NEEDED, "cpu") if c in offered]
    delegated = _read(os.path.join(parent, "cgroup.subtree_control")).split()
    if any(c not in delegated for c in wanted):
        try:
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write(" ".join(f"+{c}" for c in wanted))
        except OSError as e:
            raise ValueError(
                f"ENVS_SANDBOX_CGROUP={parent}: cannot enable {wanted} for its children ({e.strerror}; "
                f"a cgroup that holds processes cannot); {fix}"
            ) from None
    why = _usable(parent)
    if why:
        raise ValueError(f"ENVS_SANDBOX_CGROUP={parent}: {why}; {fix}")
    return Delegation(parent, f"per-run cgroups under {parent}")


def _set(path: str, name: str, value: str) -> None:
    target = os.path.join(path, name)
    if os.path.exists(target):
        with open(target, "w") as f:
            f.write(value)


def create(parent: str, *, memory_bytes: int, max_procs: int, cpus: float) -> str:
    """A fresh cgroup for one run under `parent`, with its limits written; returns its path."""
    path = os.path.join(parent, f"envs-run-{os.getpid()}-{next(_names)}")
    os.mkdir(path)
    _set(path, "memory.max", str(memory_bytes))
    _set(path, "memory.swap.max", "0")
    _set(path, "memory.oom.group", "1")
    _set(path, "pids.max", str(max_procs))
    _set(path, "cpu.max", f"{max(1000, int(cpus * 100_000))} 100000")
    return path


def finish(path: str, timeout_s: float = 2.0) -> bool:
    """Kills whatever is left in the run's cgroup and removes it; True if the kernel OOM-killed in it."""
    events = dict(line.split() for line in _read(os.path.join(path, "memory.events")).splitlines())
    _set(path, "cgroup.kill", "1")
    deadline = time.monotonic() + timeout_s
    while "populated 1" in _read(os.path.join(path, "cgroup.events")) and time.monotonic() < deadline:
        time.sleep(0.005)
    with contextlib.suppress(OSError):  # a process the kill could not reach yet: empty once it is gone
        os.rmdir(path)
    return int(events.get("oom_kill", "0")) + int(events.get("oom_group_kill", "0")) > 0
