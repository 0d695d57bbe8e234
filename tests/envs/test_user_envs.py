"""Your own environment: rl.domains names a built-in, an installed entry point or an import path
"package.module:Class"; resolution (envs.registry), its one-line errors at config validation (rl/validate.py),
the default `sample_tasks`, the examples in examples/my_envs, and worker processes that import the user's
module (a real EnvPool). The main job on the examples: tests/test_train_user_envs.py."""

import os
import textwrap

import pytest

from configs import grpo
from configs.schema import ConfigError
from envs import Environment, Score, SingleTurnEnvironment, registry
from envs.base import has_reference_solution
from envs.pool import EnvPool
from envs.qa import gate as qa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADD = "examples.my_envs.add:AddNumbers"
GUESS = "examples.my_envs.guess:GuessNumber"


@pytest.fixture(autouse=True)
def from_repo_root(monkeypatch):
    """As a user runs the main job: from the repository root, which holds `examples`."""
    monkeypatch.syspath_prepend(ROOT)


def _module(tmp_path, monkeypatch, name: str, source: str) -> str:
    """Writes module `name` into a directory of its own on sys.path (neither the repo nor the cwd)."""
    folder = tmp_path / f"src_{name}"
    folder.mkdir()
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(folder))
    return name


def _env_module(tmp_path, monkeypatch, name: str, cls: str, body: str, header: str = "") -> str:
    """Module `name` (see `_module`) defining `class {cls}(SingleTurnEnvironment)` with `body` after
    `header`; returns the import path "name:cls"."""
    methods = textwrap.indent(textwrap.dedent(body), "    ")
    imports = f"{header}from envs import Score, SingleTurnEnvironment, Task"
    source = f"{imports}\n\n\nclass {cls}(SingleTurnEnvironment):\n{methods}"
    return f"{_module(tmp_path, monkeypatch, name, source)}:{cls}"


def _entry_points(tmp_path, monkeypatch, package: str, lines: str) -> None:
    """An installed package (its .dist-info on sys.path) declaring entry points of the registry's group."""
    info = tmp_path / f"site_{package}" / f"{package}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}\n")
    monkeypatch.syspath_prepend(str(info.parent))


def _cfg(*domains, **rl):
    cfg = grpo.get_config("test")
    cfg.rl.domains = tuple(domains)
    cfg.rl.update(rl)
    return cfg


def _refused(cfg) -> str:
    from rl import validate

    with pytest.raises(ConfigError) as err:
        validate.validate(cfg)
    return str(err.value)


# ---- Resolution ------------------------------------------------------------------------------------------


def test_import_path_is_the_domain_name_of_the_env_and_its_tasks():
    env = registry.make(ADD)
    assert env.name == ADD and isinstance(env, SingleTurnEnvironment)
    tasks = env.sample_tasks(3, 6)
    assert {t.domain for t in tasks} == {ADD} and len({t.id for t in tasks}) == 6
    assert all(env.score(t, env.reference_solution(t)) == Score(1.0, "ok") for t in tasks)
    assert registry.target(ADD) == ADD and registry.target("strings") == registry.BUILTIN["strings"]


def test_default_sample_tasks_is_seeded_and_keeps_levels():
    env = registry.make(GUESS)
    a, b = env.sample_tasks(5, 20), env.sample_tasks(5, 20)
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    assert {t.difficulty for t in a} == {0, 1} and a != env.sample_tasks(6, 20)
    assert {t.difficulty for t in env.sample_tasks(5, 8, difficulty=1)} == {1}
    with pytest.raises(ValueError, match="difficulty 7 not in levels"):
        env.sample_tasks(5, 1, difficulty=7)

    class NoTasks(Environment):
        pass

    with pytest.raises(NotImplementedError, match="neither sample_tasks nor make_task"):
        NoTasks().sample_tasks(0, 1)


def test_entry_point_names_resolve_and_clashes_are_refused(tmp_path, monkeypatch):
    _entry_points(tmp_path, monkeypatch, "user_envs_a", f"adder = {ADD}\nmath = {ADD}\ntwice = {GUESS}")
    _entry_points(tmp_path, monkeypatch, "user_envs_b", f"twice = {ADD}")
    assert registry.installed()["adder"] == [f"{ADD} (user_envs_a)"]
    env = registry.make("adder")
    assert env.name == "adder" and {t.domain for t in env.sample_tasks(0, 3)} == {"adder"}
    with pytest.raises(registry.DomainError, match="'math' is both built in .* rename the entry point"):
        registry.target("math")
    with pytest.raises(registry.DomainError, match="'twice' is an entry point .* in several packages"):
        registry.target("twice")
    assert "is both built in" in _refused(_cfg("math"))  # at validation, before any worker


def test_factory_makes_an_environment(tmp_path, monkeypatch):
    mod = _module(
        tmp_path,
        monkeypatch,
        "user_factory_env",
        """
        from examples.my_envs.add import AddNumbers

        def make(level=1):
            env = AddNumbers()
            env.levels = (level,)
            return env
        """,
    )
    env = registry.make(f"{mod}:make", level=0)
    assert env.name == f"{mod}:make" and env.levels == (0,)
    assert registry.check_kwargs(f"{mod}:make", {}) == {}
    from rl import validate

    validate.validate(_cfg(f"{mod}:make", quality_gate=True))


# ---- Errors: one line naming rl.domains, at validation -----------------------------------------------------


def test_unknown_name_and_imports_that_fail_are_refused_by_name(tmp_path, monkeypatch):
    msg = _refused(_cfg("no_such_domain"))
    assert msg.startswith("rl.domains=('no_such_domain',) names 'no_such_domain': unknown domain")
    assert "entry points of group 'moe_post_train.environments'" in msg and "package.module:Class" in msg

    msg = _refused(_cfg("no_such_pkg_1234.envs:MyEnv"))
    assert msg.startswith("rl.domains=('no_such_pkg_1234.envs:MyEnv',) names 'no_such_pkg_1234.envs:MyEnv'")
    assert "does not import (ModuleNotFoundError: No module named 'no_such_pkg_1234')" in msg
    assert "PYTHONPATH" in msg

    mod = _module(tmp_path, monkeypatch, "user_env_that_raises", "raise RuntimeError('no data file')\n")
    msg = _refused(_cfg(f"{mod}:Env"))
    assert "does not import (RuntimeError: no data file); fix the module" in msg

    msg = _refused(_cfg("examples.my_envs.add:Adder"))
    assert "module 'examples.my_envs.add' has no attribute 'Adder' (its environments: AddNumbers)" in msg
    assert "\n" not in msg


def test_objects_that_are_no_environment_are_refused(tmp_path, monkeypatch):
    msg = _refused(_cfg("examples.my_envs.add:Score"))
    assert "examples.my_envs.add:Score is a class that does not subclass envs.Environment" in msg
    msg = _refused(_cfg("examples.my_envs.guess:__doc__"))
    assert "is a str, not an envs.Environment subclass or a factory returning one" in msg
    mod = _module(tmp_path, monkeypatch, "user_bad_factory", "def make():\n    return {'not': 'an env'}\n")
    msg = _refused(_cfg(f"{mod}:make"))
    assert msg.startswith(f"rl.domains=('{mod}:make',) names '{mod}:make': {mod}:make returned a dict")
    mod = _module(tmp_path, monkeypatch, "user_raising_factory", "def make():\n    raise OSError('gone')\n")
    assert "whose factory raised OSError: gone" in _refused(_cfg(f"{mod}:make"))


def test_a_domain_without_reference_solutions_needs_sft_and_gate_off(tmp_path, monkeypatch):
    name = _env_module(
        tmp_path,
        monkeypatch,
        "user_env_no_reference",
        "Echo",
        """
        def make_task(self, rng, level):
            return f"say {rng.randrange(1000)}", {}

        def score(self, task, completion):
            ok = completion.strip() == task.prompt[4:]
            return Score(float(ok), "ok" if ok else "wrong")
        """,
    )
    assert not has_reference_solution(registry.resolve(name)) and has_reference_solution(registry.make(ADD))
    msg = _refused(_cfg(name, quality_gate=True))  # the test config warms up with 6 SFT steps
    assert f"names '{name}', which has no reference_solution(task)" in msg
    assert "the SFT warm start (rl.sft.steps=6) and the quality gate (rl.quality_gate=True) need one" in msg
    assert msg.endswith("implement it, or set rl.sft.steps=0 and rl.quality_gate=False")
    msg = _refused(_cfg(name, quality_gate=False))
    assert msg.endswith("the SFT warm start (rl.sft.steps=6) needs one: implement it, or set rl.sft.steps=0")
    cfg = _cfg(name, quality_gate=False)
    cfg.rl.sft.steps = 0
    from rl import validate

    validate.validate(cfg)  # trains on rewards alone


def test_blocks_cannot_name_an_import_path_domain():
    cfg = _cfg(ADD, "debug")
    cfg.rl.levels = {"add": (0,)}
    msg = _refused(cfg)
    assert msg.startswith("rl.levels=['add'] names domains not in rl.domains")
    assert f"a domain given by import path ('{ADD}') is named by that path" in msg
    assert "give it a short name with an entry point" in msg


def test_entry_point_names_take_levels_options_and_weights(tmp_path, monkeypatch):
    from rl import validate

    _entry_points(tmp_path, monkeypatch, "user_envs_c", f"add = {ADD}\nguess = {GUESS}")
    cfg = _cfg("add", "guess", quality_gate=True, curriculum="static")
    cfg.rl.levels = {"add": (1,)}
    cfg.rl.static_weights = {"add": 3.0, "guess": 1.0}
    cfg.rl.sft.weights = {"add": 1.0}
    validate.validate(cfg)
    cfg.rl.env = {"add": {"digits": 3}}
    assert _refused(cfg).startswith("rl.env.add.digits: unknown keyword for domain 'add'")


def test_tasks_must_carry_the_name_the_run_knows(tmp_path, monkeypatch):
    from model.io.tokenizer import load_tokenizer
    from rl import data

    name = _env_module(
        tmp_path,
        monkeypatch,
        "user_env_own_domain",
        "Fixed",
        """
        def sample_tasks(self, seed, n, *, difficulty=None):
            return [Task(f"t{seed}/{i}", "my_domain", f"say {seed}", {}) for i in range(n)]

        def reference_solution(self, task):
            return task.prompt[4:]

        def score(self, task, completion):
            return Score(1.0, "ok")
        """,
    )
    cfg = _cfg(name)
    with pytest.raises(
        ConfigError, match=r"whose tasks say domain='my_domain'; make tasks with Task\(domain="
    ):
        data.check_domains(cfg, load_tokenizer(None, vocab_size=cfg.model.vocab_size))


def test_environment_split_on_holds_out_instances_of_one_prompt(tmp_path, monkeypatch):
    """A game with one prompt per level: split on the prompt, one split would get every task; the
    environment's `split_on = "task"` holds out instances instead (rl/data.py)."""
    from rl import data

    body = """
        split_on = {split_on!r}

        def make_task(self, rng, level):
            return "pick a secret", {{"secret": rng.randrange(10**6)}}

        def score(self, task, completion):
            return Score(0.0, "wrong")
        """
    by_task, by_prompt = (
        _env_module(tmp_path, monkeypatch, f"user_one_prompt_{s}", "OnePrompt", body.format(split_on=s))
        for s in ("task", "prompt")
    )
    for split in data.SPLITS:
        stream = data.DomainTasks(by_task, seed=0, split=split)
        assert stream.split_on == "task" and len(stream.next_tasks(3)) == 3
    with pytest.raises(RuntimeError, match="the environment's `split_on` attribute"):
        for split in data.SPLITS:
            data.DomainTasks(by_prompt, seed=0, split=split).next_tasks(1)


# ---- The examples, the gate, and worker processes --------------------------------------------------------


def test_examples_pass_the_quality_gate():
    for name in (ADD, GUESS):
        report = qa.run_checks(name, n=4)
        assert report.passed, qa.format_report(report)
    env = registry.make(GUESS)
    task = env.sample_tasks(0, 1, difficulty=1)[0]
    assert env.score(task, env.reference_solution(task)).status == "ok"
    assert env.score(task, "x").status == "format_error"
    assert env.score(task, f"x\n{task.metadata['secret']}").status == "ok"  # "number?" is feedback too
    assert env.score(task, "-1\n-1\n-1\n-1\n-1\n-1").status == "format_error"
    low = task.metadata["low"] if task.metadata["secret"] != task.metadata["low"] else task.metadata["high"]
    assert env.score(task, f"{low}").status == "wrong"


def test_workers_import_the_users_module_entry_points_and_registered_names(tmp_path, monkeypatch):
    """One real pool (forkserver workers): a module only on this process's sys.path (a folder that is
    neither the repo nor the cwd), an installed entry point, a name registered in this process, and the
    multi-turn example's episodes."""
    pid = _env_module(
        tmp_path,
        monkeypatch,
        "user_env_on_path",
        "Pid",
        """
        def make_task(self, rng, level):
            return "any", {}

        def score(self, task, completion):
            return Score(1.0, "ok", {"pid": os.getpid()})
        """,
        header="import os\n",
    )
    _entry_points(tmp_path, monkeypatch, "user_envs_d", f"adder = {ADD}")
    monkeypatch.setitem(registry._DOMAINS, "registered_guess", GUESS)  # as registry.register does
    names = [pid, "adder", "registered_guess"]
    tasks = {n: registry.make(n).sample_tasks(1, 2) for n in names}
    guess = registry.make("registered_guess")
    with EnvPool(1, domains=names, timeout_s=30.0) as pool:
        scores = pool.score_many([(tasks[pid][0], "x"), (tasks["adder"][0], "-")])
        episodes = pool.run_episodes(
            [(t, guess.reference_solution(t).splitlines()) for t in tasks["registered_guess"]]
        )
        info = pool.worker_info()
    assert scores[0].status == "ok" and scores[0].details["pid"] == info[0]["pid"] != os.getpid()
    assert scores[1].status == "format_error"
    assert [s.status for _, s in episodes] == ["ok", "ok"] and all(e["done"] for e, _ in episodes)
    assert sorted(info[0]["domains"]) == sorted(names) and not info[0]["jax_loaded"]


def test_pool_refuses_an_unknown_name_before_starting_workers():
    with pytest.raises(KeyError, match="unknown domain 'no_such_domain'"):
        EnvPool(1, domains=["no_such_domain"])
