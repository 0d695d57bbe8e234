"""What a run at the "mount" level sees: one mount plan, carried out by either backend.

A plan is a list of operations, each a JSON list, applied in order under an empty read-only root:

    ["ro", path]            the host's `path`, read-only, at the same place
    ["ro", path, at]        the host's `path`, read-only, at `at` (/etc: a copy of the entries in `ETC`)
    ["link", target, path]  a symlink (merged-/usr systems: /bin -> usr/bin)
    ["dev"]                 a minimal /dev: null zero full random urandom tty, fd links, its own devpts
    ["proc"]                a fresh /proc of the run's PID namespace
    ["tmpfs", path, bytes]  a fresh, empty tmpfs of that size, mode 1777
    ["hide", path]          an empty read-only tmpfs over `path` (a private place under a read-only dir)
    ["rw", path]            the host's `path`, writable (the work dir)

`envs.sandbox.mounts` mounts the plan itself (own backend); `bwrap_argv` turns it into bubblewrap options.
From the host, a run sees /usr (and the /bin, /lib... links or dirs), a copy of the /etc entries in `ETC`
(made once per process by `stage_etc`: one mount instead of one per entry), and its
work dir; nothing else of the host's filesystem: no /home, /root, /opt, /srv, /var, /run, /mnt, no other
work dir, and not this project unless it lies under /usr (then it is hidden).
"""

from __future__ import annotations

import fnmatch
import os
import pathlib
import subprocess

SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# /etc entries programs need (dynamic loader, users and groups for `id`/`ls -l`, alternatives symlinks, locale
# and time zone, MIME and magic tables, TLS roots, terminfo); host identity and secrets are not among them.
ETC = (
    "alternatives", "bash.bashrc", "ca-certificates", "debian_version", "gai.conf", "group", "host.conf",
    "hosts", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "locale.alias", "localtime", "magic",
    "magic.mime", "mime.types", "nsswitch.conf", "os-release", "passwd", "perl", "profile", "protocols",
    "python3*", "services", "shells", "ssl", "terminfo", "timezone",
)  # fmt: skip
NETWORK_ETC = ("resolv.conf",)  # only for Sandbox(network=True)
TMPFS = ("/tmp", "/var/tmp", "/dev/shm")


def _place(path: str) -> list:
    """An op that shows the host's `path` as it is: a symlink as the same symlink, else read-only."""
    return ["link", os.readlink(path), path] if os.path.islink(path) else ["ro", path]


def stage_etc(target: pathlib.Path, network: bool) -> None:
    """Copies the /etc entries a run may see into the empty directory `target` (modes, owners and
    symlinks kept: what the sandboxed uid could not read on the host it cannot read in the copy; what this
    user cannot read, e.g. /etc/ssl/private when not root, is left out)."""
    patterns = ETC + (NETWORK_ETC if network else ())
    names = sorted(n for n in os.listdir("/etc") if any(fnmatch.fnmatch(n, p) for p in patterns))
    if names:
        argv = ["cp", "-a", "--", *names, str(target)]
        done = subprocess.run(argv, cwd="/etc", capture_output=True, text=True)
        errors = [line for line in done.stderr.splitlines() if "Permission denied" not in line]
        if done.returncode and errors:  # what this user may not read stays out of the copy, nothing else
            raise OSError(f"copying /etc entries for the sandbox failed: {'; '.join(errors)}")
    os.chmod(target, 0o755)


def system_ops(etc: str) -> list[list]:
    """/usr and the top-level links or dirs beside it, and the staged copy of /etc at /etc."""
    return [_place(f"/{name}") for name in SYSTEM if os.path.lexists(f"/{name}")] + [["ro", etc, "/etc"]]


def private_paths() -> list[str]:
    """Host places a run must never see: this project, the host user's home, /root, /home."""
    project = pathlib.Path(__file__).resolve().parents[2]  # envs/sandbox/plan.py in the project
    return sorted({str(project), os.path.expanduser("~"), "/root", "/home"})


def base_ops(tmp_bytes: int, etc: str, private: list[str]) -> list[list]:
    """The plan but the work dir: the same for every run with these tmpfs sizes and this /etc, so the own
    backend makes it ahead of the run (`envs.sandbox.child`) and adds the work dir when the run comes."""
    ops = system_ops(etc)
    shown = [op[1] for op in ops if op[0] == "ro" and len(op) == 2 and os.path.isdir(op[1])]
    ops += [["dev"], ["proc"], *(["tmpfs", path, tmp_bytes] for path in TMPFS)]
    ops += [["hide", p] for p in private if any(p.startswith(s + "/") for s in shown) and os.path.isdir(p)]
    return ops


def mount_ops(workdir: str, tmp_bytes: int, etc: str, private: list[str]) -> list[list]:
    """The whole plan of one run: `base_ops`, then its work dir."""
    return [*base_ops(tmp_bytes, etc, private), ["rw", workdir]]


def bwrap_argv(ops: list[list], argv: list[str], cwd: str, network: bool, max_procs: int) -> list[str]:
    """The same plan as bubblewrap options; bwrap makes the same namespaces (and forbids new user ones).
    RLIMIT_NPROC is set inside, by bash, so that it counts the run's own user namespace only (set before
    bwrap it would count every process of the uid on the host)."""
    args = ["bwrap", "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session"]
    args += ["--hostname", "sandbox"] + ([] if network else ["--unshare-net"])
    for kind, *rest in ([op[0], *map(str, op[1:])] for op in ops):
        if kind == "ro":
            args += ["--ro-bind", rest[0], rest[-1]]
        elif kind == "rw":
            args += ["--bind", rest[0], rest[0]]
        elif kind == "link":
            args += ["--symlink", *rest]
        elif kind in ("dev", "proc"):
            args += [f"--{kind}", f"/{kind}"]
        elif kind == "tmpfs":
            args += ["--size", rest[1], "--perms", "1777", "--tmpfs", rest[0]]
        else:  # hide
            args += ["--size", "4096", "--perms", "0755", "--tmpfs", rest[0], "--remount-ro", rest[0]]
    shim = ["bash", "-c", 'ulimit -u "$0" && exec "$@"', str(max_procs)]
    return [*args, "--remount-ro", "/", "--chdir", cwd, "--", *shim, *argv]
