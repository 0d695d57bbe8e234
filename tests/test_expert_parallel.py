"""Expert parallelism (model/moe_parallel.py) on 8 fake CPU devices: the shard_map dispatch with its
all-to-all gives the GSPMD path's and one device's output and gradients (every parameter and the input),
for uneven loads, both routers, group-limited routing, a tensor-split expert width and capacity drops;
its refusals; the all-to-all bytes; and the ragged all-to-all, which XLA:CPU cannot run."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import model
from configs import tiny
from model import moe, moe_parallel, sharding

# f32: the shards add the same products in another order (psums over data and tensor, the fsdp
# all-gather), as in tests/test_sharding.py.
ATOL = RTOL = 2e-5
B, T = 8, 6


def _mesh(shape):
    return sharding.make_mesh({a: 1 for a in sharding.MESH_AXES} | shape)


def _cfg(mode="auto", router="softmax", impl="ragged", **moe_kw):
    cfg = tiny.get_config()
    e = cfg.model.moe
    e.num_experts, e.top_k, e.expert_parallel, e.router, e.impl = 8, 2, mode, router, impl
    for k, v in moe_kw.items():
        e[k] = v
    return cfg


def _block(cfg):
    """The block with router row 0 set so that feature 0 of `_x` (a constant 4) adds +8 to expert 0's
    logit and -40 to expert 7's: expert 0 is in nearly every token's top-2, expert 7 in none."""
    block = moe.MoEBlock(cfg.model, tuple(cfg.mesh.rules), rngs=nnx.Rngs(params=0))
    block.router[...] = block.router[...].at[0, 0].set(2.0).at[0, 7].set(-10.0)
    if cfg.model.moe.router == "sigmoid":  # a selection bias that changes some choices
        block.expert_bias[...] = jnp.linspace(0.3, -0.3, 8)
    return block


def _x():
    x = jax.random.normal(jax.random.key(1), (B, T, 64), jnp.float32)
    return x.at[..., 0].set(4.0)


def _run(block, x, forced=None):
    """((loss, y, aux), (grads of the block's whole state, of x)) jitted, and the program's HLO."""
    graphdef, state = nnx.split(block)

    def f(state, x):
        y, aux = nnx.merge(graphdef, state)(x, expert_indices_BTk=forced)
        # A weighted sum, so every output element and both router losses reach the gradients.
        w = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        loss = jnp.sum(y * w) + aux["load_balance_loss"] + aux["router_z_loss"]
        return loss, (y, aux["dropped_tokens"], aux["expert_load"])

    lowered = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True)).lower(state, x)
    return lowered.compile()(state, x), lowered.as_text()


def _assert_same(got, want):
    (loss_a, (y_a, dropped_a, load_a)), grads_a = got
    (loss_b, (y_b, dropped_b, load_b)), grads_b = want
    np.testing.assert_allclose(loss_a, loss_b, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(y_a, y_b, atol=ATOL, rtol=RTOL)
    assert float(dropped_a) == float(dropped_b)
    np.testing.assert_array_equal(load_a, load_b)
    chex.assert_trees_all_close(grads_a, grads_b, atol=ATOL, rtol=RTOL)


FORCED = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (B, T, 2))  # every token to experts 0 and 1

CASES = {
    # name: (mesh, moe fields, forced routing)
    "sigmoid-groups-expert8": ({"expert": 8}, dict(router="sigmoid", n_group=2, topk_group=1), None),
    # Shard 0 (experts 0, 1) receives every assignment, filling its slots exactly; the others none.
    "all-to-one-shard-expert4-data2": ({"expert": 4, "data": 2}, {}, FORCED),
    # The expert width split over tensor: each tensor shard's down projection is a partial sum.
    "tensor2-expert2-data2": ({"expert": 2, "tensor": 2, "data": 2}, {}, None),
    # C = ceil(0.5 * 6 * 2 / 8) = 1 slot per sequence and expert; sequences split over `sequence`.
    "capacity-expert4-sequence2": (
        {"expert": 4, "sequence": 2},
        dict(impl="capacity", capacity_factor=0.5),
        None,
    ),
}


@pytest.fixture(scope="module")
def one_device():
    """A case's one-device result (no mesh), computed once per distinct block and routing."""
    cache = {}

    def get(fields, forced):
        key = (tuple(sorted(fields.items())), forced is None)
        if key not in cache:
            cache[key] = _run(_block(_cfg(**fields)), _x(), forced)[0]
        return cache[key]

    return get


def _shard_map_case(name):
    """The case's shard_map result on its mesh, with checks that the path ran and the loads it set up."""
    mesh_shape, fields, forced = CASES[name]
    with jax.set_mesh(_mesh(mesh_shape)):
        got, hlo = _run(_block(_cfg("shard_map", **fields)), _x(), forced)
    assert "all_to_all" in hlo  # the shard_map path really ran
    load_E = np.asarray(got[0][1][2])
    if forced is None:  # the loads the router rows set up: uneven, expert 7 idle
        assert load_E[0] > 0.4 and load_E[7] == 0.0
    if fields.get("impl") == "capacity":
        assert float(got[0][1][1]) > 0  # some assignments dropped
    return got


@pytest.mark.parametrize("name", list(CASES))
def test_shard_map_equals_one_device(one_device, name):
    _, fields, forced = CASES[name]
    _assert_same(_shard_map_case(name), one_device(fields, forced))


# One case in the default run; the others are covered there by the one-device test above together with
# tests/test_sharding.py (GSPMD equals one device on these meshes).
GSPMD_DEFAULT = "all-to-one-shard-expert4-data2"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == GSPMD_DEFAULT else pytest.mark.slow) for n in CASES]
)
def test_shard_map_equals_gspmd(name):
    mesh_shape, fields, forced = CASES[name]
    with jax.set_mesh(_mesh(mesh_shape)):
        gspmd, hlo = _run(_block(_cfg("gspmd", **fields)), _x(), forced)
    assert "all_to_all" not in hlo
    _assert_same(_shard_map_case(name), gspmd)


def test_transformer_on_an_expert_mesh_equals_one_device():
    """The tiny model (4 experts, a shared one, 2 scanned MoE layers) forward and gradients on
    expert 4 x data 2 with the shard_map dispatch equal one device's."""
    toks = jax.random.randint(jax.random.key(0), (8, 16), 0, 256, jnp.int32)

    def loss_and_grads(cfg, mesh=None):
        m = model.build(cfg, mesh=mesh)
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)

        def loss(params, toks):
            logits, aux = nnx.merge(graphdef, params, rest)(toks)
            return model.next_token_loss(logits, toks) + aux["moe_loss"], logits

        lowered = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params, toks)
        return lowered.compile()(params, toks), lowered.as_text()

    cfg = tiny.get_config()  # expert_parallel: the default, auto (configs/base.py does not list it yet)
    want, _ = loss_and_grads(cfg)
    shape = {"expert": 4, "data": 2}
    cfg.mesh.shape.update({a: 1 for a in sharding.MESH_AXES} | shape)
    mesh = _mesh(shape)
    with jax.set_mesh(mesh):
        spec = sharding.logical_to_spec(("act_batch", "act_length"), cfg.mesh.rules)
        toks = jax.device_put(toks, NamedSharding(mesh, spec))
        ((loss_n, logits_n), grads_n), hlo = loss_and_grads(cfg, mesh)
    ((loss_1, logits_1), grads_1) = want
    assert "all_to_all" in hlo
    np.testing.assert_allclose(loss_n, loss_1, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(logits_n, logits_1, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(grads_n, grads_1, atol=ATOL, rtol=RTOL)


def test_layout_choice_and_refusals():
    rules = tuple(tiny.get_config().mesh.rules)
    sizes = lambda **s: {a: 1 for a in sharding.MESH_AXES} | s
    moe_cfg = lambda mode: _cfg(mode).model.moe
    # expert 4 x data 2: tokens over (data, expert), 8 / 8 = 1 sequence of 6 per shard; X = 2 experts per
    # shard, so a token sends at most min(k, X) = 2 assignments to one shard: C = 6 * 2 = 12.
    lay = moe_parallel.layout(moe_cfg("auto"), rules, sizes(expert=4, data=2), (8, 6), None)
    assert lay == moe_parallel.Layout("expert", 4, ("data", "expert"), (), (), 12, 6)
    # With capacity 1 per sequence and expert: C = min(12, 1 sequence * 2 experts * 1) = 2.
    assert moe_parallel.layout(moe_cfg("auto"), rules, sizes(expert=4, data=2), (8, 6), 1).slots == 2
    # No expert axis, or gspmd: no shard_map.
    assert moe_parallel.layout(moe_cfg("shard_map"), rules, sizes(data=8), (8, 6), None) is None
    assert moe_parallel.layout(moe_cfg("gspmd"), rules, sizes(expert=8), (8, 6), None) is None
    # 4 sequences over 8 token shards: auto falls back to GSPMD, shard_map says why and what to change.
    assert moe_parallel.layout(moe_cfg("auto"), rules, sizes(expert=8), (4, 6), None) is None
    with pytest.raises(
        ValueError, match=r"model.moe.expert_parallel=shard_map: tokens \[4, 6\] do not divide"
    ):
        moe_parallel.layout(moe_cfg("shard_map"), rules, sizes(expert=8), (4, 6), None)
    with pytest.raises(ValueError, match=r"model.moe.expert_parallel='bogus'; choose one of"):
        moe_parallel.layout(moe_cfg("bogus"), rules, sizes(expert=8), (8, 6), None)
    # Tokens not split over the experts' axis (act_batch without expert): refused under shard_map.
    no_ep_batch = tuple((k, ("data", "fsdp") if k == "act_batch" else v) for k, v in rules)
    with pytest.raises(ValueError, match="not split over the experts' axis 'expert'"):
        moe_parallel.layout(moe_cfg("shard_map"), no_ep_batch, sizes(expert=4, data=2), (8, 6), None)


def test_block_refuses_an_impossible_shard_map_before_any_work():
    block, x = _block(_cfg("shard_map")), _x()[:4]  # 4 sequences over 8 token shards
    with (
        jax.set_mesh(_mesh({"expert": 8})),
        pytest.raises(ValueError, match="model.moe.expert_parallel=shard_map"),
    ):
        jax.eval_shape(lambda x: block(x), x)


def test_all_to_all_bytes_by_hand():
    cfg = _cfg()
    cfg.model.d_model = 64  # f32: 4 bytes
    mesh = {"expert": 4, "data": 2}
    # 8 x 16 tokens over 8 token shards: T' = 16; J = 4, X = 2, k = 2, C = 16 * min(2, 2) = 32.
    # buffer 4 * 32 * 64 * 4 = 32768; counts int32 [J, X] to 3 peers: 4 * 3 * 2 = 24 bytes.
    # padded: 2 directions * 3 peers * 32 slots * 64 * 4 = 49152 (+24)
    # ragged, balanced: 2 * 3/4 * 16 * 2 * 64 * 4 = 12288 (+24)
    got = moe_parallel.all_to_all_bytes(cfg, mesh, 8, 16)
    assert got == moe_parallel.AllToAllBytes(4, 32, 32768, 49176, 12312)
    # capacity 1.0: 1 * 16 * 2 / 8 = 4 slots per sequence and expert; C = min(32, 1 * 2 * 4) = 8.
    cfg.model.moe.impl, cfg.model.moe.capacity_factor = "capacity", 1.0
    got = moe_parallel.all_to_all_bytes(cfg, mesh, 8, 16)
    assert got == moe_parallel.AllToAllBytes(4, 8, 8192, 2 * 3 * 8 * 64 * 4 + 24, 12312)
    assert moe_parallel.all_to_all_bytes(cfg, {"data": 8}, 8, 16) is None  # no expert axis
    cfg.model.moe.expert_parallel = "gspmd"
    assert moe_parallel.all_to_all_bytes(cfg, mesh, 8, 16) is None


def test_ragged_all_to_all_lowers_and_xla_cpu_refuses_it():
    """The ragged exchange (what TPU/GPU run) traces with its gradients and lowers to XLA's
    ragged-all-to-all; XLA:CPU (jax 0.10.2) cannot compile it, so CPU runs the padded one. Where a
    backend compiles it, it must give the padded exchange's output."""
    cfg = _cfg()
    block, x = _block(cfg), _x()
    mesh_shape = {"expert": 4, "data": 2}
    rules = tuple(cfg.mesh.rules)
    lay = moe_parallel.layout(
        cfg.model.moe, rules, {a: 1 for a in sharding.MESH_AXES} | mesh_shape, (B, T), None
    )
    # Two distinct experts per token, drawn at random.
    idx_BTk = jnp.argsort(jax.random.uniform(jax.random.key(3), (B, T, 8)), axis=-1)[..., :2].astype(
        jnp.int32
    )
    w_BTk = jax.random.uniform(jax.random.key(2), idx_BTk.shape)
    weights = (block.gate[...], block.up[...], block.down[...])
    kept = jnp.ones(idx_BTk.shape, bool)

    def loss(ragged, x, w, *weights):
        y = moe_parallel.dispatch(x, idx_BTk, w, kept, *weights, lay, ragged=ragged)
        return jnp.sum(jnp.sin(y))

    with jax.set_mesh(_mesh(mesh_shape)):
        grad = lambda ragged: jax.jit(
            jax.value_and_grad(lambda *a: loss(ragged, *a), argnums=(0, 1, 2, 3, 4))
        )
        lowered = grad(True).lower(x, w_BTk, *weights)
        assert "ragged_all_to_all" in lowered.as_text()
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as err:
            assert "ragged-all-to-all" in str(err) and jax.default_backend() == "cpu"
            return
        chex.assert_trees_all_close(
            compiled(x, w_BTk, *weights), grad(False)(x, w_BTk, *weights), atol=ATOL, rtol=RTOL
        )
