"""Routing record for routing replay (R3): the experts each MoE layer chose for every token the target fed.

Dimension key: L MoE layers, P pages in the pool, S slots per page, k experts per token, B rows, T tokens,
M pages per row in the page table, N pages read at once.

The record lives in device pages beside the K/V, `kv["experts"]` [L, P, S, k]: slot (page, s) holds the
routing of the token whose K/V sits at (page, s). The engine's steps write it through the page table exactly
like the K/V (`write`), so prefix reuse, copy-on-write forks (`steps.copy_pages` copies every cache entry),
speculative rollback and re-prefill after preemption keep it right without bookkeeping of its own. The model
never sees it: `steps` hands the model only `k` / `v`.

A finished sequence's rows are read from its pages before they are freed (`read`: the pages of every
sequence finishing in one step in one device read). Row t is the routing of token t of prompt + completion
when it was fed at position t; the last completion token is never fed (nothing after it is predicted), so
its row holds experts 0..k-1, as the trainer's batch does at padding: it only changes the
logits at the last position, which predict no trained token.

After a preemption the re-prefilled positions hold the routing of the re-prefill (the same tokens and
positions; in f32 the same experts up to near-ties), i.e. the routing the later tokens were sampled with.

Cost: L * k bytes per token of pool (int8 when num_experts <= 127, else int16: 2 L k bytes), one scatter
per step and one small gather per step in which sequences finish.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def dtype(num_experts: int) -> np.dtype:
    """int8 when every expert id fits (num_experts <= 127), else int16."""
    return np.dtype(np.int8 if num_experts <= 127 else np.int16)


def init_pages(
    num_moe_layers: int, num_pages: int, page_size: int, top_k: int, num_experts: int
) -> jax.Array:
    """Empty record pages [L, P, S, k]."""
    return jnp.zeros((num_moe_layers, num_pages, page_size, top_k), dtype(num_experts))


def write(experts_LPSk: jax.Array, idx_LBTk: jax.Array, table_BM, start_B, num_new_B) -> jax.Array:
    """Writes the routing of the `num_new_B` real tokens of each row at positions start.. through the page
    table (the slots `model.attention.paged_cache_attention` writes K/V to); padding goes to the null page."""
    _, b, t, _ = idx_LBTk.shape
    page = experts_LPSk.shape[2]
    pos_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid_BT = jnp.arange(t)[None, :] < num_new_B[:, None]
    page_idx_BT = jnp.minimum(pos_BT // page, table_BM.shape[1] - 1)
    page_BT = jnp.where(valid_BT, jnp.take_along_axis(table_BM, page_idx_BT, axis=1), 0)
    slot_BT = jnp.where(valid_BT, pos_BT % page, 0)
    return experts_LPSk.at[:, page_BT, slot_BT].set(idx_LBTk.astype(experts_LPSk.dtype))


@jax.jit
def _gather(experts_LPSk, pages_N):
    return experts_LPSk[:, pages_N]


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def gather(experts_LPSk: jax.Array, pages: Sequence[int]) -> jax.Array:
    """The listed pages [L, N', S, k] on device, N' = len(pages) padded to a power of two (padding reads the
    null page), so a handful of shapes covers every call."""
    padded = np.zeros(_bucket(len(pages)), np.int32)
    padded[: len(pages)] = pages
    return _gather(experts_LPSk, padded)


def read(experts_LPSk: jax.Array, seqs: Sequence[tuple[Sequence[int], int]]) -> list[np.ndarray]:
    """One [L, length, k] record per (pages, length) sequence, in one device read: rows 0..length-2 from
    the pages (positions the target fed), the last row experts 0..k-1."""
    if not seqs:
        return []
    all_pages = [p for pages, _ in seqs for p in pages]
    host_LNSk = np.asarray(jax.device_get(gather(experts_LPSk, all_pages)))
    num_layers, _, page, k = host_LNSk.shape
    out, first = [], 0
    for pages, length in seqs:
        rows_LSk = host_LNSk[:, first : first + len(pages)].reshape(num_layers, len(pages) * page, k)
        first += len(pages)
        if length - 1 > rows_LSk.shape[1]:
            raise AssertionError(f"{len(pages)} pages hold fewer than the {length - 1} fed positions")
        record = np.empty((num_layers, length, k), host_LNSk.dtype)
        record[:, : length - 1] = rows_LSk[:, : length - 1]
        record[:, length - 1] = np.arange(k)
        out.append(record)
    return out


def empty(length: int, top_k: int) -> np.ndarray:
    """The record of a dense model (no MoE layers): [0, length, k]."""
    return np.zeros((0, length, top_k), np.int8)
