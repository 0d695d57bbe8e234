"""Task streams: one grain pipeline per domain, with iterator state that checkpoints and resumes exactly.

Record `i` of a stream is made from `i` alone: a seed is hashed from (domain, split, seed, i, attempt) and the
environment's `sample_tasks(seed=<that>, n=1, difficulty=<level>)` builds the task. The level is the given
`difficulty`, else drawn uniformly from `env.levels` by the same hash (some domains always give level 0 for
`n=1`, so the level is never left to them). grain shuffles the record indices per epoch and repeats;
`get_state()` is grain's iterator state (JSON), so a restored stream yields exactly the tasks an uninterrupted
one would.

Splits. Every domain has three disjoint splits: `train` (the trainer's stream), `selection` (for choosing a
recipe: `selection_tasks`, `benchmarks/demo_recipe.py`) and `eval` (held out, reported only:
`heldout_tasks`). They draw from disjoint seed spaces (train seeds even, eval seeds 1 mod 4, selection 3 mod
4) and, since different seeds can still give the same prompt (small template pools), every task is also
assigned to a split by a hash of its prompt, read as a number u in [0, 1): u < `holdout` is eval, `holdout`
<= u < `holdout + selection` is selection, the rest train; a record whose task lands in another split is
redrawn (next attempt). So no prompt is ever in two splits, whatever the pool size (`selection=0` leaves
the eval and train splits of before the selection split existed). The price shows in small pools:
`terminal` has a few dozen prompt templates (the per-task files differ per task), and a prompt-level split
would hold whole templates (most of one level) out of training and leave eval without some levels. Such
domains (`DEFAULT_SPLIT_ON`) split on the full task (prompt + metadata) instead: instances are held out and
templates are shared. `split_on="prompt"` forces the strict split anywhere. All streams of a run must use
the same `holdout`, `selection` and `split_on` (the config's `rl.data.holdout` / `rl.data.selection`:
`split_kwargs(cfg)`).

Data that comes split (an environment with `data_splits`, e.g. `math` with `train_jsonl`/`test_jsonl` or
`tfds_name`: GSM8K's own train and test) needs no holdout: the train stream draws from the data's "train"
split and the eval stream from its "test" split (`DATA_SPLIT`); the selection stream draws from "train"
too, the prompts whose hash falls in the selection fraction (the train stream then skips them), since such
data has no third split of its own.

Environment options. `env_kwargs` (the config's `rl.env.<domain>`, see `env_kwargs(cfg)`) go to the stream's
environment, as they go to the pool's workers. They are not part of a stream's identity: options that only
change scoring (timeouts, reward shaping) may change between a run and its resume. What the stream's state
does record is a digest of the stream's first tasks, so a resume under options or data that change the tasks
(another data file, or the same path with other contents) is refused instead of silently continuing from the
saved position in other data.

`heldout_tasks(cfg, tokenizer)` is the one held-out selection: the trainer's before/after evaluation and
`python -m rl.evaluate` both score it. Its tasks have distinct prompts (distinct split keys where a domain
splits on the whole task), so `len(tasks)` is the number of distinct held-out prompts the table reports.
`selection_tasks(cfg, tokenizer)` picks the selection split's tasks the same way.

JAX-free at import: the trainer feeds the tasks to `envs.EnvPool`, which is where the prompts are rendered
(only `fits_prompt` imports `rl.rollout`, and JAX with it).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import grain

from envs import Environment, Task, registry

Split = Literal["train", "selection", "eval"]
SPLITS: tuple[Split, ...] = ("train", "selection", "eval")
SplitOn = Literal["prompt", "task"]
# Domains whose prompts are a few templates over per-task hidden data split on the whole task (see above).
# `debug` has one prompt: only its instances can be held out.
DEFAULT_SPLIT_ON: dict[str, SplitOn] = {"terminal": "task", "debug": "task"}
MAX_ATTEMPTS = 256  # redraws of one record before giving up: the split's share of the pool is ~empty
# The data split each stream draws from, for environments whose data comes split (`env.data_splits`).
DATA_SPLIT: dict[Split, str] = {"train": "train", "selection": "train", "eval": "test"}
# The env seed of a record's attempt is SEED_MODULUS * (hash // SEED_MODULUS) + SEED_OFFSET[split].
SEED_SPACE: dict[Split, tuple[int, int]] = {"train": (2, 0), "eval": (4, 1), "selection": (4, 3)}
HOLDOUT, SELECTION = 0.125, 0.125  # default fractions of prompts held out and kept for selection
FINGERPRINT_RECORDS = 4  # records whose tasks identify a stream's contents (checked on resume)
HELDOUT_DRAWS_PER_TASK = 64  # eval-stream draws per wanted task before heldout_tasks gives up


def _hash64(*parts: Any) -> int:
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def split_key(task: Task, split_on: SplitOn = "prompt") -> Any:
    """What the split is decided on: the prompt, or the whole task (`split_on="task"`)."""
    if split_on == "prompt":
        return task.prompt
    if split_on == "task":
        return [task.id, task.prompt, task.metadata]
    raise ValueError(f"split_on={split_on!r}; use 'prompt' or 'task'")


def split_of(
    task: Task, *, holdout: float = HOLDOUT, selection: float = 0.0, split_on: SplitOn = "prompt"
) -> Split:
    """The split `task` belongs to: eval for a `holdout` fraction of prompts (or whole tasks), selection
    for the next `selection` fraction, train for the rest."""
    u = _hash64("split", split_key(task, split_on)) / 2.0**64
    return "eval" if u < holdout else "selection" if u < holdout + selection else "train"


def check_fractions(holdout: float, selection: float) -> None:
    """Both fractions in range and leaving train some prompts; the error names the config field."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout (rl.data.holdout) = {holdout} must be in (0, 1): eval needs prompts")
    if not 0 <= selection < 1 or holdout + selection >= 1:
        raise ValueError(
            f"selection (rl.data.selection) = {selection} must be in [0, 1) with holdout + selection < 1 "
            f"(holdout = {holdout}): train needs prompts"
        )


class DomainTasks:
    """An endless (or `num_epochs`-long) stream of one domain's tasks of one split, as a grain pipeline."""

    def __init__(
        self,
        domain: str,
        *,
        seed: int,
        split: Split = "train",
        env: Environment | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        difficulty: int | None = None,
        levels: tuple[int, ...] | None = None,
        num_records: int = 1_000_000,
        num_epochs: int | None = None,
        holdout: float = HOLDOUT,
        selection: float = SELECTION,
        split_on: SplitOn | None = None,
    ):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; use one of {SPLITS}")
        check_fractions(holdout, selection)
        if split == "selection" and not selection:
            raise ValueError(f"{domain}: a selection stream needs selection > 0 (rl.data.selection)")
        if env is not None and env_kwargs:
            raise ValueError(f"{domain}: give env or env_kwargs, not both (env_kwargs make the env)")
        self.domain, self.seed, self.split = domain, int(seed), split
        self.holdout, self.selection = holdout, selection
        self.env = env if env is not None else registry.make(domain, **(env_kwargs or {}))
        self.split_on = split_on or DEFAULT_SPLIT_ON.get(domain) or getattr(self.env, "split_on", "prompt")
        self._owns_env = env is None
        # Split data (e.g. GSM8K train / test) is drawn from its own split, with no hash holdout.
        self.data_split = DATA_SPLIT[split] if getattr(self.env, "data_splits", ()) else None
        self._fingerprint: str | None = None
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
        """Record `index`: the first attempt whose task falls in this stream's split (split data: the
        data's own split; its "train" holds the train and selection splits, told apart by the hash)."""
        record = ("record", self.domain, self.split, self.seed, int(index))
        levels = self.levels
        # The level is the record's, not the attempt's: redraws must not skew the mix of levels.
        level = self.difficulty if self.difficulty is not None else levels[_hash64(*record) % len(levels)]
        modulus, offset = SEED_SPACE[self.split]
        for attempt in range(MAX_ATTEMPTS):
            env_seed = modulus * (_hash64(*record, attempt) // modulus) + offset  # disjoint seed spaces
            if self.data_split is not None:
                task = self.env.sample_tasks(seed=env_seed, n=1, difficulty=level, split=self.data_split)[0]
                if self.split == "eval" or self._hash_split(task, holdout=0.0) == self.split:
                    return task
                continue
            task = self.env.sample_tasks(seed=env_seed, n=1, difficulty=level)[0]
            if self._hash_split(task, holdout=self.holdout) == self.split:
                return task
        raise RuntimeError(
            f"{self.domain} ({self.split}, difficulty={self.difficulty}): no task of this split in "
            f"{MAX_ATTEMPTS} draws; the domain's pool is too small for holdout={self.holdout}, "
            f"selection={self.selection} with split_on={self.split_on!r} (try split_on='task', the "
            "environment's `split_on` attribute, or other fractions: rl.data.holdout, rl.data.selection)"
        )

    def _hash_split(self, task: Task, *, holdout: float) -> Split:
        return split_of(task, holdout=holdout, selection=self.selection, split_on=self.split_on)

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
        return {"iterator": self._iterator.get_state(), **self._identity(), "tasks": self.fingerprint()}

    def set_state(self, state: dict[str, Any]) -> None:
        mismatch = {k: (state.get(k), v) for k, v in self._identity().items() if state.get(k) != v}
        if mismatch:
            raise ValueError(f"stream state is of another stream: (saved, current) {mismatch}")
        if "tasks" in state and state["tasks"] != self.fingerprint():  # states saved before it have none
            raise ValueError(
                f"{self.domain} ({self.split}): the saved stream's tasks differ from this one's: its "
                "environment options (rl.env) or data (the files' contents) or task generator changed since "
                "the state was saved; resume with the run's own options and data, or start a new run"
            )
        self._iterator.set_state(state["iterator"])

    def fingerprint(self) -> str:
        """A digest of the tasks of records 0..FINGERPRINT_RECORDS-1: what the stream serves, whatever
        options or data made them."""
        if self._fingerprint is None:
            tasks = [self.task_at(i).to_json() for i in range(FINGERPRINT_RECORDS)]
            self._fingerprint = hashlib.sha256(json.dumps(tasks).encode()).hexdigest()[:16]
        return self._fingerprint

    def _identity(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "split": self.split,
            "seed": self.seed,
            "difficulty": self.difficulty,
            "holdout": self.holdout,
            "selection": self.selection,
            "split_on": self.split_on,
        }

    def close(self) -> None:
        if self._owns_env:
            self.env.close()


def env_kwargs(cfg: Any) -> dict[str, dict[str, Any]]:
    """{domain: constructor keywords} for every domain of cfg.rl.domains, from `rl.env.<domain>` (missing
    block or domain: {}), checked by `envs.registry.check_kwargs` and given as plain values. Every block of
    `rl.env` is checked, also one for a domain not in rl.domains (a misspelt domain name is an error)."""
    blocks = cfg.rl.get("env", None) or {}
    checked = {name: registry.check_kwargs(name, blocks[name]) for name in blocks}
    return {d: checked.get(d, {}) for d in cfg.rl.domains}


def domain_levels(cfg: Any, domain: str) -> tuple[int, ...] | None:
    """cfg.rl.levels[domain] as a tuple, None when the config names no levels for `domain` (all levels)."""
    levels = cfg.rl.get("levels", None) or {}
    return tuple(levels[domain]) if domain in levels else None


def fits_prompt(task: Task, tokenizer: Any, cfg: Any) -> bool:
    """Whether the task's formatted prompt (`rl.rollout.format_prompt`, rl.chat) has at most
    rl.max_prompt_len tokens."""
    from rl import rollout  # imports JAX: only here, so the streams stay JAX-free

    return len(rollout.format_prompt(task, tokenizer, chat=cfg.rl.chat)) <= cfg.rl.max_prompt_len


PROBE_TASKS = 16  # tasks per domain and level drawn at start to check that prompts fit


def check_domains(cfg: Any, tokenizer: Any) -> None:
    """Before any work: the split fractions (rl.data) leave every split prompts, every level in rl.levels
    exists in its domain, and some prompts of every domain fit
    rl.max_prompt_len (formatted as the sampler sees them, rl.chat included). Raises ConfigError naming the
    field; a budget that fits none would otherwise fail at the first GRPO step, after the warm start."""
    from configs.schema import ConfigError
    from rl import rollout

    rl = cfg.rl
    try:
        split_kwargs(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        kwargs = env_kwargs(cfg)
    except ValueError as e:  # an unknown domain or keyword in rl.env: the message names it
        raise ConfigError(str(e)) from None
    for d in rl.domains:
        env = registry.make(d, **kwargs[d])
        levels = domain_levels(cfg, d)
        bad = [lv for lv in levels or () if lv not in env.levels]
        if bad:
            raise ConfigError(f"rl.levels.{d}={levels} names levels {bad}; {d} has {tuple(env.levels)}")
        seed = _hash64("probe", d, rl.seed) % 2**31
        tasks = [t for lv in levels or env.levels for t in env.sample_tasks(seed, PROBE_TASKS, difficulty=lv)]
        other = sorted({t.domain for t in tasks} - {d})
        if other:  # the pool and the curriculum know the domain by its rl.domains name only
            raise ConfigError(
                f"rl.domains names {d!r}, whose tasks say domain={other[0]!r}; make tasks with "
                "Task(domain=self.name): envs.registry.make sets `name` to the name in rl.domains"
            )
        lengths = [len(rollout.format_prompt(t, tokenizer, chat=rl.chat)) for t in tasks]
        if min(lengths) > rl.max_prompt_len:
            chat = " with the chat template (rl.chat=True)" if rl.chat else ""
            raise ConfigError(
                f"rl.max_prompt_len={rl.max_prompt_len} is shorter than every prompt of {d} drawn at start "
                f"({min(lengths)} to {max(lengths)} tokens{chat}); raise it to at least {max(lengths)}"
            )


def split_kwargs(cfg: Any) -> dict[str, float]:
    """{"holdout", "selection"}: the split fractions of cfg.rl.data (defaults where a config has none), for
    every stream of a run: `DomainTasks(..., **split_kwargs(cfg))`."""
    block = cfg.rl.get("data", None) or {}
    out = {
        "holdout": float(block.get("holdout", HOLDOUT)),
        "selection": float(block.get("selection", SELECTION)),
    }
    check_fractions(**out)
    return out


def domain_stream(
    cfg: Any, domain: str, split: Split, options: Mapping[str, Any] | None = None
) -> DomainTasks:
    """The run's stream of `domain`'s `split`: seed rl.seed, levels rl.levels, fractions rl.data, options
    `options` (the environment's keywords; default: rl.env's, `env_kwargs(cfg)`)."""
    kwargs = options if options is not None else env_kwargs(cfg)[domain]
    return DomainTasks(
        domain,
        seed=cfg.rl.seed,
        split=split,
        levels=domain_levels(cfg, domain),
        env_kwargs=kwargs,
        **split_kwargs(cfg),
    )


def heldout_tasks(cfg: Any, tokenizer: Any, *, n_tasks: int | None = None) -> dict[str, list[Task]]:
    """The held-out tasks of a run, shared by the trainer's evaluation and `python -m rl.evaluate`: per
    domain of cfg.rl.domains, the first `n_tasks` (default cfg.rl.eval.n_tasks) tasks of distinct prompts of
    the domain's eval stream (`domain_stream`) whose prompt fits rl.max_prompt_len. Distinct means distinct
    split keys (`split_key`): prompts, or whole tasks where the domain splits on tasks.

    Raises ValueError when fewer fit in HELDOUT_DRAWS_PER_TASK * n_tasks draws."""
    return _distinct_tasks(cfg, tokenizer, "eval", int(n_tasks or cfg.rl.eval.n_tasks), "rl.eval.n_tasks")


def selection_tasks(cfg: Any, tokenizer: Any, *, n_tasks: int | None = None) -> dict[str, list[Task]]:
    """The selection split's tasks, picked like `heldout_tasks` (distinct prompts that fit): what a recipe
    search scores, so that the held-out split stays unseen by every choice."""
    return _distinct_tasks(cfg, tokenizer, "selection", int(n_tasks or cfg.rl.eval.n_tasks), "n_tasks")


def distinct_prompts(tasks: Sequence[Task]) -> int:
    """The number of distinct prompts among `tasks`."""
    return len({t.prompt for t in tasks})


def _distinct_tasks(cfg: Any, tokenizer: Any, split: Split, n: int, field: str) -> dict[str, list[Task]]:
    rl = cfg.rl
    kwargs = env_kwargs(cfg)
    out = {}
    for domain in rl.domains:
        stream = domain_stream(cfg, domain, split, kwargs[domain])
        tasks: dict[str, Task] = {}
        try:
            for _ in range(HELDOUT_DRAWS_PER_TASK * n):
                if len(tasks) == n:
                    break
                task = stream.next_tasks(1)[0]
                key = json.dumps(split_key(task, stream.split_on), sort_keys=True)
                if key not in tasks and fits_prompt(task, tokenizer, cfg):
                    tasks[key] = task
        finally:
            stream.close()
        if len(tasks) < n:
            raise ValueError(
                f"{domain}: only {len(tasks)} distinct {split} tasks of {field}={n} have a prompt "
                f"that fits rl.max_prompt_len={rl.max_prompt_len} tokens (in {HELDOUT_DRAWS_PER_TASK * n} "
                f"draws); raise rl.max_prompt_len or lower {field} (or give more data, or a larger "
                f"fraction: rl.data.{'holdout' if split == 'eval' else 'selection'})"
            )
        out[domain] = list(tasks.values())
    return out


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


class TaskSource:
    """Task streams and curriculum behind one lock (the async producer thread and the trainer share them):
    tasks whose prompt fits rl.max_prompt_len, the batch counter, and their checkpointed state."""

    def __init__(self, cfg, streams, scheduler, tokenizer):
        self.cfg, self.streams, self.scheduler, self.tokenizer = cfg, streams, scheduler, tokenizer
        self.lock = threading.Lock()
        self.skipped_long = 0
        self._batch_index = 0

    def next_tasks(self, n: int, weights: dict[str, float] | None = None) -> list:
        """n tasks split over the domains by the curriculum (or `weights`), skipping (and counting) tasks
        whose prompt is longer than rl.max_prompt_len tokens."""
        out = []
        with self.lock:
            for _ in range(64):
                want = n - len(out)
                allocation = split_by_weights(want, weights) if weights else self.scheduler.allocate(want)
                for task in self.streams.next_tasks(allocation):
                    if fits_prompt(task, self.tokenizer, self.cfg):
                        out.append(task)
                    else:
                        self.skipped_long += 1
                if len(out) == n:
                    return out
        raise ValueError(
            f"rl.max_prompt_len={self.cfg.rl.max_prompt_len} is shorter than nearly every prompt of "
            f"{self.cfg.rl.domains}; raise it (seq_len = max_prompt_len + max_new_tokens follows)."
        )

    def next_batch_index(self) -> int:
        with self.lock:
            self._batch_index += 1
            return self._batch_index - 1

    def set_batch_index(self, index: int) -> None:
        self._batch_index = index

    def update_curriculum(self, step: int, draws: dict) -> dict[str, float]:
        with self.lock:
            self.scheduler.observe(step, draws)
            out = self.scheduler.metrics()
        out["rollout/skipped_long_prompts"] = float(self.skipped_long)
        return out

    def state(self, step: int, version: int, **extra) -> dict[str, Any]:
        with self.lock:
            return {
                "step": step,
                "version": version,
                "streams": self.streams.get_state(),
                "curriculum": self.scheduler.state_dict(),
                **extra,
            }

    def set_state(self, meta: dict[str, Any]) -> None:
        self.streams.set_state(meta["streams"])
        self.scheduler.load_state_dict(meta["curriculum"])


def split_by_weights(n: int, weights: dict[str, float]) -> dict[str, int]:
    """n split by weights, largest remainders first (sums to n)."""
    total = sum(weights.values())
    exact = {d: n * w / total for d, w in weights.items()}
    out = {d: int(x) for d, x in exact.items()}
    for d in sorted(exact, key=lambda d: exact[d] - out[d], reverse=True)[: n - sum(out.values())]:
        out[d] += 1
    return out
