"""envs.sandbox.workroot: a process's private root of sandbox work dirs goes when the process goes, by
whatever way it goes (normal exit, a pool worker's os._exit, kill -9), and never while its process lives,
nor when a forked child of it exits. Every process here runs with TMPDIR in the test's own dir, so other
tests' roots are never in view."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from envs.sandbox import workroot

ROOT = pathlib.Path(__file__).parents[2]

HOLDER = textwrap.dedent(
    """
    import os, sys
    from envs.sandbox import workroot
    from envs.sandbox.box import Sandbox
    box = Sandbox()
    pid = os.fork()
    if pid == 0:  # a forked child that makes its own root and exits normally (its exit handlers run)
        print(workroot.get(), flush=True)
        sys.exit(0)
    os.waitpid(pid, 0)
    print(box.workdir if box.workdir.exists() else "removed", flush=True)
    sys.stdin.read()  # holds the root until the test closes stdin or kills it
    """
)


def _roots(tmp: pathlib.Path) -> set[pathlib.Path]:
    return set(tmp.glob(workroot.PREFIX + "*"))


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
    assert workroot.remove_abandoned(str(tmp_path)) == []  # both holders alive: nothing taken

    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed_root.exists()  # no exit handler ran
    assert workroot.remove_abandoned(str(tmp_path)) == [killed_root]
    assert _roots(tmp_path) == {alive_root} and (alive_root / workroot.LOCK).exists()

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
    from envs.base import Task
    from envs.pool import EnvPool

    def roots():
        return " ".join(sorted(glob.glob(os.path.join(tempfile.gettempdir(), "sandboxes-*"))))

    if __name__ == "__main__":
        # forkserver workers, as in rl.train; each makes the code domain, whose zygote makes its root. The
        # default SIGTERM grace (1 s): with 0.3 s a loaded suite once SIGKILLed a worker still cleaning up.
        with EnvPool(1, domains=["code", "debug"], timeout_s=1.0) as pool:
            print(roots(), flush=True)
            for hang in ("sleep:30", "stubborn:30"):  # past the timeout: SIGTERM; ignored: SIGKILL
                score = pool.score_many([(Task("t", "debug", "Reply with: ok"), hang)])[0]
                assert pool.score_many([(Task("u", "debug", "Reply with: ok"), "ok")])[0].status == "ok"
                print(score.status, score.details["exitcode"], roots(), flush=True)
    """
)


def test_pool_workers_leave_no_root_however_they_end(open_tmp):
    """Forkserver workers end through os._exit: multiprocessing's at a clean close, the pool's SIGTERM
    handler's past a timeout; neither runs exit handlers. A worker that ignores SIGTERM is killed outright,
    and its replacement removes its root when it makes its own."""
    script = open_tmp / "pool_script.py"
    script.write_text(POOL)
    env = {**os.environ, "TMPDIR": str(open_tmp), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    first, after_term, after_kill = run.stdout.splitlines()
    (first_root,) = [pathlib.Path(r) for r in first.split()]  # the first worker's, in this TMPDIR
    assert first_root.parent == open_tmp
    status, exitcode, *term_roots = after_term.split()
    assert (status, exitcode) == ("timeout", str(128 + signal.SIGTERM))
    # The replacement's root alone: the terminated worker removed its own.
    assert len(term_roots) == 1 and term_roots[0] != str(first_root)
    status, exitcode, *kill_roots = after_kill.split()
    assert (status, exitcode) == ("timeout", str(-signal.SIGKILL))
    # The replacement's root alone: it removed the killed worker's when it made its own.
    assert len(kill_roots) == 1 and kill_roots[0] != term_roots[0]
    assert _roots(open_tmp) == set()  # and the last worker's at the pool's close


def _abandoned_looking(path: pathlib.Path) -> pathlib.Path:
    """A dir with a lock file nobody holds: what a killed process leaves."""
    path.mkdir()
    (path / workroot.LOCK).touch()
    return path


def test_a_symlink_or_a_dir_without_a_lock_is_never_removed(tmp_path):
    """A dir named like a root but without a lock (a root being made) and a symlink named like a root,
    even to a dir with a free lock."""
    unlocked = tmp_path / (workroot.PREFIX + "unlocked")
    unlocked.mkdir()
    target = _abandoned_looking(tmp_path / "elsewhere")
    (tmp_path / (workroot.PREFIX + "link")).symlink_to(target)
    assert workroot.remove_abandoned(str(tmp_path)) == []
    assert unlocked.exists() and (target / workroot.LOCK).exists()
    mine = _abandoned_looking(tmp_path / (workroot.PREFIX + "mine"))
    assert workroot.remove_abandoned(str(tmp_path)) == [mine]


@pytest.mark.skipif(os.getuid() != 0, reason="making a dir of another uid needs root")
def test_a_dir_of_another_uid_is_never_removed(tmp_path):
    """Sandboxed code runs as nobody; at the levels that show the host's /tmp it could plant a dir named
    like an abandoned root there. The host never removes it."""
    planted = _abandoned_looking(tmp_path / (workroot.PREFIX + "planted"))
    os.chown(planted, 65534, 65534)
    assert workroot.remove_abandoned(str(tmp_path)) == []
    assert (planted / workroot.LOCK).exists()
