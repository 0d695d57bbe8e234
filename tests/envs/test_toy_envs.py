"""The toy demo domains `arith` and `strings`: golden tasks, scoring statuses, determinism, the QA gate."""

import pytest

from envs import registry
from envs.domains import arith, strings
from envs.qa import gate as qa


@pytest.mark.parametrize("name", ["arith", "strings"])
def test_registered_and_passes_the_gate(name):
    report = qa.run_checks(name, n=10)
    assert report.passed, report.failed()


@pytest.mark.parametrize("name", ["arith", "strings"])
def test_deterministic_levels(name):
    env = registry.make(name)
    for level in env.levels:
        tasks = env.sample_tasks(3, 20, difficulty=level)
        again = env.sample_tasks(3, 20, difficulty=level)
        assert [t.to_json() for t in tasks] == [t.to_json() for t in again]
        assert {t.difficulty for t in tasks} == {level}
    with pytest.raises(ValueError, match="difficulty"):
        env.sample_tasks(0, 1, difficulty=9)


def test_arith_answers_match_the_prompt():
    env = arith.ArithEnvironment()
    for level in env.levels:
        for t in env.sample_tasks(0, 50, difficulty=level):
            a, op, b = t.metadata["a"], t.metadata["op"], t.metadata["b"]
            assert t.prompt == f"{a}{op}{b}="
            assert int(t.metadata["answer"]) == eval(f"{a}{op}{b}")  # the prompt is a Python expression
            if level < 2:
                assert 0 <= a <= 9 and 0 <= b <= 9 and int(t.metadata["answer"]) >= 0
            else:
                assert 10 <= a <= 99


def test_arith_levels_use_their_operators():
    env = arith.ArithEnvironment()
    ops = {lv: {t.metadata["op"] for t in env.sample_tasks(0, 200, difficulty=lv)} for lv in env.levels}
    assert ops == {0: {"+", "-"}, 1: {"+", "-", "*"}, 2: {"+", "-"}, 3: {"+", "-"}}


def test_arith_scoring():
    env = arith.ArithEnvironment()
    task = arith.generate_task(0, 0, 2)
    answer = task.metadata["answer"]
    wrong = str(int(answer) + 1)
    assert env.score(task, answer).status == "ok"
    assert env.score(task, f" {answer}\n").status == "ok"
    assert env.score(task, f"\\boxed{{{answer}}}").status == "ok"
    assert env.score(task, wrong).status == "wrong"
    assert env.score(task, f"{answer} {wrong}").status == "format_error"
    assert env.score(task, task.prompt).status == "format_error"
    assert env.score(task, "").status == "format_error"


def test_strings_golden():
    task = strings.generate_task(0, 0, 1)
    word = task.metadata["word"]
    assert len(word) == 4 and task.prompt == f"{task.metadata['op']} {word}="
    assert strings.OPS["rev"]("kqbd") == "dbqk"
    assert strings.OPS["sort"]("kqbd") == "bdkq"
    assert task.metadata["answer"] == strings.OPS[task.metadata["op"]](word)
    env = strings.StringsEnvironment()
    assert [len(t.metadata["word"]) for t in env.sample_tasks(0, 4, difficulty=3)] == [6] * 4
    assert {t.metadata["op"] for t in env.sample_tasks(0, 50, difficulty=0)} == {"rev", "sort"}


def test_strings_scoring():
    env = strings.StringsEnvironment()
    task = strings.Task("t", "strings", "rev abcd=", {"answer": "dcba", "op": "rev", "word": "abcd"}, 1)
    assert env.score(task, "dcba").status == "ok"
    assert env.score(task, "dcba\n").reward == 1.0
    assert env.score(task, "abcd") == strings.Score(0.0, "wrong", {"parsed": "abcd", "expected": "dcba"})
    for bad in ("", "   ", "dcba dcba", "dcba\nabcd", "DCBA", "rev abcd=", "dcba" * 20):
        assert env.score(task, bad).status == "format_error", bad
