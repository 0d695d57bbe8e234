"""Running untrusted, model-written commands: a work dir, rlimits, no network, a wall clock, capped output.

    with Sandbox(files={"main.py": code}) as sb:
        result = sb.run("python3 main.py", stdin="3 4\\n")   # result.status: ok / error / timeout / killed

Every run gets: the sandbox's work dir as cwd and HOME; a scrubbed environment (PATH=/usr/bin:/bin,
HOME=workdir, LANG=C.UTF-8, nothing inherited, the caller's `env` added); rlimits on CPU seconds (rounded up
to whole seconds; SIGXCPU, then SIGKILL one second later), address space, processes, file size and open
files; no core dumps; its own session, killed as a group (SIGTERM, then SIGKILL after `_TERM_GRACE_S`) at
the wall-clock limit; stdout and stderr read concurrently, each kept up to `Limits.output_bytes` (the rest is
read and dropped, `truncated=True`). A host process running as root runs sandboxed code as `nobody` (65534),
so root's files are not writable from inside and RLIMIT_NPROC is enforced at all (the kernel exempts root).

Isolation levels (`isolation_level()`, detected once per process by running `true` under each candidate;
reported as `RunResult.isolation`, with a "+network" suffix for `Sandbox(network=True)`):

- "bwrap": bubblewrap with `--unshare-all --die-with-parent --new-session`, the host bound read-only, a
  private /tmp, /dev and /proc, and only the work dir writable. No network (unless network=True), no writes
  outside the work dir, nothing left running after the run (the PID namespace dies with bwrap).
- "unshare-net": what `unshare --user --map-root-user --net --pid --fork` does, done by the forked child
  itself (no extra exec): a user namespace, a network namespace with only loopback (up, no routes: nothing
  outside the host is reachable), and a PID namespace whose init is a small reaper (the command is PID 2),
  so every process the run started dies when the command exits or is killed. RLIMIT_NPROC is set inside
  the fresh user namespace, so it counts this run's processes only. The filesystem is the host's: the
  command can read whatever its uid can read and write whatever its uid can write (as `nobody`:
  world-writable places such as /tmp; as an ordinary user: that user's files). Hide secrets from it by
  file permissions.
- "rlimits": no namespaces. Network is reachable. Processes are confined by rlimits and by the process-group
  kill only; one that calls setsid() escapes the kill. RLIMIT_NPROC is per real uid here, so it is set to
  (that uid's current thread count + max_procs), which still counts the user's other processes.

Start: a zygote (this file run as `python -I -S`, stdlib only) is started once per process (lazily, or by
`start_zygote()`) and forks one child per run, which sets itself up and execs; its fds come over a Unix socket
(SCM_RIGHTS) and its wait status comes back on a pipe. Without a zygote, each run starts the same child code
in a fresh interpreter (`python -I -S sandbox.py --exec`): the cold path, with identical results.

Not guaranteed: limits on disk usage beyond RLIMIT_FSIZE per file, on pipe/socket memory, or on reading host
files in "unshare-net"/"rlimits"; RLIMIT_AS counts virtual memory (a runtime that reserves a lot of address
space needs a larger limit); a command line or environment over the kernel's 128 KiB per-string limit fails.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref

LEVELS = ("bwrap", "unshare-net", "rlimits")
BASE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
NOBODY = 65534
_TERM_GRACE_S = 0.2  # after SIGTERM at the wall limit, SIGKILL follows this much later
_DRAIN_S = 1.0  # after the command exits, how long to keep reading pipes a straggler still holds
_LOST_S = 5.0  # after SIGKILL, how long to wait for an exit status before giving up on it
_LOST_NOTE = "\nsandbox: exit status lost (the launcher died)"
_SELF = os.path.abspath(__file__)
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4


@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_s: float = 5.0  # RLIMIT_CPU, rounded up to whole seconds
    wall_s: float = 10.0  # wall-clock timeout of one run
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    max_procs: int = 64  # RLIMIT_NPROC (how it is counted depends on the isolation level; see above)
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 64 << 10  # stdout and stderr are each capped at this many bytes (then truncated)


@dataclasses.dataclass
class RunResult:
    returncode: int | None  # None when the command died from a signal or its status was lost
    stdout: str
    stderr: str
    timed_out: bool
    signal: int | None  # the signal that ended the command
    truncated: bool  # stdout or stderr went over Limits.output_bytes
    wall_s: float
    isolation: str

    @property
    def status(self) -> str:
        """ok (exit 0), error (nonzero exit), timeout (wall clock), killed (a signal, e.g. an rlimit)."""
        if self.timed_out:
            return "timeout"
        if self.signal is not None:
            return "killed"
        return "ok" if self.returncode == 0 else "error"


# ----------------------------------------------------------------------------------------------------------
# Child side: runs in the forked (zygote) or fresh (cold) process that becomes the command.


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _write_proc(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    _libc().prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # setuid cleared it; uid_map must stay writable


def _loopback_up() -> None:
    import fcntl

    iff_up, siocgifflags, siocsifflags = 0x1, 0x8913, 0x8914
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, siocgifflags, struct.pack("16sH22x", b"lo", 0))[:18])[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def _enter_namespaces(network: bool) -> None:
    """Fresh user (+ network) + PID namespaces; the caller's next child is PID 1 of the new namespace."""
    import ctypes

    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWUSER | _CLONE_NEWPID | (0 if network else _CLONE_NEWNET)
    if _libc().unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    _write_proc("/proc/self/uid_map", f"0 {uid} 1\n")
    _write_proc("/proc/self/setgroups", "deny")
    _write_proc("/proc/self/gid_map", f"0 {gid} 1\n")
    if not network:
        _loopback_up()


def _end_like(status: int) -> None:
    """End this process the way a wait status says: the same exit code, or the same signal."""
    import resource

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _fork_init() -> None:
    """Forks PID 1 of the new PID namespace, a reaper, and under it the command's process (the only one that
    returns). The command is not PID 1, so its signals behave as usual; when it ends, PID 1 exits and the
    kernel kills whatever else is left in the namespace. This process waits and ends as the command did."""
    status_r, status_w = os.pipe()
    init = os.fork()
    if init:
        os.close(status_w)
        _, init_status = os.waitpid(init, 0)
        reported = os.read(status_r, 64)
        _end_like(int(reported) if reported else init_status)
    os.close(status_r)
    _libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    command = os.fork()
    if command == 0:
        os.close(status_w)
        return
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == command:
            os.write(status_w, str(status).encode())
            os._exit(0)


def _user_tasks(uid: int) -> int:
    """Threads of real uid `uid` (what RLIMIT_NPROC counts outside a fresh user namespace)."""
    count = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue
        if "Uid" in fields and int(fields["Uid"].split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _set_limit(resource_id: int, soft: int, hard: int | None = None) -> None:
    import resource

    cap = resource.getrlimit(resource_id)[1]
    hard = soft if hard is None else hard
    if cap != resource.RLIM_INFINITY:
        soft, hard = min(soft, cap), min(hard, cap)
    resource.setrlimit(resource_id, (soft, hard))


def _set_rlimits(limits: dict, nproc: int) -> None:
    import resource

    cpu = max(1, math.ceil(limits["cpu_s"]))
    _set_limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _set_limit(resource.RLIMIT_AS, limits["memory_bytes"])
    _set_limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    _set_limit(resource.RLIMIT_NOFILE, limits["open_files"])
    _set_limit(resource.RLIMIT_CORE, 0)
    _set_limit(resource.RLIMIT_NPROC, nproc)


def _preload() -> None:
    """Imports what the child needs while it can still read the interpreter's files (before dropping uid)."""
    _libc()
    import fcntl  # noqa: F401
    import resource  # noqa: F401


def _exec_child(spec: dict) -> None:
    """Become the command described by `spec` (fds 0-2 are already its stdio). Never returns."""
    try:
        _preload()
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE and SIGXFSZ; the command must not
        os.closerange(3, 65536)
        if os.getsid(0) != os.getpid():
            os.setsid()
        os.umask(0o022)
        if spec["uid"] is not None:
            _drop_privileges(spec["uid"])
        _libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        nproc = spec["limits"]["max_procs"]
        if spec["level"] == "unshare-net":
            _enter_namespaces(spec["network"])
            _fork_init()
        else:
            nproc += _user_tasks(os.getuid())
        _set_rlimits(spec["limits"], nproc)
        os.chdir(spec["cwd"])
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except FileNotFoundError as e:
        os.write(2, f"sandbox: {e.filename}: command not found\n".encode())
        os._exit(127)
    except BaseException as e:  # noqa: BLE001 - anything here must end the child, never return to a caller
        os.write(2, f"sandbox: setup failed: {e!r}\n".encode())
        os._exit(126)


# ----------------------------------------------------------------------------------------------------------
# Zygote side: a stdlib-only process that forks one child per request.


def _recv_exact(sock: socket.socket, n: int, head: bytes = b"") -> bytes:
    data = bytearray(head)
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _recv_request(sock: socket.socket) -> tuple[dict, list[int]] | None:
    try:
        head, fds, _, _ = socket.recv_fds(sock, 8, 4)
    except ConnectionError:
        return None
    if not head:
        return None
    (size,) = struct.unpack("!Q", _recv_exact(sock, 8, head))
    return json.loads(_recv_exact(sock, size)), fds


def _fork_child(spec: dict, fds: list[int]) -> int:
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        _exec_child(spec)
    return pid


def _report(fd: int, number: int, close: bool = False) -> None:
    """One line to the host's status pipe; a host that stopped listening must not take the zygote down."""
    with contextlib.suppress(OSError):
        os.write(fd, f"{number}\n".encode())
    if close:
        os.close(fd)


def _reap(children: dict[int, int]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        fd = children.pop(pid, None)
        if fd is not None:
            _report(fd, status, close=True)


def _zygote_main(fd: int) -> None:
    _preload()
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: dict[int, int] = {}
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                request = _recv_request(sock)
                if request is None:
                    for pid in children:
                        _kill_group(pid, signal.SIGKILL)
                    return
                spec, fds = request
                try:
                    pid = _fork_child(spec, fds)
                    _report(fds[3], pid)
                    children[pid] = fds[3]
                except OSError:
                    os.close(fds[3])  # the host reads EOF instead of a pid: no child
                for f in fds[:3]:
                    os.close(f)
            else:
                os.read(wake_r, 4096)
            _reap(children)


# ----------------------------------------------------------------------------------------------------------
# Host side: launching (zygote or cold), collecting output, enforcing the wall clock.


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _Zygote:
    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-I", "-S", _SELF, "--zygote", str(theirs.fileno())]
        self.proc = subprocess.Popen(
            argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True
        )
        theirs.close()
        self.sock, self.owner, self.lock = ours, os.getpid(), threading.Lock()

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def launch(self, spec: dict, fds: list[int]) -> None:
        payload = json.dumps(spec).encode()
        with self.lock:
            socket.send_fds(self.sock, [struct.pack("!Q", len(payload))], fds)
            self.sock.sendall(payload)


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()
_USE_ZYGOTE = True  # tests switch it off to compare the two paths


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


def _launch_cold(spec: dict, fds: list[int]) -> None:
    """Runs the child code in a fresh interpreter; a thread reports its wait status like the zygote does."""
    spec_r, spec_w = os.pipe()
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate([*fds[:3], spec_r])]
    argv = [sys.executable, "-I", "-S", _SELF, "--exec"]
    try:
        pid = os.posix_spawn(sys.executable, argv, {}, file_actions=actions, setsid=True)
    finally:
        os.close(spec_r)
    data = memoryview(json.dumps(spec).encode())
    with contextlib.suppress(BrokenPipeError):
        while data:
            data = data[os.write(spec_w, data) :]
    os.close(spec_w)
    _report(fds[3], pid)
    threading.Thread(target=lambda: _report(fds[3], os.waitpid(pid, 0)[1], close=True), daemon=True).start()


def _launch(spec: dict, fds: list[int], use_zygote: bool) -> None:
    """Hands the child's fds (stdin, stdout, stderr, status) to a launcher; closes the status fd only
    through the launcher (it carries the pid line and the wait status)."""
    if use_zygote and _USE_ZYGOTE and start_zygote():
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

    def __init__(self, pid: int, stdin: bytes, pipes: dict[str, int], limits: Limits, level: str):
        self.pid, self.limits, self.level = pid, limits, level
        self.out, self.err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
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
        deadline, kill_at, give_up = start + self.limits.wall_s, math.inf, math.inf
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
        if self.level == "rlimits":
            _kill_group(self.pid, signal.SIGKILL)  # stragglers that stayed in the group
        self.drain_until = time.monotonic() + _DRAIN_S  # pipes an escaped straggler holds stop mattering

    def _close(self, fd: int) -> None:
        self.sel.unregister(fd)
        os.close(fd)

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self._close(key.fd)
        self.sel.close()

    def result(self, wall_s: float, isolation: str) -> RunResult:
        status = self.status
        exited = status is not None and os.WIFEXITED(status)
        signaled = status is not None and os.WIFSIGNALED(status)
        return RunResult(
            returncode=os.WEXITSTATUS(status) if exited else None,
            stdout=self.out.data.decode("utf-8", "replace"),
            stderr=self.err.data.decode("utf-8", "replace")
            + ("\nsandbox: exit status lost" if self.lost else ""),
            timed_out=self.timed_out,
            signal=os.WTERMSIG(status) if signaled else None,
            truncated=self.out.truncated or self.err.truncated,
            wall_s=wall_s,
            isolation=isolation,
        )


def _execute(spec: dict, stdin: bytes, limits: Limits, isolation: str, use_zygote: bool = True) -> RunResult:
    (in_r, in_w), (out_r, out_w), (err_r, err_w), (st_r, st_w) = (os.pipe() for _ in range(4))
    start = time.monotonic()
    try:
        _launch(spec, [in_r, out_w, err_w, st_w], use_zygote)
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    line = _read_line(st_r, _LOST_S)
    pid = int(line) if line else 0
    pipes = {"stdin": in_w, "stdout": out_r, "stderr": err_r, "status": st_r}
    run = _Run(pid, stdin, pipes, limits, spec["level"])
    if pid:
        run.pump(start)
    else:
        run.lost = True
        run.close()
    return run.result(time.monotonic() - start, isolation)


# ----------------------------------------------------------------------------------------------------------
# Isolation detection and the public API.

_LEVEL: str | None = None
_LEVEL_LOCK = threading.Lock()


def _sandbox_uid() -> int | None:
    """The uid sandboxed code runs as: `nobody` when the host is root (never root itself), else the host's."""
    return NOBODY if os.geteuid() == 0 else None


def _bwrap_argv(argv: list[str], workdir: str, cwd: str, network: bool) -> list[str]:
    share = ["--share-net"] if network else []
    return [
        "bwrap", "--unshare-all", *share, "--die-with-parent", "--new-session", "--ro-bind", "/", "/",
        "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--bind", workdir, workdir,
        "--chdir", cwd, "--", *argv,
    ]  # fmt: skip


def _spec(
    argv: list[str], env: dict, workdir: str, cwd: str, limits: Limits, level: str, network: bool
) -> dict:
    if level == "bwrap":
        argv = _bwrap_argv(argv, workdir, cwd, network)
    return {
        "argv": argv,
        "env": env,
        "cwd": cwd,
        "limits": dataclasses.asdict(limits),
        "level": level,
        "network": network,
        "uid": _sandbox_uid(),
    }


def _probe(level: str) -> bool:
    with tempfile.TemporaryDirectory(prefix="sandbox-probe-") as d:
        if _sandbox_uid() is not None:
            os.chown(d, _sandbox_uid(), _sandbox_uid())
        spec = _spec(["true"], dict(BASE_ENV), d, d, Limits(), level, network=False)
        return _execute(spec, b"", Limits(), level, use_zygote=False).status == "ok"


def isolation_level() -> str:
    """The strongest level that works here, one of `LEVELS`; detected once per process."""
    global _LEVEL
    with _LEVEL_LOCK:
        if _LEVEL is None:
            candidates = (["bwrap"] if shutil.which("bwrap") else []) + ["unshare-net"]
            _LEVEL = next((level for level in candidates if _probe(level)), "rlimits")
        return _LEVEL


def _rmtree(path: pathlib.Path) -> None:
    def unlock(func, p, _):
        os.chmod(os.path.dirname(p), 0o700)
        func(p)

    shutil.rmtree(path, onerror=unlock)


def _cleanup(*paths: pathlib.Path) -> None:
    for path in paths:
        if path.exists():
            _rmtree(path)


_PRIVATE_ROOT: pathlib.Path | None = None


def _private_root() -> pathlib.Path:
    """A per-process parent for work dirs, mode 0711: sandboxed code (all running as one uid, e.g.
    `nobody`) can enter its own work dir but cannot list the parent, so the random names of other live
    sandboxes' work dirs cannot be found."""
    global _PRIVATE_ROOT
    if _PRIVATE_ROOT is None or not _PRIVATE_ROOT.exists():
        _PRIVATE_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="sandboxes-")).resolve()
        os.chmod(_PRIVATE_ROOT, 0o711)
        atexit.register(_rmtree, _PRIVATE_ROOT)
    return _PRIVATE_ROOT


class Sandbox:
    """A fresh temporary work dir, reusable across runs (multi-step tasks); a context manager."""

    def __init__(
        self,
        *,
        limits: Limits = Limits(),
        network: bool = False,
        files: dict[str, str | bytes] | None = None,
    ):
        self.limits, self.network = limits, network
        root = _private_root()
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="sandbox-", dir=root)).resolve()
        self._snapdir = pathlib.Path(tempfile.mkdtemp(prefix="sandbox-snap-", dir=root)).resolve()
        self._snapshots = 0
        self._finalizer = weakref.finalize(self, _cleanup, self.workdir, self._snapdir)
        self._chown(self.workdir)
        for relpath, content in (files or {}).items():
            self.write(relpath, content)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(
        self,
        cmd: str | list[str],
        *,
        stdin: str | None = None,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> RunResult:
        """Runs `cmd` (a str runs under `bash -c`) in the work dir (or `cwd`, relative to it)."""
        limits = limits or self.limits
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        full_env = {**BASE_ENV, "HOME": str(self.workdir), **(env or {})}
        run_cwd = str(self._inside(cwd or "."))
        level = isolation_level()
        spec = _spec(argv, full_env, str(self.workdir), run_cwd, limits, level, self.network)
        isolation = level + ("+network" if self.network else "")
        return _execute(spec, (stdin or "").encode(), limits, isolation)

    def write(self, relpath: str, content: str | bytes, *, mode: int = 0o644) -> None:
        path = self._inside(relpath)
        self._makedirs(path.parent)
        data = content.encode() if isinstance(content, str) else content
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        except OSError as e:
            raise ValueError(f"cannot write {relpath!r} in the sandbox: {e}") from e
        with open(fd, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
        self._chown(path)

    def read(self, relpath: str) -> bytes:
        path = self._inside(relpath)
        if not path.resolve().is_relative_to(self.workdir):
            raise ValueError(f"{relpath!r} resolves outside the sandbox work dir")
        return path.read_bytes()

    def snapshot(self) -> str:
        """Saves a full copy (not hard links) of the work dir; returns its id for `rollback`."""
        self._snapshots += 1
        snapshot_id = f"snap{self._snapshots}"
        _copy_tree(self.workdir, self._snapdir / snapshot_id)
        return snapshot_id

    def rollback(self, snapshot_id: str) -> None:
        """The work dir back to exactly the snapshot: contents, modes, owners; later files removed."""
        source = self._snapdir / snapshot_id
        if "/" in snapshot_id or not source.is_dir():
            raise KeyError(f"no snapshot {snapshot_id!r}")
        for child in list(self.workdir.iterdir()):
            if child.is_dir() and not child.is_symlink():
                _rmtree(child)
            else:
                child.unlink()
        _copy_tree(source, self.workdir)

    def close(self) -> None:
        self._finalizer()

    def _inside(self, relpath: str) -> pathlib.Path:
        """`relpath` under the work dir; its existing directories must not lead outside (symlinks too)."""
        path = pathlib.Path(os.path.normpath(self.workdir / relpath))
        if path == self.workdir:
            return path
        parent = pathlib.Path(os.path.realpath(path.parent))
        if not path.is_relative_to(self.workdir) or not parent.is_relative_to(self.workdir):
            raise ValueError(f"{relpath!r} is outside the sandbox work dir")
        return path

    def _makedirs(self, directory: pathlib.Path) -> None:
        missing = [d for d in [directory, *directory.parents] if d.is_relative_to(self.workdir)]
        for d in reversed(missing):
            if not d.exists():
                d.mkdir()
                self._chown(d)

    def _chown(self, path: pathlib.Path) -> None:
        uid = _sandbox_uid()
        if uid is not None:
            os.lchown(path, uid, uid)


def _copy_tree(source: pathlib.Path, target: pathlib.Path) -> None:
    """Real copies (reflinks where the filesystem has them), keeping modes, owners and times."""
    subprocess.run(["cp", "-a", "--reflink=auto", f"{source}/.", str(target)], check=True)


def run_once(
    cmd: str | list[str],
    *,
    files: dict[str, str | bytes] | None = None,
    stdin: str | None = None,
    limits: Limits = Limits(),
    network: bool = False,
) -> RunResult:
    """A fresh Sandbox, one run, closed."""
    with Sandbox(limits=limits, network=network, files=files) as sb:
        return sb.run(cmd, stdin=stdin)


def start_latency(n: int = 50) -> dict[str, float]:
    """Milliseconds from `run(["true"])` to its result: warm (zygote) and cold (fresh interpreter)."""
    global _USE_ZYGOTE
    isolation_level()
    start_zygote()
    figures = {}
    with Sandbox() as sb:
        for name, warm in (("warm", True), ("cold", False)):
            _USE_ZYGOTE, times = warm, []
            for _ in range(n):
                t = time.perf_counter()
                sb.run(["true"])
                times.append((time.perf_counter() - t) * 1e3)
            times.sort()
            figures[f"{name}_p50_ms"] = times[len(times) // 2]
            figures[f"{name}_p99_ms"] = times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]
    _USE_ZYGOTE = True
    return figures


def _main(args: list[str]) -> None:
    if args[:1] == ["--zygote"]:
        _zygote_main(int(args[1]))
    elif args[:1] == ["--exec"]:
        with open(3, "rb") as f:
            spec = json.loads(f.read())
        _exec_child(spec)
    else:
        print(json.dumps({"isolation": isolation_level(), **start_latency()}))


if __name__ == "__main__":
    _main(sys.argv[1:])
