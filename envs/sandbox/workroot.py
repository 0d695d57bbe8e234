"""Each process's private parent of sandbox work dirs (`<tmp>/sandboxes-*`), and its removal.

A process makes its root on first use and removes it at exit. Exit handlers do not run everywhere a
sandbox lives: a multiprocessing child (an `envs.pool` worker) leaves through `os._exit`, and a worker past
its timeout is killed with SIGKILL. So the root also carries a lock: `.lock`, a file its process holds an
exclusive `flock` on for as long as it lives. The kernel drops that lock when the process dies, however it
dies, and the next process that makes a root removes the roots whose lock it can take (`remove_abandoned`).
A root's `.lock` appears only once it is held (it is locked under a temporary name, then renamed), so a root
being made is never taken for an abandoned one. Only roots owned by this uid, not symlinks, are touched.

A root belongs to the process that made it: a forked child that makes sandboxes makes its own, and its exit
never removes its parent's.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import pathlib
import shutil
import tempfile
import threading

PREFIX = "sandboxes-"
LOCK = ".lock"

_lock = threading.Lock()
_root: pathlib.Path | None = None
_owner_pid: int | None = None  # the process that made _root (a forked child inherits the globals)
_lock_fd: int | None = None


def rmtree(path: pathlib.Path) -> None:
    """Removes a tree whose dirs a sandbox may have made unwritable."""

    def unlock(func, p, _):
        os.chmod(os.path.dirname(p), 0o700)
        func(p)

    shutil.rmtree(path, onerror=unlock)


def get() -> pathlib.Path:
    """This process's root, mode 0711, made on first use (after removing abandoned roots). Sandboxed code,
    all running as one uid, can enter its own work dir but cannot list the parent, so the names of other
    live sandboxes' work dirs cannot be found. Its empty `.root` is where each run mounts its own root at
    the mount level."""
    global _root, _owner_pid, _lock_fd
    with _lock:
        if _owner_pid == os.getpid() and _root is not None and _root.exists():
            return _root
        # A forked child's copy of its parent's lock (the parent's lock stays: it holds the same open file),
        # or the lock of a root removed from under this process.
        if _lock_fd is not None:
            os.close(_lock_fd)
        remove_abandoned()
        root = pathlib.Path(tempfile.mkdtemp(prefix=PREFIX)).resolve()
        os.chmod(root, 0o711)
        (root / ".root").mkdir(mode=0o755)
        fd, held = tempfile.mkstemp(prefix=".lock-", dir=root)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(held, root / LOCK)
        _root, _owner_pid, _lock_fd = root, os.getpid(), fd
        return root


def remove() -> None:
    """Removes this process's root now (exit handlers and `envs.pool` workers call it); the next `get`
    makes a new one."""
    global _root, _lock_fd
    with _lock:
        if _root is None or _owner_pid != os.getpid():
            return
        with contextlib.suppress(OSError):
            rmtree(_root)
        if _lock_fd is not None:
            os.close(_lock_fd)
        _root, _lock_fd = None, None


atexit.register(remove)  # a no-op in a process that made no root (a forked child inherits the registration)


def remove_abandoned(parent: str | None = None) -> list[pathlib.Path]:
    """Removes the roots under `parent` (the temp dir) whose process is gone; returns them."""
    removed = []
    uid = os.getuid()
    for path in pathlib.Path(parent or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            if path.is_symlink() or path.stat().st_uid != uid:
                continue
            fd = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # no lock: a root made before locks, or one already removed
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            rmtree(path)
        except OSError:  # the lock is held (its process is alive), or the tree could not all be removed
            continue
        else:
            removed.append(path)
        finally:
            os.close(fd)
    return removed
