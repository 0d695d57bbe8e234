"""The documents of domain `finance`: quarterly reports, announcements, the annual summary and distractors,
rendered from a `Company`, interleaved and padded to the level's size."""

from __future__ import annotations

import random
from fractions import Fraction

from envs.domains.finance.company import (
    _COMMENTARY_PARAGRAPHS,
    _ORDINAL,
    _PREFIXES_OTHER,
    _QUARTER_END,
    _REGIONS,
    _SEGMENTS,
    _SUFFIXES,
    Company,
    _fixed,
    _n,
)

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
