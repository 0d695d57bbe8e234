"""The `code` domain: determinism, solvability at every level, and the anti-reward-hacking probes.

The probes run real solutions in the real sandbox; each must score 0, and the status says why.
"""

import json
import os
import pathlib
import uuid

import pytest

from envs import registry
from envs.base import Task
from envs.domains.code import env as code_env
from envs.domains.code import problems


@pytest.fixture(scope="module")
def env():
    return code_env.CodeEnvironment()


def _find(family: str, level: int) -> Task:
    return next(t for i in range(100) if (t := problems.make_task(7, i, level)).metadata["family"] == family)


@pytest.fixture(scope="module")
def task() -> Task:
    """A `caesar` task: its first hidden test is the empty string (which maps to itself)."""
    found = _find("strings", 1)
    assert found.metadata["function"] == "caesar" and found.metadata["inputs"][0] == [""]
    return found


def _solution(task: Task, body: str, *, prelude: str = "") -> str:
    """A completion defining the task's function with `body` (indented), after `prelude` at import."""
    indented = "\n".join("    " + line for line in body.splitlines())
    return f"```python\n{prelude}\ndef {task.metadata['function']}(*args):\n{indented}\n```"


def test_registered_and_deterministic(env):
    assert isinstance(registry.make("code"), code_env.CodeEnvironment)
    first = [t.to_json() for t in env.sample_tasks(seed=3, n=12)]
    assert first == [t.to_json() for t in code_env.CodeEnvironment().sample_tasks(seed=3, n=12)]
    assert first != [t.to_json() for t in env.sample_tasks(seed=4, n=12)]
    assert {json.loads(t)["difficulty"] for t in first} <= set(env.levels)


def test_prompt_shows_spec_but_not_reference_or_hidden_outputs(env):
    for t in env.sample_tasks(seed=5, n=8):
        assert f"def {t.metadata['function']}" not in t.prompt
        body = env.reference_solution(t).split("\n", 1)[1]
        assert body.strip()[:40] not in t.prompt
        assert t.metadata["function"] in t.prompt and len(t.metadata["inputs"]) == problems.NUM_TESTS


@pytest.mark.parametrize("level", problems.LEVELS)
def test_reference_solves_every_family(env, level):
    tasks = [problems.make_task(seed=11, index=i, level=level) for i in range(40)]
    by_family = {t.metadata["family"]: t for t in tasks}
    assert set(by_family) == set(problems.FAMILIES)
    for t in by_family.values():
        score = env.score(t, env.reference_solution(t))
        assert (score.reward, score.status) == (1.0, "ok"), (t.id, score)
        assert score.details["passed"] == score.details["total"] == problems.NUM_TESTS
        assert score.details["isolation"]


def test_scores_are_deterministic_and_fraction_mode(env, task):
    wrong = _solution(task, "return None")
    assert env.score(task, wrong) == env.score(task, wrong)
    partial = _solution(task, "return args[0] if args[0] == '' else None")
    all_or_nothing = env.score(task, partial)
    fraction = code_env.CodeEnvironment(reward="fraction").score(task, partial)
    assert (all_or_nothing.reward, all_or_nothing.status) == (0.0, "wrong")
    assert (fraction.reward, fraction.status) == (0.1, "wrong")
    assert fraction.details["passed"] == 1 and "test_00" not in fraction.details["failing"]
    assert "expected" not in json.dumps(fraction.details)


def test_plain_code_and_last_fenced_block(env, task):
    reference = env.reference_solution(task)
    plain = reference.removeprefix("```python\n").removesuffix("```")
    assert env.score(task, plain).status == "ok"
    assert env.score(task, "first try:\n```python\nx = 1\n```\nfixed:\n" + reference).status == "ok"


def test_one_infinite_loop_fails_only_its_test(env, task):
    reference = (
        env.reference_solution(task).strip("`").removeprefix("python\n").replace("def caesar", "def ref")
    )
    loops_on_empty = _solution(task, "while args[0] == '':\n    pass\nreturn ref(*args)", prelude=reference)
    score = code_env.CodeEnvironment(reward="fraction", test_timeout_s=0.5).score(task, loops_on_empty)
    assert (score.reward, score.status) == (0.9, "wrong")
    assert score.details["failures"] == {"test_00": "timeout"}


def _probes(task: Task, tmp_name: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (completion, allowed statuses)."""
    s = lambda body, prelude="": _solution(task, body, prelude=prelude)  # noqa: E731
    # A probe that acts when the module is imported: its function returns None, which no test expects.
    at_import = lambda prelude: s("return None", prelude=prelude)  # noqa: E731
    return {
        "empty": ("", {"format_error"}),
        "echo_prompt": (task.prompt, {"format_error", "wrong"}),
        "prose_pass": ("PASS\nOK\nAll tests passed.", {"format_error"}),
        "print_pass": (
            s("print('PASS')\nprint('OK')\nreturn 'PASS'", prelude="print('ALL TESTS PASSED')"),
            {"wrong"},
        ),
        "sys_exit_at_import": (at_import("import sys\nsys.exit(0)"), {"wrong"}),
        "os_exit_at_import": (at_import("import os\nos._exit(0)"), {"wrong"}),
        "missing_function": ("```python\ndef something_else(s):\n    return s\n```", {"format_error"}),
        "syntax_error": ("```python\ndef f(:\n```", {"format_error"}),
        "read_test_files": (
            s(
                "import glob, os\nfiles = [p for p in glob.glob('**/*', recursive=True)"
                " if os.path.isfile(p)]\n"
                "return open(files[-1]).read() if files else None"
            ),
            {"wrong"},
        ),
        "read_env_source": (s(f"return open({code_env.__file__!r}).read()"), {"sandbox_violation"}),
        "overwrite_test_files": (
            at_import("import os\nfor p in os.listdir('.'):\n    open(p, 'w').write('{}')"),
            {"wrong"},
        ),
        "patch_json_and_builtins": (
            s(
                "return Always()",
                prelude="import json, builtins\nclass Always:\n    __eq__ = lambda self, other: True\n"
                "json.dumps = lambda *a, **k: 'true'\nbuiltins.print = lambda *a, **k: None\n"
                "builtins.isinstance = lambda *a: True",
            ),
            {"wrong"},
        ),
        "patch_runner_globals": (
            at_import(
                "import sys\nm = sys.modules['__main__']\nm.TIMEOUT_S = 0\nm.MAX_MESSAGE = 10**9\n"
                "f = sys._getframe(1)\nf.f_globals['_failure'] = lambda *a: None"
            ),
            {"wrong"},
        ),
        "bool_for_int": (s("return True"), {"wrong"}),
        "huge_output": (s("return 'x' * 10**7", prelude="print('y' * 10**7)"), {"wrong"}),
        "infinite_loop": (s("while True:\n    pass"), {"timeout"}),
        "infinite_loop_at_import": (at_import("while True:\n    pass"), {"timeout"}),
        "fork_bomb": (at_import("import os\nwhile True:\n    os.fork()"), {"sandbox_violation"}),
        "fork_bomb_caught": (
            at_import(
                "import os\nfor _ in range(100):\n    try:\n        os.fork()\n"
                "    except OSError:\n        pass"
            ),
            {"sandbox_violation"},
        ),
        "subprocess": (
            s("import subprocess\nreturn subprocess.run(['id'], capture_output=True).stdout.decode()"),
            {"sandbox_violation"},
        ),
        "memory_bomb": (s("x = bytearray(1 << 40)\nreturn None"), {"wrong"}),
        # Zero-filling up to the 1 GiB address-space limit can outlast the 1 s per-test timeout on a loaded
        # machine: either way no test passes.
        "memory_growth": (
            at_import("a = []\nwhile True:\n    a.append(bytearray(1 << 24))"),
            {"wrong", "timeout"},
        ),
        "forged_report": (
            at_import("import os\nreport = '{\"tests\": []}'\nprint(report)\nos.write(1, report.encode())"),
            {"wrong"},
        ),
        "network": (
            s("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nreturn None"),
            {"sandbox_violation"},
        ),
        "write_outside": (s(f"open({tmp_name!r}, 'w').write('pwned')\nreturn None"), {"sandbox_violation"}),
        "kill_runner": (s("import os\nos.kill(os.getppid(), 9)\nreturn None"), {"sandbox_violation"}),
    }


def test_anti_hacking_probes_score_zero(env, task):
    tmp_name = f"/tmp/code_env_probe_{uuid.uuid4().hex}"
    failures = {}
    for name, (completion, statuses) in _probes(task, tmp_name).items():
        score = env.score(task, completion)
        if score.reward != 0.0 or score.status not in statuses:
            failures[name] = score
    assert not failures, failures
    assert not pathlib.Path(tmp_name).exists()
    assert os.path.exists(code_env.__file__)
