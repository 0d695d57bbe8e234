"""The main job on the user's own environments, named in rl.domains by import path (examples/my_envs): the
single-turn reward environment and the multi-turn guessing game, quality gate on, a short SFT warm start on
their reference solutions, then GRPO steps whose metrics carry each domain's reward under its name."""

import json
import os

from configs import grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADD = "examples.my_envs.add:AddNumbers"
GUESS = "examples.my_envs.guess:GuessNumber"


def test_main_job_trains_on_import_path_domains(tmp_path, monkeypatch):
    from envs.pool import EnvPool
    from rl import train

    monkeypatch.syspath_prepend(ROOT)  # as a user runs it: from the repository root
    actions = []  # the number of actions of each guessing episode the workers ran, turn by turn
    run_episodes = EnvPool.run_episodes

    def counted(pool, items):
        actions.extend(len(a) for task, a in items if task.domain == GUESS)
        return run_episodes(pool, items)

    monkeypatch.setattr(EnvPool, "run_episodes", counted)
    cfg = grpo.get_config("test")  # the tiny model, 24 + 8 tokens, 2 groups of 4 per step, 1 worker
    cfg.rl.domains = (ADD, GUESS)
    cfg.rl.max_turns = 2
    cfg.rl.quality_gate = True  # both examples have reference solutions
    cfg.rl.sft.steps = 2
    cfg.rl.steps = cfg.rl.checkpoint_every = 2
    out = train.train(cfg, str(tmp_path), run_eval=False)

    assert out["steps"] == 2
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if f"reward/{ADD}" in r or f"reward/{GUESS}" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # one group of each domain per step (2 prompts, each domain's share at least 1)
        assert 0.0 <= r[f"reward/{ADD}"] <= 1.0 and 0.0 <= r[f"reward/{GUESS}"] <= 1.0
    # The game replies to the untrained model's first move ("number?" to garbage) and the episode goes on:
    # every episode gets its second turn (prompt <= 13 + move <= 8 + reply 9 + 1 <= 32 tokens), none a third.
    assert set(actions) == {1, 2} and actions.count(1) == actions.count(2) >= 2 * cfg.rl.group_size
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rl"]["domains"] == [ADD, GUESS]  # what rl.evaluate reads back and resolves again


def test_quality_gate_gets_the_domains_env_options(tmp_path, monkeypatch):
    """rl.env.<domain>.<kwarg> reaches the quality gate as it reaches the workers: a domain whose constructor
    needs its option passes the gate (before, the gate made every domain with default arguments and refused
    this one, and `rl.env.code.min_isolation` was refused by the gate whose error advised setting it)."""
    from envs import registry
    from rl import train

    monkeypatch.setitem(registry._DOMAINS, "answer", "answer_env:Answer")  # tests/answer_env.py
    cfg = grpo.get_config("test")
    cfg.rl.domains = ("answer",)
    cfg.rl.env.answer = {"answer": "ok"}
    cfg.rl.quality_gate = True
    cfg.rl.sft.steps = cfg.rl.steps = 0  # the gate and the pool run; no model step is needed to tell
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 0
    assert json.loads((tmp_path / "config.json").read_text())["rl"]["env"]["answer"] == {"answer": "ok"}
