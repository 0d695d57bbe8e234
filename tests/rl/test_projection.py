"""rl.gradient_projection: PCGrad's coefficients on hand-worked vectors; the per-domain losses add up to the
batch loss (and their gradients to its gradient) for every aggregation; a step whose batch has one domain is
the plain step; two exactly conflicting domains cancel (worked by hand below); one domain is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import grpo as grpo_config
from model.config import ConfigError
from rl import losses, projection, train_state, validate
from rl import train_step as ts

B, T, PROMPT = 8, 16, 6
LENS = (3, 10, 5, 8, 1, 9, 7, 2)
ATOL = 1e-6


def _cfg(**rl):
    cfg = grpo_config.get_config("tiny")
    cfg.rl.optim.update(lr=1e-2, warmup_steps=0, total_steps=100, eps=1e-3)
    cfg.model.moe.load_balance_weight = 0.0
    cfg.rl.domains = ("arith", "strings")
    cfg.rl.update(rl)
    return cfg


def _batch(domain_B, tokens_BT=None, advantages_B=None, lens=LENS):
    t_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lens_B1 = jnp.asarray(lens, jnp.int32)[:, None]
    mask_BT = ((t_BT >= PROMPT) & (t_BT < PROMPT + lens_B1)).astype(jnp.float32)
    if tokens_BT is None:
        tokens_BT = jax.random.randint(jax.random.key(1), (B, T), 0, 256, jnp.int32)
    return {
        "tokens_BT": tokens_BT,
        "positions_BT": t_BT,
        "mask_BT": mask_BT,
        "advantages_B": jnp.linspace(-1.0, 1.0, B) if advantages_B is None else jnp.asarray(advantages_B),
        "behaviour_logp_BT": jnp.full((B, T), -5.5) * mask_BT,
        "domain_B": jnp.asarray(domain_B, jnp.int32),
    }


def _copy(state):
    return jax.tree.map(lambda x: x.copy(), state)


def _max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)))


def _project_vectors(*vectors):
    grads_D = {"w": jnp.asarray(vectors, jnp.float32)}
    update, metrics = projection.project(grads_D, tuple(f"d{i}" for i in range(len(vectors))))
    return np.asarray(update["w"]), {k: float(v) for k, v in metrics.items()}


def test_pcgrad_on_worked_vectors():
    # g1 = (1, 0), g2 = (-1, 1): g1.g2 = -1 < 0.
    #   g1' = g1 - (-1 / |g2|^2 = 2) g2 = (1, 0) + (-1, 1) / 2 = (0.5, 0.5)
    #   g2' = g2 - (-1 / |g1|^2 = 1) g1 = (-1, 1) + (1, 0) = (0, 1)
    update, m = _project_vectors((1.0, 0.0), (-1.0, 1.0))
    np.testing.assert_allclose(update, (0.5, 1.5), atol=1e-7)
    assert m["projection/conflicts"] == 2.0
    np.testing.assert_allclose(m["projection/cosine/d0|d1"], -1 / np.sqrt(2), atol=1e-7)
    # |(0.5, 1.5)| / |(0, 1)| = sqrt(2.5)
    np.testing.assert_allclose(m["projection/kept"], np.sqrt(2.5), atol=1e-6)
    # No conflict (orthogonal or aligned): the plain sum.
    update, m = _project_vectors((1.0, 0.0), (0.0, 2.0))
    np.testing.assert_allclose(update, (1.0, 2.0))
    assert m["projection/conflicts"] == 0.0 and m["projection/kept"] == 1.0
    # A zero gradient (a domain without rows) projects nothing and is projected to nothing.
    update, m = _project_vectors((1.0, 0.0), (0.0, 0.0))
    np.testing.assert_allclose(update, (1.0, 0.0))
    assert m["projection/conflicts"] == 0.0 and m["projection/cosine/d0|d1"] == 0.0
    # Three domains, against the unprojected g_j in ascending j:
    # g1 = (1, 0), g2 = (-1, 1), g3 = (0, -1).
    #   g1': vs g2 dot -1 -> (0.5, 0.5); vs g3: (0.5, 0.5).(0, -1) = -0.5
    #        -> (0.5, 0.5) - 0.5 (0, 1) = (0.5, 0)
    #   g2': vs g1 dot -1 -> (0, 1); vs g3: (0, 1).(0, -1) = -1 -> (0, 0)
    #   g3': vs g1 dot 0; vs g2: (0, -1).(-1, 1) = -1 -> (0, -1) + (-1, 1) / 2 = (-0.5, -0.5)
    #   sum = (0, -0.5); conflicts: 2 (g1) + 2 (g2) + 1 (g3) = 5
    update, m = _project_vectors((1.0, 0.0), (-1.0, 1.0), (0.0, -1.0))
    np.testing.assert_allclose(update, (0.0, -0.5), atol=1e-7)
    assert m["projection/conflicts"] == 5.0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_domain_losses_and_gradients_add_up_to_the_batch(aggregation):
    cfg = _cfg()
    cfg.rl.loss.aggregation = aggregation
    if aggregation == "seq-mean-token-sum-norm":
        cfg.rl.loss.max_tokens = T
    model_def, state = train_state.init_state(cfg, seed=0)
    model_def = train_state.as_model_def(model_def)._replace(rest=state.model_state)
    batch = _batch((0, 1, 1, 0, 1, 0, 0, -1), lens=LENS[:-1] + (0,))  # row 7: padding (no tokens, -1)
    units = lambda mask_MBT: losses.units_M(aggregation, mask_MBT)
    w = 0.7  # a micro-batch's share: carried into every domain's loss

    def full(p):
        return losses.grpo_loss(cfg, model_def, p, batch, w, 1)[0]

    def per_domain(p):
        return losses.grpo_domain_losses(cfg, model_def, p, batch, w, 1, units_fn=units, num_domains=2)[0]

    losses_D = per_domain(state.params)
    # The same 43 per-token terms (each of order w / 43: advantages in [-1, 1], ratios ~1) added in two orders
    # cancel to ~0.027: f32 rounding is relative to the terms, not to that sum (worst case 42 eps w ~ 3.5e-6),
    # so the sums agree to ATOL, as the gradients below; a lost or doubled token moves them by ~1e-2.
    np.testing.assert_allclose(float(losses_D.sum()), float(full(state.params)), rtol=0, atol=ATOL)
    assert abs(float(losses_D[0] - losses_D[1])) > 1e-4  # two different halves, not a copy
    g_full = jax.grad(full)(state.params)
    g_sum = jax.grad(lambda p: per_domain(p).sum())(state.params)
    assert _max_diff(g_full, g_sum) < ATOL


def test_one_domain_batch_is_the_plain_step():
    cfg = _cfg()
    model_def, state0 = train_state.init_state(cfg, seed=0)
    batch = _batch((1,) * B)
    plain, plain_m = ts.make_train_step(cfg, model_def)(_copy(state0), batch)
    cfg_p = _cfg(gradient_projection=True)
    projected, m = ts.make_train_step(cfg_p, model_def)(_copy(state0), batch)
    assert _max_diff(state0.params, plain.params) > 1e-3
    assert _max_diff(plain.params, projected.params) < ATOL
    np.testing.assert_allclose(m["grad_norm"], plain_m["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(m["loss"], plain_m["loss"], rtol=1e-6)
    assert float(m["projection/conflicts"]) == 0.0
    assert float(m["projection/cosine/arith|strings"]) == 0.0  # arith has no rows: a zero gradient


def test_a_domain_without_rows_gets_no_gradient_on_the_demo_model():
    """The demo's MoE model at the demo's batch shape (128 rows x 52 positions, 8 rows of one domain as after
    the filters): the other domain's gradient is exactly 0, so their cosine is exactly 0 (cosine_DD: 0 only
    where a gradient is zero) and nothing is projected. A vmap over the per-domain cotangents failed this (a
    gradient of norm 0.28 for the domain without rows). That such a step is the plain step is
    test_one_domain_batch_is_the_plain_step's check (the plain step at this size would double the compile)."""
    cfg = grpo_config.get_config("demo")
    cfg.rl.domains = ("math", "strings")
    b, t = 128, 52
    model_def, state0 = train_state.init_state(cfg, seed=0)
    t_BT = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    mask_BT = ((t_BT >= 36) & (t_BT < 46) & (np.arange(b) < 8)[:, None]).astype(np.float32)
    rng = np.random.default_rng(0)
    batch = {
        "tokens_BT": rng.integers(0, cfg.model.vocab_size, (b, t)).astype(np.int32),
        "positions_BT": t_BT.copy(),
        "mask_BT": mask_BT,
        "advantages_B": np.where(np.arange(b) < 8, np.linspace(-1.5, 1.5, b), 0.0).astype(np.float32),
        "behaviour_logp_BT": (-3.0 * mask_BT).astype(np.float32),
        "domain_B": np.where(np.arange(b) < 8, 0, -1).astype(np.int32),
    }
    cfg.rl.gradient_projection = True
    projected, m = ts.make_train_step(cfg, model_def)(_copy(state0), batch)
    assert float(m["grad_norm"]) > 0 and _max_diff(state0.params, projected.params) > 0
    assert float(m["projection/cosine/math|strings"]) == 0.0
    assert float(m["projection/conflicts"]) == 0.0 and float(m["projection/kept"]) == 1.0


def test_exactly_conflicting_domains_cancel():
    """Rows 4-7 repeat rows 0-3 (tokens, masks) with advantage -0.5 instead of +1, and the router z-loss is
    off, so domain 1's gradient is exactly -1/2 of domain 0's (token-mean: equal token shares), and
    g0 = G/2, g1 = -G/4 for G the gradient of rows 0-3 at advantage 1.
      plain: g0 + g1 = G/4.
      PCGrad: g0' = g0 - (g0.g1 / |g1|^2) g1 = G/2 + 2 (-G/4) = 0; g1' = g1 - (g1.g0 / |g0|^2) g0
      = -G/4 + G/4 = 0. The update is 0: grad_norm 0, conflicts 2, cosine -1."""
    cfg = _cfg()
    cfg.model.moe.z_loss_weight = 0.0
    model_def, state0 = train_state.init_state(cfg, seed=0)
    half = jax.random.randint(jax.random.key(3), (B // 2, T), 0, 256, jnp.int32)
    advantages = (1.0,) * 4 + (-0.5,) * 4
    batch = _batch((0,) * 4 + (1,) * 4, jnp.concatenate([half, half]), advantages, lens=LENS[:4] * 2)
    _, plain_m = ts.make_train_step(cfg, model_def)(_copy(state0), batch)
    cfg_p = _cfg(gradient_projection=True)
    cfg_p.model.moe.z_loss_weight = 0.0
    _, m = ts.make_train_step(cfg_p, model_def)(_copy(state0), batch)
    assert float(plain_m["grad_norm"]) > 1e-2
    assert float(m["grad_norm"]) < 1e-5 * float(plain_m["grad_norm"])
    assert float(m["projection/conflicts"]) == 2.0
    np.testing.assert_allclose(float(m["projection/cosine/arith|strings"]), -1.0, atol=1e-5)
    assert float(m["projection/kept"]) < 1e-5


def test_one_domain_is_refused():
    cfg = grpo_config.get_config("test")
    cfg.rl.gradient_projection = True
    with pytest.raises(ConfigError, match=r"rl\.gradient_projection=True .*two or more rl\.domains"):
        validate.validate(cfg)


def test_sharded_equals_single_device():
    """The projection step on data 2 x expert 2 x tensor 2 (the domains' gradients sharded like the
    parameters) against one device, with a batch of both domains."""
    from model import sharding

    cfg = _cfg(gradient_projection=True)
    model_def, state0 = train_state.init_state(cfg, seed=0)
    batch = _batch((0, 1, 1, 0, 1, 0, 0, 1))
    single, single_m = ts.make_train_step(cfg, model_def)(_copy(state0), batch)
    cfg.mesh.shape.update({"data": 2, "expert": 2, "tensor": 2})
    mesh = sharding.make_mesh(cfg.mesh.shape)
    model_def, state = train_state.init_state(cfg, mesh=mesh, seed=0)
    sharded, m = ts.make_train_step(cfg, model_def, mesh=mesh)(state, batch)
    assert _max_diff(single.params, sharded.params) < 2e-5  # f32 sums over shards in another order
    for name in ("loss", "grad_norm", "projection/cosine/arith|strings", "projection/kept"):
        np.testing.assert_allclose(m[name], single_m[name], atol=2e-5, err_msg=name)
    assert float(m["projection/conflicts"]) == float(single_m["projection/conflicts"])
