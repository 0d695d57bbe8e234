"""Decode attention over a paged KV cache: one query token per sequence, split-K over blocks of pages.

Dimension key: B batch, N query heads, K kv heads, G = N // K query heads per kv head, H head dim,
P pages in the pool, L slots per page (page size), M pages per sequence in the page table,
C pages per block (`pages_per_block`), J = ceil(M / C) blocks per sequence.

The cache is a page pool k_pages_KPLH / v_pages_KPLH. Sequence b holds lengths_B[b] tokens; token t lives
in physical page page_table_BM[b, t // L], slot t % L. The query attends to tokens 0..length-1, i.e. it
is the token at position length-1 with a causal mask (`paged_attention_reference` says exactly that
through `reference.attention_reference`). Slots at or past the length, and table entries past
ceil(length / L), may hold anything (stale pages, NaN): they are masked with `where`, never multiplied
in, and the table entries are clipped into [0, P) so that no index leaves the pool. Length 0 gives zeros.

Each block of C pages yields a partial (o, lse) in f32, like any key block of the package contract
(`reference.py`), and the partials combine exactly through max / log-sum-exp (`reference.merge_partials`,
or `merge_blocks` for all J at once). GQA never repeats K/V: the G query heads of a kv head share its
pages. Decode only: no VJP is defined.

Implementations (`impl`):
  - "xla": a `fori_loop` over the blocks that hold tokens (the trip count is the longest sequence's,
    traced); each step gathers its C pages with the page table, does masked einsum attention and folds
    its partial into the running one. The default on CPU and GPU; the engine calls it every decode step.
  - "pallas": on TPU (and in interpret mode on CPU) the page table and lengths are scalar-prefetched
    (`pltpu.PrefetchScalarGridSpec`) so the K/V BlockSpecs' index_map picks the physical page; the grid is
    (B, K, J, C), one page per step, with an online softmax over the C pages of a block. Pages past the
    length repeat the previous block index (no new copy) and skip their compute under `pl.when`.
    On GPU the Triton lowering has no scalar prefetch, so the kernel instead receives the page table as
    an ordinary input, keeps the whole pool of one kv head as its K/V block, and walks the pages of a
    block with `lax.fori_loop`, indexing the pool ref with the physical page ("pallas_gather" forces
    this formulation anywhere; "pallas_prefetch" forces the TPU one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import reference
from pallas_kernels.mask import Mask, allowed
from pallas_kernels.reference import MASK_VALUE

IMPLS = ("xla", "pallas", "pallas_prefetch", "pallas_gather")


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_reference(q_BNH, k_pages_KPLH, v_pages_KPLH, lengths_B, page_table_BM, *, scale=None):
    """Gathers each sequence's pages into contiguous K/V and runs the package's reference attention."""
    _check_args(q_BNH, k_pages_KPLH, v_pages_KPLH, lengths_B, page_table_BM)
    b, n, h = q_BNH.shape
    kv, _, page, _ = k_pages_KPLH.shape
    m = page_table_BM.shape[1]
    table_BM = jnp.clip(page_table_BM, 0, k_pages_KPLH.shape[1] - 1)
    pos_S = jnp.arange(m * page, dtype=jnp.int32)
    valid_BS = pos_S[None] < lengths_B[:, None]

    def contiguous(pages_KPLH):
        x_BSKH = jnp.transpose(pages_KPLH[:, table_BM], (1, 2, 3, 0, 4)).reshape(b, m * page, kv, h)
        return jnp.where(valid_BS[:, :, None, None], x_BSKH, jnp.zeros((), x_BSKH.dtype))

    o_B1NH = reference.attention_reference(
        q_BNH[:, None],
        contiguous(k_pages_KPLH),
        contiguous(v_pages_KPLH),
        Mask(
            causal=True,
            q_positions=_query_position(lengths_B[:, None]),
            kv_positions=jnp.broadcast_to(pos_S[None], (b, m * page)),
        ),
        scale=scale,
    )
    return o_B1NH[:, 0]


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "impl", "interpret", "num_kv_heads"))
def paged_attention(
    q_BNH,
    k_pages_KPLH,
    v_pages_KPLH,
    lengths_B,
    page_table_BM,
    *,
    scale: float | None = None,
    pages_per_block: int = 8,
    impl: str | None = None,
    interpret: bool | None = None,
    kv_offset=None,
    num_kv_heads: int | None = None,
):
    """o_BNH (q's dtype) for one query token per sequence over its `lengths_B` tokens in the page pool.

    `pages_per_block` larger than M is clipped to M. `impl=None` is "pallas" on TPU and "xla" elsewhere;
    `interpret=None` interprets the Pallas kernel on CPU. Jittable: lengths and page table are traced.

    `kv_offset` (traced) and `num_kv_heads` (static) read the kv heads `kv_offset .. kv_offset + K - 1` of a
    pool that stacks several layers' heads (a model's cache, `[layers * K, P, L, H]`): the "xla" path gathers
    those rows directly, without first copying the layer out of the pool; the Pallas paths slice it.
    """
    if (kv_offset is None) != (num_kv_heads is None):
        raise ValueError("kv_offset and num_kv_heads go together (both or neither)")
    _check_args(q_BNH, k_pages_KPLH, v_pages_KPLH, lengths_B, page_table_BM, num_kv_heads)
    if not isinstance(pages_per_block, int) or pages_per_block < 1:
        raise ValueError(f"pages_per_block: {pages_per_block!r}, expected a positive int")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl: {impl!r}, expected one of {IMPLS} or None (backend default)")
    backend = jax.default_backend()
    impl = impl or ("pallas" if backend == "tpu" else "xla")
    if impl == "pallas":
        impl = "pallas_gather" if backend == "gpu" else "pallas_prefetch"
    interpret = backend == "cpu" if interpret is None else interpret
    b, n, h = q_BNH.shape
    _, pool, page, _ = k_pages_KPLH.shape
    kv = num_kv_heads or k_pages_KPLH.shape[0]
    rows_K = (
        None if kv_offset is None else jnp.asarray(kv_offset, jnp.int32) + jnp.arange(kv, dtype=jnp.int32)
    )
    if rows_K is not None and impl != "xla":
        k_pages_KPLH = lax.dynamic_slice_in_dim(k_pages_KPLH, rows_K[0], kv)
        v_pages_KPLH = lax.dynamic_slice_in_dim(v_pages_KPLH, rows_K[0], kv)
        rows_K = None
    m = page_table_BM.shape[1]
    c = min(pages_per_block, m)
    j = -(-m // c)
    scale = h**-0.5 if scale is None else scale
    lengths_B = jnp.clip(lengths_B.astype(jnp.int32), 0, m * page)
    # Padding pages sit past every length, so they are masked; clipping keeps stale entries in the pool.
    table_BJC = jnp.pad(jnp.clip(page_table_BM.astype(jnp.int32), 0, pool - 1), ((0, 0), (0, j * c - m)))
    table_BJC = table_BJC.reshape(b, j, c)
    q_BKGH = q_BNH.reshape(b, kv, n // kv, h)
    if impl == "xla":
        o_BKGH, _ = _xla_attention(q_BKGH, k_pages_KPLH, v_pages_KPLH, lengths_B, table_BJC, scale, rows_K)
    else:
        kernel = _pallas_prefetch_partials if impl == "pallas_prefetch" else _pallas_gather_partials
        partials = kernel(
            q_BKGH, k_pages_KPLH, v_pages_KPLH, lengths_B, table_BJC, scale=scale, interpret=interpret
        )
        o_BKGH, _ = merge_blocks(*partials)
    return o_BKGH.reshape(b, n, h).astype(q_BNH.dtype)


def _query_position(length):
    """The decode query is the last token of its sequence."""
    return length - 1


def _attends(length, kv_pos):
    """The package's mask for a decode query: causal, from the last of `length` tokens to keys at kv_pos."""
    return allowed(_query_position(length), kv_pos, None, None, causal=True, sliding_window=None)


def merge_blocks(o_BKJGH, lse_BKJG):
    """Merges the J block partials exactly (the vectorised `reference.merge_partials`); f32 in and out.

    All-masked blocks carry o = 0 and lse = MASK_VALUE, so a sequence of length 0 merges to o = 0.
    """
    max_BKG = jnp.max(lse_BKJG, axis=2)
    w_BKJG = jnp.exp(lse_BKJG - max_BKG[:, :, None])
    total_BKG = jnp.sum(w_BKJG, axis=2)
    o_BKGH = jnp.sum(o_BKJGH * w_BKJG[..., None], axis=2) / total_BKG[..., None]
    return o_BKGH, max_BKG + jnp.log(total_BKG)


def _finish(max_s, denom, acc):
    """(o, lse) of one block from its running max score, softmax denominator and unnormalised output."""
    has_keys = denom > 0
    safe_denom = jnp.where(has_keys, denom, 1.0)
    return acc / safe_denom, jnp.where(has_keys, max_s + jnp.log(safe_denom), MASK_VALUE)


def _xla_attention(q_BKGH, k_pages_KPLH, v_pages_KPLH, lengths_B, table_BJC, scale, rows_K=None):
    """(o_BKGH, lse_BKG): a loop over the blocks that hold tokens, folding each partial into the running
    one with `reference.merge_partials`. One block's pages at a time stay in cache; later blocks are
    skipped, since the trip count is the longest sequence's block count (traced, so no retrace)."""
    b, kv, g, h = q_BKGH.shape
    _, _, c = table_BJC.shape
    tokens = c * k_pages_KPLH.shape[2]

    def body(ji, carry):
        table_BC = lax.dynamic_index_in_dim(table_BJC, ji, axis=1, keepdims=False)
        o_BKGH, lse_BKG = _xla_block(
            q_BKGH, k_pages_KPLH, v_pages_KPLH, lengths_B - ji * tokens, table_BC, scale, rows_K
        )
        return reference.merge_partials(*carry, o_BKGH, lse_BKG)

    init = (jnp.zeros((b, kv, g, h), jnp.float32), jnp.full((b, kv, g), MASK_VALUE, jnp.float32))
    return lax.fori_loop(0, (jnp.max(lengths_B) + tokens - 1) // tokens, body, init)


def _xla_block(q_BKGH, k_pages_KPLH, v_pages_KPLH, lengths_B, table_BC, scale, rows_K=None):
    """(o_BKGH, lse_BKG) over the pages of table_BC; lengths_B counts tokens from the block's start."""
    c, page = table_BC.shape[1], k_pages_KPLH.shape[2]
    k_KBCLH = gather_pages(k_pages_KPLH, table_BC, rows_K)
    v_KBCLH = gather_pages(v_pages_KPLH, table_BC, rows_K)
    pos_CL = jnp.arange(c * page, dtype=jnp.int32).reshape(c, page)
    ok_BCL = _attends(lengths_B[:, None, None], pos_CL[None])
    s_BKGCL = jnp.einsum("bkgh,kbclh->bkgcl", q_BKGH.astype(jnp.float32), k_KBCLH.astype(jnp.float32))
    ok = ok_BCL[:, None, None]
    s_BKGCL = jnp.where(ok, s_BKGCL * scale, MASK_VALUE)
    m_BKG = jnp.max(s_BKGCL, axis=(-2, -1))
    p_BKGCL = jnp.where(ok, jnp.exp(s_BKGCL - m_BKG[..., None, None]), 0.0)
    v_KBCLH = jnp.where(ok_BCL[None, ..., None], v_KBCLH, jnp.zeros((), v_KBCLH.dtype))
    acc_BKGH = jnp.einsum("bkgcl,kbclh->bkgh", p_BKGCL, v_KBCLH.astype(jnp.float32))
    o_BKGH, lse_BKG1 = _finish(m_BKG[..., None], jnp.sum(p_BKGCL, axis=(-2, -1))[..., None], acc_BKGH)
    return o_BKGH, lse_BKG1[..., 0]


def gather_pages(pages_KPLH, table_BC, rows_K=None):
    """pages_KPLH[:, table_BC] as [K, B, C, L, H] (or pages[rows_K][:, table_BC] in one gather, when the
    pool stacks more heads than one layer's). XLA:CPU gathers bf16 about 3x slower than uint16, so 2-byte
    pages are gathered through a same-width bitcast (free)."""

    def take(x):
        return x[:, table_BC] if rows_K is None else x[rows_K[:, None, None], table_BC[None]]

    if pages_KPLH.dtype.itemsize != 2:
        return take(pages_KPLH)
    bits_KPLH = lax.bitcast_convert_type(pages_KPLH, jnp.uint16)
    return lax.bitcast_convert_type(take(bits_KPLH), pages_KPLH.dtype)


def _page_step(q_GH, k_LH, v_LH, start, length, carry, scale):
    """Online-softmax update of (m_G1, l_G1, acc_GH) with the page whose first token is `start`."""
    m_G1, l_G1, acc_GH = carry
    page = k_LH.shape[0]
    dtype = jnp.promote_types(q_GH.dtype, k_LH.dtype)
    s_GL = lax.dot_general(
        q_GH.astype(dtype), k_LH.astype(dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    ok_1L = _attends(length, start + lax.broadcasted_iota(jnp.int32, (1, page), 1))
    ok_L1 = _attends(length, start + lax.broadcasted_iota(jnp.int32, (page, 1), 0))
    s_GL = jnp.where(ok_1L, s_GL * scale, MASK_VALUE)
    m_new = jnp.maximum(m_G1, jnp.max(s_GL, axis=1, keepdims=True))
    p_GL = jnp.where(ok_1L, jnp.exp(s_GL - m_new), 0.0)
    alpha = jnp.exp(m_G1 - m_new)
    v_LH = jnp.where(ok_L1, v_LH.astype(jnp.float32), 0.0)
    acc_GH = alpha * acc_GH + jnp.dot(p_GL, v_LH, preferred_element_type=jnp.float32)
    return m_new, alpha * l_G1 + jnp.sum(p_GL, axis=1, keepdims=True), acc_GH


def _table_slot(length, slot, page):
    """The table slot a prefetch grid step reads: its own while needed, then the last needed one again
    (same block index, so the pipeline issues no copy for pages past the length)."""
    return jnp.minimum(slot, jnp.maximum((length + page - 1) // page - 1, 0))


def _pages_in_block(length, ji, c, page):
    """How many of block ji's C pages hold tokens below `length` (the gather kernel reads only those)."""
    return jnp.clip((length + page - 1) // page - ji * c, 0, c)


def _partial_shapes(q_BKGH, j):
    b, kv, g, h = q_BKGH.shape
    return (
        jax.ShapeDtypeStruct((b, kv, j, g, h), jnp.float32),
        jax.ShapeDtypeStruct((b, kv, j, g, 1), jnp.float32),
    )


def _prefetch_kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, *, scale):
    """One page per grid step (b, k, j, c); o_ref accumulates over c and is finished at the last page."""
    bi, ji, ci = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    c, page = pl.num_programs(3), k_ref.shape[0]
    start = (ji * c + ci) * page
    length = lengths_ref[bi]

    @pl.when(ci == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)

    @pl.when(start < length)
    def _page():
        carry = (m_ref[...], l_ref[...], o_ref[...])
        m_ref[...], l_ref[...], o_ref[...] = _page_step(
            q_ref[...], k_ref[...], v_ref[...], start, length, carry, scale
        )

    @pl.when(ci == c - 1)
    def _done():
        o_ref[...], lse_ref[...] = _finish(m_ref[...], l_ref[...], o_ref[...])


def _pallas_prefetch_partials(q_BKGH, k_pages_KPLH, v_pages_KPLH, lengths_B, table_BJC, *, scale, interpret):
    """TPU formulation: scalar-prefetched page table drives the K/V index_map, one page per grid step."""
    b, kv, g, h = q_BKGH.shape
    page = k_pages_KPLH.shape[2]
    _, j, c = table_BJC.shape

    def page_index(bi, ki, ji, ci, lengths_ref, table_ref):
        slot = _table_slot(lengths_ref[bi], ji * c + ci, page)
        return ki, table_ref[bi, slot // c, slot % c], 0, 0

    def block_index(bi, ki, ji, ci, lengths_ref, table_ref):
        return bi, ki, ji, 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, kv, j, c),
        in_specs=[
            pl.BlockSpec((None, None, g, h), lambda bi, ki, ji, ci, *_: (bi, ki, 0, 0)),
            pl.BlockSpec((None, None, page, h), page_index),
            pl.BlockSpec((None, None, page, h), page_index),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, g, h), block_index),
            pl.BlockSpec((None, None, None, g, 1), block_index),
        ],
        scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32)],
    )
    o_BKJGH, lse_BKJG1 = pl.pallas_call(
        functools.partial(_prefetch_kernel, scale=scale),
        grid_spec=grid_spec,
        out_shape=_partial_shapes(q_BKGH, j),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(lengths_B, table_BJC, q_BKGH, k_pages_KPLH, v_pages_KPLH)
    return o_BKJGH, lse_BKJG1[..., 0]


def _gather_kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale):
    """One block per grid step (b, k, j): loops over its needed pages, indexing the pool ref by page."""
    bi, ji = pl.program_id(0), pl.program_id(2)
    c, page = table_ref.shape[2], k_ref.shape[1]
    length = lengths_ref[bi]
    num_pages = _pages_in_block(length, ji, c, page)
    q_GH = q_ref[...]

    def body(ci, carry):
        physical = table_ref[bi, ji, ci]
        start = (ji * c + ci) * page
        return _page_step(q_GH, k_ref[physical], v_ref[physical], start, length, carry, scale)

    g, h = q_GH.shape
    init = (
        jnp.full((g, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((g, 1), jnp.float32),
        jnp.zeros((g, h), jnp.float32),
    )
    o_ref[...], lse_ref[...] = _finish(*lax.fori_loop(0, num_pages, body, init))


def _pallas_gather_partials(q_BKGH, k_pages_KPLH, v_pages_KPLH, lengths_B, table_BJC, *, scale, interpret):
    """GPU formulation (no scalar prefetch in Triton): the table is an input, the pool one K/V block."""
    b, kv, g, h = q_BKGH.shape
    _, pool, page, _ = k_pages_KPLH.shape
    _, j, c = table_BJC.shape
    pool_spec = pl.BlockSpec((None, pool, page, h), lambda bi, ki, ji: (ki, 0, 0, 0))
    o_BKJGH, lse_BKJG1 = pl.pallas_call(
        functools.partial(_gather_kernel, scale=scale),
        grid=(b, kv, j),
        in_specs=[
            pl.BlockSpec((b,), lambda bi, ki, ji: (0,)),
            pl.BlockSpec((b, j, c), lambda bi, ki, ji: (0, 0, 0)),
            pl.BlockSpec((None, None, g, h), lambda bi, ki, ji: (bi, ki, 0, 0)),
            pool_spec,
            pool_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, g, h), lambda bi, ki, ji: (bi, ki, ji, 0, 0)),
            pl.BlockSpec((None, None, None, g, 1), lambda bi, ki, ji: (bi, ki, ji, 0, 0)),
        ],
        out_shape=_partial_shapes(q_BKGH, j),
        interpret=interpret,
    )(lengths_B, table_BJC, q_BKGH, k_pages_KPLH, v_pages_KPLH)
    return o_BKJGH, lse_BKJG1[..., 0]


def _check_args(q_BNH, k_pages_KPLH, v_pages_KPLH, lengths_B, page_table_BM, num_kv_heads=None):
    if q_BNH.ndim != 3:
        raise ValueError(f"q_BNH: shape {q_BNH.shape}, expected [B, N, H] (one decode token per sequence)")
    if k_pages_KPLH.ndim != 4 or v_pages_KPLH.shape != k_pages_KPLH.shape:
        raise ValueError(
            f"k_pages {k_pages_KPLH.shape}, v_pages {v_pages_KPLH.shape}: expected the same [K, P, L, H]"
        )
    b, n, h = q_BNH.shape
    kv = num_kv_heads or k_pages_KPLH.shape[0]
    if k_pages_KPLH.shape[0] < kv:
        raise ValueError(f"k_pages: {k_pages_KPLH.shape[0]} kv-head rows, fewer than num_kv_heads={kv}")
    if k_pages_KPLH.shape[3] != h:
        raise ValueError(f"k_pages: head dim {k_pages_KPLH.shape[3]}, q has {h}; they must match")
    if n % kv:
        raise ValueError(f"q_BNH: {n} query heads, not a multiple of the {kv} kv heads of k_pages")
    if lengths_B.shape != (b,):
        raise ValueError(f"lengths_B: shape {lengths_B.shape}, expected ({b},): one length per sequence")
    if page_table_BM.ndim != 2 or page_table_BM.shape[0] != b:
        raise ValueError(f"page_table_BM: shape {page_table_BM.shape}, expected [{b}, max_pages]")
    for name, x in (("lengths_B", lengths_B), ("page_table_BM", page_table_BM)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}: dtype {x.dtype}, expected an integer dtype (int32)")
    for name, x in (("q_BNH", q_BNH), ("k_pages", k_pages_KPLH), ("v_pages", v_pages_KPLH)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: dtype {x.dtype}, expected a float dtype (bf16 or f32)")
