"""The problem bank of domain `code`: four families (strings, lists, parsing, dynamic programming), one
problem per family and difficulty level 0..3, each with random parameters (a shift, a separator, coin values,
edit costs) so the spec and the answers change with the seed. The reference implementation of every problem
lives here as source (never in the prompt); `make_task` runs it in this trusted process for the hidden
tests' expected outputs, which live in `Task.metadata`.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from typing import Any

from envs.base import Task

LEVELS = (0, 1, 2, 3)
NUM_TESTS = 10
NUM_EXAMPLES = 2

_LOWER = "abcdefghijklmnopqrstuvwxyz"
_WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "zeta", "rho", "tau", "phi", "psi")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One (family, level): a spec template, a reference body and generators for parameters and inputs.

    `body` (source) reads its parameters as upper-case module constants; the reference solution is those
    constants followed by the body. `spec` is formatted with the parameters and the `describe` strings.
    """

    family: str
    level: int
    signature: str
    spec: str
    body: str
    params: Callable[[random.Random], dict[str, Any]]
    inputs: Callable[[random.Random, dict[str, Any]], list[list[Any]]]
    describe: Callable[[dict[str, Any]], dict[str, str]] = lambda p: {}

    @property
    def function(self) -> str:
        return self.signature.split("(", 1)[0]


def _text(rng: random.Random, alphabet: str, lo: int, hi: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _strip_inputs(rng: random.Random, p: dict[str, Any]) -> list[list[Any]]:
    pool = _LOWER + _LOWER.upper() + p["chars"] * 3 + " ,.!"
    fixed = [[""], [p["chars"] * 2], [p["chars"].upper() + "xyz"]]
    return fixed + [[_text(rng, pool, 1, 30)] for _ in range(NUM_TESTS)]


def _caesar_inputs(rng: random.Random, p: dict[str, Any]) -> list[list[Any]]:
    pool = _LOWER + _LOWER.upper() + " .,!?0123456789"
    fixed = [[""], ["xyz XYZ abc"], ["Grüße, 2024!"]]
    return fixed + [[_text(rng, pool, 1, 40)] for _ in range(NUM_TESTS)]


def _rle_inputs(rng: random.Random, p: dict[str, Any]) -> list[list[Any]]:
    def runs() -> str:
        return "".join(rng.choice("abcAB") * rng.choice((1, 1, 2, 3, 12)) for _ in range(rng.randint(1, 8)))

    return [[""], ["a"], ["zzzzzzzzzzzzzzz"]] + [[runs()] for _ in range(NUM_TESTS)]


def _pal_inputs(rng: random.Random, p: dict[str, Any]) -> list[list[Any]]:
    pool = "abcAB" if p["ignore_case"] else "abc"
    return [[""], ["x"], ["abcd"]] + [[_text(rng, pool, 2, 16)] for _ in range(NUM_TESTS)]


def _ints(rng: random.Random, lo: int, hi: int, n_lo: int, n_hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(n_lo, n_hi))]


def _intervals(rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(rng.randint(0, 7)):
        a = rng.randint(0, 30)
        out.append([a, a + rng.randint(1, 6)])
    return out


def _kv_inputs(rng: random.Random, p: dict[str, Any]) -> list[list[Any]]:
    def line() -> str:
        parts = [
            f"{rng.choice(_WORDS)}{rng.choice(('', ' '))}={rng.choice(('', ' '))}{rng.randint(-99, 999)}"
        ]
        parts += [f"{rng.choice(_WORDS)}={rng.randint(-99, 999)}" for _ in range(rng.randint(0, 5))]
        return p["sep"].join(parts) + rng.choice(("", p["sep"]))

    return [[""], [f"a=1{p['sep']}a=2"]] + [[line()] for _ in range(NUM_TESTS)]


def _duration_inputs(rng: random.Random, p: dict[str, Any]) -> list[list[Any]]:
    def valid() -> str:
        units = sorted(rng.sample("dhms", rng.randint(1, 4)), key="dhms".index)
        return "".join(f"{rng.randint(0, 150)}{u}" for u in units)

    bad = ["", "10", "5x", "h5", "1h 30m", "-5s", "3m2"]
    return [[b] for b in rng.sample(bad, 4)] + [["59s"], ["1h"]] + [[valid()] for _ in range(NUM_TESTS)]


def _csv_inputs(rng: random.Random, p: dict[str, Any]) -> list[list[Any]]:
    d = p["delim"]

    def field() -> str:
        word = rng.choice(_WORDS + ("", f"a{d}b", 'say "hi"', "x y"))
        needs_quotes = d in word or '"' in word or rng.random() < 0.2
        return '"' + word.replace('"', '""') + '"' if needs_quotes else word

    lines = [d.join(field() for _ in range(rng.randint(1, 6))) for _ in range(NUM_TESTS)]
    return [[""], [d * 2], ['""']] + [[line] for line in lines]


def _expr(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.3:
        return rng.choice(("", "", "", "-")) + str(rng.randint(0, 20))
    left, right = _expr(rng, depth - 1), _expr(rng, depth - 1)
    text = f"{left}{rng.choice((' ', ''))}{rng.choice('+-*')}{rng.choice((' ', ''))}{right}"
    return f"({text})" if rng.random() < 0.4 else text


def _expr_inputs(rng: random.Random, p: dict[str, Any]) -> list[list[Any]]:
    return [["7"], ["2+3*4"], ["(1 - 2) * -3"]] + [[_expr(rng, 3)] for _ in range(NUM_TESTS)]


def _pairs(rng: random.Random, pool: str, hi: int) -> list[list[Any]]:
    return [[_text(rng, pool, 0, hi), _text(rng, pool, 0, hi)] for _ in range(NUM_TESTS)]


_PROBLEMS = (
    Problem(
        "strings",
        0,
        "strip_chars(s: str) -> str",
        "Return `s` with every occurrence of the characters {chars_list} removed. Matching is "
        "case-sensitive; all other characters keep their order.",
        """
def strip_chars(s):
    return "".join(c for c in s if c not in CHARS)
""",
        lambda rng: {"chars": "".join(rng.sample(_LOWER, 3))},
        _strip_inputs,
        lambda p: {"chars_list": ", ".join(repr(c) for c in p["chars"])},
    ),
    Problem(
        "strings",
        1,
        "caesar(s: str) -> str",
        "Shift every ASCII letter of `s` by {shift} position(s) in the alphabet (a positive shift moves "
        "forward, a negative one backward), wrapping around from z to a and keeping upper/lower case. Every "
        "other character, including non-ASCII letters, is unchanged.",
        """
def caesar(s):
    out = []
    for c in s:
        if "a" <= c <= "z":
            out.append(chr((ord(c) - 97 + SHIFT) % 26 + 97))
        elif "A" <= c <= "Z":
            out.append(chr((ord(c) - 65 + SHIFT) % 26 + 65))
        else:
            out.append(c)
    return "".join(out)
""",
        lambda rng: {"shift": rng.choice([k for k in range(-25, 26) if k])},
        _caesar_inputs,
    ),
    Problem(
        "strings",
        2,
        "rle(s: str) -> str",
        "Run-length encode `s`: each maximal run of one repeated character becomes {order}. {ones}",
        """
def rle(s):
    out, i = [], 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        n = j - i
        if OMIT_ONES and n == 1:
            out.append(s[i])
        elif COUNT_FIRST:
            out.append(f"{n}{s[i]}")
        else:
            out.append(f"{s[i]}{n}")
        i = j
    return "".join(out)
""",
        lambda rng: {"omit_ones": rng.random() < 0.5, "count_first": rng.random() < 0.5},
        _rle_inputs,
        lambda p: {
            "order": "the run length followed by the character"
            if p["count_first"]
            else "the character followed by the run length",
            "ones": "A run of length 1 is written as the bare character."
            if p["omit_ones"]
            else "The length is written even when it is 1.",
        },
    ),
    Problem(
        "strings",
        3,
        "longest_palindrome(s: str) -> str",
        "Return the longest contiguous substring of `s` that is a palindrome{case}. When several have the "
        "maximal length, return the leftmost. The empty string gives the empty string.",
        """
def longest_palindrome(s):
    t = s.lower() if IGNORE_CASE else s
    best = (0, 0)
    for center in range(2 * len(s) - 1):
        lo, hi = center // 2, (center + 1) // 2
        while lo >= 0 and hi < len(s) and t[lo] == t[hi]:
            lo -= 1
            hi += 1
        if hi - lo - 1 > best[1] - best[0]:
            best = (lo + 1, hi)
    return s[best[0] : best[1]]
""",
        lambda rng: {"ignore_case": rng.random() < 0.5},
        _pal_inputs,
        lambda p: {
            "case": " when upper/lower case is ignored (return it as written in `s`)"
            if p["ignore_case"]
            else " (case-sensitive)"
        },
    ),
    Problem(
        "lists",
        0,
        "sum_multiples(xs: list[int]) -> int",
        "Return the sum of the elements of `xs` that are divisible by {k} (negative numbers and zero "
        "included). An empty list sums to 0.",
        """
def sum_multiples(xs):
    return sum(x for x in xs if x % K == 0)
""",
        lambda rng: {"k": rng.randint(2, 7)},
        lambda rng, p: [[[]], [[0]]] + [[_ints(rng, -50, 50, 1, 12)] for _ in range(NUM_TESTS)],
    ),
    Problem(
        "lists",
        1,
        "rotate(xs: list[int]) -> list[int]",
        "Return a new list: `xs` rotated {direction} by {steps} positions (an element that falls off one "
        "end comes back at the other; the count may exceed the length). An empty list gives an empty list.",
        """
def rotate(xs):
    if not xs:
        return []
    k = (STEPS if RIGHT else -STEPS) % len(xs)
    return xs[len(xs) - k :] + xs[: len(xs) - k]
""",
        lambda rng: {"steps": rng.randint(1, 9), "right": rng.random() < 0.5},
        lambda rng, p: [[[]], [[5]]] + [[_ints(rng, 0, 9, 1, 11)] for _ in range(NUM_TESTS)],
        lambda p: {"direction": "to the right" if p["right"] else "to the left"},
    ),
    Problem(
        "lists",
        2,
        "longest_window(xs: list[int]) -> int",
        "`xs` holds non-negative integers. Return the length of the longest contiguous sublist whose sum is "
        "at most {limit} (0 when no non-empty sublist qualifies).",
        """
def longest_window(xs):
    best = lo = total = 0
    for hi, x in enumerate(xs):
        total += x
        while total > LIMIT:
            total -= xs[lo]
            lo += 1
        best = max(best, hi - lo + 1)
    return best
""",
        lambda rng: {"limit": rng.randint(5, 30)},
        lambda rng, p: [[[]], [[p["limit"] + 1]]] + [[_ints(rng, 0, 12, 1, 16)] for _ in range(NUM_TESTS)],
    ),
    Problem(
        "lists",
        3,
        "merge_intervals(intervals: list[list[int]]) -> list[list[int]]",
        "Each interval is a pair [start, end] with start < end, in any order. Merge every group of "
        "intervals that overlap (one starts before another ends){touch}, and return the merged intervals as "
        "[start, end] lists sorted by start.",
        """
def merge_intervals(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and (a < merged[-1][1] or (MERGE_TOUCHING and a == merged[-1][1])):
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged
""",
        lambda rng: {"merge_touching": rng.random() < 0.5},
        lambda rng, p: [[[]], [[[1, 3], [3, 5]]]] + [[_intervals(rng)] for _ in range(NUM_TESTS)],
        lambda p: {
            "touch": "; intervals that only touch (one starts exactly where another ends) "
            + ("merge too" if p["merge_touching"] else "stay separate")
        },
    ),
    Problem(
        "parsing",
        0,
        "parse_pairs(s: str) -> dict[str, int]",
        "`s` holds `key=value` items separated by {sep_repr}; values are integers, whitespace around keys "
        "and values is ignored, empty items are skipped, and a later key overrides an earlier one. Return "
        "the dict of keys to integer values.",
        """
def parse_pairs(s):
    out = {}
    for part in s.split(SEP):
        if part.strip():
            key, value = part.split("=", 1)
            out[key.strip()] = int(value)
    return out
""",
        lambda rng: {"sep": rng.choice(";,&|")},
        _kv_inputs,
        lambda p: {"sep_repr": repr(p["sep"])},
    ),
    Problem(
        "parsing",
        1,
        "parse_duration(s: str) -> int",
        "`s` is a duration written as one or more `<digits><unit>` parts with no spaces, each unit one of "
        "d (day), h, m, s (second), for example '1h30m'. Return the total duration in whole {unit} (rounded "
        "down), or -1 when `s` is not of that form (including the empty string).",
        """
import re


def parse_duration(s):
    if not re.fullmatch(r"([0-9]+[dhms])+", s):
        return -1
    sizes = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    total = sum(int(n) * sizes[u] for n, u in re.findall(r"([0-9]+)([dhms])", s))
    return total // DIVISOR
""",
        lambda rng: dict(
            zip(("unit", "divisor"), rng.choice((("seconds", 1), ("minutes", 60), ("hours", 3600))))
        ),
        _duration_inputs,
    ),
    Problem(
        "parsing",
        2,
        "split_csv(line: str) -> list[str]",
        "Split one CSV line into its fields. Fields are separated by {delim_repr}. A field wrapped in "
        "double quotes may contain the separator, and inside it two double quotes stand for one; the "
        "wrapping quotes are removed. Whitespace is kept as is. An empty line is a single empty field.",
        """
def split_csv(line):
    fields, cur, quoted, i = [], [], False, 0
    while i < len(line):
        c = line[i]
        if quoted and c == '"':
            if line[i + 1 : i + 2] == '"':
                cur.append(c)
                i += 1
            else:
                quoted = False
        elif quoted or c not in ('"', DELIM):
            cur.append(c)
        elif c == '"':
            quoted = True
        else:
            fields.append("".join(cur))
            cur = []
        i += 1
    fields.append("".join(cur))
    return fields
""",
        lambda rng: {"delim": rng.choice(",;|")},
        _csv_inputs,
        lambda p: {"delim_repr": repr(p["delim"])},
    ),
    Problem(
        "parsing",
        3,
        "evaluate(expr: str) -> int",
        "Evaluate an integer expression made of non-negative integer literals, +, -, *, parentheses and "
        "spaces. {precedence} A '-' where an operand is expected is unary minus and applies to the operand "
        "right after it. Do not use eval.",
        """
import re


def evaluate(expr):
    tokens = re.findall(r"[0-9]+|[-+*()]", expr)
    pos = 0

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def atom():
        tok = take()
        if tok == "(":
            value = chain(TOP)
            take()
            return value
        return -atom() if tok == "-" else int(tok)

    def chain(ops):
        operand = atom if FLAT or ops == ["*"] else lambda: chain(["*"])
        value = operand()
        while pos < len(tokens) and tokens[pos] in ops:
            op, rhs = take(), operand()
            value = value * rhs if op == "*" else value + rhs if op == "+" else value - rhs
        return value

    return chain(TOP)
""",
        lambda rng: {"flat": (flat := rng.random() < 0.5), "top": ["+", "-", "*"] if flat else ["+", "-"]},
        _expr_inputs,
        lambda p: {
            "precedence": "All three binary operators have the SAME precedence and apply strictly left to "
            "right (so 2+3*4 is 20)."
            if p["flat"]
            else "* binds tighter than + and -, which apply left to right (so 2+3*4 is 14)."
        },
    ),
    Problem(
        "dp",
        0,
        "count_ways(n: int) -> int",
        "A staircase has `n` steps; each move climbs one of {steps} steps. Return the number of ordered "
        "move sequences that reach exactly step `n`, modulo 1000000007 (n = 0 has one way: no moves).",
        """
def count_ways(n):
    ways = [1] + [0] * n
    for i in range(1, n + 1):
        ways[i] = sum(ways[i - s] for s in STEPS if s <= i) % 1000000007
    return ways[n]
""",
        lambda rng: {"steps": sorted(rng.sample(range(1, 6), rng.randint(2, 3)))},
        lambda rng, p: [[0], [1], [2]] + [[rng.randint(3, 300)] for _ in range(NUM_TESTS)],
    ),
    Problem(
        "dp",
        1,
        "min_coins(amount: int) -> int",
        "Coins come in the values {coins} (unlimited supply). Return the smallest number of coins that sum "
        "to exactly `amount`, or -1 when no combination does (0 coins for amount 0).",
        """
def min_coins(amount):
    best = [0] + [None] * amount
    for a in range(1, amount + 1):
        options = [best[a - c] for c in COINS if c <= a and best[a - c] is not None]
        best[a] = min(options) + 1 if options else None
    return -1 if best[amount] is None else best[amount]
""",
        lambda rng: {"coins": sorted(rng.sample(range(2, 26), 3))},
        lambda rng, p: [[0], [1], [p["coins"][-1] + 1]] + [[rng.randint(2, 300)] for _ in range(NUM_TESTS)],
    ),
    Problem(
        "dp",
        2,
        "lcs_length(a: str, b: str) -> int",
        "Return the length of the longest common subsequence of `a` and `b` (characters in order, not "
        "necessarily contiguous). {case}",
        """
def lcs_length(a, b):
    if IGNORE_CASE:
        a, b = a.lower(), b.lower()
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]
""",
        lambda rng: {"ignore_case": rng.random() < 0.5},
        lambda rng, p: [["", "abc"], ["abc", "abc"], ["aBc", "AbC"]] + _pairs(rng, "abcdAB", 14),
        lambda p: {
            "case": "Upper and lower case count as equal."
            if p["ignore_case"]
            else "Comparison is case-sensitive."
        },
    ),
    Problem(
        "dp",
        3,
        "edit_cost(a: str, b: str) -> int",
        "Return the minimum total cost of turning `a` into `b` with these operations on single characters: "
        "insert one (cost {insert}), delete one (cost {delete}), replace one by another (cost {substitute}).",
        """
def edit_cost(a, b):
    prev = [j * INSERT for j in range(len(b) + 1)]
    for i, x in enumerate(a, 1):
        cur = [i * DELETE]
        for j, y in enumerate(b, 1):
            replace = prev[j - 1] + (0 if x == y else SUBSTITUTE)
            cur.append(min(prev[j] + DELETE, cur[j - 1] + INSERT, replace))
        prev = cur
    return prev[-1]
""",
        lambda rng: {
            "insert": rng.randint(1, 4),
            "delete": rng.randint(1, 4),
            "substitute": rng.randint(1, 6),
        },
        lambda rng, p: [["", ""], ["", "ab"], ["kitten", "sitting"]] + _pairs(rng, "abcd", 10),
    ),
)
BY_KEY = {(p.family, p.level): p for p in _PROBLEMS}
FAMILIES = tuple(dict.fromkeys(p.family for p in _PROBLEMS))


def reference_source(problem: Problem, params: dict[str, Any]) -> str:
    """The reference implementation: the parameters as upper-case constants, then the body."""
    constants = "".join(f"{key.upper()} = {value!r}\n" for key, value in sorted(params.items()))
    return f"{constants}{problem.body}"


def call_reference(source: str, function: str, inputs: list[list[Any]]) -> list[Any]:
    namespace: dict[str, Any] = {"__name__": "reference"}
    exec(compile(source, "reference.py", "exec"), namespace)
    return [json.loads(json.dumps(namespace[function](*args))) for args in inputs]


def make_task(seed: int, index: int, level: int | None = None) -> Task:
    """Task `index` of `seed`: a family, level, parameters, hidden tests and their expected outputs."""
    rng = random.Random(f"code:{seed}:{index}")
    level = rng.choice(LEVELS) if level is None else level
    problem = BY_KEY[(rng.choice(FAMILIES), level)]
    params = problem.params(rng)
    inputs = problem.inputs(rng, params)[:NUM_TESTS]
    examples = problem.inputs(random.Random(f"code-examples:{seed}:{index}"), params)[-NUM_EXAMPLES:]
    source = reference_source(problem, params)
    expected = call_reference(source, problem.function, inputs)
    shown = call_reference(source, problem.function, examples)
    lines = [f"    {problem.function}({', '.join(map(repr, a))}) == {e!r}" for a, e in zip(examples, shown)]
    prompt = (
        f"Write a Python function `{problem.signature}`.\n\n"
        f"{problem.spec.format(**params, **problem.describe(params))}\n\nExamples:\n"
        + "\n".join(lines)
        + "\n\n"
        "Use only the standard library; the function must not read or write files, start processes or use "
        "the network. Reply with the complete function in a ```python code block."
    )
    metadata = {
        "family": problem.family,
        "level": level,
        "function": problem.function,
        "params": params,
        "inputs": inputs,
        "expected": expected,
    }
    return Task(f"code/{problem.family}/{level}/{seed}-{index}", "code", prompt, metadata, level)
