"""`make_grpo_update(...).compile`: the main job compiles its update before the first step (beside the
engine's warmup, `rl.train._warm_up`); the first real update then compiles none of the executables it
runs (reference and proximal log-probs, the train step at the mini-batch row count), and compiling neither
changes nor donates the state. `rl.batch.empty_batch` has exactly `make_batch`'s entries, shapes and dtypes.
"""

import logging

import jax
import numpy as np

from configs import grpo as grpo_config
from envs import Task
from model import config as model_config
from model import sharding
from rl import batch as batch_lib
from rl import distributed, rollout, train_state
from rl import train_step as ts

B, T = 8, 16


def _cfg():
    cfg = grpo_config.get_config("tiny")
    cfg.rl.loss.kl_kind = "k1"  # the reference log-probs
    cfg.rl.mini_batches = 2  # the proximal log-probs and a train step of B / 2 rows
    cfg.rl.routing_replay = True  # expert_indices, rows on axis 1
    cfg.batch_size, cfg.seq_len = B, T
    cfg.mesh.shape.update({"data": 2, "expert": 2, "tensor": 2})
    return cfg


def _sample(group: int, length: int, reward: float, layers: int, k: int) -> rollout.Sample:
    prompt, tokens = [1, 2, 3], list(range(5, 5 + length))
    return rollout.Sample(
        Task(f"t{group}", "debug", "p"),
        group,
        prompt,
        tokens,
        [1] * length,
        [-1.0] * length,
        [0] * length,
        reward,
        "ok",
        "length",
        "x",
        expert_indices=np.zeros((layers, len(prompt) + length, k), np.int32),
    )


def _compiled(records) -> list[str]:
    return [r.getMessage() for r in records if "Finished XLA compilation of" in r.getMessage()]


def test_empty_batch_matches_make_batch():
    cfg = _cfg()
    layers, k = model_config.layer_counts(cfg.model)[1], cfg.model.moe.top_k
    samples = [_sample(g, 4 + g, float(i), layers, k) for g in range(2) for i in range(2)]
    real, _ = batch_lib.make_batch(
        samples, length_bucket=T, max_len=T, rows=B, routing=True, domains=("debug",)
    )
    empty = batch_lib.empty_batch(B, T, routing=(layers, k), domains=("debug",))
    assert sorted(empty) == sorted(real)
    for key in real:
        assert (empty[key].shape, empty[key].dtype) == (real[key].shape, real[key].dtype), key
    assert not empty["mask_BT"].any() and (empty["domain_B"] == -1).all()  # every row is padding


def test_compiled_update_compiles_nothing_and_keeps_the_state(caplog):
    cfg = _cfg()
    mesh = sharding.make_mesh(cfg.mesh.shape)
    model_def, state = train_state.init_state(cfg, mesh=mesh, seed=0)
    ref_params = jax.tree.map(lambda x: x.copy(), state.params)
    before = jax.tree.map(np.asarray, state.params)
    update = ts.make_grpo_update(cfg, model_def, mesh=mesh)
    layers, k = model_config.layer_counts(cfg.model)[1], cfg.model.moe.top_k
    place = lambda local: distributed.global_batch(
        local, train_state.batch_shardings(cfg, tuple(local), mesh, B), train_state.ROW_AXIS
    )
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        update.compile(state, place(batch_lib.empty_batch(B, T, routing=(layers, k))), ref_params=ref_params)
    compiled = _compiled(caplog.records)
    # the reference and proximal log-probs (`fn`) and the train step of B / 2 rows (`step`)
    assert sum("jit(fn)" in m for m in compiled) == 2, compiled
    assert sum("jit(step)" in m for m in compiled) == 1, compiled
    assert not any(x.is_deleted() for x in jax.tree.leaves(state)), "compile donated the state"
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)

    samples = [_sample(g, 3 + 2 * i, float(i), layers, k) for g in range(4) for i in range(2)]
    batch, _ = batch_lib.make_batch(samples, length_bucket=T, max_len=T, rows=B, routing=True)
    caplog.clear()
    with jax.log_compiles(True):
        state, metrics = update(state, place(batch), ref_params=ref_params)
    late = [m for m in _compiled(caplog.records) if "jit(fn)" in m or "jit(step)" in m]
    assert not late, f"the first update compiled {late}"
    assert metrics["updates"] == 2.0
    moved = max(
        float(np.abs(np.asarray(a) - b).max())
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before))
    )
    assert moved > 0
