"""rl.train, the main job, on the tiny model and the `debug` domain: end to end, and kill -9 resume."""

import json
import os
import signal
import subprocess
import time
from unittest import mock

import main_job
import numpy as np
import pytest
import xla_env

from configs import grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_end_to_end(tmp_path):
    from rl import train, train_step

    cfg = grpo.get_config("test")
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 4
    assert out["engine"]["compiles_after_warmup"] == 0
    assert out["engine"]["policy_version"] == 4  # one weight push per update
    steps = [r for r in _records(tmp_path) if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert np.isfinite(r["train/loss"]) and 0.0 < r["reward"] < 1.0  # groups with a signal
        assert r["weight/debug"] == 1.0 and r["pipeline/staleness"] == 0.0
        assert r["engine/preemptions"] == 0.0 and 0.0 <= r["engine/prefix_hit_rate"] <= 1.0
        assert "engine/host_offloads" not in r  # no host tier in this config
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]  # every 2 steps; max_to_keep 2
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rl"]["domains"] == ["debug"]

    # Started again when finished (as a scheduler may restart a job): it restores step 4 and ends without
    # compiling the update or any engine step.
    make_real = train_step.make_grpo_update

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run compiled the update")

    def make_update(*args, **kwargs):
        update = make_real(*args, **kwargs)
        update.compile = refuse
        return update

    with mock.patch.object(train_step, "make_grpo_update", make_update):
        again = train.train(cfg, str(tmp_path), run_eval=False)
    assert again["steps"] == 4 and again["engine"]["compiles"] == 0
    assert [r["step"] for r in _records(tmp_path) if "train/loss" in r] == [1, 2, 3, 4]


def test_engine_metrics_are_rates_since_the_last_log_line():
    """`rl.step_metrics.engine_metrics` on counters made up by hand: 30 tokens over 20 target forwards, 6 of 8
    drafts accepted, 24 of 64 looked-up prompt tokens from the prefix cache, 1 preemption; the host tier's
    moves only when it is on."""
    from rl import step_metrics

    names = ("generated_tokens", "target_row_forwards", "proposed_tokens", "accepted_tokens", "preemptions")
    names += ("prefix_lookup_tokens", "prefix_hit_tokens", "prefix_offloads", "prefix_reloads")
    before = dict.fromkeys(names, 10.0)
    now = dict(before)
    now.update(
        generated_tokens=40.0,
        target_row_forwards=30.0,
        proposed_tokens=18.0,
        accepted_tokens=16.0,
        preemptions=11.0,
        prefix_lookup_tokens=74.0,
        prefix_hit_tokens=34.0,
        prefix_offloads=13.0,
        prefix_reloads=12.0,
    )
    assert step_metrics.engine_metrics(before, now, host_tier=True) == {
        "engine/tokens_per_target_forward": 1.5,
        "engine/preemptions": 1.0,
        "engine/acceptance_rate": 0.75,
        "engine/prefix_hit_rate": 0.375,
        "engine/host_offloads": 3.0,
        "engine/host_reloads": 2.0,
    }
    # Nothing proposed and nothing looked up: no rate to give; no host tier: no moves.
    assert step_metrics.engine_metrics(before, before, host_tier=False) == {
        "engine/tokens_per_target_forward": 0.0,
        "engine/preemptions": 0.0,
    }


def _final_params(workdir):
    from rl import checkpoint, train_state

    cfg = grpo.get_config("test")
    _, target = train_state.init_state(cfg, seed=cfg.rl.seed)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), save_every=2)
    state, meta = ckpt.restore(target_state=target)
    ckpt.close()
    return state, meta


def test_kill_9_and_restart_resumes_bit_identically(tmp_path):
    """Real processes: an uninterrupted run, and a run killed with SIGKILL right after its step-2
    checkpoint and restarted; sync mode with a fixed seed ends with bit-identical parameters."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_env.child_flags(1),
        JAX_COMPILATION_CACHE_DIR=os.path.join(ROOT, ".jax_cache"),
    )
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(main_job.command(full), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    proc = subprocess.Popen(
        main_job.command(killed), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "2").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run(main_job.command(killed), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    (a, meta_a), (b, meta_b) = _final_params(full), _final_params(killed)
    assert meta_a["step"] == meta_b["step"] == 4
    import jax

    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    restarts = [r for r in _records(killed) if "train/loss" in r]
    assert restarts[-1]["step"] == 4


@pytest.mark.parametrize("bad", ["rl.max_staleness=-1"])
def test_bad_config_names_the_field(tmp_path, bad):
    from rl import train

    cfg = grpo.get_config("test")
    cfg.rl.max_staleness = -1
    cfg.rl.async_rollout = True
    with pytest.raises(ValueError, match=bad):
        train.train(cfg, str(tmp_path), run_eval=False)


def test_async_mode_overlaps_and_bounds_staleness(tmp_path):
    from rl import train

    cfg = grpo.get_config("test")
    cfg.rl.async_rollout, cfg.rl.max_staleness, cfg.rl.max_queue = True, 1, 1
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 4 and out["engine"]["compiles_after_warmup"] == 0
    steps = [r for r in _records(tmp_path) if "pipeline/staleness" in r]
    assert len(steps) == 4 and all(r["pipeline/staleness"] <= 1 for r in steps)
