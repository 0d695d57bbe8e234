"""A domain that misbehaves on request, for testing `envs.pool`: the completion says what scoring does.

    ok               -> Score(1.0, "ok")
    wrong            -> Score(0.0, "wrong")
    sleep:<seconds>  -> sleeps, then ok (a slow or hanging verifier)
    stubborn:<secs>  -> ignores SIGTERM, then sleeps (only SIGKILL stops it)
    crash            -> os._exit(1): the worker process dies
    segv             -> the worker process kills itself with SIGSEGV
    raise            -> raises RuntimeError inside `score`
    flaky:<path>     -> crashes the first time (creating the marker file <path>), ok afterwards

Anything else is a `format_error`. Deliberately not deterministic (sleeps, crashes): never train on it.
"""

from __future__ import annotations

import os
import pathlib
import resource
import signal
import time

from envs.base import Score, SingleTurnEnvironment, Task


def _crash_without_core_dump(sig: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.kill(os.getpid(), sig)


class DebugEnvironment(SingleTurnEnvironment):
    name = "debug"
    levels = (0,)

    def sample_tasks(self, seed: int, n: int, *, difficulty: int | None = None) -> list[Task]:
        return [
            Task(id=f"debug-{seed}-{i}", domain=self.name, prompt="Reply with: ok", metadata={"answer": "ok"})
            for i in range(n)
        ]

    def reference_solution(self, task: Task) -> str:
        return "ok"

    def score(self, task: Task, completion: str) -> Score:
        command, _, argument = completion.strip().partition(":")
        details = {"task_id": task.id}
        if command == "ok":
            return Score(1.0, "ok", details)
        if command == "wrong":
            return Score(0.0, "wrong", details)
        if command == "sleep":
            time.sleep(float(argument))
            return Score(1.0, "ok", details)
        if command == "stubborn":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(float(argument))
            return Score(1.0, "ok", details)
        if command == "crash":
            os._exit(1)
        if command == "segv":
            _crash_without_core_dump(signal.SIGSEGV)
        if command == "raise":
            raise RuntimeError(f"debug environment raised on request (task {task.id})")
        if command == "flaky":
            marker = pathlib.Path(argument)
            if not marker.exists():
                marker.touch()
                os._exit(1)
            return Score(1.0, "ok", details)
        return Score(0.0, "format_error", {**details, "reason": f"unknown debug command {command!r}"})
