"""`Completion`: one sampled continuation, what `Engine.generate` returns."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Completion:
    """One sampled continuation. `logprobs[i]` is the log-prob of `tokens[i]` under the distribution it was
    drawn from (after temperature / top-k / top-p / min-p); `raw_logprobs` under the untempered softmax.
    A stop token ends the completion and is included; `finish_reason` is "stop" or "length".

    `expert_indices` (with `EngineConfig.record_routing`, else None): [L_moe, len(prompt) + len(tokens), k]
    int8 (int16 with more than 127 experts), row t the experts each MoE layer chose for token t of prompt +
    tokens when it was fed at position t; the last token is never fed, its row holds experts 0..k-1. A dense
    model gives L_moe = 0. See `inference.routing`."""

    prompt_index: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    sample_index: int = 0
    raw_logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)
    request_id: int = 0
    expert_indices: np.ndarray | None = None
