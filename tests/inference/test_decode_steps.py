"""`EngineConfig.decode_steps`: N decode steps per device call give the tokens of N single-step calls.

Each row's token at decode step i is drawn with the key of step i whatever the call it falls in, so for the
same seeds the tokens of N-step calls equal those of single steps (greedy and T=1), the log-probs agree to
f32 rounding, stop tokens and max_new_tokens end a completion where a single-step engine ends it, pages
reserved for a call and not used go back, and nothing compiles after warmup.
"""

import dataclasses

import pytest
from engine_checks import check_released as _check_released
from engine_checks import prompts as _prompts
from engine_checks import same_completions as _same
from engine_checks import single_and_many, stops_from, warm_engine
from engines import small_engine, tiny_target

from inference.drafters import NgramDrafter
from inference.engine import Engine, EngineConfig
from inference.sampling import SamplingParams

ECFG = small_engine()


@pytest.fixture(scope="module")
def target():
    cfg, _, params = tiny_target()
    return cfg, params


@pytest.fixture(scope="module")
def engines(target):
    """One decode step per call, and 8."""
    return single_and_many(*target, ECFG, 8)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_many_steps_per_call_give_the_single_step_tokens(engines, temperature):
    single, many = engines
    # 6 prompts for 4 slots (rows admitted between calls), lengths that are not multiples of 8, n=2 forks.
    prompts = _prompts(1, [5, 17, 9, 30, 3, 12])
    sampling = [
        SamplingParams(temperature=temperature, max_new_tokens=m, n=2, seed=7) for m in (13, 3, 21, 8, 1, 16)
    ]
    want = single.generate(prompts, sampling)
    calls = many.stats().get("decode_calls", 0)
    got = many.generate(prompts, sampling)
    _same(got, want)
    assert [len(c.tokens) for c in got] == [m for m in (13, 3, 21, 8, 1, 16) for _ in range(2)]
    # 12 sequences through 4 slots: far fewer device calls than the 30-odd single steps.
    assert many.stats()["decode_calls"] - calls < sum((13, 3, 21, 8, 1, 16)) * 2 / 4
    _check_released(many)
    assert many.stats()["compiles_after_warmup"] == 0


def test_stop_tokens_end_the_completion_inside_a_call(engines):
    single, many = engines
    prompts = _prompts(2, [7, 11, 4])
    # Stop on the 3rd token of the first completion and the 10th of the second (inside a call of 8).
    sampling = stops_from(single, prompts, (2, 9), temperature=1.0, max_new_tokens=40, seed=3)
    stops = sampling.stop_tokens
    want = single.generate(prompts, sampling)
    got = many.generate(prompts, sampling)
    _same(got, want)
    assert got[0].finish_reason == "stop" and got[0].tokens[-1] in stops and len(got[0].tokens) <= 3
    assert got[1].finish_reason == "stop" and len(got[1].tokens) <= 10
    _check_released(many)


def test_a_finished_row_idles_at_most_n_minus_one_steps(engines):
    _, many = engines
    # One row of 2 tokens beside one of 20: the short one leaves after the first call (2 of its 8 steps);
    # the long one needs ceil(20 / 8) = 3 calls and 20 target forwards in all for its 20 tokens.
    before = many.stats()
    out = many.generate(_prompts(3, [6, 6]), [SamplingParams(max_new_tokens=m, seed=1) for m in (2, 20)])
    after = many.stats()
    assert [len(c.tokens) for c in out] == [2, 20]
    assert after["decode_calls"] - before.get("decode_calls", 0) == 3
    assert after["target_row_forwards"] - before.get("target_row_forwards", 0) == 22
    assert after["decode_steps"] - before.get("decode_steps", 0) == 20  # loop steps run: 8 + 8 + 4
    _check_released(many)
    # The steps' wall time splits into device wait and host work, both positive (their ratio is a speed
    # figure: benchmarks/decode.py reports the host share).
    step_s = after["step_s"] - before["step_s"]
    wait_s = after["device_wait_s"] - before["device_wait_s"]
    assert 0 < wait_s < step_s


def test_pool_pressure_preempts_and_keeps_the_tokens(target, engines):
    single, _ = engines
    # 16 + 1 pages of 8 tokens for 4 slots of up to 30 + 40 tokens: calls reserve 8 slots per row, so
    # sequences are preempted and re-prefilled; the tokens stay those of the roomy single-step engine.
    tight = warm_engine(*target, ECFG, decode_steps=8, num_pages=17, prefix_cache_pages=0)
    prompts = _prompts(4, [30, 25, 28, 20, 22])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40, seed=5)
    _same(tight.generate(prompts, sampling), single.generate(prompts, sampling))
    assert tight.stats()["preemptions"] > 0
    _check_released(tight)
    assert tight.stats()["compiles_after_warmup"] == 0


def test_errors_name_the_field(target, engines):
    cfg, params = target
    _, many = engines
    with pytest.raises(ValueError, match="engine.decode_steps=4 must be 1 with a NgramDrafter"):
        Engine(cfg, params, dataclasses.replace(ECFG, decode_steps=4), draft=NgramDrafter(3))
    with pytest.raises(ValueError, match="engine.max_stop_tokens=8"):
        many.generate([[1, 2]], SamplingParams(max_new_tokens=4, stop_tokens=tuple(range(9))))
    with pytest.raises(ValueError, match="engine.decode_steps=0 must be >= 1"):
        EngineConfig(decode_steps=0)
