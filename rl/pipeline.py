"""Asynchronous rollout: a producer thread fills a bounded queue with batches tagged by policy version.

The producer calls `make_batch()` (rollout with the engine, scoring in the environment pool, filters,
batch assembly) in a loop and puts each result in a queue of at most `max_queue` batches; it blocks when
the queue is full, so it never runs more than `max_queue` batches ahead. The trainer takes batches with
`get()`: a batch whose oldest token was sampled by a policy more than `max_staleness` versions behind the
trainer's is dropped (and counted); the rest train, corrected by truncated importance weights against the
behaviour log-probs the engine recorded. After each step the trainer pushes its weights into the engine
(`Engine.update_params`, thread-safe): generation in flight continues with the new weights from its next
step on (interrupt-and-resume), and each token keeps the log-prob it was sampled with.

Sync mode is the same code with `max_staleness=0` and no thread: `get()` produces the batch itself.

Metrics per batch: `staleness` (trainer version minus the batch's oldest sampling version), `queue_wait_s`
(how long the trainer waited for it), `generation_s` (the producer's time for it), plus drops.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class RolloutBatch:
    """What the producer hands the trainer."""

    batch: dict[str, Any] | None  # the train step's arrays (None: no group had a reward signal)
    version: int  # oldest policy version that sampled a model token of it
    metrics: dict[str, float]  # for dashboards
    domains: dict[str, Any] = dataclasses.field(default_factory=dict)  # domain -> rollout.DomainDraw
    samples: list[Any] = dataclasses.field(default_factory=list)  # a few episodes, for samples.jsonl
    dropped: list[Any] = dataclasses.field(default_factory=list)  # a few the filters dropped, for it too
    generation_s: float = 0.0


class Pipeline:
    """`Pipeline(make_batch, *, asynchronous, max_staleness, max_queue)`; `get(trainer_version)` returns
    the next usable batch and its pipeline metrics."""

    def __init__(
        self,
        make_batch: Callable[[], RolloutBatch],
        *,
        asynchronous: bool,
        max_staleness: int = 1,
        max_queue: int = 2,
    ):
        if max_staleness < 0:
            raise ValueError(f"rl.max_staleness={max_staleness} must be >= 0 (0 = on-policy).")
        if max_queue < 1:
            raise ValueError(f"rl.max_queue={max_queue} must be >= 1.")
        self.make_batch, self.asynchronous = make_batch, asynchronous
        self.max_staleness = max_staleness if asynchronous else 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.dropped = 0
        self._thread = None
        if asynchronous:
            self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                item = self._timed()
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surfaced in the trainer's thread by get()
            self._error = e

    def _timed(self) -> RolloutBatch:
        t0 = time.perf_counter()
        item = self.make_batch()
        item.generation_s = time.perf_counter() - t0
        return item

    def get(self, trainer_version: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The next batch at most `max_staleness` versions old, with its metrics."""
        if not self.asynchronous:
            item = self._timed()
            return item, self._metrics(item, trainer_version, 0.0)
        t0 = time.perf_counter()
        while True:
            if self._error is not None:
                raise RuntimeError("the rollout producer failed") from self._error
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if trainer_version - item.version <= self.max_staleness:
                return item, self._metrics(item, trainer_version, time.perf_counter() - t0)
            self.dropped += 1

    def _metrics(self, item: RolloutBatch, trainer_version: int, wait_s: float) -> dict[str, float]:
        return {
            "pipeline/staleness": float(trainer_version - item.version),
            "pipeline/queue_wait_s": wait_s,
            "pipeline/generation_s": item.generation_s,
            "pipeline/dropped_stale_batches": float(self.dropped),
        }

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
