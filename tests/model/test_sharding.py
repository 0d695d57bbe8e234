"""Sharded forward and gradients on 8 fake CPU devices equal the single-device ones."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import model
from configs import tiny
from model import sharding

# f32; sharded reductions (psum over fsdp/tensor shards) add in another order than one device does.
ATOL = RTOL = 2e-5

MESHES = [
    {"data": 8},
    {"fsdp": 4, "tensor": 2},
    {"data": 2, "expert": 4},
    {"data": 2, "expert": 2, "tensor": 2},
    {"fsdp": 2, "expert": 2, "sequence": 2},
]


def _mesh(shape):
    full = {a: 1 for a in sharding.MESH_AXES}
    full.update(shape)
    return sharding.make_mesh(full)


def _loss_and_grads(m, toks):
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params, toks):
        logits, aux = nnx.merge(graphdef, params, rest)(toks)
        return model.next_token_loss(logits, toks) + aux["moe_loss"], logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params, toks)


@pytest.fixture(scope="module")
def reference():
    """Single-device logits, loss and gradients, per MoE impl."""
    out = {}
    toks = jax.random.randint(jax.random.key(0), (8, 16), 0, 256, jnp.int32)
    for arg in ("", "capacity"):
        cfg = tiny.get_config(arg)
        cfg.model.moe.capacity_factor = 2.0
        out[arg] = (toks, _loss_and_grads(model.build(cfg), toks))
    return out


def _sharded(arg, mesh_shape, toks, attention_impl=None):
    """(model, mesh, sharded tokens, ((loss, logits), grads)) of the tiny config on `mesh_shape`."""
    cfg = tiny.get_config(arg)
    cfg.model.moe.capacity_factor = 2.0
    if attention_impl:
        cfg.model.attention_impl = attention_impl
    cfg.mesh.shape.update({a: 1 for a in sharding.MESH_AXES})
    cfg.mesh.shape.update(mesh_shape)
    mesh = _mesh(mesh_shape)
    m = model.build(cfg, mesh=mesh)
    batch_spec = sharding.logical_to_spec(("act_batch", "act_length"), cfg.mesh.rules)
    with jax.set_mesh(mesh):
        toks_sharded = jax.device_put(toks, NamedSharding(mesh, batch_spec))
        return m, mesh, toks_sharded, _loss_and_grads(m, toks_sharded)


def _assert_same(got, want):
    ((loss_n, logits_n), grads_n), ((loss_1, logits_1), grads_1) = got, want
    np.testing.assert_allclose(loss_n, loss_1, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(logits_n, logits_1, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(grads_n, grads_1, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: ",".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("arg", ["", "capacity"])
def test_sharded_equals_single_device(reference, mesh_shape, arg):
    toks, want = reference[arg]
    _assert_same(_sharded(arg, mesh_shape, toks)[3], want)


def test_parameter_shardings_follow_the_rules():
    shape = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2, "sequence": 1}
    cfg = tiny.get_config()
    cfg.mesh.shape.update(shape)
    m = model.build(cfg, mesh=_mesh(shape))
    params = nnx.state(m, nnx.Param)
    spec = lambda v: v[...].sharding.spec
    blocks = params["moe_layers"]["blocks"]
    P = PartitionSpec
    # ('layers', 'exp', 'embed', 'mlp') -> (None, expert, fsdp, tensor)
    assert spec(blocks["mlp"]["gate"]) == P(None, "expert", "fsdp", "tensor")
    # ('layers', 'exp', 'mlp', 'embed') -> (None, expert, tensor, fsdp)
    assert spec(blocks["mlp"]["down"]) == P(None, "expert", "tensor", "fsdp")
    # ('layers', 'embed', 'heads', 'head_dim') -> (None, fsdp, tensor, None)
    assert spec(blocks["attn"]["q"]) == P(None, "fsdp", "tensor", None)
    assert spec(blocks["attn"]["k"]) == P(None, "fsdp", "tensor", None)
    # ('vocab', 'embed') -> (tensor, fsdp); ('embed', 'vocab') -> (fsdp, tensor)
    assert spec(params["embed"]["embedding"]) == P("tensor", "fsdp")
    assert spec(params["unembed"]) == P("fsdp", "tensor")
    # router ('layers', 'embed', None) and norms ('layers', 'norm') stay unsharded but for fsdp.
    assert spec(blocks["mlp"]["router"]) == P(None, "fsdp", None)
    assert spec(blocks["attn_norm"]["scale"]) == P(None, None)
    # each device holds 1/(2*2*2) of an expert weight
    gate = blocks["mlp"]["gate"][...]
    assert gate.addressable_shards[0].data.size * 8 == gate.size


def test_logical_to_spec_uses_each_mesh_axis_once():
    rules = (("a", ("data", "fsdp")), ("b", "fsdp"), ("c", None))
    assert sharding.logical_to_spec(("a", "b", "c"), rules) == PartitionSpec(("data", "fsdp"), None, None)
    with pytest.raises(KeyError, match="'zzz' has no entry in mesh.rules"):
        sharding.logical_to_spec(("zzz",), rules)


def test_constrain_is_a_no_op_without_a_mesh():
    x = jnp.ones((2, 3))
    assert sharding.constrain(x, ("act_batch", "act_embed"), tiny.get_config().mesh.rules) is x


@pytest.mark.parametrize("mesh_shape", [{"sequence": 8}, {"data": 2, "tensor": 2, "sequence": 2}])
def test_ring_attention_in_the_model_equals_single_device(reference, mesh_shape):
    """attention_impl='ring' runs the ring over the `sequence` axis inside the sharded model."""
    toks, want = reference[""]
    m, mesh, toks_sharded, got = _sharded("", mesh_shape, toks, attention_impl="ring")
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda t: m(t)[0]).lower(toks_sharded).as_text()
    assert "collective_permute" in hlo or "collective-permute" in hlo  # the ring really ran
    _assert_same(got, want)
