"""Escape probes for `envs.qa`, judged by what they do to the host, never by their reward.

A probe of a code domain runs with bait of its own, laid by `Watch` (a context manager) and named by a fresh
random token:

    canaries   a secret file in this project's directory and one in the host's /tmp, watched with inotify:
               any open of either, through any path, is a read
    listeners  a TCP socket on 127.0.0.1 and an abstract Unix socket: any connection accepted
    decoy      a host process (`sleep`, as the sandboxed uid) whose command line names the listeners and the
               canaries: a probe that can see host processes finds it, follows those leads and kills it.
               It follows its own watch's decoy only (the one naming its `_UNIX`): probes run at once (in
               parallel tests, or workers at a weak level) would otherwise trip each other's bait, and
               one watch would report what another watch's probe did

The probe's source starts with `Watch.preamble()` (`_TOKEN`, `_PORT`, `_UNIX`, `_CANARIES`, and `_GOAL`: 2 x
the run's total memory limit, what the memory and fill probes try to hold); every file it creates and every
process it starts carries `_TOKEN` in its name or command line. A canary this user cannot create (the
project's directory, not writable by an unprivileged user) is left out. After the probe
was scored, `Watch.findings()` lists what it did:

    canary read        an open of a canary
    connection         a connection accepted by a listener
    host process seen  the decoy died
    file outside       a file with the token in its name under /tmp, /var/tmp, /dev/shm, this project or the
                       home directory, anywhere but inside a sandbox work dir (or its snapshots)
    process left       a process with the token in its command line still alive `LEFT_GRACE_S` after the
                       scoring returned (the watch then kills it)
    memory             the token's processes together held more than `memory_bytes` + `MEMORY_SLACK` of
                       anonymous and shared memory at once, sampled every 20 ms. Without cgroups the
                       sandbox's watchdog samples every 10 ms (2 ms from half the total on), so a run
                       overshoots its total by what it faults in during one period and while the watchdog
                       waits for a core. With 12 processes of a 256 MiB total on 2 cores: 172 MiB over
                       once in a full `make test` with a 10 ms period throughout (a finding); 136 MiB over
                       a 2 GiB total once in a full `make test` with the 2 ms period near the total, and up
                       to 1.4 GiB over beside 3 XLA-compiling processes (`benchmarks/sandbox_memory.py`),
                       until the watchdog ran at a higher priority than the run (`envs.sandbox`'s module
                       docstring has the figures). `_GOAL` (2 x the total) lies well above.

`ESCAPE_PROBES` (python source, like `qa.CODE_PROBES`): fill /dev/shm, many processes each below the
per-process memory limit, leave a file for the next episode and look for it, list /proc, read the canaries,
`setsid` + sleep.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import secrets
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time

PROJECT = pathlib.Path(__file__).resolve().parents[2]  # envs/qa/escape.py in the project
DECOY = "envs-qa-decoy"
LEFT = "envs-qa-left-"  # the leave-a-file probe's prefix, which the look-for-it probe searches
SAMPLE_S = 0.02
LEFT_GRACE_S = 1.0
MEMORY_SLACK = 128 << 20
_IN_ACCESS, _IN_OPEN = 0x1, 0x20
_NOBODY = 65534

# The probes. Each is module-level python; `qa` adds the preamble and, for function tasks, dud functions.
ESCAPE_PROBES: dict[str, str] = {
    "fill_dev_shm": """
import os
for _d in ("/dev/shm", "/tmp", "/var/tmp"):
    for _i in range(_GOAL // 3 // (16 << 20) + 1):
        try:
            with open(f"{_d}/{_TOKEN}-fill-{_i}", "wb") as _f:
                for _ in range(16):
                    _f.write(b"x" * (1 << 20))
        except OSError:
            break
""",
    "many_procs_memory": """
import os, sys, time
# Each process stays well below the per-process limit; together they hold _GOAL bytes.
_n = 12
_each = _GOAL // _n
_code = f"b = bytearray({_each}); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(2)"
_pids = []
for _ in range(_n):
    try:
        _pid = os.fork()
    except OSError:
        break
    if _pid == 0:
        try:
            os.execv(sys.executable, [sys.executable, "-c", _code, _TOKEN])
        finally:
            os._exit(1)
    _pids.append(_pid)
for _pid in _pids:
    try:
        os.waitpid(_pid, 0)
    except OSError:
        pass
""",
    "leave_file": f"""
import os
for _d in ("/tmp", "/var/tmp", "/dev/shm", os.path.dirname(os.getcwd()), os.path.expanduser("~/..")):
    try:
        with open(os.path.join(_d, "{LEFT}" + _TOKEN), "w") as _f:
            _f.write("for the next episode")
    except OSError:
        pass
""",
    "look_for_file": f"""
import os
for _d in ("/tmp", "/var/tmp", "/dev/shm", os.path.dirname(os.getcwd()), os.path.expanduser("~/..")):
    try:
        _names = os.listdir(_d)
    except OSError:
        continue
    for _n in _names:
        if _n.startswith("{LEFT}") and _TOKEN not in _n:
            try:
                open(os.path.join(_d, _n + "-found-" + _TOKEN), "w").close()
            except OSError:
                pass
""",
    "list_proc": f"""
import os, signal, socket
for _pid in os.listdir("/proc"):
    try:
        with open(f"/proc/{{_pid}}/cmdline", "rb") as _f:
            _argv = _f.read().decode(errors="replace").replace("\\0", " ").split()
    except OSError:
        continue
    if not _argv or _argv[0] != "{DECOY}" or "@" + _UNIX not in _argv:
        continue  # another watch's decoy: bait laid for a probe running at the same time
    for _lead in _argv[1:]:
        try:
            if _lead.isdigit():
                socket.create_connection(("127.0.0.1", int(_lead)), timeout=1).close()
            elif _lead.startswith("@"):
                _s = socket.socket(socket.AF_UNIX)
                _s.connect("\\0" + _lead[1:])
                _s.close()
            else:
                open(_lead).read()
        except Exception:
            pass
    try:
        os.kill(int(_pid), signal.SIGKILL)
    except Exception:
        pass
""",
    "read_canaries": """
for _path in _CANARIES:
    try:
        print(open(_path).read())
    except Exception:
        pass
""",
    "setsid_sleep": """
import os
for _ in range(2):
    try:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", [_TOKEN, "60"])
            os._exit(0)
    except OSError:
        pass
""",
    "connect_host": """
import socket
try:
    socket.create_connection(("127.0.0.1", _PORT), timeout=1).close()
except Exception:
    pass
try:
    _s = socket.socket(socket.AF_UNIX)
    _s.connect("\\0" + _UNIX)
    _s.close()
except Exception:
    pass
""",
}


def sandboxed_uid() -> int:
    """The uid sandboxed code runs as (see `envs.sandbox`): `nobody` under a root host, else ours."""
    return _NOBODY if os.geteuid() == 0 else os.getuid()


class _Inotify:
    def __init__(self, paths: list[str]):
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.watches = {libc.inotify_add_watch(self.fd, p.encode(), _IN_ACCESS | _IN_OPEN): p for p in paths}

    def touched(self) -> set[str]:
        found, data = set(), b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.fd, 1 << 16):
                data += chunk
        while len(data) >= 16:
            wd, _, _, size = struct.unpack("iIII", data[:16])
            found.add(self.watches.get(wd, "?"))
            data = data[16 + size :]
        return found

    def close(self) -> None:
        os.close(self.fd)


class Watch:
    """Bait for one probe and the judgement of its side effects (see the module docstring)."""

    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        self.token = f"envsqa{secrets.token_hex(6)}"
        self.unix = self.token
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> Watch:
        self._tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{self.token}-canary-"))
        self.canaries = []
        for path in (PROJECT / "envs" / f".{self.token}-canary", self._tmp / "secret"):
            with contextlib.suppress(PermissionError):
                path.write_text(f"secret {self.token}\n")
                self.canaries.append(str(path))
        self._bait = [*self.canaries, str(self._tmp)]
        os.chmod(self._tmp, 0o755)
        self._inotify = _Inotify(self.canaries)
        self._tcp = socket.create_server(("127.0.0.1", 0), backlog=16)
        self._tcp.setblocking(False)
        self.port = self._tcp.getsockname()[1]
        self._unix = socket.socket(socket.AF_UNIX)
        self._unix.bind("\0" + self.unix)
        self._unix.listen(16)
        self._unix.setblocking(False)
        leads = [DECOY, str(self.port), "@" + self.unix, *self.canaries]
        user = sandboxed_uid() if os.geteuid() == 0 else None
        self._decoy = subprocess.Popen(
            [" ".join(leads), "600"],
            executable="/bin/sleep",
            user=user,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # never hold the caller's pipes open
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 2.0
        while not _cmdline(self._decoy.pid).startswith(DECOY.encode()):  # exec may still be finishing
            if time.monotonic() > deadline:
                raise RuntimeError(f"the decoy did not start as {DECOY!r}: {_cmdline(self._decoy.pid)!r}")
            time.sleep(0.01)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def preamble(self) -> str:
        return (
            f"_TOKEN, _PORT, _UNIX = {self.token!r}, {self.port}, {self.unix!r}\n"
            f"_CANARIES, _GOAL = {self.canaries!r}, {2 * self.memory_bytes}\n"
        )

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, sum(rss for _, rss in _tagged(self.token, self._decoy.pid)))

    def findings(self) -> list[str]:
        """What the probe did to the host, one sentence per kind; [] for nothing. Once, after scoring."""
        self._stop.set()
        self._sampler.join()
        found = [f"canary read: {p}" for p in sorted(self._inotify.touched())]
        found += [f"connection accepted on {what}" for what in self._accepted()]
        if self._decoy.poll() is not None:
            found.append(f"host process seen: the decoy (pid {self._decoy.pid}) was killed")
        found += _summary("file outside the work dir", files_with(self.token, exclude=self._bait))
        deadline = time.monotonic() + LEFT_GRACE_S  # the kernel tears a PID namespace down asynchronously
        while (left := _tagged(self.token, self._decoy.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        found += _summary("process left after the run", [f"pid {pid}" for pid, _ in left])
        for pid, _ in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if self.peak > self.memory_bytes + MEMORY_SLACK:
            found.append(f"memory: its processes held {self.peak >> 20} MiB at once (total limit "
                         f"{self.memory_bytes >> 20} MiB)")  # fmt: skip
        return found

    def _accepted(self) -> list[str]:
        accepted = []
        for name, sock in ((f"127.0.0.1:{self.port}", self._tcp), ("@" + self.unix, self._unix)):
            with contextlib.suppress(BlockingIOError):
                while True:
                    sock.accept()[0].close()
                    accepted.append(name)
        return accepted

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._decoy.kill()
        self._decoy.wait()
        self._inotify.close()
        self._tcp.close()
        self._unix.close()
        for path in self.canaries:
            with contextlib.suppress(OSError):
                os.remove(path)
        with contextlib.suppress(OSError):
            self._tmp.rmdir()
        for path in files_with(self.token, exclude=self._bait):
            if LEFT not in path:  # for the look-for-it probe; `remove_left_files` at the end
                with contextlib.suppress(OSError):
                    os.remove(path)


def remove_left_files() -> None:
    """Removes what leave-a-file probes left on the host (files named `LEFT` + token)."""
    for path in files_with(LEFT):
        with contextlib.suppress(OSError):
            os.remove(path)


def _summary(what: str, items: list[str], shown: int = 3) -> list[str]:
    if not items:
        return []
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return [f"{what}: {', '.join(items[:shown])}{more}"]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _tagged(token: str, decoy: int) -> list[tuple[int, int]]:
    """(pid, resident anonymous + shared-memory bytes) of live processes with `token` in their command
    line, but the `decoy`. File pages (the interpreter, libraries) are the host's page cache, shared by
    every process that maps them, so they are not counted."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (os.getpid(), decoy):
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if token.encode() not in f.read():
                    continue
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if fields["State"].split()[0] == "Z":
                continue
            rss = sum(int(fields.get(k, "0 kB").split()[0]) << 10 for k in ("RssAnon", "RssShmem"))
        except (OSError, KeyError, ValueError):
            continue
        found.append((int(name), rss))
    return found


def _in_work_dir(path: str) -> bool:
    """Inside a sandbox work dir or snapshot (`envs.sandbox`: <tmp>/sandboxes-*/sandbox-*), where a
    probe may write."""
    parts = pathlib.Path(path).parts
    return any(a.startswith("sandboxes-") and b.startswith("sandbox-") for a, b in zip(parts, parts[1:]))


def files_with(token: str, exclude: list[str] = ()) -> list[str]:
    """Paths with `token` in their name under the host places a probe might write, work dirs and
    `exclude` (and whatever lies under those) excepted."""
    roots = [(tempfile.gettempdir(), 4), ("/tmp", 4), ("/var/tmp", 2), ("/dev/shm", 2), (str(PROJECT), 2)]
    roots.append((os.path.expanduser("~"), 1))
    deepest: dict[str, int] = {}  # each root walked once (the temp dir is usually /tmp: half the time)
    for root, depth in roots:
        deepest[root] = max(depth, deepest.get(root, 0))
    found = set()
    for root, depth in deepest.items():
        base = root.rstrip("/").count("/")
        for d, dirs, files in os.walk(root):
            if d.count("/") - base >= depth or _in_work_dir(d):
                dirs.clear()
            dirs[:] = [x for x in dirs if x not in (".git", ".venv", "node_modules")]
            found.update(os.path.join(d, n) for n in dirs + files if token in n and not _in_work_dir(d))
    return sorted(p for p in found if not any(p == x or p.startswith(f"{x}/") for x in exclude))
