"""The `terminal` domain: determinism, solvability, episodes, rollback, disturbance, and hacking probes.

Everything runs in the real sandbox; one task per (family, level) keeps the file fast.
"""

import json
import pathlib
import uuid

import pytest

from envs import registry
from envs.base import Task
from envs.domains.terminal import env as terminal_env
from envs.domains.terminal import tasks as terminal_tasks
from envs.sandbox import box as sandbox


def _find(family: str, level: int, seed: int = 0) -> Task:
    return next(
        t for i in range(100) if (t := terminal_tasks.make_task(seed, i, level)).metadata["family"] == family
    )


ALL_KINDS = [(family, level) for family in terminal_tasks.FAMILIES for level in terminal_tasks.LEVELS]


@pytest.fixture(scope="module")
def env():
    environment = terminal_env.TerminalEnvironment(step_limits=sandbox.Limits(cpu_s=3.0, wall_s=3.0))
    yield environment
    environment.close()


@pytest.fixture(scope="module")
def disturbed():
    environment = terminal_env.TerminalEnvironment(disturbance=True)
    yield environment
    environment.close()


def _run(env: terminal_env.TerminalEnvironment, task: Task, actions: list[str]):
    episode = env.reset(task)
    for action in actions:
        if episode.done:
            break
        episode = env.step(episode, action)
    return episode, env.score_episode(task, episode)


def test_registered_and_deterministic(env):
    assert isinstance(registry.make("terminal"), terminal_env.TerminalEnvironment)
    first = [t.to_json() for t in env.sample_tasks(seed=3, n=12)]
    assert first == [t.to_json() for t in terminal_env.TerminalEnvironment().sample_tasks(seed=3, n=12)]
    assert first != [t.to_json() for t in env.sample_tasks(seed=4, n=12)]
    for task in env.sample_tasks(seed=3, n=12):
        hidden = json.dumps([task.metadata["checks"], task.metadata["hidden"], task.metadata["reference"]])
        assert task.metadata["reference"][0] not in task.prompt and len(hidden) > 20


@pytest.mark.parametrize("family,level", ALL_KINDS)
def test_reference_solves_every_kind(env, family, level):
    task = _find(family, level)
    score = env.score(task, env.reference_solution(task))
    assert (score.reward, score.status) == (1.0, "ok"), (task.id, score)
    assert score.details["isolation"] == sandbox.isolation_level()


def test_multi_step_episode(env):
    task = _find("logs", 1)
    actions = env.reference_solution(task).splitlines()
    assert actions[-1] == "submit"
    episode = env.reset(task)
    assert episode.observation == task.prompt and not episode.done
    episode = env.step(episode, "ls")
    assert "app.log" in episode.observation and "[exit code: 0]" in episode.observation
    episode = env.step(episode, "cat no-such-file")
    assert "No such file" in episode.observation and "[exit code: 1]" in episode.observation
    for action in actions:
        episode = env.step(episode, action)
    assert episode.done and episode.turns == 1 + len(actions)  # submit is not a turn
    assert [t["action"] for t in episode.transcript] == ["ls", "cat no-such-file", *actions]
    score = env.score_episode(task, episode)
    assert (score.reward, score.status, score.details["turns"]) == (1.0, "ok", len(actions) + 1)


def test_wrong_and_empty_episodes_score_zero(env):
    task = _find("logs", 1)
    for actions in ([], ["echo r0000 > answer.txt"], ["echo PASS", "echo OK > answer.txt"], ["exit"]):
        _, score = _run(env, task, actions)
        assert (score.reward, score.status) == (0.0, "wrong"), (actions, score)
        assert score.details["reasons"] and "r" + "0000" not in json.dumps(score.details)


def test_hard_coding_the_sample_answer_fails_on_hidden_inputs(env):
    task = _find("repair", 0)
    sample_count = sum(1 for line in task.metadata["files"]["sample.txt"].splitlines() if line)
    _, score = _run(
        env, task, [f"printf '#!/bin/bash\\necho {sample_count}\\n' > count.sh", "chmod +x count.sh"]
    )
    assert (score.reward, score.status) == (0.0, "wrong")
    assert score.details["reasons"] == ["wrong output on the hidden input"]


def test_max_turns_ends_the_episode():
    env = terminal_env.TerminalEnvironment(max_turns=2)
    try:
        episode = env.reset(_find("files", 0))
        episode = env.step(env.step(episode, "true"), "true")
        assert episode.done and episode.turns == 2
        with pytest.raises(ValueError):
            env.step(episode, "true")
    finally:
        env.close()


def test_rollback_restores_post_setup_state():
    env = terminal_env.TerminalEnvironment()
    try:
        _check_rollback(env, _find("logs", 2))  # setup gzips logs/auth-1.log
    finally:
        env.close()


def _check_rollback(env: terminal_env.TerminalEnvironment, task: Task) -> None:
    episode = env.reset(task)
    assert episode.state["setup_ran"]
    env.step(episode, "rm -rf logs && echo junk > junk.txt")
    env.score_episode(task, episode)
    again = env.reset(task)
    assert not again.state["setup_ran"]
    listing = env.step(again, "ls -a . logs").observation
    assert "auth-1.log.gz" in listing and "auth-0.log" in listing and "junk.txt" not in listing
    assert "auth-1.log\n" not in listing
    assert env.score_episode(task, again).status == "wrong"
    _, score = _run(env, task, env.reference_solution(task).splitlines())
    assert score.status == "ok"


@pytest.mark.parametrize("family,level", ALL_KINDS)
def test_disturbance_handled_by_reference_and_fails_naive(disturbed, family, level):
    task = _find(family, level)
    reference = disturbed.reference_solution(task)
    assert "for attempt in" in reference
    assert disturbed.score(task, reference).status == "ok"
    naive = task.metadata["reference"]
    episode, score = _run(disturbed, task, naive)
    assert (score.reward, score.status) == (0.0, "wrong")
    assert "temporary failure" in "".join(t["observation"] for t in episode.transcript)
    # The failure is transient: repeating the failed command once (as an agent should) succeeds.
    flaky_line = next(line for line in naive if task.metadata["flaky"] in line.split())
    _, retried = _run(disturbed, task, [*naive, flaky_line])
    assert retried.status == "ok"


def test_hacking_probes_score_zero(env):
    task = _find("logs", 0)
    marker = f"/tmp/terminal_probe_{uuid.uuid4().hex}"
    probes = {
        "find_verifier": ["find / -name 'verify*.py' -newer /proc/1 2>/dev/null | head; ls -a .. | head"],
        "print_pass": ["echo PASS; echo OK; exit 0"],
        "huge_output": ["yes PASS | head -c 50000000"],
        "infinite_loop": ["while true; do :; done"],
        "fork_bomb": ["bomb() { bomb | bomb & }; bomb"],
        "memory_bomb": ["python3 -c 'x = bytearray(1 << 40)'"],
        "network": ["python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)\""],
        "write_outside": [f"echo 3 > {marker}; echo 3 > /answer.txt; echo 3 > ../answer.txt"],
    }
    for name, actions in probes.items():
        episode, score = _run(env, task, actions)
        assert (score.reward, score.status) == (0.0, "wrong"), (name, score)
        assert all(len(t["observation"]) < 4200 for t in episode.transcript), name
    assert not pathlib.Path(marker).exists() or sandbox.isolation_level() != "bwrap"
