"""Host side of one sandboxed run: launch (zygote or cold interpreter), pump the pipes, keep the wall limit.

`execute(spec, stdin, wall_s=..., output_bytes=..., use_zygote=...)` -> `Finished`. The spec is built by
`envs.sandbox`; the child side is `envs/sandbox/child.py`.

Launch: a zygote (`zygote.py`, stdlib only, started once per process with an empty
environment) forks the children of runs and, where the spec allows (`spec["prep"]["ahead"]`), keeps the
next child made ahead: its namespaces and mounts exist before the request, which then only brings what is
the run's own (`child`'s docstring). The child's stdio, its status pipe and its events pipe come
over a Unix socket (SCM_RIGHTS) and its wait status comes back on the status pipe. `prepare(spec)` asks for
a child made ahead without a run. Without a zygote (`use_zygote=False`), each run starts the same child
code in a fresh interpreter (`child.py --exec`): the cold path, with identical results.

Collect: stdout and stderr read concurrently, each kept up to `output_bytes` (the rest read and dropped,
`truncated`); at `wall_s` the run's process group gets SIGTERM, then SIGKILL `_TERM_GRACE_S` later.
"""

from __future__ import annotations

import collections
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
import subprocess
import sys
import threading
import time

from envs.sandbox.messages import recv_message, report, send_message

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
ZYGOTE = os.path.join(os.path.dirname(CHILD), "zygote.py")
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
    events: list[dict]  # what the run's supervisor reported (messages.EVENTS_FD)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _Zygote:
    """The host's side of the zygote (`zygote.py`): a socket for requests, and the children made
    ahead that the zygote has handed over (their pid and channel, by the prep they were made from), to
    which a run goes straight from here."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-I", "-S", ZYGOTE, "--zygote", str(theirs.fileno())]
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
        self.ahead: collections.deque[tuple[bytes, int, socket.socket]] = collections.deque()

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def launch(self, spec: dict, fds: list[int]) -> int | None:
        """Starts a run (fds: stdin, stdout, stderr, status, events): through a child made ahead for its
        prep, whose pid it returns (the zygote gets the status pipe, to report C's end if the run's PID 1
        does not), else through the zygote, which writes the pid to the status pipe (None). A spec without
        "run" and no fds asks for children made ahead only."""
        prep, run = json.dumps(spec["prep"]).encode(), spec.get("run")
        with self.lock:
            self._collect(prep if spec["prep"]["ahead"] else None)
            if run is None:
                send_message(self.sock, b"ahead\n" + prep, [])
                return None
            payload = json.dumps(run).encode()
            while self.ahead and self.ahead[0][0] == prep:
                _, pid, channel = self.ahead.popleft()
                try:
                    if select.select([channel], [], [], 0)[0]:  # it never writes: readable is its end
                        continue
                    send_message(channel, payload, fds)
                except OSError:
                    continue
                finally:
                    channel.close()
                with contextlib.suppress(OSError):  # the run has started: never start it again elsewhere
                    send_message(self.sock, b"claim\n" + prep + b"\n" + str(pid).encode(), [fds[3]])
                return pid
            send_message(self.sock, b"run\n" + prep + b"\n" + payload, fds)
            return None

    def _collect(self, prep: bytes | None) -> None:
        """Takes the children the zygote has handed over since; drops those made for a prep other than
        `prep` (a request that may be served ahead: the zygote makes its new ones for this prep)."""
        while select.select([self.sock], [], [], 0)[0]:
            message = recv_message(self.sock)
            if message is None:
                return
            made, _, pid = message[0].rpartition(b"\n")
            self.ahead.append((made, int(pid), socket.socket(fileno=message[1][0])))
        if prep is not None:
            for entry in [e for e in self.ahead if e[0] != prep]:
                self.ahead.remove(entry)
                entry[2].close()  # at EOF it ends once made


def encode(spec: dict) -> bytes:
    """The cold path's spec on fd 4: the prep's JSON, a newline, the run's JSON."""
    return json.dumps(spec["prep"]).encode() + b"\n" + json.dumps(spec["run"]).encode()


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _forget_zygote() -> None:
    """In a forked child of the host: the zygote and the children it handed over stay the parent's (a copy
    of a handed channel here would keep a child the parent drops waiting)."""
    global _ZYGOTE, _ZYGOTE_LOCK
    if _ZYGOTE is not None:
        for _, _, channel in _ZYGOTE.ahead:
            channel.close()
        _ZYGOTE.sock.close()
    _ZYGOTE, _ZYGOTE_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_zygote)


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
    """Starts the zygote if need be and has it make children ahead from `spec["prep"]` (whose "ahead" is
    true), so that the first run with that prep finds one ready; False without a zygote."""
    if not start_zygote():
        return False
    try:
        _ZYGOTE.launch({"prep": spec["prep"]}, [])
    except OSError:
        return False
    return True


def zygote_pid() -> int | None:
    """The pid of this process's live zygote, if any."""
    return _ZYGOTE.proc.pid if _ZYGOTE is not None and _ZYGOTE.alive() else None


def _launch_cold(spec: dict, fds: list[int]) -> int:
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
    data = memoryview(encode(spec))
    with contextlib.suppress(BrokenPipeError):
        while data:
            data = data[os.write(spec_w, data) :]
    os.close(spec_w)
    status_fd = os.dup(fds[3])
    reporter = threading.Thread(target=lambda: report(status_fd, os.waitpid(pid, 0)[1], close=True))
    reporter.daemon = True
    reporter.start()
    return pid


def _launch(spec: dict, fds: list[int], use_zygote: bool) -> int | None:
    """Hands the child's fds (stdin, stdout, stderr, status, events) to a launcher; returns the pid of the
    run's C when it is known here, else None: the first line on the status pipe is the pid, the next the
    wait status. Closes the status fd (the launcher has it)."""
    try:
        if use_zygote and start_zygote():
            try:
                return _ZYGOTE.launch(spec, fds)
            except OSError:
                pass
        return _launch_cold(spec, fds)
    finally:
        os.close(fds[3])


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
        if chunk and b"\n" not in self.status_text:
            return
        self._close(fd)
        first = self.status_text.split(b"\n", 1)[0]  # the run's PID 1 may write before the zygote does
        self.status = int(first) if first.strip() else None
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
        pid = _launch(spec, [in_r, out_w, err_w, st_w, ev_w], use_zygote)
    finally:
        for fd in (in_r, out_w, err_w, ev_w):
            os.close(fd)
    if pid is None:
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
