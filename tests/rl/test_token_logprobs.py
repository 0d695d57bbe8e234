"""rl.grpo.token_logprobs: teacher-forced log-probs under the sampler's processing, golden values by hand."""

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
