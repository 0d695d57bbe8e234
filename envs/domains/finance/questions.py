"""The questions of domain `finance`: each needs numbers from at least two documents, cites the exact text
that states each number, and carries its exact `Fraction` answer and worked steps."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from fractions import Fraction

from envs.domains import answers
from envs.domains.finance.company import Company, _fixed, _n
from envs.domains.finance.documents import _segment_rows, income_rows


@dataclasses.dataclass
class Question:
    text: str
    answer: Fraction = Fraction(0)
    percent: bool = False
    steps: list[str] = dataclasses.field(default_factory=list)
    facts: list[list[str]] = dataclasses.field(default_factory=list)  # [document title, text stating it]

    def cite(self, title: str, label: str, value: int, snippet: str | None = None) -> int:
        """Records that document `title` states `label` = `value` (in `snippet`, by default a table row)."""
        self.facts.append([title, snippet or f"| {label} | {_n(value)} |"])
        self.steps.append(f"{title}: {label} = {_n(value)}")
        return value

    def row(self, company: Company, q: int, label: str) -> int:
        """A first-column value of report `q`'s statement of operations or segment table."""
        rows = income_rows(company, q) + _segment_rows(company, q)
        value = int(next(cells[1] for cells in rows if cells[0] == label).replace(",", ""))
        return self.cite(company.report_title(q), label, value)

    def finish(self, exact: Fraction, places: int | None, percent: bool = False) -> Question:
        self.percent = percent
        self.answer = exact if places is None else answers.round_half_away(exact, places)
        if places is not None:
            self.steps.append(f"Exact value {answers.format_number(exact)}; rounded: {_fixed(exact, places)}")
        return self


_PCT = "Give the percentage rounded to one decimal place (a % sign is optional)."
_THOUSANDS = "Give the amount in thousands of US dollars."


def _percent_change(q: Question, old: int | Fraction, new: int | Fraction) -> Question:
    change = Fraction(new - old) * 100 / old
    q.steps.append(f"Change: ({_n_any(new)} - {_n_any(old)}) / {_n_any(old)} * 100")
    return q.finish(change, 1, percent=True)


def _n_any(value: int | Fraction) -> str:
    return answers.format_number(Fraction(value))


def _two_quarters(rng: random.Random, c: Company) -> tuple[int, int]:
    a, b = sorted(rng.sample(range(len(c.quarters)), 2))
    return a, b


def revenue_growth(rng: random.Random, c: Company) -> Question:
    a, b = _two_quarters(rng, c)
    q = Question(
        f"By what percentage did {c.name}'s total revenue change from {c.label(a)} to {c.label(b)}, using "
        f"the figures as first reported in those two quarterly reports? {_PCT}"
    )
    return _percent_change(q, q.row(c, a, "Total revenue"), q.row(c, b, "Total revenue"))


def combined_gross_margin(rng: random.Random, c: Company) -> Question:
    a, b = _two_quarters(rng, c)
    q = Question(
        f"What was {c.name}'s gross margin (gross profit divided by total revenue) for {c.label(a)} and "
        f"{c.label(b)} combined, using the figures as first reported in the two quarterly reports? {_PCT}"
    )
    profit = q.row(c, a, "Gross profit") + q.row(c, b, "Gross profit")
    revenue = q.row(c, a, "Total revenue") + q.row(c, b, "Total revenue")
    q.steps.append(f"Margin: {_n(profit)} / {_n(revenue)} * 100")
    return q.finish(Fraction(profit * 100, revenue), 1, percent=True)


def segment_total(rng: random.Random, c: Company) -> Question:
    quarters = sorted(rng.sample(range(len(c.quarters)), rng.randint(2, len(c.quarters))))
    segment = rng.choice(sorted(set.intersection(*(set(c.quarters[x].segments) for x in quarters))))
    names = ", ".join(c.label(x) for x in quarters)
    q = Question(
        f"What was the total revenue of {c.name}'s {segment} segment over {names} together, as first "
        f"reported in the quarterly reports? {_THOUSANDS}"
    )
    total = sum(q.row(c, x, segment) for x in quarters)
    q.steps.append(f"Sum: {_n(total)}")
    return q.finish(Fraction(total), None)


def line_change(rng: random.Random, c: Company) -> Question:
    a, b = _two_quarters(rng, c)
    label = rng.choice(("Net income", "Operating income", "Total operating expenses", "Cost of revenue"))
    q = Question(
        f"By how much did {c.name}'s {label.lower()} change from {c.label(a)} to {c.label(b)} "
        f"({c.label(b)} minus {c.label(a)}), as first reported in the quarterly reports? {_THOUSANDS}"
    )
    diff = q.row(c, b, label) - q.row(c, a, label)
    q.steps.append(f"Difference: {_n(diff)}")
    return q.finish(Fraction(diff), None)


def _restated(q: Question, c: Company) -> tuple[int, int]:
    r, segment, amount = c.restatement
    snippet = f"Revenue for {c.label(r)} was overstated by {_n(amount)} thousand"
    q.cite(f"{c.name} restatement notice", f"{c.label(r)} revenue overstatement", amount, snippet)
    return r, amount


def restated_net_margin(rng: random.Random, c: Company) -> Question:
    r = c.restatement[0]
    q = Question(
        f"{c.name} later restated its {c.label(r)} results. What is {c.label(r)}'s net margin (net income "
        f"divided by total revenue) after the restatement? {_PCT}"
    )
    income, revenue = q.row(c, r, "Net income"), q.row(c, r, "Total revenue")
    _, amount = _restated(q, c)
    q.steps.append(f"Restated margin: ({_n(income)} - {_n(amount)}) / ({_n(revenue)} - {_n(amount)}) * 100")
    return q.finish(Fraction((income - amount) * 100, revenue - amount), 1, percent=True)


def restated_growth(rng: random.Random, c: Company) -> Question:
    r = c.restatement[0]
    q = Question(
        f"Using {c.name}'s restated total revenue for {c.label(r)} and the total revenue first reported "
        f"for {c.label(r + 1)}, by what percentage did revenue change from {c.label(r)} to {c.label(r + 1)}? "
        f"{_PCT}"
    )
    old = q.row(c, r, "Total revenue")
    _, amount = _restated(q, c)
    q.steps.append(f"Restated {c.label(r)} revenue: {_n(old)} - {_n(amount)} = {_n(old - amount)}")
    return _percent_change(q, old - amount, q.row(c, r + 1, "Total revenue"))


def _split_ratio(q: Question, c: Company) -> int:
    ratio = c.split[1]
    return q.cite(f"{c.name} announces stock split", "split ratio", ratio, f"{ratio}-for-1 stock split")


def split_adjusted_eps(rng: random.Random, c: Company) -> Question:
    a = rng.randrange(c.split[0])
    q = Question(
        f"What was {c.name}'s diluted earnings per share for {c.label(a)} on a basis adjusted for the later "
        "stock split, computed as net income divided by the split-adjusted diluted share count? Give US "
        "dollars rounded to two decimal places."
    )
    income, shares = q.row(c, a, "Net income"), q.row(c, a, "Diluted shares outstanding (thousands)")
    ratio = _split_ratio(q, c)
    q.steps.append(f"EPS: {_n(income)} / ({_n(shares)} * {ratio})")
    return q.finish(Fraction(income, shares * ratio), 2)


def split_adjusted_shares(rng: random.Random, c: Company) -> Question:
    a, b = rng.randrange(c.split[0]), rng.randrange(c.split[0], len(c.quarters))
    q = Question(
        f"On a split-adjusted basis, by what percentage did {c.name}'s diluted shares outstanding change "
        f"from {c.label(a)} to {c.label(b)}? {_PCT}"
    )
    label = "Diluted shares outstanding (thousands)"
    old = q.row(c, a, label)
    ratio = _split_ratio(q, c)
    q.steps.append(f"Split-adjusted {c.label(a)} shares: {_n(old)} * {ratio} = {_n(old * ratio)}")
    return _percent_change(q, old * ratio, q.row(c, b, label))


def organic_growth(rng: random.Random, c: Company) -> Question:
    acq, target, _ = c.acquisition
    q = Question(
        f"Excluding the revenue of the acquired {target} business, by what percentage did {c.name}'s total "
        f"revenue change from {c.label(acq - 1)} to {c.label(acq)}, as first reported? {_PCT}"
    )
    q.cite(f"{c.name} completes acquisition", "acquired segment", 0, f'as a separate segment, "{target}"')
    q.steps[-1] = f"{c.name} completes acquisition: {target} is reported as its own segment"
    old, new, acquired = (
        q.row(c, acq - 1, "Total revenue"),
        q.row(c, acq, "Total revenue"),
        q.row(c, acq, target),
    )
    q.steps.append(f"Organic {c.label(acq)} revenue: {_n(new)} - {_n(acquired)} = {_n(new - acquired)}")
    return _percent_change(q, old, new - acquired)


def summary_gap(rng: random.Random, c: Company) -> Question:
    x = rng.choice([c.summary_gap[0], c.summary_gap[0], c.restatement[0] if c.restatement else 0])
    q = Question(
        f"By how much does the total revenue for {c.label(x)} in {c.name}'s FY{c.year} annual summary differ "
        f"from the figure in the {c.label(x)} quarterly report? Give the annual summary figure minus the "
        f"quarterly report figure. {_THOUSANDS}"
    )
    summary = q.cite(
        f"{c.name} FY{c.year} annual summary",
        f"{c.label(x)} total revenue",
        c.summary_revenue(x),
        f"| {c.label(x)} | {_n(c.summary_revenue(x))} |",
    )
    report = q.row(c, x, "Total revenue")
    q.steps.append(f"Difference: {_n(summary)} - {_n(report)} = {_n(summary - report)}")
    return q.finish(Fraction(summary - report), None)


def annual_net_income(rng: random.Random, c: Company) -> Question:
    q = Question(
        f"What was {c.name}'s total net income for fiscal year {c.year} (all four quarters), taking the "
        f"announced restatement into account? {_THOUSANDS}"
    )
    total = sum(q.row(c, x, "Net income") for x in range(len(c.quarters)))
    _, amount = _restated(q, c)
    q.steps.append(f"Total: {_n(total)} - {_n(amount)} = {_n(total - amount)}")
    return q.finish(Fraction(total - amount), None)


def operating_margin_gap(rng: random.Random, first: Company, second: Company) -> Question:
    x = rng.randrange(len(first.quarters))
    q = Question(
        f"In {first.label(x)}, how many percentage points higher was {first.name}'s operating margin "
        f"(operating income divided by total revenue) than {second.name}'s, using the figures as first "
        f"reported? Give {first.name}'s margin minus {second.name}'s (negative if lower), in percentage "
        "points rounded to one decimal place."
    )
    margins = []
    for c in (first, second):
        income, revenue = q.row(c, x, "Operating income"), q.row(c, x, "Total revenue")
        margins.append(Fraction(income * 100, revenue))
        q.steps.append(f"{c.name}: {_n(income)} / {_n(revenue)} * 100")
    return q.finish(margins[0] - margins[1], 1, percent=True)


def combined_revenue(rng: random.Random, first: Company, second: Company) -> Question:
    a, b = _two_quarters(rng, first)
    q = Question(
        f"What was the combined total revenue of {first.name} and {second.name} in {first.label(a)} and "
        f"{first.label(b)} (four figures in all), as first reported in their quarterly reports? {_THOUSANDS}"
    )
    total = sum(q.row(c, x, "Total revenue") for c in (first, second) for x in (a, b))
    q.steps.append(f"Sum: {_n(total)}")
    return q.finish(Fraction(total), None)


Single = Callable[[random.Random, Company], Question]
_BASIC: tuple[Single, ...] = (revenue_growth, combined_gross_margin, segment_total, line_change)
_EVENT_KINDS: dict[str, tuple[Single, ...]] = {
    "restatement": (restated_net_margin, restated_growth),
    "split": (split_adjusted_eps, split_adjusted_shares),
    "acquisition": (organic_growth,),
    "summary": (summary_gap, annual_net_income),
}


def _events(rng: random.Random, level: int) -> set[str]:
    if level == 1:
        return {rng.choice(("restatement", "split", "acquisition"))}
    return set(_EVENT_KINDS) if level >= 2 else set()


def _question(rng: random.Random, companies: list[Company], events: set[str]) -> Question:
    """Cross-company half the time when there are two companies; else mostly about an announced event."""
    if len(companies) > 1 and rng.random() < 0.5:
        return rng.choice((operating_margin_gap, combined_revenue))(rng, *rng.sample(companies, 2))
    kinds = [k for e in sorted(events) for k in _EVENT_KINDS[e]] if events and rng.random() < 0.7 else []
    return rng.choice(kinds or list(_BASIC))(rng, rng.choice(companies))
