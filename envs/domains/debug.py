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

Slow verifiers, for pipeline benchmarks: a task whose `metadata["delay_s"]` is set makes `score` sleep that
long before scoring. `DebugEnvironment(delay_median_s=m)` puts a delay in every task it samples, drawn from a
lognormal with median `m` and p99 = 20 m (`DELAY_SIGMA`), seeded by (seed, index), so the same task always
carries the same delay. The trainer builds its task streams with `registry.make("debug")` (no arguments),
so `m` defaults to the environment variable `DEBUG_ENV_DELAY_MEDIAN_S`, read once at construction; only the
sampling side needs it, as the scoring side reads the delay from the task.
"""

from __future__ import annotations

import math
import os
import pathlib
import random
import resource
import signal
import time

from envs.base import Score, SingleTurnEnvironment, Task

DELAY_ENV_VAR = "DEBUG_ENV_DELAY_MEDIAN_S"
DELAY_SIGMA = math.log(20.0) / 2.3263  # lognormal sigma with p99 / median = 20 (2.3263: the normal's z_0.99)


def _crash_without_core_dump(sig: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.kill(os.getpid(), sig)


class DebugEnvironment(SingleTurnEnvironment):
    name = "debug"
    levels = (0,)

    def __init__(self, delay_median_s: float | None = None):
        if delay_median_s is None:
            delay_median_s = float(os.environ.get(DELAY_ENV_VAR) or 0.0)
        if not delay_median_s >= 0:
            raise ValueError(f"debug: delay_median_s={delay_median_s!r} must be >= 0 ({DELAY_ENV_VAR})")
        self.delay_median_s = delay_median_s

    def task_at(self, seed: int, index: int, level: int | None) -> Task:
        metadata: dict = {"answer": "ok"}
        if self.delay_median_s > 0:
            rng = random.Random(f"debug-delay-{seed}-{index}")  # str seeds hash the same in every process
            metadata["delay_s"] = round(rng.lognormvariate(math.log(self.delay_median_s), DELAY_SIGMA), 6)
        return Task(id=f"debug-{seed}-{index}", domain=self.name, prompt="Reply with: ok", metadata=metadata)

    def reference_solution(self, task: Task) -> str:
        return "ok"

    def score(self, task: Task, completion: str) -> Score:
        time.sleep(float(task.metadata.get("delay_s", 0.0)))  # a slow verifier (see the module docstring)
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
