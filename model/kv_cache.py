"""The KV cache types the model reads and writes: a contiguous `DenseCache` and a `PagedCache`.

Both are NamedTuples, so they are pytrees (jit, scan and tree maps see their arrays) and the model picks the
attention path by type, not by the keys of a dict. Page arrays are named by `PAGE_KEYS`: GQA's `k` and `v`,
or MLA's one `latent` array whose rows are both keys and values.

Dimension key: L layers, B batch, S cache slots, K kv heads (1 for MLA), W row width, P pages, Lp tokens
per page, M pages per row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

PAGE_KEYS = ("k", "v", "latent")  # the arrays a KV cache holds: GQA keys and values, or MLA latent rows


def page_keys(arrays: dict) -> tuple[str, ...]:
    """The page arrays' names among `arrays`' keys (the engine's dict holds other state beside them)."""
    return tuple(k for k in PAGE_KEYS if k in arrays)


class DenseCache(NamedTuple):
    """A contiguous cache: `max_len` slots per row. For one attention layer `arrays` maps each `PAGE_KEYS`
    name to [B, S, K, W] ([L, B, S, K, W] for a stack of layers); for the whole model (`init_cache`) it maps
    "dense" and "moe" to their layer stacks' arrays (None where there are no such layers). `index` [B]
    ([L, B] inside a stack) is how many tokens each row has cached: new tokens are written from there."""

    arrays: dict
    index: jax.Array


class PagedCache(NamedTuple):
    """The engine's paged cache for one forward: `pages` maps each `PAGE_KEYS` name to its page array
    [Lc * K, P, Lp, W] (layer i owns rows i*K .. i*K + K - 1), `page_table` [B, M] each row's pages,
    `start` [B] tokens already cached per row, `num_new` [B] how many of the T new tokens are real (the rest
    is padding, written to the null page 0 and never read), and `layer` the cache layer of the attention
    being run (set by the model as it walks its layers)."""

    pages: dict
    page_table: jax.Array
    start: jax.Array
    num_new: jax.Array
    layer: jax.Array | int = 0
