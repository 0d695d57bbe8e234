"""`EngineConfig.decode_steps` with a `ModelDrafter`: N speculative steps per device call give the tokens of
N single-step calls.

Each step of a row runs with the start, pending token and keys a single-step call at that point would get,
so for the same seeds the tokens equal those of one speculative step per call (greedy and T=1), the
log-probs agree to f32 rounding, the drafts proposed and accepted are the same, stop tokens and
max_new_tokens end a completion where the single-step engine ends it (also inside a step's accepted run),
reserved pages that were not used go back, and nothing compiles after warmup. The drafter's weights are 90%
the target's, so some drafts are accepted and some are not (both paths of the verification run).
"""

import dataclasses

import jax
import pytest
from engine_checks import check_released as _check_released
from engine_checks import prompts as _prompts
from engine_checks import same_completions as _same
from engine_checks import single_and_many, stops_from
from engines import small_engine, tiny_target
from flax import nnx

import model
from inference.drafters import ModelDrafter, NgramDrafter
from inference.engine import Engine
from inference.sampling import SamplingParams

ECFG = small_engine(num_pages=128, num_draft=3)
COUNTS = ("proposed_tokens", "accepted_tokens", "target_row_forwards", "generated_tokens")


@pytest.fixture(scope="module")
def pair():
    cfg, _, params = tiny_target()
    other = nnx.state(model.build(cfg, seed=7), nnx.Param)
    return cfg, params, jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, params, other)


@pytest.fixture(scope="module")
def engines(pair):
    """One speculative step per call, and 4."""
    cfg, params, draft_params = pair
    return single_and_many(cfg, params, ECFG, 4, lambda: ModelDrafter(cfg, draft_params))


def _run(eng, prompts, sampling):
    before = eng.stats()
    out = eng.generate(prompts, sampling)
    after = eng.stats()
    return out, {k: after.get(k, 0) - before.get(k, 0) for k in (*COUNTS, "spec_steps", "spec_calls")}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_many_spec_steps_per_call_give_the_single_step_tokens(engines, temperature):
    single, many = engines
    # 6 prompts for 4 slots (rows admitted between calls), n=2 forks, budgets that end inside a step's
    # accepted run (1, 3: fewer than num_draft + 1) and budgets longer than one call (4 steps of up to 4).
    prompts = _prompts(1, [5, 17, 9, 30, 3, 12])
    budgets = (13, 3, 21, 8, 1, 19)
    sampling = [SamplingParams(temperature=temperature, max_new_tokens=m, n=2, seed=7) for m in budgets]
    want, d_single = _run(single, prompts, sampling)
    got, d_many = _run(many, prompts, sampling)
    _same(got, want)
    assert [len(c.tokens) for c in got] == [m for m in budgets for _ in range(2)]
    assert {k: d_many[k] for k in COUNTS} == {k: d_single[k] for k in COUNTS}
    assert 0 < d_many["accepted_tokens"] < d_many["proposed_tokens"]  # some drafts accepted, some not
    assert d_single.get("spec_calls", 0) == 0
    assert d_many["spec_calls"] < d_single["spec_steps"] / 2
    _check_released(many)
    assert many.stats()["compiles_after_warmup"] == 0


def test_stop_tokens_end_the_completion_inside_a_call(engines):
    single, many = engines
    prompts = _prompts(2, [7, 11, 4])
    sampling = stops_from(single, prompts, (2, 9, 5), temperature=1.0, max_new_tokens=40, seed=3)
    stops = sampling.stop_tokens
    want, d_single = _run(single, prompts, sampling)
    got, d_many = _run(many, prompts, sampling)
    _same(got, want)
    assert {k: d_many[k] for k in COUNTS} == {k: d_single[k] for k in COUNTS}
    assert all(c.finish_reason == "stop" and c.tokens[-1] in stops for c in got)
    assert len(got[0].tokens) <= 3 and len(got[1].tokens) <= 10 and len(got[2].tokens) <= 6
    _check_released(many)
    assert many.stats()["compiles_after_warmup"] == 0


def test_other_drafters_refuse_many_steps_naming_the_field(pair):
    cfg, params, _ = pair
    with pytest.raises(ValueError, match="engine.decode_steps=4 must be 1 with a NgramDrafter"):
        Engine(cfg, params, dataclasses.replace(ECFG, decode_steps=4), draft=NgramDrafter(3))
