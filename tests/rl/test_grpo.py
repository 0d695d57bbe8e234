"""rl.grpo: golden values derived by hand in the comments, gradients through jax.grad."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference import sampling
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


# --- token_logprobs -----------------------------------------------------------------------------------------


def test_token_logprobs_against_hand_softmax():
    # Position 0 predicts from nothing: 0. Position 1 reads logits[0] = log[1,2,1] -> probs [.25,.5,.25];
    # token 0 has p .25. Position 2 reads logits[1] = log[1,1,2] -> [.25,.25,.5]; token 2 has p .5.
    # logits[2] predicts past the end and must not be used (it would make token 2 nearly impossible).
    logits = jnp.log(jnp.array([[[1.0, 2, 1], [1, 1, 2], [1, 1, 1]]]))
    logits = logits.at[0, 2].set(jnp.array([100.0, 0, 0]))
    tokens = jnp.array([[2, 0, 2]])
    logp = grpo.token_logprobs(logits, tokens)
    chex.assert_shape(logp, (1, 3))
    close(logp, [[0, math.log(0.25), math.log(0.5)]])
    assert logp.dtype == jnp.float32

    # Temperature 2 halves the logits: probs proportional to sqrt([1,2,1]) -> p(0) = 1 / (2 + sqrt 2)
    # = .2928932, and to sqrt([1,1,2]) -> p(2) = sqrt 2 / (2 + sqrt 2) = .4142136.
    hot = grpo.token_logprobs(logits.astype(jnp.bfloat16), tokens, temperature=2.0)
    want = [[0, math.log(0.2928932), math.log(0.4142136)]]
    close(grpo.token_logprobs(logits, tokens, temperature=2.0), want)
    close(hot, want, atol=2e-2)  # bf16 logits carry ~3 significant digits.


def test_token_logprobs_over_a_window_of_positions():
    # The hand values of the test above. positions [[0, 1]]: logits rows 0 and 1 score tokens 1 and 2:
    # [0, log .25, log .5]. positions [[1, 2]]: row 1 scores token 2 (log .5); position 2 predicts past the
    # end (its logits, favouring token 0, are ignored) and token 1 is outside the window: 0.
    logits = jnp.log(jnp.array([[[1.0, 2, 1], [1, 1, 2], [100, 1e-30, 1e-30]]]))
    tokens = jnp.array([[2, 0, 2]])
    first = grpo.token_logprobs(logits[:, :2], tokens, positions_BK=jnp.array([[0, 1]]))
    close(first, [[0, math.log(0.25), math.log(0.5)]])
    second = grpo.token_logprobs(logits[:, 1:], tokens, positions_BK=jnp.array([[1, 2]]))
    close(second, [[0, 0, math.log(0.5)]])
    # The gradient of token 2's log-prob reaches window row 0 only: onehot(2) - [.25, .25, .5].
    grad = jax.grad(lambda lg: grpo.token_logprobs(lg, tokens, positions_BK=jnp.array([[1, 2]]))[0, 2])
    close(grad(logits[:, 1:])[0], [[-0.25, -0.25, 0.5], [0, 0, 0]])
    # A filter applies within the window as without one: top-k 2 of [.4, .3, .2, .1] keeps token 0 at 4/7.
    filtered = grpo.token_logprobs(FILTER_LOGITS[:, :1], jnp.array([[3, 0, 2]]), top_k=2,
                                   positions_BK=jnp.array([[0]]))  # fmt: skip
    close(filtered, [[0.0, math.log(4 / 7), 0.0]])


def test_window_positions_start_before_the_first_trained_token():
    mask = jnp.array([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]], jnp.float32)
    np.testing.assert_array_equal(grpo.window_positions(mask, 3), [[1, 2, 3], [0, 1, 2], [0, 1, 2]])


# logits log[.4, .3, .2, .1] at positions 0 and 1; each filter below keeps tokens {0, 1}, renormalised to
# [4/7, 3/7]: top-k 2; top-p .6 (mass before each token 0, .4, .7, .9: the first two are < .6); min-p .6
# (keep p >= .6 * .4 = .24: .4 and .3).
FILTER_LOGITS = jnp.log(jnp.array([[[0.4, 0.3, 0.2, 0.1]] * 3]))


@pytest.mark.parametrize("filters", [{"top_k": 2}, {"top_p": 0.6}, {"min_p": 0.6}])
def test_token_logprobs_filtered_golden_and_gradient(filters):
    # Position 1: token 0 is kept, log(4/7); d/d logits[0] = onehot(0) - [4/7, 3/7, 0, 0] = [3/7, -3/7, 0, 0]
    # (the dropped logits get no gradient: the keep-mask is a constant). Position 2: token 2 is dropped,
    # LOGP_FLOOR, with a zero (not NaN) gradient.
    tokens = jnp.array([[3, 0, 2]])
    logp = grpo.token_logprobs(FILTER_LOGITS, tokens, **filters)
    close(logp, [[0.0, math.log(4 / 7), grpo.LOGP_FLOOR]])
    grad = jax.grad(lambda lg: grpo.token_logprobs(lg, tokens, **filters)[0, 1])(FILTER_LOGITS)
    close(grad[0], [[3 / 7, -3 / 7, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    grad = jax.grad(lambda lg: grpo.token_logprobs(lg, tokens, **filters)[0, 2])(FILTER_LOGITS)
    close(grad, np.zeros((1, 3, 4)), atol=0)


def _random_logits_and_tokens(key=0, shape=(2, 6, 11)):
    """Random logits; token t is the argmax of logits[:, t - 1] for odd t (kept by any filter) and the
    argmin for even t (dropped by top-k 5)."""
    logits = 3.0 * jax.random.normal(jax.random.key(key), shape)
    best, worst = jnp.argmax(logits, axis=-1), jnp.argmin(logits, axis=-1)
    nxt = jnp.where(jnp.arange(shape[1]) % 2 == 0, best, worst)  # Predicted from t: the token at t + 1.
    return logits, jnp.roll(nxt, 1, axis=1).astype(jnp.int32)


def test_token_logprobs_match_the_samplers_processed_logprobs():
    logits, tokens = _random_logits_and_tokens()
    batch, length, _ = logits.shape
    params = sampling.SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    fn = jax.jit(functools.partial(grpo.token_logprobs, temperature=0.7, top_k=5, top_p=0.9))
    logp = fn(logits, tokens)
    chex.assert_shape(logp, (batch, length))
    arrays = sampling.sampling_arrays([params] * batch)
    for t in range(1, length):
        logp_BV = sampling.processed_logprobs(logits[:, t - 1], arrays)
        want_B = jnp.take_along_axis(logp_BV, tokens[:, t, None], axis=-1)[:, 0]
        if t % 2 == 0:  # argmin: outside the top 5, -inf for the sampler, the floor here.
            assert np.all(np.isneginf(want_B))
            close(logp[:, t], np.full(batch, grpo.LOGP_FLOOR), atol=0)
        else:
            assert np.all(np.asarray(want_B) > -1e3)
            close(logp[:, t], want_B)
    close(logp[:, 0], np.zeros(batch), atol=0)
    grad = jax.grad(lambda lg: fn(lg, tokens).sum())(logits)
    chex.assert_tree_all_finite(grad)


def test_token_logprobs_filter_that_keeps_everything_matches_no_filter():
    # top_k = V is "on" (the processed path) but keeps every token: the plain tempered softmax.
    logits, tokens = _random_logits_and_tokens(key=1)
    plain = grpo.token_logprobs(logits, tokens, temperature=0.7)
    close(grpo.token_logprobs(logits, tokens, temperature=0.7, top_k=logits.shape[-1]), plain)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0.0}, r"temperature=0.0 must be > 0 \(greedy decoding has no log-probs\)"),
        ({"temperature": -1.0}, r"temperature=-1.0 must be > 0"),
        ({"top_k": -1}, r"top_k=-1 must be >= 0"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"min_p": 1.5}, r"min_p=1.5 must be in \[0, 1\]"),
    ],
)
def test_token_logprobs_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        grpo.token_logprobs(FILTER_LOGITS, jnp.zeros((1, 3), jnp.int32), **kwargs)


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


def test_filtered_logprobs_through_the_loss_have_finite_gradients():
    # Prompt-like positions (even t, and t = 0) hold tokens the filters drop: LOGP_FLOOR, masked out.
    logits, tokens = _random_logits_and_tokens(key=2)
    mask = (jnp.arange(logits.shape[1]) % 2 == 1)[None, :] & jnp.ones((logits.shape[0], 1), bool)
    logp_fn = functools.partial(grpo.token_logprobs, temperature=0.7, top_k=5, top_p=0.9)
    old = jax.lax.stop_gradient(logp_fn(logits, tokens)) - 0.1
    cfg = grpo.default_loss_config()
    cfg.update(kl_kind="k3", kl_coef=0.1)

    def loss(lg):
        return grpo.loss_from_config(
            logp_fn(lg, tokens),
            old,
            jnp.array([1.0, -1.0]),
            mask,
            cfg=cfg,
            behaviour_logp_BT=old,
            ref_logp_BT=old,
        )[0]

    value, grad = jax.jit(jax.value_and_grad(loss))(logits)
    chex.assert_tree_all_finite((value, grad))
    assert float(jnp.abs(grad).max()) > 0


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


# --- truncated importance weights ---------------------------------------------------------------------------


def test_truncated_importance_weights_cap_mask_and_no_gradient():
    # proximal / behaviour = [1.5, 3, .5, 10]; cap 2 -> [1.5, 2, .5], the last token is masked -> 0.
    behaviour = jnp.array([[-1.0, -2.0, -0.5, -3.0]])
    proximal = behaviour + jnp.log(jnp.array([[1.5, 3.0, 0.5, 10.0]]))
    mask = jnp.array([[1, 1, 1, 0]], bool)
    close(grpo.truncated_importance_weights(proximal, behaviour, mask), [[1.5, 2.0, 0.5, 0.0]])
    close(grpo.truncated_importance_weights(proximal, behaviour, mask, cap=4.0), [[1.5, 3.0, 0.5, 0.0]])
    weight_sum = lambda p, b: grpo.truncated_importance_weights(p, b, mask).sum()
    gp, gb = jax.grad(weight_sum, argnums=(0, 1))(proximal, behaviour)
    close(gp, np.zeros((1, 4)), atol=0)
    close(gb, np.zeros((1, 4)), atol=0)
    with pytest.raises(ValueError, match=r"cap=0.0 must be positive"):
        grpo.truncated_importance_weights(proximal, behaviour, mask, cap=0.0)


def test_is_weights_scale_the_loss_as_constants():
    # r = 1, A = 1, weights [2, .5]: token losses -2, -.5 -> mean -1.25; d/d logp = -w / 2 = [-1, -.25];
    # no gradient reaches the weights.
    logp, w = jnp.zeros((1, 2)), jnp.array([[2.0, 0.5]])
    f = lambda lp, w: grpo.policy_loss(lp, jnp.zeros((1, 2)), jnp.ones(1), jnp.ones((1, 2)), is_weights_BT=w)[
        0
    ]
    loss, (g_logp, g_w) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(logp, w)
    close(loss, -1.25)
    close(g_logp, [[-1.0, -0.25]])
    close(g_w, [[0.0, 0.0]], atol=0)


# --- corrections and mismatch metrics -----------------------------------------------------------------------

# r = pi_proximal / pi_behaviour per token; band [.5, 2], cap 2.
#   row 0: [.4, 1, 3]            product 1.2 (in band), geometric mean 1.2^(1/3) = 1.0626586 (in)
#   row 1: [1.5, 1.5, pad 100]   product 2.25 (out), geometric mean 1.5 (in); the padded 100 is ignored
#   row 2: [.3, .55, .6]         product .099 (out), geometric mean .099^(1/3) = .4626065 (out)
CORR_R = jnp.array([[0.4, 1.0, 3.0], [1.5, 1.5, 100.0], [0.3, 0.55, 0.6]])
CORR_MASK = jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]], bool)
CORR_BEHAVIOUR = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5], [-0.2, -0.4, -0.6]])
CORR_PROXIMAL = CORR_BEHAVIOUR + jnp.log(CORR_R)
CORR_WEIGHTS = {
    "none": [[1, 1, 1], [1, 1, 0], [1, 1, 1]],
    "tis": [[0.4, 1, 2], [1.5, 1.5, 0], [0.3, 0.55, 0.6]],  # min(r, 2)
    "icepop": [[0, 1, 0], [1.5, 1.5, 0], [0, 0.55, 0.6]],  # r in [.5, 2], else 0
    "seq-mask": [[0.4, 1, 2], [1.5, 1.5, 0], [0, 0, 0]],  # row 2's geometric mean is out: 0
    "seq-reject": [[1, 1, 1], [0, 0, 0], [0, 0, 0]],  # rows 1 and 2's products are out: 0
}


@pytest.mark.parametrize("kind", sorted(CORR_WEIGHTS))
def test_correction_weights_golden_and_constant(kind):
    fn = lambda p, b: grpo.correction_weights(p, b, CORR_MASK, kind=kind, low=0.5, high=2.0, cap=2.0)
    w = jax.jit(fn)(CORR_PROXIMAL, CORR_BEHAVIOUR)
    chex.assert_shape(w, (3, 3))
    assert w.dtype == jnp.float32
    close(w, CORR_WEIGHTS[kind])
    gp, gb = jax.grad(lambda p, b: fn(p, b).sum(), argnums=(0, 1))(CORR_PROXIMAL, CORR_BEHAVIOUR)
    close(gp, np.zeros((3, 3)), atol=0)
    close(gb, np.zeros((3, 3)), atol=0)


def test_seq_mask_without_cap_and_wider_band():
    # cap 0 (truncation off): seq-mask keeps weight 1 on rows 0 and 1. Band [.25, 4]: every row's geometric
    # mean is in; products 1.2, 2.25 in, .099 out -> seq-reject keeps rows 0 and 1.
    w = grpo.correction_weights(CORR_PROXIMAL, CORR_BEHAVIOUR, CORR_MASK, kind="seq-mask", cap=0.0)
    close(w, [[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    w = grpo.correction_weights(CORR_PROXIMAL, CORR_BEHAVIOUR, CORR_MASK, kind="seq-mask", low=0.25, high=4.0)
    close(w, CORR_WEIGHTS["tis"])
    w = grpo.correction_weights(
        CORR_PROXIMAL, CORR_BEHAVIOUR, CORR_MASK, kind="seq-reject", low=0.25, high=4.0
    )
    close(w, [[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"kind='pop' is unknown; choose one of \['icepop', 'none'"):
        grpo.correction_weights(CORR_PROXIMAL, CORR_BEHAVIOUR, CORR_MASK, kind="pop")


@pytest.mark.parametrize(
    "correction, kept, mean",
    [
        # 8 masked tokens. Weights from CORR_WEIGHTS: nonzero counts 8, 8, 5, 5, 3.
        ("none", 1.0, 1.0),
        ("tis", 1.0, (3.4 + 3.0 + 1.45) / 8),  # row sums 3.4, 3, 1.45
        ("icepop", 5 / 8, 5.15 / 8),  # 1 + 1.5 + 1.5 + .55 + .6
        ("seq-mask", 5 / 8, 6.4 / 8),  # 3.4 + 3
        ("seq-reject", 3 / 8, 3 / 8),
    ],
)
def test_loss_from_config_applies_the_correction(correction, kept, mean):
    # logp = old (r = 1), A = [1, -1, 1]: token loss -A w; token-mean over the 8 masked tokens.
    cfg = _cfg(correction=correction)
    adv = jnp.array([1.0, -1.0, 1.0])
    loss, metrics = jax.jit(functools.partial(grpo.loss_from_config, cfg=cfg))(
        CORR_PROXIMAL, CORR_PROXIMAL, adv, CORR_MASK, behaviour_logp_BT=CORR_BEHAVIOUR
    )
    w = np.asarray(CORR_WEIGHTS[correction], np.float32)
    close(loss, -(w * np.asarray(adv)[:, None]).sum() / 8)
    close(metrics["correction_kept_fraction"], kept)
    close(metrics["is_weight_mean"], mean)
    assert ("tis_weight_mean" in metrics) == (correction == "tis")


def test_mismatch_metrics_golden():
    # r = train - behaviour: masked ratios [.4, 1, 3] and [1.5, .8]; the padded e^10 is ignored.
    # k1 = mean(-log r) = -log(.4 * 3 * 1.5 * .8) / 5 = -log 1.44 / 5 = -.0729286 (negative: k1 is unbiased,
    #   not nonnegative). k3 = mean(r - 1 - log r): .3162907 + 0 + .9013877 + .0945349 + .0231436 = 1.3353569,
    #   / 5 = .2670714. Band 2, [.5, 2]: .4 and 3 are out -> 2 / 5. Max 3, min .4.
    ratios = jnp.array([[0.4, 1.0, 3.0], [1.5, 0.8, math.exp(10.0)]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
    behaviour = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.5, -jnp.inf]])
    train = jnp.where(mask, behaviour + jnp.log(ratios), 10.0)
    metrics = jax.jit(functools.partial(grpo.mismatch_metrics, band=2.0))(train, behaviour, mask)
    chex.assert_tree_all_finite(metrics)
    close(metrics["mismatch_kl_k1"], -0.0729286)
    close(metrics["mismatch_kl"], 0.2670714)
    close(metrics["mismatch_out_of_band"], 0.4)
    close(metrics["mismatch_ratio_max"], 3.0)
    close(metrics["mismatch_ratio_min"], 0.4)
    # Band 4, [.25, 4]: every ratio is in.
    close(grpo.mismatch_metrics(train, behaviour, mask, band=4.0)["mismatch_out_of_band"], 0.0, atol=0)
    with pytest.raises(ValueError, match=r"band=0.5 must be >= 1"):
        grpo.mismatch_metrics(train, behaviour, mask, band=0.5)


# --- loss_from_config ---------------------------------------------------------------------------------------

LOGP = jnp.array([[-1.0, -2.0], [-0.5, -1.5]])
TIS_W = jnp.array([[1.5, 3.0], [0.5, 1.0]])  # old / behaviour; 3 is capped to 2.
BEHAVIOUR = LOGP - jnp.log(TIS_W)
REF = LOGP - jnp.array([[0.4, 0.2], [0.0, -0.2]])  # k1 = logp - ref.
ADV = jnp.array([1.0, -1.0])


def _cfg(**kw):
    cfg = grpo.default_loss_config()
    cfg.update(kw)
    return cfg


def test_default_loss_config():
    cfg = grpo.default_loss_config()
    assert dict(cfg) == {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "ratio": "token",
        "aggregation": "token-mean",
        "max_tokens": 0,
        "kl_kind": "none",
        "kl_coef": 0.0,
        "correction": "tis",
        "correction_low": 0.5,
        "correction_high": 2.0,
        "tis_cap": 2.0,
    }


def test_loss_from_config_with_tis_and_kl():
    # logp = old (r = 1); TIS weights [[1.5, 2], [.5, 1]]; token losses -A w = [[-1.5, -2], [.5, 1]]
    # -> mean -.5.
    # k1 = [[.4, .2], [0, -.2]] -> mean .1; loss = -.5 + .1 * .1 = -.49. Mean weight 5 / 4 = 1.25.
    cfg = _cfg(kl_kind="k1", kl_coef=0.1)
    fn = jax.jit(functools.partial(grpo.loss_from_config, cfg=cfg))
    loss, metrics = fn(LOGP, LOGP, ADV, jnp.ones((2, 2), bool), behaviour_logp_BT=BEHAVIOUR, ref_logp_BT=REF)
    close(loss, -0.49)
    close(metrics["loss"], -0.49)
    close(metrics["policy_loss"], -0.5)
    close(metrics["kl"], 0.1)
    close(metrics["tis_weight_mean"], 1.25)
    # d loss / d logp = (-A w + .1 * 1) / 4 per token: [[-1.4, -1.9], [.6, 1.1]] / 4.
    grad = jax.grad(
        lambda lp: fn(lp, LOGP, ADV, jnp.ones((2, 2)), behaviour_logp_BT=BEHAVIOUR, ref_logp_BT=REF)[0]
    )
    close(grad(LOGP), [[-0.35, -0.475], [0.15, 0.275]])


def test_loss_from_config_tis_off_and_no_kl():
    # tis_cap 0: the behaviour log-probs are ignored; token losses [[-1, -1], [1, 1]] -> 0. No KL term.
    loss, metrics = grpo.loss_from_config(
        LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=_cfg(tis_cap=0.0), behaviour_logp_BT=BEHAVIOUR, ref_logp_BT=REF
    )
    close(loss, 0.0)
    assert "kl" not in metrics and "tis_weight_mean" not in metrics
    # Default config (tis_cap 2) but no behaviour log-probs: on-policy, the same 0.
    close(grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=_cfg())[0], 0.0)


def test_loss_from_config_k3_and_sum_norm():
    # k3 per token with d = ref - logp = [[-.4, -.2], [0, .2]]:
    #   e^-.4 + .4 - 1 = .0703200, e^-.2 + .2 - 1 = .0187308, 0, e^.2 - .2 - 1 = .0214028.
    # sum-norm, max_tokens 4: policy rows (-1 - 1) / 4 = -.5 and (1 + 1) / 4 = .5 -> mean 0;
    #   KL rows (.0703200 + .0187308) / 4 = .0222627, .0214028 / 4 = .0053507 -> mean .0138067; * coef 1.
    cfg = _cfg(kl_kind="k3", kl_coef=1.0, aggregation="seq-mean-token-sum-norm", max_tokens=4)
    loss, metrics = grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=cfg, ref_logp_BT=REF)
    close(metrics["kl"], 0.0138067)
    close(loss, 0.0138067)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"aggregation": "x"}, r"rl.loss.aggregation='x' is unknown; choose one of \['seq-mean-token-mean'"),
        ({"ratio": "seq"}, r"rl.loss.ratio='seq' is unknown; choose one of \['sequence', 'token'\]"),
        ({"kl_kind": "k2"}, r"rl.loss.kl_kind='k2' is unknown; choose one of \['k1', 'k3', 'none'\]"),
        ({"clip_low": -0.1}, r"rl.loss.clip_low=-0.1 must be >= 0"),
        ({"tis_cap": -1.0}, r"rl.loss.tis_cap=-1.0 must be >= 0"),
        ({"aggregation": "seq-mean-token-sum-norm"}, r"rl.loss.max_tokens=0 must be > 0 for aggregation="),
        ({"correction": "is"}, r"rl.loss.correction='is' is unknown; choose one of \['icepop', 'none'"),
        ({"correction_low": 0.0}, r"rl.loss.correction_low=0.0 must be in \(0, 1\]"),
        ({"correction_low": 1.5}, r"rl.loss.correction_low=1.5 must be in \(0, 1\]"),
        ({"correction_high": 0.9}, r"rl.loss.correction_high=0.9 must be >= 1"),
    ],
)
def test_loss_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=_cfg(**overrides))


def test_loss_config_missing_field_and_missing_ref():
    cfg = grpo.default_loss_config()
    del cfg["kl_coef"]
    with pytest.raises(ValueError, match=r"rl.loss.kl_coef is missing"):
        grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=cfg)
    with pytest.raises(ValueError, match=r"rl.loss.kl_kind='k1' needs ref_logp_BT"):
        grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=_cfg(kl_kind="k1"))


# --- registry -----------------------------------------------------------------------------------------------


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
