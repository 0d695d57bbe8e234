"""The mount namespace of a run at the "mount" level (own backend), made by the run's PID 1.

Standard library only, like `envs.sandbox.child`, which uses it. `mount_plan` mounts the plan
(`envs.sandbox.plan`) under a fresh tmpfs; `stage` puts the host's work-dir parent in a holder there;
`enter_root` makes that tmpfs the namespace's read-only `/` (the host's root unmounted); all three before
the run is asked for. `show_workdir` then binds the run's own work dir from the stage into place and
covers the stage.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
_ST_TO_MS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}  # + atime
MNT_DETACH = 2
STAGE = ".stage"  # where, until the run comes, the host's work dirs are seen (see `stage`)
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}  # fmt: skip
LIBC = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


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


def mount_plan(root: str, ops: list[list]) -> None:
    """Mounts the plan under `root` (a fresh tmpfs)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for op in ops:
        _OPS[op[0]](root, *op[1:])


def stage(root: str, workdirs: str) -> None:
    """A small tmpfs at `workdirs` (where the host makes work dirs; read-only once the run's work dir is in
    it) holding, until `show_workdir`, the host's `workdirs` at `STAGE`: the one place of the host the root
    keeps while the run is made."""
    holder = root + workdirs
    _makedirs(holder)
    _mount("tmpfs", holder, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    _makedirs(holder + "/" + STAGE)
    _mount(workdirs, holder + "/" + STAGE, None, MS_BIND)


def show_workdir(workdirs: str, workdir: str) -> None:
    """The run's work dir (one in `workdirs`) from the stage into its place, then the stage covered by an
    empty read-only tmpfs (nothing of the run has run yet: P is waiting for this run) and the holder made
    read-only. Covered, not unmounted: an unmount waits for an RCU grace period, milliseconds on a busy
    machine, and no path reaches a covered mount (I holds no descriptor or directory in it)."""
    name, stage = workdir[len(workdirs) + 1 :], f"{workdirs}/{STAGE}"
    if not workdir.startswith(workdirs + "/") or "/" in name or name in ("", ".", "..", STAGE):
        raise ValueError(f"work dir {workdir!r} is not a directory in {workdirs!r}")
    os.mkdir(workdir, 0o755)
    _mount(f"{stage}/{name}", workdir, None, MS_BIND | MS_REC)
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=0755")  # as `_hide`
    _mount(None, workdirs, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter_root(root: str) -> None:
    """Makes `root` this namespace's `/`, read-only, and drops the host's root from it."""
    os.chdir(root)
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: no system call number known for {os.uname().machine}")
    check(LIBC.syscall(number, b".", b"."), "pivot_root")  # the old root ends up stacked under `.`
    check(LIBC.umount2(b".", MNT_DETACH), "detach the host root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
