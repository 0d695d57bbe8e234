"""Domain `terminal`: multi-step shell tasks in a sandboxed work dir, verified after the episode.

Each turn the policy emits one shell command; it runs under `bash -c` in the task's sandbox work dir (a fresh
shell each turn, so `cd` does not carry over) and the observation is its capped stdout, stderr and exit code.
The episode ends on `exit` / `submit` or after `max_turns`. Families, each at levels 0..3 (`tasks`):

- files: count matching lines, distinct values of a CSV column, rename files by a pattern, aggregate a CSV.
- logs: count ERROR lines, the request id with the most errors, the user with the most failed logins across
  plain and gzipped files, the slowest endpoint by mean latency.
- repair: a script that is not executable, a Python script with a bug, a Makefile indented with spaces, a
  Makefile with a wrong prerequisite plus a buggy generator script.

`reset` writes the task's files, runs its setup and snapshots the work dir; a later episode of the same task
rolls back to that snapshot instead of redoing the setup. Verification happens only in `score_episode`, in
fresh sandboxes the agent never saw: the final work dir is copied out (regular files only, capped); repair
tasks first run the repaired program there on hidden inputs the agent never saw (so hard-coding the sample's
answer fails); then `verify.py` runs in another fresh sandbox that holds only data, reads the task's checks
(expected values included) on stdin, and prints its verdict as JSON.

Disturbance (`disturbance=True`): the task's key command (`metadata["flaky"]`) fails once with a transient
error (a shim on PATH, armed in the snapshot); an agent must notice and retry. The reference solution wraps
that command in a retry loop; the same commands without it fail.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
import stat
from typing import Any

from envs.base import Environment, Episode, Score, Task
from envs.domains.terminal.tasks import LEVELS, make_task
from envs.sandbox import box as sandbox

MAX_OBSERVATION = 4000  # characters of stdout + stderr shown per turn
MAX_COPY_FILES, MAX_COPY_BYTES = 500, 4 << 20  # what verification copies out of the final work dir
VERIFY = (pathlib.Path(__file__).parent / "verify.py").read_text()  # the file the sandbox runs as verify.py

_SHIM = """#!/bin/bash
# Injected transient failure: the first call fails, later calls run the real command.
armed="$(dirname "$0")/../armed"
if [ -e "$armed" ]; then
  rm -f "$armed"
  echo "{name}: temporary failure: resource busy, try again" >&2
  exit 75
fi
exec {path} "$@"
"""


def _copy_out(workdir: str) -> list[tuple[str, bytes, int]]:
    """(relpath, content, mode) of the regular files under `workdir` (not the disturbance shim), capped."""
    out, total = [], 0
    for root, dirs, names in os.walk(workdir):
        dirs[:] = sorted(d for d in dirs if not (root == workdir and d == ".flaky"))
        for name in sorted(names):
            path = os.path.join(root, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as f:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or total + info.st_size > MAX_COPY_BYTES:
                    continue
                data = f.read(MAX_COPY_BYTES - total)
            total += len(data)
            out.append((os.path.relpath(path, workdir), data, stat.S_IMODE(info.st_mode) & 0o755))
            if len(out) >= MAX_COPY_FILES:
                return out
    return out


def _observation(run: sandbox.RunResult) -> str:
    text = run.stdout + run.stderr
    if len(text) > MAX_OBSERVATION or run.truncated:
        text = text[:MAX_OBSERVATION] + "\n[output truncated]"
    if run.timed_out:
        return f"{text}\n[timed out]"
    return f"{text}\n[exit code: {run.returncode if run.returncode is not None else f'signal {run.signal}'}]"


def _retrying(line: str) -> str:
    return f"for attempt in 1 2 3; do (set -o pipefail; {line}) && break; sleep 0.2; done"


class TerminalEnvironment(Environment):
    """Multi-turn shell tasks in a sandbox; verified after the episode in fresh sandboxes."""

    name = "terminal"
    levels = LEVELS

    def __init__(
        self,
        *,
        max_turns: int = 20,
        disturbance: bool = False,
        step_limits: sandbox.Limits | None = None,
        max_cached: int = 16,
        min_isolation: str = sandbox.REQUIRED,
    ):
        """`min_isolation`: the weakest sandbox level to accept (`envs.sandbox.require`); below the mount
        level only as an explicit, logged override."""
        sandbox.require(min_isolation, who="domain 'terminal'")
        sandbox.start_zygote()  # pre-warmed: the first episode of a worker pays no interpreter start
        self.max_turns = max_turns
        self.disturbance = disturbance
        self.step_limits = step_limits or sandbox.Limits(cpu_s=5.0, wall_s=10.0)
        self.max_cached = max_cached
        self._idle: collections.OrderedDict[str, list[tuple[sandbox.Sandbox, str]]] = (
            collections.OrderedDict()
        )
        self._live: dict[int, tuple[str, sandbox.Sandbox, str]] = {}
        self._next_handle = 0

    def draw_levels(self, seed: int, n: int) -> list[int | None]:
        return [None] * n  # `make_task` draws each task's level from the task's own generator

    def task_at(self, seed: int, index: int, level: int | None) -> Task:
        return make_task(seed, index, level)

    def reference_solution(self, task: Task) -> str:
        flaky = task.metadata["flaky"]
        lines = list(task.metadata["reference"])
        if self.disturbance:
            first = next(i for i, line in enumerate(lines) if flaky in line.split())
            lines[first] = _retrying(lines[first])
        return "\n".join([*lines, "submit"])

    def reset(self, task: Task) -> Episode:
        box, snapshot, fresh = self._acquire(task)
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self._live[handle] = (task.id, box, snapshot)
        state = {"handle": handle, "isolation": sandbox.isolation_level(), "setup_ran": fresh}
        return Episode(task=task, observation=task.prompt, state=state)

    def step(self, episode: Episode, action: str) -> Episode:
        if episode.done:
            raise ValueError("step() on a finished episode")
        command = action.strip()
        if command in ("exit", "submit"):
            episode.done = True
            episode.transcript.append({"action": action, "observation": ""})
            return episode
        _, box, _ = self._live[episode.state["handle"]]
        env = {"PATH": f"{box.workdir}/.flaky/bin:{sandbox.BASE_ENV['PATH']}"} if self.disturbance else None
        run = box.run(command, limits=self.step_limits, env=env)
        episode.observation = _observation(run)
        episode.transcript.append({"action": action, "observation": episode.observation})
        episode.turns += 1
        episode.done = episode.turns >= self.max_turns
        return episode

    def score_episode(self, task: Task, episode: Episode) -> Score:
        if episode.state.get("handle") not in self._live:
            return Score(
                0.0, "env_error", {"reason": "episode not started by this environment, or scored twice"}
            )
        task_id, box, snapshot = self._live.pop(episode.state["handle"])
        try:
            files = _copy_out(str(box.workdir))
        finally:
            self._release(task_id, box, snapshot)
        details = {"isolation": episode.state["isolation"], "turns": episode.turns}
        run = self._run_hidden(task, files) if task.metadata["exec"] else None
        verdict = self._verify(task, files, run)
        if verdict is None:
            return Score(0.0, "env_error", {**details, "reason": "the verifier gave no verdict"})
        status = "ok" if verdict["ok"] else "wrong"
        return Score(float(verdict["ok"]), status, {**details, "reasons": verdict["reasons"]})

    def close(self) -> None:
        for boxes in self._idle.values():
            for box, _ in boxes:
                box.close()
        for _, box, _ in self._live.values():
            box.close()
        self._idle.clear()
        self._live.clear()

    def _acquire(self, task: Task) -> tuple[sandbox.Sandbox, str, bool]:
        """An idle sandbox of this task rolled back to its post-setup snapshot, else a new one set up."""
        if self._idle.get(task.id):
            box, snapshot = self._idle[task.id].pop()
            box.rollback(snapshot)
            return box, snapshot, False
        box = sandbox.Sandbox(limits=self.step_limits)
        for path, content in task.metadata["files"].items():
            box.write(path, content, mode=task.metadata["modes"].get(path, 0o644))
        for command in task.metadata["setup"]:
            run = box.run(command)
            if run.status != "ok":
                box.close()
                raise RuntimeError(f"{task.id}: setup {command!r} failed: {run.stderr[-300:]}")
        if self.disturbance:
            flaky = task.metadata["flaky"]
            real = shutil.which(flaky, path=sandbox.BASE_ENV["PATH"]) or flaky
            box.write(f".flaky/bin/{flaky}", _SHIM.format(name=flaky, path=real), mode=0o755)
            box.write(".flaky/armed", "")
        return box, box.snapshot(), True

    def _release(self, task_id: str, box: sandbox.Sandbox, snapshot: str) -> None:
        self._idle.setdefault(task_id, []).append((box, snapshot))
        self._idle.move_to_end(task_id)
        while sum(len(v) for v in self._idle.values()) > self.max_cached:
            _, boxes = self._idle.popitem(last=False)
            for old, _ in boxes:
                old.close()

    def _run_hidden(self, task: Task, files: list[tuple[str, bytes, int]]) -> sandbox.RunResult:
        """The repaired program on hidden inputs, in a fresh sandbox holding a copy of the final work dir."""
        with sandbox.Sandbox(limits=self.step_limits) as box:
            for path, content, mode in files:
                box.write(path, content, mode=mode)
            for path, content in task.metadata["hidden"].items():
                box.write(path, content)
            return box.run(task.metadata["exec"])

    def _verify(self, task: Task, files: list, run: sandbox.RunResult | None) -> dict[str, Any] | None:
        """Runs the task's verify.py in a fresh sandbox with the copied files as data; its JSON verdict."""
        data = {f"work/{path}": content for path, content, _ in files}
        if run is not None:
            data["exec.json"] = json.dumps(
                {"returncode": run.returncode, "stdout": run.stdout, "timed_out": run.timed_out}
            )
        checks = json.dumps(task.metadata["checks"])
        argv = ["python3", "-I", "-S", "verify.py"]
        result = sandbox.run_once(argv, files={"verify.py": VERIFY, **data}, stdin=checks)
        try:
            verdict = json.loads(result.stdout.strip().splitlines()[-1])
            return {"ok": verdict["ok"] is True, "reasons": [str(r) for r in verdict["reasons"]]}
        except (ValueError, IndexError, KeyError, TypeError):
            return None
