"""The `math` domain: procedural arithmetic and word problems, plus GSM8K-style data (JSONL or tfds).

Difficulty levels of the procedural tasks (all exact; answers are `Fraction`s):

- -1: a two-digit number plus or minus a single digit ("Compute 47 + 8."), the easiest mission level: a
  toy model learns it in minutes (`make demo`). One operation is its own work, so the reference solution is
  the boxed answer alone (`\\boxed{55}`), a dozen tokens, and its prompt asks for that alone
  (the question, a blank line, "Answer in \\boxed{}.");
- 0: one operation on two integers (`+ - * /`, divisions exact, the odd negative operand);
- 1: integer expressions of 3-5 operands with parentheses, evaluated step by step;
- 2: word problems of several steps: prices and change, discounts and tax, speeds and durations, ages,
  wages and savings, unit conversions, filling and draining tanks;
- 3: fractions and longer chains: fraction expressions, 6-8 operation chains, fraction word problems.

A `Task`'s metadata holds the exact answer as a string `Fraction` reads back (`"-7/3"`, JSON-serialisable;
`task_answer` returns the `Fraction`), the worked steps and the source. Scoring goes through
`envs.domains.answers.grade`: one final answer, compared exactly (metadata "tolerance" and "percent" are
honoured when a data set needs them). Data tasks come from `load_gsm8k_jsonl` or `load_tfds` (imports
tensorflow_datasets only when called).

Data splits. `MathEnvironment(train_jsonl=..., test_jsonl=...)` and/or `MathEnvironment(tfds_name=...,
tfds_data_dir=...)` (the dataset's 'train' and 'test' splits) keep the data's own splits:
`data_splits == ("train", "test")` and `sample_tasks(..., split="train" | "test")` draws from one of them
(`rl.data.DomainTasks` draws "train" for its train stream and "test" for its eval stream, with no hash holdout
of its own). Unsplit data (`tasks=...`, `jsonl_path=...`) and the procedural tasks have no data splits; then
`rl.data.DomainTasks` holds out a hash fraction of prompts. Scoring never needs the split: a task carries its
answer in its metadata, so a worker built with the same options scores tasks of either split.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from envs.base import Score, SingleTurnEnvironment, Task
from envs.domains import answers

INSTRUCTION = (
    "Show your work, then give the final answer as a single number in \\boxed{} (write fractions as a/b)."
)
# Level -1 has no work to show and no fractions: its prompt asks for the boxed answer alone (and is a third
# as long, which is most of what a toy model's step costs there).
ANSWER_ONLY = "Answer in \\boxed{}."
GSM8K_LEVEL = 2  # grade-school word problems sit with the level-2 procedural ones
_CALCULATOR = re.compile(r"<<[^>]*>>")


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str
    answer: Fraction
    steps: tuple[str, ...]
    kind: str


_fmt = answers.format_number
_OPS: dict[str, Callable[[Fraction, Fraction], Fraction]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


# ---- Levels 0 and 1: integer expressions -------------------------------------------------------------------

Expr = Fraction | tuple[str, "Expr", "Expr"]


def _ratio(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _value(expr: Expr) -> Fraction:
    if isinstance(expr, Fraction):
        return expr
    op, left, right = expr
    return _OPS[op](_value(left), _value(right))


def _render(expr: Expr, parens: bool = False) -> str:
    """Infix text; every fraction leaf in parentheses so "/" never reads two ways."""
    if isinstance(expr, Fraction):
        text = _ratio(expr)
        return f"({text})" if expr.denominator != 1 or expr < 0 else text
    op, left, right = expr
    left_text = _render(left, _needs_parens(left, op, False))
    text = f"{left_text} {op} {_render(right, _needs_parens(right, op, True))}"
    return f"({text})" if parens else text


def _needs_parens(child: Expr, op: str, is_right: bool) -> bool:
    if isinstance(child, Fraction):
        return False
    child_prec, prec = _PRECEDENCE[child[0]], _PRECEDENCE[op]
    return child_prec < prec or (is_right and child_prec == prec and op in "-/")


def _steps(expr: Expr, out: list[str]) -> Fraction:
    """Evaluates `expr` innermost first, appending one "a op b = c" line per operation."""
    if isinstance(expr, Fraction):
        return expr
    op, left, right = expr
    a, b = _steps(left, out), _steps(right, out)
    c = _OPS[op](a, b)
    out.append(f"{_render(a)} {op} {_render(b)} = {_render(c)}")
    return c


def _expression_problem(expr: Expr, kind: str) -> Problem:
    steps: list[str] = []
    answer = _steps(expr, steps)
    return Problem(f"Compute {_render(expr)}.", answer, tuple(steps), kind)


def _exact_divisor(rng: random.Random, value: Fraction) -> Fraction | None:
    if value.denominator != 1 or value == 0:
        return None
    divisors = [d for d in range(2, 26) if value.numerator % d == 0]
    return Fraction(rng.choice(divisors)) if divisors else None


def _int_tree(rng: random.Random, leaves: int) -> Expr:
    if leaves == 1:
        return Fraction(rng.randint(1, 40))
    split = rng.randint(1, leaves - 1)
    left = _int_tree(rng, split)
    op = rng.choice("+-*/")
    if op == "/":
        divisor = _exact_divisor(rng, _value(left))
        if divisor is not None:
            return ("/", left, divisor)
        op = "+"
    right = _int_tree(rng, leaves - split)
    if op == "*" and abs(_value(left) * _value(right)) > 5000:
        op = "-"
    return (op, left, right)


def two_operand(rng: random.Random) -> Problem:
    op = rng.choice("+-*/")
    if op == "*":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
    elif op == "/":
        b, q = rng.randint(2, 30), rng.randint(2, 99)
        a = b * q
    else:
        a, b = rng.randint(2, 999), rng.randint(2, 999)
    if op in "+-" and rng.random() < 0.2:
        a = -a
    return _expression_problem((op, Fraction(a), Fraction(b)), "two_operand")


def small_add_sub(rng: random.Random) -> Problem:
    """Level -1: 10..99 plus or minus 1..9 (answers 1..108); no steps (the one operation is the answer)."""
    a, op, b = rng.randint(10, 99), rng.choice("+-"), rng.randint(1, 9)
    problem = _expression_problem((op, Fraction(a), Fraction(b)), "small_add_sub")
    return dataclasses.replace(problem, steps=())


def parenthesised(rng: random.Random) -> Problem:
    while True:
        expr = _int_tree(rng, rng.randint(3, 5))
        if "(" in _render(expr) and abs(_value(expr)) <= 100_000:
            return _expression_problem(expr, "parenthesised")


# ---- Level 2: word problems --------------------------------------------------------------------------------

_NAMES = ("Maya", "Leo", "Ana", "Omar", "Priya", "Jonas", "Mei", "Tomas", "Ada", "Kofi")


def _money(value: Fraction) -> str:
    """Whole dollars as "$12", cents as "$12.05" (`value` has at most two decimals)."""
    if value.denominator == 1:
        return f"${value.numerator}"
    cents = int(value * 100)
    return f"${cents // 100}.{cents % 100:02d}"


def shopping(rng: random.Random) -> Problem:
    name = rng.choice(_NAMES)
    n1, n2 = rng.randint(2, 9), rng.randint(2, 12)
    p1, p2 = Fraction(rng.randint(150, 1200), 100), Fraction(rng.randint(40, 400), 100)
    total = n1 * p1 + n2 * p2
    bill = Fraction((int(total) // 20 + 1) * 20)
    question = (
        f"{name} buys {n1} notebooks at {_money(p1)} each and {n2} pens at {_money(p2)} each, and pays with "
        f"{_money(bill)}. How much change, in dollars, does {name} get?"
    )
    steps = (
        f"Notebooks: {n1} * {_fmt(p1)} = {_fmt(n1 * p1)}",
        f"Pens: {n2} * {_fmt(p2)} = {_fmt(n2 * p2)}",
        f"Total: {_fmt(n1 * p1)} + {_fmt(n2 * p2)} = {_fmt(total)}",
        f"Change: {_fmt(bill)} - {_fmt(total)} = {_fmt(bill - total)}",
    )
    return Problem(question, bill - total, steps, "shopping")


def discount(rng: random.Random) -> Problem:
    price = Fraction(rng.randint(2, 30) * 20)
    off, tax = rng.choice((10, 20, 25, 30, 50)), rng.choice((5, 8, 10, 15))
    discounted = price * (100 - off) / 100
    final = discounted * (100 + tax) / 100
    question = (
        f"A jacket costs {_money(price)}. It is discounted by {off}%, and then a sales tax of {tax}% is "
        "added to the discounted price. What is the final price in dollars?"
    )
    steps = (
        f"Discounted: {_fmt(price)} * (100 - {off})/100 = {_fmt(discounted)}",
        f"With tax: {_fmt(discounted)} * (100 + {tax})/100 = {_fmt(final)}",
    )
    return Problem(question, final, steps, "discount")


def travel(rng: random.Random) -> Problem:
    v1, t1 = rng.randint(4, 30) * 5, rng.randint(1, 5)
    v2, minutes = rng.randint(2, 20) * 12, rng.choice((15, 20, 30, 45, 50, 90))
    d1, d2 = Fraction(v1 * t1), Fraction(v2 * minutes, 60)
    question = (
        f"A train travels at {v1} km/h for {t1} hours, then at {v2} km/h for {minutes} minutes. "
        "How many kilometres does it travel in total?"
    )
    steps = (
        f"First part: {v1} * {t1} = {_fmt(d1)} km",
        f"Second part: {v2} * {minutes}/60 = {_fmt(d2)} km",
        f"Total: {_fmt(d1)} + {_fmt(d2)} = {_fmt(d1 + d2)} km",
    )
    return Problem(question, d1 + d2, steps, "travel")


def ages(rng: random.Random) -> Problem:
    older, younger = rng.sample(_NAMES, 2)
    young, k, years = rng.randint(3, 20), rng.randint(2, 4), rng.randint(2, 15)
    total = (k + 1) * young + 2 * years
    question = (
        f"{older} is {k} times as old as {younger}. In {years} years the sum of their ages will be {total}. "
        f"How old is {older} now?"
    )
    steps = (
        f"Let {younger}'s age be x; {older} is {k}x.",
        f"In {years} years: x + {years} + {k}x + {years} = {total}, so {k + 1}x = {total - 2 * years}",
        f"x = {young}, so {older} is {k} * {young} = {k * young}",
    )
    return Problem(question, Fraction(k * young), steps, "ages")


def flour(rng: random.Random) -> Problem:
    grams, batches, days = rng.randint(12, 90) * 25, rng.randint(2, 12), rng.randint(2, 7)
    total = grams * batches * days
    question = (
        f"A recipe needs {grams} grams of flour per batch. A baker makes {batches} batches a day for {days} "
        "days. How many kilograms of flour does the baker use?"
    )
    steps = (
        f"Grams: {grams} * {batches} * {days} = {total}",
        f"Kilograms: {total} / 1000 = {_fmt(Fraction(total, 1000))}",
    )
    return Problem(question, Fraction(total, 1000), steps, "units")


def wages(rng: random.Random) -> Problem:
    name = rng.choice(_NAMES)
    wage, hours, days = rng.randint(12, 40), rng.randint(4, 9), rng.randint(3, 6)
    rent, food, weeks = rng.randint(10, 40) * 5, rng.randint(8, 30) * 5, rng.randint(2, 8)
    earned = wage * hours * days
    question = (
        f"{name} earns ${wage} per hour and works {hours} hours a day, {days} days a week. Each week {name} "
        f"spends ${rent} on rent and ${food} on food. How many dollars does {name} save in {weeks} weeks?"
    )
    steps = (
        f"Weekly pay: {wage} * {hours} * {days} = {earned}",
        f"Weekly savings: {earned} - {rent} - {food} = {earned - rent - food}",
        f"Over {weeks} weeks: {earned - rent - food} * {weeks} = {(earned - rent - food) * weeks}",
    )
    return Problem(question, Fraction((earned - rent - food) * weeks), steps, "wages")


def tank(rng: random.Random) -> Problem:
    fill, drain, minutes = rng.randint(8, 30), rng.randint(2, 7), rng.randint(3, 12)
    start = rng.randint(1, 20) * 10
    end = start + (fill - drain) * minutes
    question = (
        f"A tank starts with {start} litres. Pipe A adds {fill} litres per minute while pipe B drains "
        f"{drain} litres per minute. How many litres are in the tank after {minutes} minutes?"
    )
    steps = (
        f"Net rate: {fill} - {drain} = {fill - drain} litres per minute",
        f"Added: {fill - drain} * {minutes} = {(fill - drain) * minutes}",
        f"In the tank: {start} + {(fill - drain) * minutes} = {end}",
    )
    return Problem(question, Fraction(end), steps, "rates")


# ---- Level 3: fractions and longer chains ------------------------------------------------------------------


def _fraction(rng: random.Random) -> Fraction:
    den = rng.randint(2, 12)
    return Fraction(rng.randint(1, 2 * den), den)


def fraction_expression(rng: random.Random) -> Problem:
    leaves = [_fraction(rng) for _ in range(rng.randint(3, 4))]
    expr: Expr = leaves[0]
    for leaf in leaves[1:]:
        op = rng.choice("+-*/")
        expr = (op, expr, leaf) if rng.random() < 0.6 else (op, leaf, expr)
    return _expression_problem(expr, "fraction_expression")


def chain(rng: random.Random) -> Problem:
    value = Fraction(rng.randint(2, 30))
    lines, steps = [f"Start with {value}."], []
    for _ in range(rng.randint(6, 8)):
        op = rng.choice("+-*/")
        operand = _fraction(rng) if rng.random() < 0.4 else Fraction(rng.randint(2, 12))
        words = {"+": "add", "-": "subtract", "*": "multiply by", "/": "divide by"}[op]
        new = _OPS[op](value, operand)
        lines.append(f"Then {words} {_render(operand)}.")
        steps.append(f"{_render(value)} {op} {_render(operand)} = {_render(new)}")
        value = new
    question = " ".join(lines) + " What number do you end with?"
    return Problem(question, value, tuple(steps), "chain")


def fraction_word(rng: random.Random) -> Problem:
    dens = rng.sample((2, 3, 4, 5, 6, 8), 3)
    a, b, c = (Fraction(rng.randint(1, d - 1), d) for d in dens)
    total = dens[0] * dens[1] * dens[2] * rng.randint(1, 6)
    sport = total * a
    team = sport * b
    choir = team * c
    question = (
        f"A school has {total} students. {_ratio(a)} of them play a sport, {_ratio(b)} of those play "
        f"football, and {_ratio(c)} of the football players also sing in the choir. How many students play "
        "football and sing in the choir?"
    )
    steps = (
        f"Sport: {total} * {_ratio(a)} = {_ratio(sport)}",
        f"Football: {_ratio(sport)} * {_ratio(b)} = {_ratio(team)}",
        f"Choir: {_ratio(team)} * {_ratio(c)} = {_ratio(choir)}",
    )
    return Problem(question, choir, steps, "fraction_word")


GENERATORS: dict[int, tuple[Callable[[random.Random], Problem], ...]] = {
    -1: (small_add_sub,),
    0: (two_operand,),
    1: (parenthesised,),
    2: (shopping, discount, travel, ages, flour, wages, tank),
    3: (fraction_expression, chain, fraction_word),
}


def task_answer(task: Task) -> Fraction:
    """The exact answer stored in `task.metadata["answer"]`."""
    return Fraction(task.metadata["answer"])


def _problem_task(problem: Problem, task_id: str, level: int) -> Task:
    metadata = {
        "answer": str(problem.answer),
        "steps": list(problem.steps),
        "kind": problem.kind,
        "source": "procedural",
    }
    instruction = ANSWER_ONLY if level == -1 else INSTRUCTION
    return Task(task_id, "math", f"{problem.question}\n\n{instruction}", metadata, level)


def generate_task(seed: int, index: int, level: int) -> Task:
    """Task `index` of `seed` at `level`: the same arguments always give the same task."""
    rng = random.Random(f"math:{seed}:{index}:{level}")
    generator: Callable[[random.Random], Problem] = rng.choice(GENERATORS[level])
    return _problem_task(generator(rng), f"math/{seed}/{index}/L{level}", level)


def record_to_task(record: Mapping[str, Any], task_id: str, *, difficulty: int = GSM8K_LEVEL) -> Task:
    """A GSM8K-style record ({"question", "answer": "<rationale>\\n#### <number>"}) as a math `Task`."""
    question, solution = _text(record["question"]), _text(record["answer"])
    rationale, sep, final = solution.rpartition("####")
    value = answers.parse_number(final) if sep else None
    if value is None:
        raise ValueError(f"{task_id}: the answer must end with '#### <number>', got {solution[-80:]!r}")
    metadata = {
        "answer": str(value),
        "steps": [line for line in _CALCULATOR.sub("", rationale).strip().splitlines() if line.strip()],
        "kind": "gsm8k",
        "source": "gsm8k",
    }
    return Task(task_id, "math", f"{question.strip()}\n\n{INSTRUCTION}", metadata, difficulty)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def load_gsm8k_jsonl(path: str | os.PathLike[str]) -> list[Task]:
    """One task per non-empty line of a JSONL file with "question" and "answer" (ending "#### <number>")."""
    path = Path(path)
    tasks = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                tasks.append(record_to_task(json.loads(line), f"{path.stem}/{line_no}"))
    return tasks


def load_tfds(
    name: str = "gsm8k", split: str = "test", data_dir: str | os.PathLike[str] | None = None
) -> list[Task]:
    """Tasks from a prepared tfds dataset read through `tfds.data_source` (array_record), offline.

    `data_dir` must already hold the prepared dataset (e.g. `tfds build gsm8k --file_format=array_record
    --data_dir=...` on a machine with network access); nothing is downloaded here.
    """
    if data_dir is None or not Path(data_dir).is_dir():
        raise FileNotFoundError(
            f"load_tfds({name!r}, {split!r}): data_dir={data_dir!r} is not a directory; prepare the dataset "
            "offline first (tfds build --file_format=array_record --data_dir=DIR) and pass that DIR"
        )
    import tensorflow_datasets as tfds  # lazily: importing envs must stay light and JAX-free

    try:
        source = tfds.data_source(name, split=split, data_dir=os.fspath(data_dir), download=False)
    except Exception as e:  # tfds raises several unrelated types for "not prepared here"
        raise FileNotFoundError(
            f"load_tfds: no prepared {name!r} split {split!r} under {data_dir}: {e}"
        ) from e
    return [record_to_task(source[i], f"{name}/{split}/{i}") for i in range(len(source))]


DATA_SPLITS = ("train", "test")


class MathEnvironment(SingleTurnEnvironment):
    """Procedural math tasks (levels -1 to 3); or data tasks, unsplit (`tasks`, `jsonl_path`) or kept in their
    train and test splits (`train_jsonl`, `test_jsonl`, `tfds_name` + `tfds_data_dir`); see the module
    docstring. Split sources may be combined (each split is the concatenation of its sources)."""

    name = "math"
    levels = (-1, 0, 1, 2, 3)
    level_seed = "math-levels"
    data_splits: tuple[str, ...] = ()  # ("train", "test") when the data comes split

    def __init__(
        self,
        tasks: Sequence[Task] | None = None,
        *,
        jsonl_path: str | os.PathLike[str] | None = None,
        train_jsonl: str | os.PathLike[str] | None = None,
        test_jsonl: str | os.PathLike[str] | None = None,
        tfds_name: str | None = None,
        tfds_data_dir: str | os.PathLike[str] | None = None,
    ):
        unsplit = list(tasks or [])
        if jsonl_path is not None:
            unsplit += load_gsm8k_jsonl(jsonl_path)
        jsonl = {"train": train_jsonl, "test": test_jsonl}
        if tfds_name is None and tfds_data_dir is not None:
            raise ValueError("math: tfds_data_dir given without tfds_name (e.g. tfds_name='gsm8k')")
        self.split_tasks: dict[str, list[Task]] = {}
        if tfds_name is not None or any(path is not None for path in jsonl.values()):
            if unsplit:
                raise ValueError(
                    "math: give either unsplit data (tasks / jsonl_path: a hash fraction is held out for "
                    "evaluation) or split data (train_jsonl / test_jsonl / tfds_name), not both"
                )
            for split in DATA_SPLITS:
                data = [] if jsonl[split] is None else load_gsm8k_jsonl(jsonl[split])
                if tfds_name is not None:
                    data += load_tfds(tfds_name, split, tfds_data_dir)
                self.split_tasks[split] = data
            self.data_splits = DATA_SPLITS
        self.tasks = unsplit or [t for split in self.split_tasks.values() for t in split]
        if self.tasks:
            self.levels = tuple(sorted({t.difficulty for t in self.tasks}))

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]], *, prefix: str = "record") -> MathEnvironment:
        """An environment serving GSM8K-style records ({"question", "answer"}), unsplit."""
        return cls(tasks=[record_to_task(r, f"{prefix}/{i}") for i, r in enumerate(records)])

    def sample_tasks(
        self, seed: int, n: int, *, difficulty: int | None = None, split: str | None = None
    ) -> list[Task]:
        """`n` tasks of `seed`; with split data, of `split` ("train" or "test"; default "train")."""
        if difficulty is not None and difficulty not in self.levels:
            raise ValueError(f"{self.name}: difficulty {difficulty} not in levels {self.levels}")
        if self.data_splits:
            split = split or "train"
            if split not in self.data_splits:
                raise ValueError(f"math: split={split!r}; use one of {self.data_splits}")
            return self._sample_data(self.split_tasks[split], seed, n, difficulty, split)
        if split is not None:
            raise ValueError(
                f"math: split={split!r} needs split data (train_jsonl / test_jsonl or tfds_name); this "
                "environment serves " + ("unsplit data" if self.tasks else "procedural tasks")
            )
        if self.tasks:
            return self._sample_data(self.tasks, seed, n, difficulty, None)
        return super().sample_tasks(seed, n, difficulty=difficulty)

    task_at = staticmethod(generate_task)

    @staticmethod
    def _sample_data(
        tasks: Sequence[Task], seed: int, n: int, difficulty: int | None, split: str | None
    ) -> list[Task]:
        pool = [t for t in tasks if difficulty is None or t.difficulty == difficulty]
        if not pool:
            level = "" if difficulty is None else f" of difficulty {difficulty}"
            where = "" if split is None else f" in the {split!r} split (give {split}_jsonl or tfds_name)"
            raise ValueError(f"math: no data tasks{level}{where}")
        rng = random.Random(f"math-data:{seed}")
        return rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)

    def reference_solution(self, task: Task) -> str:
        """The worked steps and the boxed answer; a task without steps (level -1): the boxed answer."""
        boxed = f"\\boxed{{{answers.format_number(task_answer(task))}}}"
        steps = "\n".join(task.metadata.get("steps", []))
        return f"{steps}\n\nThe final answer is {boxed}." if steps else boxed

    def score(self, task: Task, completion: str) -> Score:
        return answers.graded_score(
            completion,
            task_answer(task),
            percent=bool(task.metadata.get("percent", False)),
            tolerance=task.metadata.get("tolerance"),
        )
