"""The zygote of `envs.sandbox`: a stdlib-only process that forks the children of runs, some made ahead.

Run as a script by `envs.sandbox.launch`: `python -I -S zygote.py --zygote FD`, FD a Unix socket to the
host. Requests on it (`launch._Zygote`'s; a kind, the prep's JSON, what else the kind needs):

    run    the run's JSON, with the run's stdin, stdout, stderr, the host's status pipe and events fds: a
           child is forked from the prep, its pid written to the status pipe (the host's kill target), the
           run and fds handed to it
    claim  a pid, with the status pipe: the host has sent a run to that child made ahead itself
    ahead  nothing more: make children ahead from this prep

Children made ahead (`prep["ahead"]`, `child.AHEAD` of them) are forked from the prep before any
request: each makes its namespaces and mounts, then waits on its channel. The zygote hands each to the host
at once (the prep's JSON and the pid, with the channel's fd); the host sends a run straight to the oldest
made for the run's prep, then claims it. A channel closes with its one run, so no child serves two, and
each claim (or a run for another prep, or a handed child's end) makes the next at once; the host drops
those made for another prep (at EOF they end). For every run the zygote writes C's wait status once it has
reaped C; at the own backend's namespaced levels the run's PID 1 writes the command's wait status there
first (the host takes the first line) and C ends after it. The zygote is the subreaper of what its
children leave: a run's PID 1 ends just after its C.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's directory out

import child  # noqa: E402
import messages  # noqa: E402

_PR_SET_CHILD_SUBREAPER = 36


class _Child:
    """A forked C (`child.run_child`) that takes its run from its channel (at `SPEC_FD`)."""

    def __init__(self, prep: dict, devnull: int):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid = os.fork()
        if self.pid == 0:
            signal.set_wakeup_fd(-1)
            messages.place_fds([devnull, devnull, devnull, devnull, theirs.fileno()])  # SPEC_FD: the channel
            child.run_child(prep)
        theirs.close()
        self.channel = ours


class _Zygote:
    def __init__(self, host: socket.socket):
        self.host, self.devnull = host, os.open(os.devnull, os.O_RDWR)
        self.children: dict[int, int] = {}  # the pid of a run's C -> the host's status fd for it
        self.handed: dict[int, bytes] = {}  # children made ahead and handed to the host -> their prep
        self.ended: dict[int, int] = {}  # wait statuses of handed children that ended before their claim
        self.ahead_key = b""  # the prep the last children made ahead were made from
        self.parsed: tuple[bytes, dict] = (b"", {})

    def request(self, payload: bytes, fds: list[int]) -> None:
        """`run`: a run for a child forked now (fds: stdin, stdout, stderr, the host's status pipe, of which
        a copy stays here, events); `claim`: the host sent a run to a child it was handed (fds: the status
        pipe); `ahead`: only make children ahead."""
        kind, _, rest = payload.partition(b"\n")
        if kind == b"claim":
            key, _, pid_text = rest.rpartition(b"\n")
            pid = int(pid_text)
            self.handed.pop(pid, None)
            if pid in self.ended:
                messages.report(fds[0], self.ended.pop(pid), close=True)
            else:
                self.children[pid] = fds[0]
        elif kind == b"run":
            key, _, run = rest.partition(b"\n")
            self._start(key, run, fds)
        else:
            key = rest
        self._make_ahead(key)

    def _prep(self, key: bytes) -> dict:
        if self.parsed[0] != key:
            self.parsed = (key, json.loads(key))
        return self.parsed[1]

    def _make_ahead(self, key: bytes) -> None:
        """Tops the children made ahead from this prep, handed and not yet claimed, up to `AHEAD`. Each is
        handed to the host at once (its pid and channel), which sends it its run without the zygote."""
        prep = self._prep(key)
        if not prep["ahead"]:
            return
        self.ahead_key = key  # the host drops those made for another prep
        while sum(made == key for made in self.handed.values()) < child.AHEAD:
            try:
                made = _Child(prep, self.devnull)
            except OSError:
                return
            try:
                messages.send_message(
                    self.host, key + b"\n" + str(made.pid).encode(), [made.channel.fileno()]
                )
                self.handed[made.pid] = key
            except OSError:
                with contextlib.suppress(OSError):
                    os.kill(made.pid, signal.SIGKILL)
                return
            finally:
                made.channel.close()

    def _start(self, key: bytes, run: bytes, fds: list[int]) -> None:
        """The pid goes to the host before the run to the child (whose PID 1 may report on the same pipe)."""
        try:
            started = _Child(self._prep(key), self.devnull)
        except OSError:
            for fd in fds:
                os.close(fd)  # the host reads EOF instead of a pid: no child
            return
        messages.report(fds[3], started.pid)
        try:
            messages.send_message(started.channel, run, fds)
            self.children[started.pid] = fds[3]
        except OSError:  # it died at once: the host finds the status lost
            os.close(fds[3])
            with contextlib.suppress(OSError):
                os.kill(started.pid, signal.SIGKILL)
        finally:
            started.channel.close()
            for fd in (fds[0], fds[1], fds[2], fds[4]):
                os.close(fd)

    def close(self) -> None:
        for pid in [*self.children, *self.handed]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def reap(self) -> None:
        """Reports ended runs; keeps the status of a handed child that ended unclaimed (its claim may be on
        the way); also reaps runs' PID 1s (orphans here)."""
        replace = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            fd = self.children.pop(pid, None)
            if fd is not None:
                messages.report(fd, status, close=True)
            elif self.handed.pop(pid, None) is not None:
                self.ended[pid] = status
                while len(self.ended) > 64:  # dropped by the host: no claim will come
                    del self.ended[next(iter(self.ended))]
                replace = True
        if replace and self.ahead_key:
            self._make_ahead(self.ahead_key)


def zygote_main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    child._prctl(_PR_SET_CHILD_SUBREAPER, 1)
    zygote = _Zygote(sock)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                message = messages.recv_message(sock)
                if message is None:
                    zygote.close()
                    return
                zygote.request(*message)
            else:
                os.read(wake_r, 4096)
            zygote.reap()


if __name__ == "__main__":
    if sys.argv[1:2] != ["--zygote"]:
        sys.exit("usage: zygote.py --zygote FD (started by envs.sandbox.launch)")
    zygote_main(int(sys.argv[2]))
