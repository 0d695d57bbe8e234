"""Ring attention over 2, 4 and 8 fake CPU devices equals full attention, forward and backward."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels import reference, ring_attention
from pallas_kernels.mask import Mask

# f32; the ring sums the same terms as the reference, merged per block through the lse.
ATOL = RTOL = 2e-5


def _mesh(p):
    return Mesh(np.asarray(jax.devices()[:p]), ("sequence",), axis_types=(AxisType.Auto,))


def _inputs(b, t, n, k, h, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h))
    kk = jax.random.normal(keys[1], (b, t, k, h))
    v = jax.random.normal(keys[2], (b, t, k, h))
    do = jax.random.normal(keys[3], (b, t, n, h))
    return q, kk, v, do


def _ring_fn(mesh, *, causal, layout, block_impl, with_segments, window=None):
    """Global-array function: (q, k, v, seg) in natural order -> o in natural order, via the ring."""
    p = mesh.shape["sequence"]
    seq = P(None, "sequence")
    heads = P(None, "sequence", None, None)

    def local(q, k, v, pos, seg):
        return ring_attention.ring_attention(
            q,
            k,
            v,
            Mask(
                causal=causal,
                segment_ids=seg if with_segments else None,
                q_positions=pos,
                kv_positions=pos,
                sliding_window=window,
            ),
            block_impl=block_impl,
        )

    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(heads, heads, heads, seq, seq), out_specs=heads, check_vma=False
    )

    def f(q, k, v, seg):
        b, t = q.shape[:2]
        if layout == "zigzag":
            z = lambda x: ring_attention.zigzag(x, p)  # noqa: E731
            pos = ring_attention.zigzag_positions(b, t, p)
            return ring_attention.unzigzag(sharded(z(q), z(k), z(v), pos, z(seg)), p)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        return sharded(q, k, v, pos, seg)

    return f


@pytest.mark.parametrize(
    "p,causal,layout,segments,window,block_impl",
    [
        (2, True, "contiguous", False, None, "reference"),
        (4, True, "zigzag", True, None, "reference"),
        (8, True, "zigzag", False, None, "reference"),
        (8, True, "contiguous", True, None, "reference"),
        (4, False, "contiguous", True, None, "reference"),
        (4, True, "contiguous", False, 5, "reference"),
        (8, True, "zigzag", True, None, "chunked"),
        (4, False, "contiguous", False, 9, "chunked"),
        (2, True, "zigzag", True, None, "flash"),
    ],
)
def test_ring_equals_full_attention(p, causal, layout, segments, window, block_impl):
    b, t = 2, 32
    q, k, v, do = _inputs(b, t, 4, 2, 8)
    seg = (jnp.arange(t)[None, :] >= jnp.array([[5], [19]])).astype(jnp.int32)
    mask = Mask(causal=causal, segment_ids=seg if segments else None, sliding_window=window)
    want_o, vjp = jax.vjp(lambda q, k, v: reference.attention_reference(q, k, v, mask), q, k, v)
    want_grads = vjp(do)

    f = _ring_fn(
        _mesh(p), causal=causal, layout=layout, block_impl=block_impl, with_segments=segments, window=window
    )
    got_o, vjp = jax.vjp(lambda q, k, v: jax.jit(f)(q, k, v, seg), q, k, v)
    np.testing.assert_allclose(got_o, want_o, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(vjp(do), want_grads, atol=ATOL, rtol=RTOL)


def test_zigzag_balances_causal_work():
    # Allowed (query, key) pairs per shard: contiguous shards are 1:3:5:7, zigzag shards all equal.
    t, p = 64, 4
    pos = np.arange(t)
    for layout, expect_equal in (("contiguous", False), ("zigzag", True)):
        order = ring_attention.zigzag_order(t, p) if layout == "zigzag" else pos
        work = [int(np.sum(order[i * 16 : (i + 1) * 16, None] >= pos[None, :])) for i in range(p)]
        assert (len(set(work)) == 1) == expect_equal, (layout, work)
    np.testing.assert_array_equal(
        ring_attention.unzigzag(ring_attention.zigzag(jnp.arange(t)[None], p), p)[0], np.arange(t)
    )


def test_zigzag_error_names_the_fix():
    with pytest.raises(ValueError, match="multiple of 2 \\* num_shards"):
        ring_attention.zigzag_order(30, 4)
