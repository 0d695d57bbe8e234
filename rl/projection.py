"""Gradient projection between domains (PCGrad, Yu et al. 2020) for `rl.gradient_projection`.

Dimension key: D domains of the run (`rl.domains`, in that order), N parameters (a pytree's leaves).

The train step computes one gradient per domain, g_D (the gradient of the rows of that domain, weighted by
the domain's share of the batch's loss units, so that sum_d g_d is the ordinary batch gradient). PCGrad
makes each g_i leave out its conflict with every other domain: for j != i in ascending order, if
g_i' . g_j < 0, then g_i' -= (g_i' . g_j / |g_j|^2) g_j (against the unprojected g_j, as in the paper; the
order is fixed, not random, so a step is a function of its batch). The update is sum_i g_i'.

Every g_i' is a combination of the original gradients, g_i' = sum_k A_ik g_k, and every dot product the
rule needs is a combination of the Gram matrix G_DD = g_D g_D^T. So the projection runs on D x D numbers
and touches the parameters once: the update is sum_k c_k g_k with c = 1^T A.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def gram_DD(grads_D) -> jax.Array:
    """G[i, j] = <g_i, g_j> over every leaf (f32) of a pytree whose leaves are stacked [D, ...]."""
    leaves = jax.tree.leaves(grads_D)
    d = leaves[0].shape[0]
    gram = jnp.zeros((d, d), jnp.float32)
    for leaf in leaves:
        flat = leaf.reshape(d, -1).astype(jnp.float32)
        gram = gram + flat @ flat.T
    return gram


def pcgrad_coefficients(gram_DD: jax.Array, eps: float = 1e-30) -> tuple[jax.Array, jax.Array]:
    """(c_D, conflicts): the projected update is sum_k c_k g_k; `conflicts` counts the projections made
    (ordered pairs i != j with g_i' . g_j < 0). A zero gradient g_j (|g_j|^2 <= eps) projects nothing."""
    d = gram_DD.shape[0]
    rows = []
    conflicts = jnp.zeros((), jnp.float32)
    for i in range(d):
        a_D = jnp.zeros((d,), jnp.float32).at[i].set(1.0)
        for j in range(d):
            if j == i:
                continue
            dot = a_D @ gram_DD[:, j]  # g_i' . g_j
            norm2 = gram_DD[j, j]
            hit = (dot < 0) & (norm2 > eps)
            a_D = a_D.at[j].add(jnp.where(hit, -dot / jnp.maximum(norm2, eps), 0.0))
            conflicts = conflicts + hit.astype(jnp.float32)
        rows.append(a_D)
    return jnp.stack(rows).sum(axis=0), conflicts


def combine(grads_D, c_D: jax.Array):
    """sum_k c_k g_k, leaf by leaf."""
    return jax.tree.map(lambda g: jnp.tensordot(c_D, g.astype(jnp.float32), axes=1), grads_D)


def cosine_DD(gram_DD: jax.Array) -> jax.Array:
    """Cosines between the domains' gradients (0 where a gradient is zero)."""
    norm_D = jnp.sqrt(jnp.maximum(jnp.diag(gram_DD), 0.0))
    outer = norm_D[:, None] * norm_D[None, :]
    return jnp.where(outer > 0, gram_DD / jnp.maximum(outer, 1e-30), 0.0)


def project(grads_D, domains: tuple[str, ...]) -> tuple[object, dict[str, jax.Array]]:
    """(the PCGrad update, metrics): `projection/conflicts`, `projection/cosine/<a>|<b>` for every pair,
    and `projection/kept`, |update| / |sum of the unprojected gradients|."""
    gram = gram_DD(grads_D)
    c_D, conflicts = pcgrad_coefficients(gram)
    cos = cosine_DD(gram)
    update = combine(grads_D, c_D)
    # |update| from the update itself: where domains conflict, c^T G c subtracts terms of order |g|^2, and its
    # square root turns f32 rounding into ~1e-3 (a kept fraction of exactly 0 came out as 1.07e-3).
    # (optax.tree.norm: the norm the train step reports as grad_norm, of the same update)
    plain2 = jnp.sum(gram)  # |sum_d g_d|^2 = 1^T G 1
    kept = optax.tree.norm(update) / jnp.sqrt(jnp.maximum(plain2, 1e-30))
    metrics = {"projection/conflicts": conflicts}
    metrics["projection/kept"] = jnp.where((conflicts > 0) & (plain2 > 0), kept, 1.0)  # none: the plain sum
    for i, a in enumerate(domains):
        for j in range(i + 1, len(domains)):
            metrics[f"projection/cosine/{a}|{domains[j]}"] = cos[i, j]
    return update, metrics
