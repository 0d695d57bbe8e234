"""The main job's per-step metrics that are computed, not logged as they come: the rollout batch's dashboard
numbers, the engine's rates since the last log line, the devices' memory, and every process's domain draws
summed for the curriculum. Names are for dashboards (`rl.metrics`); the curriculum reads `DomainDraw`s."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rl import distributed
from rl import memory as memory_lib
from rl.rollout import DomainDraw


def memory(state, ref_params, engine) -> dict[str, float]:
    """`memory/*` of the logged step, each the largest over every process: the bytes any one device holds
    in live arrays, and in each part (params, optimizer state, reference, sampler weights, KV pages), and
    the peak resident memory of a process (`rl.memory`; the planner's figure: `model.plan --sampler`)."""
    parts = {
        "params": state.params,
        "optimizer": state.opt_state,
        "reference": ref_params,
        "sampler_weights": (engine.params, engine.draft_params),
        "kv_pages": (engine.kv, engine.draft_kv, engine.mtp_kv),
    }
    mine = memory_lib.snapshot(parts)
    return dict(zip(mine, distributed.allgather(list(mine.values())).max(axis=0)))


def global_draws(drawn: dict, domains: Sequence[str]) -> dict:
    """Every process's draws per domain, summed (the curriculum is replicated: it must see them all)."""
    zero = DomainDraw()
    local = [drawn.get(d, zero) for d in domains]
    rows = distributed.allgather(
        [x for d in local for x in (d.samples, d.reward_sum, d.tokens, d.sandbox_seconds)]
    )
    total = rows.sum(axis=0).reshape(len(domains), 4)
    out = {}
    for d, (n, reward, tokens, seconds) in zip(domains, total):
        if n:
            out[d] = DomainDraw(int(round(n)), float(reward), int(round(tokens)), float(seconds))
    return out


def rollout_metrics(counts, stats, drawn, samples) -> dict[str, float]:
    """Dashboard metrics of one rollout batch (names for people; the curriculum reads `drawn`)."""
    out = {f"rollout/{k}": float(v) for k, v in {**counts, **stats}.items() if _is_number(v)}
    total = sum(d.samples for d in drawn.values())
    if total:
        out["reward"] = sum(d.reward_sum for d in drawn.values()) / total
    for d, draw in drawn.items():
        out[f"reward/{d}"] = draw.mean_reward
        out[f"tokens/{d}"] = float(draw.tokens)
        out[f"sandbox_seconds/{d}"] = draw.sandbox_seconds
    if samples:
        out["kept_reward"] = float(np.mean([s.reward for s in samples]))
    for d in sorted({s.task.domain for s in samples}):
        out[f"kept_ok/{d}"] = float(np.mean([s.status == "ok" for s in samples if s.task.domain == d]))
    return out


_ENGINE_COUNTS = (
    "generated_tokens",
    "target_row_forwards",
    "proposed_tokens",
    "accepted_tokens",
    "preemptions",
)


_PREFIX_COUNTS = ("lookup_tokens", "hit_tokens", "offloads", "reloads")


def engine_counts(engine) -> dict[str, float]:
    """The engine's running counters (this process's engine) that `engine_metrics` turns into rates."""
    stats = engine.stats()
    prefix = stats.get("prefix_cache", {})
    out = {k: float(stats.get(k, 0)) for k in _ENGINE_COUNTS}
    out.update({f"prefix_{k}": float(prefix.get(k, 0)) for k in _PREFIX_COUNTS})
    return out


def engine_metrics(before: dict[str, float], now: dict[str, float], host_tier: bool) -> dict[str, float]:
    """Since the last log line: tokens per target forward, draft acceptance, the prefix cache's hit rate
    (prompt tokens whose K/V it held over those looked up: the groups' shared prompts, a multi-turn episode's
    earlier turns), preemptions, and with a host tier the pages it moved out and back."""
    d = {k: now[k] - before[k] for k in now}
    out = {
        "engine/tokens_per_target_forward": d["generated_tokens"] / max(d["target_row_forwards"], 1.0),
        "engine/preemptions": d["preemptions"],
    }
    if d["proposed_tokens"]:
        out["engine/acceptance_rate"] = d["accepted_tokens"] / d["proposed_tokens"]
    if d["prefix_lookup_tokens"]:
        out["engine/prefix_hit_rate"] = d["prefix_hit_tokens"] / d["prefix_lookup_tokens"]
    if host_tier:
        out["engine/host_offloads"], out["engine/host_reloads"] = d["prefix_offloads"], d["prefix_reloads"]
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
