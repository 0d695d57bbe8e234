"""envs.sandbox_root: a process's private root of sandbox work dirs goes when the process goes, by whatever
way it goes (normal exit, a pool worker's os._exit, kill -9), and never while its process lives, nor when a
forked child of it exits. Every process here runs with TMPDIR in the test's own dir, so other tests' roots
are never in view."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from envs import sandbox_root

ROOT = pathlib.Path(__file__).parent.parent

HOLDER = textwrap.dedent(
    """
    import os, sys
    from envs import sandbox_root
    from envs.sandbox import Sandbox
    box = Sandbox()
    pid = os.fork()
    if pid == 0:  # a forked child that makes its own root and exits normally (its exit handlers run)
        print(sandbox_root.get(), flush=True)
        sys.exit(0)
    os.waitpid(pid, 0)
    print(box.workdir if box.workdir.exists() else "removed", flush=True)
    sys.stdin.read()  # holds the root until the test closes stdin or kills it
    """
)


def _roots(tmp: pathlib.Path) -> set[pathlib.Path]:
    return set(tmp.glob(sandbox_root.PREFIX + "*"))


def _start_holder(tmp: pathlib.Path) -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child_root, workdir = proc.stdout.readline().strip(), proc.stdout.readline().strip()
    # The child's exit left its parent's Sandbox (and root) alone: the work dir is there.
    assert workdir != "removed"
    return proc, pathlib.Path(workdir).parent, pathlib.Path(child_root)


def test_roots_of_live_processes_stay_and_a_killed_ones_root_is_removed(tmp_path):
    killed, killed_root, killed_child_root = _start_holder(tmp_path)
    alive, alive_root, _ = _start_holder(tmp_path)
    # The forked child's exit removed its own root, not the one its parent made before the fork.
    assert not killed_child_root.exists() and killed_child_root.parent == tmp_path
    assert _roots(tmp_path) == {killed_root, alive_root}
    assert sandbox_root.remove_abandoned(str(tmp_path)) == []  # both holders alive: nothing taken

    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed_root.exists()  # no exit handler ran
    assert sandbox_root.remove_abandoned(str(tmp_path)) == [killed_root]
    assert _roots(tmp_path) == {alive_root} and (alive_root / sandbox_root.LOCK).exists()

    alive.stdin.close()  # a normal exit removes the root
    assert alive.wait(timeout=30) == 0
    assert _roots(tmp_path) == set()


@pytest.fixture
def open_tmp():
    """A temp dir the sandboxes' user namespaces can pass through (pytest's tmp_path is under a 0700 dir)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="sandbox-root-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


POOL = textwrap.dedent(
    """
    import glob, os, tempfile
    from envs.pool import EnvPool

    if __name__ == "__main__":
        with EnvPool(1, domains=["code"], timeout_s=60.0) as pool:  # forkserver workers, as in rl.train
            print(*glob.glob(os.path.join(tempfile.gettempdir(), "sandboxes-*")), flush=True)
            print(pool.worker_info()[0]["pid"], flush=True)
    """
)


def test_a_pool_worker_removes_its_root_when_it_ends(open_tmp):
    """Forkserver workers end through os._exit (multiprocessing's), which runs no exit handlers."""
    script = open_tmp / "pool_script.py"
    script.write_text(POOL)
    env = {**os.environ, "TMPDIR": str(open_tmp), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    roots, pid = run.stdout.splitlines()
    # The code domain started its zygote in the worker: the worker had made its root, in this TMPDIR.
    (root,) = [pathlib.Path(r) for r in roots.split()]
    assert root.parent == open_tmp
    assert not pathlib.Path(f"/proc/{pid}").exists()
    assert not root.exists() and _roots(open_tmp) == set()


def _abandoned_looking(path: pathlib.Path) -> pathlib.Path:
    """A dir with a lock file nobody holds: what a killed process leaves."""
    path.mkdir()
    (path / sandbox_root.LOCK).touch()
    return path


def test_a_symlink_or_a_dir_without_a_lock_is_never_removed(tmp_path):
    """A dir named like a root but without a lock (a root being made) and a symlink named like a root,
    even to a dir with a free lock."""
    unlocked = tmp_path / (sandbox_root.PREFIX + "unlocked")
    unlocked.mkdir()
    target = _abandoned_looking(tmp_path / "elsewhere")
    (tmp_path / (sandbox_root.PREFIX + "link")).symlink_to(target)
    assert sandbox_root.remove_abandoned(str(tmp_path)) == []
    assert unlocked.exists() and (target / sandbox_root.LOCK).exists()
    assert sandbox_root.remove_abandoned(str(tmp_path)) == []
    mine = _abandoned_looking(tmp_path / (sandbox_root.PREFIX + "mine"))
    assert sandbox_root.remove_abandoned(str(tmp_path)) == [mine]


@pytest.mark.skipif(os.getuid() != 0, reason="making a dir of another uid needs root")
def test_a_dir_of_another_uid_is_never_removed(tmp_path):
    """Sandboxed code runs as nobody; at the levels that show the host's /tmp it could plant a dir named
    like an abandoned root there. The host never removes it."""
    planted = _abandoned_looking(tmp_path / (sandbox_root.PREFIX + "planted"))
    os.chown(planted, 65534, 65534)
    assert sandbox_root.remove_abandoned(str(tmp_path)) == []
    assert (planted / sandbox_root.LOCK).exists()
