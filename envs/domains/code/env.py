"""Domain `code`: implement a Python function from a spec; hidden tests run in the sandbox.

Tasks are procedural: four families (strings, lists, parsing, dynamic programming), one problem per family
and difficulty level 0..3, each with random parameters (a shift, a separator, coin values, edit costs) so the
spec and the answers change with the seed (`problems`). The reference implementation of every problem is
source there (never in the prompt); the hidden test inputs and their expected outputs (computed by running the
reference in this trusted process) live in `Task.metadata`.

Scoring never lets the expected outputs near the solution. The sandbox receives only the solution, the test
inputs and `runner.py`; the runner forks one worker per test (a fresh process, so state cannot leak between
tests and an infinite loop costs only its own test), reads each worker's output as JSON over a pipe and prints
them all; this process compares them with the expected outputs as canonical JSON (so `True` is not `1` and an
object with a lying `__eq__` cannot pass). Inside each worker an audit hook refuses network, subprocesses,
signals, ctypes, and file access outside the work dir (reads: also the Python installation), and reports the
attempt, which scores `sandbox_violation`: defence in depth on top of the sandbox's own isolation.
"""

from __future__ import annotations

import json
import pathlib

from envs.base import Score, SingleTurnEnvironment, Task
from envs.domains.code.problems import BY_KEY, LEVELS, NUM_TESTS, make_task, reference_source
from envs.domains.code.scoring import check_code, extract_code, verdict
from envs.sandbox import box as sandbox

RUNNER = (pathlib.Path(__file__).parent / "runner.py").read_text()  # the file the sandbox runs as runner.py


class CodeEnvironment(SingleTurnEnvironment):
    """Implement a function from a spec; hidden tests in the sandbox; all-or-nothing or fraction reward."""

    name = "code"
    levels = LEVELS

    def __init__(
        self,
        reward: str = "all_or_nothing",
        *,
        test_timeout_s: float = 1.0,
        max_test_timeouts: int = 3,
        limits: sandbox.Limits | None = None,
        python: str = "python3",
        min_isolation: str = sandbox.REQUIRED,
    ):
        """`min_isolation`: the weakest sandbox level to accept (`envs.sandbox.require`); below the mount
        level only as an explicit, logged override."""
        sandbox.require(min_isolation, who="domain 'code'")
        sandbox.start_zygote()  # pre-warmed: the first episode of a worker pays no interpreter start
        if reward not in ("all_or_nothing", "fraction"):
            raise ValueError(f"reward={reward!r}; use 'all_or_nothing' or 'fraction'")
        self.reward = reward
        self.test_timeout_s = test_timeout_s
        self.max_test_timeouts = max_test_timeouts
        self.python = python
        wall_s = test_timeout_s * NUM_TESTS + 5.0
        self.limits = limits or sandbox.Limits(cpu_s=wall_s, wall_s=wall_s)

    def draw_levels(self, seed: int, n: int) -> list[int | None]:
        return [None] * n  # `make_task` draws each task's level from the task's own generator

    def task_at(self, seed: int, index: int, level: int | None) -> Task:
        return make_task(seed, index, level)

    def reference_solution(self, task: Task) -> str:
        problem = BY_KEY[(task.metadata["family"], task.metadata["level"])]
        return f"```python\n{reference_source(problem, task.metadata['params'])}```"

    def score(self, task: Task, completion: str) -> Score:
        code = extract_code(completion)
        reason = check_code(code, task.metadata["function"])
        if reason is not None:
            return Score(0.0, "format_error", {"reason": reason, "isolation": sandbox.isolation_level()})
        inputs = {"function": task.metadata["function"], "inputs": task.metadata["inputs"]}
        argv = [self.python, "-I", "-S", "-B", "runner.py"]
        argv += [str(self.test_timeout_s), str(self.max_test_timeouts), "2000"]
        files = {"runner.py": RUNNER, "solution.py": code, "inputs.json": json.dumps(inputs)}
        run = sandbox.run_once(argv, files=files, limits=self.limits)
        return verdict(task, run, self.reward)
