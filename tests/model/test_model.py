"""Transformer: shapes and finiteness, causality, scan == list, remat, KV cache, RoPE scaling."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model
from configs import base, tiny
from model import layers, rope
from model.kv_cache import PagedCache

# f32 compute: two orderings of the same sums differ by a few ulps of O(1) values.
ATOL = RTOL = 1e-5


def _tokens(b=2, t=12, seed=0, vocab=256):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab, jnp.int32)


def _cfg(arg=""):
    return tiny.get_config(arg)


def _jitted(m):
    """`m`'s forward under jit. Called op by op, a model compiles each operation on its own the first time
    (seconds per test on XLA:CPU); test_shapes_and_finite calls it that way."""
    graphdef, state = nnx.split(m)
    run = jax.jit(lambda state, args, kw: nnx.merge(graphdef, state)(*args, **kw))
    return lambda *args, **kw: run(state, args, kw)


@pytest.mark.parametrize("arg", ["", "capacity", "dense"])
def test_shapes_and_finite(arg):
    cfg = _cfg(arg)
    m = model.build(cfg)
    toks = _tokens()
    logits, aux = m(toks)
    chex.assert_shape(logits, (2, 12, cfg.model.vocab_size))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite((logits, aux))
    if cfg.model.moe.num_experts:
        chex.assert_shape(aux["expert_load"], (2, 4))
        chex.assert_shape(aux["expert_indices"], (2, 2, 12, 2))
        np.testing.assert_allclose(aux["expert_load"].sum(-1), 1.0, rtol=1e-6)
    else:
        assert float(aux["moe_loss"]) == 0.0


def test_tiny_is_a_few_hundred_thousand_parameters():
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model.build(_cfg()), nnx.Param)))
    assert 1e5 < n < 1e6, n


@pytest.mark.parametrize("arg", ["", "capacity"])
def test_causal(arg, monkeypatch):
    """d logits[:, t0] / d (input at s) is zero for every s > t0 and nonzero for some s <= t0."""
    cfg = _cfg(arg)
    m = model.build(cfg)
    toks = _tokens()
    t0 = 5
    orig = layers.Embed.__call__

    def f(delta_BTD):
        monkeypatch.setattr(layers.Embed, "__call__", lambda self, t: orig(self, t) + delta_BTD)
        logits, _ = m(toks)
        return jnp.sum(logits[:, t0] * jnp.cos(jnp.arange(logits.shape[-1]))[None, :])

    g_BTD = jax.jit(jax.grad(f))(jnp.zeros((2, 12, cfg.model.d_model)))
    per_pos = jnp.abs(g_BTD).sum(axis=(0, 2))
    assert float(per_pos[t0 + 1 :].max()) == 0.0
    assert float(per_pos[: t0 + 1].min()) > 0.0


def test_segment_ids_isolate_packed_sequences():
    m = _jitted(model.build(_cfg()))
    a, b = _tokens(1, 6, seed=1), _tokens(1, 6, seed=2)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[1] * 6 + [2] * 6])
    pos = jnp.array([list(range(6)) * 2])
    logits_packed, _ = m(packed, pos, segment_ids=seg)
    logits_b, _ = m(b)
    np.testing.assert_allclose(logits_packed[:, 6:], logits_b, atol=ATOL, rtol=RTOL)


def _params(m):
    return nnx.state(m, nnx.Param)


def test_scan_and_list_hold_the_same_model():
    cfg_scan, cfg_list = _cfg(), _cfg()
    cfg_list.model.scan_layers = False
    m_scan, m_list = model.build(cfg_scan), model.build(cfg_list)
    stacked = _params(m_scan)["moe_layers"]["blocks"]
    for i in range(2):
        layer_i = jax.tree.map(lambda a, i=i: a[i], stacked)
        chex.assert_trees_all_equal(
            jax.tree.leaves(layer_i), jax.tree.leaves(_params(m_list)["moe_layers"]["blocks"][i])
        )
    toks = _tokens()
    np.testing.assert_allclose(_jitted(m_scan)(toks)[0], _jitted(m_list)(toks)[0], atol=ATOL, rtol=RTOL)


def _grads(m, toks):
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params):
        logits, aux = nnx.merge(graphdef, params, rest)(toks)
        return model.next_token_loss(logits, toks) + aux["moe_loss"]

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
@pytest.mark.parametrize("scan", [True, False])
def test_remat_keeps_gradients(remat, scan):
    toks = _tokens()
    base = _cfg()
    base.model.scan_layers = scan
    other = _cfg()
    other.model.scan_layers = scan
    other.model.remat = remat
    loss_a, g_a = _grads(model.build(base), toks)
    loss_b, g_b = _grads(model.build(other), toks)
    np.testing.assert_allclose(loss_a, loss_b, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(g_a, g_b, atol=ATOL, rtol=RTOL)


def test_first_dense_layers_and_tied_embeddings():
    cfg = _cfg()
    cfg.model.num_layers = 3
    cfg.model.moe.first_dense_layers = 1
    cfg.model.tie_embeddings = True
    m = model.build(cfg)
    params = _params(m)
    assert "unembed" not in params
    chex.assert_shape(params["dense_layers"]["blocks"]["mlp"]["gate"][...], (1, 64, 128))
    chex.assert_shape(params["moe_layers"]["blocks"]["mlp"]["gate"][...], (2, 4, 64, 96))
    logits, aux = m(_tokens())
    chex.assert_tree_all_finite(logits)
    chex.assert_shape(aux["expert_indices"], (2, 2, 12, 2))


def test_attention_bias_and_sigmoid_router():
    cfg = _cfg()
    cfg.model.attention_bias = True  # Qwen2-style q/k/v bias
    cfg.model.moe.router = "sigmoid"
    m = model.build(cfg)
    attn = _params(m)["moe_layers"]["blocks"]["attn"]
    chex.assert_shape(attn["q_bias"][...], (2, 4, 16))
    chex.assert_shape(attn["k_bias"][...], (2, 2, 16))
    before, _ = m(_tokens())
    m.moe_layers.blocks.attn.k_bias[...] = jnp.ones((2, 2, 16))
    after, aux = m(_tokens())
    chex.assert_tree_all_finite((after, aux))
    assert float(jnp.abs(after - before).max()) > 1e-4  # the bias takes part in the forward pass


def test_bf16_compute_with_f32_params():
    cfg = _cfg()
    cfg.model.compute_dtype = "bfloat16"
    m = model.build(cfg)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(_params(m)))
    toks = _tokens()
    loss, grads = _grads(m, toks)
    chex.assert_tree_all_finite((loss, grads))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    f32 = _cfg()
    loss32, _ = _grads(model.build(f32), toks)
    # bf16 has an 8-bit mantissa: the loss agrees with f32 to about 1%.
    np.testing.assert_allclose(loss, loss32, rtol=2e-2)


@pytest.mark.parametrize("arg", ["", "capacity"])
def test_kv_cache_decode_equals_full_forward(arg):
    """Prefill 5 tokens, then feed 7 one at a time: every step's logits equal the full forward's."""
    cfg = _cfg(arg)
    cfg.model.moe.capacity_factor = 2.0  # per-sequence capacity: no drops with T=1 or T=12
    m = model.build(cfg)
    toks = _tokens()
    cache = m.init_cache(batch=2, max_len=16, dtype=jnp.float32)
    m = _jitted(m)
    full, _ = m(toks)
    logits, aux = m(toks[:, :5], kv_cache=cache)
    outs = [logits]
    cache = aux["kv_cache"]
    for t in range(5, 12):
        logits, aux = m(toks[:, t : t + 1], kv_cache=cache)
        outs.append(logits)
        cache = aux["kv_cache"]
    np.testing.assert_array_equal(cache.index, [12, 12])
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=ATOL, rtol=RTOL)


def test_logit_positions_pick_the_full_forwards_rows():
    """logit_positions [B, K] returns the full forward's logits at those positions (clipped to T - 1), the
    same aux; a paged-cache call refuses them."""
    m = model.build(_cfg())
    toks = _tokens()
    full, aux_full = m(toks)
    positions = jnp.array([[3, 4, 5], [10, 11, 12]], jnp.int32)  # 12 is past the end: row 11
    picked, aux = m(toks, logit_positions=positions)
    chex.assert_shape(picked, (2, 3, full.shape[-1]))
    want = jnp.stack([full[0, 3:6], full[1, jnp.array([10, 11, 11])]])
    np.testing.assert_allclose(picked, want, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(aux["moe_loss"], aux_full["moe_loss"], rtol=1e-6)
    paged = PagedCache(m.init_paged_cache(4, 8), jnp.zeros((2, 2)), jnp.zeros(2), jnp.ones(2))
    with pytest.raises(ValueError, match="logit_positions"):
        m(toks[:, :1], kv_cache=paged, logit_positions=positions[:, :1])


def _rope(**kw):
    """The model config's RoPE block: the field table's defaults (theta 10000, no scaling), `kw` changed."""
    r = base.model_defaults().rope
    r.update(kw)
    return r


def test_rope_linear_and_llama3_frequencies():
    h = 128
    base, _ = rope.inv_frequencies(h, _rope())
    np.testing.assert_allclose(base[1], 10000.0 ** (-2 / 128))
    lin, _ = rope.inv_frequencies(h, _rope(scaling="linear", factor=4.0))
    np.testing.assert_allclose(lin, base / 4)
    l3, _ = rope.inv_frequencies(
        h, _rope(scaling="llama3", theta=500000.0, factor=8.0, original_max_position=8192)
    )
    b3, _ = rope.inv_frequencies(h, _rope(theta=500000.0))
    wavelen = 2 * np.pi / b3
    # Wavelengths shorter than 8192/4 = 2048 are kept; longer than 8192/1 are divided by 8.
    np.testing.assert_allclose(l3[wavelen < 2048], b3[wavelen < 2048])
    np.testing.assert_allclose(l3[wavelen > 8192], b3[wavelen > 8192] / 8)
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any()
    i = int(np.argmax(mid))
    smooth = (8192 / wavelen[i] - 1) / (4 - 1)
    np.testing.assert_allclose(l3[i], (1 - smooth) * b3[i] / 8 + smooth * b3[i])


def test_rope_yarn():
    h, factor = 64, 16.0
    inv, mscale = rope.inv_frequencies(h, _rope(scaling="yarn", factor=factor))
    base, _ = rope.inv_frequencies(h, _rope())
    assert mscale == pytest.approx(0.1 * np.log(16.0) + 1.0)
    # dim * ln(4096 / (32 * 2pi)) / (2 ln 10000) = 64 * 3.0106 / 18.4207 = 10.46 -> low = 10;
    # with beta_slow = 1: 64 * 6.4763 / 18.4207 = 22.50 -> high = 23. Below 10: extrapolate (keep);
    # from 23 on: interpolate (divide by the factor).
    np.testing.assert_allclose(inv[:10], base[:10])
    np.testing.assert_allclose(inv[23:], base[23:] / factor)
    assert np.all((inv[10:23] <= base[10:23]) & (inv[10:23] >= base[10:23] / factor))


def test_rope_yarn_deepseek_mscale():
    # DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1: cos/sin unscaled (1.3689 / 1.3689), and the
    # softmax scale times (0.1 ln 40 + 1)^2 = 1.36889^2 = 1.87386.
    r = _rope(scaling="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    assert rope.inv_frequencies(64, r)[1] == pytest.approx(1.0)
    assert rope.softmax_scale_factor(r) == pytest.approx(1.87386, abs=1e-5)
    # mscale 0.707 over mscale_all_dim 1 (factor 4): (0.0707 ln 4 + 1) / (0.1 ln 4 + 1) = 1.09801 / 1.13863
    r = _rope(scaling="yarn", factor=4.0, mscale=0.707, mscale_all_dim=1.0)
    assert rope.inv_frequencies(64, r)[1] == pytest.approx(1.09801 / 1.13863, abs=1e-5)
    assert rope.softmax_scale_factor(_rope()) == 1.0


def test_rope_rotation_preserves_norm_and_relative_position():
    cfg = _rope()
    x = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    y = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

    def rot(v, p):
        c, s = rope.cos_sin(jnp.array([[p]]), 16, cfg)
        return rope.apply_rope(v, c, s)

    np.testing.assert_allclose(jnp.linalg.norm(rot(x, 7)), jnp.linalg.norm(x), rtol=1e-6)
    dot = lambda p, q: float(jnp.sum(rot(x, p) * rot(y, q)))
    assert dot(3, 1) == pytest.approx(dot(10, 8), rel=1e-5)


def test_next_token_loss_golden():
    # Uniform logits over V = 4: every prediction costs ln 4.
    assert float(model.next_token_loss(jnp.zeros((1, 3, 4)), jnp.array([[0, 1, 2]]))) == pytest.approx(
        np.log(4.0)
    )
    # V = 2, tokens (0, 1, 1). Position 0 predicts 1 with logits (0, ln 3): p = 3/4, nll = ln(4/3);
    # position 1 predicts 1 with logits (0, 0): nll = ln 2; the last position has no target.
    logits = jnp.array([[[0.0, np.log(3.0)], [0.0, 0.0], [5.0, -5.0]]])
    toks = jnp.array([[0, 1, 1]])
    expected = (np.log(4 / 3) + np.log(2)) / 2
    assert float(model.next_token_loss(logits, toks)) == pytest.approx(expected, rel=1e-6)
    # mask[t + 1] = 0 removes the prediction of token t + 1: only position 0 remains.
    masked = model.next_token_loss(logits, toks, jnp.array([[1, 1, 0]]))
    assert float(masked) == pytest.approx(np.log(4 / 3), rel=1e-6)
    # A batch of two identical rows has the same mean.
    two = model.next_token_loss(jnp.concatenate([logits, logits]), jnp.concatenate([toks, toks]))
    assert float(two) == pytest.approx(expected, rel=1e-6)
