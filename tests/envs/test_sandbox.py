"""envs.sandbox: exit codes, stdin, env scrubbing, wall/CPU/memory/process/file/output limits, no network,
snapshots, and the zygote and cold paths agreeing. Each test is a few short runs (the suite takes ~20 s).

Runs at the level detected here with the default backend; `ENVS_SANDBOX_BACKEND=bwrap` runs it all with
bubblewrap. What isolation each level adds is in tests/envs/test_sandbox_isolation.py."""

import contextlib
import os
import pathlib
import re
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from envs.sandbox import box as sandbox
from envs.sandbox import workroot
from envs.sandbox.box import Limits, Sandbox, isolation_level, run_once
from envs.sandbox.child import AHEAD

LEVEL = isolation_level()
# The detected level, and the no-namespace level forced, for the tests about cleanup and process limits.
LEVELS = [LEVEL] if LEVEL == "rlimits" else [LEVEL, "rlimits"]


@pytest.fixture
def sb():
    with Sandbox() as box:
        yield box


@pytest.fixture(params=LEVELS)
def level(request):
    sandbox.configure(level=request.param)
    yield request.param
    sandbox.configure()


def _procs_in(workdir: pathlib.Path) -> list[int]:
    """Processes whose cwd is inside `workdir` (every process a run starts, unless it chdirs away)."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            cwd = os.readlink(f"/proc/{name}/cwd")
        except OSError:
            continue
        if cwd == str(workdir) or cwd.startswith(f"{workdir}/"):
            pids.append(int(name))
    return pids


def _assert_no_processes_left(workdir: pathlib.Path) -> None:
    deadline = time.monotonic() + 3.0  # the kernel tears a PID namespace down asynchronously
    while _procs_in(workdir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _procs_in(workdir) == []


def test_isolation_level_is_documented():
    assert LEVEL in sandbox.LEVELS
    assert run_once("true").isolation == LEVEL
    assert run_once("true", network=True).isolation == LEVEL + "+network"


def test_exit_codes_and_output(sb):
    ok = sb.run("echo out; echo err >&2")
    assert (ok.returncode, ok.stdout, ok.stderr, ok.status) == (0, "out\n", "err\n", "ok")
    bad = sb.run(["bash", "-c", "exit 7"])
    assert (bad.returncode, bad.signal, bad.status) == (7, None, "error")
    missing = sb.run(["no-such-command-here"])
    assert missing.returncode == 127 and "not found" in missing.stderr
    killed = sb.run("kill -SEGV $$")
    assert (killed.returncode, killed.signal, killed.status) == (None, signal.SIGSEGV, "killed")


def test_stdin_and_files(sb):
    sb.write("prog.py", "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n")
    result = sb.run("python3 prog.py", stdin="3 4 5\n")
    assert result.stdout == "12\n"
    big = "x" * (1 << 20)  # larger than a pipe buffer: written concurrently with reading stdout
    assert sb.run("wc -c", stdin=big).stdout.strip() == str(len(big))
    sb.run("echo made > new.txt")
    assert sb.read("new.txt") == b"made\n"


def test_environment_is_scrubbed(sb, monkeypatch):
    monkeypatch.setenv("SANDBOX_HOST_SECRET", "hunter2")
    env = dict(
        line.split("=", 1) for line in sb.run("env", env={"EXTRA": "1"}).stdout.splitlines() if "=" in line
    )
    assert "SANDBOX_HOST_SECRET" not in env and "hunter2" not in str(env)
    assert env["PATH"] == "/usr/bin:/bin" and env["HOME"] == str(sb.workdir) and env["LANG"] == "C.UTF-8"
    assert env["EXTRA"] == "1"
    assert set(env) <= {"PATH", "HOME", "LANG", "EXTRA", "PWD", "SHLVL", "_"}  # the last three: bash's own


@pytest.mark.parametrize("cmd", ["sleep 100", "python3 -c 'while True: pass'", "sleep 100 & sleep 100; wait"])
def test_wall_timeout_kills_the_group(sb, level, cmd):
    result = sb.run(cmd, limits=Limits(wall_s=1.0, cpu_s=30))
    assert result.status == "timeout" and result.timed_out
    assert result.wall_s < 1.0 + 2.0
    _assert_no_processes_left(sb.workdir)


def test_cpu_rlimit(sb):
    result = sb.run(["python3", "-c", "while True: pass"], limits=Limits(cpu_s=1, wall_s=20))
    assert result.status == "killed" and result.signal in (signal.SIGXCPU, signal.SIGKILL)
    assert result.wall_s < 10


def test_memory_bomb_fails_inside_and_host_is_fine(sb):
    bomb = "a = []\nwhile True:\n    a.append(bytearray(1 << 24))\n"
    result = sb.run(["python3", "-c", bomb], limits=Limits(memory_bytes=256 << 20))
    assert result.status in ("error", "killed")
    assert result.status == "killed" or "MemoryError" in result.stderr
    assert sb.run("echo fine").stdout == "fine\n"


@pytest.mark.parametrize(
    "bomb",
    [
        ":(){ :|:& };:",
        "python3 -c 'import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass'",
    ],
)
def test_fork_bomb_is_stopped(sb, level, bomb):
    """The bash bomb's first shell exits at once (its descendants are what must die); the Python one loops."""
    result = sb.run(bomb, limits=Limits(wall_s=2.0, max_procs=32))
    assert result.wall_s < 2.0 + 2.0
    _assert_no_processes_left(sb.workdir)
    assert sb.run("echo alive").stdout == "alive\n"


def test_process_limit(sb, level):
    """Forking stops at max_procs: in a fresh user namespace it counts this run only, else the uid's total."""
    code = (
        "import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
        "except OSError:\n    pass\nprint(n)\n"
    )
    result = sb.run(["python3", "-c", code], limits=Limits(max_procs=16, wall_s=10))
    assert result.status == "ok"
    if level == "rlimits":
        # The limit is (this uid's thread count at start + 16); that count includes processes of other
        # sandboxes and users of the uid, outside this test's control: only "the limit stopped it" is exact.
        assert 1 <= int(result.stdout) < 200
    else:
        assert 1 <= int(result.stdout) <= 16  # the fresh user namespace counts this run only
    _assert_no_processes_left(sb.workdir)  # the sleeping children die with the run


def test_huge_output_is_truncated_without_hanging(sb):
    cmd = "head -c 50000000 /dev/zero | tr '\\0' a; head -c 50000000 /dev/zero | tr '\\0' b >&2; echo done"
    result = sb.run(cmd, limits=Limits(output_bytes=4096, wall_s=20))
    assert result.status == "ok" and result.truncated
    assert result.stdout == "a" * 4096 and result.stderr == "b" * 4096
    assert not sb.run("echo small").truncated


def test_file_size_limit(sb):
    limits = Limits(file_bytes=1 << 20)
    result = sb.run("exec head -c 2000000 /dev/zero > big", limits=limits)
    assert result.status == "killed" and result.signal == signal.SIGXFSZ  # the default action, not SIG_IGN
    assert (sb.workdir / "big").stat().st_size <= 1 << 20
    code = "open('big2', 'wb').write(b'0' * (2 << 20))"  # Python ignores SIGXFSZ itself: the write fails
    result = sb.run(["python3", "-c", code], limits=limits)
    assert result.status == "error" and "File too large" in result.stderr
    assert (sb.workdir / "big2").stat().st_size <= 1 << 20


@pytest.mark.skipif(
    LEVEL == "rlimits", reason="no user/network namespace works here: network stays reachable"
)
def test_network_unreachable(sb):
    code = "import socket\ns = socket.socket()\ns.settimeout(3)\ns.connect(('1.1.1.1', 53))"
    result = sb.run(["python3", "-c", code])
    assert result.status == "error" and "OSError" in result.stderr
    routes = sb.run("cat /proc/net/route").stdout.splitlines()
    assert routes[1:] == []  # only the header: no route out of the namespace
    interfaces = [line.split(":")[0].strip() for line in sb.run("cat /proc/net/dev").stdout.splitlines()[2:]]
    assert interfaces == ["lo"]
    loopback = (
        "import socket\ns = socket.create_server(('127.0.0.1', 0))\nsocket.create_connection(s.getsockname())"
    )
    assert sb.run(["python3", "-c", loopback]).status == "ok"


def test_writing_outside_the_workdir(sb, tmp_path):
    if LEVEL != "mount" and os.geteuid() != 0:
        pytest.skip("without a mount namespace the command runs as this user and may write this user's files")
    target = tmp_path / "escaped"
    result = sb.run(f"echo x > {target}")
    assert result.status == "error" and not target.exists()
    with pytest.raises(ValueError):
        sb.write("../escaped", "x")
    sb.run("ln -s /etc/passwd link; ln -s / root")
    with pytest.raises(ValueError):
        sb.read("link")
    with pytest.raises(ValueError):
        sb.write("root/etc/escaped", "x")
    with pytest.raises(ValueError):
        sb.write("link", "x")


def _tree(root: pathlib.Path) -> dict[str, tuple[int, bytes | None]]:
    tree = {".": (stat.S_IMODE(root.stat().st_mode), None)}
    for path in root.rglob("*"):
        data = path.read_bytes() if path.is_file() else None
        tree[str(path.relative_to(root))] = (stat.S_IMODE(path.lstat().st_mode), data)
    return tree


def test_snapshot_and_rollback_restore_exactly(sb):
    sb.write("a.sh", "echo a\n", mode=0o755)
    sb.write("sub/b.txt", "bee\n")
    before = _tree(sb.workdir)
    snap = sb.snapshot()
    for _ in range(2):  # a snapshot can be rolled back to more than once
        change = "echo more >> a.sh; chmod 600 a.sh; rm sub/b.txt; mkdir -p new/deep; echo c > new/deep/c"
        assert sb.run(change).status == "ok"
        assert _tree(sb.workdir) != before
        sb.rollback(snap)
        assert _tree(sb.workdir) == before
    assert sb.run("./a.sh").stdout == "a\n"
    with pytest.raises(KeyError):
        sb.rollback("nope")


def test_close_removes_everything():
    box = Sandbox(files={"f": "x"})
    box.snapshot()
    workdir, snapdir = box.workdir, box._snapdir
    box.close()
    assert not workdir.exists() and not snapdir.exists()


COMMANDS = [
    "echo out; echo err >&2; exit 3",
    "cat",
    "kill -TERM $$",
    "python3 -c 'print(1)' && id -u",
    "head -c 100000 /dev/zero | tr '\\0' z",
    "cat /proc/net/route | wc -l",
]


def test_zygote_and_cold_paths_agree():
    def outcomes(box):
        runs = [box.run(cmd, stdin="in\n", limits=Limits(output_bytes=1000)) for cmd in COMMANDS]
        return [
            (r.returncode, r.stdout, r.stderr, r.signal, r.truncated, r.status, r.isolation) for r in runs
        ]

    assert sandbox.start_zygote()
    with Sandbox() as warm, Sandbox(zygote=False) as cold:
        assert outcomes(cold) == outcomes(warm)


def test_zygote_restarts_after_dying(sb):
    assert sandbox.start_zygote()
    dead = sandbox.zygote_pid()
    os.kill(dead, signal.SIGKILL)
    while pathlib.Path(f"/proc/{dead}").exists() and "Z" not in _state(dead):
        time.sleep(0.01)
    assert sb.run("echo back").stdout == "back\n"
    assert sandbox.zygote_pid() not in (None, dead)


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_other_sandboxes_work_dirs_cannot_be_listed():
    """All sandboxed code runs as one uid: the 0711 parent hides the (random) names of other work dirs."""
    with sandbox.Sandbox() as a, sandbox.Sandbox() as b:
        if a.workdir.parent.stat().st_uid == os.geteuid() and os.geteuid() != 0:
            pytest.skip("sandboxed code runs as the host user here, who owns the parent and may list it")
        b.write("secret.txt", "s3cret")
        r = a.run(f"ls {a.workdir.parent}")
        if LEVEL == "mount":  # the parent inside is a directory of the run's own /tmp: its work dir only
            assert r.stdout.split() == [a.workdir.name]
            assert a.run(f"cat {b.workdir}/secret.txt").status == "error"
        else:  # the same uid could read b's files, if it knew their names
            assert r.status == "error" and "Permission denied" in r.stderr
        assert b.workdir.name not in r.stdout


# The zygote makes the next run's child ahead (own backend at the namespaced levels, no cgroup): its C forks
# a PID 1 that makes the namespaces and mounts before any request. Seen from the host, as its parent sees it.
ISOLATED = sandbox.isolation()
MADE_AHEAD = LEVEL != "rlimits" and ISOLATED.backend == "unshare" and ISOLATED.resources != "cgroup2"
needs_ahead = pytest.mark.skipif(
    not MADE_AHEAD or os.geteuid() != 0,
    reason="no child is made ahead here (bwrap, cgroups or rlimits), or not root: the children are not "
    "dumpable, so only root may read their namespaces",
)


def _children(parent: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(name))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@contextlib.contextmanager
def _made_ahead():
    """The children the zygote has made ahead, by the PID namespace of their PID 1, in which their run will
    run: once it has `AHEAD` children or more, each a C whose PID 1 has forked its P (so neither a finished
    run's C, whose P is gone, nor one still being made; its ended runs' PID 1s, "sandbox-init", also end up
    its children). Their namespaces are held open meanwhile: a freed one's number could be a new one's."""
    deadline, held = time.monotonic() + 10.0, []
    try:
        while time.monotonic() < deadline:
            cs = [c for c in _children(sandbox.zygote_pid()) if not _cmdline(c).startswith(b"sandbox-init")]
            made = {}
            for c in cs:
                with contextlib.suppress(OSError, IndexError):
                    init = _children(c)[0]
                    if _children(init):
                        held.append(os.open(f"/proc/{init}/ns/pid", os.O_RDONLY))
                        made[f"pid:[{os.fstat(held[-1]).st_ino}]"] = c
            if len(cs) == len(made) >= AHEAD:  # more: made for another prep, its hand-over not yet read
                yield made
                return
            while held:
                os.close(held.pop())
            time.sleep(0.01)
        raise AssertionError(f"not {AHEAD} made ahead; zygote's children: {_children(sandbox.zygote_pid())}")
    finally:
        for fd in held:
            os.close(fd)


def _ends(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while pathlib.Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not pathlib.Path(f"/proc/{pid}").exists()


@needs_ahead
def test_a_child_made_ahead_serves_one_run_with_that_runs_own_limits_and_paths():
    # bash's ulimit units, by hand: -t seconds (cpu_s rounded up), -v and -f KiB, -n files, -u processes
    small = Limits(cpu_s=2.5, memory_bytes=300 << 20, file_bytes=3 << 20, open_files=50, max_procs=20)
    large = Limits(cpu_s=7, memory_bytes=200 << 20, file_bytes=1 << 20, open_files=40, max_procs=10)
    expected = {small: "3 307200 3072 50 20", large: "7 204800 1024 40 10"}
    probe = "echo $(ulimit -t) $(ulimit -v) $(ulimit -f) $(ulimit -n) $(ulimit -u); pwd; cat mine; "
    probe += 'echo "$HOME"; readlink /proc/self/ns/pid'
    assert sandbox.start_zygote()
    served = []
    with Sandbox(files={"sub/mine": "a\n"}) as a, Sandbox(files={"mine": "b\n"}) as b:
        for box, limits, cwd, mine in [(a, small, "sub", "a"), (b, large, ".", "b"), (a, large, "sub", "a")]:
            with _made_ahead() as ahead:
                lines = box.run(probe, limits=limits, cwd=cwd).stdout.splitlines()
            where = os.path.normpath(box.workdir / cwd)
            assert lines[:-1] == [expected[limits], where, mine, str(box.workdir)]
            assert lines[-1] in ahead  # its PID namespace was made before the run was asked for
            assert _ends(ahead[lines[-1]])  # the child that served it ends (after its report): used once
            served.append(ahead[lines[-1]])
    assert len(set(served)) == 3


@needs_ahead
def test_a_run_with_other_mounts_is_not_served_by_a_child_made_for_others():
    """tmp_bytes and the network flag are made ahead (tmpfs sizes, /etc, the network namespace): a run
    that asks for others gets a child made for it, and the next ones are made for those."""
    assert sandbox.start_zygote()  # made ahead for the default Limits, no network
    probe = "df -B1 --output=size /tmp | tail -n 1; test -e /etc/resolv.conf && echo resolv; "
    probe += "readlink /proc/self/ns/pid"
    runs = [(8 << 20, False), (8 << 20, False), (4 << 20, True), (64 << 20, False), (64 << 20, False)]
    served = []
    with Sandbox() as offline, Sandbox(network=True) as online:
        for tmp_bytes, network in runs:
            with _made_ahead() as ahead:
                result = (online if network else offline).run(probe, limits=Limits(tmp_bytes=tmp_bytes))
            lines = result.stdout.splitlines()
            if LEVEL == "mount":
                assert [x.strip() for x in lines[:-1]] == [str(tmp_bytes)] + (["resolv"] if network else [])
            served.append(lines[-1] in ahead)
    assert served == [False, True, False, False, True]


def test_a_run_whose_work_dir_is_gone_fails_the_same_warm_and_cold():
    """A failure after the child was made (here: binding a work dir that no longer exists) is the run's
    setup failure on its stderr, on both paths."""
    outcomes = []
    for warm in (True, False):
        box = Sandbox(zygote=warm)
        workroot.rmtree(box.workdir)
        result = box.run(["true"])
        outcomes.append((result.returncode, "sandbox: setup failed" in result.stderr))
        box.close()
    if LEVEL == "mount":
        assert outcomes == [(126, True), (126, True)]
    else:
        assert outcomes[0] == outcomes[1]


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: [0] is field 3 (state), [1] the parent, [16] nice."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _slice_ns(pid: int | str) -> int | None:
    with open(f"/proc/{pid}/sched") as f:
        found = [line.split(":")[1] for line in f if line.startswith("se.slice")]
    return int(found[0]) if found else None


def _may_lower_nice() -> bool:
    """Whether this host process may lower its nice value (CAP_SYS_NICE), asked of a fresh interpreter."""
    probe = "import os; os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


@pytest.mark.parametrize("zygote", [True, False])
def test_the_watchdog_outranks_the_run_and_the_run_never_outranks_the_host(zygote):
    """With the watchdog bounding a run's total (no cgroup), its supervisor C runs `WATCH_NICE_BELOW` nice
    values under the host where it may lower its own, and the run at the host's; elsewhere C at the host's
    and the run `WATCH_NICE_BELOW` above it. C's EEVDF slice request is `WATCH_SLICE_NS` (kernels from 6.12
    take one), the run's the host's: a sandboxed run never gets a higher priority than its starter."""
    if sandbox.isolation().resources != "watchdog" or sandbox.isolation().backend != "unshare":
        pytest.skip(f"no watchdog at the own backend here ({sandbox.isolation()})")
    host_nice, host_slice = os.getpriority(os.PRIO_PROCESS, 0), _slice_ns("self")
    with Sandbox(zygote=zygote) as box:
        running = threading.Thread(target=box.run, args=(["sleep", "3"],))
        running.start()
        deadline = time.monotonic() + 2.0
        while not (command := _procs_in(box.workdir)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert command, "the run's command did not show up"
        supervisor = int(_stat(int(_stat(command[0])[1]))[1])  # P's parent is I, I's is C
        nice = int(_stat(command[0])[16]), int(_stat(supervisor)[16])
        seen = (nice[0], _slice_ns(command[0]), nice[1], _slice_ns(supervisor))
        running.join()
    below, above = (
        max(-20, host_nice - sandbox.WATCH_NICE_BELOW),
        min(19, host_nice + sandbox.WATCH_NICE_BELOW),
    )
    assert (seen[2], seen[0]) == ((below, host_nice) if _may_lower_nice() else (host_nice, above))
    assert seen[1] == host_slice
    kernel = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    if kernel >= (6, 12) and host_slice is not None:
        assert seen[3] == sandbox.WATCH_SLICE_NS
