"""rl.grpo: golden values derived by hand in the comments, gradients through jax.grad."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import grpo

ATOL = 1e-5  # f32 arithmetic on values of order 1; every golden below is exact to ~1e-7.


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected, dtype=np.float32), rtol=0, atol=atol)


# --- group_advantages --------------------------------------------------------------------------------------

REWARDS = jnp.array([1.0, 0, 0, 1, 1, 1, 1, 0])


def test_advantages_group_std():
    # Group 1 [1,0,0,1]: mean .5, deviations +-.5, var .25, std .5 -> [1, -1, -1, 1].
    # Group 2 [1,1,1,0]: mean .75, deviations [.25,.25,.25,-.75], var (3 * .0625 + .5625) / 4 = .1875,
    #   std sqrt(.1875) = .4330127 -> .25 / .4330127 = 1 / sqrt(3), -.75 / .4330127 = -sqrt(3).
    adv = grpo.group_advantages(REWARDS, 4, std="group")
    chex.assert_shape(adv, (8,))
    s3 = math.sqrt(3.0)
    close(adv, [1, -1, -1, 1, 1 / s3, 1 / s3, 1 / s3, -s3])
    assert adv.dtype == jnp.float32


def test_advantages_batch_std():
    # Group means as above; the divisor is the std of all 8 rewards: 5 ones and 3 zeros, mean .625,
    # var .625 * .375 = .234375, std .4841229 -> .5 / .4841229 = 1.0327956, .25 / std = .5163978,
    # .75 / std = 1.5491933.
    adv = grpo.group_advantages(REWARDS, 4, std="batch")
    close(adv, [1.0327956, -1.0327956, -1.0327956, 1.0327956, 0.5163978, 0.5163978, 0.5163978, -1.5491933])


def test_advantages_no_std_is_dr_grpo():
    # Reward minus group mean only: group 1 mean .5, group 2 mean .75.
    adv = grpo.group_advantages(REWARDS, 4, std="none")
    close(adv, [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])


def test_advantages_group_size_two():
    # Pairs [1,0] [0,1] [1,1] [1,0]: each unequal pair has mean .5, std .5 -> +-1; the equal pair gives 0.
    close(grpo.group_advantages(REWARDS, 2), [1, -1, -1, 1, 0, 0, 1, -1])


@pytest.mark.parametrize("std", ["group", "batch", "none"])
def test_advantages_zero_variance_group_is_zero_not_nan(std):
    # Group 1 is all ones (every sample right): no signal, advantage exactly 0 whatever the divisor.
    adv = grpo.group_advantages(jnp.array([1.0, 1, 1, 1, 0, 1, 0, 1]), 4, std=std)
    chex.assert_tree_all_finite(adv)
    close(adv[:4], [0, 0, 0, 0], atol=0)
    assert float(adv[5]) > 0 > float(adv[4])
    # A batch with no variance at all: the batch std is 0 too.
    close(grpo.group_advantages(jnp.ones(8), 4, std=std), np.zeros(8), atol=0)


def test_advantages_errors():
    with pytest.raises(ValueError, match=r"8 rows, not a multiple of group_size=3"):
        grpo.group_advantages(REWARDS, 3)
    with pytest.raises(
        ValueError, match=r"std='zscore' is unknown; choose one of \['batch', 'group', 'none'\]"
    ):
        grpo.group_advantages(REWARDS, 4, std="zscore")


# --- policy_loss: clipping ----------------------------------------------------------------------------------

# Five one-token sequences, old logp 0, logp = log r.
CLIP_R = [1.5, 0.5, 1.5, 0.5, 1.1]
CLIP_A = jnp.array([1.0, 1, -1, -1, 1])


def _clip_loss(logp_B1, **kw):
    return grpo.policy_loss(logp_B1, jnp.zeros((5, 1)), CLIP_A, jnp.ones((5, 1), bool), **kw)


def test_clip_branches_and_gradients():
    # clip range [.8, 1.28].  Per token: -min(r A, clip(r) A), d/d logp = -r A unless clipped (then 0):
    #   r 1.5, A +1: min(1.5, 1.28) = 1.28, clipped        -> loss -1.28, grad 0
    #   r 0.5, A +1: min(0.5, 0.8)  = 0.5                  -> loss -0.5,  grad -0.5
    #   r 1.5, A -1: min(-1.5, -1.28) = -1.5               -> loss  1.5,  grad  1.5
    #   r 0.5, A -1: min(-0.5, -0.8) = -0.8, clipped       -> loss  0.8,  grad 0
    #   r 1.1, A +1: inside the range                      -> loss -1.1,  grad -1.1
    # token-mean: (-1.28 - .5 + 1.5 + .8 - 1.1) / 5 = -.116; gradients / 5.
    logp = jnp.log(jnp.array(CLIP_R))[:, None]
    (loss, metrics), grad = jax.jit(jax.value_and_grad(_clip_loss, has_aux=True))(logp)
    chex.assert_rank([loss, *metrics.values()], 0)
    close(loss, -0.116)
    close(grad[:, 0], [0.0, -0.1, 0.3, 0.0, -0.22])
    # Clipped: tokens 0 (high side) and 3 (low side) of 5. Mean ratio (1.5+.5+1.5+.5+1.1)/5 = 1.02.
    # approx KL (r-1) - log r: r 1.5 -> .5 - .4054651 = .0945349; r .5 -> -.5 + .6931472 = .1931472;
    #   r 1.1 -> .1 - .0953102 = .0046898; mean (2 * .0945349 + 2 * .1931472 + .0046898) / 5 = .1160108.
    close(metrics["clip_fraction"], 0.4)
    close(metrics["clip_fraction_low"], 0.2)
    close(metrics["clip_fraction_high"], 0.2)
    close(metrics["ratio_mean"], 1.02)
    close(metrics["approx_kl"], 0.1160108)
    close(metrics["ratio_max"], 1.5)


def test_clip_higher_is_separate_from_clip_low():
    # r 1.25, A +1 on every row: inside [.8, 1.28] (DAPO clip-higher) so it trains, but clipped by the
    # symmetric [.8, 1.2] of plain PPO. Loss -1.25 vs -1.2; gradient -1.25 / 5 vs 0.
    logp = jnp.full((5, 1), math.log(1.25))
    adv = jnp.ones(5)
    f = lambda lp, hi: grpo.policy_loss(lp, jnp.zeros((5, 1)), adv, jnp.ones((5, 1)), clip_high=hi)[0]
    loss_and_grad = jax.jit(jax.value_and_grad(f), static_argnums=1)
    loss, grad = loss_and_grad(logp, 0.28)
    close(loss, -1.25)
    close(grad, np.full((5, 1), -0.25))
    loss, grad = loss_and_grad(logp, 0.2)
    close(loss, -1.2)
    close(grad, np.zeros((5, 1)), atol=0)
    # A wider clip_low keeps r .75 with A -1 trained: min(-.75, -clip(.75)) is -.8 (clipped) at clip_low .2,
    # -.75 (unclipped) at clip_low .3.
    low = lambda cl: grpo.policy_loss(
        jnp.full((1, 1), math.log(0.75)), jnp.zeros((1, 1)), -jnp.ones(1), jnp.ones((1, 1)), clip_low=cl
    )[0]
    close(low(0.2), 0.8)
    close(low(0.3), 0.75)


# --- policy_loss / aggregate: aggregations on a ragged mask ------------------------------------------------

X = jnp.array([[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
RAGGED = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)


def test_aggregations_on_ragged_mask():
    # Masked tokens: row 0 -> 1, 2; row 1 -> 5, 6, 7, 8; row 2 -> none.
    # token-mean: (1 + 2 + 5 + 6 + 7 + 8) / 6 = 29 / 6.
    close(grpo.aggregate(X, RAGGED, aggregation="token-mean"), 29 / 6)
    # seq-mean-token-mean: row means 1.5 and 6.5; the empty row is left out -> 4.0 (not 8 / 3).
    close(grpo.aggregate(X, RAGGED, aggregation="seq-mean-token-mean"), 4.0)
    # seq-mean-token-sum-norm, max_tokens 4: row sums 3, 26, 0 -> .75, 6.5, 0 -> mean of 3 rows = 7.25 / 3.
    close(grpo.aggregate(X, RAGGED, aggregation="seq-mean-token-sum-norm", max_tokens=4), 7.25 / 3)
    # A float mask is the same as a bool one.
    close(grpo.aggregate(X, RAGGED.astype(jnp.float32), aggregation="seq-mean-token-mean"), 4.0)


@pytest.mark.parametrize(
    "aggregation, max_tokens, expected",
    [
        # r = 1 everywhere, A = [1, 2, 3]: per-token loss -A_b on masked tokens.
        ("token-mean", None, (-1 * 2 - 2 * 4) / 6),  # -10 / 6
        ("seq-mean-token-mean", None, (-1 - 2) / 2),  # row means -1, -2; row 2 empty
        ("seq-mean-token-sum-norm", 4, (-2 / 4 - 8 / 4 + 0) / 3),  # row sums -2, -8, 0
    ],
)
def test_policy_loss_aggregations(aggregation, max_tokens, expected):
    logp = -jnp.ones((3, 4))
    loss, _ = grpo.policy_loss(
        logp, logp, jnp.array([1.0, 2, 3]), RAGGED, aggregation=aggregation, max_tokens=max_tokens
    )
    close(loss, expected)


def test_aggregation_errors():
    with pytest.raises(ValueError, match=r"max_tokens=None: aggregation='seq-mean-token-sum-norm' needs"):
        grpo.aggregate(X, RAGGED, aggregation="seq-mean-token-sum-norm")
    with pytest.raises(
        ValueError, match=r"aggregation='mean' is unknown; choose one of \['seq-mean-token-mean'"
    ):
        grpo.policy_loss(X, X, jnp.ones(3), RAGGED, aggregation="mean")
    with pytest.raises(ValueError, match=r"ratio='seq' is unknown; choose one of \['sequence', 'token'\]"):
        grpo.policy_loss(X, X, jnp.ones(3), RAGGED, ratio="seq")


# --- GSPO sequence ratio ------------------------------------------------------------------------------------

# logp - old_logp per token; row 0's last token is masked (its 5.0 must not enter s_0).
GSPO_LOG_R = jnp.array([[0.1, 0.3, 5.0], [-0.2, 0.0, 0.2]])
GSPO_MASK = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
GSPO_OLD = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]])


def _gspo(logp, adv, **kw):
    return grpo.policy_loss(
        logp, GSPO_OLD, adv, GSPO_MASK, ratio="sequence", aggregation="seq-mean-token-mean", **kw
    )


def test_gspo_ratio_value_and_gradient():
    # s_0 = exp((.1 + .3) / 2) = exp(.2) = 1.2214028; s_1 = exp((-.2 + 0 + .2) / 3) = 1; both in [.8, 1.28].
    # A = [1, -1]: row losses -1.2214028 and +1 -> mean -.1107014.
    # GSPO gradient: d loss / d logp_{i,t} = -A_i s_i m_{i,t} / |y_i| / 2 rows:
    #   row 0: -1.2214028 / 2 / 2 = -.3053507 on tokens 0, 1 and 0 on the masked token; row 1: 1 / 3 / 2.
    logp = GSPO_OLD + GSPO_LOG_R
    adv = jnp.array([1.0, -1.0])
    (loss, metrics), grad = jax.jit(jax.value_and_grad(lambda lp: _gspo(lp, adv), has_aux=True))(logp)
    close(loss, -0.1107014)
    close(metrics["ratio_mean"], (2 * 1.2214028 + 3 * 1.0) / 5)
    close(grad, [[-0.3053507, -0.3053507, 0.0], [1 / 6, 1 / 6, 1 / 6]])

    # The same as the gradient of the paper's sequence-level objective -mean_i s_i(theta) A_i.
    def sequence_objective(lp):
        log_s = ((lp - GSPO_OLD) * GSPO_MASK).sum(axis=1) / GSPO_MASK.sum(axis=1)
        return -(jnp.exp(log_s) * adv).mean()

    close(grad, jax.jit(jax.grad(sequence_objective))(logp))


def test_gspo_clips_whole_sequences():
    # Row 0 log-ratios .5, .5 -> s_0 = exp(.5) = 1.6487 > 1.28 with A +1: clipped, no gradient on the row.
    # Row 1 is unchanged (s_1 = 1): gradient 1/6 per token with A -1. 2 of 5 masked tokens clipped.
    logp = GSPO_OLD + GSPO_LOG_R.at[0, 1].set(0.5).at[0, 0].set(0.5)
    adv = jnp.array([1.0, -1.0])
    (loss, metrics), grad = jax.jit(jax.value_and_grad(lambda lp: _gspo(lp, adv), has_aux=True))(logp)
    close(loss, (-1.28 + 1.0) / 2)
    close(grad, [[0, 0, 0], [1 / 6, 1 / 6, 1 / 6]])
    close(metrics["clip_fraction"], 2 / 5)


def test_policy_loss_jits():
    logp = GSPO_OLD + GSPO_LOG_R
    fn = jax.jit(functools.partial(grpo.policy_loss, ratio="sequence", aggregation="seq-mean-token-mean"))
    loss, _ = fn(logp, GSPO_OLD, jnp.array([1.0, -1.0]), GSPO_MASK)
    close(loss, -0.1107014)


# --- masked-out positions: huge ratios and -inf log-probs ---------------------------------------------------

# One row; log r = [log 1.5, log .5, 50]; the third token is padding.
PAD_MASK = jnp.array([[1, 1, 0]], bool)
PAD_OLD = jnp.array([[-1.0, -2.0, -3.0]])


def test_ratio_max_ignores_padded_tokens():
    # Masked ratios 1.5 and .5: ratio_max 1.5, not e^50 (the padded token); ratio_mean 1.
    logp = PAD_OLD + jnp.array([[math.log(1.5), math.log(0.5), 50.0]])
    _, metrics = grpo.policy_loss(logp, PAD_OLD, jnp.ones(1), PAD_MASK)
    close(metrics["ratio_max"], 1.5)
    close(metrics["ratio_mean"], 1.0)
    # No token masked in: 0, the identity of a max over micro-batches.
    _, metrics = grpo.policy_loss(logp, PAD_OLD, jnp.ones(1), jnp.zeros((1, 3)))
    close(metrics["ratio_max"], 0.0, atol=0)


@pytest.mark.parametrize("pad", [-jnp.inf, grpo.LOGP_FLOOR])
@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_pad_logprobs_give_no_nan(pad, ratio):
    # A padded position whose target the sampler's filters drop: -inf (or the floor) in logp, old, ref and
    # behaviour. Loss, metrics and gradients equal those with a finite padded value: no NaN, no gradient.
    finite = PAD_OLD + jnp.array([[math.log(1.5), math.log(0.5), 0.0]])
    padded = finite.at[0, 2].set(pad)
    old = PAD_OLD.at[0, 2].set(pad)
    cfg = grpo.default_loss_config()
    cfg.update(ratio=ratio, kl_kind="k3", kl_coef=0.1)

    def run(lp, old, other):
        f = lambda lp: grpo.loss_from_config(
            lp, old, jnp.ones(1), PAD_MASK, cfg=cfg, behaviour_logp_BT=other, ref_logp_BT=other
        )
        return jax.value_and_grad(f, has_aux=True)(lp)

    (loss, metrics), grad = run(padded, old, old)
    (want_loss, want_metrics), want_grad = run(finite, PAD_OLD, PAD_OLD)
    chex.assert_tree_all_finite((loss, metrics, grad))
    close(loss, want_loss)
    close(grad, want_grad)
    assert float(grad[0, 2]) == 0.0
    for name, value in want_metrics.items():
        close(metrics[name], value)


# --- KL penalty ---------------------------------------------------------------------------------------------

KL_LOGP = jnp.array([[0.0, -1.0, 0.0]])
KL_REF = jnp.array([[-1.0, 0.0, -10.0]])  # The masked third token would add k1 = 10, k3 = e^-10 + 9.
KL_MASK = jnp.array([[1, 1, 0]], bool)


def test_kl_k1_and_k3():
    # k1 = logp - ref: [1, -1] -> token mean 0.
    close(grpo.kl_penalty(KL_LOGP, KL_REF, KL_MASK, kind="k1"), 0.0)
    # k3 with d = ref - logp = [-1, 1]: e^-1 + 1 - 1 = .3678794, e - 1 - 1 = .7182818 -> mean .5430806.
    close(grpo.kl_penalty(KL_LOGP, KL_REF, KL_MASK, kind="k3"), 0.5430806)
    # d k3 / d logp = 1 - exp(ref - logp): 1 - e^-1 = .6321206, 1 - e = -1.7182818; / 2 tokens; 0 when masked.
    grad = jax.grad(lambda lp: grpo.kl_penalty(lp, KL_REF, KL_MASK, kind="k3"))(KL_LOGP)
    close(grad, [[0.3160603, -0.8591409, 0.0]])
    # Aggregated like the loss: Dr. GRPO sum-norm with max_tokens 4 -> (.3678794 + .7182818) / 4.
    kl = grpo.kl_penalty(
        KL_LOGP, KL_REF, KL_MASK, kind="k3", aggregation="seq-mean-token-sum-norm", max_tokens=4
    )
    close(kl, 0.2715403)
    with pytest.raises(ValueError, match=r"kind='k2' is unknown; choose one of \['k1', 'k3'\]"):
        grpo.kl_penalty(KL_LOGP, KL_REF, KL_MASK, kind="k2")


def test_register_new_variant_by_name():
    @grpo.register("aggregation", "test-max")
    def _max(x_BT, mask_BT, max_tokens):
        return jnp.where(mask_BT > 0, x_BT, -jnp.inf).max()

    try:
        close(grpo.aggregate(X, RAGGED, aggregation="test-max"), 8.0)
        with pytest.raises(ValueError, match=r"aggregation 'test-max' is already registered"):
            grpo.register("aggregation", "test-max")(_max)
    finally:
        del grpo.AGGREGATIONS["test-max"]
    with pytest.raises(
        ValueError, match=r"kind='loss' is unknown; choose one of \['advantages', 'aggregation'"
    ):
        grpo.register("loss", "x")
