"""envs.domains.debug slow verifiers: seeded heavy-tailed delays in the task, slept in `score`."""

import math
import statistics
import time

import pytest

from envs import registry
from envs.domains import debug


def test_no_delay_by_default(monkeypatch):
    monkeypatch.delenv(debug.DELAY_ENV_VAR, raising=False)
    (task,) = registry.make("debug").sample_tasks(seed=3, n=1)
    assert "delay_s" not in task.metadata


def test_delays_are_seeded_and_heavy_tailed():
    env = debug.DebugEnvironment(delay_median_s=0.05)
    delays = [t.metadata["delay_s"] for t in env.sample_tasks(seed=1, n=20_000)]
    assert delays[:50] == [t.metadata["delay_s"] for t in env.sample_tasks(seed=1, n=50)]
    assert delays[:50] != [t.metadata["delay_s"] for t in env.sample_tasks(seed=2, n=50)]
    # Lognormal(ln 0.05, ln 20 / z_0.99): median 50 ms, p99 1 s, mean 0.05 * exp(sigma^2 / 2) = 115 ms.
    # Standard errors of 20k draws: ~1.1% on the median, ~3.4% on the p99, ~1.5% on the mean; the bounds are
    # 4-7 of them (the draws are seeded, so this is a fixed sample, not a flaky one).
    ranked = sorted(delays)
    assert statistics.median(ranked) == pytest.approx(0.05, rel=0.05)
    assert ranked[int(0.99 * len(ranked))] == pytest.approx(1.0, rel=0.2)
    assert statistics.mean(ranked) == pytest.approx(0.05 * math.exp(debug.DELAY_SIGMA**2 / 2), rel=0.1)


def test_env_var_is_read_at_construction(monkeypatch):
    monkeypatch.setenv(debug.DELAY_ENV_VAR, "0.02")
    env = registry.make("debug")
    monkeypatch.setenv(debug.DELAY_ENV_VAR, "0")
    (task,) = env.sample_tasks(seed=5, n=1)
    assert (
        task.metadata["delay_s"]
        == debug.DebugEnvironment(0.02).sample_tasks(seed=5, n=1)[0].metadata["delay_s"]
    )
    with pytest.raises(ValueError, match="must be >= 0"):
        debug.DebugEnvironment(delay_median_s=-1.0)


def test_score_sleeps_the_task_delay_and_scores_the_same():
    env = debug.DebugEnvironment()
    (task,) = debug.DebugEnvironment(delay_median_s=0.05).sample_tasks(seed=0, n=1)
    t0 = time.perf_counter()
    slow = env.score(task, "ok")
    elapsed = time.perf_counter() - t0
    assert elapsed >= task.metadata["delay_s"]
    (plain,) = env.sample_tasks(seed=0, n=1)
    assert (slow.reward, slow.status) == (env.score(plain, "ok").reward, "ok") == (1.0, "ok")
