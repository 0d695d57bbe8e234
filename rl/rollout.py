"""Rollout: tasks -> prompts -> engine completions -> environment scores -> filtered groups -> a train batch.

Dimension key: B rows (samples), T token positions.

`rollout` samples `n` completions per task (one GRPO group per task). Single-turn domains are scored in one
`EnvPool.score_many` call. Multi-turn domains (an `Environment.max_turns > 1`; `reset().done` cannot tell, as
single-turn environments also return an unfinished episode) are driven turn by turn when `max_turns > 1`: all
active episodes generate together, the completion (stop token excluded) is the next action, and the
environment's observation is appended to the context before the next turn. Environments are deterministic, so
each turn replays the growing action list with `EnvPool.run_episodes` (reset, step per action, score): that is
O(turns^2) environment work, fine for a handful of turns, and it keeps no episode state in the trainer. Each
continuation prompt is the previous prompt + completion + observation tokens, so the engine's prefix cache
reuses the earlier turns. With `max_turns=1` a multi-turn domain sees the one completion through
`score_many`, where the environment runs its lines as the actions (`Environment.score`).

`filter_samples` drops what must not be trained on (errored episodes, zero-variance groups) and counts it;
`make_batch` builds the `rl.train_step` batch; `collect` back-fills until enough valid groups are in.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from envs import Score, Task, registry
from envs.pool import EnvPool
from inference.sampling import SamplingParams
from model.io.tokenizer import Tokenizer
from rl import grpo

EXCLUDED_STATUSES = ("env_error", "crash", "timeout")  # the environment's fault: never a reward of 0
_ACTION = "\x01action\x01"  # placeholder assistant content when cutting a chat template into turn pieces


@dataclasses.dataclass
class Sample:
    """One completion (single-turn) or one episode (multi-turn) of a task.

    `tokens`, `mask`, `behaviour_logp` and `policy_versions` are aligned per completion token: model tokens
    have mask 1, their sampling log-prob and the policy version that sampled them (0 if the engine reports
    none); observation tokens (multi-turn) have mask 0, log-prob 0 and version -1. `actions` is the model's
    text of each turn without stop tokens and `text` those joined by newlines; `observations` are the
    environment's replies appended to the context (one fewer than `turns`, the model turns). `episode_done`
    is False when the rollout's turn or token budget, not the environment, ended the episode.
    `sandbox_seconds` is `details["sandbox_seconds"]` (the final `Score.details`) when the environment
    reports it, else this sample's share of the wall time of the pool calls that scored it.
    """

    task: Task
    group: int
    prompt_tokens: list[int]
    tokens: list[int]
    mask: list[int]
    behaviour_logp: list[float]
    policy_versions: list[int]
    reward: float
    status: str
    finish_reason: str
    text: str
    actions: list[str] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    turns: int = 1
    sandbox_seconds: float = 0.0
    episode_done: bool = True
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    expert_indices: np.ndarray | None = None  # [L_moe, len(prompt_tokens + tokens), k] when recorded
    advantage: float | None = None  # set by `make_batch`

    @property
    def num_generated(self) -> int:
        return int(sum(self.mask))

    @property
    def version(self) -> int | None:
        """The oldest policy version that sampled one of its model tokens (observation tokens, version -1,
        do not count), or None when the engine reported none."""
        return min((v for v, m in zip(self.policy_versions, self.mask) if m and v >= 0), default=None)


@dataclasses.dataclass
class DomainDraw:
    """Every sample drawn for one domain in one batch, kept or filtered: the curriculum's reward, compute."""

    samples: int = 0
    reward_sum: float = 0.0
    tokens: int = 0
    sandbox_seconds: float = 0.0

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / max(self.samples, 1)

    def add(self, sample: Sample) -> None:
        self.samples += 1
        self.reward_sum += sample.reward
        self.tokens += sample.num_generated
        self.sandbox_seconds += sample.sandbox_seconds


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from any parts (the user's seed of any size, a counter, a name): sampling keys are
    built from int32 seeds, so derived seeds are hashed into that range, never computed by arithmetic."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def format_prompt(task: Task, tokenizer: Tokenizer, *, chat: bool) -> list[int]:
    """The task's prompt as token ids. `chat=True`: the tokenizer's chat template with one user message and
    the assistant's generation prompt. `chat=False`: bos (if the tokenizer has one), the raw prompt text and
    a newline."""
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": task.prompt}], add_generation_prompt=True)
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(task.prompt + "\n")


def observation_tokens(
    tokenizer: Tokenizer, observation: str, *, chat: bool, stop_token: int | None
) -> list[int]:
    """Tokens appended after a model turn (which ended with `stop_token`, or None if cut by length) to show
    an observation; they end where the model's next turn starts.

    `chat=False`: a newline, the observation, a newline. `chat=True`: what the chat template writes after an
    assistant's content (less the stop token the model already emitted) followed by a user turn holding the
    observation and the assistant's generation prompt, cut from two renderings of the template."""
    if not chat:
        return tokenizer.encode("\n" + observation + "\n")
    turns = [{"role": "user", "content": "task"}, {"role": "assistant", "content": _ACTION}]
    base = tokenizer.apply_chat_template(turns, add_generation_prompt=False)
    full = tokenizer.apply_chat_template(
        [*turns, {"role": "user", "content": observation}], add_generation_prompt=True
    )
    if not full.startswith(base) or _ACTION not in base:
        raise ValueError("the chat template does not render a conversation by appending turns")
    closer = base[base.rindex(_ACTION) + len(_ACTION) :]
    if stop_token is not None:
        stop_text = tokenizer.decode([stop_token])
        closer = closer[len(stop_text) :] if closer.startswith(stop_text) else closer
    return tokenizer.encode(closer + full[len(base) :])


def default_multi_turn(pool: EnvPool) -> Callable[[str], bool]:
    """domain -> whether it is multi-turn: `max_turns > 1` of the environment built in this process from the
    pool's keyword arguments (environments are plain Python, cheap to build; made once per domain)."""
    cache: dict[str, bool] = {}

    def is_multi_turn(domain: str) -> bool:
        if domain not in cache:
            env = registry.make(domain, **pool.domains.get(domain, {}))
            cache[domain] = env.max_turns > 1
            env.close()
        return cache[domain]

    return is_multi_turn


@dataclasses.dataclass
class _Episode:
    """Bookkeeping of one sample while it is being generated."""

    task: Task
    group: int
    index: int  # sample index within its group
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    actions: list[str] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str = "length"
    last_stop: int | None = None
    seconds: float = 0.0
    done: bool = False
    score: Score | None = None
    experts: np.ndarray | None = None  # the last turn's record covers the whole context

    def add_completion(self, completion: Any, tokenizer: Tokenizer, stop_tokens: Collection[int]) -> None:
        toks = [int(t) for t in completion.tokens]
        self.tokens += toks
        self.mask += [1] * len(toks)
        self.logp += [float(x) for x in completion.logprobs]
        versions = list(completion.policy_versions) or [0] * len(toks)
        self.versions += [int(v) for v in versions]
        self.finish_reason = completion.finish_reason
        stopped = completion.finish_reason == "stop" and bool(toks) and toks[-1] in stop_tokens
        self.last_stop = toks[-1] if stopped else None
        self.actions.append(tokenizer.decode(toks[:-1] if stopped else toks))
        self.experts = getattr(completion, "expert_indices", None)

    def add_observation(self, text: str, toks: list[int]) -> None:
        self.observations.append(text)
        self.tokens += toks
        self.mask += [0] * len(toks)
        self.logp += [0.0] * len(toks)
        self.versions += [-1] * len(toks)

    def to_sample(self) -> Sample:
        score, text = self.score, "\n".join(self.actions)
        seconds = float(score.details.get("sandbox_seconds", self.seconds))
        return Sample(
            *(self.task, self.group, self.prompt, self.tokens, self.mask, self.logp, self.versions),
            *(float(score.reward), score.status, self.finish_reason, text, self.actions, self.observations),
            turns=len(self.actions),
            sandbox_seconds=seconds,
            episode_done=self.done,
            details=dict(score.details),
            expert_indices=self.experts,
        )


def group_seed(seed: int, group: int) -> int:
    """The sampling seed of group `group` of a rollout round sampled with `seed`."""
    return derive_seed(seed, "group", group)


def _turn_seed(seed: int, turn: int, task_id: str, index: int) -> int:
    """A deterministic per-(turn, task, sample) seed for continuation turns (each is its own request)."""
    return derive_seed(seed, turn, task_id, index)


def rollout(
    engine: Any,
    pool: EnvPool,
    tasks: Sequence[Task],
    tokenizer: Tokenizer,
    *,
    n: int,
    sampling: SamplingParams,
    max_turns: int = 1,
    max_total_tokens: int | None = None,
    chat: bool = False,
    group_offset: int = 0,
    multi_turn: Callable[[str], bool] | None = None,
) -> list[Sample]:
    """`n` samples per task, ordered by (task, sample); task i is group `group_offset + i`.

    Stop tokens are `sampling.stop_tokens`, or the tokenizer's `stop_ids` when that is empty. The token
    budget of one sample (prompt + every turn + observations) is `max_total_tokens`, at most the engine's
    `max_seq_len`: each turn's `max_new_tokens` is clipped to what is left, and a multi-turn episode ends when
    the next observation plus one model token would not fit (that observation is then not appended). An
    episode also ends after `max_turns` model turns, when the environment says done, or when an environment
    call fails (`timeout`, `crash`, `env_error`: the status is kept for `filter_samples`).
    """
    if max_turns < 1 or n < 1:
        raise ValueError(f"max_turns={max_turns} and n={n} must be >= 1")
    stop_tokens = tuple(sampling.stop_tokens) or tuple(tokenizer.stop_ids)
    sampling = dataclasses.replace(sampling, stop_tokens=stop_tokens)
    limits = [max_total_tokens, getattr(getattr(engine, "ecfg", None), "max_seq_len", None)]
    budget = min((x for x in limits if x), default=None)
    is_multi = multi_turn or default_multi_turn(pool)

    prompts = [format_prompt(task, tokenizer, chat=chat) for task in tasks]
    # Each group samples from a seed of its own (group id, not position in this call): a group's samples
    # are the same whichever process or round draws it (rl.distributed).
    params = [
        _clipped(sampling, len(p), budget, n=n, seed=group_seed(sampling.seed, group_offset + i), key_index=0)
        for i, p in enumerate(prompts)
    ]
    episodes = [
        _Episode(task, group_offset + i, s, prompts[i]) for i, task in enumerate(tasks) for s in range(n)
    ]
    for ep, completion in zip(episodes, engine.generate(prompts, params), strict=True):
        ep.add_completion(completion, tokenizer, stop_tokens)

    single = [ep for ep in episodes if max_turns == 1 or not is_multi(ep.task.domain)]
    if single:
        start = time.monotonic()
        scores = pool.score_many([(ep.task, ep.actions[0]) for ep in single])
        share = (time.monotonic() - start) / len(single)
        for ep, score in zip(single, scores):
            ep.score, ep.seconds, ep.done = score, share, True

    active = [ep for ep in episodes if ep.score is None]
    for turn in range(1, max_turns + 1):
        if not active:
            break
        start = time.monotonic()
        results = pool.run_episodes([(ep.task, ep.actions) for ep in active])
        share = (time.monotonic() - start) / len(active)
        still = []
        for ep, (episode, score) in zip(active, results):
            ep.score, ep.seconds = score, ep.seconds + share
            ep.done = bool(episode.get("done", True)) or score.status in EXCLUDED_STATUSES
            if ep.done or turn == max_turns:
                continue
            obs = observation_tokens(tokenizer, episode["observation"], chat=chat, stop_token=ep.last_stop)
            if budget is not None and len(ep.prompt) + len(ep.tokens) + len(obs) + 1 > budget:
                continue
            ep.add_observation(episode["observation"], obs)
            still.append(ep)
        active = still
        if not active:
            break
        contexts = [ep.prompt + ep.tokens for ep in active]
        params = [
            _clipped(
                sampling,
                len(c),
                budget,
                n=1,
                seed=_turn_seed(sampling.seed, turn, f"{ep.group}:{ep.task.id}", ep.index),
                key_index=0,
            )
            for c, ep in zip(contexts, active)
        ]
        for ep, completion in zip(active, engine.generate(contexts, params), strict=True):
            ep.add_completion(completion, tokenizer, stop_tokens)
    return [ep.to_sample() for ep in episodes]


def _clipped(sampling: SamplingParams, context: int, budget: int | None, **changes: int) -> SamplingParams:
    limit = sampling.max_new_tokens if budget is None else min(sampling.max_new_tokens, budget - context)
    if limit < 1:
        raise ValueError(f"a context of {context} tokens leaves no room in the token budget of {budget}")
    return dataclasses.replace(sampling, max_new_tokens=limit, **changes)


# ---------------------------------------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------------------------------------


def filter_samples(
    samples: Sequence[Sample],
    *,
    group_size: int | None = None,
    min_group_size: int = 2,
    reward_tol: float = 1e-6,
) -> tuple[list[Sample], dict[str, int]]:
    """Samples worth training on, in input order, and counts of what was dropped and why.

    1. Samples with status `env_error`, `crash` or `timeout` are excluded (`excluded_<status>`): a broken
       environment is no evidence about the policy, so they are never read as a reward of 0. Other statuses
       (`format_error`, `sandbox_violation`) are the policy's doing and stay, with their reward.
    2. A group keeps its remaining samples only if at least `min_group_size` (2) remain, since an advantage
       needs a baseline from the same prompt (`dropped_small_groups`, `dropped_small_group_samples`).
    3. Groups whose rewards do not vary are dropped (`dropped_zero_variance_groups`, `..._samples`): they have
       no learning signal. Rewards all in {0, 1} are compared exactly, others by max - min <= `reward_tol`.

    `group_size`, when given, is checked: no group may hold more samples than that.
    """
    counts: Counter[str] = Counter()
    groups: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.group].append(s)
    counts["groups_in"], counts["samples_in"] = len(groups), len(samples)
    keep_groups = set()
    for g, members in groups.items():
        if group_size is not None and len(members) > group_size:
            raise ValueError(f"group {g} has {len(members)} samples, more than group_size={group_size}")
        ok = [s for s in members if s.status not in EXCLUDED_STATUSES]
        counts.update(f"excluded_{s.status}" for s in members if s.status in EXCLUDED_STATUSES)
        if len(ok) < min_group_size:
            counts["dropped_small_groups"] += 1
            counts["dropped_small_group_samples"] += len(ok)
        elif _zero_variance([s.reward for s in ok], reward_tol):
            counts["dropped_zero_variance_groups"] += 1
            counts["dropped_zero_variance_samples"] += len(ok)
        else:
            keep_groups.add(g)
    kept = [s for s in samples if s.group in keep_groups and s.status not in EXCLUDED_STATUSES]
    counts["kept_groups"], counts["kept_samples"] = len(keep_groups), len(kept)
    return kept, dict(counts)


def _zero_variance(rewards: list[float], tol: float) -> bool:
    if all(r in (0.0, 1.0) for r in rewards):
        return len(set(rewards)) == 1
    return max(rewards) - min(rewards) <= tol


# ---------------------------------------------------------------------------------------------------------
# Batch
# ---------------------------------------------------------------------------------------------------------


def advantages(samples: Sequence[Sample], *, std: str = "group", eps: float = 1e-6) -> np.ndarray:
    """Per-sample advantages (f32) with `rl.grpo.group_advantages`, group by group: groups may differ in
    size after exclusions, so groups of each size go through one call together. `std="batch"` centres per
    group and divides by the std of all rewards in `samples`, as the registered "batch" variant does."""
    rewards = np.asarray([s.reward for s in samples], np.float32)
    rows: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        rows[s.group].append(i)
    by_size: dict[int, list[list[int]]] = defaultdict(list)
    for idx in rows.values():
        by_size[len(idx)].append(idx)
    out = np.zeros(len(samples), np.float32)
    for size, groups in by_size.items():
        flat = np.concatenate(groups)
        if std == "batch":
            adv = grpo.group_advantages(rewards[flat], size, std="none")
            adv = adv / (float(rewards.std()) + eps)
        else:
            adv = grpo.group_advantages(rewards[flat], size, std=std, eps=eps)
        out[flat] = np.asarray(adv)
    return out


# ---------------------------------------------------------------------------------------------------------
# Back-fill
# ---------------------------------------------------------------------------------------------------------


def collect(
    engine: Any,
    pool: EnvPool,
    next_tasks: Callable[[int], list[Task]],
    tokenizer: Tokenizer,
    *,
    groups: int,
    n: int,
    sampling: SamplingParams,
    max_attempts: int = 4,
    min_group_size: int = 2,
    reward_tol: float = 1e-6,
    shard: Any = None,
    **rollout_kwargs: Any,
) -> tuple[list[Sample], dict[str, int], dict[str, DomainDraw], list[Sample]]:
    """Rolls out `next_tasks(k)` (k = groups still missing) round after round until `groups` valid groups
    (after `filter_samples`) are in or `max_attempts` rounds have run. Round 0 samples with
    `sampling.seed`, round a > 0 with `derive_seed(seed, "round", a)`. Returns the kept samples (group ids
    unique across rounds) and the summed filter counts plus `rounds`, `groups_requested`,
    `groups_collected`, `groups_missing` (0 when complete) and
    `surplus_groups` (valid groups beyond `groups`, from `next_tasks` returning more than asked, dropped),
    and per domain a `DomainDraw` over every sample drawn, filtered or not (the curriculum's reward and
    compute: a kept-only reward would be biased toward 1/2), and the samples the filters dropped (for
    samples.jsonl: what a step without a learning signal sampled).

    With `shard` (an `rl.distributed.TaskShard`, several processes), `groups` is this process's share: each
    round every process takes its part of one global draw (`shard.draw`, which also gives the global id of
    its first group) and the rounds go on while any process still misses groups (`shard.all_done`)."""
    kept: list[Sample] = []
    dropped: list[Sample] = []
    counts: Counter[str] = Counter()
    drawn: dict[str, DomainDraw] = defaultdict(DomainDraw)
    have, next_group = 0, 0
    for attempt in range(max_attempts):
        if have >= groups if shard is None else shard.all_done(have >= groups):
            break
        if shard is None:
            tasks = next_tasks(groups - have)
        else:
            tasks, next_group = shard.draw(max(groups - have, 0))
        counts["rounds"] += 1
        if not tasks:
            if shard is not None and have >= groups:
                continue  # this process is done; others still draw
            break
        round_seed = sampling.seed if attempt == 0 else derive_seed(sampling.seed, "round", attempt)
        round_sampling = dataclasses.replace(sampling, seed=round_seed)
        samples = rollout(
            engine,
            pool,
            tasks,
            tokenizer,
            n=n,
            sampling=round_sampling,
            group_offset=next_group,
            **rollout_kwargs,
        )
        next_group += len(tasks)
        for s in samples:  # every sample's reward and compute, kept or not (for the curriculum)
            drawn[s.task.domain].add(s)
        good, c = filter_samples(samples, group_size=n, min_group_size=min_group_size, reward_tol=reward_tol)
        counts.update(c)
        room = set(sorted({s.group for s in good})[: groups - have])
        counts["surplus_groups"] += c["kept_groups"] - len(room)
        kept += [s for s in good if s.group in room]
        taken = {id(s) for s in good}
        dropped += [s for s in samples if id(s) not in taken]
        have += len(room)
    counts.update(groups_requested=groups, groups_collected=have, groups_missing=groups - have)
    return kept, dict(counts), dict(drawn), dropped


def collect_options(rl_cfg: Any) -> dict[str, Any]:
    """The one place the main job's config becomes `collect`'s group size, back-fill rounds, turns, chat
    template and zero-variance tolerance (rl.group_size, max_attempts, max_turns, chat, reward_tol)."""
    return dict(
        n=int(rl_cfg.group_size),
        max_attempts=int(rl_cfg.max_attempts),
        max_turns=int(rl_cfg.max_turns),
        chat=bool(rl_cfg.chat),
        reward_tol=float(rl_cfg.reward_tol),
    )


def sampling_params(
    rl_cfg: Any, tokenizer: Tokenizer, *, seed: int, n: int = 1, **changes: Any
) -> SamplingParams:
    """The one place the main job's config becomes `SamplingParams` (rollout, evaluation, rl.evaluate):
    rl.temperature / top_k / top_p / max_new_tokens, the tokenizer's stop ids, `seed` (31-bit, see
    `derive_seed`) and `n`; `changes` override (e.g. an evaluation's temperature)."""
    fields = dict(
        temperature=float(rl_cfg.temperature),
        top_k=int(rl_cfg.top_k),
        top_p=float(rl_cfg.top_p),
        max_new_tokens=int(rl_cfg.max_new_tokens),
        n=n,
        seed=seed,
        stop_tokens=tuple(tokenizer.stop_ids),
    )
    fields.update(changes)
    return SamplingParams(**fields)
