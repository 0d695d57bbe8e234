"""inference.Engine on the tiny MoE model: exact vs naive decoding, sharing, speculation, no recompiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import check_fits, check_rejects, first_tokens, power_against, sample_counts
from engine_checks import check_released as _check_released
from engine_checks import (
    host_tier_twins,
    padded_forward,
    same_completions,
    scribble_free_pages,
    warm_engine,
)
from engine_checks import prompts as _prompts
from engines import small_engine, tiny_target
from flax import nnx

import model
from configs import tiny
from inference import sampling
from inference.drafters import GroupDrafter, ModelDrafter, NgramDrafter
from inference.engine import Engine, EngineConfig
from inference.sampling import SamplingParams

# One set of sizes for every engine here, so they share compiled steps (page pool, table width, buckets).
ECFG = small_engine()
NAIVE_LEN = 128


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def engine(target):
    cfg, _, params = target
    return warm_engine(cfg, params, ECFG)


@pytest.fixture(scope="module")
def forward(target):
    """Plain forward's log-probs [T, V] over a right-padded row."""

    def logp(net, tokens_BT):
        logits_BTV, _ = net(tokens_BT)
        return jax.nn.log_softmax(logits_BTV[0], axis=-1)

    return padded_forward(target[1], logp, NAIVE_LEN)


def naive_greedy(forward, params, prompt, n):
    """Recomputes the whole sequence for every new token."""
    seq, raw = list(prompt), []
    for _ in range(n):
        logp_V = forward(params, seq)[-1]
        seq.append(int(np.argmax(logp_V)))
        raw.append(float(logp_V[seq[-1]]))
    return seq[len(prompt) :], raw


def test_greedy_equals_naive_decode(target, engine, forward):
    _, _, params = target
    # Length 1 (nothing to prefill), page boundaries (7, 8, 9), a chunked prefill (33, 50 > prefill_chunk 32).
    prompts = _prompts(0, [1, 7, 8, 9, 33, 50])
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for prompt, out in zip(prompts, outs):
        tokens, raw = naive_greedy(forward, params, prompt, 12)
        assert out.tokens == tokens
        assert out.finish_reason == "length"
        np.testing.assert_allclose(out.raw_logprobs, raw, atol=1e-5)
        assert out.logprobs == [0.0] * 12  # greedy: the one-hot distribution
    _check_released(engine)


def test_paged_equals_contiguous_cache(target, engine):
    cfg, m, _ = target
    prompt = _prompts(1, [21])[0]
    cache = m.init_cache(1, 64, jnp.float32)
    logits, aux = m(jnp.asarray([prompt]), kv_cache=cache)
    tokens, raw = [], []
    for _ in range(10):
        logp_V = jax.nn.log_softmax(logits[0, -1])
        tokens.append(int(jnp.argmax(logp_V)))
        raw.append(float(logp_V[tokens[-1]]))
        logits, aux = m(jnp.asarray([[tokens[-1]]]), kv_cache=aux["kv_cache"])
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=10))[0]
    assert out.tokens == tokens
    np.testing.assert_allclose(out.raw_logprobs, raw, atol=1e-5)


def test_logprobs_agree_with_score_and_plain_forward(target, engine, forward):
    _, _, params = target
    prompts = _prompts(2, [5, 30])
    # Seed 6: under seed 5 one sampled row reaches a top-p tie (the mass before its 17th-ranked token equals
    # 0.9 of the top-20 mass to 1e-6), where logits 7e-7 apart (the batched scoring forward against decode)
    # keep 16 or 17 tokens and the log-probs differ by 0.028 whichever is right.
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, max_new_tokens=9, n=3, seed=6)
    outs = engine.generate(prompts, sp)
    full = [prompts[c.prompt_index] for c in outs]
    processed = engine.score(full, outs, sp)
    raw = engine.score(full, outs)
    for prompt, out, proc_T, raw_T in zip(full, outs, processed, raw):
        np.testing.assert_allclose(out.logprobs, proc_T, atol=1e-5)
        np.testing.assert_allclose(out.raw_logprobs, raw_T, atol=1e-5)
        logp_TV = forward(params, prompt + out.tokens)
        plain = [logp_TV[len(prompt) - 1 + i, t] for i, t in enumerate(out.tokens)]
        np.testing.assert_allclose(raw_T, plain, atol=1e-5)
        # Processed log-probs by hand: temperature, top-k 20, top-p .9, min-p .01 on the plain logits.
        arrays = sampling.sampling_arrays([sp] * len(out.tokens))
        rows = jnp.asarray(logp_TV[len(prompt) - 1 : len(prompt) - 1 + len(out.tokens)])
        hand = sampling.processed_logprobs(rows, arrays)
        np.testing.assert_allclose(
            proc_T, np.asarray(hand)[np.arange(len(out.tokens)), out.tokens], atol=1e-5
        )


def test_n_samples_differ_and_runs_reproduce(engine):
    prompt = _prompts(3, [6])
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, n=16, seed=11)
    outs = engine.generate(prompt, sp)
    assert [c.sample_index for c in outs] == list(range(16))
    assert len({tuple(c.tokens) for c in outs}) > 8
    again = engine.generate(prompt, sp)
    assert [c.tokens for c in again] == [c.tokens for c in outs]
    other = engine.generate(prompt, dataclasses.replace(sp, seed=12))
    assert [c.tokens for c in other] != [c.tokens for c in outs]


def test_prefix_sharing_changes_only_the_prefill_count(target):
    cfg, _, params = target
    system = _prompts(4, [24])[0]
    prompts = [system + p for p in _prompts(5, [3, 9, 17])]
    sp = SamplingParams(temperature=1.0, max_new_tokens=7, n=2, seed=3)
    shared, alone = (
        Engine(cfg, params, ECFG),
        Engine(cfg, params, dataclasses.replace(ECFG, prefix_cache_pages=0)),
    )
    for _ in range(2):
        a, b = shared.generate(prompts, sp), alone.generate(prompts, sp)
        assert [c.tokens for c in a] == [c.tokens for c in b]
        np.testing.assert_allclose(
            np.concatenate([c.logprobs for c in a]), np.concatenate([c.logprobs for c in b]), atol=1e-5
        )
    contexts = sum(len(p) - 1 for p in prompts)
    # Without the cache each distinct context is prefilled once per call (the n=2 samples fork it) ...
    assert alone.stats()["prefill_tokens"] == 2 * contexts
    # ... with it the second call prefills only the partial last pages (page size 8), and the first call
    # already reuses the system prompt's 3 full pages for the second and third prompts.
    assert shared.stats()["prefill_tokens"] < alone.stats()["prefill_tokens"] - contexts
    assert shared.stats()["prefix_cache"]["hit_rate"] > 0.5
    _check_released(shared)


def test_n_samples_prefill_the_prompt_once(target):
    cfg, _, params = target
    eng = Engine(cfg, params, dataclasses.replace(ECFG, prefix_cache_pages=0))
    prompt = _prompts(6, [40])
    eng.generate(prompt, SamplingParams(max_new_tokens=3, n=8))
    assert eng.stats()["prefill_tokens"] == 39  # the context; each sample feeds the last prompt token itself


@pytest.fixture(scope="module")
def small_drafter():
    cfg = tiny.get_config("dense")
    cfg.model.num_layers = 1
    return ModelDrafter(cfg, nnx.state(model.build(cfg, seed=1), nnx.Param))


def test_speculative_greedy_equals_plain_greedy(target, engine, small_drafter):
    cfg, _, params = target
    prompts = _prompts(7, [1, 9, 33]) + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=20)
    plain = engine.generate(prompts, sp)
    for draft in (small_drafter, NgramDrafter(2), GroupDrafter(2), ModelDrafter(cfg, params)):
        eng = Engine(cfg, params, ECFG, draft=draft)
        outs = eng.generate(prompts, sp)
        assert [c.tokens for c in outs] == [c.tokens for c in plain]
        for a, b in zip(outs, plain):
            np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=1e-5)
        _check_released(eng)
    stats = eng.stats()  # the target drafting for itself: every token accepted, k + 1 per forward
    assert stats["acceptance_rate"] == 1.0
    assert stats["tokens_per_target_forward"] == 5.0


def _next_law(forward, params, tokens, sp) -> np.ndarray:
    """The processed distribution of the token after `tokens` under `sp`, from a plain forward."""
    arrays = sampling.sampling_arrays([sp])
    return np.exp(
        np.asarray(sampling.processed_logprobs(jnp.asarray(forward(params, tokens)[-1:]), arrays))[0]
    )


def _exact_pairs(forward, params, prompt, sp):
    """P(t1, t2) of the first two processed-distribution tokens, enumerated with plain forwards."""
    p1 = _next_law(forward, params, prompt, sp)
    return {
        (int(a), int(b)): p1[a] * p2
        for a in np.flatnonzero(p1)
        for b, p2 in zip(
            *(lambda p: (np.flatnonzero(p), p[p > 0]))(_next_law(forward, params, prompt + [int(a)], sp))
        )
    }


def _first_token_law(p: np.ndarray) -> dict:
    return {(int(a),): p[a] for a in np.flatnonzero(p)}


def test_speculative_sampling_matches_the_exact_distribution(target, forward):
    """Chi-square over the first two tokens (temperature .8, top-k 3, top-p .95) with a draft model that
    partly agrees with the target (its weights are 90% the target's), so acceptance and the residual both
    matter. The biased variant (resample from p instead of the residual) must fail; its power at this N is
    computed from the exact first-token law below and required to exceed 0.99."""
    cfg, _, params = target
    other = nnx.state(model.build(cfg, seed=7), nnx.Param)
    draft_params = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, params, other)
    prompt = _prompts(8, [5])[0]
    n = 1000  # the power below exceeds 1 - 1e-7 at this N (noncentrality 167)
    sp = SamplingParams(temperature=0.8, top_k=3, top_p=0.95, max_new_tokens=2, n=n, seed=1)
    exact = _exact_pairs(forward, params, prompt, sp)
    alpha = 1e-3
    ecfg = dataclasses.replace(ECFG, max_batch=16)
    engine_args = (cfg, params, ecfg, lambda: ModelDrafter(cfg, draft_params), prompt, sp)

    counts, acceptance = sample_counts(*engine_args, "residual")
    assert 0.2 < acceptance < 0.95, acceptance  # both paths exercised
    check_fits(counts, exact, n, alpha)

    # Power of the same test against the biased variant, from the exact first-token laws p (target) and
    # q (draft): biased P(x) = min(p, q)(x) + (1 - sum min(p, q)) p(x).
    p = _next_law(forward, params, prompt, sp)
    q = _next_law(forward, draft_params, prompt, sp)
    biased = np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * p
    power, lam = power_against(p, biased, n, alpha)
    assert power > 0.99, (power, lam)
    biased_counts, _ = sample_counts(*engine_args, "p")
    check_rejects(first_tokens(biased_counts), _first_token_law(p), n, alpha)


def test_group_drafter_sampling_matches_the_exact_distribution(target, forward):
    """The same chi-square as above with the group drafter: each sample's proposals are its siblings' text
    (one-hot q), accepted with p(x), else resampled from p without x. The biased variant (resample from p)
    must fail. Its first-token law: a proposal x from a sibling that followed the biased law b gives
    b(a) p(a) + (1 - sum b p) p(a), whose fixed point b* the later samples follow; the first 16 (one batch,
    in lockstep, no sibling text yet; the prompt's tokens are distinct, so no prompt match either) follow p.
    Its power against that mixture is required to exceed 0.99."""
    cfg, _, params = target
    prompt = _prompts(8, [5])[0]
    assert len(set(prompt)) == len(prompt)
    n, batch = 1500, 16  # the power below is 0.9996 here (noncentrality 49)
    sp = SamplingParams(temperature=0.8, top_k=3, top_p=0.95, max_new_tokens=2, n=n, seed=1)
    exact = _exact_pairs(forward, params, prompt, sp)
    alpha = 1e-3
    ecfg = dataclasses.replace(ECFG, max_batch=batch)
    engine_args = (cfg, params, ecfg, lambda: GroupDrafter(3), prompt, sp)

    counts, acceptance = sample_counts(*engine_args, "residual")
    assert 0.2 < acceptance < 0.95, acceptance  # both paths exercised
    check_fits(counts, exact, n, alpha)

    p = _next_law(forward, params, prompt, sp)
    b = p
    for _ in range(200):
        b = b * p + (1 - np.sum(b * p)) * p
    biased = (batch * p + (n - batch) * b) / n
    power, lam = power_against(p, biased, n, alpha)
    assert power > 0.99, (power, lam)
    biased_counts, _ = sample_counts(*engine_args, "p")
    check_rejects(first_tokens(biased_counts), _first_token_law(p), n, alpha)


def test_update_draft_params_swaps_the_drafter_without_recompiling(target, small_drafter):
    """The draft model (here with the target's config) starts from other weights, then gets the target's:
    greedy acceptance goes to 1 (k + 1 tokens per target forward), outputs stay the target's."""
    cfg, _, params = target
    other = nnx.state(model.build(cfg, seed=5), nnx.Param)
    eng = Engine(cfg, params, ECFG, draft=ModelDrafter(cfg, other))
    eng.warmup()
    sp = SamplingParams(temperature=0.0, max_new_tokens=15)  # 3 speculative steps of k + 1 = 5 tokens
    before = eng.generate(_prompts(17, [9, 20]), sp)
    stats = eng.stats()
    assert stats["accepted_tokens"] < 0.5 * stats["proposed_tokens"], stats
    donated = jax.tree.map(jnp.copy, params)
    eng.update_draft_params(donated)
    jax.tree.map(lambda a: a.delete(), donated)  # the engine keeps its own copy: the caller may donate
    after = eng.generate(_prompts(18, [9, 20]), sp)  # new prompts: no draft K/V cached from the old weights
    delta = {k: eng.stats()[k] - stats[k] for k in ("accepted_tokens", "proposed_tokens", "spec_steps")}
    assert delta == {"accepted_tokens": 2 * 3 * 4, "proposed_tokens": 2 * 3 * 4, "spec_steps": 3}, delta
    plain = Engine(cfg, params, ECFG)
    assert [c.tokens for c in after] == [c.tokens for c in plain.generate(_prompts(18, [9, 20]), sp)]
    assert [c.tokens for c in before] == [c.tokens for c in plain.generate(_prompts(17, [9, 20]), sp)]
    # At T = 1 the draft changes which tokens are drawn (the same law, other draws).
    t1 = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    sampled = eng.generate(_prompts(19, [9]), t1)
    eng.update_draft_params(other)
    assert eng.generate(_prompts(19, [9]), t1)[0].tokens != sampled[0].tokens
    assert eng.stats()["compiles_after_warmup"] == 0
    with pytest.raises(ValueError, match="draft params do not match"):
        eng.update_draft_params(small_drafter.params)
    with pytest.raises(ValueError, match="needs an engine built with a ModelDrafter"):
        plain.update_draft_params(params)


def test_no_recompiles_after_warmup(target):
    cfg, _, params = target
    rng = np.random.default_rng(9)
    engines = [
        Engine(cfg, params, ECFG),
        Engine(cfg, params, ECFG, draft=NgramDrafter(3)),
        Engine(cfg, params, dataclasses.replace(ECFG, record_routing=True), draft=GroupDrafter(3)),
    ]
    for eng in engines:
        eng.warmup()
        for i in range(6):
            lengths = rng.integers(1, 60, int(rng.integers(1, 4)))
            sp = SamplingParams(
                temperature=float(rng.choice([0.0, 0.6, 1.3])),
                top_k=int(rng.choice([0, 5])),
                top_p=float(rng.choice([1.0, 0.8])),
                min_p=float(rng.choice([0.0, 0.05])),
                max_new_tokens=int(rng.integers(1, 30)),
                n=int(rng.choice([1, 2, 5])),
                seed=i,
                stop_tokens=(int(rng.integers(0, 256)),),
            )
            eng.generate(_prompts(i, lengths), sp)
        eng.update_params(jax.tree.map(lambda a: a * 1.01, params))
        eng.generate(_prompts(99, [13]), SamplingParams(max_new_tokens=5))
        assert eng.stats()["compiles_after_warmup"] == 0


def test_min_prefill_batch_pads_small_prefills(target, forward):
    """min_prefill_batch = prefill_batch: one prefill row bucket is compiled; a single prompt is prefilled in
    a padded call of 2 rows and decodes as the naive greedy loop does; nothing compiles after warmup."""
    cfg, _, params = target
    eng = Engine(cfg, params, dataclasses.replace(ECFG, min_prefill_batch=2))
    eng.warmup()
    shapes, run_prefill = [], eng._run_prefill

    def recording(tokens_BT, *rest):
        shapes.append(tokens_BT.shape)
        return run_prefill(tokens_BT, *rest)

    eng._run_prefill = recording
    prompt = _prompts(21, [11])
    out = eng.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert out.tokens == naive_greedy(forward, params, prompt[0], 6)[0]
    assert shapes == [(2, 16)]  # 1 prompt of 11 tokens: 2 rows (one padding), the 16-token bucket
    assert eng.stats()["compiles_after_warmup"] == 0
    with pytest.raises(ValueError, match="engine.min_prefill_batch=8 must be <= prefill_batch=4"):
        EngineConfig(min_prefill_batch=8)
    with pytest.raises(ValueError, match="engine.min_prefill_batch=3 must be a power of two"):
        EngineConfig(min_prefill_batch=3)


def test_warmup_compiles_no_prefill_longer_than_max_seq_len(target, forward):
    """max_seq_len 24 under a 64-token prefill_chunk: no context is longer than 24 tokens, so warmup compiles
    the 16- and 32-token buckets (x rows 1, 2) and not 64; a 20-token prompt then runs in the 32 bucket with
    nothing compiled after warmup."""
    cfg, _, params = target
    eng = Engine(cfg, params, dataclasses.replace(ECFG, max_seq_len=24, prefill_chunk=64))
    shapes, run_prefill = [], eng._run_prefill

    def recording(tokens_BT, *rest):
        shapes.append(tokens_BT.shape)
        return run_prefill(tokens_BT, *rest)

    eng._run_prefill = recording
    eng.warmup()
    assert shapes == [(1, 16), (2, 16), (1, 32), (2, 32)]
    prompt = _prompts(22, [20])
    out = eng.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert out.tokens == naive_greedy(forward, params, prompt[0], 4)[0]
    assert shapes[4:] == [(1, 32)]
    assert eng.stats()["compiles_after_warmup"] == 0


def test_update_params_swaps_weights_without_recompiling(target, forward):
    cfg, _, params = target
    new = nnx.state(model.build(cfg, seed=3), nnx.Param)
    eng = Engine(cfg, params, ECFG)
    eng.warmup()
    prompt = _prompts(10, [12])
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    eng.generate(prompt, sp)
    assert eng.stats()["prefix_cache"]["device_pages"] > 0
    assert eng.update_params(new) == 1
    assert eng.stats()["prefix_cache"]["device_pages"] == 0  # stale K/V dropped
    out = eng.generate(prompt, sp)[0]
    assert out.tokens == naive_greedy(forward, new, prompt[0], 8)[0]
    assert out.policy_versions == [1] * 8
    # Interrupt and resume: a weight update between steps; the sequence continues with the new weights.
    eng.submit(prompt, sp)
    eng.step()
    eng.step()
    eng.update_params(params)
    done = []
    while eng.has_work():
        done += eng.step()
    assert done[0].policy_versions == [1, 1] + [2] * 6
    assert eng.stats()["compiles_after_warmup"] == 0
    with pytest.raises(ValueError, match="do not match the model config"):
        eng.update_params(jax.tree.map(lambda a: a[..., :1], params))


def test_continuous_and_static_batching_give_the_same_completions(target):
    cfg, _, params = target
    prompts = _prompts(11, [3, 20, 9, 14, 2, 30, 7])
    sps = [SamplingParams(temperature=1.0, max_new_tokens=m, seed=2) for m in (2, 25, 4, 18, 3, 9, 30)]
    runs = {}
    for scheduler in ("continuous", "static"):
        eng = Engine(cfg, params, dataclasses.replace(ECFG, scheduler=scheduler))
        runs[scheduler] = (eng.generate(prompts, sps), eng.stats()["decode_steps"])
    (cont, cont_steps), (stat, stat_steps) = runs["continuous"], runs["static"]
    assert [c.tokens for c in cont] == [c.tokens for c in stat]
    assert [len(c.tokens) for c in cont] == [2, 25, 4, 18, 3, 9, 30]
    # Static waits for the longest of each batch of 4: 25 + 30 steps; continuous refills slots as they free.
    assert stat_steps == 55 and cont_steps < stat_steps


def test_stop_tokens_end_a_completion(engine):
    prompt = _prompts(12, [10])
    free = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=10))[0]
    stop = free.tokens[3]
    first = free.tokens.index(stop)
    out = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=10, stop_tokens=(stop,)))[0]
    assert out.tokens == free.tokens[: first + 1] and out.finish_reason == "stop"


def test_preemption_when_pages_run_out_keeps_outputs(target, engine):
    cfg, _, params = target
    prompts = _prompts(13, [30, 31, 29, 28])
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    # Each sequence grows to 9 pages of 8 tokens; 4 of them need 36 > the 19 usable pages.
    small = Engine(cfg, params, dataclasses.replace(ECFG, num_pages=20, prefix_cache_pages=0))
    outs = small.generate(prompts, sp)
    assert small.stats()["preemptions"] > 0
    assert [c.tokens for c in outs] == [c.tokens for c in engine.generate(prompts, sp)]
    _check_released(small)


def test_host_tier_reload_gives_the_same_completions(target):
    cfg, _, params = target
    eng = Engine(cfg, params, dataclasses.replace(ECFG, host_cache_pages=32))
    prompts = _prompts(14, [41, 26])
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=4)
    first = eng.generate(prompts, sp)
    moved = eng.offload_prefix(64)
    assert moved > 0 and eng.stats()["prefix_cache"]["host_pages"] == moved
    scribble_free_pages(eng)  # the reload must bring the contents back, not find them still there
    second = eng.generate(prompts, sp)
    assert eng.stats()["prefix_cache"]["reloads"] > 0
    assert [c.tokens for c in second] == [c.tokens for c in first]
    _check_released(eng)
    with pytest.raises(ValueError, match="engine.host_cache_pages > 0"):
        Engine(cfg, params, ECFG).offload_prefix(1)


def test_host_tier_moves_the_draft_models_pages(target, small_drafter):
    """With a ModelDrafter a page is also the draft model's K/V at the same index: a reload that left them
    behind would draft from scribbled pages, and at T=1 the tokens and acceptance would change."""
    cfg, _, params = target
    prompts = _prompts(16, [41, 26])
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=5)
    (host, host_counts), (twin, twin_counts) = host_tier_twins(
        cfg, params, ECFG, prompts, sp, lambda: ModelDrafter(small_drafter.cfg, small_drafter.params)
    )
    same_completions(host, twin)
    assert host_counts == twin_counts and twin_counts["proposed_tokens"] > 0


def test_errors_name_the_field(target, engine):
    cfg, _, params = target
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        engine.submit([[1], []], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([[1, 999]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="engine.max_seq_len=96"):
        engine.submit([[1] * 90], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="engine.prefill_chunk=48 must be a power of two"):
        EngineConfig(prefill_chunk=48)
    with pytest.raises(ValueError, match="engine.scheduler='fifo'"):
        EngineConfig(scheduler="fifo")
    with pytest.raises(ValueError, match="engine.host_cache_pages=-1 must be >= 0"):
        EngineConfig(host_cache_pages=-1)
    with pytest.raises(ValueError, match="engine.prefix_cache_pages=-2 must be >= -1"):
        EngineConfig(prefix_cache_pages=-2)
    with pytest.raises(ValueError, match="engine.num_pages=-4 must be >= 0"):
        EngineConfig(num_pages=-4)
    with pytest.raises(ValueError, match="unknown fields \\['max_bach'\\]"):
        EngineConfig.from_config({"max_bach": 4})
    big = tiny.get_config("dense")
    big.model.vocab_size = 512
    with pytest.raises(ValueError, match="draft model vocab_size=512"):
        Engine(cfg, params, ECFG, draft=ModelDrafter(big, nnx.state(model.build(big), nnx.Param)))
    assert not engine.has_work()


def test_threads_share_one_engine(engine):
    """Two threads generate at once (their steps interleave in one batch); each gets its own completions,
    equal to running alone."""
    import threading

    a_prompts, b_prompts = _prompts(15, [5, 17, 9]), _prompts(16, [12, 3])
    sp = SamplingParams(temperature=1.0, max_new_tokens=11, n=2, seed=8)
    alone_a, alone_b = engine.generate(a_prompts, sp), engine.generate(b_prompts, sp)
    result = {}
    thread = threading.Thread(target=lambda: result.update(a=engine.generate(a_prompts, sp)))
    thread.start()
    result["b"] = engine.generate(b_prompts, sp)
    thread.join()
    assert [c.tokens for c in result["a"]] == [c.tokens for c in alone_a]
    assert [c.tokens for c in result["b"]] == [c.tokens for c in alone_b]
    _check_released(engine)
