"""Chunked (O(T)-memory) attention against pallas_kernels.reference: forward o and lse, gradients by
the custom VJP and by `chunked_attention_bwd` called directly, the ring-attention use of its parts,
fully masked rows, block skipping, errors, and compiled temp memory."""

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.blocks import BlockSizes
from pallas_kernels.chunked_attention import (
    _live_blocks,
    _Side,
    _side,
    _Static,
    chunked_attention,
    chunked_attention_bwd,
    chunked_attention_fwd,
)
from pallas_kernels.mask import Mask, allowed

# f32: the same terms as the reference, summed in blocks and in another order (max error seen 1.2e-6).
F32_TOL = 1e-5
# bf16: both sides round o, dq, dk, dv to bf16, and ours feeds p and ds to the matmuls in bf16 where the
# reference keeps f32: at most one bf16 step (2^-8 relative) apart in what we saw, 1e-2 leaves ~2 steps.
BF16_TOL = 1e-2
TOL = {jnp.float32: F32_TOL, jnp.bfloat16: BF16_TOL}


class Case(NamedTuple):
    t: int
    s: int
    n: int
    k: int
    dtype: type
    causal: bool
    blocks: BlockSizes | None
    window: int | None = None
    segments: bool = False
    positions: str = "default"  # "default", "suffix" (queries are the last T of S keys), "zigzag"


CASES = {
    "t1": Case(1, 1, 2, 1, jnp.float32, True, BlockSizes(16, 16)),
    "t37_seg_mha": Case(37, 37, 4, 4, jnp.float32, True, BlockSizes(16, 32), segments=True),
    "t130_noncausal_seg_window": Case(
        130, 130, 4, 2, jnp.float32, False, BlockSizes(32, 16), window=9, segments=True
    ),
    "t130_window_gqa4_bf16": Case(130, 130, 8, 2, jnp.bfloat16, True, BlockSizes(32, 32), window=20),
    "cross_t37_s70_seg": Case(
        37, 70, 4, 2, jnp.float32, True, BlockSizes(16, 16), segments=True, positions="suffix"
    ),
    "t37_noncausal_seg_bf16": Case(37, 37, 4, 2, jnp.bfloat16, False, BlockSizes(16, 16), segments=True),
    "zigzag_t64": Case(64, 64, 4, 2, jnp.float32, True, BlockSizes(16, 16), positions="zigzag"),
    "default_blocks_t300": Case(300, 300, 2, 1, jnp.float32, True, None),
    # One block pair (no loops: the path of every short sequence), then one query block over 5 key blocks.
    "one_pair_t37_seg": Case(37, 37, 4, 2, jnp.float32, True, None, segments=True),
    "one_pair_cross_window": Case(
        20, 70, 4, 2, jnp.float32, True, BlockSizes(32, 128), window=9, positions="suffix"
    ),
    "one_q_block_cross_seg": Case(
        20, 70, 4, 2, jnp.float32, True, BlockSizes(32, 16), segments=True, positions="suffix"
    ),
}


def _zigzag(length: int, chunks: int) -> np.ndarray:
    """Token indices in the ring-attention zigzag order: chunk 0, chunk n-1, chunk 1, chunk n-2, ..."""
    order = [c for pair in zip(range(chunks // 2), range(chunks - 1, chunks // 2 - 1, -1)) for c in pair]
    return np.arange(length).reshape(chunks, -1)[order].reshape(-1)


def _inputs(case: Case, b: int = 2, h: int = 8, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, case.t, case.n, h)).astype(case.dtype)
    k = jax.random.normal(keys[1], (b, case.s, case.k, h)).astype(case.dtype)
    v = jax.random.normal(keys[2], (b, case.s, case.k, h)).astype(case.dtype)
    do = jax.random.normal(keys[3], (b, case.t, case.n, h)).astype(case.dtype)
    arrays = {}
    if case.positions == "suffix":
        arrays["q_positions"] = jnp.broadcast_to(jnp.arange(case.s - case.t, case.s)[None], (b, case.t))
        arrays["kv_positions"] = jnp.broadcast_to(jnp.arange(case.s)[None], (b, case.s))
    elif case.positions == "zigzag":
        arrays["q_positions"] = arrays["kv_positions"] = jnp.broadcast_to(
            _zigzag(case.t, 8)[None], (b, case.t)
        )
    if case.segments:  # two packed sequences per row, the split point differs per row
        splits = jnp.array([[1], [2]])
        pos_q = arrays.get("q_positions", jnp.arange(case.t)[None])
        pos_kv = arrays.get("kv_positions", jnp.arange(case.s)[None])
        arrays["segment_ids"] = (pos_q >= splits * case.s // 3).astype(jnp.int32)
        arrays["kv_segment_ids"] = (pos_kv >= splits * case.s // 3).astype(jnp.int32)
    return (q, k, v, do), arrays


def _everything(case: Case, qkv_do, arrays):
    """One jit per case: ours (o, lse, direct-bwd grads, VJP grads) and the reference (o, lse, grads)."""

    @jax.jit
    def run(q, k, v, do, arrays):
        mask = Mask(causal=case.causal, sliding_window=case.window, **arrays)
        o, lse = chunked_attention_fwd(q, k, v, mask, block_sizes=case.blocks)
        direct = chunked_attention_bwd(q, k, v, o, lse, do, mask, block_sizes=case.blocks)
        o_vjp, vjp = jax.vjp(
            lambda q, k, v: chunked_attention(q, k, v, mask, block_sizes=case.blocks), q, k, v
        )
        want_o, want_lse = reference.attention_reference(q, k, v, mask, return_lse=True)
        want_grads = reference.attention_reference_bwd(q, k, v, do, mask)
        return (o, lse, direct, o_vjp, vjp(do)), (want_o, want_lse, want_grads)

    return run(*qkv_do, arrays)


def _close(got, want, tol, what):
    chex.assert_trees_all_equal_dtypes(got, want)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(f32(got), f32(want), atol=tol, rtol=tol, err_msg=what)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    case = CASES[name]
    tol = TOL[case.dtype]
    qkv_do, arrays = _inputs(case)
    (o, lse, direct, o_vjp, vjp_grads), (want_o, want_lse, want_grads) = _everything(case, qkv_do, arrays)
    _close(o, want_o, tol, "o")
    np.testing.assert_array_equal(o_vjp, o)
    assert lse.dtype == jnp.float32
    np.testing.assert_allclose(lse, want_lse, atol=tol, rtol=tol, err_msg="lse")
    for what, got in (("direct bwd", direct), ("vjp", vjp_grads)):
        for d, g, w in zip("qkv", got, want_grads):
            _close(g, w, tol, f"{what} d{d}")


def test_ring_parts_over_two_key_halves_equal_the_whole():
    # Ring attention: forward per key block, merged by lse; backward per key block given the FINAL o, lse.
    case = Case(37, 50, 4, 2, jnp.float32, True, BlockSizes(16, 16), positions="suffix")
    (q, k, v, do), arrays = _inputs(case)
    q_pos, kv_pos = arrays["q_positions"], arrays["kv_positions"]
    halves = (slice(0, 25), slice(25, 50))  # equal shapes: one compile of each part serves both halves
    masks = [Mask(causal=True, q_positions=q_pos, kv_positions=kv_pos[:, h]) for h in halves]
    fwd = jax.jit(functools.partial(chunked_attention_fwd, block_sizes=case.blocks))
    parts = [fwd(q, k[:, h], v[:, h], mask) for h, mask in zip(halves, masks)]
    o, lse = reference.merge_partials(parts[0][0], parts[0][1], parts[1][0], parts[1][1])

    @jax.jit
    def want(q, k, v, do, q_pos, kv_pos):
        mask = Mask(causal=True, q_positions=q_pos, kv_positions=kv_pos)
        o, lse = reference.attention_reference(q, k, v, mask, return_lse=True)
        return o, lse, reference.attention_reference_bwd(q, k, v, do, mask)

    want_o, want_lse, (want_dq, want_dk, want_dv) = want(q, k, v, do, q_pos, kv_pos)
    np.testing.assert_allclose(o, want_o, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(lse, want_lse, atol=F32_TOL, rtol=F32_TOL)

    bwd = jax.jit(functools.partial(chunked_attention_bwd, block_sizes=case.blocks))
    (dq0, dk0, dv0), (dq1, dk1, dv1) = [
        bwd(q, k[:, h], v[:, h], o, lse, do, mask) for h, mask in zip(halves, masks)
    ]
    np.testing.assert_allclose(dq0 + dq1, want_dq, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(jnp.concatenate([dk0, dk1], 1), want_dk, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(jnp.concatenate([dv0, dv1], 1), want_dv, atol=F32_TOL, rtol=F32_TOL)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    case = Case(20, 20, 2, 1, jnp.float32, True, BlockSizes(8, 8))
    qkv_do, _ = _inputs(case)
    # Row 0: every key sits after every query (causal masks all). Row 1: queries 0..9 are in segment 7,
    # which no key has; queries 10.. see keys 0.. of segment 1.
    arrays = dict(
        kv_positions=jnp.stack([jnp.full((20,), 100), jnp.arange(20)]).astype(jnp.int32),
        segment_ids=jnp.stack([jnp.ones(20), jnp.where(jnp.arange(20) < 10, 7, 1)]).astype(jnp.int32),
        kv_segment_ids=jnp.ones((2, 20), jnp.int32),
    )
    (o, lse, direct, _, (dq, dk, dv)), (want_o, _, _) = _everything(case, qkv_do, arrays)
    chex.assert_tree_all_finite((o, lse, direct, dq, dk, dv))
    masked = np.array([[True] * 20, [True] * 10 + [False] * 10])
    np.testing.assert_array_equal(o[masked], 0.0)
    np.testing.assert_array_equal(lse[masked], reference.MASK_VALUE)
    np.testing.assert_array_equal(dq[masked], 0.0)
    np.testing.assert_array_equal(direct[0][masked], 0.0)
    np.testing.assert_array_equal(dk[0], 0.0)  # row 0 attends to no key at all
    np.testing.assert_array_equal(dv[0], 0.0)
    np.testing.assert_allclose(o, want_o, atol=F32_TOL, rtol=F32_TOL)


def _static(causal, window=None):
    return _Static(causal=causal, sliding_window=window, scale=1.0, block_q=16, block_kv=16)


def test_causal_skips_the_blocks_above_the_diagonal():
    pos = jnp.broadcast_to(jnp.arange(128)[None], (2, 128))
    side = _side(pos, None, 16)
    live = _live_blocks(side, side, _static(causal=True))
    np.testing.assert_array_equal(live, np.tril(np.ones((8, 8), bool)))  # 36 of 64 pairs: (n + 1) / 2n
    live = _live_blocks(side, side, _static(causal=True, window=20))
    np.testing.assert_array_equal(live, np.tril(np.ones((8, 8), bool)) & np.triu(np.ones((8, 8), bool), -2))


def test_skipped_blocks_are_never_computed():
    # NaN values in keys after every query: any computed block would spread them (0 * NaN in p @ v and
    # in do @ v^T), so finite o, dq and zero dk, dv there show the forward and backward skip those blocks.
    case = Case(16, 64, 2, 1, jnp.float32, True, BlockSizes(16, 16))
    (q, k, v, do), _ = _inputs(case)
    v = v.at[:, 32:].set(jnp.nan)

    @jax.jit
    def run(q, k, v, do):
        f = functools.partial(chunked_attention, mask=Mask(causal=True), block_sizes=case.blocks)
        o, vjp = jax.vjp(f, q, k, v)
        return o, vjp(do)

    o, (dq, dk, dv) = run(q, k, v, do)
    chex.assert_tree_all_finite((o, dq))
    np.testing.assert_array_equal(dk[:, 32:], 0.0)
    np.testing.assert_array_equal(dv[:, 32:], 0.0)
    np.testing.assert_allclose(
        o, reference.attention_reference(q, k[:, :16], v[:, :16], Mask(causal=True)), atol=F32_TOL
    )


def test_a_dead_single_pair_gives_the_skipped_result():
    # One block pair (16 queries, 16 keys) where every key comes after every query: the pair is computed
    # without a loop or cond, and its NaN values must not reach o or any gradient.
    case = Case(16, 16, 2, 1, jnp.float32, True, None)
    (q, k, v, do), _ = _inputs(case)
    v = v.at[:].set(jnp.nan)
    kv_pos = jnp.broadcast_to(jnp.arange(100, 116)[None], (2, 16))

    @jax.jit
    def run(q, k, v, do):
        mask = Mask(causal=True, kv_positions=kv_pos)
        o, vjp = jax.vjp(functools.partial(chunked_attention, mask=mask), q, k, v)
        lse = chunked_attention_fwd(q, k, v, mask)[1]
        return o, lse, vjp(do)

    o, lse, grads = run(q, k, v, do)
    np.testing.assert_array_equal(o, 0.0)
    np.testing.assert_array_equal(lse, reference.MASK_VALUE)
    for g in grads:
        np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 24])
def test_skipping_never_drops_an_allowed_pair(causal, window):
    # Zigzag positions with packed segments: every block pair with an allowed (query, key) is live.
    t, block = 128, 16
    pos = jnp.broadcast_to(_zigzag(t, 4)[None], (2, t))
    seg = (pos >= jnp.array([[30], [70]])).astype(jnp.int32)
    side: _Side = _side(pos, seg, block)
    live = _live_blocks(side, side, _static(causal, window))
    ok = allowed(
        pos[:, :, None],
        pos[:, None, :],
        seg[:, :, None],
        seg[:, None, :],
        causal=causal,
        sliding_window=window,
    )
    needed = ok.reshape(2, t // block, block, t // block, block).any(axis=(0, 2, 4))
    assert np.all(np.asarray(live) | ~np.asarray(needed))
    assert not np.all(live)  # and something is skipped


def test_bad_arguments_name_the_fix():
    q, k, v = jnp.zeros((2, 8, 3, 8)), jnp.zeros((2, 8, 2, 8)), jnp.zeros((2, 8, 2, 8))
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        chunked_attention(q, k, v, Mask(causal=True))
    q = q[:, :, :2]
    with pytest.raises(ValueError, match="segment_ids: shape"):
        chunked_attention(q, k, v, Mask(causal=True, segment_ids=jnp.zeros((8,), jnp.int32)))
    with pytest.raises(ValueError, match="kv_segment_ids: shape"):
        chunked_attention(q, k[:, :5], v[:, :5], Mask(causal=True, segment_ids=jnp.zeros((2, 8), jnp.int32)))
    with pytest.raises(ValueError, match="sliding_window"):
        chunked_attention(q, k, v, Mask(causal=True, sliding_window=0))
    with pytest.raises(ValueError, match="block_q=0: expected a positive int"):
        chunked_attention(q, k, v, Mask(causal=True), block_sizes=BlockSizes(0, 16))
    with pytest.raises(ValueError, match="lse"):
        chunked_attention_bwd(q, k, v, q, jnp.zeros((2, 8)), q, Mask(causal=True))


def _temp_bytes(fn, t: int) -> int:
    q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 1, 16), jnp.float32)
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, Mask(causal=True)))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temp_memory_grows_linearly_not_quadratically():
    # Measured on CPU: chunked 3.4 MB -> 6.6 MB (2.0x; per-block scores plus O(T) blocked copies);
    # the reference 176 MB -> 2.82 GB (16.0x, its T x S scores and probabilities).
    small, large = _temp_bytes(chunked_attention, 2048), _temp_bytes(chunked_attention, 8192)
    assert large <= 4.5 * small, (small, large)
