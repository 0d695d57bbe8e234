"""The answer parser (hand-written golden cases) and the math domain: levels, determinism, data loaders."""

import json
import subprocess
import sys
from fractions import Fraction

import pytest

from envs import registry
from envs.domains import answers
from envs.domains.math_env import MathEnvironment, load_gsm8k_jsonl, load_tfds, task_answer

F = Fraction

GOLDEN = [
    ("\\boxed{42}", F(42)),
    ("Work... so the result is \\boxed{-17}.", F(-17)),
    ("\\boxed{\\frac{3}{4}}", F(3, 4)),
    ("\\boxed{\\dfrac{-3}{4}}", F(-3, 4)),
    ("$\\boxed{-\\frac{10}{4}}$", F(-5, 2)),
    ("\\boxed{{3}}", F(3)),
    ("\\boxed{\\text{5 apples}}", F(5)),
    ("\\boxed{1,234,567}", F(1234567)),
    ("\\boxed{0.75}", F(3, 4)),
    ("\\boxed{12\\%}", F(12, 100)),
    ("Answer: 7/8", F(7, 8)),
    ("**Final Answer:** $\\$1,234.50$", F(246900, 200)),
    ("answer: -0.5 km", F(-1, 2)),
    ("Answer: 12/4 = 3", F(3)),  # one distinct value, written twice
    ("step 1\nstep 2\n#### 72", F(72)),
    ("#### 1,000", F(1000)),
    ("The answer is 3.5.", F(7, 2)),
    ("The answer is not obvious at first. We find the answer is 12.", F(12)),
    ("\\boxed{3} and again \\boxed{3}", F(3)),
    ("Final answer: \\boxed{9}", F(9)),
    ("Answer: let me think step by step.\n\\boxed{5}", F(5)),  # a number-less "Answer:" line is prose
    ("\\boxed{\\boxed{5}}", F(5)),
    ("42", F(42)),
    ("  -7/3.  ", F(-7, 3)),
    ("$15", F(15)),
]

SEVERAL = [
    "\\boxed{3} or maybe \\boxed{4}",
    "Answer: 3 or 4",
    "Answer: 3, 4, 5",
    "The answer is 3 or 4.",
    "\\boxed{3, 4}",
    "\\boxed{5}\nAnswer: 6",
    "#### 2\n#### 3",
    "Answer: 1,2",  # not 12: "1,2" is two numbers
]

NO_ANSWER = [
    "",
    "   \n",
    "PASS",
    "OK",
    "I think it is 42",
    "Put the answer in \\boxed{}.",
    "\\boxed{5",
    "\\boxed{x}",
]


@pytest.mark.parametrize("completion,expected", GOLDEN)
def test_parser_golden(completion, expected):
    result = answers.parse_answer(completion)
    assert (result.status, result.value) == ("ok", expected), result.reason


@pytest.mark.parametrize("completion", SEVERAL)
def test_several_candidates_are_a_format_error(completion):
    result = answers.grade(completion, F(3))
    assert (result.status, result.reward) == ("format_error", 0.0), result


@pytest.mark.parametrize("completion", NO_ANSWER)
def test_no_answer_is_a_format_error(completion):
    result = answers.grade(completion, F(42))
    assert (result.status, result.reward, result.value) == ("format_error", 0.0, None), result


def test_percent_and_tolerance():
    assert answers.parse_answer("\\boxed{12.5\\%}", percent=True).value == F(25, 2)
    assert answers.parse_answer("\\boxed{12.5}", percent=True).value == F(25, 2)
    assert answers.grade("\\boxed{0.333}", F(1, 3)).status == "wrong"
    assert answers.grade("\\boxed{0.333}", F(1, 3), tolerance="0.001").status == "ok"
    assert answers.grade("\\boxed{0.33}", F(1, 3), tolerance="0.001").status == "wrong"


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{5} " * 100_000,
        "Answer: 5\n" * 100_000,
        "the answer is 5 " * 100_000,
        "\\boxed{" * 100_000,
        "\\boxed{" * 100_000 + "}" * 100_000,
    ],
)
def test_adversarial_completions_are_cheap_and_score_zero(completion):
    # Many markers are a format error after reading MAX_MARKERS + 1; nesting is matched in one pass.
    result = answers.grade(completion, F(5))
    assert (result.status, result.reward) == ("format_error", 0.0), result.reason


def test_plain_number_rule_never_fires_on_long_text():
    long_numbers = " ".join(str(i) for i in range(200))
    assert answers.parse_answer(long_numbers).status == "format_error"
    assert answers.parse_answer("7" * (answers.PLAIN_MAX_CHARS + 1)).status == "format_error"


@pytest.mark.parametrize("value", [F(0), F(-5), F(3, 4), F(-1, 8), F(1, 3), F(22, 7), F(1234567, 100)])
def test_format_number_round_trips(value):
    assert answers.parse_answer(f"\\boxed{{{answers.format_number(value)}}}").value == value


def test_round_half_away():
    # 12.25 -> 12.3 and -12.25 -> -12.3 (halves away from zero); 12.24 -> 12.2; 0.005 -> 0.01 at 2 places.
    assert answers.round_half_away(F(1225, 100), 1) == F(123, 10)
    assert answers.round_half_away(F(-1225, 100), 1) == F(-123, 10)
    assert answers.round_half_away(F(1224, 100), 1) == F(122, 10)
    assert answers.round_half_away(F(5, 1000), 2) == F(1, 100)


@pytest.fixture(scope="module")
def env():
    return registry.make("math")


def test_same_seed_same_tasks(env):
    assert env.sample_tasks(7, 20) == env.sample_tasks(7, 20)
    assert env.sample_tasks(7, 20) != env.sample_tasks(8, 20)
    assert {t.difficulty for t in env.sample_tasks(7, 60)} == {-1, 0, 1, 2, 3}


@pytest.mark.parametrize("level", [-1, 0, 1, 2, 3])
def test_every_level_is_solvable_and_strict(env, level):
    tasks = env.sample_tasks(11, 50, difficulty=level)
    assert all(t.difficulty == level for t in tasks)
    for task in tasks:
        ref = env.score(task, env.reference_solution(task))
        assert (ref.reward, ref.status) == (1.0, "ok"), (task.prompt, ref)
        assert F(ref.details["parsed"]) == task_answer(task)
        wrong = env.score(task, f"\\boxed{{{answers.format_number(task_answer(task) + 1)}}}")
        assert (wrong.reward, wrong.status) == (0.0, "wrong")
        for probe in ("", task.prompt, "PASS", f"{task.prompt}\n{task.prompt}"):
            hacked = env.score(task, probe)
            assert (hacked.reward, hacked.status) == (0.0, "format_error"), (probe, hacked)
        other = answers.format_number(task_answer(task) + 1)
        both = f"\\boxed{{{task.metadata['answer']}}} or \\boxed{{{other}}}"
        assert env.score(task, both).status == "format_error"


def test_level_contents(env):
    kinds = {
        level: {t.metadata["kind"] for t in env.sample_tasks(3, 60, difficulty=level)} for level in range(4)
    }
    assert kinds[0] == {"two_operand"}
    assert kinds[1] == {"parenthesised"}
    assert kinds[2] >= {"shopping", "travel", "ages", "wages"}
    assert kinds[3] == {"fraction_expression", "chain", "fraction_word"}
    assert all("(" in t.prompt for t in env.sample_tasks(3, 20, difficulty=1))


def test_easiest_level(env):
    # Level -1: "Compute a + b." / "Compute a - b." with a in 10..99, b in 1..9, through the level's prompt
    # format (question, blank line, the level's short instruction); its reference is the boxed answer alone.
    tasks = env.sample_tasks(5, 400, difficulty=-1)
    seen = set()
    for task in tasks:
        question, instruction = task.prompt.split("\n\n")
        assert instruction == "Answer in \\boxed{}."
        a, op, b = question.removeprefix("Compute ").removesuffix(".").split(" ")
        assert 10 <= int(a) <= 99 and 1 <= int(b) <= 9 and op in "+-"
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert task_answer(task) == expected
        assert env.reference_solution(task) == f"\\boxed{{{expected}}}"
        assert env.score(task, f"The answer is {expected}.").reward == 1.0
        assert env.score(task, str(expected - 1)).status == "wrong"
        seen.add((a, op, b))
    assert len(seen) > 300  # of 90 * 2 * 9 = 1620 prompts: a pool for three splits
    assert {t.metadata["kind"] for t in tasks} == {"small_add_sub"}


def test_episode_interface(env):
    task = env.sample_tasks(0, 1)[0]
    episode = env.step(env.reset(task), env.reference_solution(task))
    assert episode.done and env.score_episode(task, episode).reward == 1.0


GSM8K_LINES = [
    {
        "question": "Tom has 3 bags of 12 apples. He eats 5. How many are left?",
        "answer": "3*12=<<3*12=36>>36\n#### 31",
    },
    {"question": "A shop sells 1,200 pens a day for 3 days.", "answer": "1200*3=3600\n#### 3,600"},
    {"question": "Temperature drops from 4 by 10.", "answer": "4-10=-6\n#### -6"},
]


def test_gsm8k_jsonl_round_trip(tmp_path):
    path = tmp_path / "gsm8k_test.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in GSM8K_LINES) + "\n\n")
    tasks = load_gsm8k_jsonl(path)
    assert [task_answer(t) for t in tasks] == [F(31), F(3600), F(-6)]
    assert all(t.prompt.startswith(r["question"]) for t, r in zip(tasks, GSM8K_LINES))
    assert "<<" not in tasks[0].metadata["steps"][0]
    env = MathEnvironment(jsonl_path=path)
    assert env.levels == (2,)
    for task in env.sample_tasks(0, 5):
        assert env.score(task, env.reference_solution(task)).reward == 1.0
        assert env.score(task, "#### 999999").status == "wrong"
    assert env.sample_tasks(1, 3) == env.sample_tasks(1, 3)
    restored = [type(t).from_json(t.to_json()) for t in tasks]
    assert restored == tasks
    assert MathEnvironment.from_records(GSM8K_LINES).score(tasks[1], "\\boxed{3600}").reward == 1.0


TEST_LINES = [
    {"question": f"Held-out problem {i}: what is {i} + {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"}
    for i in range(1, 5)
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _questions(tasks):
    return {t.prompt.split("\n\n")[0] for t in tasks}


def test_gsm8k_train_and_test_files_stay_split(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_LINES)
    test = write_jsonl(tmp_path / "test.jsonl", TEST_LINES)
    env = MathEnvironment(train_jsonl=train, test_jsonl=test)
    assert env.data_splits == ("train", "test") and env.levels == (2,)
    drawn = {
        s: [t for seed in range(40) for t in env.sample_tasks(seed, 2, split=s)] for s in ("train", "test")
    }
    assert _questions(drawn["train"]) == {r["question"] for r in GSM8K_LINES}
    assert _questions(drawn["test"]) == {r["question"] for r in TEST_LINES}
    assert env.sample_tasks(3, 2) == env.sample_tasks(3, 2, split="train")  # the default is train
    for task in drawn["test"][:4]:  # scoring needs no split: the answer is in the task
        assert env.score(task, env.reference_solution(task)).reward == 1.0
    with pytest.raises(ValueError, match="split='eval'"):
        env.sample_tasks(0, 1, split="eval")


def test_split_data_refuses_ambiguous_or_missing_sources(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_LINES)
    with pytest.raises(ValueError, match="not both"):
        MathEnvironment(jsonl_path=train, test_jsonl=train)
    with pytest.raises(ValueError, match="tfds_name"):
        MathEnvironment(tfds_data_dir=tmp_path)
    only_train = MathEnvironment(train_jsonl=train)
    assert len(only_train.sample_tasks(0, 2, split="train")) == 2
    with pytest.raises(ValueError, match="'test' split .*test_jsonl"):
        only_train.sample_tasks(0, 1, split="test")
    with pytest.raises(ValueError, match="needs split data"):
        MathEnvironment().sample_tasks(0, 1, split="test")
    with pytest.raises(ValueError, match="needs split data"):
        MathEnvironment(jsonl_path=train).sample_tasks(0, 1, split="train")


def test_gsm8k_record_without_final_answer_is_rejected(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "no marker here"}) + "\n")
    with pytest.raises(ValueError, match="####"):
        load_gsm8k_jsonl(path)


def test_tfds_without_data_dir_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="array_record"):
        load_tfds("gsm8k", "test", None)
    with pytest.raises(FileNotFoundError, match="array_record"):
        load_tfds("gsm8k", "test", tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no prepared"):
        load_tfds("tiny_gsm_never_built", "test", tmp_path)


def test_tfds_array_record_round_trip(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")

    class TinyGsmForTest(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            text = tfds.features.Text()
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict({"question": text, "answer": text})
            )

        def _split_generators(self, dl_manager):
            return {
                "train": self._generate_examples(GSM8K_LINES),
                "test": self._generate_examples(TEST_LINES),
            }

        def _generate_examples(self, records):
            yield from enumerate(records)

    TinyGsmForTest(data_dir=tmp_path, file_format="array_record").download_and_prepare()
    assert list(tmp_path.rglob("*.array_record*"))
    tasks = load_tfds("tiny_gsm_for_test", "train", tmp_path)
    assert sorted(task_answer(t) for t in tasks) == [F(-6), F(31), F(3600)]
    env = MathEnvironment(tasks=tasks)
    assert all(env.score(t, env.reference_solution(t)).reward == 1.0 for t in tasks)
    # tfds_name serves the dataset's train split for training and its test split for evaluation.
    split = MathEnvironment(tfds_name="tiny_gsm_for_test", tfds_data_dir=tmp_path)
    assert split.data_splits == ("train", "test")
    for name, records in (("train", GSM8K_LINES), ("test", TEST_LINES)):
        drawn = [t for seed in range(40) for t in split.sample_tasks(seed, 2, split=name)]
        assert _questions(drawn) == {r["question"] for r in records}
        assert all(split.score(t, split.reference_solution(t)).reward == 1.0 for t in drawn[:4])


def test_envs_domains_import_neither_jax_nor_tfds():
    code = (
        "import sys, envs.domains.math_env, envs.domains.finance.env\n"
        "bad = [m for m in ('jax', 'tensorflow_datasets', 'tensorflow') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2])
    )
