"""rl.pipeline: bounded producer queue, staleness filter, error propagation (no JAX needed)."""

import threading
import time

import pytest

from rl.pipeline import Pipeline, RolloutBatch


class Versions:
    """The policy version the 'sampler' sees; the trainer bumps it after each step (update_params)."""

    def __init__(self):
        self.version, self.produced = 0, 0
        self.lock = threading.Lock()

    def make_batch(self, delay=0.0):
        time.sleep(delay)
        with self.lock:
            self.produced += 1
            return RolloutBatch({"id": self.produced}, self.version, {})


def test_sync_mode_is_on_policy():
    v = Versions()
    p = Pipeline(v.make_batch, asynchronous=False, max_staleness=3)
    for _ in range(3):
        item, metrics = p.get(v.version)
        assert item.version == v.version and metrics["pipeline/staleness"] == 0
        v.version += 1
    assert v.produced == 3 and p.max_staleness == 0


def test_async_drops_batches_older_than_max_staleness():
    v = Versions()
    p = Pipeline(lambda: v.make_batch(0.0), asynchronous=True, max_staleness=1, max_queue=2)
    time.sleep(0.3)  # the producer fills the queue (2) and holds one more, all at version 0
    assert v.produced <= 3  # bounded: never more than max_queue ahead (+ the one being put)
    seen = []
    for _ in range(4):
        item, metrics = p.get(v.version)
        assert v.version - item.version <= 1
        seen.append(metrics["pipeline/staleness"])
        v.version += 2  # a trainer that moves two versions per batch makes queued batches stale
    assert p.dropped > 0 and max(seen) <= 1
    p.close()


def test_async_overlaps_generation_with_training():
    """The producer samples the next batch while the trainer trains on the current one (checked by who
    was running when, not by wall time)."""
    v = Versions()
    training = threading.Event()
    overlapped = []

    def make_batch():
        item = v.make_batch(0.01)
        overlapped.append(training.is_set())
        return item

    p = Pipeline(make_batch, asynchronous=True, max_staleness=2, max_queue=1)
    for _ in range(5):
        p.get(v.version)
        training.set()
        time.sleep(0.05)  # "training": the producer, unblocked by the get, fills the queue meanwhile
        training.clear()
        v.version += 1
    p.close()
    assert sum(overlapped) >= 3, overlapped


def test_producer_errors_reach_the_trainer():
    def broken():
        raise ValueError("environment pool died")

    p = Pipeline(broken, asynchronous=True)
    with pytest.raises(RuntimeError, match="rollout producer failed") as info:
        p.get(0)
    assert "pool died" in str(info.value.__cause__)
    p.close()


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="rl.max_staleness=-1"):
        Pipeline(lambda: None, asynchronous=True, max_staleness=-1)
    with pytest.raises(ValueError, match="rl.max_queue=0"):
        Pipeline(lambda: None, asynchronous=True, max_queue=0)
