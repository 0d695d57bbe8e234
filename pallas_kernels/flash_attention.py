"""Flash attention in Pallas: a forward kernel and two backward kernels (dq; dk and dv), one custom_vjp.

Dimension key: B batch, T query tokens, S key tokens, N query heads, K kv heads, G = N // K query heads per
kv head, H head dim; in block tables Q query blocks, J key blocks. Suffix `_p` marks a length padded up to
a multiple of the block sizes.

The contract (layout, o = 0 and lse = MASK_VALUE for fully masked rows) is `reference.py`'s, the masking
rule `mask.py`'s; `flash_attention_reference` is the einsum reference.

Structure (Triton style, portable): internally q is [B, N, T, H] and k, v are [B, K, S, H]. The forward and
dq kernels run on a grid (B, N, query blocks), hold one query block and the whole key range of their kv head
(index map: query head // G, so K/V are never repeated), and loop over key blocks. The dk/dv kernel runs on
(B, K, key blocks), holds all G query heads of its kv head, and loops over query blocks and then heads, so
dk and dv come out per kv head. Lengths are padded up to the blocks; padded keys (and, in the backward,
padded queries) are masked by a static test on the token index and padded query rows are sliced off.

Block skipping: XLA computes, per block, the min / max of positions and segment ids, and from them which
(query block, key block) pairs can hold an allowed pair; each kernel loops only from the first to the last
live block of its row (`_live_range` tables), so causal attention does about half the work. The elementwise
mask is still applied inside, so the tables only need to be conservative.

Masks, positions and segment ids travel as int32 in blocked layouts, [B, Q, block, 1] for queries and
[B, J, 1, block] for keys, so each kernel reads (block_q, 1) and (1, block_kv) tiles that broadcast to the
score tile with no lane-dim dynamic slicing (TPU friendly). Backend-specific choices sit in `_backend`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import reference
from pallas_kernels.blocks import BlockSizes
from pallas_kernels.mask import Mask, allowed, blocks_may_attend

MASK_VALUE = reference.MASK_VALUE
flash_attention_reference = reference.attention_reference

_NT = (((1,), (1,)), ((), ()))  # a @ b.T: contract the head dim of both operands
_INT_MAX = jnp.iinfo(jnp.int32).max
_INT_MIN = jnp.iinfo(jnp.int32).min
# Smallest tile: Triton's tl.dot needs 16 on each side, and TPU tiles bf16 rows in 16s.
_MIN_BLOCK = 16


class _Backend(NamedTuple):
    interpret: bool
    compiler_params: Any
    table_memory_space: Any  # where the scalar block-range tables live (TPU: SMEM, to drive loop bounds)


class _Static(NamedTuple):
    """Everything a kernel needs to know at trace time (hashable: a jit static argument)."""

    causal: bool
    sliding_window: int | None
    scale: float
    t: int  # true lengths: tokens at or past them are padding
    s: int
    has_segments: bool


def _platform(interpret: bool | None, x) -> str:
    """'interpret', 'gpu' or 'tpu'. None: interpret on CPU (default backend, or the platform of x)."""
    if interpret:
        return "interpret"
    platform = jax.default_backend()
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        platform = next(iter(x.devices())).platform
    if platform == "cpu":
        if interpret is None:
            return "interpret"
        raise ValueError("flash attention on CPU runs only in interpret mode (interpret=None or True)")
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _backend(platform: str, head_dim: int) -> _Backend:
    """The only backend-specific code: compiler parameters and the memory space of the scalar tables."""
    if platform == "tpu":
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
        return _Backend(False, params, pltpu.SMEM)
    if platform == "gpu":
        # Wide heads want more warps per tile.
        params = pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)
        return _Backend(False, params, None)
    if platform == "interpret":
        return _Backend(True, None, None)
    raise ValueError(f"flash attention: no Pallas backend for platform {platform!r}")


def _fit(block: int, length: int) -> int:
    """The block, shrunk to the smallest power of two (>= _MIN_BLOCK) that covers a short sequence."""
    return min(block, max(_MIN_BLOCK, pl.next_power_of_2(length)))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_axis(x, axis: int, length: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _query_blocks(ids_BT, length_p: int, block: int):
    """int32 [B, T] -> [B, Q, block, 1]: each kernel reads a (block, 1) column of one query block."""
    b = ids_BT.shape[0]
    return _pad_axis(ids_BT.astype(jnp.int32), 1, length_p).reshape(b, length_p // block, block, 1)


def _key_blocks(ids_BS, length_p: int, block: int):
    """int32 [B, S] -> [B, J, 1, block]: each kernel reads a (1, block) row of one key block."""
    b = ids_BS.shape[0]
    return _pad_axis(ids_BS.astype(jnp.int32), 1, length_p).reshape(b, length_p // block, 1, block)


def _block_bounds(ids_BT, length: int, length_p: int, block: int):
    """(min, max) over each block's real tokens, [B, blocks] each; an all-padding block gives (MAX, MIN)."""
    b = ids_BT.shape[0]
    valid = (jnp.arange(length_p) < length)[None]
    ids = _pad_axis(ids_BT.astype(jnp.int32), 1, length_p)
    lo = jnp.where(valid, ids, _INT_MAX).reshape(b, length_p // block, block).min(-1)
    hi = jnp.where(valid, ids, _INT_MIN).reshape(b, length_p // block, block).max(-1)
    return lo, hi


def _live_blocks(mask: Mask, st: _Static, t_p: int, s_p: int, block_q: int, block_kv: int):
    """bool [B, Q, J]: whether query block i and key block j may hold an allowed pair (conservative)."""
    q_lo, q_hi = (x[:, :, None] for x in _block_bounds(mask.q_positions, st.t, t_p, block_q))
    k_lo, k_hi = (x[:, None, :] for x in _block_bounds(mask.kv_positions, st.s, s_p, block_kv))
    segments = None
    if st.has_segments:
        qs_lo, qs_hi = (x[:, :, None] for x in _block_bounds(mask.segment_ids, st.t, t_p, block_q))
        ks_lo, ks_hi = (x[:, None, :] for x in _block_bounds(mask.kv_segment_ids, st.s, s_p, block_kv))
        segments = (qs_lo, qs_hi, ks_lo, ks_hi)
    # Each block holds a real token; the rule's differences only matter where both do (padding may wrap).
    real = (q_lo <= q_hi) & (k_lo <= k_hi)
    may = blocks_may_attend(
        q_lo, q_hi, k_lo, k_hi, causal=st.causal, sliding_window=st.sliding_window, segments=segments
    )
    return real & may


def _live_range(live_BQJ, axis: int):
    """int32 [B * rows * 2]: [first, last + 1) of the live blocks along `axis` for each row; (0, 0) if none.

    Flat, so that on TPU it sits in scalar memory without per-dimension padding.
    """
    n = live_BQJ.shape[axis]
    any_live = live_BQJ.any(axis)
    first = jnp.argmax(live_BQJ, axis)
    last = n - jnp.argmax(jnp.flip(live_BQJ, axis), axis)
    return jnp.where(any_live[..., None], jnp.stack([first, last], -1), 0).astype(jnp.int32).reshape(-1)


def _loop_bounds(range_ref):
    """This program's [first, last + 1) block range from a flat `_live_range` table (rows: grid axis 2)."""
    row = pl.program_id(0) * pl.num_programs(2) + pl.program_id(2)
    return range_ref[2 * row], range_ref[2 * row + 1]


def _mask(qpos, kpos, qseg, kseg, q_start, kv_start, st: _Static, t_p: int, s_p: int, check_q: bool):
    """bool (block_q, block_kv) inside a kernel: the contract's mask and the padding tests."""
    ok = allowed(qpos, kpos, qseg, kseg, causal=st.causal, sliding_window=st.sliding_window)
    if st.s < s_p:
        ok = ok & (kv_start + lax.broadcasted_iota(jnp.int32, kpos.shape, 1) < st.s)
    if check_q and st.t < t_p:
        ok = ok & (q_start + lax.broadcasted_iota(jnp.int32, qpos.shape, 0) < st.t)
    return ok


def _read_ids(pos_ref, seg_ref, index):
    """The position (and segment, if any) tile at `index` of blocked id refs; `...` reads the whole ref."""
    return pos_ref[index], (None if seg_ref is None else seg_ref[index])


def _scores(q, k, st: _Static):
    return lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * st.scale


def _fwd_kernel(range_ref, q_ref, k_ref, v_ref, id_refs, o_ref, lse_ref, *, st, t_p, s_p):
    """One query block of one head against the live key blocks: online softmax with f32 accumulators."""
    i = pl.program_id(2)
    block_q, block_kv = q_ref.shape[0], id_refs.kv_pos.shape[2]
    q = q_ref[...]
    qpos, qseg = _read_ids(id_refs.q_pos, id_refs.q_seg, ...)

    def body(j, carry):
        m_prev, denom_prev, acc_prev = carry
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(kv_start, block_kv), :]
        v = v_ref[pl.ds(kv_start, block_kv), :]
        kpos, kseg = _read_ids(id_refs.kv_pos, id_refs.kv_seg, j)
        ok = _mask(qpos, kpos, qseg, kseg, i * block_q, kv_start, st, t_p, s_p, check_q=False)
        s = jnp.where(ok, _scores(q, k, st), MASK_VALUE)
        m = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        # `where`, not just exp: while a row has seen no allowed key, m is MASK_VALUE and exp(s - m) is 1.
        p = jnp.where(ok, jnp.exp(s - m), 0.0)
        alpha = jnp.exp(m_prev - m)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m, alpha * denom_prev + p.sum(axis=1, keepdims=True), alpha * acc_prev + pv

    init = (
        jnp.full((block_q, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    m, denom, acc = lax.fori_loop(*_loop_bounds(range_ref), body, init)
    seen = denom > 0.0
    denom_safe = jnp.where(seen, denom, 1.0)
    o_ref[...] = (acc / denom_safe).astype(o_ref.dtype)  # acc is 0 on fully masked rows
    lse_ref[...] = jnp.where(seen, m + jnp.log(denom_safe), MASK_VALUE)


def _dq_kernel(range_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, id_refs, dq_ref, *, st, t_p, s_p):
    """dq for one query block of one head: sum over live key blocks of ds @ k, ds = p * (do @ v.T - delta)."""
    i = pl.program_id(2)
    block_q, block_kv = q_ref.shape[0], id_refs.kv_pos.shape[2]
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    qpos, qseg = _read_ids(id_refs.q_pos, id_refs.q_seg, ...)

    def body(j, dq):
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(kv_start, block_kv), :]
        v = v_ref[pl.ds(kv_start, block_kv), :]
        kpos, kseg = _read_ids(id_refs.kv_pos, id_refs.kv_seg, j)
        ok = _mask(qpos, kpos, qseg, kseg, i * block_q, kv_start, st, t_p, s_p, check_q=True)
        p = jnp.where(ok, jnp.exp(_scores(q, k, st) - lse), 0.0)
        ds = p * (lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32) - delta)
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(*_loop_bounds(range_ref), body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    range_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, id_refs, dk_ref, dv_ref, *, st, t_p, s_p
):
    """dk, dv for one key block of one kv head: loops over live query blocks, then over its G query heads."""
    j = pl.program_id(2)
    num_heads, block_q, block_kv = q_ref.shape[0], id_refs.q_pos.shape[1], k_ref.shape[0]
    k, v = k_ref[...], v_ref[...]
    kpos, kseg = _read_ids(id_refs.kv_pos, id_refs.kv_seg, ...)

    def query_block(i, carry):
        q_start = pl.multiple_of(i * block_q, block_q)
        rows = pl.ds(q_start, block_q)
        qpos, qseg = _read_ids(id_refs.q_pos, id_refs.q_seg, i)
        ok = _mask(qpos, kpos, qseg, kseg, q_start, j * block_kv, st, t_p, s_p, check_q=True)

        def head(g, carry):
            dk, dv = carry
            q, do = q_ref[g, rows, :], do_ref[g, rows, :]
            p = jnp.where(ok, jnp.exp(_scores(q, k, st) - lse_ref[g, rows, :]), 0.0)
            dv = dv + jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
            dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_ref[g, rows, :])
            return dk + jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32), dv

        return lax.fori_loop(0, num_heads, head, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(*_loop_bounds(range_ref), query_block, (zeros, zeros))
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


class _Ids(NamedTuple):
    """Blocked int32 id arrays (or their BlockSpecs, or, in a kernel, their refs); segments may be None."""

    q_pos: Any
    kv_pos: Any
    q_seg: Any
    kv_seg: Any


def _id_inputs(mask: Mask, t_p: int, s_p: int, block_q: int, block_kv: int, q_whole: bool):
    """Blocked position / segment arrays and their BlockSpecs on a (B, heads, blocks) grid.

    q_whole: the kernel gets every query block (dk/dv kernel) and one key block; else the reverse.
    """
    q_seg, kv_seg, q_pos, kv_pos = mask.segment_ids, mask.kv_segment_ids, mask.q_positions, mask.kv_positions
    nq, nk = t_p // block_q, s_p // block_kv
    if q_whole:
        q_spec = pl.BlockSpec((None, nq, block_q, 1), lambda b, h, j: (b, 0, 0, 0))
        k_spec = pl.BlockSpec((None, None, 1, block_kv), lambda b, h, j: (b, j, 0, 0))
    else:
        q_spec = pl.BlockSpec((None, None, block_q, 1), lambda b, h, i: (b, i, 0, 0))
        k_spec = pl.BlockSpec((None, nk, 1, block_kv), lambda b, h, i: (b, 0, 0, 0))
    if q_seg is None:
        arrays = _Ids(_query_blocks(q_pos, t_p, block_q), _key_blocks(kv_pos, s_p, block_kv), None, None)
        return arrays, _Ids(q_spec, k_spec, None, None)
    arrays = _Ids(
        _query_blocks(q_pos, t_p, block_q),
        _key_blocks(kv_pos, s_p, block_kv),
        _query_blocks(q_seg, t_p, block_q),
        _key_blocks(kv_seg, s_p, block_kv),
    )
    return arrays, _Ids(q_spec, k_spec, q_spec, k_spec)


def _heads_first(x_BTNH, length_p: int):
    return _pad_axis(jnp.transpose(x_BTNH, (0, 2, 1, 3)), 2, length_p)


def _heads_last(x_BNTH, length: int):
    return jnp.transpose(x_BNTH[:, :, :length], (0, 2, 1, 3))


def _row_stat(x_BTN, length_p: int):
    """f32 [B, T, N] -> [B, N, T_p, 1]: per-row statistics read as (block_q, 1) tiles."""
    return _pad_axis(jnp.transpose(x_BTN.astype(jnp.float32), (0, 2, 1)), 2, length_p)[..., None]


def _call(kernel, backend: _Backend, grid, in_specs, out_specs, out_shape, name: str):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=backend.interpret,
        compiler_params=backend.compiler_params,
        name=name,
    )


def _fwd(q_BTNH, k_BSKH, v_BSKH, mask, st: _Static, blocks: BlockSizes, platform: str):
    b, t, n, h = q_BTNH.shape
    s, num_kv = k_BSKH.shape[1], k_BSKH.shape[2]
    g = n // num_kv
    backend = _backend(platform, h)
    block_q, block_kv = _fit(blocks.block_q, t), _fit(blocks.block_kv, s)
    t_p, s_p = _round_up(t, block_q), _round_up(s, block_kv)
    range_flat = _live_range(_live_blocks(mask, st, t_p, s_p, block_q, block_kv), axis=2)
    ids, id_specs = _id_inputs(mask, t_p, s_p, block_q, block_kv, q_whole=False)
    q_spec = pl.BlockSpec((None, None, block_q, h), lambda bi, hi, i: (bi, hi, i, 0))
    kv_spec = pl.BlockSpec((None, None, s_p, h), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0))
    row_spec = pl.BlockSpec((None, None, block_q, 1), lambda bi, hi, i: (bi, hi, i, 0))
    o_BNTH, lse_BNT1 = _call(
        functools.partial(_fwd_kernel, st=st, t_p=t_p, s_p=s_p),
        backend,
        grid=(b, n, t_p // block_q),
        in_specs=[pl.BlockSpec(memory_space=backend.table_memory_space), q_spec, kv_spec, kv_spec, id_specs],
        out_specs=[q_spec, row_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, n, t_p, h), q_BTNH.dtype),
            jax.ShapeDtypeStruct((b, n, t_p, 1), jnp.float32),
        ],
        name="flash_attention_fwd",
    )(range_flat, _heads_first(q_BTNH, t_p), _heads_first(k_BSKH, s_p), _heads_first(v_BSKH, s_p), ids)
    return _heads_last(o_BNTH, t), jnp.transpose(lse_BNT1[:, :, :t, 0], (0, 2, 1))


def _dq(q_BNTH, k_BKSH, v_BKSH, do_BNTH, lse_BNT1, delta_BNT1, mask, st, block_q, block_kv, backend):
    b, n, t_p, h = q_BNTH.shape
    s_p = k_BKSH.shape[2]
    g = n // k_BKSH.shape[1]
    range_flat = _live_range(_live_blocks(mask, st, t_p, s_p, block_q, block_kv), axis=2)
    ids, id_specs = _id_inputs(mask, t_p, s_p, block_q, block_kv, q_whole=False)
    q_spec = pl.BlockSpec((None, None, block_q, h), lambda bi, hi, i: (bi, hi, i, 0))
    kv_spec = pl.BlockSpec((None, None, s_p, h), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0))
    row_spec = pl.BlockSpec((None, None, block_q, 1), lambda bi, hi, i: (bi, hi, i, 0))
    table_spec = pl.BlockSpec(memory_space=backend.table_memory_space)
    return _call(
        functools.partial(_dq_kernel, st=st, t_p=t_p, s_p=s_p),
        backend,
        grid=(b, n, t_p // block_q),
        in_specs=[table_spec, q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, id_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_BNTH.shape, q_BNTH.dtype),
        name="flash_attention_dq",
    )(range_flat, q_BNTH, k_BKSH, v_BKSH, do_BNTH, lse_BNT1, delta_BNT1, ids)


def _dkv(q_BNTH, k_BKSH, v_BKSH, do_BNTH, lse_BNT1, delta_BNT1, mask, st, block_q, block_kv, backend):
    b, n, t_p, h = q_BNTH.shape
    num_kv, s_p = k_BKSH.shape[1], k_BKSH.shape[2]
    g = n // num_kv
    range_flat = _live_range(_live_blocks(mask, st, t_p, s_p, block_q, block_kv), axis=1)
    ids, id_specs = _id_inputs(mask, t_p, s_p, block_q, block_kv, q_whole=True)
    # Block index k along N selects query heads k*G .. k*G + G-1: the heads that read kv head k.
    q_spec = pl.BlockSpec((None, g, t_p, h), lambda bi, ki, j: (bi, ki, 0, 0))
    row_spec = pl.BlockSpec((None, g, t_p, 1), lambda bi, ki, j: (bi, ki, 0, 0))
    kv_spec = pl.BlockSpec((None, None, block_kv, h), lambda bi, ki, j: (bi, ki, j, 0))
    table_spec = pl.BlockSpec(memory_space=backend.table_memory_space)
    kv_shape = jax.ShapeDtypeStruct(k_BKSH.shape, k_BKSH.dtype)
    return _call(
        functools.partial(_dkv_kernel, st=st, t_p=t_p, s_p=s_p),
        backend,
        grid=(b, num_kv, s_p // block_kv),
        in_specs=[table_spec, q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, id_specs],
        out_specs=[kv_spec, kv_spec],
        out_shape=[kv_shape, jax.ShapeDtypeStruct(v_BKSH.shape, v_BKSH.dtype)],
        name="flash_attention_dkv",
    )(range_flat, q_BNTH, k_BKSH, v_BKSH, do_BNTH, lse_BNT1, delta_BNT1, ids)


def _bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, do_BTNH, mask, st, blocks: BlockSizes, platform: str):
    t, s, h = q_BTNH.shape[1], k_BSKH.shape[1], q_BTNH.shape[3]
    backend = _backend(platform, h)
    dq_blocks = _fit(blocks.block_q_dq, t), _fit(blocks.block_kv_dq, s)
    dkv_blocks = _fit(blocks.block_q_dkv, t), _fit(blocks.block_kv_dkv, s)
    # One padding serves both kernels.
    t_p = _round_up(t, math.lcm(dq_blocks[0], dkv_blocks[0]))
    s_p = _round_up(s, math.lcm(dq_blocks[1], dkv_blocks[1]))
    # delta = rowsum(do * o) = rowsum(p * dp): the softmax Jacobian's correction term, from the final o.
    delta_BTN = jnp.sum(do_BTNH.astype(jnp.float32) * o_BTNH.astype(jnp.float32), axis=-1)
    args = (
        _heads_first(q_BTNH, t_p),
        _heads_first(k_BSKH, s_p),
        _heads_first(v_BSKH, s_p),
        _heads_first(do_BTNH.astype(q_BTNH.dtype), t_p),
        _row_stat(lse_BTN, t_p),
        _row_stat(delta_BTN, t_p),
        mask,
        st,
    )
    dq_BNTH = _dq(*args, *dq_blocks, backend)
    dk_BKSH, dv_BKSH = _dkv(*args, *dkv_blocks, backend)
    return _heads_last(dq_BNTH, t), _heads_last(dk_BKSH, s), _heads_last(dv_BKSH, s)


def _prepare(q_BTNH, k_BSKH, v_BSKH, mask: Mask, scale, block_sizes, interpret):
    """The filled mask and the static arguments of the jitted paths: settings, block sizes, platform."""
    reference.check_shapes(q_BTNH, k_BSKH, v_BSKH)
    mask = mask.filled(q_BTNH, k_BSKH)
    st = _Static(
        causal=mask.causal,
        sliding_window=mask.sliding_window,
        scale=float(q_BTNH.shape[3] ** -0.5 if scale is None else scale),
        t=q_BTNH.shape[1],
        s=k_BSKH.shape[1],
        has_segments=mask.segment_ids is not None,
    )
    blocks = BlockSizes() if block_sizes is None else block_sizes
    for name, value in vars(blocks).items():
        if value % _MIN_BLOCK:
            raise ValueError(f"BlockSizes.{name}={value!r}: flash attention needs a multiple of {_MIN_BLOCK}")
    return mask, st, blocks, _platform(interpret, q_BTNH)


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _fwd_jit(q_BTNH, k_BSKH, v_BSKH, mask, st, blocks, platform):
    return _fwd(q_BTNH, k_BSKH, v_BSKH, mask, st, blocks, platform)


@functools.partial(jax.jit, static_argnums=(7, 8, 9))
def _bwd_jit(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, do_BTNH, mask, st, blocks, platform):
    return _bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, do_BTNH, mask, st, blocks, platform)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q_BTNH, k_BSKH, v_BSKH, mask, st, blocks, platform):
    return _fwd(q_BTNH, k_BSKH, v_BSKH, mask, st, blocks, platform)[0]


def _attention_fwd_rule(q_BTNH, k_BSKH, v_BSKH, mask, st, blocks, platform):
    o_BTNH, lse_BTN = _fwd(q_BTNH, k_BSKH, v_BSKH, mask, st, blocks, platform)
    return o_BTNH, (q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, mask)


def _attention_bwd_rule(st, blocks, platform, residuals, do_BTNH):
    q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, mask = residuals
    grads = _bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, do_BTNH, mask, st, blocks, platform)
    return (*grads, None)  # integer mask arrays: no cotangent


_attention.defvjp(_attention_fwd_rule, _attention_bwd_rule)
_attention_jit = jax.jit(_attention, static_argnums=(4, 5, 6))


def flash_attention_fwd(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    mask: Mask,
    *,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
):
    """Forward kernel: (o_BTNH in q's dtype, lse_BTN f32)."""
    return _fwd_jit(
        q_BTNH, k_BSKH, v_BSKH, *_prepare(q_BTNH, k_BSKH, v_BSKH, mask, scale, block_sizes, interpret)
    )


def flash_attention_bwd(
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
    interpret: bool | None = None,
):
    """Backward kernels: (dq, dk, dv) in the inputs' dtypes.

    o and lse are the FINAL attention output and log-sum-exp of these queries: with keys split across
    calls (ring attention), pass the merged o / lse and this call's keys; the gradients are this key
    block's share of dq and its exact dk, dv.
    """
    static = _prepare(q_BTNH, k_BSKH, v_BSKH, mask, scale, block_sizes, interpret)
    return _bwd_jit(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BTN, do_BTNH, *static)


def flash_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    mask: Mask,
    *,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
):
    """Differentiable flash attention -> o_BTNH (custom_vjp: the backward kernels recompute p from lse)."""
    return _attention_jit(
        q_BTNH, k_BSKH, v_BSKH, *_prepare(q_BTNH, k_BSKH, v_BSKH, mask, scale, block_sizes, interpret)
    )
