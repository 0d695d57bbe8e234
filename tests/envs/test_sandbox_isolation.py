"""What each isolation level of envs.sandbox keeps in, probed as an attacker would and judged by the side
effects on the host (envs.qa.escape), not by what the probe prints: at the mount level nothing gets out,
with the project's own backend and with bubblewrap (skipped where it is not installed), as root and as an
unprivileged user; below it the same probes are caught, so the judge can fail. And: code and terminal
domains refuse to start below the mount level unless overridden, loudly."""

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from envs import registry
from envs.qa import escape
from envs.sandbox import box as sandbox
from envs.sandbox.box import Limits, Sandbox

REPO = pathlib.Path(__file__).resolve().parents[2]
LEVEL = sandbox.isolation_level()
needs_mount = pytest.mark.skipif(LEVEL != "mount", reason=f"no mount namespace here ({LEVEL})")
# Small, so that the probes below the mount level (where nothing else bounds them) stay cheap for the host:
# each probe process may map 128 MiB, the whole run hold 256 MiB; `_GOAL` is then 512 MiB.
TINY = Limits(memory_bytes=128 << 20, total_memory_bytes=256 << 20, wall_s=8.0, cpu_s=5.0, tmp_bytes=8 << 20)


def _probe(name: str, limits: Limits = TINY) -> tuple[sandbox.RunResult, list[str]]:
    with escape.Watch(limits.total_memory_bytes) as watch:
        source = watch.preamble() + escape.ESCAPE_PROBES[name]
        run = sandbox.run_once(["python3", "-c", source, watch.token], limits=limits)
        return run, watch.findings()


@pytest.fixture(params=["unshare", "bwrap"])
def backend(request):
    if request.param == "bwrap" and not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    try:
        found = sandbox.configure(backend=request.param)
        if found.level != "mount":
            pytest.skip(f"no mount level with backend {request.param}: {found.notes}")
        yield request.param
    finally:
        sandbox.configure()


@pytest.fixture
def level_below():
    yield
    sandbox.configure()
    escape.remove_left_files()


@pytest.mark.parametrize("name", escape.ESCAPE_PROBES)
def test_escape_probe_does_nothing_to_the_host_at_the_mount_level(name, backend):
    run, findings = _probe(name)
    assert findings == [], run.stderr
    assert run.isolation == "mount"
    if name == "many_procs_memory":  # 12 processes of 43 MiB each, each under its own 128 MiB limit
        assert run.memory_exceeded and run.status == "killed", run


# What each probe must be caught doing when the level below stands in the way (written by hand from what
# the levels leave open: unshare-net shares the host's filesystem and /proc; rlimits also the network and
# the process tree).
CAUGHT = {
    "unshare-net": {
        "fill_dev_shm": "file outside the work dir",
        "many_procs_memory": "memory",
        "leave_file": "file outside the work dir",
        "list_proc": "canary read",
        "read_canaries": "canary read",
    },
    "rlimits": {
        "fill_dev_shm": "file outside the work dir",
        "many_procs_memory": "memory",
        "leave_file": "file outside the work dir",
        "list_proc": "host process seen",
        "read_canaries": "canary read",
        "setsid_sleep": "process left after the run",
        "connect_host": "connection accepted",
    },
}


@pytest.mark.parametrize("level,name", [(lv, n) for lv, probes in CAUGHT.items() for n in probes])
def test_escape_is_caught_below_the_mount_level(level, name, level_below):
    if sandbox.rank(LEVEL) > sandbox.rank(level):
        pytest.skip(f"{level} is not available here ({LEVEL})")
    sandbox.configure(level=level)
    run, findings = _probe(name)
    assert any(f.startswith(CAUGHT[level][name]) for f in findings), (findings, run.stderr)


def test_probes_running_at_once_leave_each_others_bait_alone(level_below):
    """Under `pytest -n 2` the unprivileged mount-level probes saw a canary read and connections: a root
    worker's `list_proc` probe at the rlimits level, running at the same moment, followed the leads of
    every decoy it found. A probe now follows only its own watch's decoy; the other watch sees nothing."""
    sandbox.configure(level="rlimits")
    with escape.Watch(TINY.total_memory_bytes) as other:
        run, findings = _probe("list_proc")
        assert any(f.startswith("host process seen") for f in findings), (findings, run.stderr)
        assert other.findings() == []


_TAKE_OVER = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for pid in sys.argv[1:]:
    attached = libc.ptrace(16, int(pid), 0, 0) == 0  # PTRACE_ATTACH
    if attached:
        libc.ptrace(17, int(pid), 0, 0)  # PTRACE_DETACH
    looked = []
    for where in ("root", "cwd", "fd", "mem"):
        try:
            os.listdir(f"/proc/{pid}/{where}") if where != "mem" else open(f"/proc/{pid}/mem", "rb").close()
            looked.append(where)
        except OSError:
            pass
    out[pid] = [attached, looked]
print(json.dumps(out))
"""


def _descendants(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            stat = pathlib.Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found += [int(name), *_descendants(int(name))]
    return found


@needs_mount
def test_code_of_the_same_uid_cannot_take_over_a_child_made_ahead(level_below):
    """Children made ahead wait in user namespaces of the sandboxed uid, which gives every other process of
    that uid in the host's user namespace (here a run at the rlimits level) all capabilities in them: were
    they dumpable it could trace one and run the next mount-level run its own way. C, I and P of every
    child made ahead must refuse to be traced or looked into."""
    if sandbox.isolation().backend != "unshare" or sandbox.isolation().resources == "cgroup2":
        pytest.skip("no child is made ahead here (bwrap or cgroups)")
    assert sandbox.start_zygote()
    deadline = time.monotonic() + 10.0
    while len(waiting := _descendants(sandbox.zygote_pid())) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)  # two children made ahead, each a C, its I and its P
    assert len(waiting) >= 6, waiting
    sandbox.configure(level="rlimits")
    run = sandbox.run_once(["python3", "-c", _TAKE_OVER, *map(str, waiting)], limits=TINY)
    assert run.status == "ok", run.stderr
    assert json.loads(run.stdout) == {str(pid): [False, []] for pid in waiting}


@needs_mount
def test_a_left_file_is_gone_for_the_next_run():
    with Sandbox(limits=TINY) as sb, escape.Watch(TINY.total_memory_bytes) as watch:
        assert sb.run(f"for d in /tmp /var/tmp /dev/shm; do echo x > $d/{watch.token}; done").status == "ok"
        look = sb.run(f"ls /tmp /var/tmp /dev/shm; cat /tmp/{watch.token}")
        assert look.status == "error" and watch.token not in look.stdout
        assert watch.findings() == []


@needs_mount
def test_the_mount_level_shows_only_system_dirs_and_the_work_dir(tmp_path):
    (tmp_path / "secret").write_text("s")
    with Sandbox(limits=TINY) as a, Sandbox() as b:
        top = a.run("ls -A /").stdout.split()
        system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr", "var"}
        assert set(top) <= system
        assert {"usr", "etc", "tmp", "proc", "dev"} <= set(top)
        hidden = [str(REPO), "/home", "/root", "/run", "/var/log", "/etc/shadow"]
        hidden += [str(b.workdir), str(tmp_path)]
        shown = a.run("for p in " + " ".join(hidden) + '; do test -e "$p" && echo "$p"; done; true')
        assert shown.stdout == ""
        assert a.run("ls /proc | grep -c '^[0-9]'").stdout.strip() in ("2", "3", "4")  # init, bash, ls, grep
        sizes = a.run("df -B1 --output=size /tmp /var/tmp /dev/shm | tail -n +2").stdout.split()
        assert sizes == [str(TINY.tmp_bytes)] * 3
        assert a.run("touch /usr/x || touch /x || touch /etc/x").status == "error"
        assert a.run("echo ok > here && cat here").stdout == "ok\n"


def test_code_and_terminal_refuse_to_start_below_the_mount_level(level_below, caplog):
    for weak in [lv for lv in sandbox.LEVELS[1:] if sandbox.rank(lv) >= sandbox.rank(LEVEL)]:
        sandbox.configure(level=weak)
        for domain in ("code", "terminal"):
            with pytest.raises(sandbox.IsolationError) as refused:
                registry.make(domain)
            text = str(refused.value)
            assert f"'{domain}'" in text and "'mount'" in text and f"found '{weak}'" in text
            assert "user namespaces" in text and f"min_isolation='{weak}'" in text  # how to get it, or not
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="envs.sandbox"):
                registry.make(domain, min_isolation=weak).close()
            assert f"at sandbox isolation '{weak}', below 'mount'" in caplog.text


def test_pool_start_fails_below_the_mount_level():
    code = "from envs.pool import EnvPool\nEnvPool(1, domains=['terminal'], startup_timeout_s=60)"
    env = {**os.environ, "ENVS_SANDBOX_LEVEL": "rlimits"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "needs sandbox isolation level 'mount' or stronger, found 'rlimits'" in proc.stderr, proc.stderr


# The unprivileged path: the probes again, run by a process of an ordinary uid (as root, through setpriv).
_UNPRIVILEGED = """
import json, sys
from envs.qa import escape
from envs.sandbox import box as sandbox
limits = sandbox.Limits(**json.loads(sys.argv[1]))
out = {"isolation": sandbox.isolation().to_json(), "findings": {}}
for name, source in escape.ESCAPE_PROBES.items():
    with escape.Watch(limits.total_memory_bytes) as watch:
        run = sandbox.run_once(["python3", "-c", watch.preamble() + source, watch.token], limits=limits)
        out["findings"][name] = watch.findings()
out["id"] = sandbox.run_once("id -u").stdout.strip()
print(json.dumps(out))
"""


def test_escape_probes_as_an_unprivileged_user():
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if os.geteuid() != 0 or not setpriv or not os.access(python, os.X_OK):
        pytest.skip("needs root (to become another uid), setpriv and a system python3")
    uid = "23456"
    argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", python, "-c", _UNPRIVILEGED]
    limits = {"memory_bytes": TINY.memory_bytes, "total_memory_bytes": TINY.total_memory_bytes, "wall_s": 8.0}
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/tmp", "LANG": "C.UTF-8"}
    run = dict(cwd="/", env=env, capture_output=True, text=True, timeout=120)
    proc = subprocess.run([*argv, json.dumps(limits)], **run)
    if proc.returncode and "No module named" in proc.stderr:
        pytest.skip(f"uid {uid} cannot import this checkout with {python}: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    if out["isolation"]["level"] != "mount":
        pytest.skip(f"unprivileged user namespaces are not allowed here: {out['isolation']['notes']}")
    assert out["id"] == uid
    assert out["findings"] == {name: [] for name in escape.ESCAPE_PROBES}
