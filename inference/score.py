"""Teacher-forced scoring (`Engine.score`): the log-probs a plain forward pass gives each completion token,
in batches of rows of similar length, padded to power-of-two buckets so the scoring calls compile once per
bucket."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from inference.completion import Completion
from inference.sampling import SamplingParams, sampling_arrays
from inference.scheduler import pow2


def score(
    run: Callable,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion | Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    processed: bool,
    batch: int,
    min_bucket: int,
) -> list[np.ndarray]:
    """f32 log-probs of each completion's tokens after its prompt: `run(tokens_BT, sampling arrays)` gives
    (processed, raw) log-probs [B, T] of each position's token; `processed` picks the first (under
    `params[i]`'s sampling processing), else the raw softmax. At most `batch` rows per call."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
    rows = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        toks = list(c.tokens if isinstance(c, Completion) else c)
        rows.append((i, [int(t) for t in p], toks))
    out: list[np.ndarray | None] = [None] * len(rows)
    by_len = sorted(rows, key=lambda r: len(r[1]) + len(r[2]))
    for start in range(0, len(by_len), batch):
        chunk = by_len[start : start + batch]
        t = max(min_bucket, pow2(max(len(p) + len(c) for _, p, c in chunk)))
        b = pow2(len(chunk))
        tokens = np.zeros((b, t), np.int32)
        for r, (_, p, c) in enumerate(chunk):
            tokens[r, : len(p) + len(c)] = p + c
        arrays = sampling_arrays([params[i] for i, _, _ in chunk] + [SamplingParams()] * (b - len(chunk)))
        chosen_processed, raw = jax.device_get(run(tokens, arrays))
        chosen = chosen_processed if processed else raw
        for r, (i, p, c) in enumerate(chunk):
            out[i] = chosen[r, len(p) : len(p) + len(c)]
    return out
