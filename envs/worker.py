"""The worker process of an `EnvPool`: plain Python, envs and the standard library only (never JAX).

`worker_main` makes the worker's environments, reports ready, then answers the parent's requests in order
(`score` a completion, or run an `episode` of actions) until the parent hangs up; an exception inside an
environment becomes `Score(0.0, "env_error")`, never a crash of the worker. A worker whose parent is gone
exits after `ORPHAN_EXIT_S`, even mid-call.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing import connection as mp_connection
from typing import Any

from envs import registry
from envs.base import Environment, Episode, Score, Task
from envs.sandbox import workroot

ORPHAN_EXIT_S = 5.0  # a worker whose parent is gone exits after this long, even mid-call


def worker_main(
    requests: mp_connection.Connection, results: mp_connection.Connection, domains: dict, targets: dict
) -> None:
    """Makes the environments, reports ready, then answers requests in order until the parent hangs up.
    `targets`: the parent's "module:attr" of each domain name (names it registered or found as entry points
    resolve here as there; sys.path and the working directory come with the process start)."""
    os.setpgrp()  # own process group: Ctrl-C at the terminal is the parent's; killpg reaches our children
    try:
        for name, target in targets.items():
            registry.register(name, target)
        envs = {name: registry.make(name, **kwargs) for name, kwargs in domains.items()}
    except Exception:
        results.send(("error", traceback.format_exc()))
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: _exit_now(envs, 128 + signum))
    results.send(("ready", {"pid": os.getpid(), "jax_loaded": "jax" in sys.modules, "domains": list(envs)}))
    inbox = _start_receiver(requests)
    previous_end = 0.0
    while (item := inbox.get()) is not None:
        (request_id, kind, task, payload), received_at = item
        start = time.monotonic()
        result = _execute(envs, kind, task, payload)
        end = time.monotonic()
        reply = (request_id, result, end - start, max(0.0, previous_end - received_at))
        previous_end = end
        try:
            results.send(reply)
        except Exception as e:  # an unpicklable result; the stream is intact (pickling precedes writing)
            results.send((request_id, failure(kind, _env_error(e)), end - start, reply[3]))
    _close_envs(envs)


def _start_receiver(requests: mp_connection.Connection) -> queue.SimpleQueue:
    """Drains the request pipe in a thread: a parent sending a large request never waits for a busy worker."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        try:
            while True:
                message = requests.recv()
                inbox.put((message, time.monotonic()))
        except (EOFError, OSError):
            inbox.put(None)
        time.sleep(ORPHAN_EXIT_S)  # the main thread normally finishes first; a hung call does not
        os._exit(1)

    threading.Thread(target=receive, daemon=True, name="envpool-receiver").start()
    return inbox


def _execute(envs: dict[str, Environment], kind: str, task: Task, payload: Any) -> Any:
    env = envs.get(task.domain)
    if env is None:
        return failure(kind, Score(0.0, "env_error", {"error": f"domain {task.domain!r} not in this pool"}))
    if kind == "score":
        try:
            return _checked(env.score(task, payload))
        except Exception as e:
            return _env_error(e)
    episode = None
    try:
        episode = env.reset(task)
        for action in payload:
            if episode.done:
                break
            episode = env.step(episode, action)
        return _episode_dict(episode), _checked(env.score_episode(task, episode))
    except Exception as e:
        return _episode_dict(episode), _env_error(e)


def _checked(score: Any) -> Score:
    if not isinstance(score, Score):
        raise TypeError(f"environment returned {type(score).__name__}, not envs.Score")
    return score


def _episode_dict(episode: Episode | None) -> dict[str, Any]:
    if episode is None:
        return {}
    fields = ("observation", "done", "turns", "transcript", "state")
    return {name: getattr(episode, name) for name in fields}


def _env_error(e: BaseException) -> Score:
    return Score(0.0, "env_error", {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def failure(kind: str, score: Score) -> Any:
    """The result of a call that produced no environment output, shaped like the call's normal result."""
    return score if kind == "score" else ({}, score)


def _close_envs(envs: dict[str, Environment]) -> None:
    for env in envs.values():
        with contextlib.suppress(Exception):
            env.close()
    # A worker leaves through os._exit (multiprocessing's, or ours on SIGTERM), which runs no exit handlers:
    # the sandboxes' private root goes now (a worker killed outright leaves its root to the next process
    # that makes one, `envs.sandbox.workroot.remove_abandoned`).
    workroot.remove()  # a no-op where no sandbox was made


def _exit_now(envs: dict[str, Environment], code: int) -> None:
    _close_envs(envs)
    os._exit(code)
