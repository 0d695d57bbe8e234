"""The memory watchdog of a sandboxed run: C's side, between the run's start and its end.

Standard library only, like `envs.sandbox.child`, which uses it. C reads the run's own /proc through a
descriptor (`_open_run_proc`), adds up the anonymous and shared memory its processes map (`_memory_in`) every
`WATCH_S` (every `WATCH_NEAR_S` from half the limit on) and kills every one of them past the run's total
(`_kill_all`), reporting `{"memory_exceeded": bytes}` on `messages.EVENTS_FD`. It runs at a higher priority
than the run (`raise_priority`, `lower_run_priority`) so that it gets a core within its period.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import struct
import sys

if __package__:  # imported as envs.sandbox.watchdog (by the host)
    from envs.sandbox import messages, mounts
else:  # run from a script (`python -I -S child.py`, the zygote): `-I` leaves the script's directory out
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import messages
    import mounts

WATCH_S = 0.01  # the memory watchdog's period while the run holds under half its total
WATCH_NEAR_S = 0.002  # its period from half the total on: a burst of processes that start together faults
# memory in quickly and lands inside one period
RUN_NICE: int | None = None  # the run's processes' nice value, from `raise_priority`
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # sched_setattr's system call number
_RSS = re.compile(rb"^Rss(?:Anon|Shmem):\s+(\d+) kB", re.M)


def _open_run_proc(proc: str | int, host_proc_dev: int) -> int | None:
    """A descriptor of the run's /proc, from `proc` (a path, or a descriptor of the directory), or None while
    that is still the host's /proc: one descriptor per look, so that measuring and killing see the same
    /proc even where `proc` is a path that could come to name another."""
    try:
        fd = os.open(proc if isinstance(proc, str) else ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
                     dir_fd=None if isinstance(proc, str) else proc)  # fmt: skip
    except OSError:
        return None
    if os.fstat(fd).st_dev == host_proc_dev:
        os.close(fd)
        return None
    return fd


def _pids_in(proc: int) -> list[str]:
    """The process directories of the /proc open at `proc`."""
    try:
        return [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return []


def _memory_in(proc: int) -> int:
    """Bytes of anonymous and shared memory mapped by the processes of the PID namespace whose /proc is open
    at `proc`."""
    total = 0
    for name in _pids_in(proc):
        with (
            contextlib.suppress(OSError),
            open(os.open(f"{name}/status", os.O_RDONLY, dir_fd=proc), "rb") as f,
        ):
            total += sum(int(kb) for kb in _RSS.findall(f.read())) << 10
    return total


def _sched_slice(slice_ns: int) -> None:
    """This process's time slice request under EEVDF (sched_setattr's sched_runtime for SCHED_OTHER, Linux
    6.12+; 0: the default): a shorter request than the running task's lets a waking task preempt it. No
    privilege needed; where the kernel or architecture has no such call, nothing happens."""
    number = _SCHED_SETATTR.get(os.uname().machine)
    if number is not None:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        attr = struct.pack("=IIqiIQQQ", 48, 0, 0, nice, 0, slice_ns, 0, 0)  # struct sched_attr, version 0
        mounts.LIBC.syscall(number, 0, attr, 0)


def raise_priority(nice_below: int, slice_ns: int) -> None:
    """C, while it may (before it drops privileges): the watchdog must run within its period on a machine
    whose cores the run's processes (and the host's) keep busy, or the run faults memory in meanwhile. C's
    nice value goes `nice_below` under the host's where lowering it is allowed (CAP_SYS_NICE: root, say);
    elsewhere the run's goes `nice_below` above it instead (`lower_run_priority`). A short slice request
    (`slice_ns`, `_sched_slice`) is set too; alone, it does not get C a core in time beside a busy host."""
    global RUN_NICE
    host = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(-20, host - nice_below))
        RUN_NICE = host
    except PermissionError:
        RUN_NICE = min(19, host + nice_below)
    _sched_slice(slice_ns)


def lower_run_priority() -> None:
    """I, or bwrap's process, before anything of the run: the run's nice value (`raise_priority`) and the
    default slice."""
    if RUN_NICE is not None:
        os.setpriority(os.PRIO_PROCESS, 0, RUN_NICE)
        _sched_slice(0)


def _kill_all(proc: int) -> None:
    """SIGKILL to every process of the PID namespace whose /proc is open at `proc`, each through a descriptor
    of its /proc directory (`pidfd_send_signal`), at once: killing PID 1 alone leaves the others running, and
    faulting in memory, until PID 1 is scheduled and its exit kills them."""
    for name in _pids_in(proc):
        with contextlib.suppress(OSError):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc)
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            finally:
                os.close(fd)


def watch(pid: int, limit: int | None, proc: str | int | None, report: socket.socket | None = None) -> int:
    """Waits for `pid` to end, or for its wait-status line on `report`; with a `limit`, kills `pid` when
    the run's processes together map more memory than that. Returns the reported status, else `pid`'s."""
    watching = limit is not None and proc is not None
    pidfd = os.pidfd_open(pid)
    host_dev = os.stat("/proc").st_dev
    line, waits, used = b"", [pidfd] + ([report] if report is not None else []), 0
    try:
        while True:
            period = (WATCH_NEAR_S if 2 * used >= limit else WATCH_S) if watching else None
            ready = select.select(waits, [], [], period)[0]
            if report is not None and report in ready:
                chunk = report.recv(64)
                line += chunk
                if not chunk or line.endswith(b"\n"):
                    break
            elif pidfd in ready:
                break
            elif watching and (run_proc := _open_run_proc(proc, host_dev)) is not None:
                try:
                    if (used := _memory_in(run_proc)) > limit:
                        _kill_all(run_proc)
                        os.kill(pid, signal.SIGKILL)
                        os.write(messages.EVENTS_FD, json.dumps({"memory_exceeded": used}).encode() + b"\n")
                        break
                finally:
                    os.close(run_proc)
    finally:
        os.close(pidfd)
    return int(line) if line.endswith(b"\n") else os.waitpid(pid, 0)[1]


def watch_limit(prep: dict, run: dict) -> int | None:
    return run["limits"]["total_memory_bytes"] if prep["watch"] else None


def proc_inside(pid: int) -> str:
    """The /proc that process `pid` sees (under its root): the run's own once its PID namespace mounts it."""
    return os.path.join("/proc", str(pid), "root", "proc")
