"""A domain for tests/test_train_user_envs.py, in a module of its own: the environment workers import it,
and they must stay JAX-free (a test module imports JAX)."""

from envs import Score, SingleTurnEnvironment


class Answer(SingleTurnEnvironment):
    """A domain that cannot be made without its option: "Reply with: <answer>"."""

    def __init__(self, answer: str):
        self.answer = answer

    def make_task(self, rng, level):
        return f"Reply with: {self.answer}", {"answer": self.answer}

    def reference_solution(self, task):
        return task.metadata["answer"]

    def score(self, task, completion):
        right = completion.strip() == task.metadata["answer"]
        return Score(1.0, "ok") if right else Score(0.0, "wrong")
