"""rl.evaluate (pass@k, per-domain aggregation, table, a real evaluation of the tiny model) and rl.plot."""

import json
import math

import pytest
from engines import small_engine, tiny_target

from configs.runs import read_config
from envs import STATUSES, Score, Task, registry
from envs.pool import EnvPool
from inference import Engine, SamplingParams
from model.io.tokenizer import ByteTokenizer
from rl import evaluate, metrics, plot

# ---------------------------------------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 1, 1, 0.25),  # k = 1 is c/n: 1 - C(3,1)/C(4,1) = 1 - 3/4
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 4, 1 - 35 / 210),  # C(7,4) = 35, C(10,4) = 210
        (4, 0, 4, 0.0),  # never solved
        (4, 4, 2, 1.0),  # always solved
        (2, 1, 2, 1.0),  # n - c < k: every k-subset holds a success (C(1,2) = 0)
        (4, 1, 4, 1.0),  # n = k: 1 if any success
    ],
)
def test_pass_at_k_golden(n, c, k, expected):
    assert evaluate.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 1, 5), (4, 5, 2), (4, -1, 2), (4, 1, 0)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        evaluate.pass_at_k(n, c, k)


# ---------------------------------------------------------------------------------------------------------
# Aggregation from hand-made scores
# ---------------------------------------------------------------------------------------------------------


def _outcomes() -> list[evaluate.Outcome]:
    a, b = Task("a", "math", "p"), Task("b", "math", "p")
    c = Task("c", "code", "p")
    scores = [
        (a, Score(1.0, "ok"), 10, 0.0),
        (a, Score(0.0, "wrong"), 20, 0.0),
        (a, Score(0.0, "wrong"), 30, 0.0),
        (a, Score(0.0, "format_error"), 40, 0.0),
        (b, Score(0.0, "wrong"), 5, 0.0),
        (b, Score(0.0, "timeout"), 5, 0.0),
        (b, Score(0.0, "wrong"), 5, 0.0),
        (b, Score(0.0, "wrong"), 5, 0.0),
        (c, Score(1.0, "ok"), 8, 0.5),
        (c, Score(1.0, "ok"), 8, 0.5),
        (c, Score(0.0, "crash"), 8, 2.0),
        (c, Score(0.25, "wrong"), 8, 1.0),  # partial credit (code: tests passed)
    ]
    return [
        evaluate.Outcome.from_score(t, s, generated_tokens=g, sandbox_seconds=sec) for t, s, g, sec in scores
    ]


def test_aggregate_by_hand():
    results = evaluate.aggregate(_outcomes(), k=2)
    assert sorted(results) == ["code", "math"]
    m, c = results["math"], results["code"]
    assert (m["tasks"], m["samples"], m["k"]) == (2, 8, 2)
    assert m["pass@1"] == 1 / 8
    assert m["pass@k"] == pytest.approx((0.5 + 0.0) / 2)  # task a: n=4, c=1, k=2 -> 0.5; task b: 0
    assert m["reward"] == 1 / 8
    assert m["status"] == {
        "ok": 1,
        "wrong": 5,
        "format_error": 1,
        "timeout": 1,
        "crash": 0,
        "sandbox_violation": 0,
        "env_error": 0,
    }
    assert m["generated_tokens_per_task"] == (100 + 20) / 2
    assert m["sandbox_seconds_per_task"] == 0.0
    assert c["pass@1"] == 0.5
    assert c["pass@k"] == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert c["reward"] == pytest.approx(2.25 / 4)
    assert c["status"]["ok"] == 2 and c["status"]["crash"] == 1 and c["status"]["wrong"] == 1
    assert c["sandbox_seconds_per_task"] == 4.0
    for row in results.values():
        assert list(row["status"]) == list(STATUSES)
        assert sum(row["status"].values()) == row["samples"]


def test_aggregate_rejects_unknown_status_and_too_few_samples():
    with pytest.raises(ValueError, match="'bogus'"):
        evaluate.aggregate([evaluate.Outcome("t", "math", 0.0, "bogus")], k=1)
    with pytest.raises(ValueError, match="k=2"):
        evaluate.aggregate([evaluate.Outcome("t", "math", 1.0, "ok")], k=2)


def test_table_and_flatten():
    results = evaluate.aggregate(_outcomes(), k=2)
    results["math"].update(seconds_per_task=1.5, prefix_cache_hit_rate=0.25)
    results["code"].update(seconds_per_task=0.5, prefix_cache_hit_rate=None)
    lines = evaluate.format_table(results).splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1  # aligned
    assert lines[0].split()[:5] == ["domain", "tasks", "pass@1", "pass@2", "reward"]
    assert lines[1].split()[:5] == ["code", "1", "0.500", "0.833", "0.562"]
    assert lines[2].split()[0] == "math" and lines[2].split()[-1] == "0.250"
    assert lines[1].split()[-1] == "-"
    flat = evaluate.flatten(results)
    assert flat["eval/math/pass@1"] == 1 / 8 and flat["eval/code/status/crash"] == 1.0
    assert "eval/code/prefix_cache_hit_rate" not in flat
    json.dumps(results)  # the eval.json payload


def test_missing_run_config_names_file_and_fix(tmp_path):
    from configs.errors import UserError

    with pytest.raises(UserError, match=r"--workdir=.* is not a run of rl.train \(.*config\.json not found"):
        read_config(str(tmp_path))


def test_overrides_change_a_copy_and_the_heldout_selection():
    import ml_collections

    from model.io.tokenizer import ByteTokenizer
    from rl import data

    rl = {"domains": ("arith", "strings"), "seed": 0, "chat": False, "max_prompt_len": 16, "temperature": 1.0}
    rl.update(max_new_tokens=8, levels={"arith": (2,)}, eval={"n_tasks": 3, "k": 2})
    run_cfg = ml_collections.ConfigDict({"rl": rl})
    saved = run_cfg.to_json()
    cfg = evaluate.with_overrides(run_cfg, domains=["arith"], n_tasks=2, k=4, temperature=0.0)
    assert run_cfg.to_json() == saved  # the run's config is untouched
    assert (tuple(cfg.rl.domains), cfg.rl.eval.n_tasks, cfg.rl.eval.k, cfg.rl.temperature) == (
        ("arith",),
        2,
        4,
        0.0,
    )
    assert evaluate.with_overrides(run_cfg).to_json() == saved  # nothing set: the run's own evaluation
    # --n_tasks=2 takes the first two of the trainer's held-out tasks, with the run's levels.
    tokenizer = ByteTokenizer(256)
    trainer = data.heldout_tasks(run_cfg, tokenizer)
    assert data.heldout_tasks(cfg, tokenizer) == {"arith": trainer["arith"][:2]}
    assert {t.difficulty for t in trainer["arith"]} == {2}


# ---------------------------------------------------------------------------------------------------------
# A real evaluation: tiny model, engine, environment pool
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with EnvPool(1, domains=["math", "debug"], timeout_s=30.0) as p:  # started before the model's arrays
        yield p


class _ScriptedEngine:
    """Answers prompt i, sample j of each `generate` call with `script[i][j]` and the stop token; its prefix
    cache reports 3 hits per 10 looked-up tokens per call, on top of earlier (pre-evaluation) counts."""

    def __init__(self, script: list[list[str]], tokenizer):
        self.script, self.tokenizer = script, tokenizer
        self.prefix = {"hit_tokens": 100.0, "lookup_tokens": 100.0}

    def generate(self, prompts, sampling):
        from inference import Completion

        out = []
        for i, params in enumerate(sampling):
            for j in range(params.n):
                tokens = self.tokenizer.encode(self.script[i][j]) + [params.stop_tokens[0]]
                out.append(Completion(i, tokens, [-1.0] * len(tokens), "stop", sample_index=j))
        self.prefix["hit_tokens"] += 3
        self.prefix["lookup_tokens"] += 10
        return out

    def stats(self):
        return {"prefix_cache": dict(self.prefix, hit_rate=self.prefix["hit_tokens"] / 200)}


def test_evaluate_scores_scripted_completions(pool):
    from inference import SamplingParams
    from model.io.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer(256)
    math_env = registry.make("math")
    math_tasks = math_env.sample_tasks(seed=10_000, n=2)
    tasks = {"debug": registry.make("debug").sample_tasks(seed=7, n=3), "math": math_tasks}
    scripts = {
        "debug": [["ok", "wrong"], ["wrong", "wrong"], ["???", "ok"]],
        "math": [[math_env.reference_solution(t), math_env.reference_solution(t)] for t in math_tasks],
    }
    results = {}
    for domain, domain_tasks in tasks.items():
        engine = _ScriptedEngine(scripts[domain], tokenizer)
        sampling = SamplingParams(max_new_tokens=24, seed=0)
        results.update(
            evaluate.evaluate(engine, pool, tokenizer, {domain: domain_tasks}, k=2, sampling=sampling)
        )
    d = results["debug"]
    assert d["status"] == {**dict.fromkeys(STATUSES, 0), "ok": 2, "wrong": 3, "format_error": 1}
    assert d["pass@1"] == 2 / 6 and d["reward"] == 2 / 6
    assert d["pass@k"] == pytest.approx((1 + 0 + 1) / 3)  # tasks 0 and 2 solved once in 2 samples
    # Generated tokens count the stop token: task 0 (2+1) + (5+1), task 1 2 * (5+1), task 2 (3+1) + (2+1).
    assert d["generated_tokens_per_task"] == (9 + 12 + 7) / 3
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.3)  # the delta over this call, not 103 / 110
    m = results["math"]
    assert m["status"]["ok"] == 4 and m["pass@1"] == 1.0 and m["pass@k"] == 1.0 and m["reward"] == 1.0


def test_evaluate_tiny_model_end_to_end(pool):
    cfg, _, params = tiny_target()
    engine = Engine(cfg, params, small_engine(max_seq_len=256, num_pages=128, prefill_chunk=64))
    tasks = {
        "math": registry.make("math").sample_tasks(seed=10_000, n=3),
        "debug": registry.make("debug").sample_tasks(seed=10_001, n=2),
    }
    k, max_new = 2, 24
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=0)
    results = evaluate.evaluate(engine, pool, ByteTokenizer(256), tasks, k=k, sampling=sampling)

    assert sorted(results) == ["debug", "math"]
    for domain, row in results.items():
        n_tasks = len(tasks[domain])
        assert (row["tasks"], row["samples"], row["k"]) == (n_tasks, n_tasks * k, k)
        assert sum(row["status"].values()) == n_tasks * k
        assert 0.0 <= row["pass@1"] <= row["pass@k"] <= 1.0
        assert row["pass@1"] == row["status"]["ok"] / (n_tasks * k)
        assert 0.0 <= row["reward"] <= 1.0
        # Every sample generated 1..max_new tokens (a random model rarely emits NUL, the stop token).
        assert k <= row["generated_tokens_per_task"] <= k * max_new
        assert row["sandbox_seconds_per_task"] >= 0.0 and row["seconds_per_task"] > 0.0
        assert 0.0 <= row["prefix_cache_hit_rate"] <= 1.0
        assert not any(row["status"][s] for s in ("timeout", "crash", "env_error")), row["status"]
    assert "math" in evaluate.format_table(results)


# ---------------------------------------------------------------------------------------------------------
# rl.plot
# ---------------------------------------------------------------------------------------------------------


def test_plot_writes_png(tmp_path):
    with metrics.MetricsLogger(tmp_path, tensorboard=False, stream=None) as log:
        for step in range(1, 11):
            log.log(
                step,
                {
                    "reward/math": step / 10,
                    "reward/code": math.sqrt(step) / 4 if step != 5 else float("nan"),
                    "weight/math": 0.5 + step / 40,
                    "weight/code": 0.5 - step / 40,
                    "train/loss": 1.0 / step,
                },
            )
        log.log(10, {"eval/math/pass@1": 0.75})
    records = metrics.read_metrics(tmp_path)
    steps, values = plot.series(records, plot._REWARD)["code"]
    assert 5 not in steps and len(steps) == len(values) == 9  # the NaN was logged as null and is skipped
    out = tmp_path / "curves.png"
    counts = plot.plot(records, out)
    assert counts == {"reward": 2, "eval": 1, "weight": 2}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5_000
