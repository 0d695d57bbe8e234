"""Command-line overrides inside config blocks (configs/cli.py): rl.levels.<domain>, rl.env.<domain>.<kwarg>,
rl.sft.optim.<field> ... reach the main job, which config_flags alone refuses with a bare KeyError."""

import json
import os
import subprocess
import sys

import main_job
import pytest
import xla_env

from configs import cli, grpo, schema
from configs.errors import UserError
from rl import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_take_block_overrides_keeps_every_other_flag(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_TAKEN", [])
    argv = [
        "train.py",
        "--config=configs/grpo.py:test",
        "--config.rl.steps=3",  # a plain field: config_flags sets it
        "--config.rl.levels.math=(1, 2)",
        "--config.rl.env.math.train_jsonl",  # the two-argument form
        "gsm8k.jsonl",
        "-config.rl.sft.optim.lr=1e-3",
        "--config.rl.levels={'math': (3,)}",  # a whole block: config_flags sets it
        "--workdir=w",
    ]
    taken = cli.take_block_overrides(argv)
    assert taken == [
        ("rl.levels.math", "(1, 2)"),
        ("rl.env.math.train_jsonl", "gsm8k.jsonl"),
        ("rl.sft.optim.lr", "1e-3"),
    ]
    assert argv == [
        "train.py",
        "--config=configs/grpo.py:test",
        "--config.rl.steps=3",
        "--config.rl.levels={'math': (3,)}",
        "--workdir=w",
    ]
    assert taken == cli._TAKEN
    with pytest.raises(SystemExit) as exit_info:
        cli.take_block_overrides(["train.py", "--config.rl.levels.math"])
    assert exit_info.value.code == 2
    assert "error: --config.rl.levels.math needs a value" in capsys.readouterr().err


def test_every_override_without_a_config_file(monkeypatch):
    monkeypatch.setattr(cli, "_TAKEN", [])
    argv = ["evaluate.py", "--workdir=w", "--config.rl.eval.k=2", "--config.rl.levels.math=(1,)"]
    assert not cli.config_given(argv)
    assert cli.config_given(["x", "--config", "configs/grpo.py:test"])
    assert cli.config_given(["x", "-config=configs/grpo.py"])
    assert not cli.config_given(["x", "--config.rl.steps=1", "--configs=1"])
    assert cli.take_block_overrides(argv, every=True) == [("rl.eval.k", "2"), ("rl.levels.math", "(1,)")]
    assert argv == ["evaluate.py", "--workdir=w"]
    assert cli.taken() == [("rl.eval.k", "2"), ("rl.levels.math", "(1,)")]


def test_block_paths_are_the_schema_blocks():
    assert set(cli.block_paths()) == {
        "rl.levels",
        "rl.static_weights",
        "rl.env",
        "rl.draft_model",
        "rl.sft.weights",
        "rl.sft.optim",
    }


def test_overrides_create_keys_on_a_locked_config_and_are_checked():
    cfg = grpo.get_config("test")
    cfg.lock()
    cli.with_block_overrides(
        cfg,
        [
            ("rl.levels.debug", "(0,)"),
            ("rl.static_weights.debug", "2"),
            ("rl.sft.optim.lr", "1e-3"),
            ("rl.draft_model.d_model", "32"),
            ("rl.env.terminal.disturbance", "true"),
            ("rl.env.math.train_jsonl", "data/gsm8k.jsonl"),
        ],
    )
    assert cfg.rl.levels.debug == (0,)
    assert cfg.rl.static_weights.debug == 2
    assert cfg.rl.sft.optim.lr == 0.001
    assert cfg.rl.draft_model.to_dict() == {"num_layers": 1, "d_model": 32}
    assert cfg.rl.env.terminal.disturbance is True
    assert cfg.rl.env.code.reward == "all_or_nothing"  # the block's other defaults stay
    assert cfg.rl.env.math.train_jsonl == "data/gsm8k.jsonl"
    schema.check(cfg.rl, grpo.RL, "rl")
    fresh = cli.with_block_overrides(grpo.get_config("test"), [("rl.levels.debug", "0")])
    with pytest.raises(schema.ConfigError, match=r"rl.levels.debug=0 must be a non-empty tuple of ints"):
        validate.validate(fresh)


def test_override_errors_name_the_flag():
    cfg = grpo.get_config("test")
    with pytest.raises(UserError, match=r"--config.rl.env.code.reward=3: .*reward"):
        cli.with_block_overrides(cfg, [("rl.env.code.reward", "3")])  # a str field given an int
    with pytest.raises(UserError, match=r"config.rl.sft.optim.lr is 0.001, not a block of keys"):
        cli.with_block_overrides(cfg, [("rl.sft.optim.lr", "1e-3"), ("rl.sft.optim.lr.x", "1")])
    with pytest.raises(UserError, match=r"--config.rl.levels.math overrides a config, but no --config"):
        cli.with_block_overrides(None, [("rl.levels.math", "(1,)")])
    assert cli.with_block_overrides(None, []) is None


def test_main_job_takes_block_overrides_from_its_command_line(tmp_path):
    """`python -m rl.train` with block keys the test config does not have: the run's config.json has them
    (no SFT or GRPO steps: the overrides are read before any work)."""
    cmd = main_job.command(tmp_path) + [
        "--config.rl.steps=0",
        "--config.rl.sft.steps=0",
        "--config.rl.levels.debug=(0,)",
        "--config.rl.sft.optim.lr",
        "0.002",
        "--config.rl.env.debug.delay_median_s=0.0",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_env.child_flags(1))
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(ROOT, ".jax_cache")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    with open(tmp_path / "config.json") as f:
        rl = json.load(f)["rl"]
    assert rl["levels"] == {"debug": [0]}
    assert rl["sft"]["optim"] == {"lr": 0.002}
    assert rl["env"]["debug"] == {"delay_median_s": 0.0}
    # rl.evaluate without --config: every override applies to the run's config.json (here 8 tasks a domain)
    assert json.loads((tmp_path / "config.json").read_text())["rl"]["eval"]["n_tasks"] == 8
    out = tmp_path / "eval.json"
    evaluate = [sys.executable, "-m", "rl.evaluate", f"--workdir={tmp_path}", "--k=1", f"--out={out}"]
    subprocess.run(
        evaluate + ["--config.rl.eval.n_tasks=2"], cwd=ROOT, check=True, capture_output=True, timeout=300
    )
    assert json.loads(out.read_text())["results"]["debug"]["tasks"] == 2
