"""The data of domain `finance`: fictional companies and their quarters (segments, costs, shares, events),
and the sizes of each level (`LEVEL_CHARS`)."""

from __future__ import annotations

import dataclasses
import random
from fractions import Fraction

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
