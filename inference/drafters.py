"""Draft proposers for exact speculative decoding (`inference.speculative`).

- `ModelDrafter(cfg, params)`: a smaller model with the target's vocabulary. The engine gives it its own
  paged cache over the same page tables (so copy-on-write, prefix reuse and rollback apply to both) and runs
  it on device inside the speculative step: it samples k tokens from its processed distribution q, with the
  request's temperature / top-k / top-p, and the target verifies them.
- `NgramDrafter(n)`: prompt lookup. The last `n` tokens (then n - 1, ..., 1) are searched for earlier in the
  sequence (prompt and generated text); the tokens that followed the most recent match are proposed. Its q is
  the one-hot on the proposal, so verification stays exact. Costs no model forward at all.
- `MTPDrafter()`: the target's own multi-token-prediction head (DeepSeek-V3's MTP module) drafts from the
  target's hidden state, on device inside the speculative step, with its own K/V pages.
- `GroupDrafter(n)`: proposals from the other samples of the same request (the n samples of a GRPO group
  share their prompt and often much of their text), falling back to the sequence's own text. Model-free and
  one-hot like `NgramDrafter`.

A one-hot draft keeps more than each sample's law: verifying a proposal x emits a token distributed exactly
as p whatever x is, so a sample stays independent of the siblings its proposals came from (GRPO's group
advantages need independent samples). Token-for-token reproducibility is per engine configuration: the
group drafter's proposals depend on how far the siblings got, i.e. on the batching.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx

import model as model_lib
from model.moe.layer import ExpertBias

# What a model runs on in the engine: its parameters and the sigmoid routers' selection biases.
WEIGHTS = (nnx.Param, ExpertBias)


def split_weights(cfg: ml_collections.ConfigDict) -> tuple[nnx.GraphDef, nnx.State]:
    """(graph definition, abstract `WEIGHTS` state) of the model `cfg` describes."""
    abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, WEIGHTS)


def model_weights(name: str, given, like: nnx.State, *, keep: nnx.State | None = None) -> nnx.State:
    """`given` (a Transformer, or a state of its `nnx.Param`s with or without its `ExpertBias`es) as the
    state of `WEIGHTS` with the tree, shapes and dtypes of `like`. A model with a sigmoid router needs its
    selection biases: a Param-only state takes those of `keep` (the engine's current ones), else it is
    refused (zero biases would route differently from the checkpoint)."""
    if isinstance(given, nnx.Module):
        given = nnx.state(given, WEIGHTS)
    biases = lambda state: jax.tree.leaves(nnx.filter_state(state, ExpertBias))
    if biases(like) and not biases(given):
        if keep is None:
            raise ValueError(
                f"{name}: this model has a sigmoid router, whose selection biases (ExpertBias) are not "
                "nnx.Params; pass the module or nnx.state(model, (nnx.Param, model.moe.layer.ExpertBias))."
            )
        given = nnx.merge_state(given, nnx.filter_state(keep, ExpertBias))
    _check_params(name, given, like)
    return given


class ModelDrafter:
    """A draft model: `cfg` (its own model config) and `params` (its nnx.Param state, with the selection
    biases of a sigmoid router: see `model_weights`; or the module)."""

    def __init__(self, cfg: ml_collections.ConfigDict, params):
        self.cfg = cfg
        self.graphdef, abstract = split_weights(cfg)
        self.params = model_weights("draft params", params, abstract)


class MTPDrafter:
    """The target's own multi-token-prediction head (`model.mtp_layers`, DeepSeek-V3's MTP modules) as the
    drafter: the same weights propose and verify (the "high-speed variant" of a model is the model itself).
    The engine keeps the first MTP module's K/V in pages of its own over the same page tables and runs it
    inside the speculative step (`inference.steps.speculative_mtp`); `update_params` moves it with the
    target. A cached prefix shares the module's K/V too: the entry at a cached prefix's last position read
    the token that followed it when it was cached, which lowers acceptance by at most that one position,
    never exactness."""


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


class GroupDrafter:
    """Proposes up to k tokens from sibling samples (same request): the most recent match of the sequence's
    last `n` tokens (then n - 1, ..., 1) in a sibling's prompt tail + completion, still decoding or finished,
    proposing what followed there; at each length a sibling match comes before one in the sequence's own
    prompt + completion (the `NgramDrafter` fallback). `group(prompt, num_samples)` makes the per-request
    index the engine keeps until the request's last sample finishes."""

    def __init__(self, n: int = 3, *, max_scan: int = 64):
        if n < 1:
            raise ValueError(f"GroupDrafter(n={n}): n must be >= 1 (the longest suffix to match).")
        if max_scan < 1:
            raise ValueError(f"GroupDrafter(max_scan={max_scan}) must be >= 1.")
        self.n, self.max_scan = n, max_scan

    def group(self, prompt: Sequence[int], num_samples: int) -> SampleGroup:
        return SampleGroup(prompt, num_samples, self.n, self.max_scan)


class SampleGroup:
    """The n-gram index of one request's samples: every n-gram (lengths 1..n) of prompt + completion of each
    sample, with where its next token sits, in the order the tokens arrived. The prompt's own n-grams are
    indexed once (owner -1); an n-gram followed by a sample's token belongs to that sample. Updating costs
    n dict appends per token and proposing at most n lookups and `max_scan` candidates per length, whatever
    the lengths: the engine calls `propose` for every row of every speculative step."""

    def __init__(self, prompt: Sequence[int], num_samples: int, n: int, max_scan: int):
        self.prompt, self.n, self.max_scan = [int(t) for t in prompt], n, max_scan
        self.tokens: list[list[int]] = [[] for _ in range(num_samples)]
        self.finished = 0  # samples done; their text stays until the last one (`finish`)
        self._grams: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for nxt in range(1, len(self.prompt)):
            self._index(-1, nxt)

    def _slice(self, owner: int, a: int, b: int) -> list[int]:
        """Tokens a..b-1 of prompt + completion of sample `owner` (the prompt alone for owner -1)."""
        p = len(self.prompt)
        if owner < 0 or b <= p:
            return self.prompt[a:b]
        toks = self.tokens[owner]
        return toks[a - p : b - p] if a >= p else self.prompt[a:] + toks[: b - p]

    def _index(self, owner: int, nxt: int) -> None:
        """Registers the n-grams ending just before position `nxt` of `owner`'s sequence."""
        for m in range(1, min(self.n, nxt) + 1):
            gram = tuple(self._slice(owner, nxt - m, nxt))
            self._grams.setdefault(gram, []).append((owner, nxt))

    def append(self, sample: int, tokens: Sequence[int]) -> None:
        """Sample `sample` emitted `tokens` (in order)."""
        for tok in tokens:
            self.tokens[sample].append(int(tok))
            self._index(sample, len(self.prompt) + len(self.tokens[sample]) - 1)

    def finish(self) -> bool:
        """One more sample finished; True when it was the last (the engine then drops the index)."""
        self.finished += 1
        return self.finished == len(self.tokens)

    def propose(self, sample: int, k: int) -> list[int]:
        """Up to k tokens for sample `sample`; [] when no suffix of its text occurred before."""
        length = len(self.prompt) + len(self.tokens[sample])
        for m in range(min(self.n, length), 0, -1):
            hits = self._grams.get(tuple(self._slice(sample, length - m, length)))
            if not hits:
                continue
            best = {True: None, False: None}  # sibling?, -> (tokens available, owner, next position)
            for owner, nxt in reversed(hits[-self.max_scan :]):
                sibling = owner not in (-1, sample)
                # Own and prompt matches continue in this sample's own text (the prompt runs into it).
                src = owner if sibling else sample
                avail = min(len(self.prompt) + len(self.tokens[src]) - nxt, k)
                if best[sibling] is None or avail > best[sibling][0]:
                    best[sibling] = (avail, src, nxt)
                if sibling and avail == k:
                    break  # the most recent sibling match with k tokens after it
            choice = best[True] or best[False]
            if choice is not None:
                avail, src, nxt = choice
                return self._slice(src, nxt, nxt + avail)
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


DRAFTERS = (ModelDrafter, NgramDrafter, GroupDrafter, MTPDrafter)


def check_drafter(draft, cfg: ml_collections.ConfigDict, engine_cfg) -> None:
    """Raises what is wrong with `draft` (one of `DRAFTERS` or None) for an engine of `engine_cfg` over the
    model `cfg`."""
    if draft is not None and not isinstance(draft, DRAFTERS):
        raise TypeError(
            f"draft={draft!r} must be an inference.ModelDrafter, NgramDrafter, GroupDrafter, "
            "MTPDrafter or None."
        )
    if isinstance(draft, MTPDrafter) and not cfg.model.mtp_layers:
        raise ValueError(
            "draft=MTPDrafter() needs a model with multi-token-prediction modules "
            "(model.mtp_layers >= 1, DeepSeek-V3's num_nextn_predict_layers); this one has none."
        )
    vocab = cfg.model.vocab_size
    if isinstance(draft, ModelDrafter) and draft.cfg.model.vocab_size != vocab:
        raise ValueError(f"draft model vocab_size={draft.cfg.model.vocab_size} != target vocab_size={vocab}.")
    if draft is not None and not isinstance(draft, ModelDrafter) and engine_cfg.decode_steps > 1:
        raise ValueError(
            f"engine.decode_steps={engine_cfg.decode_steps} must be 1 with a {type(draft).__name__} (its "
            "proposals come from the host or the last step, one device call per speculative step); "
            "multi-step calls are for plain decoding and a ModelDrafter."
        )
