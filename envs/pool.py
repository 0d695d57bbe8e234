"""`EnvPool`: environments score and step in separate, JAX-free worker processes.

The trainer has JAX initialised, so workers are started with forkserver (or spawn), never a plain fork, and
never import JAX. Each worker makes its environments (`envs.registry.make`) before the pool is ready.

Parent side, per worker, one handler thread feeds the worker from a shared bounded queue (at most
`max_inflight_per_worker` requests outstanding in it: backpressure, `submit` blocks when the queue is full)
and collects its replies over pipes; one watchdog thread enforces the per-call timeout (SIGTERM to the
worker's process group, SIGKILL after `term_grace_s`). A worker that dies is replaced by a fresh one:
a timed-out call returns `Score(0.0, "timeout")`, a call that crashed its worker is retried once and then
returns `Score(0.0, "crash")`, and the other calls it had in flight are retried on the other workers.
An exception inside an environment is no crash: the live worker returns `Score(0.0, "env_error")`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import itertools
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from multiprocessing import connection as mp_connection
from multiprocessing import forkserver, resource_tracker
from multiprocessing.reduction import ForkingPickler
from typing import Any

from envs import registry
from envs.base import Score, Task
from envs.worker import failure, worker_main

KINDS = ("score", "episode")
_STATS_WINDOW = 10_000  # latencies kept for the percentiles


# ---------------------------------------------------------------------------------------------------------
# Process start: hide the parent's __main__, share forkserver and resource tracker between pools
# ---------------------------------------------------------------------------------------------------------

_START_LOCK = threading.Lock()
_SERVICES_LOCK = threading.Lock()
_live_pools = 0
_services_to_stop: list[Any] = []  # stop functions of the helper processes the first live pool started


@contextlib.contextmanager
def _parent_main_hidden() -> Iterator[None]:
    """Spawn and forkserver children re-run the parent's `__main__` (to unpickle functions defined there);
    the trainer's main imports JAX, so while a worker starts `__main__` is an empty stand-in."""
    with _START_LOCK:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def _acquire_services(start_method: str) -> None:
    """Notes which helper processes (forkserver, resource tracker) are not yet running: pools start them."""
    global _live_pools
    with _SERVICES_LOCK:
        if _live_pools == 0:
            _services_to_stop.clear()
            if start_method == "forkserver" and forkserver._forkserver._forkserver_pid is None:
                _services_to_stop.append(forkserver._forkserver._stop)
            if resource_tracker._resource_tracker._fd is None:
                _services_to_stop.append(resource_tracker._resource_tracker._stop)
        _live_pools += 1


def _release_services() -> None:
    """The last pool to close stops the helper processes that pools started, so none outlives them."""
    global _live_pools
    with _SERVICES_LOCK:
        _live_pools -= 1
        if _live_pools == 0:
            for stop in _services_to_stop:
                stop()
            _services_to_stop.clear()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


# ---------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------


class _StartError(RuntimeError):
    pass


@dataclasses.dataclass(eq=False)
class _Request:
    id: int
    kind: str
    task: Task
    payload: Any
    future: Future
    submitted_at: float
    sent_at: float = 0.0
    crashes: int = 0  # times it was running when its worker died


class _RequestQueue:
    """Bounded FIFO shared by the handler threads; retries go to the front and ignore the bound.

    A pipe holds one byte while requests wait, so a handler can wait on its worker and on new work at once.
    """

    def __init__(self, capacity: int):
        self._items: collections.deque[_Request] = collections.deque()
        self._capacity = capacity
        self._cond = threading.Condition()
        self._closed = False
        self.fd, self._bell_w = os.pipe()

    def put(self, request: _Request) -> None:
        with self._cond:
            while len(self._items) >= self._capacity and not self._closed:
                self._cond.wait()
            self._append([request], front=False)

    def put_front(self, requests: list[_Request]) -> None:
        with self._cond:
            self._append(requests, front=True)

    def _append(self, requests: list[_Request], *, front: bool) -> None:
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        if requests and not self._items:
            os.write(self._bell_w, b"x")
        if front:
            self._items.extendleft(reversed(requests))
        else:
            self._items.extend(requests)

    def get_nowait(self) -> _Request | None:
        with self._cond:
            if not self._items or self._closed:
                return None
            request = self._items.popleft()
            if not self._items:
                os.read(self.fd, 1)
            self._cond.notify()
            return request

    def close(self) -> list[_Request]:
        """Refuses new requests and returns the waiting ones; the bell stays rung so every handler wakes."""
        with self._cond:
            self._closed = True
            if not self._items:
                os.write(self._bell_w, b"x")
            waiting, self._items = list(self._items), collections.deque()
            self._cond.notify_all()
            return waiting


class _Worker:
    """One worker process and its parent-side handler thread, which replaces the process when it dies."""

    def __init__(self, pool: EnvPool, index: int):
        self._pool = pool
        self._index = index
        self._lock = threading.Lock()  # shared with the watchdog
        self._inflight: collections.deque[_Request] = collections.deque()
        self._head_started = 0.0
        self._timed_out: _Request | None = None
        self._kill_at: float | None = None
        self.process: Any = None
        self.info: dict[str, Any] = {}

    # -- process lifecycle -------------------------------------------------------------------------------

    def launch(self) -> None:
        ctx = self._pool._ctx
        requests_r, self._requests = ctx.Pipe(duplex=False)
        self._results, results_w = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=worker_main,
            args=(requests_r, results_w, self._pool.domains, self._pool.targets),
            name=f"envpool-worker-{self._index}",
            daemon=True,
        )
        with _parent_main_hidden():
            process.start()
        requests_r.close()
        results_w.close()
        self.process = process

    def await_ready(self, timeout_s: float) -> None:
        ready = mp_connection.wait([self._results, self._pool._stop_r], timeout_s)
        if self._results not in ready:
            raise _StartError(f"worker {self._index} not ready within {timeout_s:.0f} s")
        try:
            kind, info = self._results.recv()
        except EOFError:
            self.process.join(1.0)
            raise _StartError(f"worker {self._index} exited during start ({self.process.exitcode})") from None
        if kind == "error":
            raise _StartError(f"worker {self._index} failed to make its environments:\n{info}")
        if info["jax_loaded"]:
            raise _StartError(f"worker {self._index} imported JAX; environment workers must stay JAX-free")
        self.info = info

    def stop(self) -> None:
        """Hangs up (an idle worker exits by itself), then SIGTERM and SIGKILL; returns once it is reaped."""
        grace = self._pool.term_grace_s
        with contextlib.suppress(OSError):
            self._requests.close()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self.process.join(grace)
            if self.process.exitcode is not None:
                break
            _signal_group(self.process.pid, sig)
        self.process.join()
        self._results.close()

    # -- handler thread ----------------------------------------------------------------------------------

    def serve(self) -> None:
        pool = self._pool
        while not pool._closing:
            waitables = [self._results, self.process.sentinel, pool._stop_r]
            if len(self._inflight) < pool.max_inflight_per_worker:
                waitables.append(pool._queue.fd)
            ready = mp_connection.wait(waitables)
            if pool._closing:
                break
            died = self.process.sentinel in ready
            if self._results in ready or died:
                died = not self._drain() or died
            if died and not self._replace():
                return
            if not died and pool._queue.fd in ready:
                self._take()
        self.stop()
        pool._fail_all(self._take_inflight()[0], "EnvPool closed")

    def _take(self) -> None:
        while len(self._inflight) < self._pool.max_inflight_per_worker:
            request = self._pool._queue.get_nowait()
            if request is None:
                return
            self._send(request)

    def _send(self, request: _Request) -> None:
        try:
            data = ForkingPickler.dumps((request.id, request.kind, request.task, request.payload))
        except Exception as e:
            request.future.set_exception(e)
            return
        with self._lock:
            if not self._inflight:
                self._head_started = time.monotonic()
            self._inflight.append(request)
        self._pool._note_outstanding(+1)
        request.sent_at = time.monotonic()
        with contextlib.suppress(OSError):  # a dead worker: the sentinel leads to _replace, which retries
            self._requests.send_bytes(data)

    def _drain(self) -> bool:
        """Handles every reply waiting in the pipe; False once the worker has hung up."""
        try:
            while self._results.poll():
                self._complete(*self._results.recv())
        except (EOFError, OSError):
            return False
        return True

    def _complete(self, request_id: int, result: Any, env_s: float, waited_s: float) -> None:
        received_at = time.monotonic()
        with self._lock:
            request = next(r for r in self._inflight if r.id == request_id)
            self._inflight.remove(request)
            self._head_started = received_at
        self._pool._note_outstanding(-1)
        overhead_s = received_at - request.sent_at - env_s - waited_s
        self._pool._finish(request, result, overhead_s=overhead_s)

    def _take_inflight(self) -> tuple[list[_Request], _Request | None]:
        """Empties the worker's calls (the watchdog then leaves its pid alone); also which one timed out."""
        with self._lock:
            inflight, timed_out = list(self._inflight), self._timed_out
            self._inflight.clear()
            self._timed_out, self._kill_at = None, None
        self._pool._note_outstanding(-len(inflight))
        return inflight, timed_out

    def _replace(self) -> bool:
        """The worker died: settles its calls, starts a fresh worker; False if none could be started."""
        inflight, timed_out = self._take_inflight()
        self.stop()
        details = {"worker_pid": self.process.pid, "exitcode": self.process.exitcode}
        retries = []
        for position, request in enumerate(inflight):
            if request is timed_out:
                self._pool._finish_failed(request, "timeout", {**details, "timeout_s": self._pool.timeout_s})
            elif position == 0 and timed_out is None:
                request.crashes += 1
                if request.crashes > 1:
                    self._pool._finish_failed(request, "crash", {**details, "attempts": request.crashes})
                else:
                    retries.append(request)
            else:
                retries.append(request)
        self._pool._count(restarts=1, crashes=int(timed_out is None), retries=len(retries))
        if retries:
            try:
                self._pool._queue.put_front(retries)
            except RuntimeError:
                self._pool._fail_all(retries, "EnvPool closed")
        return self._restart()

    def _restart(self) -> bool:
        for attempt in range(3):
            if self._pool._closing:
                return False
            try:
                self.launch()
                self.await_ready(self._pool.startup_timeout_s)
                return True
            except (_StartError, OSError) as e:
                error = e
                self.stop()
                if not self._pool._closing:
                    time.sleep(0.5 * 2**attempt)
        self._pool._worker_lost(self._index, error)
        return False

    # -- watchdog ----------------------------------------------------------------------------------------

    def check_deadline(self, now: float) -> None:
        """Called by the watchdog: SIGTERM when the running call is past its timeout, SIGKILL after grace."""
        with self._lock:
            if not self._inflight or self.process is None or self.process.pid is None:
                return
            if self._kill_at is None:
                if now - self._head_started < self._pool.timeout_s:
                    return
                self._timed_out, sig = self._inflight[0], signal.SIGTERM
                self._kill_at = now + self._pool.term_grace_s
            elif now >= self._kill_at:
                self._kill_at, sig = math.inf, signal.SIGKILL
            else:
                return
            pid = self.process.pid
        _signal_group(pid, sig)


class EnvPool:
    """Worker processes that score completions and run episodes; see the module docstring.

    `domains`: names (built in, registered, entry points or import paths: `envs.registry`), or name ->
    keyword arguments for `envs.registry.make`; workers resolve each name as this process does (`targets`,
    this process's sys.path and working directory). Use as a context manager or
    call `close()` (also run at exit). Closing the last pool stops the forkserver and resource tracker if
    pools started them (a resource tracker started first by the pool also stops then).
    """

    def __init__(
        self,
        num_workers: int,
        *,
        domains: Sequence[str] | Mapping[str, Mapping[str, Any]],
        max_inflight_per_worker: int = 2,
        timeout_s: float = 30.0,
        start_method: str = "forkserver",
        term_grace_s: float = 1.0,
        startup_timeout_s: float = 60.0,
    ):
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method={start_method!r}: forkserver or spawn (fork is unsafe with JAX)")
        if num_workers < 1 or max_inflight_per_worker < 1 or timeout_s <= 0:
            raise ValueError("num_workers and max_inflight_per_worker must be >= 1, timeout_s > 0")
        if isinstance(domains, Mapping):
            self.domains = {name: dict(kwargs) for name, kwargs in domains.items()}
        else:
            self.domains = {name: {} for name in domains}
        self.targets = {name: registry.target(name) for name in self.domains}  # KeyError: unknown name
        self.max_inflight_per_worker = max_inflight_per_worker
        self.timeout_s = timeout_s
        self.term_grace_s = term_grace_s
        self.startup_timeout_s = startup_timeout_s
        self._ctx = multiprocessing.get_context(start_method)
        self._queue = _RequestQueue(num_workers * max_inflight_per_worker)
        self._stop_r, self._stop_w = os.pipe()
        self._closing = self._closed = False
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._counts: collections.Counter[str] = collections.Counter()
        self._latency_s: collections.deque[float] = collections.deque(maxlen=_STATS_WINDOW)
        self._overhead_s: collections.deque[float] = collections.deque(maxlen=_STATS_WINDOW)
        self._outstanding = self._max_outstanding = 0
        self._lost: dict[int, str] = {}
        self._workers = [_Worker(self, i) for i in range(num_workers)]
        _acquire_services(start_method)
        self._start_workers()
        self._threads = [threading.Thread(target=self._watch, daemon=True, name="envpool-watchdog")]
        self._threads += [
            threading.Thread(target=w.serve, daemon=True, name=f"envpool-handler-{i}")
            for i, w in enumerate(self._workers)
        ]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    def _start_workers(self) -> None:
        try:
            for worker in self._workers:
                worker.launch()
            for worker in self._workers:
                worker.await_ready(self.startup_timeout_s)
        except BaseException as e:
            for worker in self._workers:
                if worker.process is not None:
                    worker.stop()
            self._close_fds()
            _release_services()
            if isinstance(e, _StartError):
                raise RuntimeError(str(e)) from None
            raise

    # -- public API --------------------------------------------------------------------------------------

    def submit(self, kind: str, task: Task, payload: str | Sequence[str]) -> Future:
        """Queues one call; blocks while the queue is full. `kind="score"`: payload is the completion, the
        result a `Score`; `kind="episode"`: payload is the actions, the result `(episode dict, Score)`."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}; use one of {KINDS}")
        if task.domain not in self.domains:
            raise KeyError(f"domain {task.domain!r} not served by this pool ({sorted(self.domains)})")
        if kind == "episode" and isinstance(payload, str):
            raise TypeError("an episode's payload is the list of actions, not one string")
        if self._closing:
            raise RuntimeError("EnvPool is closed")
        future: Future = Future()
        future.set_running_or_notify_cancel()  # results always arrive; no cancelling half-run calls
        payload = payload if kind == "score" else list(payload)
        self._queue.put(_Request(next(self._ids), kind, task, payload, future, time.monotonic()))
        return future

    def score_many(self, items: Sequence[tuple[Task, str]]) -> list[Score]:
        """Scores (task, completion) pairs; results in input order."""
        futures = [self.submit("score", task, completion) for task, completion in items]
        return [future.result() for future in futures]

    def run_episodes(self, items: Sequence[tuple[Task, Sequence[str]]]) -> list[tuple[dict[str, Any], Score]]:
        """Runs each task's actions (reset, step until done, score); (episode dict, Score) in input order."""
        futures = [self.submit("episode", task, actions) for task, actions in items]
        return [future.result() for future in futures]

    def worker_info(self) -> list[dict[str, Any]]:
        """Per worker, what it reported when it became ready: pid, jax_loaded, domains."""
        return [dict(worker.info) for worker in self._workers]

    def stats(self) -> dict[str, Any]:
        """Counters and latency percentiles (over the last calls). Overhead: round trip to the worker minus
        the time inside the environment and the time spent behind an earlier call in the same worker."""
        with self._lock:
            counts = dict(self._counts)
            latency_ms = sorted(1e3 * s for s in self._latency_s)
            overhead_ms = sorted(1e3 * s for s in self._overhead_s)
            outstanding, max_outstanding = self._outstanding, self._max_outstanding
        return {
            "workers": len(self._workers) - len(self._lost),
            **{key: counts.get(key, 0) for key in ("calls", "timeouts", "crashes", "retries", "restarts")},
            "statuses": {key[7:]: n for key, n in counts.items() if key.startswith("status:")},
            "outstanding": outstanding,
            "max_outstanding": max_outstanding,
            "latency_p50_ms": _percentile(latency_ms, 50),
            "latency_p99_ms": _percentile(latency_ms, 99),
            "overhead_p50_ms": _percentile(overhead_ms, 50),
            "overhead_p99_ms": _percentile(overhead_ms, 99),
        }

    def close(self) -> None:
        """Stops every worker (and the helper processes pools started); waiting calls fail."""
        if self._closed:
            return
        self._closed = self._closing = True
        atexit.unregister(self.close)
        self._fail_all(self._queue.close(), "EnvPool closed")
        os.write(self._stop_w, b"x")
        for thread in self._threads:
            thread.join()
        self._close_fds()
        _release_services()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- bookkeeping (handler and watchdog threads) ------------------------------------------------------

    def _watch(self) -> None:
        interval = min(0.05, self.timeout_s / 10)
        while not self._closing:
            time.sleep(interval)
            now = time.monotonic()
            for worker in self._workers:
                worker.check_deadline(now)

    def _finish(self, request: _Request, result: Any, *, overhead_s: float | None = None) -> None:
        score = result if request.kind == "score" else result[1]
        with self._lock:
            self._counts.update(("calls", f"status:{score.status}"))
            self._counts["timeouts"] += score.status == "timeout"
            self._latency_s.append(time.monotonic() - request.submitted_at)
            if overhead_s is not None:
                self._overhead_s.append(overhead_s)
        request.future.set_result(result)

    def _finish_failed(self, request: _Request, status: str, details: dict[str, Any]) -> None:
        self._finish(request, failure(request.kind, Score(0.0, status, details)))

    def _fail_all(self, requests: list[_Request], reason: str) -> None:
        for request in requests:
            request.future.set_exception(RuntimeError(reason))

    def _count(self, **increments: int) -> None:
        with self._lock:
            self._counts.update(increments)

    def _note_outstanding(self, delta: int) -> None:
        with self._lock:
            self._outstanding += delta
            self._max_outstanding = max(self._max_outstanding, self._outstanding)

    def _worker_lost(self, index: int, error: Exception) -> None:
        """A worker could not be restarted; once none is left, waiting and future calls fail."""
        with self._lock:
            self._lost[index] = str(error)
            all_lost = len(self._lost) == len(self._workers)
        if all_lost:
            self._closing = True
            self._fail_all(self._queue.close(), f"EnvPool has no workers left: {error}")

    def _close_fds(self) -> None:
        for fd in (self._stop_r, self._stop_w, self._queue.fd, self._queue._bell_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]
