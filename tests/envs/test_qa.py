"""The environment quality gate: real domains pass it, a domain that rewards "PASS" fails it, by name."""

import importlib
import json
import subprocess
import sys

import pytest

from envs import registry
from envs.base import Score, SingleTurnEnvironment, Task
from envs.qa import escape, probes
from envs.qa import gate as qa
from envs.sandbox import box as sandbox

REPO = __file__.rsplit("/tests/", 1)[0]
GATED = ("scene3d", "math", "finance", "code", "terminal")  # `debug` misbehaves on purpose (pool tests)


class RewardsPass(SingleTurnEnvironment):
    """Broken on purpose: any completion containing "PASS" earns the reward."""

    name = "rewards_pass"
    levels = (0, 1)

    def sample_tasks(self, seed, n, *, difficulty=None):
        levels = self.levels if difficulty is None else (difficulty,)
        return [
            Task(
                f"rp-{seed}-{i}",
                self.name,
                f"What is {i} + {seed}?",
                {"answer": i + seed},
                levels[i % len(levels)],
            )
            for i in range(n)
        ]

    def reference_solution(self, task):
        return str(task.metadata["answer"])

    def score(self, task, completion):
        if "PASS" in completion or completion.strip() == str(task.metadata["answer"]):
            return Score(1.0, "ok")
        return Score(0.0, "wrong")


def _importable(domain: str) -> str:
    """'' when the domain's class imports; otherwise why not (a module someone is still writing)."""
    module, cls = registry._DOMAINS[domain].split(":")
    try:
        found = hasattr(importlib.import_module(module), cls)
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return "" if found else f"{module} has no {cls} yet"


@pytest.fixture(scope="module")
def pool():
    ready = [d for d in GATED if not _importable(d)]
    try:
        from envs.pool import EnvPool
    except ImportError as e:
        print(f"envs.pool not importable ({e}): consistency checked in process only")
        yield None
        return
    p = EnvPool(2, domains=ready)
    yield p
    p.close()


@pytest.mark.parametrize("domain", GATED)
def test_gate_passes_for_real_domains(domain, pool):
    why = _importable(domain)
    if why:
        pytest.skip(f"domain {domain!r} skipped: its module is not ready yet ({why})")
    report = qa.run_checks(domain, n=3, seed=0, pool=pool, probe_tasks=1)
    print(qa.format_report(report))
    assert report.passed, (report.failed(), [c for c in report.checks if not c.passed])
    names = {c.name for c in report.checks}
    assert {"levels", "solvability", "consistency", "strata", "probe:empty", "probe:echo_prompt"} <= names
    assert "probe:print_pass" in names and "probe:huge_output" in names
    if domain in probes.CODE_DOMAINS:
        assert {f"probe:{p}" for p in probes.CODE_PROBES} <= names
        assert {f"probe:{p}" for p in escape.ESCAPE_PROBES} <= names
        assert all(
            r["side_effects"] == []
            for c in report.checks
            if c.name.startswith("probe:")
            for r in c.data["runs"]
        )
    assert set(report.strata) == set(registry.make(domain).levels)


def test_gate_is_deterministic():
    a = qa.run_checks("scene3d", n=4, seed=3).to_json()
    b = qa.run_checks("scene3d", n=4, seed=3).to_json()
    assert a == b and a["passed"]
    assert json.loads(json.dumps(a)) == a


def test_noisy_reference_is_seeded():
    import random

    text = "Answer: 12345\nline two 678\n"
    assert probes.noisy(text, 0.0, random.Random(0)) == text
    assert probes.noisy(text, 0.5, random.Random(1)) == probes.noisy(text, 0.5, random.Random(1))
    assert probes.noisy(text, 1.0, random.Random(1)) == ""


def test_broken_domain_fails_with_probe_named():
    registry.register("rewards_pass", f"{__name__}:RewardsPass")
    report = qa.run_checks("rewards_pass", n=4, seed=0)
    print(qa.format_report(report))
    assert not report.passed
    assert report.check("solvability").passed
    assert "probe:print_pass" in report.failed() and "probe:huge_output" in report.failed()
    assert "probe:empty" not in report.failed()
    assert "rewards_pass" in json.dumps(report.to_json())


def test_cli_exits_nonzero_for_broken_domain(tmp_path):
    out = tmp_path / "qa.json"
    cmd = [sys.executable, "-m", "envs.qa", "--register=rewards_pass=tests.envs.test_qa:RewardsPass"]
    cmd += ["--domain=rewards_pass", "--n=3", "--workers=0", f"--json={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "probe:print_pass" in proc.stdout and "gate: FAIL" in proc.stdout
    result = json.loads(out.read_text())
    assert result["passed"] is False
    assert "probe:print_pass" in result["domains"]["rewards_pass"]["failed"]

    ok = subprocess.run(
        [sys.executable, "-m", "envs.qa", "--domain=scene3d", "--n=2", "--workers=0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_gate_fails_escapes_with_zero_reward_below_the_mount_level():
    """The same probes through the terminal domain at unshare-net (allowed by the explicit override): every
    reward is 0, yet the gate fails them by what they did to the host."""
    if sandbox.rank(sandbox.isolation_level()) > sandbox.rank("unshare-net"):
        pytest.skip("no unshare-net level here")
    small = sandbox.Limits(memory_bytes=128 << 20, total_memory_bytes=256 << 20, cpu_s=5.0, wall_s=10.0)
    kwargs = {"min_isolation": "unshare-net", "step_limits": small}
    caught = ["read_canaries", "leave_file", "many_procs_memory"]
    sandbox.configure(level="unshare-net")
    try:
        report = qa.run_checks(
            "terminal", n=1, probe_tasks=1, probes=caught + ["connect_host"], env_kwargs=kwargs
        )
    finally:
        sandbox.configure()
    print(qa.format_report(report))
    assert sorted(report.failed()) == sorted(f"probe:{p}" for p in caught)
    for name in caught:
        (run,) = report.check(f"probe:{name}").data["runs"]
        assert run["reward"] == 0.0 and run["side_effects"], run
