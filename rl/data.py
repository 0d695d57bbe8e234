"""Task streams: one grain pipeline per domain, with iterator state that checkpoints and resumes exactly.

Record `i` of a stream is made from `i` alone: a seed is hashed from (domain, split, seed, i, attempt) and the
environment's `sample_tasks(seed=<that>, n=1, difficulty=<level>)` builds the task. The level is the given
`difficulty`, else drawn uniformly from `env.levels` by the same hash (some domains always give level 0 for
`n=1`, so the level is never left to them). grain shuffles the record indices per epoch and repeats;
`get_state()` is grain's iterator state (JSON), so a restored stream yields exactly the tasks an uninterrupted
one would.

Held-out evaluation. Train and eval draw from disjoint seed spaces (even and odd seeds) and, since different
seeds can still give the same prompt (small template pools), every task is also assigned to a split by a
hash of its prompt: a fraction `holdout` of prompts belongs to eval and the rest to train; a record whose
task lands in the other split is redrawn (next attempt). So no prompt is ever in both splits, whatever the
pool size. The price shows in small pools: `terminal` has a few dozen prompt templates (the per-task files
differ per task), and a prompt-level split would hold whole templates (most of one level) out of training
and leave eval without some levels. Such domains (`DEFAULT_SPLIT_ON`) split on the full task (prompt +
metadata) instead: instances are held out and templates are shared. `split_on="prompt"` forces the strict
split anywhere. Both splits must use the same `holdout` and `split_on`.

JAX-free: the trainer feeds the tasks to `envs.EnvPool`, which is where the prompts are rendered.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any, Literal

import grain

from envs import Environment, Task, registry

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")
SplitOn = Literal["prompt", "task"]
# Domains whose prompts are a few templates over per-task hidden data split on the whole task (see above).
DEFAULT_SPLIT_ON: dict[str, SplitOn] = {"terminal": "task"}
MAX_ATTEMPTS = 256  # redraws of one record before giving up: the split's share of the pool is ~empty


def _hash64(*parts: Any) -> int:
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def split_of(task: Task, *, holdout: float, split_on: SplitOn = "prompt") -> Split:
    """The split `task` belongs to: eval for a `holdout` fraction of prompts (or whole tasks)."""
    if split_on == "prompt":
        key = task.prompt
    elif split_on == "task":
        key = [task.prompt, task.metadata]
    else:
        raise ValueError(f"split_on={split_on!r}; use 'prompt' or 'task'")
    return "eval" if _hash64("split", key) / 2.0**64 < holdout else "train"


class DomainTasks:
    """An endless (or `num_epochs`-long) stream of one domain's tasks of one split, as a grain pipeline."""

    def __init__(
        self,
        domain: str,
        *,
        seed: int,
        split: Split = "train",
        env: Environment | None = None,
        difficulty: int | None = None,
        levels: tuple[int, ...] | None = None,
        num_records: int = 1_000_000,
        num_epochs: int | None = None,
        holdout: float = 0.125,
        split_on: SplitOn | None = None,
    ):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; use 'train' or 'eval'")
        if not 0 < holdout < 1:
            raise ValueError(f"holdout={holdout} must be in (0, 1): both splits need prompts")
        self.domain, self.seed, self.split = domain, int(seed), split
        self.holdout, self.split_on = holdout, split_on or DEFAULT_SPLIT_ON.get(domain, "prompt")
        self.env = env if env is not None else registry.make(domain)
        self._owns_env = env is None
        if difficulty is not None and difficulty not in self.env.levels:
            raise ValueError(f"{domain}: difficulty={difficulty} not in levels {self.env.levels}")
        bad = [lv for lv in levels or () if lv not in self.env.levels]
        if bad or (levels is not None and not levels):
            raise ValueError(f"{domain}: levels={levels} must be a non-empty subset of {self.env.levels}")
        self.difficulty = difficulty
        self.levels = tuple(levels) if levels else tuple(self.env.levels)
        self.dataset = (
            grain.MapDataset.range(num_records)
            .shuffle(seed=_hash64("shuffle", domain, split, self.seed) % 2**32)
            .repeat(num_epochs)
            .map(self.task_at)
            # Synchronous reads: tasks cost < 10 ms; prefetch threads would fight the trainer for the GIL.
            .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        )
        self._iterator = iter(self.dataset)

    def task_at(self, index: int) -> Task:
        """Record `index`: the first attempt whose task falls in this stream's split."""
        record = ("record", self.domain, self.split, self.seed, int(index))
        levels = self.levels
        # The level is the record's, not the attempt's: redraws must not skew the mix of levels.
        level = self.difficulty if self.difficulty is not None else levels[_hash64(*record) % len(levels)]
        for attempt in range(MAX_ATTEMPTS):
            h = _hash64(*record, attempt)
            env_seed = 2 * (h >> 1) + (self.split == "eval")  # disjoint seed spaces: even train, odd eval
            task = self.env.sample_tasks(seed=env_seed, n=1, difficulty=level)[0]
            if split_of(task, holdout=self.holdout, split_on=self.split_on) == self.split:
                return task
        raise RuntimeError(
            f"{self.domain} ({self.split}, difficulty={self.difficulty}): no task of this split in "
            f"{MAX_ATTEMPTS} draws; the domain's pool is too small for holdout={self.holdout} with "
            f"split_on={self.split_on!r} (try split_on='task' or another holdout)"
        )

    def __iter__(self) -> Iterator[Task]:
        return self._iterator

    def next_tasks(self, n: int) -> list[Task]:
        """The next `n` tasks (fewer only when a finite `num_epochs` runs out)."""
        tasks = []
        for _ in range(n):
            try:
                tasks.append(next(self._iterator))
            except StopIteration:
                break
        return tasks

    def get_state(self) -> dict[str, Any]:
        """grain's iterator state plus what identifies the stream (checked on `set_state`)."""
        return {"iterator": self._iterator.get_state(), **self._identity()}

    def set_state(self, state: dict[str, Any]) -> None:
        mismatch = {k: (state.get(k), v) for k, v in self._identity().items() if state.get(k) != v}
        if mismatch:
            raise ValueError(f"stream state is of another stream: (saved, current) {mismatch}")
        self._iterator.set_state(state["iterator"])

    def _identity(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "split": self.split,
            "seed": self.seed,
            "difficulty": self.difficulty,
            "holdout": self.holdout,
            "split_on": self.split_on,
        }

    def close(self) -> None:
        if self._owns_env:
            self.env.close()


class TaskMixer:
    """Draws per-domain task counts (e.g. `DomainScheduler.allocate`) from one stream per domain."""

    def __init__(self, streams: dict[str, DomainTasks]):
        self.streams = dict(streams)

    def next_tasks(self, allocation: dict[str, int]) -> list[Task]:
        """`allocation[d]` tasks of each domain `d`, grouped by domain in the order of `allocation`."""
        unknown = sorted(set(allocation) - set(self.streams))
        if unknown:
            raise KeyError(f"no stream for domains {unknown}; streams: {sorted(self.streams)}")
        return [t for d, n in allocation.items() if n > 0 for t in self.streams[d].next_tasks(n)]

    def get_state(self) -> dict[str, Any]:
        return {d: s.get_state() for d, s in self.streams.items()}

    def set_state(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.streams):
            raise ValueError(f"mixer state has domains {sorted(state)}; streams are {sorted(self.streams)}")
        for d, s in self.streams.items():
            s.set_state(state[d])

    def close(self) -> None:
        for s in self.streams.values():
            s.close()
