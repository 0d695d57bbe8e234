"""The attention contract every kernel in this package implements, and its plain-jnp reference.

Dimension key: B batch, T query tokens, S key tokens, N query heads, K kv heads, G = N // K query
heads per kv head, H head dim.

Layout is the model's: q_BTNH, k_BSKH, v_BSKH -> o_BTNH, and a log-sum-exp lse_BTN in f32.

Masking is `mask.Mask`'s rule; every entry point takes one `Mask`.

A row with no allowed key gives o = 0 and lse = MASK_VALUE (finite), never NaN, so partial results
of several key blocks merge through `merge_partials` without special cases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mask import Mask, full_mask

# Finite: exp(MASK_VALUE - m) underflows to 0 for any real m, and MASK_VALUE - MASK_VALUE is 0, not NaN.
MASK_VALUE = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))  # exactly representable in f32


def check_shapes(q_BTNH, k_BSKH, v_BSKH) -> None:
    b, _, n, h = q_BTNH.shape
    if k_BSKH.shape != v_BSKH.shape or k_BSKH.shape[0] != b or k_BSKH.shape[3] != h:
        raise ValueError(
            f"q {q_BTNH.shape}, k {k_BSKH.shape}, v {v_BSKH.shape}: expected [B,T,N,H], [B,S,K,H] x2"
        )
    if n % k_BSKH.shape[2]:
        raise ValueError(f"num query heads {n} must be a multiple of num kv heads {k_BSKH.shape[2]}")


def attention_reference(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    mask: Mask,
    *,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Einsum attention with f32 scores; O(T*S) memory. Returns o_BTNH (q's dtype), and lse_BTN if asked."""
    check_shapes(q_BTNH, k_BSKH, v_BSKH)
    b, t, n, h = q_BTNH.shape
    kv = k_BSKH.shape[2]
    scale = h**-0.5 if scale is None else scale
    ok_BTS = full_mask(mask.filled(q_BTNH, k_BSKH))
    q_BTKGH = q_BTNH.reshape(b, t, kv, n // kv, h)
    s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) * scale
    ok = ok_BTS[:, None, None]
    s_BKGTS = jnp.where(ok, s_BKGTS, MASK_VALUE)
    m = jnp.max(s_BKGTS, axis=-1, keepdims=True)
    p = jnp.where(ok, jnp.exp(s_BKGTS - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o_BTKGH = jnp.einsum("bkgts,bskh->btkgh", p, v_BSKH.astype(jnp.float32))
    o_BTNH = o_BTKGH.reshape(b, t, n, h).astype(q_BTNH.dtype)
    if not return_lse:
        return o_BTNH
    lse_BKGT = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), MASK_VALUE)[..., 0]
    lse_BTN = jnp.transpose(lse_BKGT, (0, 3, 1, 2)).reshape(b, t, n)
    return o_BTNH, lse_BTN


def merge_partials(o1_BTNH, lse1_BTN, o2_BTNH, lse2_BTN):
    """Combines attention over two disjoint key sets from their (o, lse); f32 in, f32 out."""
    lse_BTN = jnp.logaddexp(lse1_BTN, lse2_BTN)
    w1 = jnp.exp(lse1_BTN - lse_BTN)[..., None]
    w2 = jnp.exp(lse2_BTN - lse_BTN)[..., None]
    return o1_BTNH * w1 + o2_BTNH * w2, lse_BTN


def attention_reference_bwd(q_BTNH, k_BSKH, v_BSKH, do_BTNH, mask: Mask, *, scale: float | None = None):
    """(dq, dk, dv) of the reference by autodiff: what every kernel's backward must reproduce."""

    def f(q, k, v):
        return attention_reference(q, k, v, mask, scale=scale)

    _, vjp = jax.vjp(f, q_BTNH, k_BSKH, v_BSKH)
    return vjp(do_BTNH)


def attention_reference_bwd_from_lse(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    o_BTNH,
    lse_BTN,
    do_BTNH,
    mask: Mask,
    *,
    scale: float | None = None,
):
    """(dq, dk, dv) for one key block given the FINAL o and lse of the full attention.

    What a block kernel's backward computes when the keys are split across blocks (ring attention):
    p = exp(s - lse) uses the global lse, and delta = sum(do * o) the global output, so the block
    gradients of all key blocks add up to the gradient of the full attention. O(T*S) memory.
    """
    check_shapes(q_BTNH, k_BSKH, v_BSKH)
    b, t, n, h = q_BTNH.shape
    kv = k_BSKH.shape[2]
    g = n // kv
    scale = h**-0.5 if scale is None else scale
    ok_BTS = full_mask(mask.filled(q_BTNH, k_BSKH))
    f32 = jnp.float32
    q_BTKGH = q_BTNH.astype(f32).reshape(b, t, kv, g, h)
    do_BTKGH = do_BTNH.astype(f32).reshape(b, t, kv, g, h)
    k, v = k_BSKH.astype(f32), v_BSKH.astype(f32)
    lse_BTKG = lse_BTN.reshape(b, t, kv, g)
    delta_BTKG = jnp.sum(do_BTNH.astype(f32) * o_BTNH.astype(f32), axis=-1).reshape(b, t, kv, g)
    s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k) * scale
    p = jnp.exp(s_BKGTS - jnp.transpose(lse_BTKG, (0, 2, 3, 1))[..., None])
    p = jnp.where(ok_BTS[:, None, None], p, 0.0)
    dv = jnp.einsum("bkgts,btkgh->bskh", p, do_BTKGH)
    dp = jnp.einsum("btkgh,bskh->bkgts", do_BTKGH, v)
    ds = p * (dp - jnp.transpose(delta_BTKG, (0, 2, 3, 1))[..., None]) * scale
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, k).reshape(b, t, n, h)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, q_BTKGH)
    return dq.astype(q_BTNH.dtype), dk.astype(k_BSKH.dtype), dv.astype(v_BSKH.dtype)
