"""The `strings` domain: reverse or sort a short lowercase word, scored by exact match.

Prompts are "<op> <word>=" ("rev kqbd=", "sort kqbd="); the answer is the transformed word alone, and the
whole completion (surrounding whitespace ignored) must be exactly that word. Levels set the word length:
level L uses words of 3 + L letters drawn from a-z (levels 0-3: 3 to 6 letters).

Status: `ok` on an exact match; `wrong` when the completion is one lowercase word of another value;
`format_error` for anything else (empty, several words or lines, other characters, over `MAX_CHARS`).
Tasks are a pure function of (seed, index, level).
"""

from __future__ import annotations

import random
import string

from envs.base import Score, SingleTurnEnvironment, Task

OPS = {"rev": lambda w: w[::-1], "sort": lambda w: "".join(sorted(w))}
MAX_CHARS = 64  # a longer completion cannot be one short word: rejected before any other work


def generate_task(seed: int, index: int, level: int) -> Task:
    """Task `index` of `seed` at `level`: the same arguments always give the same task."""
    rng = random.Random(f"strings:{seed}:{index}:{level}")
    op = rng.choice(sorted(OPS))
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(3 + level))
    metadata = {"answer": OPS[op](word), "op": op, "word": word}
    return Task(f"strings/{seed}/{index}/L{level}", "strings", f"{op} {word}=", metadata, level)


class StringsEnvironment(SingleTurnEnvironment):
    """Procedural word reversal and sorting."""

    name = "strings"
    levels = (0, 1, 2, 3)
    level_seed = "strings-levels"

    task_at = staticmethod(generate_task)

    def reference_solution(self, task: Task) -> str:
        return task.metadata["answer"]

    def score(self, task: Task, completion: str) -> Score:
        expected = task.metadata["answer"]
        if len(completion) > MAX_CHARS:
            return Score(0.0, "format_error", {"reason": f"longer than {MAX_CHARS} characters"})
        answer = completion.strip()
        if answer == expected:
            return Score(1.0, "ok", {"parsed": answer})
        if answer and all(c in string.ascii_lowercase for c in answer):
            return Score(0.0, "wrong", {"parsed": answer, "expected": expected})
        return Score(0.0, "format_error", {"reason": "not one lowercase word", "expected": expected})
