"""inference.GroupDrafter: proposals from sibling samples, exact greedy outputs, bounded memory.

Its exactness at T > 0 (the chi-square over the first two tokens, with the biased variant's failure) is in
tests/inference/test_engine.py beside the model drafter's, which shares the helpers.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from engines import small_engine, tiny_target
from flax import nnx

import model
from inference import Engine, GroupDrafter, NgramDrafter, SamplingParams

ECFG = small_engine()


def test_proposes_what_followed_in_a_sibling():
    group = GroupDrafter(3).group([1, 2, 3], num_samples=3)
    group.append(0, [4, 5, 6, 7, 8])
    # The start of a completion: the prompt's tail is followed by sibling 0's first tokens.
    assert group.propose(1, 3) == [4, 5, 6]
    group.append(1, [4, 5])
    assert group.propose(1, 3) == [6, 7, 8]
    assert group.propose(1, 9) == [6, 7, 8]  # all sibling 0 has so far
    # The most recent sibling match wins: sample 2 diverged after [4, 5] and is the latest to emit it.
    group.append(2, [4, 5, 9, 9])
    assert group.propose(1, 2) == [9, 9]
    # A finished sibling keeps its text (the engine drops the index when the request is done).
    assert not group.finish() and not group.finish()
    assert group.propose(1, 2) == [9, 9]
    assert group.finish()  # the last sample: the engine drops the index


def test_suffix_lengths_and_own_text_fallback():
    group = GroupDrafter(2).group([7, 1, 2, 3], num_samples=2)
    # No sibling text: the sequence's own prompt + completion, like NgramDrafter ([1, 2] -> 3 in the prompt).
    group.append(0, [9, 1, 2])
    assert group.propose(0, 3) == [3, 9, 1]
    assert group.propose(0, 3) == NgramDrafter(2).propose([7, 1, 2, 3, 9, 1, 2], 3)
    # At the same suffix length a sibling match comes first ...
    group.append(1, [1, 2, 5, 6])
    assert group.propose(0, 2) == [5, 6]
    # ... but a longer own match beats a shorter sibling one: suffix [8, 4] occurs only in sample 0's text,
    # [4] also in sample 1's.
    group.append(0, [8, 4, 0, 8, 4])
    group.append(1, [4, 11])
    assert group.propose(0, 1) == [0]
    # Nothing matches: no proposal.
    fresh = GroupDrafter(3).group([1, 2], num_samples=2)
    assert fresh.propose(0, 4) == []


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="GroupDrafter\\(n=0\\)"):
        GroupDrafter(0)
    with pytest.raises(ValueError, match="max_scan=0"):
        GroupDrafter(2, max_scan=0)


@pytest.fixture(scope="module")
def target():
    cfg, _, params = tiny_target()
    return cfg, params


def test_greedy_equals_plain_and_siblings_are_accepted(target):
    """Greedy samples of a prompt coincide: with 8 samples and 4 decode slots the second four are proposed
    their finished siblings' text and accept it, so the group drafter beats prompt lookup (the same text,
    which a random model seldom repeats); outputs equal the plain engine's exactly."""
    cfg, params = target
    prompts = [[3, 14, 15, 92, 65], list(range(40, 61))]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24, n=8)
    plain = Engine(cfg, params, ECFG).generate(prompts, sp)
    stats = {}
    for name, draft in (("group", GroupDrafter(3)), ("ngram", NgramDrafter(3))):
        eng = Engine(cfg, params, ECFG, draft=draft)
        eng.warmup()
        outs = eng.generate(prompts, sp)
        assert [c.tokens for c in outs] == [c.tokens for c in plain]
        np.testing.assert_allclose(
            np.concatenate([c.raw_logprobs for c in outs]),
            np.concatenate([c.raw_logprobs for c in plain]),
            atol=1e-5,
        )
        stats[name] = eng.stats()
        assert stats[name]["compiles_after_warmup"] == 0
        # every request's index dropped when it finished
        assert not eng.has_work() and not eng.scheduler.groups
    group, ngram = stats["group"], stats["ngram"]
    assert group["acceptance_rate"] > 0 and group["tokens_per_target_forward"] > 1.5, group
    assert group["tokens_per_target_forward"] > ngram["tokens_per_target_forward"] + 0.3, (group, ngram)


@pytest.fixture(scope="module")
def peaked(target):
    """The tiny model after 8 Adam steps on one 48-token text (loss ~0.05): sampled at T = 1 from the text's
    first 5 tokens, the samples share much of the rest, each leaving and rejoining it at its own places."""
    cfg, params = target
    text = np.random.default_rng(0).integers(1, 256, 48).tolist()
    graphdef = nnx.graphdef(model.build(cfg, seed=0))
    tokens_BT = jnp.asarray([text])
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        loss = lambda p: model.next_token_loss(nnx.merge(graphdef, p)(tokens_BT)[0], tokens_BT)
        grads = jax.grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = opt.init(params)
    for _ in range(8):
        params, opt_state = step(params, opt_state)
    return params, text[:5]


@pytest.mark.parametrize("max_batch", [4, 16], ids=["staggered", "lockstep"])
def test_shared_text_at_temperature_one(target, peaked, max_batch):
    """16 samples at T = 1 that share text: proposals from siblings are accepted (with the target's
    probability of the proposed token), prompt lookup finds little (the text does not repeat itself). With 4
    slots later samples follow finished ones; with 16 all run together and siblings ahead in the shared
    text lead. The same seed reproduces the run."""
    cfg, _ = target
    params, prompt = peaked
    ecfg = dataclasses.replace(ECFG, max_batch=max_batch)
    sp = SamplingParams(temperature=1.0, max_new_tokens=40, n=16, seed=2)
    runs = {}
    for name, draft in (("group", GroupDrafter(3)), ("ngram", NgramDrafter(3))):
        eng = Engine(cfg, params, ecfg, draft=draft)
        runs[name] = ([c.tokens for c in eng.generate([prompt], sp)], eng.stats())
    (tokens, group), (_, ngram) = runs["group"], runs["ngram"]
    assert len({tuple(t) for t in tokens}) > 1  # samples, not copies
    assert group["acceptance_rate"] > 0.5, group
    assert group["tokens_per_target_forward"] > ngram["tokens_per_target_forward"] + 0.3, (group, ngram)
    again = Engine(cfg, params, ecfg, draft=GroupDrafter(3))
    assert [c.tokens for c in again.generate([prompt], sp)] == tokens
