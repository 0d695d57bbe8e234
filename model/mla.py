"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2).

Dimension key: B batch, T query tokens, S key tokens, D model width, N heads, Q query low-rank width,
R kv latent width (`kv_lora_rank`), n per-head no-RoPE q/k width, r RoPE width (one key part shared by
every head), v value head width, H = n + r the q/k head width, C = R + r one cache row.

Each token's keys and values come from one compressed row: c = RMSNorm(x @ W_dkv) [R] and a RoPE key
k_r [r] shared by all heads. Per head, k = [c @ W_uk, k_r] and v = c @ W_uv (W_uk, W_uv: the two halves
of `kv_b`). Two equivalent forms:

- expanded (training, no cache): k and v are materialised per head and go through the model's attention
  kernel (`model.attention_impl`). The kernels take one head width for q, k and v, so v is zero-padded
  from v to H (and the output sliced back): the value matmul and the output buffer grow by H / v (1.5x
  for DeepSeek-V3's 192 / 128; the score matmul, the larger one, is unchanged).
- absorbed (any KV cache): the cache holds only [c, k_r] per token (C values per layer, for all heads).
  The query is moved into latent space, q_lat = q_n @ W_uk^T [N, R], so scores are
  [q_lat, q_r] . [c, k_r]: multi-query attention with one C-wide kv head whose values are the cache row
  itself. The output's first R entries are the attended latent, which W_uv maps to v per head. The
  contiguous cache, paged prefill and paged decode (`pallas_kernels.paged_attention`, one kv head) all
  use this form.

The softmax scale is H^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's
correction). The latent norms use eps 1e-6 as DeepSeek's and Hugging Face's implementations do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from model import attention, layers, rope, sharding
from model.attention import ATTENTION_IMPLS
from model.kv_cache import DenseCache, PagedCache

LATENT_NORM_EPS = 1e-6


def cache_width(m: ml_collections.ConfigDict) -> int:
    """Values per token per layer in an MLA cache: the latent and the shared RoPE key."""
    return m.mla.kv_lora_rank + m.mla.qk_rope_head_dim


class MLAttention(nnx.Module):
    """`__call__(x_BTD, positions_BT, *, segment_ids_BT=None, cache=None) -> (y_BTD, cache)` like
    `model.attention.Attention`; a cache holds `latent` rows [.., C] (see the module docstring)."""

    def __init__(self, m: ml_collections.ConfigDict, rules, *, rngs: nnx.Rngs):
        a = m.mla
        d, n = m.d_model, m.num_heads
        hn, hr, hv, r = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
        h = hn + hr
        pd = m.param_dtype
        if a.q_lora_rank:
            q = a.q_lora_rank
            self.q_a = layers.param(rngs, (d, q), ("embed", None), std=d**-0.5, dtype=pd)
            self.q_a_norm = layers.RMSNorm(q, eps=LATENT_NORM_EPS, dtype=pd)
            self.q_b = layers.param(rngs, (q, n, h), (None, "heads", "head_dim"), std=q**-0.5, dtype=pd)
        else:
            self.q = layers.param(rngs, (d, n, h), ("embed", "heads", "head_dim"), std=d**-0.5, dtype=pd)
        self.kv_a = layers.param(rngs, (d, r + hr), ("embed", None), std=d**-0.5, dtype=pd)
        self.kv_a_norm = layers.RMSNorm(r, eps=LATENT_NORM_EPS, dtype=pd)
        self.kv_b = layers.param(rngs, (r, n, hn + hv), (None, "heads", "head_dim"), std=r**-0.5, dtype=pd)
        self.o = layers.param(
            rngs, (n, hv, d), ("heads", "head_dim", "embed"), std=(n * hv) ** -0.5, dtype=pd
        )
        self.q_lora = bool(a.q_lora_rank)
        self.dims = (hn, hr, hv, r)
        self.interleave = bool(a.rope_interleave)
        self.rope_cfg = m.rope
        self.scale = h**-0.5 * rope.softmax_scale_factor(m.rope)
        self.impl = m.attention_impl
        self.compute_dtype = layers.dtype_of(m.compute_dtype)
        self.rules = rules

    def _project(self, x_BTD, positions_BT):
        """(q_nope [B,T,N,n], q_rope [B,T,N,r] rotated, latent [B,T,C]: normed c and rotated k_r)."""
        cdt = self.compute_dtype
        hn, hr, _, r = self.dims
        if self.q_lora:
            q_BTQ = self.q_a_norm(layers.matmul_rows(x_BTD, self.q_a[...].astype(cdt)))
            q_BTNH = layers.matmul_rows(q_BTQ, self.q_b[...].astype(cdt))
        else:
            q_BTNH = layers.matmul_rows(x_BTD, self.q[...].astype(cdt))
        ckr_BTC = layers.matmul_rows(x_BTD, self.kv_a[...].astype(cdt))
        c_BTR = self.kv_a_norm(ckr_BTC[..., :r])
        cos, sin = rope.cos_sin(positions_BT, hr, self.rope_cfg)
        q_rope = rope.apply_rope(q_BTNH[..., hn:], cos, sin, interleave=self.interleave)
        k_rope = rope.apply_rope(ckr_BTC[:, :, None, r:], cos, sin, interleave=self.interleave)[:, :, 0]
        return q_BTNH[..., :hn], q_rope, jnp.concatenate([c_BTR, k_rope], axis=-1)

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        *,
        segment_ids_BT: jax.Array | None = None,
        cache: DenseCache | PagedCache | None = None,
    ) -> tuple[jax.Array, DenseCache | PagedCache | None]:
        cdt = self.compute_dtype
        x_BTD = x_BTD.astype(cdt)
        q_nope, q_rope, latent_BTC = self._project(x_BTD, positions_BT)
        if cache is None:
            o_BTNv = self._expanded(q_nope, q_rope, latent_BTC, positions_BT, segment_ids_BT)
        else:
            q_BTNC = self._latent_query(q_nope, q_rope)
            new_BT1C = latent_BTC[:, :, None, :]
            if isinstance(cache, PagedCache):
                o_BTNC, cache = attention.paged_cache_attention(
                    q_BTNC, new_BT1C, None, cache, scale=1.0, keys=("latent",)
                )
            else:
                rows = attention.write_cache(cache.arrays["latent"], new_BT1C, cache.index)
                rows_cdt = rows.astype(cdt)
                o_BTNC = attention.cached_attention(
                    q_BTNC, rows_cdt, rows_cdt, cache.index, num_new=x_BTD.shape[1], scale=1.0
                )
                cache = DenseCache({"latent": rows}, cache.index)
            o_BTNv = self._values(o_BTNC)
        act = ("act_batch", "act_length", "act_heads", None)
        o_BTNv = sharding.constrain(o_BTNv.astype(cdt), act, self.rules)
        return layers.matmul_rows(o_BTNv, self.o[...].astype(cdt), contract=2), cache

    def _expanded(self, q_nope, q_rope, latent_BTC, positions_BT, segment_ids_BT):
        """Per-head keys and values through the attention kernel (v zero-padded to the q/k width)."""
        cdt = self.compute_dtype
        hn, hr, hv, r = self.dims
        kv_BTNx = layers.matmul_rows(latent_BTC[..., :r], self.kv_b[...].astype(cdt))
        b, t, n, _ = kv_BTNx.shape
        k_rope = jnp.broadcast_to(latent_BTC[:, :, None, r:], (b, t, n, hr)).astype(cdt)
        k_BTNH = jnp.concatenate([kv_BTNx[..., :hn], k_rope], axis=-1)
        v_BTNH = jnp.pad(kv_BTNx[..., hn:], ((0, 0), (0, 0), (0, 0), (0, hn + hr - hv)))
        # The kernels scale by H^-0.5; the YaRN correction goes into q.
        factor = self.scale * (hn + hr) ** 0.5
        q_BTNH = jnp.concatenate([q_nope, q_rope.astype(cdt)], axis=-1)
        if factor != 1.0:
            q_BTNH = q_BTNH * jnp.asarray(factor, cdt)
        act = ("act_batch", "act_length", "act_heads", None)
        q_BTNH, k_BTNH, v_BTNH = (sharding.constrain(z, act, self.rules) for z in (q_BTNH, k_BTNH, v_BTNH))
        fn = ATTENTION_IMPLS[self.impl]
        extra = dict(positions=positions_BT, rules=self.rules) if self.impl == "ring" else {}
        o_BTNH = fn(q_BTNH, k_BTNH, v_BTNH, causal=True, segment_ids=segment_ids_BT, **extra)
        return o_BTNH[..., :hv]

    def _latent_query(self, q_nope, q_rope):
        """[q_n @ W_uk^T, q_r] * scale [B, T, N, C]: scores against cache rows need no further scale."""
        hn, _, _, r = self.dims
        w_uk_RNn = self.kv_b[...][..., :hn].astype(jnp.float32)
        q_lat = jnp.einsum("btnh,rnh->btnr", q_nope.astype(jnp.float32), w_uk_RNn)
        q_BTNC = jnp.concatenate([q_lat, q_rope.astype(jnp.float32)], axis=-1) * self.scale
        return q_BTNC.astype(self.compute_dtype)

    def _values(self, o_BTNC):
        """The attended latent (first R entries of each head's output) through W_uv: [B, T, N, v]."""
        hn, _, _, r = self.dims
        w_uv_RNv = self.kv_b[...][..., hn:].astype(self.compute_dtype)
        return jnp.einsum("btnr,rnv->btnv", o_BTNC[..., :r].astype(self.compute_dtype), w_uv_RNv)
