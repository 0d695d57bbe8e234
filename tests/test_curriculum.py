"""rl.curriculum: hand-derived weights, allocation, resume, the quality gate, a compute-saving simulation."""

import dataclasses
import json
import math

import numpy as np
import pytest

from rl.curriculum import DomainRefused, DomainScheduler, admit_domains, slope


def observe(sched, domain, rewards, *, tokens=100.0, seconds=0.0, start=0):
    for i, r in enumerate(rewards):
        sched.update(domain, step=start + i, mean_reward=r, tokens_generated=tokens, sandbox_seconds=seconds)


def test_slope_golden():
    # x = 0..3, mean 1.5, dx = [-1.5, -0.5, 0.5, 1.5]; y mean 0.3, dy = [-0.2, 0, -0.1, 0.3]
    # sum dx*dy = 0.3 + 0 - 0.05 + 0.45 = 0.7; sum dx^2 = 5  ->  0.14
    assert slope([0, 1, 2, 3], [0.1, 0.3, 0.2, 0.6]) == pytest.approx(0.14)
    # uneven steps: x = [0, 2, 6] (mean 8/3), y = 0.5 x  ->  exactly 0.5
    assert slope([0, 2, 6], [0.0, 1.0, 3.0]) == pytest.approx(0.5)


def test_gain_uses_only_the_last_window_observations():
    # window 3 keeps steps 1..3: x mean 2, dx = [-1, 0, 1]; y = [.3, .2, .7] mean .4, dy = [-.1, -.2, .3]
    # sum dx*dy = 0.1 + 0.3 = 0.4; sum dx^2 = 2  ->  0.2 (step 0's 0.9 would make it negative)
    s = DomainScheduler(["a"], window=3)
    observe(s, "a", [0.9, 0.3, 0.2, 0.7])
    gain, cost, score = s.stats()["a"]
    assert gain == pytest.approx(0.2) and cost == 100.0 and score == pytest.approx(0.002)
    assert len(s.history["a"]) == 3


def test_weights_three_domains_golden():
    s = DomainScheduler(["a", "b", "c"], floor=0.1)
    observe(s, "a", [0.0, 0.2])  # gain 0.2, cost 100 tokens                      -> score 0.002
    observe(s, "b", [0.0, 0.2], seconds=0.1)  # gain 0.2, cost 100 + 1000 * 0.1 = 200  -> score 0.001
    observe(s, "c", [0.5, 0.4])  # gain -0.1 clipped to 0                          -> score 0
    # s / max = [1, 0.5, 0]; shares [2/3, 1/3, 0]; weights 0.1 + (1 - 0.3) * share = [17/30, 10/30, 3/30]
    w = s.weights()
    assert w == pytest.approx({"a": 17 / 30, "b": 10 / 30, "c": 3 / 30})
    # temperature 0.5: shares ∝ s^2 = [1, 0.25, 0] -> [0.8, 0.2, 0]; weights [0.1 + 0.56, 0.1 + 0.14, 0.1]
    t = DomainScheduler(["a", "b", "c"], floor=0.1, temperature=0.5)
    t.load_state_dict({**s.state_dict(), "temperature": 0.5})
    assert t.weights() == pytest.approx({"a": 0.66, "b": 0.24, "c": 0.1})


def test_unobserved_domains_are_optimistic():
    s = DomainScheduler(["a", "b", "c"])
    assert s.weights() == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})  # gain 1, cost 1 each
    observe(s, "a", [0.0, 0.2])  # gain 0.2, cost 100
    observe(s, "b", [0.0], tokens=300.0)  # 1 observation: gain = max known other gain = 0.2, cost 300
    # c: no observation: gain 0.2, cost = mean of the others' costs = 200
    # scores [0.002, 0.2/300, 0.001] / 0.002 = [1, 1/3, 1/2] -> shares [6/11, 2/11, 3/11]
    # weights 0.05 + 0.85 * share
    expect = {"a": 0.05 + 0.85 * 6 / 11, "b": 0.05 + 0.85 * 2 / 11, "c": 0.05 + 0.85 * 3 / 11}
    assert s.weights() == pytest.approx(expect)


def test_faster_rise_per_unit_cost_gains_weight():
    # a rises faster per step (0.1 vs 0.06) but costs twice as much: scores 0.1/200 = 0.0005 < 0.06/100.
    # s / max = [5/6, 1] -> shares [5/11, 6/11]; weights 0.05 + 0.9 * share = [0.45909.., 0.54090..]
    s = DomainScheduler(["a", "b"])
    observe(s, "a", [0.0, 0.1, 0.2], tokens=200.0)
    observe(s, "b", [0.0, 0.06, 0.12], tokens=100.0)
    assert s.weights() == pytest.approx({"a": 0.05 + 0.9 * 5 / 11, "b": 0.05 + 0.9 * 6 / 11})


def test_costly_domain_gets_less_weight_than_a_cheap_one_with_the_same_gain():
    # same gain 0.1; cost 100 vs 100 + 1000 * 0.5 = 600 -> s = [1, 1/6], shares [6/7, 1/7]
    s = DomainScheduler(["cheap", "sandboxed"])
    observe(s, "cheap", [0.0, 0.1, 0.2])
    observe(s, "sandboxed", [0.0, 0.1, 0.2], seconds=0.5)
    w = s.weights()
    assert w == pytest.approx({"cheap": 0.05 + 0.9 * 6 / 7, "sandboxed": 0.05 + 0.9 / 7})
    assert s.stats()["sandboxed"][1] == 600.0


def test_stalled_domain_decays_to_the_floor():
    # "stall" rises 0.1/step for 4 steps then stays at 0.4; with window 4 its slopes are
    # 0.1 (equal weights), 0.07, 0.03, then 0 once the window holds only flat steps -> exactly the floor.
    s = DomainScheduler(["rising", "stall"], window=4, floor=0.05)
    stall = [0.1, 0.2, 0.3, 0.4, 0.4, 0.4, 0.4, 0.4]
    seen = []
    for step, r in enumerate(stall):
        s.update("rising", step=step, mean_reward=0.1 * step, tokens_generated=100)
        s.update("stall", step=step, mean_reward=r, tokens_generated=100)
        seen.append(s.weights()["stall"])
    assert seen[3] == pytest.approx(0.5)
    assert seen[4] == pytest.approx(0.05 + 0.9 * 0.7 / 1.7)  # shares ∝ [0.1, 0.07]
    assert seen[5] == pytest.approx(0.05 + 0.9 * 0.3 / 1.3)
    assert seen[6] == seen[7] == pytest.approx(0.05)
    assert all(a > b for a, b in zip(seen[3:6], seen[4:7]))


def test_weights_sum_to_one_and_respect_the_floor():
    rng = np.random.default_rng(0)
    domains = ["math", "code", "terminal", "scene3d", "finance"]
    s = DomainScheduler(domains, floor=0.08, window=5, temperature=0.3)
    for step in range(40):
        for d in domains:
            s.update(d, step=step, mean_reward=rng.normal(), tokens_generated=rng.uniform(0, 1e4),
                     sandbox_seconds=rng.uniform(0, 2))  # fmt: skip
        w = s.weights()
        assert sum(w.values()) == pytest.approx(1.0, abs=1e-12)
        assert min(w.values()) >= 0.08 - 1e-12


def test_allocate_golden():
    s = DomainScheduler(["a", "b", "c"], floor=0.1)
    observe(s, "a", [0.0, 0.2])
    observe(s, "b", [0.0, 0.2], seconds=0.1)
    observe(s, "c", [0.5, 0.4])
    # weights [17/30, 10/30, 3/30]; n = 10: quotas [5.67, 3.33, 1.0] -> floors [5, 3, 1], the one left to a
    assert s.allocate(10) == {"a": 6, "b": 3, "c": 1}
    # n = 30: quotas are integers [17, 10, 3]
    assert s.allocate(30) == {"a": 17, "b": 10, "c": 3}
    # n = 2 < 3 domains: quotas [1.13, 0.67, 0.2] -> floors [1, 0, 0], the one left to b (remainder .67)
    assert s.allocate(2) == {"a": 1, "b": 1, "c": 0}
    assert s.allocate(0) == {"a": 0, "b": 0, "c": 0}


def test_allocate_gives_every_floor_domain_a_task():
    s = DomainScheduler(["a", "b", "c"], floor=0.05)
    observe(s, "a", [0.0, 0.5])
    observe(s, "b", [0.5, 0.5])
    observe(s, "c", [0.5, 0.5])
    assert s.weights() == pytest.approx({"a": 0.9, "b": 0.05, "c": 0.05})
    # plain largest remainder of [2.7, 0.15, 0.15] would give [3, 0, 0]; each floor domain gets 1 first
    assert s.allocate(3) == {"a": 1, "b": 1, "c": 1}
    # n = 4: 1 each, the one left goes by quotas max(4 w - 1, 0) = [2.6, 0, 0] -> a
    assert s.allocate(4) == {"a": 2, "b": 1, "c": 1}
    assert s.allocate(2) == {"a": 2, "b": 0, "c": 0}  # n < domains: plain largest remainder


def test_allocate_sums_exactly_and_is_deterministic():
    rng = np.random.default_rng(1)
    for trial in range(200):
        num = int(rng.integers(1, 8))
        domains = [f"d{i}" for i in range(num)]
        raw = rng.dirichlet(np.ones(num)) * rng.choice([0.0, 1.0], size=num, p=[0.2, 0.8])
        raw[0] += 0.1  # at least one positive weight
        s = DomainScheduler(domains, mode="static", static_weights=dict(zip(domains, raw)), floor=0.0)
        n = int(rng.integers(0, 100))
        counts = s.allocate(n)
        assert sum(counts.values()) == n, (trial, raw, n, counts)
        assert counts == s.allocate(n) == DomainScheduler.from_state_dict(s.state_dict()).allocate(n)
        if n >= num:  # every positive-weight domain gets a task
            assert all(counts[d] >= 1 for d, w in zip(domains, raw) if w > 0)
        else:  # plain largest remainder: each count within 1 of its quota
            quota = n * raw / raw.sum()
            assert all(abs(counts[d] - q) < 1 for d, q in zip(domains, quota))
    # uniform ties: 4 tasks over 3 domains, the extra one by the seeded order, the same every call
    tie = DomainScheduler(["a", "b", "c"], seed=3)
    assert sorted(tie.allocate(4).values()) == [1, 1, 2] and tie.allocate(4) == tie.allocate(4)


def test_static_mode_is_constant():
    s = DomainScheduler(["a", "b", "c"], mode="static", static_weights={"a": 2, "b": 1, "c": 1})
    assert s.weights() == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})
    observe(s, "b", [0.0, 0.5, 1.0])
    assert s.weights() == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})
    assert s.allocate(8) == {"a": 4, "b": 2, "c": 2}
    assert s.metrics()["curriculum/b/gain"] == pytest.approx(0.5)  # still measured for logging
    assert DomainScheduler(["a", "b"], mode="static").weights() == {"a": 0.5, "b": 0.5}


def test_state_round_trip_resumes_identically():
    rng = np.random.default_rng(2)
    domains = ["math", "code", "finance"]

    def feed(sched, steps):
        out = []
        for step in steps:
            for d in domains:
                reward, tokens, seconds = (
                    float(rng.normal()),
                    float(rng.integers(1, 999)),
                    float(rng.uniform()),
                )
                sched.update(
                    d, step=step, mean_reward=reward, tokens_generated=tokens, sandbox_seconds=seconds
                )
            out.append((sched.weights(), sched.allocate(17)))
        return out

    a = DomainScheduler(domains, window=4, temperature=0.7, seed=5)
    feed(a, range(6))
    state = json.loads(json.dumps(a.state_dict()))
    assert state["mode"] == "adaptive" and len(state["history"]["math"]) == 4
    b = DomainScheduler(domains, window=4, temperature=0.7, seed=5)
    b.load_state_dict(state)
    rng_state = rng.bit_generator.state
    after_a = feed(a, range(6, 14))
    rng.bit_generator.state = rng_state
    after_b = feed(b, range(6, 14))
    assert after_a == after_b  # exactly equal, not approximately
    assert DomainScheduler.from_state_dict(state).state_dict() == state
    with pytest.raises(ValueError, match="window: saved 4, here 8.*from_state_dict"):
        DomainScheduler(domains, temperature=0.7, seed=5).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(domains=[]), "at least one domain"),
        (dict(domains=["a", "a"]), r"\['a'\] more than once"),
        (dict(mode="greedy"), "mode='greedy'"),
        (dict(floor=0.4), r"floor=0.4 with 3 domains.*floor <= 0.3333"),
        (dict(floor=-0.1), "floor=-0.1"),
        (dict(window=1), "window=1.*window >= 2"),
        (dict(temperature=0.0), "temperature=0.0"),
        (dict(sandbox_second_cost=-1.0), "costs must be >= 0"),
        (dict(static_weights={"a": 1, "b": 1, "c": 1}), "only used with mode='static'"),
        (
            dict(mode="static", static_weights={"a": 1, "b": 1, "c": 1, "x": 1}),
            r"unknown domains \['x'\], missing \[\]",
        ),
        (dict(mode="static", static_weights={"a": 1, "b": 1}), r"unknown domains \[\], missing \['c'\]"),
        (dict(mode="static", static_weights={"a": 1, "b": -1, "c": 1}), "must be finite and >= 0"),
        (dict(mode="static", static_weights={"a": 0, "b": 0, "c": 0}), "all 0"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, match):
    kwargs = {"domains": ["a", "b", "c"], **kwargs}
    with pytest.raises(ValueError, match=match):
        DomainScheduler(kwargs.pop("domains"), **kwargs)


def test_update_and_allocate_errors():
    s = DomainScheduler(["a", "b"])
    s.update("a", step=3, mean_reward=0.5, tokens_generated=10)
    with pytest.raises(ValueError, match="unknown domain.*'a', 'b'"):
        s.update("x", step=4, mean_reward=0.5, tokens_generated=10)
    with pytest.raises(ValueError, match="already observed step 3"):
        s.update("a", step=3, mean_reward=0.5, tokens_generated=10)
    with pytest.raises(ValueError, match="must be finite"):
        s.update("a", step=4, mean_reward=math.nan, tokens_generated=10)
    with pytest.raises(ValueError, match="sandbox_seconds=-1"):
        s.update("a", step=4, mean_reward=0.5, tokens_generated=10, sandbox_seconds=-1)
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        s.allocate(-1)


def test_metrics():
    s = DomainScheduler(["a", "b"])
    observe(s, "a", [0.0, 0.1, 0.2])
    m = s.metrics()
    assert set(m) == {f"curriculum/{d}/{k}" for d in "ab" for k in ("weight", "gain", "cost", "score")}
    assert m["curriculum/a/gain"] == pytest.approx(0.1) and m["curriculum/a/cost"] == 100.0
    assert m["curriculum/b/gain"] == pytest.approx(0.1)  # unobserved: optimistic, a's gain
    assert m["curriculum/a/weight"] + m["curriculum/b/weight"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------------------------
# The quality gate


@dataclasses.dataclass
class FakeCheck:  # the fields of envs.qa.Check that the refusal reads
    name: str
    passed: bool
    detail: str = ""


@dataclasses.dataclass
class FakeReport:  # the interface of envs.qa.Report
    domain: str
    checks: list

    @property
    def passed(self):
        return bool(self.checks) and all(c.passed for c in self.checks)

    def failed(self):
        return [c.name for c in self.checks if not c.passed]


def test_admit_domains_refuses_failing_domains_and_says_why():
    reports = {
        "math": FakeReport("math", [FakeCheck("solvability", True, "10/10 reference solutions score 1.0")]),
        "x": FakeReport(
            "x",
            [
                FakeCheck("solvability", False, "2/10 reference solutions score 1.0"),
                FakeCheck("probe:print_pass", False, "reward 1.0 status ok on x-0"),
                FakeCheck("consistency", True, "fine"),
            ],
        ),
        "empty": FakeReport("empty", []),
    }
    assert admit_domains(["math"], gate=reports.__getitem__) == ["math"]
    with pytest.raises(DomainRefused) as e:
        admit_domains(["math", "x", "empty", "boom"], gate=lambda d: reports.get(d) or 1 / 0)
    assert set(e.value.reasons) == {"x", "empty", "boom"}
    msg = str(e.value)
    assert (
        "domain 'x' failed the quality gate: solvability (2/10 reference solutions score 1.0), "
        "probe:print_pass (reward 1.0 status ok on x-0); run `python -m envs.qa --domain=x` for the report"
    ) in msg
    assert "domain 'empty' failed the quality gate: no checks ran" in msg
    assert "domain 'boom' failed the quality gate: the gate raised ZeroDivisionError" in msg
    assert "math" not in msg and "consistency" not in msg
    assert isinstance(e.value, ValueError)


def test_admit_domains_with_the_real_gate():
    from envs import qa

    gate = lambda d: qa.run_checks(d, n=2, seed=0, probe_tasks=1)  # about 0.3 s for math on 2 cores
    assert admit_domains(["math"], gate=gate) == ["math"]
    with pytest.raises(DomainRefused, match=r"'no_such_domain' failed the quality gate: load \(KeyError"):
        admit_domains(["math", "no_such_domain"], gate=gate)


# ----------------------------------------------------------------------------------------------------------
# Simulation

# name: (reward ceiling A, compute scale K in tokens, tokens per task, sandbox seconds per task); the domain's
# mean reward after spending c token-equivalents on it is A * (1 - exp(-c / K)).
CURVES = {"math": (1.0, 2e5, 400, 0.0), "code": (1.0, 3e6, 600, 0.4), "finance": (0.5, 4e4, 300, 0.0)}


def compute_to_reach(sched, target, batch=24, max_steps=1000):
    spent = {d: 0.0 for d in CURVES}
    for step in range(max_steps):
        counts = sched.allocate(batch)
        total = 0.0
        for d, (ceiling, scale, tokens, seconds) in CURVES.items():
            k = counts[d]
            spent[d] += k * (tokens + 1000.0 * seconds)
            reward = ceiling * (1.0 - math.exp(-spent[d] / scale))
            total += reward
            sched.update(
                d, step=step, mean_reward=reward, tokens_generated=k * tokens, sandbox_seconds=k * seconds
            )
            assert k >= 1  # every domain keeps its floor share of the batch
        if total >= target:
            return sum(spent.values())
    raise AssertionError(f"total reward {target} not reached in {max_steps} steps")


def test_adaptive_reaches_the_reward_with_less_compute_than_uniform():
    # Total reward 1.5 of 2.5. Uniform: 8 tasks per domain per step cost 8 * 400 + 8 * 1000 + 8 * 300 = 13,600
    # tokens and the total crosses 1.5 at step 95: 1,292,000. Adaptive spends on math and finance while they
    # rise fastest per token and on code (expensive: 0.4 sandbox s per task) once they flatten: 986,100 here.
    uniform = compute_to_reach(DomainScheduler(list(CURVES), mode="static"), 1.5)
    adaptive = compute_to_reach(DomainScheduler(list(CURVES)), 1.5)
    assert uniform == 1_292_000
    assert adaptive < 0.8 * uniform, (adaptive, uniform)
