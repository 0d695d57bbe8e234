"""O(T)-memory attention in plain XLA: query blocks against key blocks with an online softmax.

Dimension key: B batch, T query tokens, S key tokens, N query heads, K kv heads, G = N // K query
heads per kv head, H head dim; I query blocks of X queries each (T padded to I * X), J key blocks of
Y keys each (S padded to J * Y).

The contract (layout, fully masked rows giving o = 0 and lse = MASK_VALUE) is `pallas_kernels.reference`,
the masking rule `pallas_kernels.mask`. This is the default attention on CPU for long
sequences and the per-block compute of ring attention, so the forward (with lse) and the backward
(given the final o and lse) are public on their own; `chunked_attention` ties them in a custom VJP.

Memory: the scores of one (query block, key block) pair at a time, [B, K, G, X, Y] in f32, plus O(T)
accumulators; the backward recomputes the probabilities from the saved lse. Pairs that the mask
rules out for every row of the batch (judged from the blocks' position / segment min and max) are
skipped with `lax.cond`, so causal attention does about half the score work.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.blocks import BlockSizes
from pallas_kernels.mask import Mask, allowed, blocks_may_attend
from pallas_kernels.reference import MASK_VALUE, check_shapes

# Queries and keys per block (block_q, block_kv; the other fields are flash's), clamped to T and S so short
# sequences use one block. Halving them doubles the loop steps; doubling them makes the f32 scores of one
# block pair, [B, K, G, X, Y], outgrow the CPU caches.
DEFAULT_BLOCK_SIZES = BlockSizes(block_q=256, block_kv=256)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that shapes the computation; hashable, so it is a nondiff argument of the VJP."""

    causal: bool
    sliding_window: int | None
    scale: float
    block_q: int
    block_kv: int


class _Side(NamedTuple):
    """One side (queries or keys) of the mask in blocks: [blocks, B, per block], and the static
    validity of each padded slot."""

    pos: jax.Array
    seg: jax.Array | None
    valid: np.ndarray


def _prepare(q_BTNH, k_BSKH, v_BSKH, mask: Mask, scale, block_sizes) -> tuple[_Static, Mask]:
    check_shapes(q_BTNH, k_BSKH, v_BSKH)
    mask = mask.filled(q_BTNH, k_BSKH)
    bs = DEFAULT_BLOCK_SIZES if block_sizes is None else block_sizes
    static = _Static(
        causal=mask.causal,
        sliding_window=mask.sliding_window,
        scale=float(q_BTNH.shape[3] ** -0.5 if scale is None else scale),
        block_q=min(bs.block_q, q_BTNH.shape[1]),
        block_kv=min(bs.block_kv, k_BSKH.shape[1]),
    )
    return static, mask


def _num_blocks(length: int, block: int) -> int:
    return -(-length // block)


def _pad_len(x, length: int, mode: str = "constant"):
    """Pads axis 1 up to `length`."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, mode=mode)


def _side(pos_BT, seg_BT, block: int) -> _Side:
    """Positions and segments in blocks [I, B, X]. Padded slots repeat the last real one ("edge"), so
    they leave each block's min and max, and hence the skipping test, unchanged."""
    t = pos_BT.shape[1]
    n = _num_blocks(t, block)

    def blocks(x_BT):
        x = _pad_len(x_BT, n * block, mode="edge")
        return jnp.transpose(x.reshape(x.shape[0], n, block), (1, 0, 2))

    valid_IX = (np.arange(n * block) < t).reshape(n, block)
    return _Side(blocks(pos_BT), None if seg_BT is None else blocks(seg_BT), valid_IX)


def _q_blocks(x_BTNH, kv: int, block: int):
    """[B, T, N, H] -> [I, B, K, G, X, H], zero padded: the G query heads of a kv head and the X
    queries of a block are adjacent rows of one matmul against that kv head's keys."""
    b, t, n, h = x_BTNH.shape
    i = _num_blocks(t, block)
    x = _pad_len(x_BTNH, i * block).reshape(b, i, block, kv, n // kv, h)
    return jnp.transpose(x, (1, 0, 3, 4, 2, 5))


def _q_unblocks(x_IBKGXH, t: int):
    i, b, kv, g, x, h = x_IBKGXH.shape
    return jnp.transpose(x_IBKGXH, (1, 0, 4, 2, 3, 5)).reshape(b, i * x, kv * g, h)[:, :t]


def _row_blocks(x_BTN, kv: int, block: int):
    """[B, T, N] -> [I, B, K, G, X], zero padded (lse, delta)."""
    b, t, n = x_BTN.shape
    i = _num_blocks(t, block)
    x = _pad_len(x_BTN, i * block).reshape(b, i, block, kv, n // kv)
    return jnp.transpose(x, (1, 0, 3, 4, 2))


def _row_unblocks(x_IBKGX, t: int):
    i, b, kv, g, x = x_IBKGX.shape
    return jnp.transpose(x_IBKGX, (1, 0, 4, 2, 3)).reshape(b, i * x, kv * g)[:, :t]


def _kv_blocks(x_BSKH, block: int):
    """[B, S, K, H] -> [J, B, K, Y, H], zero padded."""
    b, s, kv, h = x_BSKH.shape
    j = _num_blocks(s, block)
    x = _pad_len(x_BSKH, j * block).reshape(b, j, block, kv, h)
    return jnp.transpose(x, (1, 0, 3, 2, 4))


def _kv_unblocks(x_JBKYH, s: int):
    j, b, kv, y, h = x_JBKYH.shape
    return jnp.transpose(x_JBKYH, (1, 0, 3, 2, 4)).reshape(b, j * y, kv, h)[:, :s]


def _live_blocks(q: _Side, kv: _Side, st: _Static):
    """[I, J] bool: False where the mask rules out every (query, key) pair of the two blocks in every
    batch row. Conservative (intervals of positions), so a True pair may still be fully masked."""
    q_lo, q_hi = q.pos.min(-1)[:, None], q.pos.max(-1)[:, None]  # [I, 1, B]
    k_lo, k_hi = kv.pos.min(-1)[None], kv.pos.max(-1)[None]  # [1, J, B]
    segments = None
    if q.seg is not None:
        segments = (
            q.seg.min(-1)[:, None],
            q.seg.max(-1)[:, None],
            kv.seg.min(-1)[None],
            kv.seg.max(-1)[None],
        )
    live = blocks_may_attend(
        q_lo, q_hi, k_lo, k_hi, causal=st.causal, sliding_window=st.sliding_window, segments=segments
    )
    return live.any(-1)


def _block_mask(q_pos_BX, q_seg_BX, k_pos_BY, k_seg_BY, q_valid_X, k_valid_Y, st: _Static):
    """[B, 1, 1, X, Y] bool (broadcast over K and G). Padding is masked by the static slot
    validity, never by its positions, which repeat a real token's."""
    ok_BXY = allowed(
        q_pos_BX[:, :, None],
        k_pos_BY[:, None, :],
        None if q_seg_BX is None else q_seg_BX[:, :, None],
        None if k_seg_BY is None else k_seg_BY[:, None, :],
        causal=st.causal,
        sliding_window=st.sliding_window,
    )
    ok_BXY = ok_BXY & (q_valid_X[:, None] & k_valid_Y[None, :])[None]
    return ok_BXY[:, None, None]


def _scores(q_BKGXH, k_BKYH, st: _Static):
    s = jnp.einsum("bkgxh,bkyh->bkgxy", q_BKGXH, k_BKYH, preferred_element_type=jnp.float32)
    return s * st.scale


def _online_softmax_step(carry, q_BKGXH, k_BKYH, v_BKYH, ok, st: _Static):
    """Folds one key block into the running max m, denominator l and unnormalised output acc."""
    m_BKGX, l_BKGX, acc_BKGXH = carry
    s_BKGXY = jnp.where(ok, _scores(q_BKGXH, k_BKYH, st), MASK_VALUE)
    m_new = jnp.maximum(m_BKGX, s_BKGXY.max(-1))
    # The where matters while a row has seen only masked keys: then m_new is MASK_VALUE too, and exp is 1.
    p_BKGXY = jnp.where(ok, jnp.exp(s_BKGXY - m_new[..., None]), 0.0)
    alpha_BKGX = jnp.exp(m_BKGX - m_new)
    pv_BKGXH = jnp.einsum(
        "bkgxy,bkyh->bkgxh", p_BKGXY.astype(v_BKYH.dtype), v_BKYH, preferred_element_type=jnp.float32
    )
    return m_new, alpha_BKGX * l_BKGX + p_BKGXY.sum(-1), alpha_BKGX[..., None] * acc_BKGXH + pv_BKGXH


def _block_grads(q_BKGXH, k_BKYH, v_BKYH, do_BKGXH, lse_BKGX, delta_BKGX, ok, st: _Static):
    """(dq, dk, dv) of one block pair in f32, without the score scale on dq and dk."""
    f32 = jnp.float32
    # Masked entries may overflow to inf before the where; it selects 0 for them.
    p = jnp.where(ok, jnp.exp(_scores(q_BKGXH, k_BKYH, st) - lse_BKGX[..., None]), 0.0)
    dv_BKYH = jnp.einsum("bkgxy,bkgxh->bkyh", p.astype(do_BKGXH.dtype), do_BKGXH, preferred_element_type=f32)
    dp = jnp.einsum("bkgxh,bkyh->bkgxy", do_BKGXH, v_BKYH, preferred_element_type=f32)
    ds = p * (dp - delta_BKGX[..., None])
    dq_BKGXH = jnp.einsum("bkgxy,bkyh->bkgxh", ds.astype(k_BKYH.dtype), k_BKYH, preferred_element_type=f32)
    dk_BKYH = jnp.einsum("bkgxy,bkgxh->bkyh", ds.astype(q_BKGXH.dtype), q_BKGXH, preferred_element_type=f32)
    return dq_BKGXH, dk_BKYH, dv_BKYH


def _fwd_blocks(q_IBKGXH, k_JBKYH, v_JBKYH, qs: _Side, ks: _Side, live_IJ, st: _Static):
    """For each query block (a map), a scan over the key blocks; returns o [I, B, K, G, X, H] in q's
    dtype and lse [I, B, K, G, X] in f32."""

    def one_q_block(_, args):
        q_BKGXH, q_pos_BX, q_seg_BX, q_valid_X, live_J = args
        b, kv, g, x, h = q_BKGXH.shape
        m = jnp.full((b, kv, g, x), MASK_VALUE, jnp.float32)
        init = (m, jnp.zeros_like(m), jnp.zeros((b, kv, g, x, h), jnp.float32))

        def step(carry, kv_block):
            k_BKYH, v_BKYH, k_pos_BY, k_seg_BY, k_valid_Y, live = kv_block

            def attend(carry):
                ok = _block_mask(q_pos_BX, q_seg_BX, k_pos_BY, k_seg_BY, q_valid_X, k_valid_Y, st)
                return _online_softmax_step(carry, q_BKGXH, k_BKYH, v_BKYH, ok, st)

            return _when(live, attend, lambda c: c, carry, select=len(live_J) == 1), None

        xs = (k_JBKYH, v_JBKYH, ks.pos, ks.seg, ks.valid, live_J)
        (m_BKGX, l_BKGX, acc_BKGXH), _ = _scan(step, init, xs)
        seen = l_BKGX > 0
        l_BKGX = jnp.where(seen, l_BKGX, 1.0)
        o_BKGXH = acc_BKGXH / l_BKGX[..., None]
        lse_BKGX = jnp.where(seen, m_BKGX + jnp.log(l_BKGX), MASK_VALUE)
        return None, (o_BKGXH.astype(q_BKGXH.dtype), lse_BKGX)

    return _scan(one_q_block, None, (q_IBKGXH, qs.pos, qs.seg, qs.valid, live_IJ))[1]


def _scan(step, carry, xs):
    """`lax.scan(step, carry, xs)`; a scan of one step calls `step` once, with no loop to compile (every
    sequence up to a block long: one block pair). `xs` may hold None and numpy validity mask."""
    if jax.tree.leaves(xs)[0].shape[0] != 1:
        return lax.scan(step, carry, xs)
    carry, ys = step(carry, jax.tree.map(lambda a: a[0], xs))
    return carry, jax.tree.map(lambda a: a[None], ys)


def _when(live, fn, skip, *operands, select: bool):
    """`lax.cond(live, fn, skip, *operands)`. With `select` (a loop of one step, where the cond costs
    more to compile than one block pair costs to compute) both run and a select keeps one: a dead pair's
    values (even NaN) still never reach the result."""
    if not select:
        return lax.cond(live, fn, skip, *operands)
    return jax.tree.map(lambda a, b: jnp.where(live, a, b), fn(*operands), skip(*operands))


def _bwd_blocks(
    q_IBKGXH, k_JBKYH, v_JBKYH, do_IBKGXH, lse_IBKGX, delta_IBKGX, qs: _Side, ks: _Side, live_IJ, st: _Static
):
    """For each key block (outer scan, dq accumulated in the carry), a scan over the query blocks
    accumulating dk, dv. Returns unscaled f32 dq [I, B, K, G, X, H] and dk, dv [J, B, K, Y, H]."""

    def one_kv_block(dq_IBKGXH, kv_block):
        k_BKYH, v_BKYH, k_pos_BY, k_seg_BY, k_valid_Y, live_I = kv_block

        def step(dkv, q_block):
            q_BKGXH, do_BKGXH, lse_BKGX, delta_BKGX, q_pos_BX, q_seg_BX, q_valid_X, live, dq_BKGXH = q_block

            def add_grads(dkv, dq_BKGXH):
                ok = _block_mask(q_pos_BX, q_seg_BX, k_pos_BY, k_seg_BY, q_valid_X, k_valid_Y, st)
                dq, dk, dv = _block_grads(q_BKGXH, k_BKYH, v_BKYH, do_BKGXH, lse_BKGX, delta_BKGX, ok, st)
                return (dkv[0] + dk, dkv[1] + dv), dq_BKGXH + dq

            return _when(live, add_grads, lambda *a: a, dkv, dq_BKGXH, select=len(live_I) == 1)

        zeros_BKYH = jnp.zeros(k_BKYH.shape, jnp.float32)
        xs = (q_IBKGXH, do_IBKGXH, lse_IBKGX, delta_IBKGX, qs.pos, qs.seg, qs.valid, live_I, dq_IBKGXH)
        (dk_BKYH, dv_BKYH), dq_IBKGXH = _scan(step, (zeros_BKYH, zeros_BKYH), xs)
        return dq_IBKGXH, (dk_BKYH, dv_BKYH)

    dq_IBKGXH = jnp.zeros(q_IBKGXH.shape, jnp.float32)
    xs = (k_JBKYH, v_JBKYH, ks.pos, ks.seg, ks.valid, live_IJ.T)
    return _scan(one_kv_block, dq_IBKGXH, xs)


def _tie_to(mask: Mask, x: jax.Array) -> Mask:
    """The mask arrays, made to depend on `x` (q) through an optimization barrier.

    Under a `lax.scan` over layers the positions and segment ids are loop constants, and JAX's scan
    autodiff hoists every loop-invariant value out of the loop, computed for all iterations at once:
    here the [I, J] stack of block mask (and, through `lax.cond`, the score blocks), O(T^2) memory.
    Tied to q, they vary with the layer and stay inside the loop, block by block.
    """
    mask, _ = lax.optimization_barrier((mask, x))
    return mask


def _sides(mask: Mask, st: _Static):
    qs = _side(mask.q_positions, mask.segment_ids, st.block_q)
    ks = _side(mask.kv_positions, mask.kv_segment_ids, st.block_kv)
    return qs, ks, _live_blocks(qs, ks, st)


def _fwd(q_BTNH, k_BSKH, v_BSKH, mask: Mask, st: _Static):
    kv = k_BSKH.shape[2]
    qs, ks, live_IJ = _sides(_tie_to(mask, q_BTNH), st)
    o_IBKGXH, lse_IBKGX = _fwd_blocks(
        _q_blocks(q_BTNH, kv, st.block_q),
        _kv_blocks(k_BSKH, st.block_kv),
        _kv_blocks(v_BSKH, st.block_kv),
        qs,
        ks,
        live_IJ,
        st,
    )
    t = q_BTNH.shape[1]
    return _q_unblocks(o_IBKGXH, t), _row_unblocks(lse_IBKGX, t)


def _bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, do_BTNH, mask: Mask, st: _Static):
    t, kv = q_BTNH.shape[1], k_BSKH.shape[2]
    qs, ks, live_IJ = _sides(_tie_to(mask, q_BTNH), st)
    delta_BTN = jnp.einsum("btnh,btnh->btn", do_BTNH.astype(jnp.float32), o_BTNH.astype(jnp.float32))
    dq_IBKGXH, (dk_JBKYH, dv_JBKYH) = _bwd_blocks(
        _q_blocks(q_BTNH, kv, st.block_q),
        _kv_blocks(k_BSKH, st.block_kv),
        _kv_blocks(v_BSKH, st.block_kv),
        _q_blocks(do_BTNH, kv, st.block_q),
        _row_blocks(lse_BTN.astype(jnp.float32), kv, st.block_q),
        _row_blocks(delta_BTN, kv, st.block_q),
        qs,
        ks,
        live_IJ,
        st,
    )
    s = k_BSKH.shape[1]
    # The scale of the scores, applied once to the f32 sums rather than to every block of q or k.
    dq_BTNH = (_q_unblocks(dq_IBKGXH, t) * st.scale).astype(q_BTNH.dtype)
    dk_BSKH = (_kv_unblocks(dk_JBKYH, s) * st.scale).astype(k_BSKH.dtype)
    return dq_BTNH, dk_BSKH, _kv_unblocks(dv_JBKYH, s).astype(v_BSKH.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q_BTNH, k_BSKH, v_BSKH, mask: Mask, st: _Static):
    return _fwd(q_BTNH, k_BSKH, v_BSKH, mask, st)[0]


def _attention_fwd(q_BTNH, k_BSKH, v_BSKH, mask: Mask, st: _Static):
    o_BTNH, lse_BTN = _fwd(q_BTNH, k_BSKH, v_BSKH, mask, st)
    return o_BTNH, (q_BTNH, k_BSKH, v_BSKH, mask, o_BTNH, lse_BTN)


def _attention_bwd(st: _Static, res, do_BTNH):
    q_BTNH, k_BSKH, v_BSKH, mask, o_BTNH, lse_BTN = res
    dq, dk, dv = _bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, do_BTNH, mask, st)
    return dq, dk, dv, None  # integer mask arrays have no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def chunked_attention_fwd(
    q_BTNH, k_BSKH, v_BSKH, mask: Mask, *, scale: float | None = None, block_sizes: BlockSizes | None = None
) -> tuple[jax.Array, jax.Array]:
    """(o_BTNH in q's dtype, lse_BTN in f32)."""
    st, mask = _prepare(q_BTNH, k_BSKH, v_BSKH, mask, scale, block_sizes)
    return _fwd(q_BTNH, k_BSKH, v_BSKH, mask, st)


def chunked_attention_bwd(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    o_BTNH,
    lse_BTN,
    do_BTNH,
    mask: Mask,
    *,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) in the input dtypes, given the FINAL o and lse: ring attention passes the merged
    o / lse of all key blocks with only one of them, so delta = sum(do * o) and p = exp(s - lse) come
    from what is passed, not from these keys alone."""
    st, mask = _prepare(q_BTNH, k_BSKH, v_BSKH, mask, scale, block_sizes)
    if o_BTNH.shape != q_BTNH.shape or do_BTNH.shape != q_BTNH.shape or lse_BTN.shape != q_BTNH.shape[:3]:
        raise ValueError(
            f"o {o_BTNH.shape}, do {do_BTNH.shape}, lse {lse_BTN.shape}: expected o and do {q_BTNH.shape}"
            f" like q, lse {q_BTNH.shape[:3]} (q without H)"
        )
    return _bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, do_BTNH, mask, st)


def chunked_attention(
    q_BTNH, k_BSKH, v_BSKH, mask: Mask, *, scale: float | None = None, block_sizes: BlockSizes | None = None
) -> jax.Array:
    """o_BTNH (q's dtype), differentiable in q, k, v with the blocked backward (a custom VJP that
    saves q, k, v, o, lse and the int mask arrays, never the T x S probabilities)."""
    st, mask = _prepare(q_BTNH, k_BSKH, v_BSKH, mask, scale, block_sizes)
    return _attention(q_BTNH, k_BSKH, v_BSKH, mask, st)
