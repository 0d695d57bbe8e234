"""Rotary position embeddings with linear, Llama-3 and YaRN frequency scaling.

Rotation uses the "rotate half" layout (first and second halves of the head dimension pair up), as in
Hugging Face Llama/Qwen checkpoints, or with `interleave` adjacent pairs (x0, x1), (x2, x3), ... as in
DeepSeek checkpoints (the output is then in half layout, as Hugging Face's; only q.k products see it).
Dimension key: B batch, T tokens, N heads, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np


def inv_frequencies(head_dim: int, rope: ml_collections.ConfigDict) -> tuple[np.ndarray, float]:
    """Per-pair inverse frequencies [H/2] and the attention scale factor on cos/sin (YaRN's mscale)."""
    base = float(rope.theta)
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind, factor = rope.scaling, float(rope.factor)
    if kind == "none":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, rope)
    raise ValueError(f"model.rope.scaling={kind!r}; choose none, linear, llama3 or yarn")


def _llama3(inv_freq: np.ndarray, rope) -> np.ndarray:
    """Long wavelengths are divided by `factor`, short ones kept, a smooth blend in between."""
    factor, orig = float(rope.factor), float(rope.original_max_position)
    low_wavelen = orig / rope.low_freq_factor
    high_wavelen = orig / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(mid, blended, out)


def _yarn(inv_freq: np.ndarray, head_dim: int, rope) -> tuple[np.ndarray, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    base, factor, orig = float(rope.theta), float(rope.factor), float(rope.original_max_position)

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    if rope.mscale and rope.mscale_all_dim:
        return inv, yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    return inv, yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def softmax_scale_factor(rope: ml_collections.ConfigDict) -> float:
    """What DeepSeek's MLA multiplies its softmax scale by: yarn_mscale(factor, mscale_all_dim)^2 with a
    YaRN-scaled RoPE and a nonzero `mscale_all_dim`, else 1."""
    if rope.scaling != "none" and rope.mscale_all_dim:
        return yarn_mscale(float(rope.factor), float(rope.mscale_all_dim)) ** 2
    return 1.0


def cos_sin(
    positions_BT: jax.Array, head_dim: int, rope: ml_collections.ConfigDict
) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [B, T, H/2] in f32 for integer positions."""
    inv_freq, mscale = inv_frequencies(head_dim, rope)
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)[None, None]
    return jnp.cos(angles_BTh) * mscale, jnp.sin(angles_BTh) * mscale


def apply_rope(
    x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array, *, interleave: bool = False
) -> jax.Array:
    """Rotates pairs (x[i], x[i + H/2]) (or (x[2i], x[2i + 1]) with `interleave`) by the position angle;
    computed in f32, returned in half layout."""
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else jnp.split(x, 2, axis=-1)
    c, s = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x_BTNH.dtype)
