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

import dataclasses
import random
from collections.abc import Callable
from fractions import Fraction

from envs.base import Score, SingleTurnEnvironment, Task
from envs.domains import answers

LEVEL_CHARS = {0: (12_000, 24_000), 1: (40_000, 80_000), 2: (120_000, 200_000), 3: (280_000, 400_000)}
_COMMENTARY_PARAGRAPHS = {0: 1, 1: 3, 2: 5, 3: 5}
_QUARTER_END = ("March 31", "June 30", "September 30", "December 31")
_ORDINAL = ("first", "second", "third", "fourth")
_PREFIXES = ("Northwind", "Bluefin", "Cobalt", "Meridian", "Stonebridge", "Aurora", "Kestrel", "Lumen")
_PREFIXES_OTHER = ("Harborview", "Quayside", "Redwood", "Solace", "Tidewater", "Vantage", "Zephyr", "Orchid")
_SUFFIXES = ("Analytics Corp.", "Industries Inc.", "Systems plc", "Holdings Ltd.", "Technologies Inc.")
_SEGMENTS = (
    "Cloud Services",
    "Enterprise Software",
    "Hardware",
    "Consulting",
    "Payments",
    "Advertising",
    "Consumer Devices",
    "Industrial Sensors",
    "Logistics",
    "Licensing",
)
_TARGETS = ("Fjordline Robotics", "Saltmarsh Biotech", "Greywater Media", "Tallpine Security", "Emberly Labs")
_REGIONS = ("North America", "Europe", "Asia Pacific", "Latin America")
INSTRUCTION = (
    "Use exact arithmetic and round only the final result, as the question says (halves away from zero). "
    "End your response with the final answer as a single number in \\boxed{}."
)


def _n(value: int) -> str:
    return f"{value:,}"


def _fixed(value: Fraction, places: int) -> str:
    """`value` rounded to `places` decimals and printed with exactly that many."""
    scaled = int(abs(answers.round_half_away(value, places)) * 10**places)
    sign = "-" if value < 0 and scaled else ""
    whole, frac = divmod(scaled, 10**places)
    return f"{sign}{whole:,}.{frac:0{places}d}" if places else f"{sign}{whole:,}"


# ---- The data ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Quarter:
    """One quarter as first reported; amounts in thousands of dollars, `shares` in thousands, pre-split."""

    segments: dict[str, int]
    cogs: int
    rnd: int
    sga: int
    interest: int
    tax: int
    shares: int

    @property
    def revenue(self) -> int:
        return sum(self.segments.values())

    @property
    def operating_income(self) -> int:
        return self.revenue - self.cogs - self.rnd - self.sga

    @property
    def net_income(self) -> int:
        return self.operating_income - self.interest - self.tax


@dataclasses.dataclass
class Company:
    name: str
    ticker: str
    year: int
    quarters: list[Quarter]
    prior: list[Quarter]  # the same quarters a year earlier: the reports' comparative column
    split: tuple[int, int] | None = None  # (first quarter on the new basis, ratio)
    acquisition: tuple[int, str, int] | None = None  # (first quarter consolidated, segment, price in $M)
    restatement: tuple[int, str, int] | None = None  # (quarter, segment, revenue overstated by)
    summary_gap: tuple[int, int] | None = None  # (quarter, annual summary minus quarterly report)

    def label(self, q: int) -> str:
        return f"Q{q + 1} FY{self.year}"

    def report_title(self, q: int) -> str:
        return f"{self.name} {self.label(q)} Quarterly Report"

    def reported_shares(self, q: int) -> int:
        split_q, ratio = self.split or (len(self.quarters), 1)
        return self.quarters[q].shares * (ratio if q >= split_q else 1)

    def summary_revenue(self, q: int) -> int:
        value = self.quarters[q].revenue
        if self.restatement and self.restatement[0] == q:
            value -= self.restatement[2]
        if self.summary_gap and self.summary_gap[0] == q:
            value += self.summary_gap[1]
        return value


def _make_quarter(rng: random.Random, segments: dict[str, int], shares: int) -> Quarter:
    revenue = sum(segments.values())
    cogs = revenue * rng.randint(350, 550) // 1000
    rnd, sga = revenue * rng.randint(60, 140) // 1000, revenue * rng.randint(80, 160) // 1000
    interest = revenue * rng.randint(2, 10) // 1000 + rng.randint(50, 400)
    pretax = revenue - cogs - rnd - sga - interest
    return Quarter(segments, cogs, rnd, sga, interest, pretax * rng.randint(150, 250) // 1000, shares)


def _grow(rng: random.Random, value: int) -> int:
    return value * rng.randint(940, 1120) // 1000


def _make_company(
    rng: random.Random, name: str, year: int, n_quarters: int, events: set[str], target: str
) -> Company:
    segment_names = rng.sample(_SEGMENTS, rng.randint(2, 4))
    seg = {s: rng.randint(20_000, 300_000) for s in segment_names}
    shares = rng.randint(40_000, 400_000)
    acq_q = rng.randint(1, n_quarters - 1) if "acquisition" in events else None
    quarters, prior = [], []
    for q in range(n_quarters):
        seg = {s: _grow(rng, v) for s, v in seg.items()}
        if q == acq_q:
            seg[target] = rng.randint(8_000, 60_000)
        shares = shares * rng.randint(990, 1012) // 1000
        quarters.append(_make_quarter(rng, dict(seg), shares))
        old = {s: v * rng.randint(820, 990) // 1000 for s, v in seg.items() if s != target}
        prior.append(_make_quarter(rng, old, shares * rng.randint(990, 1030) // 1000))
    company = Company(name, name[:4].upper(), year, quarters, prior)
    if "split" in events:
        company.split = (rng.randint(1, n_quarters - 1), rng.choice((2, 3, 4, 5)))
    if acq_q is not None:
        company.acquisition = (acq_q, target, rng.randint(80, 900))
    if "restatement" in events:
        q = rng.randint(0, n_quarters - 2)
        segment = rng.choice(segment_names)
        company.restatement = (q, segment, quarters[q].segments[segment] * rng.randint(2, 8) // 100)
    if "summary" in events:
        choices = [q for q in range(n_quarters) if not company.restatement or q != company.restatement[0]]
        company.summary_gap = (rng.choice(choices), rng.choice((-1, 1)) * rng.randint(100, 5_000))
    return company


# ---- Documents ---------------------------------------------------------------------------------------------

_SENTENCES = (
    "{co} opened a new distribution centre in {city}, adding {k} employees to its regional workforce.",
    "The {product} platform now serves {n} active business customers across {k} countries.",
    "Management reiterated its commitment to disciplined capital allocation and long-term value creation.",
    "Customer satisfaction scores in {region} improved for the {ordinal} consecutive survey period.",
    "The company filed {k} new patent applications related to {product} during the period.",
    "Average order processing time fell to {k} hours after the upgrade of the {city} facility.",
    "{co} signed a multi-year supply agreement with a partner headquartered in {city}.",
    "Employees contributed {n} volunteer hours to community programs in {region}.",
    "Energy use per unit of output declined by {k} percent compared with the prior period.",
    "The board met {k} times during the period and reviewed the enterprise risk register.",
    "Backlog for {product} deliveries covered roughly {k} weeks of expected shipments.",
    "Competition in {region} intensified as new entrants priced aggressively in the mid-market segment.",
    "Supply chain constraints eased, although lead times for certain components remained above {k} weeks.",
    "The {product} beta attracted {n} sign-ups in its first month, ahead of internal planning assumptions.",
    "A cybersecurity review by an outside firm found no material weaknesses in the {city} data centre.",
    "Foreign exchange movements in {region} remained a modest headwind to reported results.",
    "{co} completed the migration of {k} legacy applications to its new enterprise resource system.",
    "Warranty claims for {product} units stayed below {k} per thousand units shipped.",
    "Training hours per employee rose to {k}, reflecting expanded leadership development programs.",
    "Inventory turns improved as the {city} warehouse adopted automated picking for {n} product lines.",
)
_PRODUCTS = ("Atlas", "Beacon", "Cirrus", "Delta One", "Evergreen", "Falcon", "Granite", "Helix", "Ion")
_CITIES = ("Rotterdam", "Austin", "Osaka", "Lyon", "Denver", "Gdansk", "Pune", "Monterrey", "Leeds")


def _paragraph(rng: random.Random, co: str, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        out.append(
            rng.choice(_SENTENCES).format(
                co=co,
                city=rng.choice(_CITIES),
                region=rng.choice(_REGIONS),
                product=rng.choice(_PRODUCTS),
                ordinal=rng.choice(_ORDINAL),
                n=_n(rng.randint(100, 90_000)),
                k=rng.randint(2, 40),
            )
        )
    return " ".join(out)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, *rows])


def income_rows(company: Company, q: int) -> list[tuple[str, str, str]]:
    """(label, this quarter, same quarter a year earlier) of report `q`'s statement of operations."""
    cur, old = company.quarters[q], company.prior[q]
    split_q, ratio = company.split or (len(company.quarters), 1)
    old_shares = old.shares * (ratio if q >= split_q else 1)
    eps = [Fraction(x.net_income, s) for x, s in ((cur, company.reported_shares(q)), (old, old_shares))]
    pairs = (
        ("Total revenue", cur.revenue, old.revenue),
        ("Cost of revenue", cur.cogs, old.cogs),
        ("Gross profit", cur.revenue - cur.cogs, old.revenue - old.cogs),
        ("Research and development", cur.rnd, old.rnd),
        ("Selling, general and administrative", cur.sga, old.sga),
        ("Total operating expenses", cur.rnd + cur.sga, old.rnd + old.sga),
        ("Operating income", cur.operating_income, old.operating_income),
        ("Interest expense", cur.interest, old.interest),
        ("Income tax expense", cur.tax, old.tax),
        ("Net income", cur.net_income, old.net_income),
        ("Diluted shares outstanding (thousands)", company.reported_shares(q), old_shares),
    )
    rows = [(label, _n(a), _n(b)) for label, a, b in pairs]
    rows.append(("Diluted earnings per share (dollars)", _fixed(eps[0], 2), _fixed(eps[1], 2)))
    return rows


def _segment_rows(company: Company, q: int) -> list[tuple[str, str, str]]:
    old = company.prior[q].segments
    return [(s, _n(v), _n(old[s]) if s in old else "n/a") for s, v in company.quarters[q].segments.items()]


def _split_parts(rng: random.Random, total: int, parts: int) -> list[int]:
    """`total` in `parts` integer shares of comparable size that add up exactly."""
    weights = [rng.randint(10, 40) for _ in range(parts)]
    shares = [total * w // sum(weights) for w in weights[:-1]]
    return [*shares, total - sum(shares)]


def quarterly_report(rng: random.Random, company: Company, q: int, level: int) -> str:
    cur, label, prior_label = company.quarters[q], company.label(q), f"Q{q + 1} FY{company.year - 1}"
    regions = _split_parts(rng, cur.revenue, len(_REGIONS))
    cash, capex, ocf = rng.randint(20_000, 900_000), rng.randint(2_000, 60_000), rng.randint(5_000, 120_000)
    parts = [
        f"{company.name} ({company.ticker}) reported results for the {_ORDINAL[q]} quarter of fiscal year "
        f"{company.year}, the three months ended {_QUARTER_END[q]}, {company.year}. Amounts are in thousands "
        "of US dollars except per-share data.",
        "Consolidated statement of operations",
        _table(("Line item", label, prior_label), income_rows(company, q)),
        "Revenue by segment",
        _table(("Segment", label, prior_label), _segment_rows(company, q)),
        "Revenue by region (unaudited)",
        _table(("Region", label), [(r, _n(v)) for r, v in zip(_REGIONS, regions)]),
        "Balance sheet and cash flow highlights",
        _table(
            ("Item", label),
            [
                ("Cash and equivalents", _n(cash)),
                ("Accounts receivable", _n(rng.randint(10_000, 300_000))),
                ("Operating cash flow", _n(ocf)),
                ("Capital expenditure", _n(capex)),
                ("Free cash flow", _n(ocf - capex)),
                ("Headcount (employees)", _n(rng.randint(800, 60_000))),
            ],
        ),
        "Management commentary",
    ]
    if company.split and q >= company.split[0]:
        parts.append(f"Share counts and per-share amounts reflect the {company.split[1]}-for-1 stock split.")
    parts += [_paragraph(rng, company.name, rng.randint(5, 9)) for _ in range(_COMMENTARY_PARAGRAPHS[level])]
    return "\n\n".join(parts)


def split_notice(company: Company) -> str:
    q, ratio = company.split
    return (
        f"The board of directors of {company.name} approved a {ratio}-for-1 stock split of its common "
        f"shares, effective at the start of {company.label(q)}. Each shareholder receives {ratio - 1} "
        "additional share(s) for every share held. Share counts and per-share amounts reported for "
        f"{company.label(q)} and later periods are on the post-split basis; earlier reports are not revised."
    )


def acquisition_notice(company: Company) -> str:
    q, target, price = company.acquisition
    return (
        f"{company.name} completed its acquisition of {target} for {price} million US dollars in cash, "
        f"effective at the start of {company.label(q)}. From {company.label(q)} onward {target} is reported "
        f'as a separate segment, "{target}". {target} had no revenue in {company.name}\'s earlier results.'
    )


def restatement_notice(company: Company) -> str:
    q, segment, amount = company.restatement
    return (
        f"{company.name} has identified an error in the timing of revenue recognition in its {segment} "
        f"segment. Revenue for {company.label(q)} was overstated by {_n(amount)} thousand US dollars. "
        "The correction reduces that quarter's total revenue, gross profit, operating income and net "
        "income by the same amount; it has no tax effect and no other quarter is affected. The original "
        "quarterly report is not reissued."
    )


def annual_summary(rng: random.Random, company: Company) -> str:
    rows = [(company.label(q), _n(company.summary_revenue(q))) for q in range(len(company.quarters))]
    return "\n\n".join(
        [
            f"This summary presents {company.name}'s total revenue by quarter for fiscal year {company.year} "
            "(thousands of US dollars), reflecting any restatements announced during the year.",
            _table(("Quarter", "Total revenue"), rows),
            _paragraph(rng, company.name, 6),
        ]
    )


def _distractor(rng: random.Random, companies: list[Company]) -> tuple[str, str]:
    co = rng.choice(companies).name
    kind = rng.randrange(4)
    if kind == 0:
        product = rng.choice(_PRODUCTS)
        return f"{co} press release: {product} launch", _paragraph(rng, co, rng.randint(12, 30))
    if kind == 1:
        lines = []
        for _ in range(rng.randint(4, 9)):
            lines.append(f"Analyst: {_paragraph(rng, co, 1)} Could you comment on that?")
            lines.append(f"Chief Financial Officer: {_paragraph(rng, co, rng.randint(2, 4))}")
        return f"{co} investor call excerpt", "\n\n".join(lines)
    if kind == 2:
        return f"{co} sustainability update", _paragraph(rng, co, rng.randint(12, 30))
    other = f"{rng.choice(_PREFIXES_OTHER)} {rng.choice(_SUFFIXES)}"
    rows = [(s, _n(rng.randint(10_000, 400_000))) for s in rng.sample(_SEGMENTS, 3)]
    text = "\n\n".join(
        [
            f"Industry newsletter. {other}, which is not affiliated with {co}, posted quarterly segment "
            "revenue as follows (thousands of US dollars).",
            _table(("Segment", "Revenue"), rows),
            _paragraph(rng, other, rng.randint(8, 20)),
        ]
    )
    return f"Industry newsletter: {other}", text


def core_documents(rng: random.Random, company: Company, level: int) -> list[tuple[str, str]]:
    """The company's reports and announcements in publication order, as (title, text)."""
    docs = []
    for q in range(len(company.quarters)):
        if company.split and company.split[0] == q:
            docs.append((f"{company.name} announces stock split", split_notice(company)))
        if company.acquisition and company.acquisition[0] == q:
            docs.append((f"{company.name} completes acquisition", acquisition_notice(company)))
        docs.append((company.report_title(q), quarterly_report(rng, company, q, level)))
        if company.restatement and company.restatement[0] == q - 1:
            docs.append((f"{company.name} restatement notice", restatement_notice(company)))
    if company.summary_gap:
        docs.append((f"{company.name} FY{company.year} annual summary", annual_summary(rng, company)))
    return docs


def _interleave(rng: random.Random, streams: list[list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """Merges the companies' document streams at random, keeping each stream in publication order."""
    streams = [list(reversed(s)) for s in streams]
    merged = []
    while any(streams):
        merged.append(rng.choice([s for s in streams if s]).pop())
    return merged


def _pad(rng: random.Random, docs: list[tuple[str, str]], companies: list[Company], target: int) -> None:
    """Inserts distractor documents at random places until the stack reaches `target` characters."""
    size = sum(len(title) + len(text) + 40 for title, text in docs)
    while size < target:
        title, text = _distractor(rng, companies)
        if size + len(text) > target + 6_000:
            text = text[: max(200, target - size)].rsplit(" ", 1)[0] + "."
        docs.insert(rng.randint(0, len(docs)), (title, text))
        size += len(title) + len(text) + 40


def render_documents(docs: list[tuple[str, str]]) -> str:
    body = [f"=== Document {i}: {title} ===\n{text}" for i, (title, text) in enumerate(docs, start=1)]
    return "\n\n".join(body) + "\n\n=== End of documents ==="


# ---- Questions ---------------------------------------------------------------------------------------------


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


# ---- The environment ---------------------------------------------------------------------------------------


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

    def sample_tasks(self, seed: int, n: int, *, difficulty: int | None = None) -> list[Task]:
        if difficulty is not None and difficulty not in self.levels:
            raise ValueError(f"finance: difficulty {difficulty} not in {self.levels}")
        level_rng = random.Random(f"finance-levels:{seed}")
        chosen = [difficulty if difficulty is not None else level_rng.choice(self.levels) for _ in range(n)]
        return [generate_task(seed, i, level) for i, level in enumerate(chosen)]

    def reference_solution(self, task: Task) -> str:
        steps = "\n".join(task.metadata["steps"])
        answer = answers.format_number(Fraction(task.metadata["answer"]))
        return f"{steps}\n\nThe final answer is \\boxed{{{answer}}}."

    def score(self, task: Task, completion: str) -> Score:
        expected = Fraction(task.metadata["answer"])
        result = answers.grade(completion, expected, percent=bool(task.metadata.get("percent")))
        details = {
            "parsed": None if result.value is None else answers.format_number(result.value),
            "expected": answers.format_number(expected),
            "reason": result.reason,
            "source": result.source,
        }
        return Score(result.reward, result.status, details)
