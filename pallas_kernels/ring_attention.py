"""Ring attention: sequence-parallel attention inside `jax.shard_map` over one mesh axis.

Dimension key: B batch, T local query tokens, S local key tokens, N query heads, K kv heads, H head dim,
P devices on the ring.

Each device holds one block of queries and one block of keys/values. Over P steps the K/V blocks travel
around the ring (device i sends to i + 1); each step the `ppermute` for the next block is issued before
the current block's compute, so the transfer overlaps it. Partial results merge through their
log-sum-exp in f32 (`reference.merge_partials`). Causal and sliding-window masks use global token
indices (`q_positions` / `kv_positions`, default: contiguous shards), so any layout works, including
the load-balanced zigzag layout from `zigzag`. Key blocks that are wholly masked for this device's
queries are skipped with `lax.cond`.

The backward carries dk/dv accumulators around the ring with their K/V block: after P steps every
accumulator is back on the device that owns the block. Per-block work is done by a block kernel with
the package's fwd/bwd contract: `chunked` (plain XLA, O(T) memory; default), `flash` (Pallas), or
`reference` (einsum; for tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import chunked_attention, flash_attention, reference
from pallas_kernels.blocks import BlockSizes
from pallas_kernels.mask import Mask, blocks_may_attend


class _Static(NamedTuple):
    axis_name: str
    scale: float | None
    block_impl: str
    block_sizes: BlockSizes | None


def _reference_fwd(q, k, v, mask, *, scale, block_sizes):
    return reference.attention_reference(q, k, v, mask, scale=scale, return_lse=True)


def _reference_bwd(q, k, v, o, lse, do, mask, *, scale, block_sizes):
    return reference.attention_reference_bwd_from_lse(q, k, v, o, lse, do, mask, scale=scale)


# Block kernels by name: (fwd, bwd) with the package's contract, called as (..., mask, scale=, block_sizes=).
BLOCK_KERNELS = {
    "chunked": (chunked_attention.chunked_attention_fwd, chunked_attention.chunked_attention_bwd),
    "flash": (flash_attention.flash_attention_fwd, flash_attention.flash_attention_bwd),
    "reference": (_reference_fwd, _reference_bwd),
}


def _block_kernels(name: str):
    if name not in BLOCK_KERNELS:
        raise ValueError(f"block_impl={name!r}: use 'chunked', 'flash' or 'reference'")
    return BLOCK_KERNELS[name]


def _any_allowed(mask: Mask, kv_pos_BS) -> jax.Array:
    """False only when no (query, key) pair of the two blocks can be allowed (a conservative test)."""
    q_pos_BT = mask.q_positions
    return blocks_may_attend(
        jnp.min(q_pos_BT),
        jnp.max(q_pos_BT),
        jnp.min(kv_pos_BS),
        jnp.max(kv_pos_BS),
        causal=mask.causal,
        sliding_window=mask.sliding_window,
    )


def _ring_perm(axis_name: str) -> list[tuple[int, int]]:
    p = jax.lax.axis_size(axis_name)
    return [(i, (i + 1) % p) for i in range(p)]


def _with_keys(mask: Mask, kv_pos, kv_seg) -> Mask:
    """The mask of this device's queries against the key block now here."""
    return dataclasses.replace(mask, kv_positions=kv_pos, kv_segment_ids=kv_seg)


def _forward(st: _Static, q, k, v, mask: Mask):
    fwd, _ = _block_kernels(st.block_impl)
    perm = _ring_perm(st.axis_name)
    b, t, n, h = q.shape
    f32 = jnp.float32

    def block(kv_block):
        k_c, v_c, pos_c, seg_c = kv_block

        def compute():
            o_i, lse_i = fwd(
                q, k_c, v_c, _with_keys(mask, pos_c, seg_c), scale=st.scale, block_sizes=st.block_sizes
            )
            return o_i.astype(f32), lse_i

        def empty():
            return jnp.zeros((b, t, n, h), f32), jnp.full((b, t, n), reference.MASK_VALUE, f32)

        return jax.lax.cond(_any_allowed(mask, pos_c), compute, empty)

    def step(carry, _):
        kv_block, o, lse = carry
        # Issued before this block's compute, which does not depend on it: the transfer overlaps it.
        nxt = jax.lax.ppermute(kv_block, st.axis_name, perm)
        o, lse = reference.merge_partials(o, lse, *block(kv_block))
        return (nxt, o, lse), None

    init = (
        (k, v, mask.kv_positions, mask.kv_segment_ids),
        jnp.zeros((b, t, n, h), f32),
        jnp.full((b, t, n), reference.MASK_VALUE, f32),
    )
    p = jax.lax.axis_size(st.axis_name)
    (last, o, lse), _ = jax.lax.scan(step, init, None, length=p - 1)
    o, lse = reference.merge_partials(o, lse, *block(last))
    return o.astype(q.dtype), lse


def _backward(st: _Static, res, do):
    q, k, v, o, lse, mask = res
    _, bwd = _block_kernels(st.block_impl)
    perm = _ring_perm(st.axis_name)
    f32 = jnp.float32

    def block_grads(k_c, v_c, pos_c, seg_c):
        def compute():
            mask_c = _with_keys(mask, pos_c, seg_c)
            dq_i, dk_i, dv_i = bwd(
                q, k_c, v_c, o, lse, do, mask_c, scale=st.scale, block_sizes=st.block_sizes
            )
            return dq_i.astype(f32), dk_i.astype(f32), dv_i.astype(f32)

        def empty():
            return jnp.zeros(q.shape, f32), jnp.zeros(k_c.shape, f32), jnp.zeros(v_c.shape, f32)

        return jax.lax.cond(_any_allowed(mask, pos_c), compute, empty)

    def step(carry, _):
        (k_c, v_c, pos_c, seg_c), dk_acc, dv_acc, dq = carry
        kv_next = jax.lax.ppermute((k_c, v_c, pos_c, seg_c), st.axis_name, perm)
        dq_i, dk_i, dv_i = block_grads(k_c, v_c, pos_c, seg_c)
        # The accumulators travel with their K/V block; after P hops they are home again.
        dk_acc, dv_acc = jax.lax.ppermute((dk_acc + dk_i, dv_acc + dv_i), st.axis_name, perm)
        return (kv_next, dk_acc, dv_acc, dq + dq_i), None

    kv_block = (k, v, mask.kv_positions, mask.kv_segment_ids)
    init = (kv_block, jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32), jnp.zeros(q.shape, f32))
    p = jax.lax.axis_size(st.axis_name)
    (_, dk, dv, dq), _ = jax.lax.scan(step, init, None, length=p)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: _Static, q, k, v, mask: Mask):
    return _forward(st, q, k, v, mask)[0]


def _ring_fwd(st, q, k, v, mask: Mask):
    o, lse = _forward(st, q, k, v, mask)
    return o, (q, k, v, o, lse, mask)


_ring.defvjp(_ring_fwd, _backward)


def ring_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    mask: Mask,
    *,
    axis_name: str = "sequence",
    scale: float | None = None,
    block_impl: str = "chunked",
    block_sizes: BlockSizes | None = None,
):
    """Attention over the whole sequence from this device's shard; call inside `jax.shard_map`.

    Arguments are the local shards ([B, T, ...] of a sequence of P * T tokens). Positions are global
    token indices; by default shard i holds tokens i*T .. i*T + T - 1 (pass `zigzag_positions` sharded
    the same way as the zigzag-ordered tokens for the balanced layout). Returns the local o_BTNH.
    """
    reference.check_shapes(q_BTNH, k_BSKH, v_BSKH)
    _block_kernels(block_impl)
    b, t, s = q_BTNH.shape[0], q_BTNH.shape[1], k_BSKH.shape[1]
    idx = jax.lax.axis_index(axis_name)
    if mask.q_positions is None:
        mask = dataclasses.replace(
            mask, q_positions=jnp.broadcast_to((idx * t + jnp.arange(t, dtype=jnp.int32))[None], (b, t))
        )
    if mask.kv_positions is None:
        mask = dataclasses.replace(
            mask, kv_positions=jnp.broadcast_to((idx * s + jnp.arange(s, dtype=jnp.int32))[None], (b, s))
        )
    st = _Static(axis_name, scale, block_impl, block_sizes)
    return _ring(st, q_BTNH, k_BSKH, v_BSKH, mask.filled(q_BTNH, k_BSKH))


def zigzag_order(t: int, num_shards: int) -> np.ndarray:
    """Token order of the zigzag layout: the sequence cut into 2P chunks, shard i holding chunks i and
    2P-1-i, so that every shard gets the same amount of causal work. `x[:, zigzag_order(...)]`."""
    if t % (2 * num_shards):
        raise ValueError(
            f"zigzag layout: sequence length {t} must be a multiple of 2 * num_shards = {2 * num_shards}; "
            "pad the sequence"
        )
    c = t // (2 * num_shards)
    chunks = [j for i in range(num_shards) for j in (i, 2 * num_shards - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def zigzag(x, num_shards: int, axis: int = 1):
    """Reorders a [B, T, ...] array (tokens, positions, segment ids, targets) into the zigzag layout."""
    return jnp.take(x, zigzag_order(x.shape[axis], num_shards), axis=axis)


def unzigzag(x, num_shards: int, axis: int = 1):
    """Inverse of `zigzag`."""
    return jnp.take(x, np.argsort(zigzag_order(x.shape[axis], num_shards)), axis=axis)


def zigzag_positions(b: int, t: int, num_shards: int) -> jax.Array:
    """Global token indices [B, T] in zigzag order: pass (sharded) as q_positions and kv_positions."""
    return jnp.broadcast_to(jnp.asarray(zigzag_order(t, num_shards), jnp.int32)[None], (b, t))
