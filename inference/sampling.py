"""Sampling: per-request parameters as arrays, one processing order, one key per sample.

Dimension key: B batch (rows, one per sequence being decoded), V vocab.

Processing order, the same on every path (plain decoding, speculative verification, scoring):

1. temperature: logits / t. A row with t == 0 is greedy: its distribution is the one-hot on the argmax (the
   lowest index among tied maxima), and no division by zero happens.
2. top-k: keep the k most likely tokens (k == 0 is off).
3. top-p: over the top-k distribution renormalised and sorted by probability, keep the smallest prefix whose
   mass is >= top_p; the most likely token is always kept; top_p == 1 is off.
4. min-p: keep tokens whose probability is >= min_p * (the largest probability); min_p == 0 is off.
5. renormalise over the kept tokens; every other token gets log-prob -inf.

Ties are broken deterministically by token index: tokens are ranked by (probability descending, index
ascending), and top-k and top-p keep a prefix of that ranking, so of two tied tokens at the boundary the
lower index is kept.

Parameters are ``[B]`` arrays (`SamplingArrays`), so changing their values never retraces a jitted caller.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; `n` completions per prompt, reproducible from `seed`."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 256
    n: int = 1
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()
    # The request index the sampling keys fold in; None: the prompt's position in its submit call. A caller
    # that gives every prompt its own seed sets 0, so a prompt samples alike wherever it sits in a batch.
    key_index: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (use 0 for greedy decoding).")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (use 0 to turn top-k off).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (use 1.0 to turn top-p off).")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1] (use 0.0 to turn min-p off).")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1 (the number of completions per prompt).")
        if not isinstance(self.stop_tokens, tuple):
            raise TypeError(f"stop_tokens={self.stop_tokens!r} must be a tuple of token ids, e.g. (2,).")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed={self.seed!r} must be an int (any size).")
        if self.key_index is not None and not 0 <= self.key_index < 2**31:
            raise ValueError(f"key_index={self.key_index} must be None or in [0, 2**31).")

    @property
    def key_seed(self) -> int:
        """The int32 seed the sampling keys are built from: `seed` itself in [0, 2**31), else a hash of it
        into that range (never arithmetic that overflows)."""
        if 0 <= self.seed < 2**31:
            return self.seed
        return zlib.crc32(f"seed:{self.seed}".encode()) & 0x7FFFFFFF


class SamplingArrays(NamedTuple):
    """Per-row sampling parameters as arrays (a pytree): values change, shapes and traces do not."""

    temperature_B: jax.Array  # f32
    top_k_B: jax.Array  # i32, 0 = off
    top_p_B: jax.Array  # f32, 1 = off
    min_p_B: jax.Array  # f32, 0 = off


def sampling_arrays(params: Sequence[SamplingParams]) -> SamplingArrays:
    """One row per entry of `params` (repeat a request's params for each of its rows). Host (numpy)
    arrays: a jitted caller transfers them with its other inputs, so building them costs no dispatch."""
    return SamplingArrays(
        temperature_B=np.asarray([p.temperature for p in params], np.float32),
        top_k_B=np.asarray([p.top_k for p in params], np.int32),
        top_p_B=np.asarray([p.top_p for p in params], np.float32),
        min_p_B=np.asarray([p.min_p for p in params], np.float32),
    )


def _rank_order(logp_BV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token ids by (log-prob descending, index ascending), and each token's rank in that order."""
    order_BV = jnp.argsort(-logp_BV, axis=-1, stable=True)
    rank_BV = jnp.argsort(order_BV, axis=-1, stable=True)
    return order_BV, rank_BV


def _top_k_mask(rank_BV: jax.Array, top_k_B: jax.Array) -> jax.Array:
    return (top_k_B[:, None] == 0) | (rank_BV < top_k_B[:, None])


def _top_p_mask(
    probs_BV: jax.Array, keep_BV: jax.Array, order_BV: jax.Array, rank_BV: jax.Array, top_p_B: jax.Array
) -> jax.Array:
    """Keep a ranked prefix of the kept tokens whose mass (before each token) is < top_p of their total."""
    kept_probs_BV = jnp.where(keep_BV, probs_BV, 0.0)
    sorted_BV = jnp.take_along_axis(kept_probs_BV, order_BV, axis=-1)
    mass_before_sorted_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV
    mass_before_BV = jnp.take_along_axis(mass_before_sorted_BV, rank_BV, axis=-1)
    total_B = jnp.sum(kept_probs_BV, axis=-1)
    # top_p == 1 is off explicitly: rounding in the cumulative sum must not drop the tail.
    return (top_p_B[:, None] >= 1.0) | (mass_before_BV < (top_p_B * total_B)[:, None])


def _greedy_logp(logits_BV: jax.Array) -> jax.Array:
    vocab = logits_BV.shape[-1]
    onehot_BV = jax.nn.one_hot(jnp.argmax(logits_BV, axis=-1), vocab, dtype=jnp.bool_)
    return jnp.where(onehot_BV, 0.0, -jnp.inf)


def processed_logprobs(logits_BV: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """f32 log-probs of the distribution tokens are sampled from (module docstring: the order)."""
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = arrays.temperature_B == 0.0
    safe_temperature_B = jnp.where(greedy_B, 1.0, arrays.temperature_B)
    scaled_BV = logits_BV / safe_temperature_B[:, None]
    logp_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
    probs_BV = jnp.exp(logp_BV)

    def ranked_keep(_):
        order_BV, rank_BV = _rank_order(logp_BV)
        keep_BV = _top_k_mask(rank_BV, arrays.top_k_B)
        return keep_BV & _top_p_mask(probs_BV, keep_BV, order_BV, rank_BV, arrays.top_p_B)

    # Ranking sorts the vocabulary twice per row (most of a decode step at V = 8k on CPU): skipped when no
    # row uses top-k or top-p, where both masks are all true anyway (same result, bit for bit).
    filtered = jnp.any(arrays.top_k_B > 0) | jnp.any(arrays.top_p_B < 1.0)

    def kept(_):
        keep_BV = jax.lax.cond(filtered, ranked_keep, lambda _: jnp.ones(probs_BV.shape, bool), None)
        max_prob_B = jnp.max(probs_BV, axis=-1)
        keep_BV &= probs_BV >= (arrays.min_p_B * max_prob_B)[:, None]
        return jax.nn.log_softmax(jnp.where(keep_BV, scaled_BV, -jnp.inf), axis=-1)

    # With no filter on any row every token is kept, and renormalising over all of them is logp_BV itself
    # (the same log_softmax of the same values): skipped, as the greedy rows' one-hot is when none is greedy.
    processed_BV = jax.lax.cond(filtered | jnp.any(arrays.min_p_B > 0.0), kept, lambda _: logp_BV, None)
    greedy = lambda _: jnp.where(greedy_B[:, None], _greedy_logp(logits_BV), processed_BV)
    return jax.lax.cond(jnp.any(greedy_B), greedy, lambda _: processed_BV, None)


def raw_logprobs(logits_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """f32 log-probs of `tokens_B` under the untempered, unfiltered softmax of the logits: `log_softmax`'s
    arithmetic (shift by the row max, subtract the log-sum-exp) on the chosen logits only."""
    x_BV = logits_BV.astype(jnp.float32)
    max_B = jax.lax.stop_gradient(jnp.max(x_BV, axis=-1))
    lse_B = jnp.log(jnp.sum(jnp.exp(x_BV - max_B[:, None]), axis=-1))
    return (jnp.take_along_axis(x_BV, tokens_B[:, None], axis=-1)[:, 0] - max_B) - lse_B


INVERSION_BLOCK = 128  # tokens per block of `inverse_cdf`'s two-level search


def categorical(key_B: jax.Array, logp_BV: jax.Array) -> jax.Array:
    """One token per row drawn from exp(logp_BV) with that row's key, by inversion (`inverse_cdf`): one
    uniform per row. Gumbel-max (`jax.random.categorical`) hashes a threefry uniform per vocabulary entry;
    at 16 x 8192 that was 0.85 ms of a 9.4 ms decode step on the 2-core reference machine, this draw
    about 0.1 ms."""
    u_B = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(key_B)
    return inverse_cdf(u_B, logp_BV)


def inverse_cdf(u_B: jax.Array, logp_BV: jax.Array) -> jax.Array:
    """The token whose cumulative-probability interval [c_(i-1), c_i) holds u * c_V, per row: c_i is the sum
    of exp(logp) over tokens 0..i (unnormalised log-probs are fine), u in [0, 1). A two-level search: block
    sums of `INVERSION_BLOCK` tokens and their cumulative sums pick the block, then the cumulative sums
    inside it pick the token, so no pass over the vocabulary is sequential. A token of probability 0
    (log-prob -inf) is never returned: where f32 rounding puts u * c_V at or past the last cumulative sum,
    the last token (and block) of positive probability is taken. A row with no such token returns 0."""
    b, v = logp_BV.shape
    c = min(INVERSION_BLOCK, v)
    n = -(-v // c)
    p_BV = jnp.exp(logp_BV.astype(jnp.float32))
    p_BNC = jnp.pad(p_BV, ((0, 0), (0, n * c - v))).reshape(b, n, c)
    block_BN = jnp.sum(p_BNC, axis=-1)
    cum_BN = jnp.cumsum(block_BN, axis=-1)
    target_B = u_B.astype(jnp.float32) * cum_BN[:, -1]
    last_positive = lambda x: jnp.max(jnp.where(x > 0, jnp.arange(x.shape[-1]), 0), axis=-1)
    block_B = jnp.minimum(jnp.sum(cum_BN <= target_B[:, None], axis=-1), last_positive(block_BN))
    before_B = jnp.where(block_B > 0, jnp.take_along_axis(cum_BN, (block_B - 1)[:, None], axis=1)[:, 0], 0.0)
    p_BC = jnp.take_along_axis(p_BNC, block_B[:, None, None], axis=1)[:, 0]
    cum_BC = before_B[:, None] + jnp.cumsum(p_BC, axis=-1)
    index_B = jnp.minimum(jnp.sum(cum_BC <= target_B[:, None], axis=-1), last_positive(p_BC))
    return (block_B * c + index_B).astype(jnp.int32)


def sample_from_logprobs(key_B: jax.Array, logp_BV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row from its own key, with its log-prob under `logp_BV`."""
    tokens_B = categorical(key_B, logp_BV)
    return tokens_B, jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]


def sample(key_B: jax.Array, logits_BV: jax.Array, arrays: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row; returns (tokens_B i32, logprob_B f32 under the processed distribution)."""
    return sample_from_logprobs(key_B, processed_logprobs(logits_BV, arrays))


def sample_keys(
    seed: int | jax.Array, request_ids_B: jax.Array, sample_index_B: jax.Array, step: int | jax.Array
) -> jax.Array:
    """A distinct key per (request, sample, step), derived from `seed` alone: runs are reproducible.

    Folding in the sample index means the n samples of one prompt never share a key.
    """
    base = jax.random.key(seed)
    step_B = jnp.broadcast_to(jnp.asarray(step, jnp.int32), request_ids_B.shape)

    def one(request_id: jax.Array, sample_index: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(base, request_id)
        return jax.random.fold_in(jax.random.fold_in(key, sample_index), step)

    return jax.vmap(one)(request_ids_B, sample_index_B, step_B)
