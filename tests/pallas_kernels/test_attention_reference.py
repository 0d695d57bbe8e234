"""The shared attention contract: the reference agrees with the model's attention, lse merges exactly,
and fully masked rows are finite zeros."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention
from pallas_kernels import reference
from pallas_kernels.mask import Mask

ATOL = RTOL = 1e-5  # f32; the same terms summed in a different order


def _qkv(b, t, s, n, k, h, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (b, t, n, h)),
        jax.random.normal(keys[1], (b, s, k, h)),
        jax.random.normal(keys[2], (b, s, k, h)),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_reference_equals_model_attention(causal):
    q, k, v = _qkv(2, 13, 13, 4, 2, 8)
    seg = (jnp.arange(13)[None, :] >= jnp.array([[4], [9]])).astype(jnp.int32)
    want = attention.reference_attention(q, k, v, causal=causal, segment_ids=seg)
    got = reference.attention_reference(q, k, v, Mask(causal=causal, segment_ids=seg))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_sliding_window_by_hand():
    # One head, H=1, q=k=1 everywhere: with window 2, row i averages v[i-1] and v[i] (v[0] alone for i=0).
    t = 5
    q = jnp.ones((1, t, 1, 1))
    k = jnp.ones((1, t, 1, 1))
    v = jnp.arange(t, dtype=jnp.float32).reshape(1, t, 1, 1)
    o = reference.attention_reference(q, k, v, Mask(causal=True, sliding_window=2))
    np.testing.assert_allclose(o[0, :, 0, 0], [0.0, 0.5, 1.5, 2.5, 3.5], atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_merging_two_key_halves_equals_full(causal):
    q, k, v = _qkv(2, 7, 10, 4, 1, 8, seed=1)
    full_o, full_lse = reference.attention_reference(q, k, v, Mask(causal=causal), return_lse=True)
    pos_kv = jnp.broadcast_to(jnp.arange(10)[None], (2, 10))
    parts = [
        reference.attention_reference(
            q, k[:, sl], v[:, sl], Mask(causal=causal, kv_positions=pos_kv[:, sl]), return_lse=True
        )
        for sl in (slice(0, 4), slice(4, 10))
    ]
    o, lse = reference.merge_partials(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    np.testing.assert_allclose(o, full_o, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(lse, full_lse, atol=ATOL, rtol=RTOL)


def test_fully_masked_rows_are_finite_zeros_and_merge_to_nothing():
    q, k, v = _qkv(1, 3, 4, 2, 1, 8)
    # Keys sit after every query: causal masks everything.
    o, lse = reference.attention_reference(
        q, k, v, Mask(causal=True, kv_positions=jnp.full((1, 4), 10, jnp.int32)), return_lse=True
    )
    np.testing.assert_array_equal(o, 0.0)
    np.testing.assert_array_equal(lse, reference.MASK_VALUE)
    o2, lse2 = reference.attention_reference(q, k, v, Mask(causal=False), return_lse=True)
    merged, merged_lse = reference.merge_partials(o, lse, o2, lse2)
    np.testing.assert_allclose(merged, o2, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(merged_lse, lse2, atol=ATOL, rtol=RTOL)
    (dq, dk, dv) = reference.attention_reference_bwd(
        q, k, v, jnp.ones_like(q), Mask(causal=True, kv_positions=jnp.full((1, 4), 10, jnp.int32))
    )
    chex.assert_tree_all_finite((dq, dk, dv))


def test_mismatched_heads_error_names_the_fix():
    q, k, v = _qkv(1, 3, 3, 3, 2, 8)
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        reference.attention_reference(q, k, v, Mask(causal=True))


@pytest.mark.parametrize("causal", [False, True])
def test_block_backward_from_lse_adds_up_to_the_full_gradient(causal):
    q, k, v = _qkv(2, 7, 10, 4, 2, 8, seed=2)
    do = jax.random.normal(jax.random.key(3), q.shape)
    o, lse = reference.attention_reference(q, k, v, Mask(causal=causal), return_lse=True)
    want = reference.attention_reference_bwd(q, k, v, do, Mask(causal=causal))
    pos_kv = jnp.broadcast_to(jnp.arange(10)[None], (2, 10))
    dq = jnp.zeros_like(q)
    dks, dvs = [], []
    for sl in (slice(0, 3), slice(3, 10)):
        dq_i, dk_i, dv_i = reference.attention_reference_bwd_from_lse(
            q, k[:, sl], v[:, sl], o, lse, do, Mask(causal=causal, kv_positions=pos_kv[:, sl])
        )
        dq, dks, dvs = dq + dq_i, dks + [dk_i], dvs + [dv_i]
    got = (dq, jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1))
    chex.assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
