"""Helpers shared by the engine tests: a plain forward over a padded row, a warmed-up engine (or a
single-step and a many-step one), random prompts, stop tokens taken from a free run, the check that an
engine gave back every page, the comparison of two engines' completions, and the host tier's round trip
beside a twin."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference import kv_pages
from inference.engine import Engine
from inference.sampling import SamplingParams


def padded_forward(m, outputs, length: int, time_axis: int = 0):
    """`run(params, tokens)`: `outputs(net, tokens_BT)` of the network `m` with `params` over one row of
    `tokens` right-padded to `length` (one compiled program for every row), each output array cut back to
    len(tokens) positions along `time_axis` (causal: the padding never changes earlier positions)."""
    graphdef = nnx.graphdef(m)

    @jax.jit
    def run_padded(params, tokens_T):
        return outputs(nnx.merge(graphdef, params), tokens_T[None])

    def run(params, tokens):
        padded = np.zeros(length, np.int32)
        padded[: len(tokens)] = tokens
        cut = (slice(None),) * time_axis + (slice(len(tokens)),)
        return jax.tree.map(lambda a: np.asarray(a)[cut], run_padded(params, padded))

    return run


def warm_engine(cfg, params, ecfg, draft=None, **fields):
    """An `Engine` on `ecfg` with `fields` replaced, warmed up (everything it runs compiled)."""
    eng = Engine(cfg, params, dataclasses.replace(ecfg, **fields), draft=draft)
    eng.warmup()
    return eng


def single_and_many(cfg, params, ecfg, decode_steps: int, make_draft=lambda: None):
    """Two warmed-up engines on `ecfg` that differ only in steps per device call: 1 and `decode_steps`."""
    single = warm_engine(cfg, params, ecfg, draft=make_draft())
    return single, warm_engine(cfg, params, ecfg, draft=make_draft(), decode_steps=decode_steps)


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n).tolist() for n in lengths]


def stops_from(eng, prompts, positions, **sampling) -> SamplingParams:
    """`SamplingParams(**sampling)` that stop on the token at `positions[i]` of `eng`'s i-th completion of
    `prompts` under the same sampling without stop tokens."""
    free = eng.generate(prompts, SamplingParams(**sampling))
    return SamplingParams(**sampling, stop_tokens=tuple(c.tokens[i] for c, i in zip(free, positions)))


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


def scribble_free_pages(eng, seed: int = 0) -> None:
    """Random contents in every free pool page of every page array the engine keeps (target K/V or latent,
    routing record, drafter pages): a host-tier reload that left an array out would read them."""
    free = eng.pool.free_pages()
    rng = np.random.default_rng(seed)
    arrays = eng._page_arrays()
    noise = {}
    for name, a in arrays.items():
        shape = (a.shape[0], len(free)) + a.shape[2:]
        integer = jnp.issubdtype(a.dtype, jnp.integer)
        noise[name] = (rng.integers(0, 100, shape) if integer else rng.normal(0, 10, shape)).astype(a.dtype)
    eng._set_page_arrays(kv_pages.scatter_pages(arrays, free, noise))


def host_tier_twins(cfg, params, ecfg, prompts, sp, make_draft=lambda: None):
    """Two engines run `prompts` twice: one with a host tier, which moves every cached prefix block to the
    host and scribbles over the free pages between the runs (its second run reloads them), and a twin
    without one (its second run hits the same blocks on device). Returns the second runs' completions and
    drafter counters [(completions, {accepted_tokens, proposed_tokens}), ...], host tier first."""
    out = []
    for host_pages in (64, 0):
        eng = Engine(cfg, params, dataclasses.replace(ecfg, host_cache_pages=host_pages), draft=make_draft())
        eng.generate(prompts, sp)
        before = eng.stats()
        if host_pages:
            assert eng.offload_prefix(host_pages) > 0
            scribble_free_pages(eng)
        second = eng.generate(prompts, sp)
        after = eng.stats()
        assert after["prefix_cache"]["hit_tokens"] > before["prefix_cache"]["hit_tokens"]
        if host_pages:
            assert after["prefix_cache"]["reloads"] > 0
        check_released(eng)
        counters = {k: after.get(k, 0) - before.get(k, 0) for k in ("accepted_tokens", "proposed_tokens")}
        out.append((second, counters))
    return out
