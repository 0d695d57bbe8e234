"""A JAX key from a seed of any size.

`jax.random.key(seed)` keeps only the low 32 bits of a Python int on the default (32-bit) configuration and
overflows above 2**64: seeds 5 and 2**32 + 5 give the same key, and every seed above 2**63 fails. `key`
equals `jax.random.key(seed)` below 2**32 (runs seeded before keep their numbers) and folds every further
32-bit chunk in, so distinct seeds of any size give distinct keys.
"""

from __future__ import annotations

import jax

CHUNK = 2**32


def key(seed: int) -> jax.Array:
    """The key of a non-negative int seed of any size (see the module docstring)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0 (any size)")
    k = jax.random.key(seed % CHUNK)
    seed //= CHUNK
    while seed:
        k = jax.random.fold_in(k, seed % CHUNK)
        seed //= CHUNK
    return k
