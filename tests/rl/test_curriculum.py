"""rl.curriculum: the gain estimate and its error, hand-derived targets and rate-limited weights, allocation,
resume, the quality gate, simulated learning curves with binomial noise, a compute-saving simulation."""

import dataclasses
import json
import math

import numpy as np
import pytest

from rl.curriculum import (
    DomainRefused,
    DomainScheduler,
    admit_domains,
    discounted_slope,
    from_config,
    saturated,
    target_shares,
)


def observe(sched, domain, rewards, *, tokens=100.0, seconds=0.0, start=0):
    for i, r in enumerate(rewards):
        sched.update(domain, step=start + i, mean_reward=r, tokens_generated=tokens, sandbox_seconds=seconds)


# ----------------------------------------------------------------------------------------------------------
# The estimate: discounted least squares and its standard error


def test_discounted_slope_without_discount_is_the_textbook_ols():
    # x = 0..3, dx = [-1.5, -0.5, 0.5, 1.5], Sxx = 5; y = [.1, .3, .2, .6], mean .3: slope 0.7 / 5 = 0.14.
    # Fitted .3 + .14 dx = [.09, .23, .37, .51], residuals [.01, .07, -.17, .09], sum of squares .042;
    # sigma^2 = .042 / (4 - 2) = .021, se^2 = sigma^2 / Sxx = .0042.
    gain, se = discounted_slope([0, 1, 2, 3], [0.1, 0.3, 0.2, 0.6])
    assert gain == pytest.approx(0.14) and se == pytest.approx(math.sqrt(0.0042))
    # Every mean over 10 samples: the per-sample variance is 10x, each mean's variance the same: same se.
    assert discounted_slope([0, 1, 2, 3], [0.1, 0.3, 0.2, 0.6], [10] * 4) == pytest.approx((0.14, se))
    # Uneven steps: y = 0.5 x exactly -> slope 0.5, se 0.
    assert discounted_slope([0, 2, 6], [0.0, 1.0, 3.0]) == pytest.approx((0.5, 0.0), abs=1e-12)


def test_discounted_slope_weights_by_samples():
    # Weighted least squares, w = n = [1, 2, 1]: x mean (0 + 2 + 2) / 4 = 1, dx = [-1, 0, 1], Sxx = 2;
    # y = [0, 1, 1] mean 3/4: slope (.75 + .25) / 2 = .5. Residuals [-.25, .25, -.25], sum n r^2 = .25;
    # sigma^2 = .25 / (3 - 2) = .25, se^2 = sigma^2 / Sxx = .125 (textbook WLS).
    assert discounted_slope([0, 1, 2], [0.0, 1.0, 1.0], [1, 2, 1]) == pytest.approx((0.5, math.sqrt(0.125)))


def test_discounted_slope_golden_with_discount():
    # half_life 1: delta = [1/4, 1/2, 1], n = 1. x mean 2.5 / 1.75 = 10/7, dx = [-10, -3, 4] / 7,
    # Sxx = (25 + 4.5 + 16) / 49 = 13/14; y = [0, 1, 1] mean 6/7, dy = [-6, 1, 1] / 7,
    # sum delta dx dy = (15 - 1.5 + 4) / 49 = 5/14 -> slope 5/13. Residuals dy - slope dx = [-4, 4, -1] / 13.
    # N = 1.75^2 / (1/16 + 1/4 + 1) = 7/3, sigma^2 = N / (N - 2) * sum delta r^2 / sum delta
    #   = 7 * (1/13) / 1.75 = 4/13;  se^2 = sigma^2 * sum delta^2 dx^2 / Sxx^2 = 4/13 * (24.5/49) / (169/196)
    #   = 392 / 2197.
    gain, se = discounted_slope([0, 1, 2], [0.0, 1.0, 1.0], half_life=1.0)
    assert gain == pytest.approx(5 / 13) and se == pytest.approx(math.sqrt(392 / 2197))


def test_discounted_slope_needs_points():
    assert math.isnan(discounted_slope([3], [0.5])[0]) and discounted_slope([3], [0.5])[1] == math.inf
    gain, se = discounted_slope([3, 4], [0.5, 0.7])  # 2 points: a slope, no error
    assert gain == pytest.approx(0.2) and se == math.inf


def test_gain_uses_only_the_last_window_observations():
    # window 3 keeps steps 1..3: dx = [-1, 0, 1]; y = [.3, .2, .7] mean .4: slope (.1 + .3) / 2 = .2
    # (step 0's 0.9 would make it negative). Residuals [.1, -.2, .1]: sigma^2 = .06 / 1, se^2 = .06 / 2.
    s = DomainScheduler(["a"], window=3, warmup=3, half_life=math.inf)
    observe(s, "a", [0.9, 0.3, 0.2, 0.7])
    est = s.stats()["a"]
    assert est.gain == pytest.approx(0.2) and est.gain_se == pytest.approx(math.sqrt(0.03))
    assert est.cost == 100.0 and est.score == pytest.approx(0.002)
    assert est.score_se == pytest.approx(math.sqrt(0.03) / 100)
    assert len(s.history["a"]) == 3


# ----------------------------------------------------------------------------------------------------------
# From estimates to target shares


def test_target_shares_shrink_differences_by_their_error():
    # Scores [3, 1], se [.5, .5]: a gains (3 > 3 * .5), b does not (1 < 1.5) but is not saturated (a's lead
    # 2 < 3 * hypot(.5, .5) = 2.12). Mean 2, deviations +-1 shrink by z * hypot / 2 = sqrt(2) / 4:
    # s = [3 - sqrt(2)/4, 1 + sqrt(2)/4], shares s / 4.
    shares = target_shares([3.0, 1.0], [0.5, 0.5], [False, False])
    assert shares == pytest.approx([(3 - math.sqrt(2) / 4) / 4, (1 + math.sqrt(2) / 4) / 4])
    # A difference within z standard errors (0.2 < hypot(.2, .2) = .28) shrinks to 0: equal shares.
    assert target_shares([1.2, 1.0], [0.2, 0.2], [False, False]) == pytest.approx([0.5, 0.5])
    # No domain shows a gain (both scores under 3 se): equal, whatever the ratio of the estimates.
    assert target_shares([0.1, 0.5], [1.0, 1.0], [False, False]) == pytest.approx([0.5, 0.5])


def test_target_shares_three_domains_golden():
    # se [.3, 0, 0]; k = 3: sd_d^2 = se_d^2 (1 - 2/3) + sum se^2 / 9 -> a: .03 + .01 = .04, b and c: .01.
    # (dev_a = 2/3 s_a - 1/3 (s_b + s_c): variance 4/9 * .09 = .04; dev_b's: 1/9 * .09 = .01.)
    # Mean 2, dev [1, 0, -1] -> s = [2 + (1 - .2), 2, 2 - (1 - .1)] = [2.8, 2, 1.1], sum 5.9.
    score, se = [3.0, 2.0, 1.0], [0.3, 0.0, 0.0]
    assert target_shares(score, se, [False] * 3) == pytest.approx([2.8 / 5.9, 2 / 5.9, 1.1 / 5.9])
    # temperature 0.5: s^2 = [7.84, 4, 1.21], sum 13.05
    expect = [7.84 / 13.05, 4 / 13.05, 1.21 / 13.05]
    assert target_shares(score, se, [False] * 3, temperature=0.5) == pytest.approx(expect)
    # c saturated: 0, and the others are compared among themselves: mean 2.5, dev +-.5, k = 2: sd_a^2 =
    # (.09 + 0) / 4 -> sd .15, sd_b also .15 -> s = [2.85, 2.15]
    assert target_shares(score, se, [False, False, True]) == pytest.approx([2.85 / 5, 2.15 / 5, 0.0])
    # An unknown domain (se inf) gets the mean of the known ones: b unknown -> mean of a, c = 2, dev +-1,
    # sd_a^2 = .09 * 0 + .09 / 4 -> .15 for both: s = [2.85, 2, 1.15]
    assert target_shares(score, [0.3, math.inf, 0.0], [False] * 3) == pytest.approx(
        [2.85 / 6, 2 / 6, 1.15 / 6]
    )


def test_saturated_enters_on_a_clear_lead_and_stays_while_not_gaining():
    # b: 0.1 < 3 * .2 (not gaining); a gains (2 > .6) and leads by 1.9 > 3 * hypot(.2, .2) = .85.
    assert saturated([2.0, 0.1], [0.2, 0.2], [False, False]).tolist() == [False, True]
    # Lead .6 < 3 * hypot(.3, .3) = 1.27: not enough to enter, enough (> 0) to stay.
    assert saturated([1.0, 0.4], [0.3, 0.3], [False, False]).tolist() == [False, False]
    assert saturated([1.0, 0.4], [0.3, 0.3], [False, True]).tolist() == [False, True]
    # b gains (.95 > .9): not saturated, whatever before; no domain gains: nobody is saturated.
    assert saturated([1.0, 0.95], [0.3, 0.3], [False, True]).tolist() == [False, False]
    assert saturated([0.5, 0.0], [0.3, 0.3], [False, True]).tolist() == [False, False]
    # Unknown domains (se inf) are never saturated, and do not saturate others.
    assert saturated([2.0, 0.0], [math.inf, 0.1], [False, True]).tolist() == [False, False]


# ----------------------------------------------------------------------------------------------------------
# The scheduler: targets from observations, weights moved at a bounded rate


def test_target_golden_and_the_bounded_step():
    # Exact lines (standard errors ~0): scores a .02 / 100 tokens = 2e-4, b 1e-4; c unobserved gets their
    # mean 1.5e-4. Shares [4/9, 2/9, 3/9]; targets .1 + .7 * share.
    s = DomainScheduler(["a", "b", "c"], floor=0.1, warmup=3, max_step=0.05)
    observe(s, "a", [0.0, 0.02, 0.04])
    observe(s, "b", [0.0, 0.01, 0.02])
    expect = {"a": 0.1 + 0.7 * 4 / 9, "b": 0.1 + 0.7 * 2 / 9, "c": 0.1 + 0.7 / 3}
    assert s.target() == pytest.approx(expect)
    assert s.weights() == pytest.approx(dict.fromkeys("abc", 1 / 3))  # weights move only in advance()
    # The largest gap is 0.7 / 9 = .0778 (a and b): a step of .05 is the fraction .05 / .0778 of the way.
    s.advance()
    assert s.weights() == pytest.approx({"a": 1 / 3 + 0.05, "b": 1 / 3 - 0.05, "c": 1 / 3})
    s.advance()  # the gap left, .0278, is within max_step: the target
    assert s.weights() == pytest.approx(expect)


def test_unobserved_domains_get_the_mean_score():
    # Only a is known: the mean of the known scores is a's own, so b's share equals a's.
    s = DomainScheduler(["a", "b"], warmup=3)
    observe(s, "a", [0.0, 0.1, 0.2])
    assert s.target() == pytest.approx({"a": 0.5, "b": 0.5})
    # b with 2 observations (below warmup 3) is still unknown: the same.
    observe(s, "b", [0.0, 0.5])
    assert s.target() == pytest.approx({"a": 0.5, "b": 0.5})


def test_faster_rise_per_unit_cost_gets_the_larger_target():
    # a rises faster per step (0.1 vs 0.06) but costs twice as much: scores 0.1/200 = 0.0005 < 0.06/100.
    # Shares [5/11, 6/11]; targets 0.05 + 0.9 * share.
    s = DomainScheduler(["a", "b"], warmup=3)
    observe(s, "a", [0.0, 0.1, 0.2], tokens=200.0)
    observe(s, "b", [0.0, 0.06, 0.12], tokens=100.0)
    assert s.target() == pytest.approx({"a": 0.05 + 0.9 * 5 / 11, "b": 0.05 + 0.9 * 6 / 11})


def test_costly_domain_gets_less_than_a_cheap_one_with_the_same_gain():
    # same gain 0.1; cost 100 vs 100 + 1000 * 0.5 = 600 -> scores [1e-3, 1.67e-4], shares [6/7, 1/7]
    s = DomainScheduler(["cheap", "sandboxed"], warmup=3)
    observe(s, "cheap", [0.0, 0.1, 0.2])
    observe(s, "sandboxed", [0.0, 0.1, 0.2], seconds=0.5)
    assert s.target() == pytest.approx({"cheap": 0.05 + 0.9 * 6 / 7, "sandboxed": 0.05 + 0.9 / 7})
    assert s.stats()["sandboxed"].cost == 600.0


def test_stalled_domain_falls_to_the_floor_at_the_bounded_rate():
    # "stall" is flat at 0.4 (gain 0, se 0: not gaining) while "rising" gains 0.01 per step with se 0: from
    # the third observation (warmup 3) stall is saturated, its target the floor .05, and its weight falls by
    # max_step = .1 a step: .5, .5, .4, .3, .2, .1, then the floor.
    s = DomainScheduler(["rising", "stall"], floor=0.05, warmup=3, max_step=0.1)
    seen = []
    for step in range(8):
        s.update("rising", step=step, mean_reward=0.01 * step, tokens_generated=100)
        s.update("stall", step=step, mean_reward=0.4, tokens_generated=100)
        s.advance()
        seen.append(s.weights()["stall"])
    assert seen == pytest.approx([0.5, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.05])
    assert s.metrics()["curriculum/stall/saturated"] == 1.0
    assert s.metrics()["curriculum/rising/saturated"] == 0.0


def test_weights_sum_to_one_respect_the_floor_and_move_at_most_max_step():
    rng = np.random.default_rng(0)
    domains = ["math", "code", "terminal", "scene3d", "finance"]
    s = DomainScheduler(domains, floor=0.08, window=40, warmup=3, temperature=0.3, max_step=0.04)
    before = s.weights()
    for step in range(60):
        for d in domains:
            s.update(d, step=step, mean_reward=rng.normal() + 0.2 * step * (d == "code"),
                     tokens_generated=rng.uniform(0, 1e4), sandbox_seconds=rng.uniform(0, 2))  # fmt: skip
        s.advance()
        w = s.weights()
        assert sum(w.values()) == pytest.approx(1.0, abs=1e-12)
        assert min(w.values()) >= 0.08 - 1e-12
        assert max(abs(w[d] - before[d]) for d in domains) <= 0.04 + 1e-12
        before = w
    # It did move: code rises 0.2 a step against noise of sd 1 (over 40 steps its slope's se is about
    # 1 / sqrt(40^3 / 12) = .014), the others are flat and fall to the floor.
    assert w["code"] == pytest.approx(1 - 4 * 0.08)


def test_observe_reads_the_rollout_draws():
    from rl.rollout import DomainDraw

    s = DomainScheduler(["a", "b"], warmup=3, half_life=math.inf)
    for step in range(3):  # a: 4 samples, mean 0.25 * step; b: no sample drawn this batch (skipped)
        s.observe(step, {"a": DomainDraw(4, step * 1.0, 40, 0.5), "b": DomainDraw()})
    assert s.history["a"] == [[i, 0.25 * i, 4, 40.0, 0.5] for i in range(3)]
    assert s.history["b"] == []
    assert s.stats()["a"].gain == pytest.approx(0.25) and s.stats()["a"].cost == 40 + 1000 * 0.5


def test_allocate_golden():
    s = DomainScheduler(["a", "b", "c"], mode="static", static_weights={"a": 17, "b": 10, "c": 3}, floor=0.1)
    # weights [17/30, 10/30, 3/30]; n = 10: quotas [5.67, 3.33, 1.0] -> floors [5, 3, 1], the one left to a
    assert s.allocate(10) == {"a": 6, "b": 3, "c": 1}
    # n = 30: quotas are integers [17, 10, 3]
    assert s.allocate(30) == {"a": 17, "b": 10, "c": 3}
    # n = 2 < 3 domains: quotas [1.13, 0.67, 0.2] -> floors [1, 0, 0], the one left to b (remainder .67)
    assert s.allocate(2) == {"a": 1, "b": 1, "c": 0}
    assert s.allocate(0) == {"a": 0, "b": 0, "c": 0}


def test_allocate_gives_every_floor_domain_a_task():
    s = DomainScheduler(["a", "b", "c"], mode="static", static_weights={"a": 18, "b": 1, "c": 1}, floor=0.05)
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
                reward, tokens, seconds = (  # math rises, the others are noise
                    float(rng.normal()) + 2.0 * step * (d == "math"),
                    float(rng.integers(1, 999)),
                    float(rng.uniform()),
                )
                sched.update(
                    d, step=step, mean_reward=reward, tokens_generated=tokens, sandbox_seconds=seconds
                )
            sched.advance()
            out.append((sched.weights(), sched.allocate(17)))
        return out

    a = DomainScheduler(domains, window=4, warmup=3, temperature=0.7, max_step=0.1, seed=5)
    feed(a, range(6))
    state = json.loads(json.dumps(a.state_dict()))
    assert state["mode"] == "adaptive" and len(state["history"]["math"]) == 4
    assert state["weights"] != [1 / 3] * 3  # the weights moved: resuming must restore them too
    b = DomainScheduler(domains, window=4, warmup=3, temperature=0.7, max_step=0.1, seed=5)
    b.load_state_dict(state)
    rng_state = rng.bit_generator.state
    after_a = feed(a, range(6, 14))
    rng.bit_generator.state = rng_state
    after_b = feed(b, range(6, 14))
    assert after_a == after_b  # exactly equal, not approximately
    assert DomainScheduler.from_state_dict(state).state_dict() == state
    other = DomainScheduler(domains, window=5, warmup=3, temperature=0.7, max_step=0.1, seed=5)
    with pytest.raises(ValueError, match="window: saved 4, here 5.*from_state_dict"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(domains=[]), "at least one domain"),
        (dict(domains=["a", "a"]), r"\['a'\] more than once"),
        (dict(mode="greedy"), "mode='greedy'"),
        (dict(floor=0.4), r"floor=0.4 with 3 domains.*floor <= 0.3333"),
        (dict(floor=-0.1), "floor=-0.1"),
        (dict(window=2), "window=2.*window >= 3"),
        (dict(half_life=0.0), "half_life=0.0"),
        (dict(z=-1.0), "z=-1.0"),
        (dict(saturation_z=math.inf), "saturation_z=inf"),
        (dict(warmup=200), r"warmup=200.*\[0, window=192\]"),
        (dict(warmup=1.5), "warmup=1.5"),
        (dict(max_step=0.0), "max_step=0.0"),
        (dict(max_step=1.5), "max_step=1.5"),
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
    with pytest.raises(ValueError, match="samples=0"):
        s.update("a", step=4, mean_reward=0.5, tokens_generated=10, samples=0)
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        s.allocate(-1)


def test_metrics():
    s = DomainScheduler(["a", "b"], warmup=3, half_life=math.inf)
    observe(s, "a", [0.0, 0.1, 0.3])
    s.advance()
    m = s.metrics()
    per_domain = {"target", "saturated", "cost"}  # b is unobserved: no gain, score or errors yet
    known = per_domain | {"gain", "gain_se", "score", "score_se"}
    expect = {"weight/a", "weight/b"} | {f"curriculum/a/{k}" for k in known}
    assert set(m) == expect | {f"curriculum/b/{k}" for k in per_domain}
    # y = [0, .1, .3] mean 2/15, dx = [-1, 0, 1]: slope .3 / 2 = .15; fitted 2/15 + .15 dx, residuals
    # [1, -2, 1] / 60: sigma^2 = (6 / 3600) / (3 - 2) = 1/600, se^2 = sigma^2 / Sxx = 1/1200
    assert m["curriculum/a/gain"] == pytest.approx(0.15) and m["curriculum/a/cost"] == 100.0
    assert m["curriculum/a/gain_se"] == pytest.approx(math.sqrt(1 / 1200))
    assert m["curriculum/a/score_se"] == pytest.approx(math.sqrt(1 / 1200) / 100)
    assert m["curriculum/b/cost"] == 100.0  # unobserved: the others' mean
    assert m["weight/a"] + m["weight/b"] == pytest.approx(1.0)
    assert m["curriculum/a/target"] == m["curriculum/b/target"] == 0.5


def test_from_config_maps_every_field_and_names_a_bad_one():
    from configs import grpo

    rl = grpo.get_config("tiny").rl
    rl.curriculum_half_life, rl.curriculum_max_step, rl.curriculum_floor = 24.0, 0.02, 0.2
    s = from_config(rl, ["a", "b"], seed=7)
    assert (s.half_life, s.max_step, s.floor, s.seed, s.mode) == (24.0, 0.02, 0.2, 7, "adaptive")
    assert (s.window, s.warmup, s.z, s.saturation_z) == (192, 16, 1.0, 3.0)
    rl.curriculum_z = -2.0
    with pytest.raises(ValueError, match=r"^rl.curriculum_z=-2.0: use a finite z >= 0"):
        from_config(rl, ["a", "b"])
    rl.curriculum_z, rl.curriculum = 1.0, "greedy"
    with pytest.raises(ValueError, match=r"^rl.curriculum='greedy'"):
        from_config(rl, ["a", "b"])
    rl.curriculum = "static"
    rl.static_weights = {"a": 3.0, "b": 1.0}
    assert from_config(rl, ["a", "b"]).weights() == {"a": 0.75, "b": 0.25}


def test_plot_draws_the_weights_with_the_gain_bands(tmp_path):
    from rl import metrics, plot

    s = DomainScheduler(["a", "b"], warmup=3, half_life=math.inf)
    with metrics.MetricsLogger(tmp_path, tensorboard=False, stream=None) as log:
        for step, (ra, rb) in enumerate([(0.0, 0.5), (0.1, 0.5), (0.3, 0.5), (0.3, 0.5)]):
            observe(s, "a", [ra], start=step)
            observe(s, "b", [rb], start=step)
            s.advance()
            log.log(step, s.metrics())
    records = metrics.read_metrics(tmp_path)
    bands = plot.gain_bands(records)
    # a from its third observation: y = [0, .1, .3] -> .15 +- 2 sqrt(1/1200) (test_metrics); then
    # y = [0, .1, .3, .3]: dx = [-1.5, -.5, .5, 1.5], y mean .175, slope (.2625 + .0375 + .0625 + .1875) / 5
    # = .11; residuals [-.01, -.02, .07, -.04], sum of squares .007 -> se^2 = .007 / 2 / 5.
    steps, gain, lo, hi = bands["a"]
    assert steps.tolist() == [2, 3] and gain == pytest.approx([0.15, 0.11])
    se = np.array([math.sqrt(1 / 1200), math.sqrt(0.0007)])
    assert lo == pytest.approx(gain - 2 * se) and hi == pytest.approx(gain + 2 * se)
    assert bands["b"][1] == pytest.approx([0.0, 0.0], abs=1e-12)  # flat: gain 0, se 0
    out = tmp_path / "curves.png"
    assert plot.plot(records, out) == {"reward": 0, "eval": 0, "weight": 2}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5_000


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
    from envs.qa import gate as qa

    gate = lambda d: qa.run_checks(d, n=2, seed=0, probe_tasks=1)  # about 0.3 s for math on 2 cores
    assert admit_domains(["math"], gate=gate) == ["math"]
    with pytest.raises(DomainRefused, match=r"'no_such_domain' failed the quality gate: load \(KeyError"):
        admit_domains(["math", "no_such_domain"], gate=gate)


# ----------------------------------------------------------------------------------------------------------
# Simulated learning curves with binomial noise at the demo's sample counts
#
# The demo draws 16 prompts x 8 samples a step over two domains with floor 0.25. Here every sample costs 8
# tokens and earns 1 with probability p_d(c), c the tokens spent on d so far: a learning curve per unit of
# compute. The failure probabilities are derived by `python -m benchmarks curriculum --derive` (not by
# simulating the scheduler): each estimate taken as normal with the standard error its regression weights
# give under the true p (1 - p), along the allocation path the rule should follow, and union bounds over
# the steps.

PROMPTS, GROUP, TOKENS = 16, 8, 8


def linear(p0, per_step):
    """A learning curve rising `per_step` a step at an equal share (64 samples, 512 tokens a step)."""
    return lambda c: min(p0 + per_step * c / (PROMPTS // 2 * GROUP * TOKENS), 1.0)


def simulate(curves, *, steps=300, seed=0):
    """Weights [step, domain] of the default adaptive scheduler (floor .25) over `steps` simulated steps."""
    sched = DomainScheduler(list(curves), floor=0.25)
    rng = np.random.default_rng(seed)
    spent = dict.fromkeys(curves, 0.0)
    out = []
    for step in range(steps):
        for d, prompts in sched.allocate(PROMPTS).items():
            n = prompts * GROUP
            if n:
                wins = rng.binomial(n, curves[d](spent[d]))
                spent[d] += n * TOKENS
                sched.update(d, step=step, mean_reward=wins / n, tokens_generated=n * TOKENS, samples=n)
        sched.advance()
        out.append(list(sched.weights().values()))
    w = np.array(out)
    assert np.abs(np.diff(w, axis=0)).max() <= 0.01 + 1e-12  # max_step, by construction
    return w


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_curves_keep_the_weights_equal(seed):
    # Both rise .0028 a step at an equal share (p .05 -> .89 in 300 steps). With equal scores, a's target
    # .25 + .5 share_a leaves [.45, .55] only when the estimated difference d beats its error SE by .2 x
    # (sum of the scores) = .4 g: P = 2 Phi(-(1 + .4 g / SE)) a step. Summed over steps 75..300: 3.3e-4. From
    # step 75 on, with targets in the band, a weight in [.25, .75] moving .01 a step reaches the band by
    # step 95 and stays: P(fail) <= 3.3e-4 per seed.
    w = simulate({"a": linear(0.05, 0.0028), "b": linear(0.05, 0.0028)}, seed=seed)[:, 0]
    assert np.abs(w[100:] - 0.5).max() <= 0.05
    assert w[100:].std() < 0.05  # the criterion, implied by the band


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_domain_learning_twice_as_fast_per_compute_gains_weight_and_keeps_it(seed):
    # a rises .0025 a step at an equal share, b .00125: per token a learns twice as fast. a's target exceeds
    # .5 whenever a's estimated score beats b's by more than SE (z = 1) and a is gaining (t > 3):
    # P(not) = Phi(1 - d / SE) + Phi(3 - t_a) a step, along the path (equal shares to step 60, then a's weight
    # rising .01 a step to 7/12); summed over steps 100..300: 1.5e-4 (d / SE is 5.0 at step 100, 7.5 at
    # 150). With every target above .5 from step 100, a's weight (>= .25, +.01 a step) is above b's from
    # step 126 (index 125) on: P(fail) <= 1.5e-4 per seed. It typically crosses near step 60.
    w = simulate({"a": linear(0.05, 0.0025), "b": linear(0.05, 0.00125)}, seed=seed)
    assert (w[125:, 0] > w[125:, 1]).all()


def test_a_saturated_domain_falls_to_the_floor():
    # b is flat at .8 while a rises .002 a step at an equal share. b is saturated at step 150 unless a's
    # lead is under 3 SE (P = 6e-6: lead / SE = 7.4) or b's t-stat is over 3 (1.35e-3); it then stays
    # saturated until b's t-stat exceeds 3 again ("exit steps", k of them in 150..300: E[k] = 151 x 1.35e-3 =
    # .20). Without exits b's weight falls .01 a step from <= .75 to the floor .25 by step 200; each exit
    # step lifts it at most .01 and costs one more step back, so in steps 200..300 it is off the floor on
    # <= 2k steps and at most .02 k above it. Both assertions fail only if k >= 11: Markov P <= .20 / 11 =
    # .019, so P(fail) <= .02 (loose: exits come in runs of ~3 steps, P(any) <= .06 by Rice's bound).
    w_b = simulate({"a": linear(0.05, 0.002), "b": lambda c: 0.8})[:, 1]
    assert np.isclose(w_b[200:], 0.25).sum() >= 80
    assert w_b[200:].max() <= 0.25 + 0.2


# A deterministic compute-saving check. name: (reward ceiling A, compute scale K in tokens, tokens per task,
# sandbox seconds per task); the domain's mean reward after spending c token-equivalents on it is
# A * (1 - exp(-c / K)).
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
        sched.advance()
        if total >= target:
            return sum(spent.values())
    raise AssertionError(f"total reward {target} not reached in {max_steps} steps")


def test_adaptive_reaches_the_reward_with_less_compute_than_uniform():
    # Total reward 1.5 of 2.5. Uniform: 8 tasks per domain per step cost 8 * 400 + 8 * 1000 + 8 * 300 = 13,600
    # tokens and the total crosses 1.5 at step 95: 1,292,000. Adaptive spends on math and finance while they
    # rise fastest per token and on code (expensive: 0.4 sandbox s per task) once they flatten: 1,092,900
    # here. The rule waits for 16 observations and moves a weight at most .01 a step, so it spends the first
    # ~20 of the ~95 steps near uniform.
    uniform = compute_to_reach(DomainScheduler(list(CURVES), mode="static"), 1.5)
    adaptive = compute_to_reach(DomainScheduler(list(CURVES)), 1.5)
    assert uniform == 1_292_000
    assert adaptive < 0.9 * uniform, (adaptive, uniform)
