"""Learning that counts: the before/after table, GRPO raising the training reward through the main
job, and (slow) `make demo`'s held-out gain."""

import json
import os

import numpy as np
import pytest

from configs import grpo
from rl import evaluate


def _row(tasks, p1, pk, k=4):
    return {"tasks": tasks, "k": k, "pass@1": p1, "pass@k": pk}


def test_format_before_after():
    before = {"math": _row(150, 0.25, 0.5), "arith": _row(100, 0.5, 0.75)}
    after = {"math": _row(150, 0.875, 0.9375), "arith": _row(100, 0.5, 0.75)}
    greedy = {"math": _row(150, 0.625, 0.625, k=1)}
    table = evaluate.format_before_after(before, after, greedy, {"math": _row(150, 0.9, 0.9, k=1)})
    # Gains by hand: math 87.5 - 25 = +62.5 points, arith 0; arith has no greedy numbers ("-").
    assert table.splitlines() == [
        "domain  prompts  greedy before  greedy after  pass@1 before  pass@1 after   gain  pass@4 before"
        "  pass@4 after",
        "arith       100              -             -          0.500         0.500   +0.0          0.750"
        "         0.750",
        "math        150          0.625         0.900          0.250         0.875  +62.5          0.500"
        "         0.938",
    ]


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_grpo_raises_the_training_reward(tmp_path):
    # The main job on the `test` config (tiny model, the debug domain's "Reply with: ok": reward 1 for "ok"),
    # a 3-step warm start that leaves the reward near 1/2, then 10 GRPO steps of 4 groups of 8 at seed 0.
    # Measured (1 CPU device, load ~12): the reward per step went 0.50 0.53 0.63 ... 0.85 0.85 0.92, the
    # mean of steps 8-10 0.29 above that of steps 1-3. The margin asked is 0.15, half of it: a real rise of
    # the reward of every sample drawn (filtered groups included), never reached by noise around a flat
    # policy at these 96 samples per three steps (binomial sd of a mean of 96 at p=1/2: 0.05).
    from rl import train

    cfg = grpo.get_config("test")
    rl = cfg.rl
    rl.sft.steps, rl.steps, rl.checkpoint_every = 3, 10, 10
    rl.prompts_per_step, rl.group_size = 4, 8
    cfg.batch_size = rl.prompts_per_step * rl.group_size
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 10
    reward = [r["reward"] for r in _records(tmp_path) if "reward" in r]
    assert len(reward) == 10
    assert np.mean(reward[-3:]) >= np.mean(reward[:3]) + 0.15, reward


@pytest.mark.slow
def test_demo_gains_on_heldout(tmp_path):
    # `make demo` (configs/grpo.py:demo) through the main job, whole: 5.5 min on 2 idle cores. Runs of this
    # recipe measured held-out pass@1 gains of +52.7 / +55.0 / +42.2 (math level -1) and +48.0 / +47.5 /
    # +44.5 (strings) points (benchmarks/results/demo.jsonl; the third on the inversion sampler); the bar
    # asked is the issue's, +25 points per domain, under any of them, on 150 distinct held-out prompts per
    # domain (k=4 samples: binomial sd of a pass@1 over 600 samples <= 0.02).
    from rl import train

    out = train.train(grpo.get_config("demo"), str(tmp_path))
    for domain in ("math", "strings"):
        before, after = out["before"][domain], out["after"][domain]
        assert before["tasks"] == after["tasks"] == 150  # distinct held-out prompts
        assert after["pass@1"] - before["pass@1"] >= 0.25, (domain, before, after)


def test_noisy_teacher_misses_a_digit_first():
    """rl.sft.noise's miss: one digit of a math answer ("\\boxed{55}" keeps its format, one of its 2 digits
    changes), one letter of a string answer (no digits there), nothing in a text with neither."""
    from rl import warm_start

    rng = np.random.default_rng(0)
    for _ in range(200):
        out = warm_start.corrupt("\\boxed{55}", rng)
        assert out.startswith("\\boxed{") and out.endswith("}") and out != "\\boxed{55}"
        digits = out[len("\\boxed{") : -1]
        assert len(digits) == 2 and digits.isdigit() and sum(a != b for a, b in zip(digits, "55")) == 1
        word = warm_start.corrupt("kqbdx", rng)
        assert len(word) == 5 and word.isalpha() and sum(a != b for a, b in zip(word, "kqbdx")) == 1
    assert warm_start.corrupt("+=- ", rng) == "+=- "
