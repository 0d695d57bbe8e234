"""inference.Engine on an MLA model (DeepSeek-V3 layout, tiny): the paged latent cache (one row of
kv_lora_rank + qk_rope_head_dim per token per layer), absorbed prefill and decode, gives the full forward's
greedy tokens and log-probs (sigmoid router with a random nonzero selection bias, carried by the engine)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_checks import host_tier_twins, same_completions
from engines import small_engine
from flax import nnx

import model
from configs import tiny
from inference import MTPDrafter
from inference.engine import Engine
from inference.sampling import SamplingParams
from model import mla
from model.moe.layer import ExpertBias

ECFG = small_engine(max_seq_len=64, num_pages=48, prefill_chunk=16)


def _mla_cfg():
    cfg = tiny.get_config()
    m = cfg.model
    m.num_layers, m.attention_kind, m.qk_norm = 3, "mla", False
    m.mla.update(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    m.moe.update(
        num_experts=8, n_group=2, topk_group=1, routed_scaling=2.5, first_dense_layers=1, router="sigmoid"
    )
    return cfg


@pytest.fixture(scope="module")
def target():
    cfg = _mla_cfg()
    m = model.build(cfg, seed=1)
    weights = nnx.state(m, (nnx.Param, ExpertBias))
    bias = weights["moe_layers"]["blocks"]["mlp"]["expert_bias"]
    bias.set_value(0.05 * jax.random.normal(jax.random.key(2), bias.shape))
    return cfg, m, weights


def test_latent_pages_hold_one_row_per_token_per_layer(target):
    cfg, m, _ = target
    pages = m.init_paged_cache(num_pages=5, page_size=8, dtype=jnp.bfloat16)
    assert list(pages) == ["latent"]
    assert pages["latent"].shape == (3, 5, 8, 12 + 4)
    assert mla.cache_width(cfg.model) == 16


def test_greedy_equals_full_forward(target):
    cfg, m, params = target
    graphdef = nnx.graphdef(m)

    @jax.jit
    def logp(params, tokens_T):
        return jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens_T[None])[0][0], axis=-1)

    def naive(prompt, n):
        seq, raw = list(prompt), []
        for _ in range(n):
            padded = np.zeros(64, np.int32)
            padded[: len(seq)] = seq
            logp_V = np.asarray(logp(params, padded))[len(seq) - 1]
            seq.append(int(np.argmax(logp_V)))
            raw.append(float(logp_V[seq[-1]]))
        return seq[len(prompt) :], raw

    eng = Engine(cfg, params, ECFG)
    rng = np.random.default_rng(0)
    # One token (no prefill), a page boundary, a chunked prefill (20 > prefill_chunk 16).
    prompts = [rng.integers(1, 256, n).tolist() for n in (1, 8, 20)]
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    for prompt, out in zip(prompts, outs):
        tokens, raw = naive(prompt, 10)
        assert out.tokens == tokens
        np.testing.assert_allclose(out.raw_logprobs, raw, atol=1e-5)


def test_host_tier_moves_latent_routing_and_mtp_pages():
    """DeepSeek-V3's layout with the host tier: a cached prefix block moved to the host and reloaded brings
    back every array indexed by its page (the latent K/V, the routing record, the MTP drafter's latent
    pages); with the free pages scribbled over in between, the second run equals a twin's without a host
    tier (its prefix hit on device): tokens, log-probs, routing and the drafter's acceptance (at T=1 a draft
    from a scribbled MTP page would change both)."""
    cfg = _mla_cfg()
    cfg.model.mtp_layers = 1
    m = model.build(cfg, seed=3)
    params = nnx.state(m, (nnx.Param, ExpertBias))
    ecfg = dataclasses.replace(ECFG, record_routing=True)
    rng = np.random.default_rng(5)
    system = rng.integers(1, 256, 24).tolist()
    prompts = [system + rng.integers(1, 256, n).tolist() for n in (3, 9)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=6)
    (host, host_counts), (twin, twin_counts) = host_tier_twins(cfg, params, ecfg, prompts, sp, MTPDrafter)
    same_completions(host, twin)
    for a, b in zip(host, twin):
        np.testing.assert_array_equal(a.expert_indices, b.expert_indices)
    assert host_counts == twin_counts and twin_counts["proposed_tokens"] > 0
