"""Running untrusted, model-written commands: a work dir, namespaces, bounded resources, a wall clock.

    with Sandbox(files={"main.py": code}) as sb:
        result = sb.run("python3 main.py", stdin="3 4\\n")   # result.status: ok / error / timeout / killed

Every run gets: the sandbox's work dir as cwd and HOME; a scrubbed environment (PATH=/usr/bin:/bin,
HOME=workdir, LANG=C.UTF-8, nothing inherited, the caller's `env` added); rlimits on CPU seconds (rounded up
to whole seconds; SIGXCPU, then SIGKILL one second later), address space per process, processes, file size,
open files and POSIX message queues; no core dumps; a wall-clock limit (SIGTERM to the run, SIGKILL
`launch._TERM_GRACE_S` later); stdout and stderr each kept up to `Limits.output_bytes` (`truncated`).
A host process running as root runs sandboxed code as `nobody` (65534), never as root.

Starting a run. Warm (the default): this process's zygote (`start_zygote`, which the code and terminal
domains call when they are made) keeps two children made ahead for the last tmpfs size and network flag
asked for: namespaces, mounts, /proc, root and the command's process exist before the request, so a run
only binds its work dir into place, sets its own limits and execs; each child serves one run and the next
one is made at once (`envs.sandbox.zygote`). Runs with a per-run cgroup, with bubblewrap or at the
"rlimits" level are not made ahead: their child is forked for the run. Cold
(`Sandbox(zygote=False)`): the same child code in a fresh interpreter per run, identical results.
`start_latency` measures both.

Isolation levels, strongest first (`isolation()` detects the strongest that works here, once per process, by
running `true` under each; every `RunResult.isolation` names it, with "+network" for `Sandbox(network=True)`):

- "mount": its own mount, PID, network, IPC, UTS and user namespaces (backend "unshare": this package
  makes them, through unprivileged user namespaces; backend "bwrap": bubblewrap makes the same ones from the
  same plan, `envs.sandbox.plan`). The run sees a read-only root holding only /usr (and /bin, /lib... as on
  the host) and a list of /etc entries, its work dir read-write, fresh tmpfs of `Limits.tmp_bytes` each on
  /tmp, /var/tmp and /dev/shm, a minimal /dev and a fresh /proc showing only its own processes; nothing of
  /root, /home, this project or other work dirs. No network (loopback only). The command runs in a user
  namespace of its own as a non-root uid with no capabilities and cannot make further user namespaces;
  SysV shared memory is capped at `tmp_bytes` (own backend). Every process of the run dies with it,
  `setsid` or not.
- "unshare-net": user + PID + network + IPC namespaces without a mount namespace: no network, nothing left
  running after the run, but the host's filesystem (what the uid may read and write, e.g. /tmp) and the
  host's processes in /proc are visible.
- "rlimits": no namespaces. Network reachable, host filesystem and processes visible; processes are confined
  by rlimits and the process-group kill only, and one that calls setsid() escapes the kill. RLIMIT_NPROC is
  per real uid here, so it is set to (that uid's current thread count + max_procs).
Code and terminal domains call `require("mount")`: below it they refuse to start unless told otherwise.

Total resources (`Isolation.resources`, also in every `RunResult`):
- "cgroup2": where a cgroup v2 is delegated (`envs.sandbox.cgroups`), each run has its own cgroup:
  memory.max = `total_memory_bytes` for all its processes, tmpfs pages and kernel memory together (no
  swap; OOM kills the whole run), pids.max, cpu.max = `cpus`.
- "watchdog": at the "mount" level without cgroups, the run's supervisor adds up the anonymous and shared
  memory mapped by all the run's processes every 10 ms (every 2 ms once they hold half of it) and kills
  every one of them past `total_memory_bytes` (`RunResult.memory_exceeded`). A run overshoots by what it
  faults in while the supervisor waits for a core, so the supervisor runs `WATCH_NICE_BELOW` nice values
  under the run: its own lowered where the host may (root), else the run's raised (a busy host then gives
  the run less CPU), with a short EEVDF slice request (`WATCH_SLICE_NS`, Linux 6.12+) besides
  (`benchmarks/sandbox_memory.py` measures the overshoot). What it cannot see is bounded per process
  only: memfd pages that are not mapped (open_files x file_bytes per process) and kernel memory; tmpfs
  use is bounded by the tmpfs sizes.
- "rlimits": per-process limits only: a run may hold max_procs x memory_bytes (plus, at "unshare-net" and
  "rlimits", whatever it writes to the host's tmpfs).

Configuration, read when the level is first detected (or given to `configure`):
    ENVS_SANDBOX_LEVEL=mount|unshare-net|rlimits   use at most this level
    ENVS_SANDBOX_BACKEND=auto|unshare|bwrap        the mount level's backend (auto: own, then bwrap)
    ENVS_SANDBOX_CGROUP=auto|none|/sys/fs/cgroup/...  where per-run cgroups go (see envs.sandbox.cgroups)

Not guaranteed: limits on disk use of the work dir beyond RLIMIT_FSIZE per file; RLIMIT_AS counts virtual
memory (a runtime that reserves much address space needs a larger `memory_bytes`); a command line or
environment over the kernel's 128 KiB per-string limit fails; with bubblewrap a command that ends with exit
code 128+N is reported as killed by signal N (bwrap reports signals that way).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time
import weakref

from configs.errors import UserError
from envs.sandbox import cgroups, launch, plan, workroot
from envs.sandbox.launch import execute, zygote_pid

__all__ = ["Limits", "RunResult", "Isolation", "IsolationError", "Sandbox", "run_once", "isolation"]
__all__ += ["isolation_level", "require", "configure", "start_zygote", "zygote_pid", "start_latency"]

LEVELS = ("mount", "unshare-net", "rlimits")
BACKENDS = ("unshare", "bwrap")
REQUIRED = "mount"  # what domains that run model-written code require by default
BASE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
NOBODY = 65534
WATCH_NICE_BELOW = 10  # the watchdog's nice value under the run's, where it may (watchdog.raise_priority)
WATCH_SLICE_NS = 100_000  # the watchdog's EEVDF slice request (the shortest the kernel takes)
HOW_TO_GET_MOUNT = (
    "allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0; on Debian kernels before 5.10 "
    "kernel.unprivileged_userns_clone=1; on Ubuntu 23.10+ kernel.apparmor_restrict_unprivileged_userns=0), "
    "or install bubblewrap (apt-get install bubblewrap; setuid bwrap works where user namespaces are "
    "restricted), or run the workers as root"
)
_log = logging.getLogger("envs.sandbox")


@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_s: float = 5.0  # RLIMIT_CPU per process, rounded up to whole seconds
    wall_s: float = 10.0  # wall-clock timeout of one run
    memory_bytes: int = 1 << 30  # RLIMIT_AS: address space of each process
    total_memory_bytes: int = 2 << 30  # all of a run's processes together (cgroup memory.max or watchdog)
    max_procs: int = 64  # RLIMIT_NPROC (how it is counted depends on the isolation level; see above)
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 64 << 10  # stdout and stderr are each capped at this many bytes (then truncated)
    tmp_bytes: int = 64 << 20  # size of each fresh tmpfs (/tmp, /var/tmp, /dev/shm) at the mount level
    cpus: float = 1.0  # cgroup cpu.max, in CPUs (only with cgroups)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Limits.{field.name}={value!r}: must be a number > 0")
        if self.total_memory_bytes < self.memory_bytes // 4:
            raise ValueError(
                f"Limits.total_memory_bytes={self.total_memory_bytes} is far below memory_bytes="
                f"{self.memory_bytes}: one process could not use its own limit; raise total_memory_bytes"
            )


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
    resources: str = ""  # how the run's total resources were bounded: cgroup2 / watchdog / rlimits
    memory_exceeded: bool = False  # killed because all its processes together passed total_memory_bytes

    @property
    def status(self) -> str:
        """ok (exit 0), error (nonzero exit), timeout (wall clock), killed (a signal, e.g. an rlimit)."""
        if self.timed_out:
            return "timeout"
        if self.signal is not None:
            return "killed"
        return "ok" if self.returncode == 0 else "error"


@dataclasses.dataclass(frozen=True)
class Isolation:
    level: str  # one of LEVELS
    backend: str  # "unshare" or "bwrap" at the mount level, "unshare" at unshare-net, "none" at rlimits
    resources: str  # "cgroup2", "watchdog" or "rlimits" (see the module docstring)
    notes: tuple[str, ...] = ()  # why stronger levels or cgroups are not in use here

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class IsolationError(UserError, RuntimeError):
    """The sandbox here is weaker than a domain requires."""


# ----------------------------------------------------------------------------------------------------------
# Detection


def rank(level: str) -> int:
    """0 for the strongest level; ValueError naming the choices for anything else."""
    if level not in LEVELS:
        raise ValueError(f"isolation level {level!r}: use one of {LEVELS} (strongest first)")
    return LEVELS.index(level)


_ISOLATION: Isolation | None = None
_CGROUP_PARENT: str | None = None
_DETECT_LOCK = threading.Lock()


def _sandbox_uid() -> int | None:
    """The uid sandboxed code runs as: `nobody` when the host is root (never root itself), else the host's."""
    return NOBODY if os.geteuid() == 0 else None


def _probe(level: str, backend: str) -> str:
    """'' when `true` runs at this level with this backend; else the reason it does not."""
    with tempfile.TemporaryDirectory(prefix="sandbox-probe-", dir=workroot.get()) as d:
        if _sandbox_uid() is not None:
            os.chown(d, _sandbox_uid(), _sandbox_uid())
        isolation = Isolation(level, backend, "rlimits")
        spec = _spec(["true"], dict(BASE_ENV), d, d, Limits(), isolation, network=False, cgroup=None)
        done = execute(spec, b"", wall_s=10.0, output_bytes=4096, use_zygote=False)
    if done.status is not None and os.WIFEXITED(done.status) and os.WEXITSTATUS(done.status) == 0:
        return ""
    lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else f"wait status {done.status}"


def _choice(name: str, value: str | None, allowed: tuple[str, ...]) -> str:
    value = value if value is not None else os.environ.get(name, allowed[0])
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: use one of {allowed}")
    return value


def _detect(level: str | None, backend: str | None, cgroup: str | None) -> tuple[Isolation, str | None]:
    cap = _choice("ENVS_SANDBOX_LEVEL", level, LEVELS)
    chosen = _choice("ENVS_SANDBOX_BACKEND", backend, ("auto", *BACKENDS))
    mount_backends = ["unshare", "bwrap"] if chosen == "auto" else [chosen]
    candidates = [("mount", b) for b in mount_backends] + [("unshare-net", "unshare"), ("rlimits", "none")]
    notes = []
    for cand_level, cand_backend in candidates:
        if rank(cand_level) < rank(cap):
            continue
        if cand_backend == "bwrap" and not shutil.which("bwrap", path=BASE_ENV["PATH"]):
            why = "bubblewrap is not installed"
        else:
            why = _probe(cand_level, cand_backend) if cand_level != "rlimits" else ""
        if not why:
            break
        notes.append(f"{cand_level} ({cand_backend}): {why}")
    if cap != LEVELS[0]:
        notes.insert(0, f"levels above {cap!r} not tried (ENVS_SANDBOX_LEVEL or configure(level=...))")
    delegation = cgroups.find(cgroup if cgroup is not None else os.environ.get("ENVS_SANDBOX_CGROUP", "auto"))
    if delegation.parent is not None:
        resources = "cgroup2"
    else:
        notes.append(f"cgroups: {delegation.reason}")
        resources = "watchdog" if cand_level == "mount" else "rlimits"
    return Isolation(cand_level, cand_backend, resources, tuple(notes)), delegation.parent


def configure(level: str | None = None, backend: str | None = None, cgroup: str | None = None) -> Isolation:
    """Detects (again) the isolation for this process: the strongest level up to `level`, the mount level's
    `backend` ("auto", "unshare" or "bwrap"), the `cgroup` parent ("auto", "none" or a path). A None takes
    the environment variable (ENVS_SANDBOX_LEVEL / _BACKEND / _CGROUP), else the default."""
    global _ISOLATION, _CGROUP_PARENT
    with _DETECT_LOCK:
        _ISOLATION, _CGROUP_PARENT = _detect(level, backend, cgroup)
        return _ISOLATION


def isolation() -> Isolation:
    """The isolation runs get in this process; detected on first use (see `configure`)."""
    with _DETECT_LOCK:
        isolated = _ISOLATION
    return isolated if isolated is not None else configure()


def isolation_level() -> str:
    """The strongest level that works here, one of `LEVELS`; detected once per process."""
    return isolation().level


def require(level: str = REQUIRED, *, who: str = "this domain") -> Isolation:
    """Raises IsolationError unless runs here get `level` or stronger. A `level` below `REQUIRED` is the
    explicit override: allowed, and logged as a warning every time when the level found is below REQUIRED."""
    rank(level)
    found = isolation()
    if rank(found.level) > rank(level):
        notes = "; ".join(found.notes) or "no notes"
        raise IsolationError(
            f"{who} needs sandbox isolation level {level!r} or stronger, found {found.level!r} ({notes}). "
            f"To get {REQUIRED!r}: {HOW_TO_GET_MOUNT}. To run anyway at {found.level!r}, pass "
            f"min_isolation={found.level!r} to the domain (rl.env.<domain>.min_isolation={found.level}); "
            "that is logged as a warning at every start."
        )
    if rank(found.level) > rank(REQUIRED):
        _log.warning(
            "!!! %s runs model-written code at sandbox isolation %r, below %r, because min_isolation=%r was "
            "set. At this level the code can read the host's files%s. Found: %s",
            who,
            found.level,
            REQUIRED,
            level,
            ", reach the network and leave processes behind" if found.level == "rlimits" else "",
            "; ".join(found.notes),
        )
    return found


# ----------------------------------------------------------------------------------------------------------
# Runs


def _spec(
    argv: list[str],
    env: dict,
    workdir: str,
    cwd: str,
    limits: Limits,
    isolated: Isolation,
    network: bool,
    cgroup: str | None,
) -> dict:
    """What the child does (`envs.sandbox.child`): `prep`, what the run's namespaces and mounts are made
    from, the same for every run with these tmpfs sizes and network flag (with `ahead`: the zygote may make
    the child from it before the run comes: own backend, no cgroup); `run`, what is this run's own."""
    prep = {
        "level": isolated.level,
        "backend": isolated.backend,
        "network": network,
        "uid": _sandbox_uid(),
        "cgroup": cgroup,
        "watch": isolated.resources == "watchdog",
        "watch_nice_below": WATCH_NICE_BELOW,
        "watch_slice_ns": WATCH_SLICE_NS,
        "tmp_bytes": limits.tmp_bytes,
        "ahead": isolated.backend == "unshare" and cgroup is None,
    }
    run = {"argv": argv, "env": env, "cwd": cwd, "limits": _limits_dict(limits), "workdir": workdir}
    if isolated.level == "mount":
        private = str(workroot.get())
        base = _base_ops(limits.tmp_bytes, network, private)
        if isolated.backend == "bwrap":
            ops = [*base, ["rw", workdir]]
            run["argv"] = plan.bwrap_argv(ops, argv, cwd, network, limits.max_procs)
        else:
            prep["mounts"], prep["root"] = base, os.path.join(private, ".root")
            prep["workdirs"] = os.path.dirname(workdir)  # staged ahead; the run shows its own one only
    return {"prep": prep, "run": run}


@functools.lru_cache(maxsize=64)
def _limits_dict(limits: Limits) -> dict:
    return dataclasses.asdict(limits)


@functools.lru_cache(maxsize=16)
def _base_ops(tmp_bytes: int, network: bool, private_root: str) -> list[list]:
    """The mount plan but the work dir (`plan.base_ops`), once per tmpfs size, network flag and
    private root (a new private root stages /etc again)."""
    return plan.base_ops(tmp_bytes, _staged_etc(network), _PRIVATE_PATHS)


def _run(
    argv: list[str],
    env: dict,
    workdir: str,
    cwd: str,
    stdin: bytes,
    limits: Limits,
    network: bool,
    zygote: bool,
) -> RunResult:
    isolated = isolation()
    cgroup = None
    if isolated.resources == "cgroup2":
        cgroup = cgroups.create(
            _CGROUP_PARENT,
            memory_bytes=limits.total_memory_bytes,
            max_procs=limits.max_procs + 3,  # the run's supervisor and init (and bwrap's) count too
            cpus=limits.cpus,
        )
    spec = _spec(argv, env, workdir, cwd, limits, isolated, network, cgroup)
    try:
        done = execute(spec, stdin, wall_s=limits.wall_s, output_bytes=limits.output_bytes, use_zygote=zygote)
    finally:
        oom = cgroups.finish(cgroup) if cgroup else False
    status = done.status
    exited = status is not None and os.WIFEXITED(status)
    signaled = status is not None and os.WIFSIGNALED(status)
    return RunResult(
        returncode=os.WEXITSTATUS(status) if exited else None,
        stdout=done.stdout.decode("utf-8", "replace"),
        stderr=done.stderr.decode("utf-8", "replace"),
        timed_out=done.timed_out,
        signal=os.WTERMSIG(status) if signaled else None,
        truncated=done.truncated,
        wall_s=done.wall_s,
        isolation=isolated.level + ("+network" if network else ""),
        resources=isolated.resources,
        memory_exceeded=oom or any("memory_exceeded" in event for event in done.events),
    )


def start_zygote(limits: Limits = Limits(), network: bool = False) -> bool:
    """Starts this process's zygote now (it also starts on the first run) and has it make children ahead
    for runs with these limits' tmpfs size and this network flag (none where runs get a cgroup each, use
    bubblewrap or run at the "rlimits" level); False if the zygote cannot start."""
    isolated = isolation()
    if not launch.start_zygote():
        return False
    workdir = str(workroot.get() / "sandbox-")  # where a Sandbox's work dir lies; only its parent counts
    spec = _spec(["true"], dict(BASE_ENV), workdir, "/", limits, isolated, network, cgroup=None)
    if spec["prep"]["ahead"] and isolated.resources != "cgroup2":
        launch.prepare(spec)
    return True


def _cleanup(owner_pid: int, *paths: pathlib.Path) -> None:
    """Removes a Sandbox's dirs, in the process that made it only: a forked child inherits the finalizer
    (run at the child's exit) but the dirs stay its parent's."""
    if os.getpid() != owner_pid:
        return
    for path in paths:
        if path.exists():
            workroot.rmtree(path)


_PRIVATE_PATHS = plan.private_paths()


def _staged_etc(network: bool) -> str:
    """This process's copy of the /etc entries runs see (`plan.stage_etc`), made on first use."""
    path = workroot.get() / (".etc-network" if network else ".etc")
    if not path.exists():
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".etc-", dir=workroot.get()))
        plan.stage_etc(staging, network)
        try:
            staging.rename(path)
        except OSError:  # another thread staged it first
            workroot.rmtree(staging)
    return str(path)


class Sandbox:
    """A fresh temporary work dir, reusable across runs (multi-step tasks); a context manager.

    `zygote=False` starts every run in a fresh interpreter (the cold path: slower, identical results)."""

    def __init__(
        self,
        *,
        limits: Limits = Limits(),
        network: bool = False,
        files: dict[str, str | bytes] | None = None,
        zygote: bool = True,
    ):
        self.limits, self.network, self.zygote = limits, network, zygote
        root = workroot.get()
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="sandbox-", dir=root)).resolve()
        self._snapdir = pathlib.Path(tempfile.mkdtemp(prefix="sandbox-snap-", dir=root)).resolve()
        self._snapshots = 0
        self._finalizer = weakref.finalize(self, _cleanup, os.getpid(), self.workdir, self._snapdir)
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
        data = (stdin or "").encode()
        return _run(argv, full_env, str(self.workdir), run_cwd, data, limits, self.network, self.zygote)

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
                workroot.rmtree(child)
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


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))]


def start_latency(n: int = 50, pause_s: float = 0.0) -> dict[str, float]:
    """Milliseconds from `run(["true"])` to its result: warm (zygote) and cold (fresh interpreter), `n`
    runs each, `pause_s` seconds apart (0: back to back, so that making the next children ahead competes
    with each run; runs of real work leave that time between starts)."""
    isolation()
    start_zygote()
    figures = {}
    for name, warm in (("warm", True), ("cold", False)):
        with Sandbox(zygote=warm) as sb:
            times = []
            for _ in range(n):
                time.sleep(pause_s)
                t = time.perf_counter()
                sb.run(["true"])
                times.append((time.perf_counter() - t) * 1e3)
        times.sort()
        figures[f"{name}_p50_ms"] = _percentile(times, 50)
        figures[f"{name}_p99_ms"] = _percentile(times, 99)
    return figures
