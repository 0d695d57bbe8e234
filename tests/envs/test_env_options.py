"""Environment options (`rl.env.<domain>.<kwarg>`): checked against the constructor without making the
environment, turned into constructor values (a dict of `sandbox.Limits` fields -> Limits), the same after the
config's JSON round trip, and the same in the main process and in the pool's workers."""

import dataclasses
import json

import ml_collections
import pytest

from envs import registry
from envs.domains.math_env import MathEnvironment
from envs.pool import EnvPool
from envs.sandbox import box as sandbox
from rl import data


def test_plain_values_from_a_config_dict(tmp_path):
    options = ml_collections.ConfigDict({"reward": "fraction", "limits": {"cpu_s": 2.0, "wall_s": 3.0}})
    assert registry.check_kwargs("code", options) == {
        "reward": "fraction",
        "limits": {"cpu_s": 2.0, "wall_s": 3.0},
    }
    checked = registry.check_kwargs("math", {"train_jsonl": tmp_path / "t.jsonl"})
    assert checked == {"train_jsonl": str(tmp_path / "t.jsonl")}  # a path as a string, as JSON keeps it
    assert registry.check_kwargs("debug", {}) == {}


def test_same_options_after_the_config_json_round_trip():
    cfg = ml_collections.ConfigDict({"rl": {"domains": ("code", "terminal"), "env": {}}})
    cfg.rl.env.code = {"limits": {"cpu_s": 2.0}, "max_test_timeouts": 2}
    cfg.rl.env.terminal = {"step_limits": {"wall_s": 4.0}, "max_turns": 3}
    reloaded = ml_collections.ConfigDict(json.loads(cfg.to_json_best_effort()))  # what rl.evaluate reads
    assert (
        data.env_kwargs(cfg)
        == data.env_kwargs(reloaded)
        == {
            "code": {"limits": {"cpu_s": 2.0}, "max_test_timeouts": 2},
            "terminal": {"step_limits": {"wall_s": 4.0}, "max_turns": 3},
        }
    )


def test_unknown_keyword_names_domain_and_accepted_ones():
    with pytest.raises(ValueError) as e:
        registry.check_kwargs("code", {"rewrd": "fraction"})
    assert str(e.value) == (
        "rl.env.code.rewrd: unknown keyword for domain 'code'; "
        "accepted: ['limits', 'max_test_timeouts', 'min_isolation', 'python', 'reward', 'test_timeout_s']"
    )
    with pytest.raises(ValueError, match=r"rl.env.math.tfds_split: unknown keyword .*'test_jsonl'"):
        registry.check_kwargs("math", {"tfds_split": "test"})  # gone: tfds_name serves train and test


def test_unknown_domain_lists_registered_ones():
    with pytest.raises(ValueError, match=r"rl.env.maths: unknown domain 'maths'; registered: \['arith', "):
        registry.check_kwargs("maths", {})
    cfg = ml_collections.ConfigDict({"rl": {"domains": ("math",), "env": {"maths": {"train_jsonl": "x"}}}})
    with pytest.raises(ValueError, match="unknown domain 'maths'"):  # a misspelt block is no silent no-op
        data.env_kwargs(cfg)


def test_env_kwargs_default_to_empty():
    cfg = ml_collections.ConfigDict({"rl": {"domains": ("math", "arith")}})  # no rl.env block at all
    assert data.env_kwargs(cfg) == {"math": {}, "arith": {}}
    with cfg.unlocked():
        cfg.rl.env = {
            "arith": {},
            "code": {"reward": "fraction"},
        }  # a block for a domain not trained: checked
    assert data.env_kwargs(cfg) == {"math": {}, "arith": {}}


def test_limits_from_a_dict_of_fields():
    with pytest.raises(
        ValueError, match=r"rl.env.code.limits.cpu: unknown field of Limits; accepted: \['cpu_s'"
    ):
        registry.check_kwargs("code", {"limits": {"cpu": 2.0}})
    env = registry.make("code", **registry.check_kwargs("code", {"limits": {"cpu_s": 2.0, "wall_s": 3.0}}))
    assert env.limits == sandbox.Limits(cpu_s=2.0, wall_s=3.0)
    terminal = registry.make("terminal", step_limits={"wall_s": 4.0})
    assert terminal.step_limits == sandbox.Limits(wall_s=4.0)
    given = sandbox.Limits(cpu_s=1.0)
    assert registry.make("code", limits=given).limits is given  # a Limits passes as it is
    terminal.close()


class NeedsPath:
    """A registered class with a required keyword and a dataclass keyword (see the test below)."""

    def __init__(self, path: str, *, limits: sandbox.Limits | None = None):
        self.path, self.limits = path, limits


class TakesAnything:
    def __init__(self, **options):
        self.options = options


def test_required_and_open_ended_signatures(monkeypatch):
    monkeypatch.setitem(registry._DOMAINS, "needs_path", f"{__name__}:NeedsPath")
    monkeypatch.setitem(registry._DOMAINS, "anything", f"{__name__}:TakesAnything")
    with pytest.raises(ValueError, match=r"rl.env.needs_path: domain 'needs_path' needs keywords \['path'\]"):
        registry.check_kwargs("needs_path", {"limits": {"cpu_s": 1.0}})
    with pytest.raises(ValueError, match="x.needs_path.limits.cpu: unknown field"):
        registry.check_kwargs("needs_path", {"path": "p", "limits": {"cpu": 1.0}}, where="x")
    assert registry.check_kwargs("anything", {"whatever": (1, 2)}) == {"whatever": [1, 2]}
    assert dataclasses.is_dataclass(registry._record_types(NeedsPath)["limits"])


def _write(path, questions):
    lines = [json.dumps({"question": q, "answer": f"{i}\n#### {i}"}) + "\n" for i, q in enumerate(questions)]
    path.write_text("".join(lines))
    return str(path)


def test_workers_score_test_split_tasks_with_the_same_options(tmp_path):
    options = {
        "train_jsonl": _write(tmp_path / "train.jsonl", ["How many? (train)"]),
        "test_jsonl": _write(tmp_path / "test.jsonl", ["How many? (test A)", "How many? (test B)"]),
    }
    cfg = ml_collections.ConfigDict({"rl": {"domains": ("math",), "env": {"math": options}}})
    kwargs = data.env_kwargs(cfg)
    tasks = data.DomainTasks("math", seed=0, split="eval", env_kwargs=kwargs["math"]).next_tasks(6)
    assert {t.prompt.split("\n\n")[0] for t in tasks} == {"How many? (test A)", "How many? (test B)"}
    env = MathEnvironment(**kwargs["math"])
    with EnvPool(1, domains=kwargs, timeout_s=30.0) as pool:
        scores = pool.score_many(
            [(t, env.reference_solution(t)) for t in tasks] + [(tasks[0], "\\boxed{77}")]
        )
    assert [s.status for s in scores] == ["ok"] * 6 + ["wrong"]
