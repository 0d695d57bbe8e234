"""Grouped-query attention with an `attention_impl` switch and an optional contiguous KV cache.

Dimension key: B batch, T query tokens, S key tokens, D model width, N query heads, K kv heads,
G query heads per kv head (N = K * G), H head dim.

`ATTENTION_IMPLS` maps `model.attention_impl` to a function
`fn(q_BTNH, k_BSKH, v_BSKH, *, causal, segment_ids=None) -> o_BTNH` (self-attention, S == T):
  reference      einsum, O(T^2) memory
  query_blocked  causal blocks of queries, the blocks above the diagonal skipped; O(T^2 / n)
  chunked        pallas_kernels.chunked_attention: plain XLA online softmax, O(T) memory
  flash          pallas_kernels.flash_attention: Pallas kernel (interpret mode on CPU: slow)
  ring           pallas_kernels.ring_attention inside shard_map over the `sequence` mesh axis (the
                 axis `act_length` maps to); `chunked` when there is no such axis of size > 1
  auto           the default: `flash` on TPU and GPU, `chunked` elsewhere (on CPU it is as fast as
                 `query_blocked` at 256 tokens and faster from 512 on; see README)
`ring` masks causally by the layer's `positions` (global token indices), so batches laid out with
`ring_attention.zigzag` (tokens and positions reordered alike) keep their meaning.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from model import layers, rope, sharding
from model.kv_cache import DenseCache, PagedCache
from model.notes import note_path
from pallas_kernels.mask import Mask

# Finite so that a fully masked row gives a uniform softmax (then zeroed), never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS, scale: float | None = None) -> jax.Array:
    """Masked softmax attention in f32 without repeating K/V across the query group; `scale` defaults to
    H^-0.5 and the value head width may differ from H."""
    b, t, n, h = q_BTNH.shape
    kv = k_BSKH.shape[2]
    scale = h**-0.5 if scale is None else scale
    q_BTKGH = q_BTNH.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    if scale != 1.0:
        scores = scores * scale
    mask = mask_BTS[:, None, None, :, :]
    scores = jnp.where(mask, scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask, probs, 0.0)  # fully masked rows: zeros, not a uniform average
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_BSKH.dtype), v_BSKH)
    return out.reshape(b, t, n, v_BSKH.shape[-1])


def _attend_gathered(q_BTNH, k_KBSH, v_KBSH, mask_BTS, scale: float | None = None) -> jax.Array:
    """`_attend` over K/V gathered from pages kv-head-major ([K, B, S, H], as `gather_pages` returns them),
    with both matmuls in the form XLA:CPU's matmul library takes as they are: scores as K [S, H] x q^T and
    the output as probs [T * G, S] x V [S, H], so only q and the probabilities (T * G rows each) are
    transposed, never the gathered K (`_attend`'s q x K^T moves every gathered key to [H, S] first; on
    the 8-layer target of benchmarks/decode.py's speculative section, 20 rows per verification, those
    copies were ~13% of the speculative step's XLA op time). The barrier keeps XLA from folding the
    probabilities' transpose into the second matmul, which it would then run outside that library."""
    kv, b, s, h = k_KBSH.shape
    t, n = q_BTNH.shape[1], q_BTNH.shape[2]
    scale = h**-0.5 if scale is None else scale
    q_BTKGH = q_BTNH.reshape(b, t, kv, n // kv, h)
    scores_KBSTG = jnp.einsum("kbsh,btkgh->kbstg", k_KBSH, q_BTKGH, preferred_element_type=jnp.float32)
    if scale != 1.0:
        scores_KBSTG = scores_KBSTG * scale
    mask = jnp.swapaxes(mask_BTS, 1, 2)[None, :, :, :, None]
    scores_KBSTG = jnp.where(mask, scores_KBSTG, MASK_VALUE)
    probs_KBSTG = jnp.where(mask, jax.nn.softmax(scores_KBSTG, axis=2), 0.0)  # fully masked rows: zeros
    probs_KBTGS = jax.lax.optimization_barrier(jnp.moveaxis(probs_KBSTG, 2, -1).astype(v_KBSH.dtype))
    out_KBTGH = jnp.einsum("kbtgs,kbsh->kbtgh", probs_KBTGS, v_KBSH)
    return jnp.moveaxis(out_KBTGH, 0, 2).reshape(b, t, n, v_KBSH.shape[-1])


def self_attention_mask(
    t: int, *, causal: bool, segment_ids_BT: jax.Array | None, q_start: int = 0, q_end: int | None = None
) -> jax.Array:
    """[B or 1, Tq, T] boolean mask of queries q_start..q_end-1 over keys 0..T-1: causal by token
    index, and within the same segment."""
    q_end = t if q_end is None else q_end
    q_idx, k_idx = jnp.arange(q_start, q_end), jnp.arange(t)
    mask = (q_idx[:, None] >= k_idx[None, :]) if causal else jnp.ones((q_end - q_start, t), bool)
    mask = mask[None]
    if segment_ids_BT is not None:
        mask = mask & (segment_ids_BT[:, q_start:q_end, None] == segment_ids_BT[:, None, :])
    return mask


def reference_attention(q_BTNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids=None) -> jax.Array:
    """Plain einsum attention; O(T^2) memory. The reference every kernel is tested against."""
    mask = self_attention_mask(q_BTNH.shape[1], causal=causal, segment_ids_BT=segment_ids)
    mask = jnp.broadcast_to(mask, (q_BTNH.shape[0],) + mask.shape[1:])
    return _attend(q_BTNH, k_BSKH, v_BSKH, mask)


QUERY_BLOCK = 128


def query_blocked_attention(q_BTNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids=None) -> jax.Array:
    """Causal attention in blocks of `QUERY_BLOCK` queries, each over the keys up to its own end.

    The same result as `reference_attention`, but the key blocks above the diagonal are never
    computed: (n + 1) / 2n of the score work for n blocks. Still O(T^2 / n) memory per block and
    plain autodiff; the O(T) kernels of `pallas_kernels` register their own names.
    """
    t = q_BTNH.shape[1]
    if not causal or t <= QUERY_BLOCK:
        return reference_attention(q_BTNH, k_BSKH, v_BSKH, causal=causal, segment_ids=segment_ids)
    outs = []
    for start in range(0, t, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, t)
        seg = None if segment_ids is None else segment_ids[:, :end]
        mask = self_attention_mask(end, causal=True, segment_ids_BT=seg, q_start=start)
        mask_BTS = jnp.broadcast_to(mask, (q_BTNH.shape[0],) + mask.shape[1:])
        outs.append(_attend(q_BTNH[:, start:end], k_BSKH[:, :end], v_BSKH[:, :end], mask_BTS))
    return jnp.concatenate(outs, axis=1)


def chunked_attention(q_BTNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids=None) -> jax.Array:
    from pallas_kernels import chunked_attention as kernel

    return kernel.chunked_attention(q_BTNH, k_BSKH, v_BSKH, Mask(causal=causal, segment_ids=segment_ids))


def flash_attention(q_BTNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids=None) -> jax.Array:
    from pallas_kernels import flash_attention as kernel

    return kernel.flash_attention(q_BTNH, k_BSKH, v_BSKH, Mask(causal=causal, segment_ids=segment_ids))


def auto_attention(q_BTNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids=None) -> jax.Array:
    backend = jax.default_backend()
    fn = flash_attention if backend in ("tpu", "gpu", "cuda", "rocm") else chunked_attention
    note_path(f"model.attention_impl=auto: {fn.__name__.removesuffix('_attention')} on {backend}")
    return fn(q_BTNH, k_BSKH, v_BSKH, causal=causal, segment_ids=segment_ids)


def _ring_axis(rules) -> str | None:
    """The single mesh axis `act_length` maps to, if any."""
    target = dict(rules).get("act_length")
    if isinstance(target, str):
        return target
    return target[0] if target and len(target) == 1 else None


def ring_self_attention(
    q_BTNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids=None, positions=None, rules=()
) -> jax.Array:
    """Ring attention over the mesh axis of `act_length`, wrapped in `shard_map` here so the layer
    stays in global (GSPMD) form; `chunked` when no mesh is set or that axis has size 1."""
    mesh = jax.sharding.get_abstract_mesh()
    axis = _ring_axis(rules)
    if mesh.empty or axis is None or dict(mesh.shape).get(axis, 1) == 1:
        note_path(
            f"model.attention_impl=ring runs chunked attention: act_length maps to mesh axis {axis!r}, which "
            "is absent or of size 1 here (no sequence parallelism to ring over)"
        )
        return chunked_attention(q_BTNH, k_BSKH, v_BSKH, causal=causal, segment_ids=segment_ids)
    from pallas_kernels import ring_attention as kernel

    b, t = q_BTNH.shape[:2]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    q_spec = sharding.mesh_spec(("act_batch", "act_length", "act_heads", None), rules, mesh)
    kv_spec = sharding.mesh_spec(("act_batch", "act_length", "act_kv_heads", None), rules, mesh)
    bt_spec = sharding.mesh_spec(("act_batch", "act_length"), rules, mesh)
    with_segments = segment_ids is not None

    def local(q, k, v, pos, seg):
        seg = seg if with_segments else None
        mask = Mask(causal=causal, segment_ids=seg, q_positions=pos, kv_positions=pos)
        return kernel.ring_attention(q, k, v, mask, axis_name=axis)

    # check_vma off: the ring's scan carries start replicated and become device-varying after a hop,
    # and the annotation API for that differs across the JAX versions we support.
    ring = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, bt_spec, bt_spec),
        out_specs=q_spec,
        check_vma=False,
    )
    seg = segment_ids if with_segments else jnp.zeros((b, t), jnp.int32)
    return ring(q_BTNH, k_BSKH, v_BSKH, positions.astype(jnp.int32), seg)


ATTENTION_IMPLS: dict[str, Callable[..., jax.Array]] = {
    "reference": reference_attention,
    "query_blocked": query_blocked_attention,
    "chunked": chunked_attention,
    "flash": flash_attention,
    "ring": ring_self_attention,
    "auto": auto_attention,
}


def register_attention_impl(name: str, fn: Callable[..., jax.Array]) -> None:
    ATTENTION_IMPLS[name] = fn


def cached_attention(
    q_BTNH, k_cache_BSKH, v_cache_BSKH, start_B, *, num_new: int, scale: float | None = None
) -> jax.Array:
    """Queries at cache slots start..start+T-1 attend to slots <= their own (the cache is causal)."""
    s = k_cache_BSKH.shape[1]
    q_slot_BT = start_B[:, None] + jnp.arange(num_new)[None, :]
    mask_BTS = jnp.arange(s)[None, None, :] <= q_slot_BT[:, :, None]
    return _attend(q_BTNH, k_cache_BSKH, v_cache_BSKH, mask_BTS, scale)


def write_cache(cache_BSKH: jax.Array, new_BTKH: jax.Array, start_B: jax.Array) -> jax.Array:
    """Writes new_BTKH at slots start_B .. start_B + T - 1 of each row."""

    def one(c_SKH, n_TKH, s):
        return jax.lax.dynamic_update_slice(c_SKH, n_TKH.astype(c_SKH.dtype), (s, 0, 0))

    return jax.vmap(one)(cache_BSKH, new_BTKH, start_B)


def paged_cache_attention(
    q_BTNH, k_BTKH, v_BTKH, cache: PagedCache, *, scale: float | None = None, keys: tuple = ("k", "v")
) -> tuple[jax.Array, PagedCache]:
    """Writes the T new tokens' K/V into a paged cache and attends over each row's cached tokens.

    `cache` (`model.kv_cache.PagedCache`): its pages `k`/`v` [Lc * K, P, Lp, H] hold every layer's pages,
    `layer` is this layer's index. Token t of row b sits at position start + t. One new token per row
    (decode) uses `pallas_kernels.paged_attention`; more (prefill chunks, speculative verification) gather
    the row's pages and attend causally by position.

    `keys=("latent",)` (MLA, `v_BTKH` None): one page array whose rows are both keys and values (see
    `model.mla`); the output then has the page width.
    """
    from pallas_kernels import paged_attention

    b, t = q_BTNH.shape[:2]
    kv = k_BTKH.shape[2]
    k_name, v_name = (keys[0], keys[-1])
    new = {k_name: k_BTKH} if v_BTKH is None else {k_name: k_BTKH, v_name: v_BTKH}
    table_BM = cache.page_table
    page = cache.pages[k_name].shape[2]
    start_B, num_new_B = cache.start, cache.num_new
    pos_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid_BT = jnp.arange(t)[None, :] < num_new_B[:, None]
    page_idx_BT = jnp.minimum(pos_BT // page, table_BM.shape[1] - 1)
    page_BT = jnp.where(valid_BT, jnp.take_along_axis(table_BM, page_idx_BT, axis=1), 0)
    slot_BT = jnp.where(valid_BT, pos_BT % page, 0)
    rows_K = cache.layer * kv + jnp.arange(kv, dtype=jnp.int32)
    idx = (rows_K[:, None, None], page_BT[None], slot_BT[None])
    pages = {
        name: cache.pages[name].at[idx].set(jnp.moveaxis(x, 2, 0).astype(cache.pages[name].dtype))
        for name, x in new.items()
    }
    k_all, v_all = pages[k_name], pages[v_name]
    lengths_B = start_B + num_new_B
    if t == 1:
        o_BNH = paged_attention.paged_attention(
            q_BTNH[:, 0], k_all, v_all, lengths_B, table_BM, scale=scale, kv_offset=rows_K[0], num_kv_heads=kv
        )
        o_BTNH = o_BNH[:, None]
    else:
        m = table_BM.shape[1]

        def rows(pages):  # this layer's pages of each row, gathered straight from the pool: [K, B, M * Lp, H]
            return paged_attention.gather_pages(pages, table_BM, rows_K).reshape(kv, b, m * page, -1)

        key_pos_S = jnp.arange(m * page, dtype=jnp.int32)
        mask_BTS = key_pos_S[None, None, :] <= pos_BT[:, :, None]
        k_rows = rows(k_all).astype(q_BTNH.dtype)
        v_rows = k_rows if v_BTKH is None else rows(v_all).astype(q_BTNH.dtype)
        o_BTNH = _attend_gathered(q_BTNH, k_rows, v_rows, mask_BTS, scale)
    return o_BTNH, cache._replace(pages=dict(cache.pages, **pages))


class Attention(nnx.Module):
    def __init__(self, m: ml_collections.ConfigDict, rules, *, rngs: nnx.Rngs):
        d, n, kv, h = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
        pd = m.param_dtype
        self.q = layers.param(rngs, (d, n, h), ("embed", "heads", "head_dim"), std=d**-0.5, dtype=pd)
        self.k = layers.param(rngs, (d, kv, h), ("embed", "kv_heads", "head_dim"), std=d**-0.5, dtype=pd)
        self.v = layers.param(rngs, (d, kv, h), ("embed", "kv_heads", "head_dim"), std=d**-0.5, dtype=pd)
        self.o = layers.param(rngs, (n, h, d), ("heads", "head_dim", "embed"), std=(n * h) ** -0.5, dtype=pd)
        if m.attention_bias:
            self.q_bias = layers.const_param(jnp.zeros((n, h), pd), ("heads", "head_dim"))
            self.k_bias = layers.const_param(jnp.zeros((kv, h), pd), ("kv_heads", "head_dim"))
            self.v_bias = layers.const_param(jnp.zeros((kv, h), pd), ("kv_heads", "head_dim"))
        if m.qk_norm:
            self.q_norm = layers.RMSNorm(h, eps=m.norm_eps, dtype=pd)
            self.k_norm = layers.RMSNorm(h, eps=m.norm_eps, dtype=pd)
        self.has_bias, self.qk_norm = bool(m.attention_bias), bool(m.qk_norm)
        self.rope_cfg = m.rope
        self.head_dim = h
        self.impl = m.attention_impl
        self.compute_dtype = layers.dtype_of(m.compute_dtype)
        self.rules = rules

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        *,
        segment_ids_BT: jax.Array | None = None,
        cache: DenseCache | PagedCache | None = None,
    ) -> tuple[jax.Array, DenseCache | PagedCache | None]:
        cdt = self.compute_dtype
        t = x_BTD.shape[1]
        x_BTD = x_BTD.astype(cdt)
        q_BTNH = layers.matmul_rows(x_BTD, self.q[...].astype(cdt))
        k_BTKH = layers.matmul_rows(x_BTD, self.k[...].astype(cdt))
        v_BTKH = layers.matmul_rows(x_BTD, self.v[...].astype(cdt))
        if self.has_bias:
            q_BTNH = q_BTNH + self.q_bias[...].astype(cdt)[None, None]
            k_BTKH = k_BTKH + self.k_bias[...].astype(cdt)[None, None]
            v_BTKH = v_BTKH + self.v_bias[...].astype(cdt)[None, None]
        if self.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        cos, sin = rope.cos_sin(positions_BT, self.head_dim, self.rope_cfg)
        q_BTNH, k_BTKH = rope.apply_rope(q_BTNH, cos, sin), rope.apply_rope(k_BTKH, cos, sin)
        act = ("act_batch", "act_length", "act_heads", None)
        q_BTNH = sharding.constrain(q_BTNH, act, self.rules)
        if cache is None:
            kv_act = ("act_batch", "act_length", "act_kv_heads", None)
            k_BTKH = sharding.constrain(k_BTKH, kv_act, self.rules)
            v_BTKH = sharding.constrain(v_BTKH, kv_act, self.rules)
            fn = ATTENTION_IMPLS[self.impl]
            extra = dict(positions=positions_BT, rules=self.rules) if self.impl == "ring" else {}
            o_BTNH = fn(q_BTNH, k_BTKH, v_BTKH, causal=True, segment_ids=segment_ids_BT, **extra)
        elif isinstance(cache, PagedCache):
            o_BTNH, cache = paged_cache_attention(q_BTNH, k_BTKH, v_BTKH, cache)
        else:
            k_cache = write_cache(cache.arrays["k"], k_BTKH, cache.index)
            v_cache = write_cache(cache.arrays["v"], v_BTKH, cache.index)
            o_BTNH = cached_attention(
                q_BTNH,
                k_cache.astype(cdt),
                v_cache.astype(cdt),
                cache.index,
                num_new=t,
            )
            cache = DenseCache({"k": k_cache, "v": v_cache}, cache.index)
        o_BTNH = sharding.constrain(o_BTNH.astype(cdt), act, self.rules)
        y_BTD = layers.matmul_rows(o_BTNH, self.o[...].astype(cdt), contract=2)
        return y_BTD, cache
