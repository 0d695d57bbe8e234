"""The `finance` domain: long synthetic filings for fictional companies, questions across several documents.

Each task is a stack of documents for one fiscal year: quarterly reports (statement of operations with a
prior-year column, segment and regional revenue, balance sheet and cash flow highlights, commentary),
announcements (a stock split, an acquisition that adds a segment, a restatement of one quarter's revenue) and
an annual summary that disagrees with one quarterly report; distractor documents (product news, analyst
calls, sustainability notes, other companies' results) pad the stack to the level's size. Sizes, at about
four characters per token (`LEVEL_CHARS`):

- 0: one company, two quarterly reports, no events: 3k-6k tokens;
- 1: one company, four quarterly reports, one announcement: 10k-20k tokens;
- 2: one company, four reports, split, acquisition, restatement and the annual summary: 30k-50k tokens;
- 3: two companies, each with all of level 2, and cross-company questions: 70k-100k tokens.

Questions need numbers from at least two documents (growth between quarters, combined margins, sums over
quarters, restated margins, split-adjusted EPS, organic growth, summary-vs-report gaps). Answers are exact
`Fraction`s: amounts are integers (thousands of dollars), percentages and EPS are rounded as the question
says, halves away from zero, and compared exactly. Metadata carries the answer, the worked steps and the
facts used (document title and the exact text that states each number) so the tests can check the
documents really support every answer.
"""

from __future__ import annotations

import random
from fractions import Fraction

from envs.base import Score, SingleTurnEnvironment, Task
from envs.domains import answers
from envs.domains.finance.company import (
    _PREFIXES,
    _SUFFIXES,
    _TARGETS,
    INSTRUCTION,
    LEVEL_CHARS,
    _make_company,
)
from envs.domains.finance.documents import _interleave, _pad, core_documents, render_documents
from envs.domains.finance.questions import _events, _question


def generate_task(seed: int, index: int, level: int) -> Task:
    """Task `index` of `seed` at `level`: the same arguments always give the same task."""
    rng = random.Random(f"finance:{seed}:{index}:{level}")
    year = rng.randint(2030, 2039)
    n_quarters = 2 if level == 0 else 4
    events = _events(rng, level)
    n_companies = 2 if level == 3 else 1
    companies = [
        _make_company(rng, f"{prefix} {rng.choice(_SUFFIXES)}", year, n_quarters, events, target)
        for prefix, target in zip(rng.sample(_PREFIXES, n_companies), rng.sample(_TARGETS, n_companies))
    ]
    docs = _interleave(rng, [core_documents(rng, c, level) for c in companies])
    lo, hi = LEVEL_CHARS[level]
    _pad(rng, docs, companies, rng.randint(lo + 2_000, hi - 8_000))
    question = _question(rng, companies, events)
    prompt = (
        f"Read the {len(docs)} documents below about {' and '.join(c.name for c in companies)}; a question "
        f"follows them.\n\n{render_documents(docs)}\n\nQuestion: {question.text}\n\n{INSTRUCTION}"
    )
    metadata = {
        "answer": str(question.answer),
        "percent": question.percent,
        "steps": question.steps,
        "facts": question.facts,
        "chars": len(prompt),
    }
    return Task(f"finance/{seed}/{index}/L{level}", "finance", prompt, metadata, level)


class FinanceEnvironment(SingleTurnEnvironment):
    """Questions over long synthetic financial filings; exact numeric answers (see the module docstring)."""

    name = "finance"
    levels = (0, 1, 2, 3)
    level_seed = "finance-levels"

    task_at = staticmethod(generate_task)

    def reference_solution(self, task: Task) -> str:
        steps = "\n".join(task.metadata["steps"])
        answer = answers.format_number(Fraction(task.metadata["answer"]))
        return f"{steps}\n\nThe final answer is \\boxed{{{answer}}}."

    def score(self, task: Task, completion: str) -> Score:
        expected = Fraction(task.metadata["answer"])
        return answers.graded_score(completion, expected, percent=bool(task.metadata.get("percent")))
