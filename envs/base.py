"""The environment protocol: `Task`, `Score`, `Episode`, `Environment`. Plain Python, never JAX.

Every domain implements the multi-turn interface (`reset` / `step` / `score_episode`); single-turn domains
get it from `SingleTurnEnvironment` (one step: the completion), so the RL loop treats all domains alike.
A domain that implements `make_task(rng, level) -> (prompt, metadata)` (or `task_at(seed, index, level)`)
gets a seeded, deterministic `sample_tasks` for free: a single-turn domain is then `make_task`, `score`
and `reference_solution` (README, "Your own environment"; `examples/my_envs/`).

`Score.status` is one of `STATUSES`. Only `ok` (reward earned) and `wrong` (a valid attempt that missed)
are ordinary outcomes; the others (`format_error`, `timeout`, `crash`, `sandbox_violation`, `env_error`)
are counted in metrics and never silently read as a reward of 0.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

STATUSES = ("ok", "wrong", "format_error", "timeout", "crash", "sandbox_violation", "env_error")


@dataclasses.dataclass(frozen=True)
class Task:
    """One problem: everything needed to score it lives in `metadata` (JSON-serialisable)."""

    id: str
    domain: str
    prompt: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    difficulty: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Task:
        return cls(**json.loads(text))


@dataclasses.dataclass(frozen=True)
class Score:
    reward: float
    status: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"Score.status={self.status!r}; use one of {STATUSES}")


@dataclasses.dataclass
class Episode:
    """A multi-turn episode in progress. `state` is the domain's own (JSON-serialisable) bookkeeping."""

    task: Task
    observation: str
    done: bool = False
    turns: int = 0
    transcript: list[dict[str, str]] = dataclasses.field(default_factory=list)  # {"action", "observation"}
    state: dict[str, Any] = dataclasses.field(default_factory=dict)


class Environment:
    """A task domain. Subclasses set `levels` and implement the methods below; `sample_tasks` is written
    once here, over `task_at(seed, index, level)` (or `make_task(rng, level)` for the default one).

    `name` is the domain's name in a run: `envs.registry.make(name)` sets it on the environment it makes
    (a built-in name, an entry point's name, or an import path "package.module:Class"), and tasks carry it
    as `Task.domain`. Scores are deterministic given (task, completion): no wall-clock or random state may
    change a reward.
    """

    name: str = ""
    levels: tuple[int, ...] = (0,)  # difficulty levels `sample_tasks` can produce
    level_seed: str = "levels"  # what keys the generator of `draw_levels` (with the seed)
    max_turns: int = 1
    # What rl.data's train / held-out split hashes: "prompt" (no prompt in two splits) or "task" (prompt and
    # metadata: for domains with a few prompt templates over per-task hidden data).
    split_on: str = "prompt"

    def make_task(self, rng: random.Random, level: int) -> tuple[str, dict[str, Any]]:
        """(prompt, metadata) of one task of difficulty `level`, drawn from `rng` only; metadata is
        JSON-serialisable and holds what scoring needs. Implement it to use the default `task_at`."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither sample_tasks nor make_task(rng, level)"
        )

    def sample_tasks(self, seed: int, n: int, *, difficulty: int | None = None) -> list[Task]:
        """`n` tasks of `seed`, a pure function of (seed, n, difficulty): task i is `task_at(seed, i, level)`,
        `level` being `difficulty` when given, else the i-th of `draw_levels(seed, n)`."""
        if difficulty is not None and difficulty not in self.levels:
            raise ValueError(f"{self.name}: difficulty {difficulty} not in levels {self.levels}")
        levels = [difficulty] * n if difficulty is not None else self.draw_levels(seed, n)
        return [self.task_at(seed, i, level) for i, level in enumerate(levels)]

    def draw_levels(self, seed: int, n: int) -> list[int | None]:
        """The levels of `n` tasks of `seed` when no difficulty is asked: each drawn from `levels` by one
        generator keyed by (`level_seed`, seed). A domain whose `task_at` draws the level itself returns
        None for each."""
        rng = random.Random(f"{self.level_seed}:{seed}")
        return [rng.choice(self.levels) for _ in range(n)]

    def task_at(self, seed: int, index: int, level: int | None) -> Task:
        """Task `index` of `seed` at `level`. The default: `make_task` with the generator
        `random.Random(f"{seed}:{index}:{level}")`, under the id `<name>/<seed>/<index>/L<level>`."""
        prompt, metadata = self.make_task(random.Random(f"{seed}:{index}:{level}"), level)
        return Task(f"{self.name}/{seed}/{index}/L{level}", self.name, prompt, dict(metadata), level)

    def reference_solution(self, task: Task) -> str:
        """A completion that scores 1.0 (multi-turn domains: the actions, one per line). The SFT warm start
        and the quality gate need it (`has_reference_solution`)."""
        raise NotImplementedError

    def reset(self, task: Task) -> Episode:
        raise NotImplementedError

    def step(self, episode: Episode, action: str) -> Episode:
        raise NotImplementedError

    def score_episode(self, task: Task, episode: Episode) -> Score:
        raise NotImplementedError

    def score(self, task: Task, completion: str) -> Score:
        """Single-turn scoring; multi-turn domains run `completion` as the action lines."""
        episode = self.reset(task)
        for action in completion.splitlines() if self.max_turns > 1 else [completion]:
            if episode.done:
                break
            episode = self.step(episode, action)
        return self.score_episode(task, episode)

    def close(self) -> None:
        """Releases sandboxes and temporary files."""


def has_reference_solution(env: Environment | type) -> bool:
    """Whether an environment (or its class) implements `reference_solution`."""
    cls = env if isinstance(env, type) else type(env)
    return cls.reference_solution is not Environment.reference_solution


class SingleTurnEnvironment(Environment):
    """A domain scored on one completion: implement `score`; the episode interface comes for free."""

    def reset(self, task: Task) -> Episode:
        return Episode(task=task, observation=task.prompt)

    def step(self, episode: Episode, action: str) -> Episode:
        episode.transcript.append({"action": action, "observation": ""})
        episode.turns += 1
        episode.done = True
        return episode

    def score_episode(self, task: Task, episode: Episode) -> Score:
        if not episode.transcript:
            return Score(0.0, "format_error", {"reason": "no completion"})
        return self.score(task, episode.transcript[-1]["action"])

    def score(self, task: Task, completion: str) -> Score:
        raise NotImplementedError
