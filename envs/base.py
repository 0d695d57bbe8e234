"""The environment protocol: `Task`, `Score`, `Episode`, `Environment`. Plain Python, never JAX.

Every domain implements the multi-turn interface (`reset` / `step` / `score_episode`); single-turn domains
get it from `SingleTurnEnvironment` (one step: the completion), so the RL loop treats all domains alike.

`Score.status` is one of `STATUSES`. Only `ok` (reward earned) and `wrong` (a valid attempt that missed)
are ordinary outcomes; the others (`format_error`, `timeout`, `crash`, `sandbox_violation`, `env_error`)
are counted in metrics and never silently read as a reward of 0.
"""

from __future__ import annotations

import dataclasses
import json
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
    """A task domain. Subclasses set `name` and `levels` and implement the methods below.

    Scores are deterministic given (task, completion): no wall-clock or random state may change a reward.
    """

    name: str = ""
    levels: tuple[int, ...] = (0,)  # difficulty levels `sample_tasks` can produce
    max_turns: int = 1

    def sample_tasks(self, seed: int, n: int, *, difficulty: int | None = None) -> list[Task]:
        raise NotImplementedError

    def reference_solution(self, task: Task) -> str:
        """A completion that scores 1.0 (multi-turn domains: the actions, one per line)."""
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
