"""The shared final-answer parser: one numeric final answer per completion, compared exactly.

Where the answer is looked for, strongest first:

1. explicit markers: every `\\boxed{...}` (nested braces), every line starting with "Answer:" or
   "Final answer:" (markdown bold allowed), every GSM8K-style "#### ..." line;
2. only when there are no explicit markers: "the (final) answer is ..." phrases, up to the end of their
   sentence;
3. only when there is neither: the whole completion, if it is nothing but one number (at most
   `PLAIN_MAX_CHARS` characters), so an echoed prompt full of numbers never yields an answer.

Exactly one final answer counts. Each marker must hold exactly one distinct number (units, `$` and words
around it are ignored); all markers of the chosen tier must agree. Several distinct candidates ("Answer: 3 or
4", "Answer: 3, 4, 5", two different boxed values) are a `format_error`, as is a completion with no answer.
Same-valued repeats (`\\boxed{12/4}` and "#### 3") are one answer.
An "Answer:" line without a number is prose, an empty `\\boxed{}` (the prompt's own instruction) is skipped,
a box inside a box belongs to the outer one, and more than `MAX_MARKERS` markers is a format error (so
adversarial completions cost bounded work).

Numbers: integers, decimals, negatives, `3/4`, `\\frac{3}{4}` / `\\dfrac` / `\\tfrac`, thousands separators
(`1,234,567`; `1,2` is two numbers, not 12). A `%` divides by 100 unless the task's answer is itself a
percentage (`percent=True`), in which case "12.5%" and "12.5" both mean 12.5. Values are `Fraction`s and
compare exactly, or within an optional absolute tolerance.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable
from fractions import Fraction

from envs.base import Score

PLAIN_MAX_CHARS = 40
MAX_COMPLETION_CHARS = 2_000_000
MAX_MARKERS = 16  # more final-answer markers than this is a format error, not a search

_LATEX_REPLACEMENTS = (
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", " "),
    ("\\ ", " "),
    ("\\$", "$"),
    ("\\%", "%"),
    ("{,}", ","),
    ("\u2212", "-"),  # unicode minus sign
    ("\\(", " "),
    ("\\)", " "),
    ("\\[", " "),
    ("\\]", " "),
    ("$", " "),
)
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>-?)"
    r"(?:\\frac\s*\{\s*(?P<fnum>-?\d+(?:\.\d+)?)\s*\}\s*\{\s*(?P<fden>-?\d+(?:\.\d+)?)\s*\}"
    r"|\\frac(?P<snum>\d)(?P<sden>\d)"
    r"|(?P<int>\d{1,3}(?:,\d{3})+(?![\d]|,\d)|\d+)(?:\.(?P<dec>\d+))?(?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?"
    r"|\.(?P<bare>\d+))"
    r"(?P<pct>\s*%)?"
)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_ANSWER_LINE = re.compile(
    r"^[ \t>*_]*(?:final[ \t]+)?answer[ \t*_]*[:\uff1a][ \t*_]*(?P<rest>.*)$", re.I | re.M
)
_HASH_LINE = re.compile(r"^[ \t]*####[ \t]*(?P<rest>.*)$", re.M)
_ANSWER_PHRASE = re.compile(r"\b(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t]+is\b[ \t:]*", re.I)
_PHRASE_WINDOW = 200  # characters read after "the answer is": bounded, so many phrases cost linear time
_SENTENCE_END = re.compile(r"\.(?=\s|$)")


@dataclasses.dataclass(frozen=True)
class AnswerResult:
    """A parsed (or graded) answer.

    `status` is "ok" (parsed; from `grade`: correct), "wrong" (from `grade` only) or "format_error".
    `source` names the rule that found the value: "boxed", "answer_line", "####", "phrase" or "plain".
    """

    value: Fraction | None
    status: str
    reason: str
    source: str = ""

    @property
    def reward(self) -> float:
        return 1.0 if self.status == "ok" else 0.0


def _format_error(reason: str) -> AnswerResult:
    return AnswerResult(None, "format_error", reason)


def normalize(text: str) -> str:
    """Strips LaTeX decoration that never changes a number's value (`\\text{}`, `\\left`, `$`, `\\,`)."""
    text = _TEXT_MACRO.sub(r" \1 ", text)
    for old, new in _LATEX_REPLACEMENTS:
        text = text.replace(old, new)
    return text


def _match_value(m: re.Match[str], percent: bool) -> Fraction | None:
    """The value of one `_NUMBER` match, or None for a zero denominator."""
    if m["fnum"] is not None:
        num, den = Fraction(m["fnum"]), Fraction(m["fden"])
    elif m["snum"] is not None:
        num, den = Fraction(int(m["snum"])), Fraction(int(m["sden"]))
    elif m["bare"] is not None:
        num, den = Fraction("0." + m["bare"]), Fraction(1)
    else:
        whole = m["int"].replace(",", "")
        num = Fraction(f"{whole}.{m['dec']}" if m["dec"] else whole)
        den = Fraction(m["den"]) if m["den"] else Fraction(1)
    if den == 0:
        return None
    value = num / den
    if m["sign"]:
        value = -value
    if m["pct"] and not percent:
        value /= 100
    return value


def numbers_in(text: str, *, percent: bool = False) -> list[Fraction | None]:
    """Every number in `text` (normalised first), in order; None marks one with a zero denominator."""
    return [_match_value(m, percent) for m in _NUMBER.finditer(normalize(text))]


def parse_number(text: str, *, percent: bool = False) -> Fraction | None:
    """The single number in `text` (words and units allowed around it), else None."""
    values = numbers_in(text, percent=percent)
    distinct = set(values)
    if len(distinct) != 1 or None in distinct:
        return None
    return values[0]


def _closing_braces(text: str) -> dict[int, int]:
    """Position of each "{" -> position of its matching "}" (one pass, so nesting costs linear time)."""
    closing, open_at = {}, []
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            open_at.append(m.start())
        elif open_at:
            closing[open_at.pop()] = m.start()
    return closing


def _boxed_contents(text: str) -> list[str] | AnswerResult:
    """The contents of every outermost `\\boxed{...}` (balanced braces), or an error for an unclosed one.

    A box inside another box is part of the outer one's content, so the contents never overlap and their
    total size stays within the completion's.
    """
    closing, contents, outer_end = _closing_braces(text), [], -1
    for m in _BOXED.finditer(text):
        if m.start() < outer_end:
            continue
        outer_end = closing.get(m.end() - 1, -1)
        if outer_end < 0:
            return _format_error("unclosed \\boxed{")
        contents.append(text[m.end() : outer_end])
    return contents


def _span_value(span: str, source: str, percent: bool) -> AnswerResult:
    values = numbers_in(span, percent=percent)
    distinct = set(values)
    if None in distinct:
        return _format_error(f"{source}: division by zero in {span.strip()[:80]!r}")
    if not distinct:
        return _format_error(f"{source}: no number in {span.strip()[:80]!r}")
    if len(distinct) > 1:
        return _format_error(f"{source}: several candidate numbers in {span.strip()[:80]!r}")
    return AnswerResult(values[0], "ok", f"{source}: {span.strip()[:80]!r}", source)


def _explicit_spans(text: str) -> list[tuple[str, str]] | AnswerResult:
    """(source, span) for every boxed answer, "Answer:" line with a number and "####" line.

    Empty boxes are skipped: the prompt's own instruction ("... in \\boxed{}") must not count as an answer.
    """
    boxed = _boxed_contents(text)
    if isinstance(boxed, AnswerResult):
        return boxed
    boxes = (("boxed", content) for content in boxed if content.strip())
    # A line like "Answer: let me think" is prose; a boxed value on the line is counted once, as boxed.
    lines = (
        ("answer_line", m["rest"])
        for m in _ANSWER_LINE.finditer(text)
        if "\\boxed" not in m["rest"] and "\\fbox" not in m["rest"] and numbers_in(m["rest"])
    )
    hashes = (("####", m["rest"]) for m in _HASH_LINE.finditer(text))
    return _at_most(itertools.chain(boxes, lines, hashes))


def _phrase_spans(text: str) -> list[tuple[str, str]] | AnswerResult:
    """ "The answer is ..." up to the end of its sentence; phrases with no number are prose, not answers."""
    spans = []
    for m in _ANSWER_PHRASE.finditer(text):
        line = text[m.end() : m.end() + _PHRASE_WINDOW].split("\n", 1)[0]
        rest = _SENTENCE_END.split(line, maxsplit=1)[0]
        if numbers_in(rest):
            spans.append(("phrase", rest))
        if len(spans) > MAX_MARKERS:
            return _format_error(f"more than {MAX_MARKERS} final-answer phrases")
    return spans


def _at_most(spans: Iterable[tuple[str, str]]) -> list[tuple[str, str]] | AnswerResult:
    """The spans, or a format error once there are more than `MAX_MARKERS` (stops reading there)."""
    taken = list(itertools.islice(spans, MAX_MARKERS + 1))
    if len(taken) > MAX_MARKERS:
        return _format_error(f"more than {MAX_MARKERS} final-answer markers")
    return taken


def _combine(spans: list[tuple[str, str]], percent: bool) -> AnswerResult:
    results = [_span_value(span, source, percent) for source, span in spans]
    for result in results:
        if result.status != "ok":
            return result
    distinct = sorted({r.value for r in results})
    if len(distinct) > 1:
        shown = ", ".join(format_number(v) for v in distinct[:5])
        return _format_error(f"several different final answers: {shown}")
    return results[-1]


def _plain(text: str, percent: bool) -> AnswerResult:
    stripped = text.strip().rstrip(".").strip()
    if len(stripped) > PLAIN_MAX_CHARS:
        return _format_error("no final answer found (use \\boxed{} or 'Answer:')")
    m = _NUMBER.fullmatch(normalize(stripped).strip())
    if m is None:
        return _format_error("no final answer found (use \\boxed{} or 'Answer:')")
    value = _match_value(m, percent)
    if value is None:
        return _format_error("plain: division by zero")
    return AnswerResult(value, "ok", "plain: the completion is a single number", "plain")


def parse_answer(completion: str, *, percent: bool = False) -> AnswerResult:
    """The one final answer in `completion`: status "ok" with its value, or "format_error" with a reason."""
    if not isinstance(completion, str) or not completion.strip():
        return _format_error("empty completion")
    if len(completion) > MAX_COMPLETION_CHARS:
        return _format_error(f"completion longer than {MAX_COMPLETION_CHARS} characters")
    spans = _explicit_spans(completion)
    if isinstance(spans, AnswerResult):
        return spans
    if spans:
        return _combine(spans, percent)
    phrases = _phrase_spans(completion)
    if isinstance(phrases, AnswerResult):
        return phrases
    if phrases:
        return _combine(phrases, percent)
    return _plain(completion, percent)


def matches(value: Fraction, expected: Fraction, *, tolerance: Fraction | float | str | None = None) -> bool:
    """Exact rational equality, or |value - expected| <= tolerance when a tolerance is given."""
    if tolerance is None:
        return value == expected
    return abs(value - expected) <= Fraction(str(tolerance))


def grade(
    completion: str,
    expected: Fraction,
    *,
    percent: bool = False,
    tolerance: Fraction | float | str | None = None,
) -> AnswerResult:
    """Parses `completion` and compares it with `expected`: status "ok", "wrong" or "format_error"."""
    parsed = parse_answer(completion, percent=percent)
    if parsed.status != "ok":
        return parsed
    if matches(parsed.value, expected, tolerance=tolerance):
        return parsed
    return dataclasses.replace(parsed, status="wrong")


def graded_score(completion: str, expected: Fraction, **options) -> Score:
    """`grade(completion, expected, **options)` as a `Score`: its reward and status, with what was parsed
    and expected (both as `format_number` writes them), why, and which rule found the value."""
    result = grade(completion, expected, **options)
    details = {
        "parsed": None if result.value is None else format_number(result.value),
        "expected": format_number(expected),
        "reason": result.reason,
        "source": result.source,
    }
    return Score(result.reward, result.status, details)


def format_number(value: Fraction) -> str:
    """`value` as the parser reads it back: "42", "-3.125" for terminating decimals, else "-7/3"."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    den, twos, fives = value.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    places = max(twos, fives)
    if den == 1 and places <= 12:
        sign = "-" if value < 0 else ""
        scaled = abs(value) * 10**places
        whole, frac = divmod(int(scaled), 10**places)
        return f"{sign}{whole}.{frac:0{places}d}"
    return f"{value.numerator}/{value.denominator}"


def round_half_away(value: Fraction, places: int) -> Fraction:
    """`value` rounded to `places` decimals, halves away from zero (exact, no float)."""
    scale = Fraction(10) ** places
    scaled = abs(Fraction(value)) * scale
    rounded = int(scaled + Fraction(1, 2))
    return (rounded if value >= 0 else -rounded) / scale
