"""The `arith` domain: two-operand integer arithmetic small enough for a byte-level toy model.

Prompts are bare expressions ending in "=" ("47+8="), so a byte-level model pays a handful of prompt tokens;
the reference solution is the number alone. Levels:

- 0: single digits, `+` and `-` (a - b with a >= b, so answers are 0..18);
- 1: single digits, `+`, `-` and `*` (answers up to 81);
- 2: a two-digit number plus or minus a single digit (answers 1..108);
- 3: two two-digit numbers, plus or minus (answers -89..198).

Scoring goes through `envs.domains.answers.grade`: exactly one final number (plain, `\\boxed{}`, or an
"Answer:" line), compared exactly; anything else is a `format_error`. Tasks are a pure function of
(seed, index, level).
"""

from __future__ import annotations

import random
from fractions import Fraction

from envs.base import Score, SingleTurnEnvironment, Task
from envs.domains import answers


def _operands(rng: random.Random, level: int) -> tuple[int, str, int]:
    if level == 0:
        op = rng.choice("+-")
        a, b = rng.randint(0, 9), rng.randint(0, 9)
    elif level == 1:
        op = rng.choice("+-*")
        a, b = rng.randint(0, 9), rng.randint(0, 9)
    elif level == 2:
        op = rng.choice("+-")
        a, b = rng.randint(10, 99), rng.randint(1, 9)
    else:
        op = rng.choice("+-")
        a, b = rng.randint(10, 99), rng.randint(10, 99)
    if op == "-" and level < 2 and a < b:
        a, b = b, a
    return a, op, b


def generate_task(seed: int, index: int, level: int) -> Task:
    """Task `index` of `seed` at `level`: the same arguments always give the same task."""
    rng = random.Random(f"arith:{seed}:{index}:{level}")
    a, op, b = _operands(rng, level)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    metadata = {"answer": str(value), "a": a, "op": op, "b": b}
    return Task(f"arith/{seed}/{index}/L{level}", "arith", f"{a}{op}{b}=", metadata, level)


class ArithEnvironment(SingleTurnEnvironment):
    """Procedural two-operand arithmetic; answers are integers."""

    name = "arith"
    levels = (0, 1, 2, 3)
    level_seed = "arith-levels"

    task_at = staticmethod(generate_task)

    def reference_solution(self, task: Task) -> str:
        return task.metadata["answer"]

    def score(self, task: Task, completion: str) -> Score:
        expected = Fraction(task.metadata["answer"])
        result = answers.grade(completion, expected)
        parsed = None if result.value is None else answers.format_number(result.value)
        details = {"parsed": parsed, "expected": task.metadata["answer"], "reason": result.reason}
        return Score(result.reward, result.status, details)
