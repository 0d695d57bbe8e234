"""Helpers shared by the engine tests: a warmed-up engine, random prompts, the check that an engine gave back
every page, and the comparison of two engines' completions."""

import dataclasses

import numpy as np


def warm_engine(cfg, params, ecfg, draft=None, **fields):
    """An `Engine` on `ecfg` with `fields` replaced, warmed up (everything it runs compiled)."""
    from inference.engine import Engine

    eng = Engine(cfg, params, dataclasses.replace(ecfg, **fields), draft=draft)
    eng.warmup()
    return eng


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n).tolist() for n in lengths]


def check_released(eng) -> None:
    """No work left, a consistent page table, and every page free or held by the prefix cache."""
    assert not eng.has_work()
    eng.table.check()
    assert eng.pool.num_free + len(list(eng.prefix.held_pages())) == eng.pool.num_pages - 1


def same_completions(a, b) -> None:
    """The same completions in the same order: tokens and finish reasons equal, log-probs to f32 rounding."""
    assert [(c.prompt_index, c.sample_index) for c in a] == [(c.prompt_index, c.sample_index) for c in b]
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
        assert x.finish_reason == y.finish_reason
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        np.testing.assert_allclose(x.raw_logprobs, y.raw_logprobs, atol=1e-5)
