"""rl.train_step: one donated, compiled-once step; the gradient follows the advantage; accumulation equals the
full batch; sharded equals one device; routing replay; optimizer schedule and field errors; SFT learns.

The test config differs from configs/grpo.py:tiny in three ways, each for a stated reason:
- lr 1e-2, no warmup: a few steps move log-probs visibly.
- Adam eps 1e-3: Adam's first update is lr * g / (|g| + eps), so two gradients equal in exact arithmetic
  but differing by f32 rounding (~5e-9 on small components) move a parameter by up to lr * 5e-9 / eps. With
  eps = 1e-8 that is a sign flip (2 * lr; 2.7e-4 measured); with eps = 1e-3 the measured difference is
  2.4e-7, an ulp or two of the O(1) parameters, inside the 1e-6 tolerance, while weighting micro-batches
  equally instead of by token count (a 30% gradient error here) moves parameters by 1.4e-2.
- MoE load-balance weight 0: that loss is a product of two batch means, the one term that accumulation
  averages rather than reproduces exactly (see rl/train_step.py); the router z-loss stays on.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model
from configs import grpo as grpo_config
from model import sharding
from rl import grpo, losses, train_state
from rl import train_step as ts

B, T, PROMPT = 8, 16, 6
# Completion lengths: micro-batches of m=2 (rows 0,2,4,6 and 1,3,5,7) hold 16 and 29 trained tokens.
LENS = (3, 10, 5, 8, 1, 9, 7, 2)
ACCUM_ATOL = 1e-6  # see the module docstring (eps)
SHARD_ATOL = 2e-5  # f32 sums over shards add in another order than on one device


def _cfg(**rl):
    cfg = grpo_config.get_config("tiny")
    cfg.rl.optim.update(lr=1e-2, warmup_steps=0, total_steps=100, eps=1e-3)
    cfg.model.moe.load_balance_weight = 0.0
    cfg.rl.update(rl)
    return cfg


def _batch(advantages=None, behaviour_logp_BT=None, seed=1):
    t_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lens_B1 = jnp.asarray(LENS, jnp.int32)[:, None]
    mask_BT = ((t_BT >= PROMPT) & (t_BT < PROMPT + lens_B1)).astype(jnp.float32)
    if behaviour_logp_BT is None:
        behaviour_logp_BT = jnp.full((B, T), -5.5) * mask_BT  # about log(1/256): IS weights near 1
    return {
        "tokens_BT": jax.random.randint(jax.random.key(seed), (B, T), 0, 256, jnp.int32),
        "positions_BT": t_BT,
        "mask_BT": mask_BT,
        "advantages_B": jnp.linspace(-1.0, 1.0, B) if advantages is None else jnp.asarray(advantages),
        "behaviour_logp_BT": behaviour_logp_BT,
    }


def _copy(state):
    return jax.tree.map(lambda x: x.copy(), state)


def _max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)))


@pytest.fixture(scope="module")
def traces():
    """Counts traces of the GRPO loss (it runs once per trace of a step, inside the traced function)."""
    count = {"n": 0}
    original = grpo.loss_from_config

    def counting(*args, **kwargs):
        count["n"] += 1
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo, "loss_from_config", counting)
        yield count


@pytest.fixture(scope="module")
def setup(traces):
    cfg = _cfg()
    model_def, state0 = train_state.init_state(cfg, seed=0)
    # A test of this worker may have built the same step before (the steps are cached per config): start
    # from an empty cache so that the first call here traces, whatever ran before.
    ts.build_step.cache_clear()
    return cfg, model_def, state0, ts.make_train_step(cfg, model_def)


@pytest.fixture(scope="module")
def stepped(setup, traces):
    """(input state, output state, metrics, traces after the first call) of one step on `_batch()`."""
    cfg, _, state0, step = setup
    state_in = _copy(state0)
    state1, metrics = step(state_in, _batch())
    jax.block_until_ready(state1)
    return state_in, state1, metrics, traces["n"]


def test_one_step_changes_params_donates_and_compiles_once(setup, stepped, traces):
    _, _, state0, step = setup
    state_in, state1, metrics, traces_after_first = stepped
    chex.assert_tree_all_finite(metrics)
    assert np.isfinite(float(metrics["loss"]))
    assert int(state1.step) == 1 and int(metrics["step"]) == 0
    assert float(metrics["tokens"]) == sum(LENS)
    assert _max_diff(state0.params, state1.params) > 1e-3
    chex.assert_trees_all_equal_shapes_and_dtypes(state0.params, state1.params)
    assert all(x.is_deleted() for x in jax.tree.leaves(state_in.params)), "the state was not donated"
    assert all(x.is_deleted() for x in jax.tree.leaves(state_in.opt_state))
    for name in ("policy_loss", "clip_fraction", "tis_weight_mean", "moe_loss", "grad_norm", "lr"):
        assert name in metrics, name
    assert float(metrics["moe_loss"]) > 0  # the router z-loss is in the objective
    np.testing.assert_allclose(metrics["advantage_mean"], 0.0, atol=1e-7)
    assert traces_after_first >= 1
    state2, _ = step(_copy(state1), _batch(seed=2))
    assert int(state2.step) == 2
    assert traces["n"] == traces_after_first, "the second call retraced"


def test_advantage_sign_moves_logprobs(setup):
    """Row 0 (advantage +1) gains log-prob, row 1 (advantage -1) loses it; on-policy behaviour log-probs."""
    cfg, model_def, state0, step = setup
    logprobs = ts.make_logprobs(cfg, model_def)
    batch = _batch()
    seq_logp = lambda params: np.asarray((logprobs(params, batch) * batch["mask_BT"]).sum(axis=1))
    before_B = seq_logp(state0.params)
    batch["behaviour_logp_BT"] = logprobs(state0.params, batch)
    batch["behaviour_logp_BT"] *= batch["mask_BT"]
    batch["advantages_B"] = jnp.zeros((B,)).at[0].set(1.0).at[1].set(-1.0)
    state = _copy(state0)
    for _ in range(3):
        state, metrics = step(state, batch)
    after_B = seq_logp(state.params)
    assert after_B[0] > before_B[0] + 0.5, (before_B, after_B)
    assert after_B[1] < before_B[1] - 0.5, (before_B, after_B)
    # Later steps train on a batch sampled by an older policy: truncated IS weights correct for it.
    assert abs(float(metrics["tis_weight_mean"]) - 1.0) > 1e-3


def test_accumulation_equals_full_batch(setup, stepped):
    cfg, model_def, state0, _ = setup
    _, full, full_metrics, _ = stepped
    cfg2 = _cfg(micro_batches=2)
    accumulated, metrics = ts.make_train_step(cfg2, model_def)(_copy(state0), _batch())
    assert sum(LENS[0::2]) != sum(LENS[1::2])  # unequal token counts: equal weights would be wrong
    assert _max_diff(state0.params, full.params) > 1e-3  # the step moves parameters far beyond tolerance
    assert _max_diff(full.params, accumulated.params) < ACCUM_ATOL
    for name in ("loss", "policy_loss", "moe_loss", "grad_norm", "clip_fraction", "tokens"):
        np.testing.assert_allclose(metrics[name], full_metrics[name], atol=ACCUM_ATOL, err_msg=name)
    with pytest.raises(ValueError, match=r"rl\.micro_batches=3 does not divide the batch of 8 rows"):
        ts.make_train_step(_cfg(micro_batches=3), model_def)(_copy(state0), _batch())
    with pytest.raises(ValueError, match=r"rl\.micro_batches=0"):
        ts.make_train_step(_cfg(micro_batches=0), model_def)


def test_logit_window_equals_full_logits(setup, stepped):
    """With rl.max_new_tokens = 10 (the longest completion here) the forwards compute logits for 10
    positions per row instead of 16: the same step, metrics and log-probs as every position's logits."""
    _, model_def, state0, _ = setup
    _, full, full_metrics, _ = stepped
    assert losses.logit_window(_cfg(), T) == 0  # tiny's max_new_tokens 32: no shorter window at T = 16
    assert (
        losses.logit_window(_cfg(max_new_tokens=10, max_turns=2), T) == 0
    )  # multi-turn rows: every position
    cfg = _cfg(max_new_tokens=10)
    assert losses.logit_window(cfg, T) == 10 == max(LENS)
    windowed, metrics = ts.make_train_step(cfg, model_def)(_copy(state0), _batch())
    assert _max_diff(full.params, windowed.params) < ACCUM_ATOL
    for name in ("loss", "policy_loss", "moe_loss", "grad_norm", "clip_fraction", "tokens"):
        np.testing.assert_allclose(metrics[name], full_metrics[name], atol=ACCUM_ATOL, err_msg=name)
    for processed in (True, False):
        want = ts.make_logprobs(_cfg(), model_def, processed=processed)(state0.params, _batch())
        got = ts.make_logprobs(cfg, model_def, processed=processed)(state0.params, _batch())
        mask = np.asarray(_batch()["mask_BT"])
        np.testing.assert_allclose(np.asarray(got) * mask, np.asarray(want) * mask, atol=1e-5)


def test_sharded_equals_single_device(stepped):
    _, single, single_metrics, _ = stepped
    cfg = _cfg()
    cfg.mesh.shape.update({"data": 2, "expert": 2, "tensor": 2})
    mesh = sharding.make_mesh(cfg.mesh.shape)
    model_def, state = train_state.init_state(cfg, mesh=mesh, seed=0)
    expected = sharding.state_shardings(state.params, mesh, cfg.mesh.rules)
    state1, metrics = ts.make_train_step(cfg, model_def, mesh=mesh)(state, _batch())
    assert _max_diff(single.params, state1.params) < SHARD_ATOL
    np.testing.assert_allclose(metrics["loss"], single_metrics["loss"], atol=SHARD_ATOL)
    got = jax.tree.map(lambda x: x.sharding, state1.params)
    assert jax.tree.leaves(got) == jax.tree.leaves(expected)
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(expected))
    mu = state1.opt_state[1][0].mu  # chain(clip, adamw): adamw's ScaleByAdamState holds the moments
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, mu)) == jax.tree.leaves(expected)


def test_routing_replay(setup):
    cfg, model_def, state0, _ = setup
    replay_cfg = _cfg(routing_replay=True)
    indices = lambda c: jax.jit(lambda p, b: losses.policy_forward(c, model_def, p, b)[1]["expert_indices"])
    replayed, free = indices(replay_cfg), indices(cfg)
    batch = _batch()
    sampled_LBTk = free(state0.params, batch)  # the sampler's routing
    chex.assert_shape(sampled_LBTk, (2, B, T, 2))
    noise = lambda path, x: (
        x + jax.random.normal(jax.random.key(3), x.shape) if "router" in jax.tree_util.keystr(path) else x
    )
    perturbed = jax.tree_util.tree_map_with_path(noise, state0.params)  # the trainer's policy moved on
    replay_batch = {**batch, "expert_indices": sampled_LBTk}
    np.testing.assert_array_equal(replayed(perturbed, replay_batch), sampled_LBTk)
    assert np.any(np.asarray(free(perturbed, replay_batch)) != np.asarray(sampled_LBTk))
    with pytest.raises(ValueError, match=r"rl\.routing_replay"):
        ts.make_train_step(replay_cfg, model_def)(_copy(state0), batch)
    with pytest.raises(ValueError, match=r"rl\.routing_replay"):
        losses.policy_forward(replay_cfg, model_def, state0.params, batch)


def test_schedule_values_and_optim_errors(stepped):
    o = _cfg().rl.optim
    o.update(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    schedule = train_state.make_schedule(o)
    # step 0: lr * 1/10; warmup end (steps 9 and 10): lr; step 60, half-way through the cosine:
    # 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + cos(pi/2)) = 5.5e-4; total_steps and after: min_lr_ratio * lr.
    for s, want in ((0, 1e-4), (9, 1e-3), (10, 1e-3), (60, 5.5e-4), (110, 1e-4), (500, 1e-4)):
        np.testing.assert_allclose(schedule(s), want, rtol=1e-6, err_msg=f"step {s}")
    np.testing.assert_allclose(stepped[2]["lr"], 1e-2, rtol=1e-6)  # the lr the first step used
    bad = {
        "warmup_steps": (-1, r"rl\.optim\.warmup_steps=-1 must be >= 0"),
        "lr": (0.0, r"rl\.optim\.lr=0\.0 must be > 0"),
        "b2": (1.0, r"rl\.optim\.b2=1\.0"),
        "eps": (0.0, r"rl\.optim\.eps=0\.0"),
        "weight_decay": (-0.1, r"rl\.optim\.weight_decay=-0\.1"),
        "total_steps": (10, r"rl\.optim\.total_steps=10 must be > rl\.optim\.warmup_steps=10"),
        "min_lr_ratio": (1.5, r"rl\.optim\.min_lr_ratio=1\.5"),
        "max_grad_norm": (0.0, r"rl\.optim\.max_grad_norm=0\.0"),
    }
    for field, (value, pattern) in bad.items():
        broken = _cfg().rl.optim
        broken.update(warmup_steps=10, total_steps=110)
        broken[field] = value
        with pytest.raises(ValueError, match=pattern):
            train_state.make_optimizer(broken)


def test_sft_step_lowers_masked_cross_entropy(setup):
    cfg, model_def, state0, _ = setup
    step = ts.make_sft_step(cfg, model_def)
    batch = {k: _batch()[k] for k in train_state.SFT_KEYS}
    logits_BTV, _ = model_def.merge(state0.params)(batch["tokens_BT"], batch["positions_BT"])
    ce0 = model.next_token_loss(logits_BTV, batch["tokens_BT"], batch["mask_BT"])
    state, ces = _copy(state0), []
    for _ in range(5):
        state, metrics = step(state, batch)
        ces.append(float(metrics["cross_entropy"]))  # of the params before this update
    np.testing.assert_allclose(ces[0], ce0, rtol=1e-5)
    assert all(b < a for a, b in zip(ces, ces[1:])), ces
    assert ces[-1] < ces[0] - 0.5, ces
    assert int(state.step) == 5
    assert isinstance(state.params, nnx.State)


def test_config_variants():
    tiny, small = grpo_config.get_config("tiny"), grpo_config.get_config("small")
    assert small.model.vocab_size == 8192 and small.rl.optim.lr == 1e-5
    for cfg in (tiny, small):
        grpo.validate_loss_config(cfg.rl.loss)
        train_state.make_optimizer(cfg.rl.optim)
        assert cfg.batch_size == cfg.rl.prompts_per_step * cfg.rl.group_size
    with pytest.raises(ValueError, match="configs/grpo.py: unknown argument 'huge'"):
        grpo_config.get_config("huge")
