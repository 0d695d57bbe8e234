"""A single-turn reward environment: "37+5=" is answered "42"."""

from envs import Score, SingleTurnEnvironment


class AddNumbers(SingleTurnEnvironment):
    levels = (0, 1)  # level L: numbers below 10 ** (L + 1)

    def make_task(self, rng, level):
        a, b = (rng.randrange(10 ** (level + 1)) for _ in range(2))
        return f"{a}+{b}=", {"answer": str(a + b)}

    def reference_solution(self, task):
        return task.metadata["answer"]

    def score(self, task, completion):
        answer = completion.strip()
        if len(answer) > 8 or not answer.isdigit():
            return Score(0.0, "format_error", {"reason": "not one number"})
        if answer == task.metadata["answer"]:
            return Score(1.0, "ok")
        return Score(0.0, "wrong", {"expected": task.metadata["answer"]})
