"""MoE block: dispatch equivalence, drop counting, router losses and gradients, routing replay."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from model.moe import dispatch as moe_dispatch
from model.moe import layer as moe

# f32 everywhere; ragged and capacity sum the same products in a different order.
ATOL = RTOL = 1e-5


def _block(impl="ragged", router="softmax", shared=1, capacity_factor=1.25, seed=0, **moe_kw):
    cfg = tiny.get_config()
    cfg.model.moe.impl = impl
    cfg.model.moe.router = router
    cfg.model.moe.num_shared_experts = shared
    cfg.model.moe.capacity_factor = capacity_factor
    for k, v in moe_kw.items():
        cfg.model.moe[k] = v
    return moe.MoEBlock(cfg.model, tuple(cfg.mesh.rules), rngs=nnx.Rngs(params=seed)), cfg


def _x(b=2, t=12, d=64, seed=1):
    return jax.random.normal(jax.random.key(seed), (b, t, d), jnp.float32)


def _loss_and_grads(block, x, **kw):
    graphdef, state = nnx.split(block)

    def f(state, x):
        y, aux = nnx.merge(graphdef, state)(x, **kw)
        # Weighted sum so every output element and both aux losses reach the gradient.
        w = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        return jnp.sum(y * w) + aux["load_balance_loss"] + aux["router_z_loss"], (y, aux)

    (loss, (y, aux)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(state, x)
    return y, aux, grads


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_ragged_equals_capacity_when_nothing_drops(router):
    x = _x()
    # capacity_factor = E / k gives C = T slots per expert: no assignment can be dropped.
    ragged, _ = _block("ragged", router)
    capacity, cfg = _block("capacity", router, capacity_factor=4 / 2)
    y_r, aux_r, (gs_r, gx_r) = _loss_and_grads(ragged, x)
    y_c, aux_c, (gs_c, gx_c) = _loss_and_grads(capacity, x)
    assert float(aux_c["dropped_tokens"]) == 0.0
    np.testing.assert_allclose(y_r, y_c, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(gx_r, gx_c, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(gs_r, gs_c, atol=ATOL, rtol=RTOL)
    np.testing.assert_array_equal(aux_r["expert_indices"], aux_c["expert_indices"])


def test_capacity_drops_are_counted_and_contribute_nothing():
    # Force every token of every sequence onto experts (0, 1); T=8, k=2, E=4, factor 1.0:
    # C = ceil(1.0 * 8 * 2 / 4) = 4 slots per expert, so experts 0 and 1 each keep the first 4 tokens
    # and drop the last 4: 8 dropped assignments per sequence, 16 for B=2, fraction 16 / 32 = 0.5.
    b, t = 2, 8
    forced = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (b, t, 2))
    x = _x(b, t)
    cap_block, _ = _block("capacity", shared=0, capacity_factor=1.0)
    ragged_block, _ = _block("ragged", shared=0)
    y_c, aux = cap_block(x, expert_indices_BTk=forced)
    y_r, _ = ragged_block(x, expert_indices_BTk=forced)
    assert float(aux["dropped_tokens"]) == 16.0
    assert float(aux["dropped_fraction"]) == 0.5
    np.testing.assert_allclose(y_c[:, :4], y_r[:, :4], atol=ATOL, rtol=RTOL)
    np.testing.assert_array_equal(y_c[:, 4:], 0.0)  # no shared expert: dropped tokens output 0


def test_capacity_formula():
    assert moe.capacity(tokens=8, top_k=2, num_experts=4, factor=1.0) == 4
    assert moe.capacity(tokens=10, top_k=2, num_experts=4, factor=1.25) == 7  # ceil(6.25)
    assert moe.capacity(tokens=1, top_k=2, num_experts=64, factor=1.0) == 1


def test_load_balance_loss_golden_values():
    lb = lambda probs, idx: float(moe.load_balance_loss(jnp.array(probs), jnp.array(idx), "softmax")[0])
    # Uniform routing: f_e = 1/4, P_e = 1/4 -> 4 * 4 * (1/16) = 1 (the minimum).
    assert lb([[0.25] * 4] * 4, [[0], [1], [2], [3]]) == pytest.approx(1.0)
    # Collapsed routing: f = P = (1, 0, 0, 0) -> 4 * 1 = 4 (the maximum).
    assert lb([[1.0, 0, 0, 0]] * 4, [[0]] * 4) == pytest.approx(4.0)
    # Two tokens to experts 0 and 1: f = (.5, .5, 0, 0), P = (.4, .4, .1, .1) -> 4 * (.2 + .2) = 1.6.
    probs = [[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1]]
    assert lb(probs, [[0], [1]]) == pytest.approx(1.6)
    # Top-2: assignments (0,1),(2,3) -> f = 1/4 each; uniform P -> 1 again.
    assert lb([[0.25] * 4] * 2, [[0, 1], [2, 3]]) == pytest.approx(1.0)


def test_load_fractions_and_z_loss_golden():
    _, f = moe.load_balance_loss(jnp.full((3, 4), 0.25), jnp.array([[0, 1], [0, 2], [0, 3]]), "softmax")
    np.testing.assert_allclose(f, [3 / 6, 1 / 6, 1 / 6, 1 / 6], rtol=1e-6)
    # logits all zero over E=4: logsumexp = log 4, z-loss = (log 4)^2.
    assert float(moe.z_loss(jnp.zeros((5, 4)))) == pytest.approx(np.log(4.0) ** 2, rel=1e-6)


@pytest.mark.parametrize("router,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_router_gradients_flow(router, renormalize):
    block, _ = _block("ragged", router, renormalize=renormalize)
    x = _x()
    graphdef, state = nnx.split(block)

    def output_only(state):
        y, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(jnp.sin(y))

    def aux_only(state, key):
        _, aux = nnx.merge(graphdef, state)(x)
        return aux[key]

    grad_aux = jax.jit(jax.grad(aux_only), static_argnums=1)
    g_out = jax.jit(jax.grad(output_only))(state)["router"][...]
    g_lb = grad_aux(state, "load_balance_loss")["router"][...]
    g_z = grad_aux(state, "router_z_loss")["router"][...]
    for g in (g_out, g_lb, g_z):
        chex.assert_tree_all_finite(g)
        assert float(jnp.abs(g).max()) > 1e-6


def test_route_softmax_top_k_renormalised():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    w, idx, probs = moe.route(logits, router="softmax", top_k=2, renormalize=True)
    np.testing.assert_array_equal(idx, [[3, 2]])
    np.testing.assert_allclose(w, [[0.4 / 0.7, 0.3 / 0.7]], rtol=1e-6)
    w, _, _ = moe.route(logits, router="softmax", top_k=2, renormalize=False)
    np.testing.assert_allclose(w, [[0.4, 0.3]], rtol=1e-6)


def test_sigmoid_bias_selects_but_does_not_weight():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    bias = jnp.array([0.0, 0.0, 0.0, 5.0])
    w, idx, _ = moe.route(logits, router="sigmoid", top_k=2, renormalize=True, bias_E=bias)
    np.testing.assert_array_equal(idx, [[3, 0]])  # the bias pulls expert 3 into the top-2
    s = jax.nn.sigmoid(logits[0])
    np.testing.assert_allclose(w, [[s[3] / (s[3] + s[0]), s[0] / (s[3] + s[0])]], rtol=1e-6)


def test_update_expert_bias_moves_toward_balance():
    # loads (.5, .25, .25, 0) vs target .25: over, equal, equal, under -> (-r, 0, 0, +r).
    new = moe.update_expert_bias(jnp.zeros(4), jnp.array([0.5, 0.25, 0.25, 0.0]), 0.01)
    np.testing.assert_allclose(new, [-0.01, 0.0, 0.0, 0.01])


def test_update_bias_state_keeps_the_tree_structure_and_the_mtp_bias():
    """The train step's out_shardings are built for the state that came in: the updated state must be the same
    pytree (an MTP module's bias sub-tree stayed a plain mapping, not a nested State), with only the decoder's
    MoE biases moved. Loads (1, 0, 0, 0) on 4 experts: -r on expert 0, +r on the rest."""
    from model.transformer import Transformer

    cfg = tiny.get_config()
    cfg.model.moe.router, cfg.model.mtp_layers = "sigmoid", 1
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    _, _, rest = nnx.split(model, nnx.Param, ...)
    rest = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), rest)
    assert "mtp" in rest and "moe_layers" in rest
    e = cfg.model.moe.num_experts
    load_LE = jnp.zeros((cfg.model.num_layers - cfg.model.moe.first_dense_layers, e)).at[:, 0].set(1.0)
    new = moe.update_bias_state(rest, load_LE, 0.01)
    assert jax.tree.structure(new) == jax.tree.structure(rest)
    want = np.full(e, 0.01)
    want[0] = -0.01
    for leaf in jax.tree.leaves(new["moe_layers"]):
        rows = np.asarray(leaf).reshape(-1, e)
        np.testing.assert_allclose(rows, np.broadcast_to(want, rows.shape))
    for leaf in jax.tree.leaves(new["mtp"]):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)


@pytest.mark.parametrize("impl", ["ragged", "capacity"])
def test_routing_replay(impl):
    block, _ = _block(impl, capacity_factor=2.0)
    x = _x()
    y, aux = block(x)
    y_replay, aux_replay = block(x, expert_indices_BTk=aux["expert_indices"])
    np.testing.assert_allclose(y, y_replay, atol=ATOL, rtol=RTOL)
    other = (aux["expert_indices"] + 1) % 4  # still distinct per token
    y_other, aux_other = block(x, expert_indices_BTk=other)
    np.testing.assert_array_equal(aux_other["expert_indices"], other)
    assert float(jnp.abs(y_other - y).max()) > 1e-3


def test_group_limited_routing_picks_top_k_inside_the_best_groups():
    # 8 experts in 4 groups of 2 with sigmoid scores p. Group scores (sum of the group's two best):
    # g0 = 0.9 + 0.1 = 1.0, g1 = 0.5 + 0.45 = 0.95, g2 = 0.8 + 0.01 = 0.81, g3 = 0.3 + 0.3 = 0.6.
    # topk_group=2 keeps g0 and g1, so top-2 is experts 0 (0.9) and 2 (0.5); ungrouped it would be 0 and 4.
    p = jnp.array([[0.9, 0.1, 0.5, 0.45, 0.8, 0.01, 0.3, 0.3]])
    logits = jnp.log(p / (1 - p))
    kw = dict(router="sigmoid", top_k=2, renormalize=True)
    _, idx, _ = moe.route(logits, n_group=4, topk_group=2, **kw)
    assert sorted(np.asarray(idx)[0].tolist()) == [0, 2]
    w, idx, _ = moe.route(logits, **kw)
    assert sorted(np.asarray(idx)[0].tolist()) == [0, 4]
    # A selection bias moves group 3 to the top: +0.5 on expert 6 gives g3 = 0.8 + 0.3 = 1.1 and expert 6
    # the best biased score (0.8); the weights stay the unbiased scores, renormalised: 0.3 / 1.2, 0.9 / 1.2.
    bias = jnp.zeros(8).at[6].set(0.5)
    w, idx, _ = moe.route(logits, n_group=4, topk_group=2, bias_E=bias, **kw)
    order = np.argsort(np.asarray(idx)[0])
    assert np.asarray(idx)[0][order].tolist() == [0, 6]
    np.testing.assert_allclose(np.asarray(w)[0][order], [0.75, 0.25], rtol=1e-6)


def _dense_reference(x_TD, idx_Tk, w_Tk, gate, up, down):
    """Every expert over every token, masked to the chosen ones (an index of E chooses none): the MoE
    output written the plain way, independent of the sort, the groups and the gathers."""
    e = gate.shape[0]
    y_ETD = jnp.stack([(jax.nn.silu(x_TD @ gate[i]) * (x_TD @ up[i])) @ down[i] for i in range(e)])
    weight_TE = jnp.sum(jax.nn.one_hot(idx_Tk, e, dtype=x_TD.dtype) * w_Tk[..., None], axis=1)
    return jnp.einsum("etd,te->td", y_ETD, weight_TE)


def _dispatch_case(t, k, e, seed=3):
    keys = jax.random.split(jax.random.key(seed), 5)
    d, f = 16, 24
    x = jax.random.normal(keys[0], (t, d))
    idx = jnp.argsort(jax.random.uniform(keys[1], (t, e)), axis=-1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(keys[2], (t, k))
    gate, up = (jax.random.normal(kk, (e, d, f)) * d**-0.5 for kk in jax.random.split(keys[3]))
    down = jax.random.normal(keys[4], (e, f, d)) * f**-0.5
    return x, idx, w, gate, up, down


def _out_and_grads(fn, x, idx, w, gate, up, down):
    def f_(x, w, gate, up, down):
        y = fn(x, idx, w, gate, up, down)
        return jnp.sum(jnp.sin(y)), y

    return jax.jit(jax.value_and_grad(f_, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, w, gate, up, down)


@pytest.mark.parametrize("t,k,e", [(12, 2, 4), (5, 3, 8), (300, 2, 4)])
def test_cpu_grouped_kernel_equals_ragged_dot(t, k, e):
    """The CPU dropless kernel (windows of each expert's rows) and the accelerator path
    (`jax.lax.ragged_dot`) give the same output and gradients; 300 tokens span several windows."""
    case = _dispatch_case(t, k, e)
    dispatch = lambda use_ragged_dot: lambda *a: moe.ragged_dispatch(*a, use_ragged_dot=use_ragged_dot)
    (_, y_a), g_a = _out_and_grads(dispatch(True), *case)
    (_, y_b), g_b = _out_and_grads(dispatch(False), *case)
    np.testing.assert_allclose(y_a, y_b, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(g_a, g_b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("use_ragged_dot", [False, True])
def test_empty_assignments_contribute_nothing(use_ragged_dot):
    """An expert index of E is an empty assignment (the expert-parallel receiver's empty slots): its
    output and gradients are those of the assignment left out, on both dispatch kernels."""
    x, idx, w, gate, up, down = _dispatch_case(12, 2, 4)
    idx = idx.at[::3, 1].set(4).at[5, :].set(4)  # every third token's second choice, all of token 5's
    dispatch = lambda *a: moe.ragged_dispatch(*a, use_ragged_dot=use_ragged_dot)
    (_, y), g = _out_and_grads(dispatch, x, idx, w, gate, up, down)
    (_, y_ref), g_ref = _out_and_grads(_dense_reference, x, idx, w, gate, up, down)
    np.testing.assert_allclose(y, y_ref, atol=ATOL, rtol=RTOL)
    np.testing.assert_array_equal(y[5], 0.0)
    chex.assert_trees_all_close(g, g_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("t,k,e", [(1, 2, 8), (16, 2, 8), (5, 3, 4)])
def test_gathered_path_equals_dispatch_and_reference(t, k, e):
    """The small-token path (each token gathers its experts' weights) gives the dispatch's and the plain
    reference's output and gradients (it is differentiable, so it may run in training too)."""
    case = _dispatch_case(t, k, e)
    (_, y), g = _out_and_grads(moe_dispatch.gathered_swiglu, *case)
    (_, y_ref), g_ref = _out_and_grads(_dense_reference, *case)
    (_, y_disp), g_disp = _out_and_grads(moe.ragged_dispatch, *case)
    np.testing.assert_allclose(y, y_ref, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(g, g_ref, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(y, y_disp, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(g, g_disp, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "impl,factor,threshold,gathers",
    [
        ("ragged", 1.25, 16, True),
        # capacity gathers only where nothing can drop, C = ceil(factor * T * k / E) >= T: factor 2.0
        # gives C = 8 = T; factor 1.0 gives C = 4 < T and keeps the capacity dispatch.
        ("capacity", 2.0, 16, True),
        ("capacity", 1.0, 16, False),
        ("ragged", 1.25, 15, False),  # 16 tokens, one past the threshold
        ("ragged", 1.25, -1, False),  # auto: B * T * k = 32 > E = 4
    ],
)
def test_block_takes_the_small_token_path_below_the_threshold(impl, factor, threshold, gathers):
    """B * T <= moe.gather_max_tokens runs the gather (no sort in the program) with the dispatch's output
    and gradients."""
    x = _x(b=2, t=8)
    small, _ = _block(impl, capacity_factor=factor, gather_max_tokens=threshold)
    dispatch, _ = _block(impl, capacity_factor=factor, gather_max_tokens=0)
    sorts = lambda blk, x: re.search(r"\bsort\[", str(jax.make_jaxpr(lambda x: blk(x)[0])(x))) is not None
    assert sorts(small, x) != gathers
    assert sorts(dispatch, x)
    if threshold == -1:  # auto: one token, k = 2 <= E = 4, gathers
        assert not sorts(small, x[:1, :1])
    if not gathers:
        return
    y_s, aux_s, g_s = _loss_and_grads(small, x)
    y_d, aux_d, g_d = _loss_and_grads(dispatch, x)
    np.testing.assert_allclose(y_s, y_d, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(g_s, g_d, atol=ATOL, rtol=RTOL)
    assert float(aux_s["dropped_tokens"]) == float(aux_d["dropped_tokens"])


def test_bad_gather_threshold_is_refused_naming_the_field():
    block, _ = _block(gather_max_tokens=-2)
    with pytest.raises(ValueError, match=r"model.moe.gather_max_tokens=-2; use -1 \(auto\), 0 \(never\)"):
        jax.eval_shape(lambda x: block(x), _x())


@pytest.mark.parametrize("impl, factor", [("ragged", 1.25), ("capacity", 2.0)])
def test_every_expert_path_below_its_threshold_equals_the_dispatch(impl, factor):
    """B * T <= moe.every_expert_max_tokens runs every expert on every token (no sort in the program): the
    dispatch's outputs and gradients up to f32 rounding (an unselected expert's rows are weighted by 0)."""
    x = _x(b=2, t=8)
    every, _ = _block(impl, capacity_factor=factor, every_expert_max_tokens=16)
    dispatch, _ = _block(impl, capacity_factor=factor, every_expert_max_tokens=0)
    sorts = lambda blk, x: re.search(r"\bsort\[", str(jax.make_jaxpr(lambda x: blk(x)[0])(x))) is not None
    assert not sorts(every, x) and sorts(dispatch, x)
    assert sorts(every, _x(b=2, t=9))  # 18 tokens: past the threshold
    y_e, aux_e, g_e = _loss_and_grads(every, x)
    y_d, aux_d, g_d = _loss_and_grads(dispatch, x)
    np.testing.assert_allclose(y_e, y_d, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(g_e, g_d, atol=ATOL, rtol=RTOL)
    assert float(aux_e["dropped_tokens"]) == float(aux_d["dropped_tokens"]) == 0.0


def test_every_expert_path_by_hand():
    # 2 tokens, 3 experts of d = f = 1 (SwiGLU silu(g x) * (u x) * down): token 0 picks experts 2 and 0 with
    # weights 0.75 / 0.25, token 1 expert 1 alone with weight 1.
    from model.moe.dispatch import every_expert_swiglu

    gate = jnp.asarray([1.0, 2.0, -1.0]).reshape(3, 1, 1)
    up = jnp.asarray([0.5, 1.0, 2.0]).reshape(3, 1, 1)
    down = jnp.asarray([3.0, -1.0, 0.5]).reshape(3, 1, 1)
    x = jnp.asarray([[2.0], [-1.0]])
    idx = jnp.asarray([[2, 0], [1, 1]], jnp.int32)
    w = jnp.asarray([[0.75, 0.25], [1.0, 0.0]])
    silu = lambda z: z / (1 + np.exp(-z))
    want0 = 0.75 * silu(-2.0) * 4.0 * 0.5 + 0.25 * silu(2.0) * 1.0 * 3.0
    want1 = 1.0 * silu(-2.0) * -1.0 * -1.0
    np.testing.assert_allclose(
        np.asarray(every_expert_swiglu(x, idx, w, gate, up, down))[:, 0], [want0, want1], rtol=1e-6
    )


def test_bad_every_expert_threshold_is_refused_naming_the_field():
    block, _ = _block(every_expert_max_tokens=-2)
    with pytest.raises(ValueError, match=r"model.moe.every_expert_max_tokens=-2; use -1"):
        jax.eval_shape(lambda x: block(x), _x())
