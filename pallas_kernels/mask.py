"""Which queries may attend which keys: the one mask description every kernel of this package takes.

Dimension key: B batch, T query tokens, S key tokens.

`Mask` holds the static rule (causal, sliding window) and the int32 arrays it reads (token positions and
segment ids), in the spirit of `SegmentIds` in `jax.experimental.pallas.ops.tpu.flash_attention`. Query i
may attend key j when all of these hold:
  - causal:            q_positions[i] >= kv_positions[j]
  - sliding_window w:  q_positions[i] - kv_positions[j] < w (and, when not causal, also
                       kv_positions[j] - q_positions[i] < w)
  - segment ids:       segment_ids[i] == kv_segment_ids[j] (packed sequences)
Positions are token indices in the full sequence (default 0..T-1 / 0..S-1), not RoPE positions: ring
attention passes global indices, and the zigzag layout permutes them.

Two functions apply the rule, and every kernel uses them: `allowed` elementwise on broadcastable tiles
(pure jnp, so Pallas kernels call it on their blocks), and `blocks_may_attend` on the (min, max) intervals
of a query block and a key block, to skip block pairs that hold no allowed pair.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["segment_ids", "kv_segment_ids", "q_positions", "kv_positions"],
    meta_fields=["causal", "sliding_window"],
)
@dataclasses.dataclass(frozen=True)
class Mask:
    """The attention mask of one call: a pytree whose arrays are traced and whose rule is static.

    segment_ids [B, T] / kv_segment_ids [B, S]: give both or neither (kv_segment_ids defaults to
    segment_ids when S == T). q_positions [B, T] / kv_positions [B, S]: None is 0..T-1 / 0..S-1.
    """

    causal: bool
    segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_positions: jax.Array | None = None
    kv_positions: jax.Array | None = None
    sliding_window: int | None = None

    def filled(self, q_BTNH, k_BSKH) -> Mask:
        """The mask for these q and k with every default made explicit: int32 positions [B, T] and [B, S],
        int32 segment ids (both or None); raises ValueError on shapes that do not fit q and k."""
        b, t, s = q_BTNH.shape[0], q_BTNH.shape[1], k_BSKH.shape[1]
        seg, kv_seg = self.segment_ids, self.kv_segment_ids
        if kv_seg is None:
            kv_seg = seg
        if (seg is None) != (kv_seg is None):
            raise ValueError(
                "segment_ids and kv_segment_ids: give both or neither (kv defaults to segment_ids)"
            )
        for name, x, want in (
            ("segment_ids", seg, (b, t)),
            ("q_positions", self.q_positions, (b, t)),
            ("kv_positions", self.kv_positions, (b, s)),
        ):
            if x is not None and jnp.shape(x) != want:
                raise ValueError(
                    f"{name}: shape {jnp.shape(x)}, expected {want}; broadcast it to [B, T or S]"
                )
        if kv_seg is not None and jnp.shape(kv_seg) != (b, s):
            raise ValueError(
                f"kv_segment_ids: shape {jnp.shape(kv_seg)}, expected {(b, s)}; pass it when S != T"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"sliding_window={self.sliding_window}: must be a positive int, or None for no window"
            )
        q_pos, kv_pos = self.q_positions, self.kv_positions
        if q_pos is None:
            q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        if kv_pos is None:
            kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
        return Mask(
            causal=bool(self.causal),
            segment_ids=_int32(seg),
            kv_segment_ids=_int32(kv_seg),
            q_positions=_int32(q_pos),
            kv_positions=_int32(kv_pos),
            sliding_window=self.sliding_window,
        )


def _int32(x):
    return None if x is None else jnp.asarray(x, jnp.int32)


def allowed(q_pos, k_pos, q_seg, k_seg, *, causal: bool, sliding_window: int | None):
    """Boolean mask from broadcastable position / segment arrays (q along rows, k along columns).

    Pure elementwise jnp, so kernels call it on their blocks (Pallas included). `q_seg`/`k_seg` may be None.
    """
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), bool)
    if causal:
        ok = ok & (q_pos >= k_pos)
    if sliding_window is not None:
        ok = ok & (q_pos - k_pos < sliding_window)
        if not causal:
            ok = ok & (k_pos - q_pos < sliding_window)
    if q_seg is not None:
        ok = ok & (q_seg == k_seg)
    return ok


def full_mask(mask: Mask):
    """The whole [B, T, S] boolean mask of a filled `Mask` (the reference only: kernels go block by block)."""
    seg, kv_seg = mask.segment_ids, mask.kv_segment_ids
    return allowed(
        mask.q_positions[:, :, None],
        mask.kv_positions[:, None, :],
        None if seg is None else seg[:, :, None],
        None if kv_seg is None else kv_seg[:, None, :],
        causal=mask.causal,
        sliding_window=mask.sliding_window,
    )


def blocks_may_attend(q_lo, q_hi, k_lo, k_hi, *, causal: bool, sliding_window: int | None, segments=None):
    """bool, the broadcast shape of the bounds: False where no query with a position in [q_lo, q_hi] may
    attend a key with a position in [k_lo, k_hi] under `allowed`'s rule.

    Conservative (intervals, not sets), so True may still be fully masked; kernels apply `allowed` inside
    the live blocks. `segments`: (q_seg_lo, q_seg_hi, k_seg_lo, k_seg_hi), or None to not test segments.
    The bounds must come from real tokens (differences of padding sentinels may wrap).
    """
    live = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_lo), jnp.shape(k_lo)), bool)
    if causal:
        live = live & (k_lo <= q_hi)
    if sliding_window is not None:
        live = live & (q_lo - k_hi < sliding_window)
        if not causal:
            live = live & (k_lo - q_hi < sliding_window)
    if segments is not None:
        q_seg_lo, q_seg_hi, k_seg_lo, k_seg_hi = segments
        live = live & (q_seg_lo <= k_seg_hi) & (k_seg_lo <= q_seg_hi)
    return live
