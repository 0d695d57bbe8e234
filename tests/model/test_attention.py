"""Attention implementations registered in model.attention agree with the einsum reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model
from configs import tiny
from model import attention

# f32; the blocked path sums the same terms as the reference, in blocks.
ATOL = RTOL = 1e-5


def _qkv(b, t, n, k, h, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (b, t, n, h)),
        jax.random.normal(keys[1], (b, t, k, h)),
        jax.random.normal(keys[2], (b, t, k, h)),
    )


@pytest.mark.parametrize("t", [5, 128, 300])
@pytest.mark.parametrize("segments", [False, True])
def test_query_blocked_equals_reference(t, segments):
    q, k, v = _qkv(2, t, 4, 2, 8)
    seg = None
    if segments:  # two packed sequences per row, the split point differs per row
        seg = (jnp.arange(t)[None, :] >= jnp.array([[t // 3], [t // 2]])).astype(jnp.int32)

    def run(fn):
        def f(q, k, v):
            o = fn(q, k, v, causal=True, segment_ids=seg)
            return jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)), o

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, o_ref), g_ref = run(attention.reference_attention)
    (_, o_blk), g_blk = run(attention.query_blocked_attention)
    np.testing.assert_allclose(o_blk, o_ref, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(g_blk, g_ref, atol=ATOL, rtol=RTOL)


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = _qkv(1, 4, 2, 1, 8)
    mask = jnp.zeros((1, 4, 4), bool).at[:, 1:].set(True)  # row 0 sees nothing
    o = attention._attend(q, k, v, mask)
    chex.assert_tree_all_finite(o)
    np.testing.assert_array_equal(o[:, 0], 0.0)


def test_model_gives_the_same_logits_and_gradients_with_every_impl(monkeypatch):
    monkeypatch.setattr(attention, "QUERY_BLOCK", 4)  # tiny sequences still span several blocks
    toks = jax.random.randint(jax.random.key(0), (2, 11), 0, 256, jnp.int32)
    seg = (jnp.arange(11)[None, :] >= jnp.array([[3], [7]])).astype(jnp.int32)  # packed rows
    out = {}
    for impl in sorted(attention.ATTENTION_IMPLS):
        cfg = tiny.get_config()
        cfg.model.attention_impl = impl
        graphdef, params, rest = nnx.split(model.build(cfg), nnx.Param, ...)

        def loss(params, graphdef=graphdef, rest=rest):
            logits, aux = nnx.merge(graphdef, params, rest)(toks, segment_ids=seg)
            return model.next_token_loss(logits, toks) + aux["moe_loss"], logits

        out[impl] = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    for impl, ((_, logits), grads) in out.items():
        (_, want_logits), want_grads = out["reference"]
        np.testing.assert_allclose(logits, want_logits, atol=ATOL, rtol=RTOL, err_msg=impl)
        chex.assert_trees_all_close(grads, want_grads, atol=ATOL, rtol=RTOL, custom_message=impl)
    assert {"chunked", "flash", "ring"} <= set(out)


@pytest.mark.parametrize("impl", ["chunked", "flash"])
def test_model_attention_memory_is_linear_in_length(impl):
    """Compiled temp memory of the tiny model's forward+backward (layers under lax.scan) grows ~4x
    when T grows 4x; with `reference` it grows ~16x. Guards against the scan hoisting the O(T^2)
    stack of block masks out of the layer loop (see chunked_attention._tie_to)."""
    temp = {}
    for t in (2048, 8192):
        cfg = tiny.get_config()
        cfg.model.attention_impl = impl
        assert cfg.model.scan_layers
        graphdef, params, rest = nnx.split(model.build(cfg), nnx.Param, ...)

        def loss(params, toks, graphdef=graphdef, rest=rest):
            logits, aux = nnx.merge(graphdef, params, rest)(toks)
            return model.next_token_loss(logits, toks) + aux["moe_loss"]

        toks = jax.ShapeDtypeStruct((1, t), jnp.int32)
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params, toks).compile()
        temp[t] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[8192] / temp[2048] <= 4.5, temp
