"""The child side of `envs.sandbox`: everything between the fork of a run and the exec of its command.

Standard library only, run as a script: `python -I -S sandbox_child.py --zygote FD` (the zygote: forks one
child per request) or `--exec` (the cold path: one fresh interpreter per run, the spec on fd 4). The host
builds the whole spec (`envs.sandbox._spec`); nothing here decides policy.

Processes of one run at the "mount" and "unshare-net" levels (own backend):

    zygote -- C   host PID namespace; its own session (the host's kill target); the run's cgroup when
                  there is one; the memory watchdog; ends the way the command ended
              `-- I   PID 1 of the run's PID namespace, root of the run's first user namespace: makes the
                      mount, network, IPC and UTS namespaces, then reaps; the namespace dies with it
                  `-- P   the command: a second user namespace in which it is the host-side uid (never 0),
                          so exec leaves it no capabilities; rlimits; no further user namespaces

With bubblewrap, C forks `bwrap` (which makes the namespaces and mounts from the same plan) instead of I.
At the "rlimits" level C execs the command itself.

C reports to the host on fd 3 (`EVENTS_FD`), one JSON object per line: {"memory_exceeded": bytes}.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import math
import os
import re
import resource
import select
import selectors
import signal
import socket
import struct
import sys
import warnings  # noqa: F401 - os.execvpe imports it; later the uid may not read the stdlib
from collections.abc import Callable

EVENTS_FD = 3  # C -> host: JSON lines
SPEC_FD = 4  # cold path: the spec arrives here
WATCH_S = 0.01  # the memory watchdog's period
NEWNS, NEWUTS, NEWIPC = 0x00020000, 0x04000000, 0x08000000
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
_ST_TO_MS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}  # + atime
MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NAME = 1, 4, 15
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}  # fmt: skip
_RSS = re.compile(rb"^Rss(?:Anon|Shmem):\s+(\d+) kB", re.M)
_LIBC = ctypes.CDLL(None, use_errno=True)


# ----------------------------------------------------------------------------------------------------------
# System calls


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _unshare(flags: int) -> None:
    _check(_LIBC.unshare(flags), "unshare")


def _prctl(option: int, value: int | bytes) -> None:
    _LIBC.prctl(option, value, 0, 0, 0)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _map_ids(inside: int, outside_uid: int, outside_gid: int) -> None:
    """This process's new user namespace: `inside` (uid and gid) is the outside ids, nothing else."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{inside} {outside_uid} 1\n")
    _write("/proc/self/gid_map", f"{inside} {outside_gid} 1\n")


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    _prctl(_PR_SET_DUMPABLE, 1)  # setuid cleared it; uid_map must stay writable


def _loopback_up() -> None:
    iff_up, siocgifflags, siocsifflags = 0x1, 0x8913, 0x8914
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, siocgifflags, struct.pack("16sH22x", b"lo", 0))[:18])[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def _set_limit(resource_id: int, soft: int, hard: int | None = None) -> None:
    cap = resource.getrlimit(resource_id)[1]
    hard = soft if hard is None else hard
    if cap != resource.RLIM_INFINITY:
        soft, hard = min(soft, cap), min(hard, cap)
    resource.setrlimit(resource_id, (soft, hard))


def _set_rlimits(limits: dict, nproc: int | None) -> None:
    cpu = max(1, math.ceil(limits["cpu_s"]))
    _set_limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _set_limit(resource.RLIMIT_AS, limits["memory_bytes"])
    _set_limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    _set_limit(resource.RLIMIT_NOFILE, limits["open_files"])
    _set_limit(resource.RLIMIT_CORE, 0)
    _set_limit(resource.RLIMIT_MSGQUEUE, 0)  # POSIX message queues hold memory no other limit counts
    if nproc is not None:
        _set_limit(resource.RLIMIT_NPROC, nproc)


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


def _end_like(status: int) -> None:
    """End this process the way a wait status says: the same exit code, or the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        _set_limit(resource.RLIMIT_CORE, 0)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _never_return(fn: Callable, *args) -> None:
    """Runs `fn` (which execs or exits) in a forked process; any failure ends that process, never returns."""
    try:
        fn(*args)
    except FileNotFoundError as e:
        os.write(2, f"sandbox: {e.filename}: command not found\n".encode())
    except BaseException as e:  # noqa: BLE001 - nothing may return into the caller's frames after a fork
        os.write(2, f"sandbox: setup failed: {e!r}\n".encode())
        os._exit(126)
    os._exit(127)


# ----------------------------------------------------------------------------------------------------------
# The mount namespace (I, own backend): a tmpfs root holding the plan's mounts, then pivot_root into it.


def _makedirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _mount_point(target: str, like: str) -> None:
    """An empty directory or file at `target` to mount `like` on."""
    if os.path.isdir(like):
        _makedirs(target)
    elif not os.path.exists(target):
        _makedirs(os.path.dirname(target))
        open(target, "w").close()


def _bind_ro(root: str, path: str, at: str | None = None) -> None:
    target = root + (at or path)
    _mount_point(target, path)
    _mount(path, target, None, MS_BIND | MS_REC)
    locked = sum(ms for st, ms in _ST_TO_MS.items() if os.statvfs(path).f_flag & st)  # must be kept
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)


def _bind_rw(root: str, path: str) -> None:
    _mount_point(root + path, path)
    _mount(path, root + path, None, MS_BIND | MS_REC)


def _link(root: str, target: str, path: str) -> None:
    _makedirs(os.path.dirname(root + path))
    os.symlink(target, root + path)


def _tmpfs(root: str, path: str, size: int) -> None:
    _makedirs(root + path)
    _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")


def _hide(root: str, path: str) -> None:
    _makedirs(root + path)
    _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=0755")


def _dev(root: str) -> None:
    dev = root + "/dev"
    _makedirs(dev)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{dev}/{name}", "w").close()
            _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in _DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    _makedirs(f"{dev}/pts")
    _mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")


def _proc(root: str) -> None:
    _makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


_OPS: dict[str, Callable] = {
    "ro": _bind_ro, "rw": _bind_rw, "link": _link, "tmpfs": _tmpfs, "hide": _hide, "dev": _dev, "proc": _proc,
}  # fmt: skip


def _build_root(root: str, ops: list[list]) -> None:
    """Mounts the plan under `root` (a fresh tmpfs), makes it this namespace's `/`, read-only."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for op in ops:
        _OPS[op[0]](root, *op[1:])
    os.chdir(root)
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: no system call number known for {os.uname().machine}")
    _check(_LIBC.syscall(number, b".", b"."), "pivot_root")  # the old root ends up stacked under `.`
    _check(_LIBC.umount2(b".", MNT_DETACH), "detach the host root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _limit_ipc(tmp_bytes: int) -> None:
    """SysV shared memory of this IPC namespace: at most `tmp_bytes`, removed once nobody attaches it."""
    _write("/proc/sys/kernel/shmmax", str(tmp_bytes))
    _write("/proc/sys/kernel/shmall", str(max(1, tmp_bytes // os.sysconf("SC_PAGE_SIZE"))))
    _write("/proc/sys/kernel/shm_rmid_forced", "1")


def _scrub_cmdline() -> None:
    """PID 1 is a fork of the zygote: /proc/1/cmdline (world-readable) would show the zygote's command
    line, and its environ area the host's. Both are overwritten in place."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])  # stat fields 48-51
    ctypes.memset(env_start, 0, env_end - env_start)
    ctypes.memset(arg_start, 0, arg_end - arg_start)
    name = b"sandbox-init"[: arg_end - arg_start - 1]
    ctypes.memmove(arg_start, name, len(name))
    _prctl(_PR_SET_NAME, b"sandbox-init")


# ----------------------------------------------------------------------------------------------------------
# The processes of one run


def _become_command(spec: dict, nproc: int | None) -> None:
    _set_rlimits(spec["limits"], nproc)
    os.chdir(spec["cwd"])
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])


def _command(spec: dict, uid: int, gid: int) -> None:
    """P: a user namespace of its own in which it is `uid` (not 0): exec drops every capability."""
    _unshare(NEWUSER)
    _map_ids(uid, 0, 0)
    _write("/proc/sys/user/max_user_namespaces", "0")
    _become_command(spec, spec["limits"]["max_procs"])


def _init(spec: dict, status_w: int, uid: int, gid: int) -> None:
    """I: PID 1 of the run. Makes the namespaces, forks the command, reaps until the command ends, then
    writes its wait status to C and exits (the kernel then kills what is left in the PID namespace)."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    mount = spec["level"] == "mount"
    _unshare(NEWIPC | NEWUTS | (0 if spec["network"] else NEWNET) | (NEWNS if mount else 0))
    socket.sethostname("sandbox")
    if not spec["network"]:
        _loopback_up()
    _limit_ipc(spec["limits"]["tmp_bytes"])
    if mount:
        _build_root(spec["root"], spec["mounts"])
    else:
        os.chdir("/")
    _scrub_cmdline()
    command = os.fork()
    if command == 0:
        os.close(status_w)
        _never_return(_command, spec, uid, gid)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == command:
            os.write(status_w, str(status).encode())
            os._exit(0)


def _memory_in(proc_dir: str, host_proc_dev: int) -> int:
    """Bytes of anonymous and shared memory mapped by the processes of the PID namespace whose /proc is
    `proc_dir`; 0 until that /proc is the run's own."""
    try:
        if os.stat(proc_dir).st_dev == host_proc_dev:
            return 0
        names = os.listdir(proc_dir)
    except OSError:
        return 0
    total = 0
    for name in names:
        if name.isdigit():
            try:
                with open(f"{proc_dir}/{name}/status", "rb") as f:
                    total += sum(int(kb) for kb in _RSS.findall(f.read())) << 10
            except OSError:
                continue
    return total


def _wait(pid: int, limit: int | None, proc_dir: str | None) -> int:
    """Waits for `pid`; with a `limit`, kills it when the run's processes together map more memory."""
    if limit is not None and proc_dir is not None:
        pidfd = os.pidfd_open(pid)
        host_dev = os.stat("/proc").st_dev
        while not select.select([pidfd], [], [], WATCH_S)[0]:
            used = _memory_in(proc_dir, host_dev)
            if used > limit:
                os.kill(pid, signal.SIGKILL)
                os.write(EVENTS_FD, json.dumps({"memory_exceeded": used}).encode() + b"\n")
                break
        os.close(pidfd)
    return os.waitpid(pid, 0)[1]


def _watch_limit(spec: dict) -> int | None:
    return spec["limits"]["total_memory_bytes"] if spec["watch"] else None


def _proc_inside(pid: int) -> str:
    """The /proc that process `pid` sees (under its root): the run's own once its PID namespace mounts it."""
    return os.path.join("/proc", str(pid), "root", "proc")


def _run_namespaced(spec: dict) -> int:
    """C, own backend: the run's first user namespace (in which I is root) and its PID namespace."""
    uid, gid = os.getuid(), os.getgid()
    _unshare(NEWUSER | NEWPID)
    _map_ids(0, uid, gid)
    status_r, status_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        os.close(EVENTS_FD)
        _never_return(_init, spec, status_w, uid, gid)
    os.close(status_w)
    init_status = _wait(init, _watch_limit(spec), _proc_inside(init))
    reported = os.read(status_r, 64)
    return int(reported) if reported else init_status


def _run_bwrap(spec: dict) -> int:
    """C, bubblewrap backend: forks bwrap (the argv the host built) and watches its PID namespace."""
    info_r, info_w = os.pipe()
    os.set_inheritable(info_w, True)
    pid = os.fork()
    if pid == 0:
        os.close(info_r)
        os.close(EVENTS_FD)
        argv = spec["argv"]
        bwrap = {**spec, "argv": [argv[0], "--info-fd", str(info_w), *argv[1:]]}
        _never_return(_become_command, bwrap, None)  # bwrap_argv sets RLIMIT_NPROC inside
    os.close(info_w)
    info = b""
    while chunk := os.read(info_r, 4096):  # bwrap closes it once the namespaces exist
        info += chunk
    os.close(info_r)
    child = re.search(rb'"child-pid":\s*(\d+)', info)
    status = _wait(pid, _watch_limit(spec), _proc_inside(int(child[1])) if child else None)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 0
    if 128 < code < 128 + signal.NSIG:  # bwrap's way to say the command died from signal code - 128
        return code - 128
    return status


def run_child(spec: dict) -> None:
    """C: becomes the run described by `spec` (fds 0-2 are its stdio, fd 3 the events). Never returns."""
    try:
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE and SIGXFSZ; the command must not
        os.closerange(EVENTS_FD + 1, 65536)
        if os.getsid(0) != os.getpid():
            os.setsid()
        os.umask(0o022)
        if spec["cgroup"]:
            _write(f"{spec['cgroup']}/cgroup.procs", "0")
        if spec["uid"] is not None:
            _drop_privileges(spec["uid"])
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if spec["level"] == "rlimits":
            os.close(EVENTS_FD)
            _never_return(_become_command, spec, spec["limits"]["max_procs"] + _user_tasks(os.getuid()))
        _end_like(_run_bwrap(spec) if spec["backend"] == "bwrap" else _run_namespaced(spec))
    except BaseException as e:  # noqa: BLE001 - anything here must end the child, never return to a caller
        os.write(2, f"sandbox: setup failed: {e!r}\n".encode())
        os._exit(126)


# ----------------------------------------------------------------------------------------------------------
# Zygote: a stdlib-only process that forks one child per request.


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
        head, fds, _, _ = socket.recv_fds(sock, 8, 5)
    except ConnectionError:
        return None
    if not head:
        return None
    (size,) = struct.unpack("!Q", _recv_exact(sock, 8, head))
    return json.loads(_recv_exact(sock, size)), fds


def place_fds(fds: list[int]) -> None:
    """Moves `fds` to 0, 1, 2, ... (through high numbers first, so that no move clobbers another)."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
        os.close(fd)


def _fork_child(spec: dict, fds: list[int]) -> int:
    """fds: stdin, stdout, stderr, the host's status pipe (kept by the zygote), events."""
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        place_fds([fds[0], fds[1], fds[2], fds[4]])
        run_child(spec)
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


def zygote_main(fd: int) -> None:
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
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(pid, signal.SIGKILL)
                    return
                spec, fds = request
                try:
                    pid = _fork_child(spec, fds)
                    _report(fds[3], pid)
                    children[pid] = fds[3]
                except OSError:
                    os.close(fds[3])  # the host reads EOF instead of a pid: no child
                for f in (fds[0], fds[1], fds[2], fds[4]):
                    os.close(f)
            else:
                os.read(wake_r, 4096)
            _reap(children)


def main(args: list[str]) -> None:
    if args[:1] == ["--zygote"]:
        zygote_main(int(args[1]))
    elif args[:1] == ["--exec"]:
        with open(SPEC_FD, "rb") as f:
            spec = json.loads(f.read())
        run_child(spec)
    else:
        sys.exit("usage: sandbox_child.py --zygote FD | --exec (started by envs.sandbox)")


if __name__ == "__main__":
    main(sys.argv[1:])
