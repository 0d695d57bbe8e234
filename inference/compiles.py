"""Counting the lowerings (new executables, whether compiled or read from the persistent cache) that happen
inside engine calls: `Engine.stats()["compiles"]` and `["compiles_after_warmup"]`.

JAX reports each lowering to a process-wide listener; the counter of the engine call running in this thread
(if any) takes it, so engines in other threads count only their own.
"""

from __future__ import annotations

import threading

import jax

_TLS = threading.local()


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and getattr(_TLS, "counter", None):
        _TLS.counter[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


class Counting:
    """Holds the engine lock and counts lowerings in this thread into `counter[0]` while inside an engine
    call."""

    def __init__(self, counter: list[int], lock: threading.RLock):
        self.counter, self.lock = counter, lock

    def __enter__(self):
        self.lock.acquire()
        self.saved = getattr(_TLS, "counter", None)
        _TLS.counter = self.counter

    def __exit__(self, *exc):
        _TLS.counter = self.saved
        self.lock.release()
