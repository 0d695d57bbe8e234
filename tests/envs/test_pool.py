"""EnvPool: order, backpressure, timeouts, crash recovery, JAX-free workers, clean shutdown (debug domain)."""

import math
import multiprocessing
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from envs.base import Score, Task
from envs.pool import EnvPool

TIMEOUT_S = 1.0  # per-call timeout in these tests; "sleep:30" is far past it


def _task(i: int = 0) -> Task:
    return Task(id=f"t{i}", domain="debug", prompt="Reply with: ok")


def _descendants() -> set[int]:
    """Processes below this one (children, grandchildren: the forkserver's workers), zombies included."""
    parents: dict[int, int] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


@pytest.fixture
def pool():
    with EnvPool(2, domains=["debug"], timeout_s=TIMEOUT_S, term_grace_s=0.3) as p:
        yield p


def test_order_preserved_over_many_calls(pool):
    completions = ["ok" if i % 3 else "wrong" for i in range(200)]
    scores = pool.score_many([(_task(i), c) for i, c in enumerate(completions)])
    assert [s.details["task_id"] for s in scores] == [f"t{i}" for i in range(200)]
    assert [s.status for s in scores] == completions
    assert [s.reward for s in scores] == [1.0 if c == "ok" else 0.0 for c in completions]
    stats = pool.stats()
    assert stats["calls"] == 200 and stats["statuses"] == {"ok": 133, "wrong": 67}
    assert stats["crashes"] == stats["timeouts"] == stats["restarts"] == 0
    for key in ("latency_p50_ms", "latency_p99_ms", "overhead_p50_ms", "overhead_p99_ms"):
        assert math.isfinite(stats[key]), key
    assert 0 <= stats["latency_p50_ms"] <= stats["latency_p99_ms"]
    assert stats["overhead_p50_ms"] <= stats["overhead_p99_ms"]


def test_workers_are_jax_free_and_prewarmed(pool):
    info = pool.worker_info()
    assert len(info) == 2
    assert all(w["jax_loaded"] is False and w["domains"] == ["debug"] for w in info)
    assert len({w["pid"] for w in info}) == 2


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_pool_works_after_jax_initialised_in_this_process(start_method):
    jax = pytest.importorskip("jax")
    jax.numpy.ones(3).sum().block_until_ready()  # a live backend (threads and all) in the parent
    with EnvPool(1, domains=["debug"], timeout_s=TIMEOUT_S, start_method=start_method) as p:
        assert p.score_many([(_task(), "ok")]) == [Score(1.0, "ok", {"task_id": "t0"})]
        assert p.worker_info()[0]["jax_loaded"] is False


def test_trainer_like_script_jax_free_workers_and_cleanup_at_exit(tmp_path):
    """Spawn and forkserver children re-run the parent's __main__, and a trainer's main imports JAX. A pool
    never closed is closed at exit."""
    pytest.importorskip("jax")
    script = tmp_path / "trainer_like.py"
    script.write_text(
        textwrap.dedent(
            """
            import jax
            from envs.base import Task
            from envs.pool import EnvPool

            if __name__ == "__main__":
                jax.numpy.zeros(1).block_until_ready()
                with EnvPool(1, domains=["debug"], timeout_s=5.0) as pool:
                    score, = pool.score_many([(Task("t", "debug", "p"), "ok")])
                    print(score.status, pool.worker_info()[0]["jax_loaded"])
                never_closed = EnvPool(1, domains=["debug"])
                print(never_closed.worker_info()[0]["pid"])
            """
        )
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(pathlib.Path(__file__).parents[2])}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    status, jax_loaded, pid = run.stdout.split()
    assert (status, jax_loaded) == ("ok", "False")
    assert not pathlib.Path(f"/proc/{pid}").exists()


def test_backpressure_submit_blocks_when_workers_and_queue_are_full():
    with EnvPool(1, domains=["debug"], max_inflight_per_worker=1, timeout_s=5.0) as p:
        start = time.monotonic()
        futures = [p.submit("score", _task(i), "sleep:0.4") for i in range(2)]  # in the worker; queued
        assert time.monotonic() - start < 0.3
        futures.append(p.submit("score", _task(2), "ok"))  # waits for a free slot: the first call to end
        assert time.monotonic() - start >= 0.3
        assert [f.result().status for f in futures] == ["ok"] * 3
        assert p.stats()["max_outstanding"] == 1


def test_outstanding_work_in_workers_is_bounded(pool):
    scores = pool.score_many([(_task(i), "sleep:0.1") for i in range(8)])
    assert [s.status for s in scores] == ["ok"] * 8
    assert pool.stats()["max_outstanding"] == 2 * 2  # reached, never exceeded
    assert pool.stats()["outstanding"] == 0


def test_timeout_replaces_worker_and_pool_keeps_serving():
    with EnvPool(1, domains=["debug"], timeout_s=TIMEOUT_S, term_grace_s=0.3) as p:
        pid = p.worker_info()[0]["pid"]
        start = time.monotonic()
        hung = p.submit("score", _task(0), "sleep:30")
        behind = p.submit("score", _task(1), "ok")  # queued in the same worker: retried, not lost
        score = hung.result()
        assert score.status == "timeout" and score.reward == 0.0
        assert score.details["worker_pid"] == pid and score.details["timeout_s"] == TIMEOUT_S
        assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 3
        assert behind.result().status == "ok"
        assert p.score_many([(_task(2), "ok")])[0].status == "ok"
        assert p.worker_info()[0]["pid"] != pid
        stats = p.stats()
        assert (stats["timeouts"], stats["restarts"], stats["retries"], stats["crashes"]) == (1, 1, 1, 0)


def test_sigterm_ignored_escalates_to_sigkill(pool):
    score = pool.score_many([(_task(), "stubborn:30")])[0]
    assert score.status == "timeout" and score.details["exitcode"] == -9
    assert pool.score_many([(_task(), "ok")])[0].status == "ok"


@pytest.mark.parametrize("completion,exitcode", [("crash", 1), ("segv", -11)])
def test_crash_is_retried_once_then_reported(pool, completion, exitcode):
    scores = pool.score_many([(_task(0), "ok"), (_task(1), completion), (_task(2), "ok")])
    assert [s.status for s in scores] == ["ok", "crash", "ok"]
    assert scores[1].details["attempts"] == 2 and scores[1].details["exitcode"] == exitcode
    stats = pool.stats()
    assert stats["crashes"] == stats["restarts"] == 2 and stats["retries"] >= 1
    assert pool.score_many([(_task(3), "ok")] * 4)[0].status == "ok"


def test_flaky_crash_succeeds_on_retry(pool, tmp_path):
    marker = tmp_path / "crashed-once"
    assert pool.score_many([(_task(), f"flaky:{marker}")])[0].status == "ok"
    assert marker.exists()
    stats = pool.stats()
    assert (stats["crashes"], stats["restarts"], stats["retries"]) == (1, 1, 1)


def test_exception_in_environment_is_env_error_not_crash(pool):
    score = pool.score_many([(_task(), "raise")])[0]
    assert score.status == "env_error" and score.reward == 0.0
    assert "RuntimeError: debug environment raised" in score.details["error"]
    assert pool.stats()["restarts"] == 0


def test_run_episodes(pool):
    results = pool.run_episodes([(_task(0), ["ok", "ignored"]), (_task(1), ["wrong"]), (_task(2), ["raise"])])
    (episode, score), (_, wrong), (_, error) = results
    assert score.status == "ok" and episode["done"] and episode["turns"] == 1
    assert episode["transcript"] == [{"action": "ok", "observation": ""}]
    assert (wrong.status, error.status) == ("wrong", "env_error")


def test_bad_requests_are_refused():
    with pytest.raises(RuntimeError, match="failed to make its environments"):
        EnvPool(1, domains={"debug": {"no_such_argument": 1}})
    with EnvPool(1, domains=["debug"]) as p:
        with pytest.raises(KeyError):
            p.submit("score", Task("t", "math", "p"), "1")
        with pytest.raises(ValueError):
            p.submit("nonsense", _task(), "ok")
    with pytest.raises(RuntimeError, match="closed"):
        p.submit("score", _task(), "ok")
    with pytest.raises(ValueError, match="fork"):
        EnvPool(1, domains=["debug"], start_method="fork")


def test_close_leaves_no_process_behind():
    before = _descendants()
    p = EnvPool(2, domains=["debug"], timeout_s=TIMEOUT_S, term_grace_s=0.3)
    pids = {w["pid"] for w in p.worker_info()}
    assert pids <= _descendants() - before
    p.submit("score", _task(), "sleep:30")  # closing does not wait for a hung call
    p.score_many([(_task(), "ok")])
    p.close()
    p.close()
    assert _descendants() == before
    assert multiprocessing.active_children() == []
    assert not any(pathlib.Path(f"/proc/{pid}").exists() for pid in pids)
