"""inference.speculative: exact rejection sampling, checked by chi-square against an enumerable target.

The tiny "models" are bigram tables over V = 5 tokens (row V is the start context): the target's next-token
distribution is p(. | previous token) and the draft's q(. | previous token), both processed with the same
temperature != 1, top-k and top-p, so the exact joint of the first two emitted tokens is p(a | s) p(b | a).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from inference.sampling import SamplingParams, processed_logprobs, sample_from_logprobs, sampling_arrays
from inference.speculative import verify

V = 5
START = V
ALPHA = 0.001
PARAMS = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)


def _tables(params: SamplingParams = PARAMS) -> tuple[jax.Array, jax.Array]:
    """Processed target and draft log-prob tables [V + 1, V]; the draft is far from the target."""
    rng = np.random.default_rng(0)
    target_logits = rng.normal(size=(V + 1, V)) * 1.5
    draft_logits = rng.normal(size=(V + 1, V)) * 1.5
    arrays = sampling_arrays([params] * (V + 1))
    return (
        processed_logprobs(jnp.asarray(target_logits, jnp.float32), arrays),
        processed_logprobs(jnp.asarray(draft_logits, jnp.float32), arrays),
    )


@functools.partial(jax.jit, static_argnames=("resample_from",))
def _round(key, context_B, p_table, q_table, resample_from):
    """One speculative round with K = 2 from `context_B`: draft two tokens, verify with one target call."""
    k0, k1, k2 = jax.random.split(key, 3)
    batch = context_B.shape[0]
    x0_B, _ = sample_from_logprobs(jax.random.split(k0, batch), q_table[context_B])
    x1_B, _ = sample_from_logprobs(jax.random.split(k1, batch), q_table[x0_B])
    draft_BK = jnp.stack([x0_B, x1_B], axis=1)
    q_BKV = jnp.stack([q_table[context_B], q_table[x0_B]], axis=1)
    p_BK1V = jnp.stack([p_table[context_B], p_table[x0_B], p_table[x1_B]], axis=1)
    return verify(k2, draft_BK, q_BKV, p_BK1V, _resample_from=resample_from)


def _first_two_tokens(key, n, p_table, q_table, resample_from):
    """(y0, y1) per sample; when round one rejects its first draft token, y1 is round two's first token."""
    key1, key2 = jax.random.split(key)
    accepted_B, tokens_BK1, _ = _round(key1, jnp.full((n,), START), p_table, q_table, resample_from)
    _, tokens2_BK1, _ = _round(key2, tokens_BK1[:, 0], p_table, q_table, resample_from)
    y1_B = jnp.where(accepted_B >= 1, tokens_BK1[:, 1], tokens2_BK1[:, 0])
    return np.asarray(tokens_BK1[:, 0]), np.asarray(y1_B)


def _biased_bracket(p_V: np.ndarray, q_V: np.ndarray) -> np.ndarray:
    """First-token law of the biased variant: accepted with min(p, q), else resampled from p."""
    overlap_V = np.minimum(p_V, q_V)
    return overlap_V + (1.0 - overlap_V.sum()) * p_V


def _chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, float, int]:
    """Pearson statistic over the cells with expected > 0; counts in zero cells are checked by the caller."""
    support = expected > 0
    statistic = np.sum((counts[support] - expected[support]) ** 2 / expected[support])
    df = int(support.sum()) - 1
    return float(statistic), float(stats.chi2.ppf(1 - ALPHA, df)), df


def _power(p0: np.ndarray, p1: np.ndarray, n: int) -> tuple[float, float]:
    """Effect size w and the power of the alpha-level chi-square test against p1 with n samples."""
    support = p0 > 0
    w2 = float(np.sum((p1[support] - p0[support]) ** 2 / p0[support]))
    df = int(support.sum()) - 1
    return np.sqrt(w2), float(stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA, df), df, n * w2))


def test_first_two_tokens_match_target_and_biased_variant_fails():
    # H0: the first emitted token follows p(. | s) and the first two follow p(a | s) p(b | a). Pearson
    # chi-square at alpha = 0.001 with N = 20,000 samples over the cells of nonzero probability (3 for the
    # first token, df 2; 9 for the pair, df 8); cells of zero probability must stay empty. The biased variant
    # (resample from p, not the residual) has first-token law min(p, q) + (1 - sum min(p, q)) p and, by the
    # same argument at each step, joint law bracket_s(a) bracket_a(b). With these tables its effect sizes are
    # w = 0.333 (first token, lambda = N w^2 = 2,217) and w = 0.508 (pair, lambda = 5,159): power 1.0 to
    # double precision, asserted >= 0.999 below. The test has power 0.99 against any w >= 0.042 (df 2) and
    # w >= 0.048 (df 8).
    n = 20_000
    p_table, q_table = _tables()
    p, q = np.exp(np.asarray(p_table, np.float64)), np.exp(np.asarray(q_table, np.float64))
    exact_first = p[START]
    exact_joint = p[START][:, None] * p[:V]
    biased_first = _biased_bracket(p[START], q[START])
    biased_joint = biased_first[:, None] * np.stack([_biased_bracket(p[a], q[a]) for a in range(V)])
    w_first, power_first = _power(exact_first, biased_first, n)
    w_joint, power_joint = _power(exact_joint.ravel(), biased_joint.ravel(), n)
    assert power_first >= 0.999 and power_joint >= 0.999, (w_first, power_first, w_joint, power_joint)

    for resample_from, should_pass in (("residual", True), ("p", False)):
        y0, y1 = _first_two_tokens(jax.random.key(0), n, p_table, q_table, resample_from)
        first_counts = np.bincount(y0, minlength=V)
        joint_counts = np.bincount(y0 * V + y1, minlength=V * V)
        assert first_counts[exact_first == 0].sum() == 0
        assert joint_counts[exact_joint.ravel() == 0].sum() == 0
        first_stat, first_critical, _ = _chi_square(first_counts, n * exact_first)
        joint_stat, joint_critical, _ = _chi_square(joint_counts, n * exact_joint.ravel())
        assert (first_stat < first_critical) == should_pass, (resample_from, first_stat, first_critical)
        assert (joint_stat < joint_critical) == should_pass, (resample_from, joint_stat, joint_critical)


# Under jit, as the engine runs it: op by op, each of its ~100 operations compiles on its own per shape.
_verify = jax.jit(verify, static_argnames=("_resample_from",))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _fixed_round(key, p_V, q_V, n, num_k):
    """Position-independent p and q: every draft token from q, every target position p."""
    key_draft, key_verify = jax.random.split(key)
    draft_BK = jax.random.categorical(key_draft, q_V, shape=(n, num_k)).astype(jnp.int32)
    q_BKV = jnp.broadcast_to(q_V[None, None], (n, num_k, V))
    p_BK1V = jnp.broadcast_to(p_V[None, None], (n, num_k + 1, V))
    return draft_BK, p_BK1V, _verify(key_verify, draft_BK, q_BKV, p_BK1V)


def test_q_equal_p_accepts_every_draft_token():
    p_table, _ = _tables()
    draft_BK, p_BK1V, (accepted_B, tokens_BK1, logp_BK1) = _fixed_round(
        jax.random.key(1), p_table[START], p_table[START], 4096, 3
    )
    np.testing.assert_array_equal(np.asarray(accepted_B), 3)
    np.testing.assert_array_equal(np.asarray(tokens_BK1[:, :3]), np.asarray(draft_BK))
    expected_BK1 = jnp.take_along_axis(p_BK1V, tokens_BK1[..., None], axis=-1)[..., 0]
    np.testing.assert_array_equal(np.asarray(logp_BK1), np.asarray(expected_BK1))
    assert np.all(np.isfinite(np.asarray(logp_BK1)))


def test_tokens_outside_target_support_are_never_emitted():
    # The target keeps 2 tokens (top_k = 2); the draft is uniform over all 5.
    p_V = processed_logprobs(
        jnp.log(jnp.asarray([[0.1, 0.4, 0.2, 0.25, 0.05]])), sampling_arrays([SamplingParams(top_k=2)])
    )[0]
    q_V = jnp.full((V,), -np.log(V), jnp.float32)
    _, _, (accepted_B, tokens_BK1, logp_BK1) = _fixed_round(jax.random.key(2), p_V, q_V, 4096, 3)
    emitted = np.arange(4)[None] <= np.asarray(accepted_B)[:, None]
    assert set(np.asarray(tokens_BK1)[emitted].tolist()) == {1, 3}
    assert np.all(np.isfinite(np.asarray(logp_BK1)[emitted]))


def test_accepted_count_distribution_matches_theory():
    # Position-independent p and q: each draft token is accepted independently with probability
    # a = sum min(p, q), so P(accepted = k) = a^k (1 - a) for k < K and a^K for k = K, and
    # E[accepted] = a (1 - a^K) / (1 - a). Chi-square at alpha = 0.001 with N = 20,000.
    n, num_k = 20_000, 4
    p_table, q_table = _tables()
    p_V, q_V = p_table[START], q_table[1]
    a = float(np.sum(np.minimum(np.exp(np.asarray(p_V, np.float64)), np.exp(np.asarray(q_V, np.float64)))))
    assert 0.2 < a < 0.9, a
    _, _, (accepted_B, _, _) = _fixed_round(jax.random.key(3), p_V, q_V, n, num_k)
    law = np.array([a**k * (1 - a) for k in range(num_k)] + [a**num_k])
    counts = np.bincount(np.asarray(accepted_B), minlength=num_k + 1)
    statistic, critical, _ = _chi_square(counts, n * law)
    assert statistic < critical, (counts, n * law)
    mean, expected_mean = float(np.mean(np.asarray(accepted_B))), a * (1 - a**num_k) / (1 - a)
    standard_error = np.sqrt(np.sum(law * (np.arange(num_k + 1) - expected_mean) ** 2) / n)
    assert abs(mean - expected_mean) < 5 * standard_error, (mean, expected_mean)


def test_greedy_accepts_iff_draft_is_target_argmax():
    batch, num_k = 64, 3
    k_target, k_draft, k_pick = jax.random.split(jax.random.key(4), 3)
    target_logits_BK1V = jax.random.normal(k_target, (batch, num_k + 1, V))
    target_argmax_BK1 = jnp.argmax(target_logits_BK1V, axis=-1)
    # Draft tokens agree with the target argmax 70% of the time, position by position.
    agree_BK = jax.random.bernoulli(k_pick, 0.7, (batch, num_k))
    draft_BK = jnp.where(agree_BK, target_argmax_BK1[:, :num_k], (target_argmax_BK1[:, :num_k] + 1) % V)
    draft_logits_BKV = jax.nn.one_hot(draft_BK, V) * 3.0 + jax.random.normal(k_draft, (batch, num_k, V)) * 0.1
    greedy = sampling_arrays([SamplingParams(temperature=0.0)] * batch * (num_k + 1))
    p_BK1V = processed_logprobs(target_logits_BK1V.reshape(-1, V), greedy).reshape(batch, num_k + 1, V)
    q_BKV = processed_logprobs(draft_logits_BKV.reshape(-1, V), _rows(greedy, batch * num_k))
    q_BKV = q_BKV.reshape(batch, num_k, V)
    accepted_B, tokens_BK1, logp_BK1 = _verify(jax.random.key(5), draft_BK, q_BKV, p_BK1V)
    expected_accepted_B = np.argmin(np.concatenate([np.asarray(agree_BK), np.zeros((batch, 1), bool)], 1), 1)
    np.testing.assert_array_equal(np.asarray(accepted_B), expected_accepted_B)
    rows = np.arange(batch)
    correction_B = np.asarray(tokens_BK1)[rows, expected_accepted_B]
    np.testing.assert_array_equal(correction_B, np.asarray(target_argmax_BK1)[rows, expected_accepted_B])
    np.testing.assert_array_equal(np.asarray(logp_BK1)[rows, expected_accepted_B], 0.0)


def _rows(arrays, count):
    return type(arrays)(*(field[:count] for field in arrays))


def test_ragged_num_draft():
    # q == p, so every row accepts exactly its own num_draft tokens, then a bonus token from p there.
    batch, num_k = 6, 4
    p_table, _ = _tables()
    p_V = p_table[START]
    draft_BK = jax.random.categorical(jax.random.key(6), p_V, shape=(batch, num_k)).astype(jnp.int32)
    num_draft_B = jnp.asarray([0, 1, 2, 3, 4, 2], jnp.int32)
    q_BKV = jnp.broadcast_to(p_V[None, None], (batch, num_k, V))
    p_BK1V = jnp.broadcast_to(p_V[None, None], (batch, num_k + 1, V))
    accepted_B, tokens_BK1, logp_BK1 = _verify(jax.random.key(7), draft_BK, q_BKV, p_BK1V, num_draft_B)
    np.testing.assert_array_equal(np.asarray(accepted_B), np.asarray(num_draft_B))
    for row, count in enumerate(np.asarray(num_draft_B)):
        np.testing.assert_array_equal(np.asarray(tokens_BK1[row, :count]), np.asarray(draft_BK[row, :count]))
        assert np.isfinite(float(logp_BK1[row, count]))
        np.testing.assert_array_equal(np.asarray(tokens_BK1[row, count + 1 :]), 0)
