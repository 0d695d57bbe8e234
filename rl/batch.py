"""The trainer's batches from episodes: one padder (`empty_batch`, filled row by row) and one truncation rule
(`head`) for the GRPO batch of rollouts (`make_batch`) and the SFT warm start's (`sft_batch`).

Dimension key: B rows, T token positions, L MoE layers, k experts per token. The entries and their logical
axes are `rl.train_state.BATCH_AXES`'s. Rows are right-padded; a row longer than the batch keeps its first
T tokens: the prompt whole and the start of the completion (a prompt that leaves no room is refused).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from rl import rollout
from rl.rollout import Sample

SFT_KEYS = ("tokens_BT", "positions_BT", "mask_BT")


def head(row: Sequence[int], length: int) -> Sequence[int]:
    """The truncation rule: a row keeps its first `length` tokens."""
    return row[:length]


def make_batch(
    samples: Sequence[Sample],
    *,
    adv_std: str = "group",
    eps: float = 1e-6,
    length_bucket: int = 64,
    max_len: int | None = None,
    row_multiple: int = 1,
    rows: int | None = None,
    pad_id: int = 0,
    routing: bool = False,
    domains: Sequence[str] | None = None,
    window: int = 0,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The GRPO batch (numpy) of `samples` and its statistics. Groups are `Sample.group`.

    Row r is prompt + completion tokens, right-padded with `pad_id` to T, the longest row rounded up to a
    multiple of `length_bucket` (few distinct shapes for the jitted step). `mask_BT` and `behaviour_logp_BT`
    sit on the positions of the tokens they score (`logp_BT[:, t]` scores token t); prompt, observation and
    padding positions are 0. Truncation: with `max_len`, T is at most `max_len` and a longer row keeps its
    first `max_len` tokens (`head`: the end of its completion is dropped, reward and advantage unchanged); a
    prompt of `max_len` tokens or more leaves nothing to train on and is an error. Rows are padded with empty
    rows (mask 0, advantage 0) to a multiple of `row_multiple` (e.g. data shards times micro-batches), or to
    exactly `rows` (the trainer's fixed [rows, max_len] shape: `length_bucket=max_len`).

    `domains` adds `domain_B` int32: each row's index in `domains` (the gradient projection's split), -1
    on padding rows.

    `window` > 0: the trainer computes logits for that many positions per row from its first trained token
    on (`rl.losses.logit_window`); a row with more tokens after its prompt is an error.

    `routing=True` adds `expert_indices` [L_moe, B, T, k] int32: each sample's recorded routing
    (`Sample.expert_indices`) at its token positions, and experts 0..k-1 at padding (positions after a
    row's end, which no trained logit attends to).
    """
    if not samples:
        raise ValueError("make_batch needs at least one sample")
    lengths = [len(s.prompt_tokens) + len(s.tokens) for s in samples]
    if max_len is not None:
        too_long = [len(s.prompt_tokens) for s in samples if len(s.prompt_tokens) >= max_len]
        if too_long:
            raise ValueError(f"prompts of {too_long[:3]} tokens leave no completion token within {max_len}")
    t = -(-max(lengths) // length_bucket) * length_bucket
    t = t if max_len is None else min(t, max_len)
    b = -(-len(samples) // row_multiple) * row_multiple
    if rows is not None:
        if len(samples) > rows:
            raise ValueError(f"{len(samples)} samples do not fit a batch of rows={rows}")
        b = rows
    if window:
        spans = [min(n, t) - len(s.prompt_tokens) for n, s in zip(lengths, samples)]
        if max(spans) > window:
            raise ValueError(
                f"a row has {max(spans)} tokens after its prompt, more than the trainer's logit window of "
                f"{window} (rl.max_new_tokens with rl.max_turns = 1): single-turn completions are at most "
                "rl.max_new_tokens long; raise rl.max_new_tokens"
            )
    routing_shape = _routing_shape(samples) if routing else None
    batch = empty_batch(b, t, routing=routing_shape, domains=domains, pad_id=pad_id)
    tokens_BT, mask_BT, logp_BT = batch["tokens_BT"], batch["mask_BT"], batch["behaviour_logp_BT"]
    for r, s in enumerate(samples):
        p, row = len(s.prompt_tokens), head(s.prompt_tokens + s.tokens, t)
        tokens_BT[r, : len(row)] = row
        mask_BT[r, p : len(row)] = s.mask[: len(row) - p]
        logp_BT[r, p : len(row)] = s.behaviour_logp[: len(row) - p]
        if routing:
            n = min(s.expert_indices.shape[1], t)
            batch["expert_indices"][:, r, :n] = s.expert_indices[:, :n]
    advantages_B = batch["advantages_B"]
    advantages_B[: len(samples)] = rollout.advantages(samples, std=adv_std, eps=eps)
    for s, a in zip(samples, advantages_B.tolist()):
        s.advantage = a
    if domains is not None:
        index = {d: i for i, d in enumerate(domains)}
        unknown = sorted({s.task.domain for s in samples} - set(index))
        if unknown:
            raise ValueError(f"samples of domains {unknown} are not in domains={tuple(domains)}")
        batch["domain_B"][: len(samples)] = [index[s.task.domain] for s in samples]
    return batch, _stats(samples, lengths, t, mask_BT, advantages_B)


def empty_batch(
    rows: int,
    seq_len: int,
    *,
    routing: tuple[int, int] | None = None,
    domains: Sequence[str] | None = None,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """`make_batch`'s entries with every row padding (tokens `pad_id`, mask, log-probs and advantages 0,
    experts 0..k-1, domain -1): what `make_batch` fills with its samples, and what the main job compiles
    its update on before the first rollout. `routing`: (MoE layers, experts per token) for
    `expert_indices`; `domains` adds `domain_B`."""
    batch = {
        "tokens_BT": np.full((rows, seq_len), pad_id, np.int32),
        "positions_BT": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy(),
        "mask_BT": np.zeros((rows, seq_len), np.float32),
        "advantages_B": np.zeros(rows, np.float32),
        "behaviour_logp_BT": np.zeros((rows, seq_len), np.float32),
    }
    if routing is not None:
        layers, k = routing
        batch["expert_indices"] = np.broadcast_to(
            np.arange(k, dtype=np.int32), (layers, rows, seq_len, k)
        ).copy()
    if domains is not None:
        batch["domain_B"] = np.full(rows, -1, np.int32)
    return batch


def _routing_shape(samples: Sequence[Sample]) -> tuple[int, int]:
    """(MoE layers, experts per token) of the samples' recorded routing; every sample must carry one."""
    missing = [i for i, s in enumerate(samples) if s.expert_indices is None]
    if missing:
        raise ValueError(
            f"samples {missing[:5]} carry no expert_indices; routing replay needs an engine built with "
            "EngineConfig(record_routing=True) (rl.routing_replay turns it on)"
        )
    num_layers, _, k = samples[0].expert_indices.shape
    return num_layers, k


def _stats(samples, lengths, t, mask_BT, advantages_B) -> dict[str, float]:
    versions = [v for s in samples for v in s.policy_versions if v >= 0]
    stats: dict[str, float] = {
        "rows": float(mask_BT.shape[0]),
        "samples": float(len(samples)),
        "groups": float(len({s.group for s in samples})),
        "seq_len": float(t),
        "trained_tokens": float(mask_BT.sum()),
        "truncated_rows": float(sum(n > t for n in lengths)),
        "pad_fraction": float(1.0 - sum(min(n, t) for n in lengths) / mask_BT.size),
        "reward_mean": float(np.mean([s.reward for s in samples])),
        "generated_tokens_mean": float(np.mean([s.num_generated for s in samples])),
        "turns_mean": float(np.mean([s.turns for s in samples])),
        "stop_fraction": float(np.mean([s.finish_reason == "stop" for s in samples])),
        "advantage_abs_mean": float(np.abs(advantages_B[: len(samples)]).mean()),
        "policy_version_min": float(min(versions, default=-1)),
        "policy_version_max": float(max(versions, default=-1)),
    }
    by_domain: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_domain[s.task.domain].append(s)
        stats[f"status/{s.status}"] = stats.get(f"status/{s.status}", 0.0) + 1.0
    for domain, members in by_domain.items():
        stats[f"reward_mean/{domain}"] = float(np.mean([s.reward for s in members]))
        stats[f"samples/{domain}"] = float(len(members))
        stats[f"sandbox_seconds/{domain}"] = float(sum(s.sandbox_seconds for s in members))
        stats[f"generated_tokens/{domain}"] = float(sum(s.num_generated for s in members))
    return stats


def sft_batch(
    examples: Sequence[tuple[list[int], list[int]]], rows: int, length: int
) -> dict[str, np.ndarray]:
    """[rows, length] tokens, positions and mask of SFT examples ((tokens, mask) pairs: prompt, solution and
    eos, the mask on the solution); an example longer than `length` keeps its first `length` tokens (`head`);
    missing rows are all padding (mask 0)."""
    batch = {k: v for k, v in empty_batch(rows, length).items() if k in SFT_KEYS}
    for r, (toks, m) in enumerate(examples[:rows]):
        toks, m = head(toks, length), head(m, length)
        batch["tokens_BT"][r, : len(toks)] = toks
        batch["mask_BT"][r, : len(m)] = m
    return batch
