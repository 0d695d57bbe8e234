"""The Pallas flash attention kernels (interpret mode on CPU) against `pallas_kernels.reference`.

Dimension key: B batch, T query tokens, S key tokens, N query heads, K kv heads, H head dim.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_attention as fa
from pallas_kernels import reference
from pallas_kernels.blocks import BlockSizes
from pallas_kernels.mask import Mask

# f32: the same terms summed blockwise in another order (online softmax, per-block dq/dk/dv sums).
TOL_F32 = dict(atol=1e-5, rtol=1e-5)
# bf16: outputs are rounded to bf16 (step 2^-8 relative) and p, ds are rounded to bf16 before the second
# matmuls, as in every flash kernel; the kernel lands within one or two bf16 steps of the reference.
TOL_BF16 = dict(atol=1e-2, rtol=1e-2)
# lse is f32 in both, computed from the same (possibly bf16) inputs with f32 scores.
TOL_LSE = TOL_F32

SMALL_BLOCKS = BlockSizes(
    block_q=16, block_kv=16, block_q_dkv=16, block_kv_dkv=32, block_q_dq=32, block_kv_dq=16
)
MIXED_BLOCKS = BlockSizes(
    block_q=32, block_kv=16, block_q_dkv=32, block_kv_dkv=16, block_q_dq=16, block_kv_dq=32
)

# Jitted once per configuration: op-by-op dispatch would compile every reference op for every shape.
_reference = jax.jit(reference.attention_reference, static_argnames=("scale", "return_lse"))
_reference_bwd = jax.jit(reference.attention_reference_bwd, static_argnames=("scale",))


def _inputs(b, t, s, n, k, h, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h)).astype(dtype)
    kk = jax.random.normal(keys[1], (b, s, k, h)).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, k, h)).astype(dtype)
    do = jax.random.normal(keys[3], (b, t, n, h)).astype(dtype)
    return q, kk, v, do


def _positions(b, start, length):
    return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32)[None], (b, length))


def _packed_segments(splits_per_row, length):
    """int32 [B, length]: segment id = number of split points at or before the token (per row)."""
    splits = jnp.asarray(splits_per_row, jnp.int32)  # [B, num_splits]
    tokens = jnp.arange(length, dtype=jnp.int32)
    return jnp.sum(tokens[None, :, None] >= splits[:, None, :], axis=-1).astype(jnp.int32)


def _assert_close(got, want, dtype):
    tol = TOL_BF16 if dtype == jnp.bfloat16 else TOL_F32
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


def _check_fwd_and_bwd(q, k, v, do, block_sizes, **mask_kwargs):
    """o and lse from the forward kernel; dq, dk, dv from the backward kernels fed that o and lse."""
    mask = Mask(**mask_kwargs)
    o, lse = fa.flash_attention_fwd(q, k, v, mask, block_sizes=block_sizes)
    want_o, want_lse = _reference(q, k, v, mask, return_lse=True)
    chex.assert_trees_all_equal_shapes_and_dtypes((o, lse), (want_o, want_lse))
    _assert_close(o, want_o, q.dtype)
    np.testing.assert_allclose(lse, want_lse, **TOL_LSE)
    grads = fa.flash_attention_bwd(q, k, v, o, lse, do, mask, block_sizes=block_sizes)
    want_grads = _reference_bwd(q, k, v, do, mask)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, (q, k, v))
    for got, want in zip(grads, want_grads):
        _assert_close(got, want, q.dtype)
    return o, lse, grads


# (b, t, s, n, k, h, dtype, block sizes, query start): odd lengths, T = 1, S != T with queries at the end
# of the keys (explicit positions), GQA ratios 1, 2, 4, f32 and bf16, default, small and mixed blocks.
CASES = {
    "t37_g2_f32_small": (2, 37, 37, 4, 2, 8, jnp.float32, SMALL_BLOCKS, 0),
    "t70_g4_bf16_mixed": (1, 70, 70, 4, 1, 16, jnp.bfloat16, MIXED_BLOCKS, 0),
    "t1_g1_bf16_default": (2, 1, 1, 2, 2, 8, jnp.bfloat16, None, 0),
    "t20_s45_g2_f32_small": (2, 20, 45, 4, 2, 8, jnp.float32, SMALL_BLOCKS, 25),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, causal):
    b, t, s, n, k, h, dtype, blocks, q_start = CASES[case]
    q, kk, v, do = _inputs(b, t, s, n, k, h, dtype)
    _check_fwd_and_bwd(
        q,
        kk,
        v,
        do,
        blocks,
        causal=causal,
        q_positions=_positions(b, q_start, t),
        kv_positions=_positions(b, 0, s),
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_segments(causal):
    # Split points differ per row, and some fall inside a block, others on a block edge (16, 32).
    seg = _packed_segments([[5, 16, 30], [13, 14, 32]], 37)
    q, k, v, do = _inputs(2, 37, 37, 4, 2, 8)
    _check_fwd_and_bwd(q, k, v, do, SMALL_BLOCKS, causal=causal, segment_ids=seg)


@pytest.mark.parametrize(
    "causal,window,packed", [(True, 8, False), (False, 5, True)], ids=["causal_w8", "full_w5_packed"]
)
def test_sliding_window(causal, window, packed):
    # S != T: 20 queries at positions 25..44 over 45 keys, so the window cuts through several key blocks.
    q, k, v, do = _inputs(2, 20, 45, 4, 2, 8)
    masks = dict(q_positions=_positions(2, 25, 20), kv_positions=_positions(2, 0, 45))
    if packed:
        kv_seg = _packed_segments([[30, 40], [22, 37]], 45)
        masks.update(segment_ids=kv_seg[:, 25:], kv_segment_ids=kv_seg)
    _check_fwd_and_bwd(q, k, v, do, SMALL_BLOCKS, causal=causal, sliding_window=window, **masks)


def test_fully_masked_rows_are_finite_zeros():
    q, k, v, do = _inputs(2, 20, 40, 4, 2, 8)
    # Row 0: every key sits after every query (causal masks all). Row 1: every third query is in segment 9,
    # which no key belongs to; the other queries attend as usual.
    kv_pos = jnp.concatenate([_positions(1, 100, 40), _positions(1, 0, 40)])
    q_seg = jnp.where(jnp.arange(20)[None, :] % 3 == 0, 9, 1) * jnp.ones((2, 1), jnp.int32)
    dead_rows = np.asarray((q_seg == 9) | (jnp.arange(2)[:, None] == 0))
    masks = dict(
        causal=True, kv_positions=kv_pos, segment_ids=q_seg, kv_segment_ids=jnp.ones((2, 40), jnp.int32)
    )
    o, lse, grads = _check_fwd_and_bwd(q, k, v, do, SMALL_BLOCKS, **masks)
    chex.assert_tree_all_finite((o, lse, grads))
    np.testing.assert_array_equal(np.asarray(o)[dead_rows], 0.0)
    np.testing.assert_array_equal(np.asarray(lse)[dead_rows], reference.MASK_VALUE)
    np.testing.assert_array_equal(np.asarray(grads[0])[dead_rows], 0.0)
    np.testing.assert_array_equal(grads[1][0], 0.0)  # row 0's keys are seen by no query


def test_bwd_takes_the_merged_o_and_lse_of_split_keys():
    # Ring attention: each key chunk's forward, merged; each chunk's backward fed the merged o and lse.
    q, k, v, do = _inputs(2, 40, 40, 4, 2, 8, seed=3)
    kv_pos = _positions(2, 0, 40)
    chunks = [slice(0, 20), slice(20, 40)]  # not block aligned; equal, so each kernel compiles once
    masks = [Mask(causal=True, kv_positions=kv_pos[:, c]) for c in chunks]
    kw = dict(block_sizes=SMALL_BLOCKS)
    parts = [fa.flash_attention_fwd(q, k[:, c], v[:, c], mask, **kw) for c, mask in zip(chunks, masks)]
    o, lse = reference.merge_partials(*parts[0], *parts[1])
    want_o, want_lse = _reference(q, k, v, Mask(causal=True), return_lse=True)
    np.testing.assert_allclose(o, want_o, **TOL_F32)
    np.testing.assert_allclose(lse, want_lse, **TOL_F32)
    grads = [
        fa.flash_attention_bwd(q, k[:, c], v[:, c], o, lse, do, mask, **kw) for c, mask in zip(chunks, masks)
    ]
    dq = grads[0][0] + grads[1][0]
    dk = jnp.concatenate([grads[0][1], grads[1][1]], axis=1)
    dv = jnp.concatenate([grads[0][2], grads[1][2]], axis=1)
    for got, want in zip((dq, dk, dv), _reference_bwd(q, k, v, do, Mask(causal=True))):
        np.testing.assert_allclose(got, want, **TOL_F32)


def test_vjp_of_flash_attention_under_jit():
    q, k, v, do = _inputs(2, 37, 37, 4, 2, 8, seed=1)
    seg = _packed_segments([[9], [20]], 37)
    mask = Mask(causal=True, segment_ids=seg, sliding_window=5)
    attend = functools.partial(fa.flash_attention, mask=mask, block_sizes=SMALL_BLOCKS)

    @jax.jit
    def o_and_grads(q, k, v, do):
        o, vjp = jax.vjp(attend, q, k, v)
        return o, vjp(do)

    o, grads = o_and_grads(q, k, v, do)
    np.testing.assert_allclose(o, _reference(q, k, v, mask), **TOL_F32)
    for got, want in zip(grads, _reference_bwd(q, k, v, do, mask)):
        np.testing.assert_allclose(got, want, **TOL_F32)


def test_causal_skips_key_blocks_above_the_diagonal():
    # 4 x 4 blocks of 16: query block i needs key blocks 0..i, so 10 of 16 pairs; key block j is read by
    # query blocks j..3. A sliding window of 16 leaves the diagonal and the block just before it.
    st = fa._Static(causal=True, sliding_window=None, scale=1.0, t=64, s=64, has_segments=False)
    mask = Mask(causal=True, q_positions=_positions(1, 0, 64), kv_positions=_positions(1, 0, 64))
    live = fa._live_blocks(mask, st, 64, 64, 16, 16)
    np.testing.assert_array_equal(fa._live_range(live, axis=2), [0, 1, 0, 2, 0, 3, 0, 4])
    np.testing.assert_array_equal(fa._live_range(live, axis=1), [0, 4, 1, 4, 2, 4, 3, 4])
    windowed = fa._live_blocks(mask, st._replace(sliding_window=16), 64, 64, 16, 16)
    np.testing.assert_array_equal(fa._live_range(windowed, axis=2), [0, 1, 0, 2, 1, 3, 2, 4])


@pytest.mark.parametrize(
    "platform,target,kernel_call",
    [("gpu", "cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")],
)
def test_lowers_for_gpu_and_tpu(monkeypatch, platform, target, kernel_call):
    # Lowering only (no device here): Pallas -> Triton IR / Mosaic for the forward and both backward kernels.
    monkeypatch.setattr(fa, "_platform", lambda interpret, x: platform)
    q = jax.ShapeDtypeStruct((2, 200, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 200, 2, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 200), jnp.int32)

    def loss(q, k, v, seg):
        o = fa.flash_attention(q, k, v, Mask(causal=True, segment_ids=seg, sliding_window=64))
        return jnp.sum(o.astype(jnp.float32))

    exported = jax.export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
        platforms=[target],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(q, kv, kv, seg)
    assert exported.mlir_module().count(f"custom_call @{kernel_call}(") == 3  # forward, dq, dk/dv


def test_block_sizes_must_be_multiples_of_16():
    q, k, v, _ = _inputs(1, 16, 16, 2, 1, 8)
    with pytest.raises(ValueError, match="block_kv_dq=24"):
        fa.flash_attention(q, k, v, Mask(causal=True), block_sizes=BlockSizes(block_kv_dq=24))
