"""Host side of one sandboxed run: launch (zygote or cold interpreter), pump the pipes, keep the wall limit.

`execute(spec, stdin, wall_s=..., output_bytes=..., use_zygote=...)` -> `Finished`. The spec is built by
`envs.sandbox`; the child side is `envs/sandbox_child.py`.

Launch: a zygote (`sandbox_child.py --zygote`, stdlib only, started once per process with an empty
environment) forks the children of runs, and where the spec allows (`spec["ahead"]`) keeps the next child
made ahead: its namespaces and mounts exist before the request, which then only brings what is the run's own
(`sandbox_child`'s docstring). The child's stdio, its status pipe and its events pipe come over a Unix socket
(SCM_RIGHTS) and its wait status comes back on the status pipe. `prepare(spec)` asks for a child made ahead
without a run. Without a zygote (`use_zygote=False`), each run starts the same child code in a fresh
interpreter (`sandbox_child.py --exec`): the cold path, with identical results.

Collect: stdout and stderr read concurrently, each kept up to `output_bytes` (the rest read and dropped,
`truncated`); at `wall_s` the run's process group gets SIGTERM, then SIGKILL `_TERM_GRACE_S` later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
CHILD_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # the zygote needs nothing of the host's
_TERM_GRACE_S = 0.2  # after SIGTERM at the wall limit, SIGKILL follows this much later
_DRAIN_S = 1.0  # after the command exits, how long to keep reading pipes a straggler still holds
_LOST_S = 5.0  # after SIGKILL, how long to wait for an exit status before giving up on it


@dataclasses.dataclass
class Finished:
    status: int | None  # the wait status; None when it was lost
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    wall_s: float
    events: list[dict]  # what the run's supervisor reported (sandbox_child.EVENTS_FD)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _Zygote:
    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-I", "-S", CHILD, "--zygote", str(theirs.fileno())]
        self.proc = subprocess.Popen(
            argv,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=CHILD_ENV,
            cwd="/",
        )
        theirs.close()
        self.sock, self.owner, self.lock = ours, os.getpid(), threading.Lock()

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def launch(self, spec: dict, fds: list[int]) -> None:
        """Sends a request (`sandbox_child.recv_message` reads it); a spec without "run" and no fds asks for
        a child made ahead only."""
        payload = json.dumps(spec).encode()
        head = struct.pack("!Q", len(payload))
        with self.lock:
            if fds:
                socket.send_fds(self.sock, [head], fds)
            else:
                self.sock.sendall(head)
            self.sock.sendall(payload)


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def start_zygote() -> bool:
    """Starts this process's zygote now (it also starts lazily on the first run); False if it cannot."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            try:
                _ZYGOTE = _Zygote()
            except OSError:
                _ZYGOTE = None
        return _ZYGOTE is not None


def prepare(spec: dict) -> bool:
    """Starts the zygote if need be and has it make a child ahead from `spec["prep"]` (a spec whose
    "ahead" is true), so that the first run with that prep finds one ready; False without a zygote."""
    if not start_zygote():
        return False
    try:
        _ZYGOTE.launch({"prep": spec["prep"], "ahead": spec["ahead"]}, [])
    except OSError:
        return False
    return True


def zygote_pid() -> int | None:
    """The pid of this process's live zygote, if any."""
    return _ZYGOTE.proc.pid if _ZYGOTE is not None and _ZYGOTE.alive() else None


def _report(fd: int, number: int, close: bool = False) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, f"{number}\n".encode())
    if close:
        os.close(fd)


def _launch_cold(spec: dict, fds: list[int]) -> None:
    """Runs the child code in a fresh interpreter; a thread reports its wait status like the zygote does."""
    spec_r, spec_w = os.pipe()
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in (fds[0], fds[1], fds[2], fds[4], spec_r)]
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(high)]
    argv = [sys.executable, "-I", "-S", CHILD, "--exec"]
    try:
        pid = os.posix_spawn(sys.executable, argv, CHILD_ENV, file_actions=actions, setsid=True)
    finally:
        for fd in (*high, spec_r):
            os.close(fd)
    data = memoryview(json.dumps(spec).encode())
    with contextlib.suppress(BrokenPipeError):
        while data:
            data = data[os.write(spec_w, data) :]
    os.close(spec_w)
    _report(fds[3], pid)
    threading.Thread(target=lambda: _report(fds[3], os.waitpid(pid, 0)[1], close=True), daemon=True).start()


def _launch(spec: dict, fds: list[int], use_zygote: bool) -> None:
    """Hands the child's fds (stdin, stdout, stderr, status, events) to a launcher; closes the status fd
    only through the launcher (it carries the pid line and the wait status)."""
    if use_zygote and start_zygote():
        try:
            _ZYGOTE.launch(spec, fds)
            os.close(fds[3])
            return
        except OSError:
            pass
    _launch_cold(spec, fds)


class _Capture:
    def __init__(self, cap: int):
        self.data, self.cap, self.truncated = bytearray(), cap, False

    def feed(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.truncated |= len(chunk) > room


def _read_line(fd: int, timeout: float) -> str | None:
    data = b""
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        ready = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
        chunk = os.read(fd, 1) if ready else b""
        if not chunk:
            return None
        data += chunk
    return data.decode()


class _Run:
    """One launched command: pumps stdin/stdout/stderr, watches the status pipe and the wall clock."""

    def __init__(
        self, pid: int, stdin: bytes, pipes: dict[str, int], wall_s: float, output_bytes: int, group: bool
    ):
        self.pid, self.wall_s, self.kill_group_at_end = pid, wall_s, group
        self.out, self.err = _Capture(output_bytes), _Capture(output_bytes)
        self.stdin, self.status_text, self.status = memoryview(stdin), b"", None
        self.timed_out, self.lost, self.drain_until = False, False, math.inf
        self.sel = selectors.DefaultSelector()
        self.sel.register(pipes["stdout"], selectors.EVENT_READ, self.out)
        self.sel.register(pipes["stderr"], selectors.EVENT_READ, self.err)
        self.sel.register(pipes["status"], selectors.EVENT_READ, "status")
        if stdin:
            os.set_blocking(pipes["stdin"], False)
            self.sel.register(pipes["stdin"], selectors.EVENT_WRITE, "stdin")
        else:
            os.close(pipes["stdin"])

    def pump(self, start: float) -> None:
        deadline, kill_at, give_up = start + self.wall_s, math.inf, math.inf
        while self.sel.get_map():
            now = time.monotonic()
            if self.status is None and not self.timed_out and now >= deadline:
                self.timed_out, kill_at = True, now + _TERM_GRACE_S
                _kill_group(self.pid, signal.SIGTERM)
            if now >= kill_at:
                kill_at, give_up = math.inf, now + _LOST_S
                _kill_group(self.pid, signal.SIGKILL)
            if now >= min(give_up, self.drain_until):
                break
            wake = min(math.inf if self.timed_out else deadline, kill_at, give_up, self.drain_until)
            for key, _ in self.sel.select(None if wake == math.inf else max(0.0, wake - now)):
                self._ready(key)
        self.lost = self.status is None
        self.close()

    def _ready(self, key: selectors.SelectorKey) -> None:
        fd = key.fd
        if key.data == "stdin":
            try:
                self.stdin = self.stdin[os.write(fd, self.stdin[: 1 << 16]) :]
            except BrokenPipeError:
                self.stdin = self.stdin[:0]
            if not self.stdin:
                self._close(fd)
            return
        chunk = os.read(fd, 1 << 16)
        if key.data == "status":
            self._status(fd, chunk)
        elif chunk:
            key.data.feed(chunk)
        else:
            self._close(fd)

    def _status(self, fd: int, chunk: bytes) -> None:
        self.status_text += chunk
        if chunk and not self.status_text.endswith(b"\n"):
            return
        self._close(fd)
        self.status = int(self.status_text) if self.status_text.strip() else None
        if self.status is None:
            self.drain_until = time.monotonic()  # the launcher is gone: nothing more to wait for
            return
        if self.kill_group_at_end:
            _kill_group(self.pid, signal.SIGKILL)  # stragglers that stayed in the group
        self.drain_until = time.monotonic() + _DRAIN_S  # pipes an escaped straggler holds stop mattering

    def _close(self, fd: int) -> None:
        self.sel.unregister(fd)
        os.close(fd)

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self._close(key.fd)
        self.sel.close()


def _read_events(fd: int) -> list[dict]:
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    os.close(fd)
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def execute(
    spec: dict, stdin: bytes, *, wall_s: float, output_bytes: int, use_zygote: bool = True
) -> Finished:
    (in_r, in_w), (out_r, out_w), (err_r, err_w), (st_r, st_w), (ev_r, ev_w) = (os.pipe() for _ in range(5))
    start = time.monotonic()
    try:
        _launch(spec, [in_r, out_w, err_w, st_w, ev_w], use_zygote)
    finally:
        for fd in (in_r, out_w, err_w, ev_w):
            os.close(fd)
    line = _read_line(st_r, _LOST_S)
    pid = int(line) if line else 0
    pipes = {"stdin": in_w, "stdout": out_r, "stderr": err_r, "status": st_r}
    run = _Run(pid, stdin, pipes, wall_s, output_bytes, group=spec["prep"]["level"] == "rlimits")
    if pid:
        run.pump(start)
    else:
        run.lost = True
        run.close()
    stderr = bytes(run.err.data) + (b"\nsandbox: exit status lost" if run.lost else b"")
    return Finished(
        status=run.status,
        stdout=bytes(run.out.data),
        stderr=stderr,
        truncated=run.out.truncated or run.err.truncated,
        timed_out=run.timed_out,
        wall_s=time.monotonic() - start,
        events=_read_events(ev_r),
    )
