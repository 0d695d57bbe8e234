"""Teacher-forced log-probs: the logits at position t score token t + k (k = 1 for the next token; MTP
depth d scores k = d + 1). One shift and one pick for every place that scores tokens it did not sample: the
model's next-token loss, the MTP loss, the trainer's log-probs (`rl.grpo.token_logprobs`) and the engine's
teacher-forced scoring (`inference.steps.score`).

Dimension key: B rows, T positions, V vocab.

Targets are shifted instead of logits sliced: slicing [:, :-k] copies the whole [B, T, V] tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def shifted(x_BT: jax.Array, k: int = 1) -> jax.Array:
    """x[:, t + k] at position t (the last k positions get 0; what they score is unused)."""
    return jnp.pad(x_BT[:, k:], ((0, 0), (0, k)))


def pick(values_BTV: jax.Array, ids_BT: jax.Array) -> jax.Array:
    """values[b, t, ids[b, t]]: the entry of each position's row that its target id names."""
    return jnp.take_along_axis(values_BTV, ids_BT[..., None], axis=-1)[..., 0]


def at_tokens(scores_BT: jax.Array, k: int = 1) -> jax.Array:
    """Scores computed at the predicting positions (t scores token t + k) moved to the scored tokens'
    positions; the first k positions, which nothing scores, get 0."""
    return jnp.pad(scores_BT[:, :-k], ((0, 0), (k, 0)))


def masked_nll(logits_BTV: jax.Array, tokens_BT: jax.Array, mask_BT=None, *, k: int = 1) -> jax.Array:
    """Mean cross-entropy of token t + k from the logits at t, over the positions whose target exists (and
    has mask[:, t + k] set)."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -pick(logp_BTV, shifted(tokens_BT, k))
    b, t = tokens_BT.shape
    valid_BT = jnp.broadcast_to(jnp.arange(t) < t - k, (b, t))
    if mask_BT is not None:
        valid_BT = valid_BT & shifted(mask_BT, k).astype(bool)
    weight_BT = valid_BT.astype(jnp.float32)
    return jnp.sum(nll_BT * weight_BT) / jnp.maximum(jnp.sum(weight_BT), 1.0)
