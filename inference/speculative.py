"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023): verify K draft tokens at once.

Dimension key: B batch, K draft tokens, K1 = K + 1 target positions, V vocab.

Both distributions are the processed ones (`inference.sampling.processed_logprobs`, same parameters), so the
emitted tokens follow the target's processed distribution exactly:

- draft token i (drawn from q_i) is accepted with probability min(1, p_i(x) / q_i(x)), in order; the first
  rejection stops;
- on a rejection at position j the correction is drawn from the normalised residual max(0, p_j - q_j) (from
  p_j when the residual is all zero, which happens only when p_j == q_j);
- when all draft tokens are accepted a bonus token is drawn from p at position num_draft.

Rows may carry fewer draft tokens than K (`num_draft_B`); positions past a row's count are ignored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from inference.sampling import categorical


def _residual_logp(target_logp_V: jax.Array, draft_logp_V: jax.Array) -> jax.Array:
    """log of the normalised max(0, p - q); log p where the residual has no mass."""
    residual_V = jnp.maximum(jnp.exp(target_logp_V) - jnp.exp(draft_logp_V), 0.0)
    total = jnp.sum(residual_V)
    return jnp.where(
        total > 0.0, jnp.log(residual_V) - jnp.log(jnp.where(total > 0.0, total, 1.0)), target_logp_V
    )


def _accepted_count(
    key: jax.Array, draft_tokens_K: jax.Array, draft_logp_KV: jax.Array, target_logp_KV: jax.Array, num_draft
) -> jax.Array:
    """Number of leading draft tokens accepted: u_i < p_i(x_i) / q_i(x_i), compared in log space."""
    num_k = draft_tokens_K.shape[0]
    q_K = jnp.take_along_axis(draft_logp_KV, draft_tokens_K[:, None], axis=-1)[:, 0]
    p_K = jnp.take_along_axis(target_logp_KV, draft_tokens_K[:, None], axis=-1)[:, 0]
    accept_K = jnp.log(jax.random.uniform(key, (num_k,))) < p_K - q_K
    accept_K &= jnp.arange(num_k) < num_draft
    return jnp.sum(jnp.cumprod(accept_K.astype(jnp.int32)))


def _verify_row(
    key: jax.Array,
    draft_tokens_K: jax.Array,
    draft_logp_KV: jax.Array,
    target_logp_K1V: jax.Array,
    num_draft: jax.Array,
    resample_from_residual: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    num_k = draft_tokens_K.shape[0]
    accept_key, correction_key = jax.random.split(key)
    accepted = _accepted_count(accept_key, draft_tokens_K, draft_logp_KV, target_logp_K1V[:num_k], num_draft)
    target_logp_V = target_logp_K1V[accepted]
    draft_logp_V = draft_logp_KV[jnp.minimum(accepted, num_k - 1)]
    rejected = accepted < num_draft
    if resample_from_residual:
        correction_logp_V = jnp.where(rejected, _residual_logp(target_logp_V, draft_logp_V), target_logp_V)
    else:
        correction_logp_V = target_logp_V
    correction = categorical(correction_key[None], correction_logp_V[None])[0]
    positions_K1 = jnp.arange(num_k + 1)
    padded_draft_K1 = jnp.concatenate([draft_tokens_K.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    tokens_K1 = jnp.where(positions_K1 < accepted, padded_draft_K1, 0)
    tokens_K1 = jnp.where(positions_K1 == accepted, correction, tokens_K1)
    logp_K1 = jnp.take_along_axis(target_logp_K1V, tokens_K1[:, None], axis=-1)[:, 0]
    return accepted, tokens_K1, jnp.where(positions_K1 <= accepted, logp_K1, 0.0)


def verify(
    key: jax.Array,
    draft_tokens_BK: jax.Array,
    draft_logp_BKV: jax.Array,
    target_logp_BK1V: jax.Array,
    num_draft_B: jax.Array | None = None,
    *,
    _resample_from: str = "residual",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verify draft tokens against the target; returns (accepted_B, out_tokens_BK1, out_logp_BK1).

    Args:
      key: one typed key (split per row) or one per row, shape [B].
      draft_tokens_BK: the drafted tokens, drawn from q.
      draft_logp_BKV: q, the draft's processed f32 log-probs at each drafted position.
      target_logp_BK1V: p, the target's processed f32 log-probs at the K + 1 positions.
      num_draft_B: drafted tokens per row (<= K); all K when None.
      _resample_from: "residual" (exact). "p" is a deliberately biased variant for the tests only.

    Returns:
      accepted_B: number of accepted draft tokens, 0..num_draft.
      out_tokens_BK1: the accepted draft tokens, then at position accepted the correction (or bonus) token;
        later positions are 0.
      out_logp_BK1: the target's processed log-prob of each emitted token; later positions are 0.
    """
    if _resample_from not in ("residual", "p"):
        raise ValueError(
            f"_resample_from={_resample_from!r} must be 'residual' (exact) or 'p' (biased, tests)."
        )
    batch, num_k = draft_tokens_BK.shape
    keys_B = jax.random.split(key, batch) if key.ndim == 0 else key
    if num_draft_B is None:
        num_draft_B = jnp.full((batch,), num_k, jnp.int32)

    def row(key, tokens_K, draft_logp_KV, target_logp_K1V, num_draft):
        return _verify_row(
            key, tokens_K, draft_logp_KV, target_logp_K1V, num_draft, _resample_from == "residual"
        )

    return jax.vmap(row)(
        keys_B,
        draft_tokens_BK,
        draft_logp_BKV.astype(jnp.float32),
        target_logp_BK1V.astype(jnp.float32),
        num_draft_B,
    )
