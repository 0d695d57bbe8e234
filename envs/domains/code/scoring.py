"""Scoring of domain `code`: the solution's code taken from a completion and checked, and the runner's
report compared with the expected outputs outside the sandbox, as canonical JSON (so `True` is not `1` and
an object with a lying `__eq__` cannot pass), never revealing an expected value.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from envs.base import Score, Task
from envs.sandbox import box as sandbox

MAX_CODE_CHARS = 64_000


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced code block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def check_code(code: str, function: str) -> str | None:
    """Why `code` cannot be a submission (no code, too long, a syntax error, no `function`), or None."""
    if not code.strip():
        return "no code"
    if len(code) > MAX_CODE_CHARS:
        return f"code longer than {MAX_CODE_CHARS} characters"
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"does not parse: {type(e).__name__}"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == function:
            return None
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == function:
            return None
        if isinstance(node, ast.alias) and (node.asname or node.name) == function:
            return None
    return f"function `{function}` is not defined"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=True)


def _failure(report: dict[str, Any], expected: Any) -> str | None:
    """Why one hidden test failed (never revealing the expected value), or None when it passed."""
    status = report.get("status")
    if status != "result":
        detail = report.get("detail")
        return f"{status}:{detail}" if detail else str(status)
    try:
        got = json.loads(report.get("detail", ""))
    except (ValueError, RecursionError):
        return "output is not JSON"
    return None if _canonical(got) == _canonical(expected) else "wrong_output"


def verdict(task: Task, run: sandbox.RunResult, reward_mode: str) -> Score:
    """Compares the runner's report with the expected outputs (outside the sandbox)."""
    details: dict[str, Any] = {"isolation": run.isolation, "total": len(task.metadata["expected"])}
    if run.timed_out:
        return Score(0.0, "timeout", {**details, "passed": 0, "reason": "the whole run timed out"})
    try:
        tests = json.loads(run.stdout.strip().splitlines()[-1])["tests"]
        assert len(tests) == details["total"]
    except (ValueError, IndexError, KeyError, TypeError, AssertionError):
        reason = {"returncode": run.returncode, "signal": run.signal, "stderr": run.stderr[-500:]}
        return Score(0.0, "crash", {**details, "passed": 0, "reason": "no runner report", **reason})
    names = [f"test_{i:02d}" for i in range(len(tests))]
    failures = {n: f for n, r, e in zip(names, tests, task.metadata["expected"]) if (f := _failure(r, e))}
    violations = sorted({v for r in tests for v in r.get("violations", [])})
    passed = len(tests) - len(failures)
    details.update(passed=passed, failing=sorted(failures), failures=failures)
    kinds = {r.get("status") for r in tests}
    if violations:
        return Score(0.0, "sandbox_violation", {**details, "violations": violations[:10]})
    if kinds == {"missing"}:
        return Score(0.0, "format_error", {**details, "reason": f"`{task.metadata['function']}` not defined"})
    if passed == len(tests):
        return Score(1.0, "ok", details)
    if kinds <= {"timeout", "skipped"}:
        return Score(0.0, "timeout", details)
    reward = passed / len(tests) if reward_mode == "fraction" else 0.0
    return Score(reward, "wrong", details)
