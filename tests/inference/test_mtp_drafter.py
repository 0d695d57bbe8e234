"""inference.MTPDrafter: the model's own multi-token-prediction head drafts, the target verifies.

The toy model is tiny.py with one layer and one MTP module, trained for a few dozen steps (next-token plus MTP
loss) on a Markov chain over tokens 1..16: from x the next token is A[x] with probability 3/4, else B[x]. The
chain's next token depends on the previous one only, so the MTP module (which reads the embedding of token
i + 1) can learn the exact law of token i + 2 and its drafts get accepted; that checks the drafter's page
bookkeeping (a draft read from a wrong position or a stale page would be rejected). Exactness is checked by
chi-square against the enumerated law of the first two tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from chi_square import check_fits, check_rejects, power_against, sample_counts
from engine_checks import check_released, padded_forward
from engines import small_engine
from flax import nnx

import model
from configs import tiny
from inference import Engine, MTPDrafter, SamplingParams, sampling
from model import mtp as mtp_lib
from model.transformer import next_token_loss

ECFG = small_engine(max_seq_len=64, num_pages=64, prefill_chunk=16)
A = (np.arange(17) * 3 + 1) % 16 + 1
B = (np.arange(17) + 5) % 16 + 1
NAIVE_LEN = 64


def chain_rows(rng: np.random.Generator, rows: int, length: int) -> np.ndarray:
    out = np.zeros((rows, length), np.int32)
    out[:, 0] = rng.integers(1, 17, rows)
    for i in range(1, length):
        out[:, i] = np.where(rng.random(rows) < 0.75, A[out[:, i - 1]], B[out[:, i - 1]])
    return out


@pytest.fixture(scope="module")
def toy():
    cfg = tiny.get_config()
    cfg.model.num_layers, cfg.model.mtp_layers = 1, 1
    m = model.build(cfg, seed=0)
    opt = nnx.Optimizer(m, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, tokens_BT):
        def loss_fn(m):
            logits_BTV, aux = m(tokens_BT)
            mtp_DBTV = m.mtp_logits(aux["hidden"], tokens_BT)
            return next_token_loss(logits_BTV, tokens_BT) + mtp_lib.mtp_loss(mtp_DBTV, tokens_BT)

        loss, grads = nnx.value_and_grad(loss_fn)(m)
        opt.update(m, grads)
        return loss

    rng = np.random.default_rng(0)
    for _ in range(80):
        loss = step(m, opt, jnp.asarray(chain_rows(rng, 32, 32)))
    # Both losses near the chain's entropy, 0.56 nats (-0.75 ln 0.75 - 0.25 ln 0.25): 1.12 together.
    assert float(loss) < 1.3, float(loss)
    return cfg, m, nnx.state(m, nnx.Param)


@pytest.fixture(scope="module")
def forward(toy):
    """Full forward over a right-padded row: (target log-probs [T, V], MTP module 1 log-probs [T, V])."""

    def logp(net, tokens_BT):
        logits_BTV, aux = net(tokens_BT)
        mtp_BTV = net.mtp_logits(aux["hidden"], tokens_BT)[0]
        return jax.nn.log_softmax(logits_BTV[0], -1), jax.nn.log_softmax(mtp_BTV[0], -1)

    return padded_forward(toy[1], logp, NAIVE_LEN)


def test_greedy_equals_plain_and_the_learned_chain_is_accepted(toy):
    cfg, _, params = toy
    prompts = [list(r) for r in chain_rows(np.random.default_rng(1), 3, 9)] + [[3]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    plain = Engine(cfg, params, ECFG).generate(prompts, sp)
    eng = Engine(cfg, params, ECFG, draft=MTPDrafter())
    eng.warmup()
    outs = eng.generate(prompts, sp)
    assert [c.tokens for c in outs] == [c.tokens for c in plain]
    for a, b in zip(outs, plain):
        np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=1e-5)
    stats = eng.stats()
    # Greedy follows x -> A[x]: every draft after the first step is right. Per sequence: one step without a
    # draft (1 token), then steps of k + 1 = 5: 1 + 5 * 4 = 21, and one more step for the last 3 of 24.
    assert stats["acceptance_rate"] >= 0.95, stats
    assert stats["tokens_per_target_forward"] == pytest.approx(24 / 6, abs=0.2), stats
    assert stats["compiles_after_warmup"] == 0
    check_released(eng)


def test_carried_draft_is_the_full_forwards_mtp_prediction(toy, forward):
    """After every step, each running slot's carried first draft was drawn from the MTP module's
    distribution at the position before the pending token, as the full (unpaged) forward over the text so far
    computes it: the prefill and each step's catch-up wrote the module's pages at the right positions."""
    cfg, _, params = toy
    eng = Engine(cfg, params, ECFG, draft=MTPDrafter())
    prompts = [list(r) for r in chain_rows(np.random.default_rng(2), 2, 11)] + [[7, 8], [5] * 20]
    sp = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3)
    eng.submit(prompts, sp)
    checked = 0
    while eng.has_work():
        eng.step()
        carry = jax.device_get(eng._mtp_carry)
        for b, seq in enumerate(eng.scheduler.slots):
            if seq is None or eng._carry_for[b] is None:
                continue
            text = seq.prompt + seq.tokens
            _, mtp_TV = forward(params, text)
            # The pending token is text[-1] at position len(text) - 1; the draft predicts the token after it
            # from the module at position len(text) - 2.
            np.testing.assert_allclose(carry.logp_BV[b], mtp_TV[len(text) - 2], atol=2e-4)
            checked += 1
    assert checked > 20
    assert eng.stats()["accepted_tokens"] > 0


# Slow (40 s of the suite): exactness is the shared `inference.speculative.verify` (test_engine's chi-square
# over a model drafter) given the draft law q, and the MTP drafter's q is checked against the MTP module's
# log-probs token by token in test_greedy_equals_plain_and_the_learned_chain_is_accepted.
@pytest.mark.slow
def test_sampling_matches_the_exact_distribution(toy, forward):
    """Chi-square over the first two tokens at temperature 1.5, top-k 4: token 1 comes from the target (no
    draft yet), token 2 is the verified MTP draft or its correction. The trained MTP head is nearly exact
    (q ~ p), so its output norm is scaled by 0.3 here (logits / 3: a flatter q, still a valid drafter) for
    rejections and the residual to matter. The biased variant (resample from p instead of the residual) must
    fail; its power at this N, from the exact laws p and q (the MTP module's distribution for token 2), is
    required to exceed 0.99."""
    cfg, m, params = toy
    net = nnx.merge(nnx.graphdef(m), params)
    net.mtp[0].norm.scale[...] = 0.3 * net.mtp[0].norm.scale[...]
    params = nnx.state(net, nnx.Param)
    prompt = [4, int(A[4]), int(A[A[4]])]
    n, alpha = 3000, 1e-3
    sp = SamplingParams(temperature=1.5, top_k=4, max_new_tokens=2, n=n, seed=5)
    arrays = sampling.sampling_arrays([sp])
    processed = lambda logp_V: np.exp(
        np.asarray(sampling.processed_logprobs(jnp.asarray(logp_V[None]), arrays))[0]
    )
    target_TV, _ = forward(params, prompt)
    p1 = processed(target_TV[-1])
    exact, biased = {}, {}
    for a in np.flatnonzero(p1):
        target_TV, mtp_TV = forward(params, prompt + [int(a)])
        p2, q2 = processed(target_TV[-1]), processed(mtp_TV[-2])
        b2 = np.minimum(p2, q2) + (1 - np.minimum(p2, q2).sum()) * p2
        for c in np.flatnonzero(p2):
            exact[(int(a), int(c))] = p1[a] * p2[c]
            biased[(int(a), int(c))] = p1[a] * b2[c]

    engine_args = (cfg, params, dataclasses.replace(ECFG, max_batch=16), MTPDrafter, prompt, sp)
    counts, acceptance = sample_counts(*engine_args, "residual")
    assert 0.2 < acceptance < 0.97, acceptance  # acceptance and the residual both matter
    check_fits(counts, exact, n, alpha)

    cells = sorted(exact)
    power, lam = power_against(
        np.array([exact[c] for c in cells]), np.array([biased[c] for c in cells]), n, alpha
    )
    assert power > 0.99, (power, lam)
    biased_counts, _ = sample_counts(*engine_args, "p")
    check_rejects(biased_counts, exact, n, alpha)


def test_mtp_drafter_needs_mtp_modules():
    cfg = tiny.get_config()
    params = nnx.state(model.build(cfg), nnx.Param)
    with pytest.raises(ValueError, match="model.mtp_layers >= 1"):
        Engine(cfg, params, ECFG, draft=MTPDrafter())
