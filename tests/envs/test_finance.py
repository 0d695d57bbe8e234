"""The finance domain: sizes per level, solvability, answers backed by the documents, anti-hacking probes."""

import re
from fractions import Fraction

import pytest

from envs import registry
from envs.domains import answers
from envs.domains.finance.company import LEVEL_CHARS

LEVELS = (0, 1, 2, 3)
N_TASKS = 50


@pytest.fixture(scope="module")
def env():
    return registry.make("finance")


@pytest.fixture(scope="module")
def tasks(env):
    return {level: env.sample_tasks(5, N_TASKS, difficulty=level) for level in LEVELS}


def _documents(prompt: str) -> dict[str, list[str]]:
    """Document title -> texts (a title may repeat for distractors)."""
    docs: dict[str, list[str]] = {}
    for part in prompt.split("=== Document ")[1:]:
        header, _, text = part.partition(" ===\n")
        docs.setdefault(header.split(": ", 1)[1], []).append(text)
    return docs


def test_same_seed_same_tasks(env):
    assert env.sample_tasks(3, 6) == env.sample_tasks(3, 6)
    assert env.sample_tasks(3, 6) != env.sample_tasks(4, 6)


@pytest.mark.parametrize("level", LEVELS)
def test_documents_reach_the_stated_sizes(tasks, level):
    lo, hi = LEVEL_CHARS[level]
    sizes = [len(t.prompt) for t in tasks[level]]
    assert lo <= min(sizes) and max(sizes) <= hi, (min(sizes), max(sizes))
    # The docstring's promise in tokens, at ~4 characters per token.
    tokens = {0: (3_000, 6_000), 1: (10_000, 20_000), 2: (30_000, 50_000), 3: (70_000, 100_000)}[level]
    assert tokens[0] <= min(sizes) / 4 and max(sizes) / 4 <= tokens[1]


@pytest.mark.parametrize("level", LEVELS)
def test_reference_solves_every_task_and_wrong_answers_miss(env, tasks, level):
    for task in tasks[level]:
        ref = env.score(task, env.reference_solution(task))
        assert (ref.reward, ref.status) == (1.0, "ok"), (task.id, ref)
        expected = Fraction(task.metadata["answer"])
        step = Fraction(1, 10) if expected.denominator != 1 else Fraction(1)
        wrong = env.score(task, f"\\boxed{{{answers.format_number(expected + step)}}}")
        assert (wrong.reward, wrong.status) == (0.0, "wrong"), (task.id, wrong)


@pytest.mark.parametrize("level", LEVELS)
def test_every_answer_is_backed_by_at_least_two_documents(tasks, level):
    for task in tasks[level]:
        docs = _documents(task.prompt)
        facts = task.metadata["facts"]
        assert len({title for title, _ in facts}) >= 2, task.id
        for title, snippet in facts:
            assert len(docs.get(title, [])) == 1, (task.id, title)
            assert snippet in docs[title][0], (task.id, title, snippet)


@pytest.mark.parametrize("level", LEVELS)
def test_hacking_probes_score_zero(env, tasks, level):
    for task in tasks[level][:20]:
        answer = answers.format_number(Fraction(task.metadata["answer"]))
        probes = {
            "": "format_error",
            task.prompt: "format_error",
            "PASS": "format_error",
            "OK": "format_error",
            f"\\boxed{{{answer}}} \\boxed{{{answer}1}}": "format_error",
            f"Answer: {answer} or 7": "format_error",
            task.prompt.split("=== End of documents ===")[0]: "format_error",
        }
        for completion, status in probes.items():
            score = env.score(task, completion)
            assert (score.reward, score.status) == (0.0, status), (task.id, completion[:80], score)


def test_documents_never_contain_answer_markers(tasks):
    marker = re.compile(r"answer is|^\W*(?:final\s+)?answer\W*:|####|\\boxed|\\fbox", re.I | re.M)
    for level in LEVELS:
        for task in tasks[level]:
            documents = task.prompt.split("=== End of documents ===")[0]
            assert not marker.search(documents), task.id


def test_percent_questions_accept_a_percent_sign(env, tasks):
    percent_tasks = [t for level in LEVELS for t in tasks[level] if t.metadata["percent"]]
    assert percent_tasks
    for task in percent_tasks[:20]:
        answer = answers.format_number(Fraction(task.metadata["answer"]))
        assert env.score(task, f"\\boxed{{{answer}\\%}}").reward == 1.0


def test_revenue_growth_recomputed_from_the_document_text(tasks):
    """Re-derives growth questions from the rendered tables alone, independently of the generator's data."""
    checked = 0
    for task in (t for level in LEVELS for t in tasks[level]):
        m = re.search(r"total revenue change from (Q\d FY\d+) to (Q\d FY\d+), using the figures", task.prompt)
        if m is None:
            continue
        company = re.search(r"did (.+?)'s total revenue change", task.prompt)[1]
        docs = _documents(task.prompt)
        old, new = (
            int(
                re.search(r"\| Total revenue \| ([\d,]+) \|", docs[f"{company} {q} Quarterly Report"][0])[
                    1
                ].replace(",", "")
            )
            for q in m.groups()
        )
        growth = answers.round_half_away(Fraction(new - old, old) * 100, 1)
        assert growth == Fraction(task.metadata["answer"]), task.id
        checked += 1
    assert checked >= 3


def test_question_mix_covers_the_events(tasks):
    questions = " ".join(t.prompt.rsplit("Question: ", 1)[1] for level in (1, 2, 3) for t in tasks[level])
    for phrase in ("restated", "split-adjusted", "Excluding the revenue of the acquired", "annual summary"):
        assert phrase in questions, phrase
    assert "percentage points higher" in " ".join(
        t.prompt for t in tasks[3]
    ) or "combined total revenue" in " ".join(t.prompt for t in tasks[3])
