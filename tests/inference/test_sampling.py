"""inference.sampling: hand-derived processed distributions, no retracing, keys, and a chi-square test."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from inference import sampling
from inference.sampling import (
    SamplingParams,
    processed_logprobs,
    raw_logprobs,
    sample,
    sample_keys,
    sampling_arrays,
)

PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
# Tied maxima at indices 1 and 3, tied minima at 0 and 4: ranking (prob desc, index asc) is 1, 3, 2, 0, 4.
TIED = np.array([0.1, 0.3, 0.2, 0.3, 0.1])
ATOL = 1e-6


def _processed(probs: np.ndarray, **kwargs) -> np.ndarray:
    logits_BV = jnp.log(jnp.asarray(probs, jnp.float32))[None]
    return np.exp(np.asarray(processed_logprobs(logits_BV, sampling_arrays([SamplingParams(**kwargs)])))[0])


@pytest.mark.parametrize(
    "probs, kwargs, expected",
    [
        # Defaults change nothing.
        (PROBS, {}, PROBS),
        # t = 0.5 squares the probabilities: [.16, .09, .0225, .01, .0025] / .285.
        (
            PROBS,
            dict(temperature=0.5),
            [0.16 / 0.285, 0.09 / 0.285, 0.0225 / 0.285, 0.01 / 0.285, 0.0025 / 0.285],
        ),
        # Top-2: [.4, .3] / .7.
        (PROBS, dict(top_k=2), [4 / 7, 3 / 7, 0, 0, 0]),
        # k >= V keeps everything.
        (PROBS, dict(top_k=9), PROBS),
        # Mass before each token: 0, .4, .7, .85, .95; top_p = .75 keeps the first three: / .85.
        (PROBS, dict(top_p=0.75), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),
        # top_p below the top token's mass still keeps the top token.
        (PROBS, dict(top_p=0.1), [1, 0, 0, 0, 0]),
        # min_p = .3: threshold .3 * .4 = .12 keeps the first three.
        (PROBS, dict(min_p=0.3), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),
        # Ties: top-1 keeps the lower index of the tied maxima.
        (TIED, dict(top_k=1), [0, 1, 0, 0, 0]),
        # Top-4 of ranking 1, 3, 2, 0, 4 drops index 4 (tied with index 0): / .9.
        (TIED, dict(top_k=4), [0.1 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0.3 / 0.9, 0]),
        # Mass before 1, 3, 2: 0, .3, .6; top_p = .5 keeps both tied maxima.
        (TIED, dict(top_p=0.5), [0, 0.5, 0, 0.5, 0]),
        # top_p = .25 keeps one of the tied maxima: the lower index.
        (TIED, dict(top_p=0.25), [0, 1, 0, 0, 0]),
        # Combination in the documented order. t = 2 gives sqrt(p) = [.632456, .547723, .387298,
        # .316228, .223607]. top_k = 4 drops index 4; renormalised over the top 4 (sum 1.883704) the mass
        # before each is 0, .335751, .626520, .832125, so top_p = .75 drops index 3. min_p = .4: threshold
        # .4 * .632456 = .252982 keeps all three: [.632456, .547723, .387298] / 1.567477. (Top-p over the
        # distribution before top-k, mass before index 3 = .743828 < .75, would keep index 3.)
        (PROBS, dict(temperature=2.0, top_k=4, top_p=0.75, min_p=0.4), [0.403486, 0.349430, 0.247084, 0, 0]),
        # Same with min_p = .65: threshold .411096 also drops index 2: [.632456, .547723] / 1.180179.
        (PROBS, dict(temperature=2.0, top_k=4, top_p=0.75, min_p=0.65), [0.535898, 0.464102, 0, 0, 0]),
    ],
)
def test_processed_golden(probs, kwargs, expected):
    np.testing.assert_allclose(_processed(probs, **kwargs), np.asarray(expected), atol=ATOL)


def test_masked_tokens_are_minus_inf():
    logits_BV = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]
    logp_BV = processed_logprobs(logits_BV, sampling_arrays([SamplingParams(top_k=2)]))
    assert logp_BV.dtype == jnp.float32
    assert np.all(np.isneginf(np.asarray(logp_BV)[0, 2:]))


@pytest.mark.parametrize("probs, argmax", [(PROBS, 0), (TIED, 1)])
def test_greedy_is_one_hot_on_argmax(probs, argmax):
    logits_BV = jnp.log(jnp.asarray(probs, jnp.float32))[None]
    logp_BV = processed_logprobs(logits_BV, sampling_arrays([SamplingParams(temperature=0.0, top_p=0.5)]))
    chex.assert_tree_all_finite(logp_BV[0, argmax])
    np.testing.assert_array_equal(np.exp(np.asarray(logp_BV))[0], np.eye(5)[argmax])
    tokens_B, logprob_B = sample(jax.random.split(jax.random.key(0), 1), logits_BV, _greedy_arrays())
    assert int(tokens_B[0]) == argmax and float(logprob_B[0]) == 0.0


def _greedy_arrays():
    return sampling_arrays([SamplingParams(temperature=0.0)])


ROW_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=4, top_p=0.9, min_p=0.1),
]


def test_per_row_parameters_equal_row_by_row():
    logits_BV = jax.random.normal(jax.random.key(1), (len(ROW_PARAMS), 11)) * 2.0
    batched_BV = processed_logprobs(logits_BV, sampling_arrays(ROW_PARAMS))
    for row, params in enumerate(ROW_PARAMS):
        alone_BV = processed_logprobs(logits_BV[row][None], sampling_arrays([params]))
        np.testing.assert_array_equal(np.asarray(batched_BV[row]), np.asarray(alone_BV[0]))


def test_changing_parameter_values_does_not_retrace():
    traces = []

    @jax.jit
    def step(key_B, logits_BV, arrays):
        traces.append(1)
        return sample(key_B, logits_BV, arrays)

    logits_BV = jax.random.normal(jax.random.key(2), (len(ROW_PARAMS), 11))
    keys_B = jax.random.split(jax.random.key(3), len(ROW_PARAMS))
    for params in (
        ROW_PARAMS,
        ROW_PARAMS[::-1],
        [SamplingParams(temperature=0.3, top_k=1)] * len(ROW_PARAMS),
    ):
        step(keys_B, logits_BV, sampling_arrays(params))
    assert len(traces) == 1


def test_sampled_logprob_is_processed_logprob_at_token():
    logits_BV = jax.random.normal(jax.random.key(4), (len(ROW_PARAMS), 11)) * 2.0
    arrays = sampling_arrays(ROW_PARAMS)
    keys_B = jax.random.split(jax.random.key(5), len(ROW_PARAMS))
    tokens_B, logprob_B = sample(keys_B, logits_BV, arrays)
    expected_B = processed_logprobs(logits_BV, arrays)[jnp.arange(len(ROW_PARAMS)), tokens_B]
    np.testing.assert_array_equal(np.asarray(logprob_B), np.asarray(expected_B))
    chex.assert_tree_all_finite(logprob_B)
    raw_B = jax.nn.log_softmax(logits_BV)[jnp.arange(len(ROW_PARAMS)), tokens_B]
    np.testing.assert_allclose(np.asarray(raw_logprobs(logits_BV, tokens_B)), np.asarray(raw_B), atol=ATOL)


def test_n16_samples_differ_and_are_reproducible():
    logits_BV = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32))[None], (16, 5))
    arrays = sampling_arrays([SamplingParams(temperature=1.0)] * 16)

    def draw(seed):
        keys_B = sample_keys(seed, jnp.zeros(16, jnp.int32), jnp.arange(16), step=0)
        return np.asarray(sample(keys_B, logits_BV, arrays)[0])

    keys_B = sample_keys(7, jnp.zeros(16, jnp.int32), jnp.arange(16), step=0)
    assert len({tuple(np.asarray(jax.random.key_data(k))) for k in keys_B}) == 16
    tokens = draw(7)
    assert len(set(tokens.tolist())) > 1
    np.testing.assert_array_equal(tokens, draw(7))


def test_sampled_frequencies_match_processed_distribution():
    # H0: tokens follow the processed distribution. Pearson chi-square at alpha = 0.001 over the kept tokens.
    # Power: against the untempered distribution on the same kept tokens (a missed temperature), effect size
    # w = sqrt(sum (p1 - p0)^2 / p0) over the kept tokens is computed below; with N = 20,000 the noncentral
    # chi-square power is asserted >= 0.999 (it is 1.0 to double precision: w = 0.206, lambda = N w^2 = 850,
    # critical value 16.27 at df 3).
    n, alpha = 20_000, 0.001
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.95)
    logits_1V = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]
    p0 = np.exp(np.asarray(processed_logprobs(logits_1V, sampling_arrays([params])))[0].astype(np.float64))
    kept = p0 > 0
    p1 = PROBS[kept] / PROBS[kept].sum()
    w2 = np.sum((p1 - p0[kept]) ** 2 / p0[kept])
    df = kept.sum() - 1
    critical = stats.chi2.ppf(1 - alpha, df)
    assert stats.ncx2.sf(critical, df, n * w2) >= 0.999

    keys_B = sample_keys(11, jnp.arange(n), jnp.zeros(n, jnp.int32), step=0)
    tokens_B, _ = jax.jit(sample)(keys_B, jnp.broadcast_to(logits_1V, (n, 5)), sampling_arrays([params] * n))
    counts = np.bincount(np.asarray(tokens_B), minlength=5)
    assert counts[~kept].sum() == 0
    statistic = np.sum((counts[kept] - n * p0[kept]) ** 2 / (n * p0[kept]))
    assert statistic < critical, (counts, n * p0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(n=0), "n="),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "u, expected",
    [
        # Probabilities [.1, .2, 0, .3, .4, 0]: cumulative .1, .3, .3, .6, 1, 1; token i holds [c_(i-1), c_i).
        (0.0, 0),
        (0.05, 0),
        (0.1, 1),  # an interval's right end belongs to the next token
        (0.29, 1),
        (0.31, 3),  # token 2 has probability 0: never drawn
        (0.61, 4),
        (1 - 2**-24, 4),  # the largest f32 below 1: the last token of positive probability, not token 5
    ],
)
def test_inverse_cdf_golden(u, expected):
    logp_1V = jnp.log(jnp.asarray([[0.1, 0.2, 0.0, 0.3, 0.4, 0.0]], jnp.float32))
    assert int(sampling.inverse_cdf(jnp.asarray([u], jnp.float32), logp_1V)[0]) == expected


def test_inverse_cdf_blocks_and_edges():
    # V = 300: blocks of 128, 128 and 44 (+ 84 padding). Mass on tokens 5, 127, 128 and 299 (.25 each), zero
    # elsewhere: cumulative .25 / .5 / .75 / 1 at those tokens, so u in [.25, .5) is token 127 (the last of
    # block 0), u in [.5, .75) token 128 (the first of block 1), u near 1 token 299; never a token of
    # probability 0 or a padding index.
    p_V = np.zeros(300, np.float32)
    p_V[[5, 127, 128, 299]] = 0.25
    u_B = jnp.asarray([0.0, 0.24, 0.25, 0.49, 0.5, 0.74, 0.75, 0.999, 1 - 2**-24], jnp.float32)
    logp_BV = jnp.broadcast_to(jnp.log(jnp.asarray(p_V))[None], (len(u_B), 300))
    got = np.asarray(sampling.inverse_cdf(u_B, logp_BV))
    np.testing.assert_array_equal(got, [5, 5, 127, 127, 128, 128, 299, 299, 299])
    # Unnormalised log-probs (all scaled by e^3) give the same tokens.
    np.testing.assert_array_equal(np.asarray(sampling.inverse_cdf(u_B, logp_BV + 3.0)), got)
    one = jnp.full((1, 300), -jnp.inf).at[0, 17].set(0.0)  # one token left
    assert int(sampling.inverse_cdf(jnp.asarray([0.99]), one)[0]) == 17
    # All tied: the token at the u-quantile (u = .5: cumulative 151/300 > 150/300 first at token 150).
    tied = jnp.zeros((3, 300))
    got = sampling.inverse_cdf(jnp.asarray([0.0, 0.5, 0.999]), tied)
    np.testing.assert_array_equal(np.asarray(got), [0, 150, 299])


def test_categorical_frequencies_across_blocks():
    # H0: tokens follow exp(logp) on a vocabulary of 3 blocks (mass on 6 tokens at block edges). Pearson
    # chi-square at alpha = 0.001 over the 6 cells, df 5, critical value 20.52. Power against uniform mass on
    # the 6 tokens (a search that ignored the probabilities): w^2 = sum (p1 - p0)^2 / p0 = 0.53 for p0 below,
    # lambda = N w^2 = 10,600 at N = 20,000, power 1.0 to double precision (asserted >= 0.999).
    n, alpha = 20_000, 0.001
    idx = np.array([0, 127, 128, 255, 256, 299])
    p0 = np.array([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    p1 = np.full(6, 1 / 6)
    critical = stats.chi2.ppf(1 - alpha, 5)
    assert stats.ncx2.sf(critical, 5, n * np.sum((p1 - p0) ** 2 / p0)) >= 0.999
    logp_V = np.full(300, -np.inf, np.float32)
    logp_V[idx] = np.log(p0)
    keys_B = sample_keys(5, jnp.arange(n), jnp.zeros(n, jnp.int32), step=0)
    tokens_B = jax.jit(sampling.categorical)(keys_B, jnp.broadcast_to(jnp.asarray(logp_V), (n, 300)))
    counts = np.bincount(np.asarray(tokens_B), minlength=300)
    assert counts.sum() == counts[idx].sum(), "a token of probability 0 was drawn"
    statistic = np.sum((counts[idx] - n * p0) ** 2 / (n * p0))
    assert statistic < critical, (counts[idx], n * p0)
