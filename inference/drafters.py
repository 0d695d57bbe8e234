"""Draft proposers for exact speculative decoding (`inference.speculative`).

- `ModelDrafter(cfg, params)`: a smaller model with the target's vocabulary. The engine gives it its own
  paged cache over the same page tables (so copy-on-write, prefix reuse and rollback apply to both) and runs
  it on device inside the speculative step: it samples k tokens from its processed distribution q, with the
  request's temperature / top-k / top-p, and the target verifies them.
- `NgramDrafter(n)`: prompt lookup. The last `n` tokens (then n - 1, ..., 1) are searched for earlier in the
  sequence (prompt and generated text); the tokens that followed the most recent match are proposed. Its q is
  the one-hot on the proposal, so verification stays exact. Costs no model forward at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx

import model as model_lib


class ModelDrafter:
    """A draft model: `cfg` (its own model config) and `params` (its nnx.Param state)."""

    def __init__(self, cfg: ml_collections.ConfigDict, params: nnx.State):
        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
        self.graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        _check_params("draft params", params, abstract_params)
        self.params = params


class NgramDrafter:
    """Proposes up to k tokens by matching the last `n` (down to 1) tokens earlier in the sequence."""

    def __init__(self, n: int = 3, *, window: int = 1024):
        if n < 1:
            raise ValueError(f"NgramDrafter(n={n}): n must be >= 1 (the longest suffix to match).")
        self.n, self.window = n, window

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """The k tokens (or fewer) that followed the most recent earlier occurrence of the longest matching
        suffix of `tokens` (at most n long), within the last `window` tokens; [] when nothing matches."""
        seq = np.asarray(tokens[-self.window :], np.int64)
        length = len(seq)
        for n in range(min(self.n, length - 1), 0, -1):
            suffix = seq[length - n :]
            # Windows starting at 0 .. length - n - 1: every earlier occurrence, none overlapping the end.
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero(np.all(windows == suffix[None], axis=1))
            if hits.size:
                # The latest match with k tokens after it (in a loop of period P < k the latest match has
                # only P), else the latest match.
                full = hits[hits + n + k <= length]
                start = int(full[-1] if full.size else hits[-1]) + n
                return seq[start : start + k].tolist()
        return []


def _check_params(name: str, params, abstract) -> None:
    """The same tree, shapes and dtypes as the model built from the config, or a clear error."""
    got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    want = jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
    if jax.tree.structure(got) != jax.tree.structure(want) or got != want:
        bad = [
            f"{jax.tree_util.keystr(path)}: {g} vs {w}"
            for (path, g), w in zip(
                jax.tree_util.tree_leaves_with_path(got, is_leaf=lambda x: isinstance(x, tuple)),
                jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, tuple)),
            )
            if g != w
        ][:3]
        raise ValueError(
            f"{name} do not match the model config (tree structure or (shape, dtype) differ: {bad}); "
            "pass the nnx.Param state of a model built from the same config."
        )
