"""The child side of `envs.sandbox`: everything between the fork of a run and the exec of its command.

Standard library only. The zygote (`zygote.py`) forks children from `run_child`; `python -I -S
child.py --exec` is the cold path (one fresh interpreter per run, the whole spec on fd 4). The host
builds the whole spec (`envs.sandbox._spec`); nothing here decides policy. A spec has two parts: `prep`,
what a run's namespaces and mounts are made from (the same for many runs), and `run`, what only this run
has (argv, env, cwd, limits, work dir). A child is made from `prep` first and takes its `run` (with the
run's stdin, stdout, stderr, status and events fds) from its channel (`SPEC_FD`) only when that comes, so
that the zygote can make children ahead of their run (`prep["ahead"]`): namespaces made, the mount plan
mounted, /proc too, the root entered, the command's process forked in its own user namespace. When the run
comes, its work dir is bound from the stage (`envs.sandbox.mounts`) and the command exec'd with the run's
limits. A child serves one run, then ends.

Processes of one run at the "mount" and "unshare-net" levels (own backend):

    zygote -- C   host PID namespace; its own session (the host's kill target); the run's cgroup when
                  there is one; the memory watchdog, at a higher priority than the run's
                  (`watchdog.raise_priority`);
                  ends the way the command ended
              `-- I   PID 1 of the run's PID namespace, root of the run's first user namespace: takes the
                      run's priority (`watchdog.lower_run_priority`); makes the
                      mount, network, IPC and UTS namespaces, the root and P ahead; takes the run from the
                      channel, passes C the events fd, shows the work dir, hands P its run, reaps; once the
                      command has ended, kills and reaps everything left in the namespace, then writes the
                      command's wait status to the host's status pipe and to C
                  `-- P   the command: a second user namespace in which it is the host-side uid (never 0),
                          so exec leaves it no capabilities; rlimits; no further user namespaces

With bubblewrap, C forks `bwrap` (which makes the namespaces and mounts from the same plan) for the run
instead of I. At the "rlimits" level C execs the command itself. Only the own backend's namespaced levels
without a per-run cgroup are made ahead (a process must start inside its cgroup; bwrap takes its plan at
exec); the others wait in C for their run, which the zygote then sends at once.

C, I and P are not dumpable (but for P's moment of writing its own id maps): their user namespaces belong
to the sandboxed uid, so any other process of that uid in the host's user namespace (code run at the
"rlimits" level, say) holds every capability in them and could ptrace a child made ahead and run the next
mount-level run its own way; an undumpable process it cannot trace or look into (that takes
CAP_SYS_PTRACE in the host's user namespace). C's watchdog reads the run's /proc through a descriptor I
opened, not through /proc/<I>/root.

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
import signal
import socket
import struct
import sys
import warnings  # noqa: F401 - os.execvpe imports it; later the uid may not read the stdlib
from collections.abc import Callable

if __package__:  # imported as envs.sandbox.child (by the host)
    from envs.sandbox import messages, mounts, watchdog
else:  # run from a script (`python -I -S child.py`, the zygote): `-I` leaves the script's directory out
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import messages
    import mounts
    import watchdog

AHEAD = 2  # children the zygote keeps made ahead: making one waits on the kernel (RCU grace periods for
# the host root's unmount, network namespace setup) for longer than a run lasts on a busy machine; two give
# each one the time of two runs, so that runs back to back still find one ready
NEWNS, NEWUTS, NEWIPC = 0x00020000, 0x04000000, 0x08000000
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NAME, _PR_SET_CHILD_SUBREAPER = 1, 4, 15, 36


# ----------------------------------------------------------------------------------------------------------
# System calls


def _unshare(flags: int) -> None:
    mounts.check(mounts.LIBC.unshare(flags), "unshare")


def _prctl(option: int, value: int | bytes) -> None:
    mounts.LIBC.prctl(option, value, 0, 0, 0)


def _write(path: str, text: str) -> None:
    """One write(2) (what /proc's id maps need), without Python's file objects."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


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
    except BaseException as e:  # noqa: BLE001 - nothing may return into the caller's frames after a fork
        os.write(2, f"sandbox: setup failed: {e!r}\n".encode())
        os._exit(126)


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


def _take_run() -> tuple[bytes, list[int]]:
    """The run's JSON and fds (stdin, stdout, stderr, the host's status pipe, events) from the zygote's
    channel on `SPEC_FD`, which is closed then. EOF (the zygote dropped this prepared child): the end."""
    channel = socket.socket(fileno=messages.SPEC_FD)
    received = messages.recv_message(channel)
    channel.close()
    if received is None:
        os._exit(0)
    return received


def _take_own_run() -> dict:
    """C's run from the zygote (rlimits level, bwrap): stdio to 0-2, events to 3; the zygote reports."""
    raw, fds = _take_run()
    os.close(fds[3])
    messages.place_fds([fds[0], fds[1], fds[2], fds[4]])
    return json.loads(raw)


def _fail(error: BaseException, given: dict | None) -> None:
    """Ends a child whose setup failed, saying why on the run's stderr (so once the run has come, if this
    process still holds the zygote's channel)."""
    if given is None:
        with contextlib.suppress(BaseException):
            _take_own_run()
    os.write(2, f"sandbox: setup failed: {error!r}\n".encode())
    os._exit(126)


def _become_command(run: dict, nproc: int | None) -> None:
    _set_rlimits(run["limits"], nproc)
    os.chdir(run["cwd"])  # a missing work dir is a setup failure (126), not a missing command
    try:
        os.execvpe(run["argv"][0], run["argv"], run["env"])
    except FileNotFoundError as e:
        os.write(2, f"sandbox: {e.filename}: command not found\n".encode())
        os._exit(127)


def _command(channel: socket.socket, uid: int, gid: int) -> None:
    """P: made ahead in a user namespace of its own in which it is `uid` (not 0), so that exec drops every
    capability; then waits on `channel` for its run (the JSON and stdin, stdout, stderr) and execs it."""
    os.closerange(0, channel.fileno())
    os.closerange(channel.fileno() + 1, 65536)
    failure = None
    try:
        _unshare(NEWUSER)
        _prctl(_PR_SET_DUMPABLE, 1)  # its own id maps are writable only so
        _map_ids(uid, 0, 0)
        _prctl(_PR_SET_DUMPABLE, 0)  # as C and I until exec, which makes the command dumpable again
        _write("/proc/sys/user/max_user_namespaces", "0")
    except BaseException as e:  # noqa: BLE001 - said on the run's stderr once the run is here
        failure = e
    received = messages.recv_message(channel)
    if received is None:
        os._exit(0)
    messages.place_fds(received[1])
    os.closerange(3, 65536)
    if failure is not None:
        raise failure
    run = json.loads(received[0])
    _become_command(run, run["limits"]["max_procs"])


def _prepare_init(prep: dict) -> None:
    """I's namespaces and, at the mount level, its root: the plan, the stage (`_stage`), entered."""
    mount = prep["level"] == "mount"
    _unshare(NEWIPC | NEWUTS | (0 if prep["network"] else NEWNET) | (NEWNS if mount else 0))
    socket.sethostname("sandbox")
    if not prep["network"]:
        _loopback_up()
    _limit_ipc(prep["tmp_bytes"])
    if mount:
        mounts.mount_plan(prep["root"], prep["mounts"])
        mounts.stage(prep["root"], prep["workdirs"])
        mounts.enter_root(prep["root"])
    else:
        os.chdir("/")
    _scrub_cmdline()


def _empty_namespace() -> None:
    """Kills every other process of this PID namespace and reaps them all. From PID 1, kill(-1) reaches
    each one, and a fork racing with it either fails (its parent has the SIGKILL) or makes a child that
    gets one too; orphans come to PID 1, so once it has no children nothing of the run is left."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while True:
            os.waitpid(-1, 0)


def _init(prep: dict, given: dict | None, to_c: socket.socket, uid: int, gid: int) -> None:
    """I: PID 1 of the run. Makes the namespaces, the root and P ahead. Its run: `given` (cold path, fds in
    place) or from its channel (the host's or the zygote's), whose events fd and JSON it passes on to C.
    Then shows the run's
    work dir (`_show_workdir`), hands P its run and reaps until P's command ends; then empties the
    namespace and reports the command's wait status: to the host's status pipe (from the zygote), then
    to C."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    failure = None
    try:
        watchdog.lower_run_priority()
        _prepare_init(prep)
        to_p, channel = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = os.fork()
        if command == 0:
            to_p.close()
            _never_return(_command, channel, uid, gid)
        channel.close()
    except BaseException as e:  # noqa: BLE001 - said on the run's stderr once the run is here
        failure = e
    status_fd, stdio = None, [0, 1, 2]
    try:
        proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the run's, for C's watchdog
        if given is None:
            raw, fds = _take_run()  # stdin, stdout, stderr, the host's status pipe, events
            stdio, status_fd = fds[:3], fds[3]
            messages.send_message(to_c, raw, [fds[4], proc])
            os.close(fds[4])
        else:
            os.close(messages.EVENTS_FD)
            raw = json.dumps(given).encode()
            messages.send_message(to_c, b"", [proc])
        os.close(proc)
        if failure is not None:
            raise failure
        if prep["level"] == "mount":
            mounts.show_workdir(prep["workdirs"], (given or json.loads(raw))["workdir"])
        messages.send_message(to_p, raw, stdio)
    except BaseException as e:  # noqa: BLE001 - nothing may return into the zygote's frames after a fork
        os.write(stdio[2], f"sandbox: setup failed: {e!r}\n".encode())
        os._exit(126)
    for fd in stdio:
        os.close(fd)  # P's now: the run's pipes reach EOF on the host once its processes are gone
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == command:
            break
    _empty_namespace()
    if status_fd is not None:
        # the zygote's line for C comes later; the host takes the first
        messages.report(status_fd, status, close=True)
    to_c.sendall(f"{status}\n".encode())
    os._exit(0)


def _run_namespaced(prep: dict, given: dict | None) -> int:
    """C, own backend: the run's first user namespace (in which I is root) and its PID namespace. From the
    zygote, C has no part in the run's start: I takes the run and passes C what the watchdog needs."""
    uid, gid = os.getuid(), os.getgid()
    _unshare(NEWUSER | NEWPID)
    _map_ids(0, uid, gid)
    _prctl(_PR_SET_DUMPABLE, 0)  # ptrace by the uid's other processes (the module docstring); I inherits it
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    init = os.fork()
    if init == 0:
        ours.close()
        _never_return(_init, prep, given, theirs, uid, gid)
    theirs.close()
    if given is None:
        os.dup2(0, messages.SPEC_FD)  # the channel is I's now (C's /dev/null in its place, for `_fail`)
    received = messages.recv_message(ours)  # the run (from the zygote's channel), and the run's /proc
    if received is None:  # I ended before its run started
        return os.waitpid(init, 0)[1]
    run, fds = given or json.loads(received[0]), received[1]
    if given is None:
        os.dup2(fds[0], messages.EVENTS_FD)
        os.close(fds.pop(0))
    status = watchdog.watch(init, watchdog.watch_limit(prep, run), fds[0], ours)
    if given is not None:  # a cold C's parent reaps no orphan: I is waited for here
        with contextlib.suppress(ChildProcessError):
            os.waitpid(init, 0)
    return status


def _run_bwrap(prep: dict, run: dict) -> int:
    """C, bubblewrap backend: forks bwrap (the argv the host built) and watches its PID namespace."""
    _prctl(_PR_SET_DUMPABLE, 0)  # as in `_run_namespaced`
    info_r, info_w = os.pipe()
    os.set_inheritable(info_w, True)
    pid = os.fork()
    if pid == 0:
        os.close(info_r)
        os.close(messages.EVENTS_FD)
        watchdog.lower_run_priority()
        argv = run["argv"]
        bwrap = {**run, "argv": [argv[0], "--info-fd", str(info_w), *argv[1:]]}
        _never_return(_become_command, bwrap, None)  # bwrap_argv sets RLIMIT_NPROC inside
    os.close(info_w)
    info = b""
    while chunk := os.read(info_r, 4096):  # bwrap closes it once the namespaces exist
        info += chunk
    os.close(info_r)
    child = re.search(rb'"child-pid":\s*(\d+)', info)
    status = watchdog.watch(
        pid, watchdog.watch_limit(prep, run), watchdog.proc_inside(int(child[1])) if child else None
    )
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 0
    if 128 < code < 128 + signal.NSIG:  # bwrap's way to say the command died from signal code - 128
        return code - 128
    return status


def run_child(prep: dict, given: dict | None = None) -> None:
    """C: made from `prep`; its run is `given` (the cold path: fds 0-2 its stdio, 3 its events) or comes
    from the zygote's channel on `SPEC_FD` (to C, or to I at the own backend's namespaced levels). Never
    returns."""
    try:
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE and SIGXFSZ; the command must not
        os.closerange(messages.SPEC_FD + 1, 65536)
        if os.getsid(0) != os.getpid():
            os.setsid()
        os.umask(0o022)
        if prep["cgroup"]:
            _write(f"{prep['cgroup']}/cgroup.procs", "0")
        if prep["watch"]:
            watchdog.raise_priority(prep["watch_nice_below"], prep["watch_slice_ns"])
        if prep["uid"] is not None:
            _drop_privileges(prep["uid"])
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if prep["level"] == "rlimits":
            run = given or _take_own_run()
            os.close(messages.EVENTS_FD)
            _never_return(_become_command, run, run["limits"]["max_procs"] + _user_tasks(os.getuid()))
        if prep["backend"] == "bwrap":
            _end_like(_run_bwrap(prep, given or _take_own_run()))
        _end_like(_run_namespaced(prep, given))
    except BaseException as e:  # noqa: BLE001 - anything here must end the child, never return to a caller
        _fail(e, given)


def main(args: list[str]) -> None:
    if args[:1] == ["--exec"]:
        with open(messages.SPEC_FD, "rb") as f:
            prep, _, run = f.read().partition(b"\n")  # launch.encode's
        run_child(json.loads(prep), json.loads(run))
    else:
        sys.exit("usage: child.py --exec (started by envs.sandbox; the zygote is zygote.py)")


if __name__ == "__main__":
    main(sys.argv[1:])
