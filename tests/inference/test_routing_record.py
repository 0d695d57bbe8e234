"""EngineConfig(record_routing=True): the engine's routing record equals a plain teacher-forced forward's.

Tolerance: 0 mismatching rows. A row is (MoE layer, position) and is compared as a set of k experts (the
order of equal-set rows is checked too, see `_mismatches`). The engine routes each token from hidden states
computed by the paged attention path (decode kernel, chunked prefill, verification), the plain forward by
full causal attention; in f32 these differ by rounding (~1e-6), so a row could only differ where two
router scores are that close: none does on these inputs, and a mismatch here means a record landed at the
wrong position, page or sequence.
"""

import dataclasses

import numpy as np
import pytest
from engine_checks import check_released as _check_released
from engine_checks import padded_forward, scribble_free_pages, warm_engine
from engine_checks import prompts as _prompts
from engines import small_engine, tiny_target
from flax import nnx

import model
from configs import tiny
from inference import routing
from inference.drafters import GroupDrafter, NgramDrafter
from inference.engine import Engine
from inference.sampling import SamplingParams

ECFG = small_engine(record_routing=True)
NAIVE_LEN = 128


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def engine(target):
    cfg, _, params = target
    return warm_engine(cfg, params, ECFG)


@pytest.fixture(scope="module")
def plain_routing(target):
    """expert_indices [L_moe, T, k] of a plain forward over a right-padded row."""
    _, m, params = target
    run = padded_forward(m, lambda net, tokens_BT: net(tokens_BT)[1]["expert_indices"][:, 0], NAIVE_LEN, 1)
    return lambda tokens: run(params, tokens)


def _mismatches(plain_routing, prompts, outs) -> int:
    """Rows (layer, position) whose expert set differs from the plain forward's, over all positions but the
    last (never fed); checks shape, dtype, the last row, and the order within equal sets."""
    bad = 0
    for c in outs:
        tokens = prompts[c.prompt_index] + c.tokens
        got_LTk = c.expert_indices
        assert got_LTk.shape == (2, len(tokens), 2) and got_LTk.dtype == np.int8, got_LTk.shape
        np.testing.assert_array_equal(got_LTk[:, -1], np.broadcast_to(np.arange(2), (2, 2)))
        want_LTk = plain_routing(tokens)[:, :-1]
        got_LTk = got_LTk[:, :-1]
        same_set = np.all(np.sort(got_LTk, -1) == np.sort(want_LTk, -1), axis=-1)
        bad += int(np.sum(~same_set))
        np.testing.assert_array_equal(got_LTk[same_set], want_LTk[same_set])  # top_k order: by score
    return bad


@pytest.mark.parametrize("temperature, n", [(0.0, 2), (1.0, 3)])
def test_record_equals_plain_forward(engine, plain_routing, temperature, n):
    # Length 1 (nothing to prefill), page boundaries (7, 8, 9), chunked prefills (33, 50 > prefill_chunk 32);
    # n samples fork each context (copy-on-write of the shared partial last page).
    prompts = _prompts(0, [1, 7, 8, 9, 33, 50])
    sp = SamplingParams(temperature=temperature, max_new_tokens=12, n=n, seed=3)
    outs = engine.generate(prompts, sp)
    assert len(outs) == n * len(prompts)
    assert _mismatches(plain_routing, prompts, outs) == 0
    assert engine.stats()["compiles_after_warmup"] == 0
    _check_released(engine)


def test_record_with_prefix_cache_hits(engine, plain_routing):
    system = _prompts(1, [24])[0]
    prompts = [system + p for p in _prompts(2, [3, 17])]
    sp = SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=4)
    before = engine.stats()["prefix_cache"]["hit_tokens"]
    first = engine.generate(prompts, sp)
    second = engine.generate(prompts, sp)  # the contexts' full pages come from the cache, routing included
    assert engine.stats()["prefix_cache"]["hit_tokens"] - before >= 2 * 24
    assert [c.tokens for c in second] == [c.tokens for c in first]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.expert_indices, b.expert_indices)
    assert _mismatches(plain_routing, prompts, first + second) == 0


def test_record_moves_with_the_host_tier(target, plain_routing):
    """A prefix block moved to the host tier takes its routing rows along: after the free pages are
    scribbled over, the reloaded contexts' records still equal the plain forward's."""
    cfg, _, params = target
    eng = Engine(cfg, params, dataclasses.replace(ECFG, host_cache_pages=32))
    system = _prompts(6, [24])[0]
    prompts = [system + p for p in _prompts(7, [3, 17])]
    sp = SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=4)
    first = eng.generate(prompts, sp)
    assert eng.offload_prefix(64) > 0
    scribble_free_pages(eng, seed=1)
    second = eng.generate(prompts, sp)
    assert eng.stats()["prefix_cache"]["reloads"] >= 3  # the 24-token system prompt's three pages
    assert [c.tokens for c in second] == [c.tokens for c in first]
    assert _mismatches(plain_routing, prompts, second) == 0
    _check_released(eng)


def test_record_with_preemption(target, plain_routing):
    cfg, _, params = target
    prompts = _prompts(3, [30, 31, 29, 28])
    # Each sequence grows to 9 pages of 8 tokens; 4 of them need 36 > the 19 usable pages.
    small = Engine(cfg, params, dataclasses.replace(ECFG, num_pages=20, prefix_cache_pages=0))
    outs = small.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=40, seed=5))
    assert small.stats()["preemptions"] > 0
    assert _mismatches(plain_routing, prompts, outs) == 0
    _check_released(small)


@pytest.mark.parametrize("draft", [NgramDrafter(2), GroupDrafter(2)], ids=["ngram", "group"])
def test_record_with_speculative_rollback(target, plain_routing, draft):
    cfg, _, params = target
    eng = Engine(cfg, params, ECFG, draft=draft)
    eng.warmup()
    # Repetitive prompts and greedy loops give proposals (the random model's sampled text at T > 0 hardly
    # ever repeats); many are rejected: verification writes k + 1 positions, the rollback keeps the accepted.
    prompts = [[5, 6, 7, 8] * 4, [9, 10] * 6 + _prompts(4, [5])[0]]
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24, n=3))
    stats = eng.stats()
    assert stats["proposed_tokens"] > stats["accepted_tokens"] > 0, stats
    assert _mismatches(plain_routing, prompts, outs) == 0
    assert stats["compiles_after_warmup"] == 0
    _check_released(eng)


def test_memory_cost_and_dtype(engine):
    # L_moe * k bytes per slot: 2 MoE layers * top-2 experts * int8 (4 experts <= 127).
    experts = engine.kv["experts"]
    assert experts.shape == (2, ECFG.pool_pages, ECFG.page_size, 2) and experts.dtype == np.int8
    assert experts.nbytes == 2 * 2 * 1 * ECFG.pool_pages * ECFG.page_size
    assert routing.dtype(127) == np.int8 and routing.dtype(128) == np.int16  # 2 L_moe k bytes past 127


def test_off_by_default_and_dense_models(target, engine):
    cfg, _, params = target
    plain = Engine(cfg, params, dataclasses.replace(ECFG, record_routing=False))
    out = plain.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0]
    assert out.expert_indices is None and "experts" not in plain.kv
    dense_cfg = tiny.get_config("dense")
    dense = Engine(dense_cfg, nnx.state(model.build(dense_cfg), nnx.Param), ECFG)
    out = dense.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0]
    assert out.expert_indices.shape == (0, 7, 2)  # no MoE layer: L_moe = 0
