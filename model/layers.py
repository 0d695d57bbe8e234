"""Basic layers: parameters with logical axes, RMSNorm, embedding, SwiGLU MLP.

Dimension key: B batch, T tokens, D model width, F ffn width, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from model import sharding


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def param(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    logical_axes: Sequence[str],
    *,
    std: float,
    dtype: str | jnp.dtype,
) -> nnx.Param:
    """A normal(0, std) parameter tagged with its logical axis names."""
    value = std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=tuple(logical_axes))


def const_param(value: jax.Array, logical_axes: Sequence[str]) -> nnx.Param:
    return nnx.Param(value, logical_axes=tuple(logical_axes))


def matmul_rows(x: jax.Array, w: jax.Array, *, contract: int = 1, preferred_element_type=None) -> jax.Array:
    """Contracts the last `contract` dims of x with the first `contract` dims of w as one 2-D matmul
    over all leading rows ([B, T, ...] -> [B*T, ...]). XLA:CPU runs the weight gradient of the
    equivalent einsum (two contracting dims, B and T) about 2x slower than this 2-D matmul."""
    lead, inner = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :]
    if w.shape[:contract] != inner:
        raise ValueError(f"matmul_rows: x {x.shape} and w {w.shape} do not share {contract} dims")
    k = math.prod(inner)
    out = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), preferred_element_type=preferred_element_type)
    return out.reshape(lead + w.shape[contract:])


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in f32, returned in the input dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scale = scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale.shape)
    return (y * scale).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype: str):
        self.scale = const_param(jnp.ones((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Embed(nnx.Module):
    """Token embedding; `attend` projects back to the vocabulary (tied output)."""

    def __init__(self, m: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
        std = m.d_model**-0.5 if m.tie_embeddings else 1.0
        self.embedding = param(
            rngs, (m.vocab_size, m.d_model), ("vocab", "embed"), std=std, dtype=m.param_dtype
        )
        self.compute_dtype = dtype_of(m.compute_dtype)

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens_BT, axis=0).astype(self.compute_dtype)

    def attend(self, x_BTD: jax.Array) -> jax.Array:
        w_DV = self.embedding[...].astype(self.compute_dtype).T
        return matmul_rows(x_BTD, w_DV, preferred_element_type=jnp.float32)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, m: ml_collections.ConfigDict, d_ff: int, rules, *, rngs: nnx.Rngs):
        d = m.d_model
        self.gate = param(rngs, (d, d_ff), ("embed", "mlp"), std=d**-0.5, dtype=m.param_dtype)
        self.up = param(rngs, (d, d_ff), ("embed", "mlp"), std=d**-0.5, dtype=m.param_dtype)
        self.down = param(rngs, (d_ff, d), ("mlp", "embed"), std=d_ff**-0.5, dtype=m.param_dtype)
        self.compute_dtype = dtype_of(m.compute_dtype)
        self.rules = rules

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cdt = self.compute_dtype
        x_BTD = x_BTD.astype(cdt)
        g_BTF = matmul_rows(x_BTD, self.gate[...].astype(cdt))
        u_BTF = matmul_rows(x_BTD, self.up[...].astype(cdt))
        h_BTF = sharding.constrain(
            jax.nn.silu(g_BTF) * u_BTF, ("act_batch", "act_length", "act_mlp"), self.rules
        )
        return matmul_rows(h_BTF, self.down[...].astype(cdt))
