"""model.moe.local: each batch shard's own dispatch equals the global ragged dispatch (outputs, gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.base import DEFAULT_RULES
from model.moe import local as moe_local
from model.moe.dispatch import ragged_dispatch
from model.sharding import make_mesh


@pytest.mark.parametrize("shape", [{"data": 4, "fsdp": 2}, {"data": 8}])
def test_local_dispatch_equals_global(shape):
    b, t, d, f, n, k = 8, 6, 16, 12, 4, 2
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (b, t, d))
    idx = jax.random.randint(keys[1], (b, t, k), 0, n).at[0].set(0)  # a skewed load: expert 0 gets more
    w = jax.nn.softmax(jax.random.normal(keys[2], (b, t, k)), -1)
    gate, up = (jax.random.normal(kk, (n, d, f)) * d**-0.5 for kk in keys[3:5])
    down = jax.random.normal(keys[5], (n, f, d)) * f**-0.5

    def global_loss(x, gate, up, down):
        y = ragged_dispatch(x.reshape(b * t, d), idx.reshape(b * t, k), w.reshape(b * t, k), gate, up, down)
        return jnp.sum(jnp.sin(y)), y.reshape(b, t, d)

    mesh = make_mesh(shape)
    assert moe_local.applies(DEFAULT_RULES, dict(mesh.shape), b)

    def local_loss(x, gate, up, down):
        y = moe_local.local_ragged(x, idx, w, gate, up, down, DEFAULT_RULES)
        return jnp.sum(jnp.sin(y)), y

    (l0, y0), g0 = jax.jit(jax.value_and_grad(global_loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, gate, up, down
    )
    with jax.set_mesh(mesh):
        (l1, y1), g1 = jax.jit(jax.value_and_grad(local_loss, argnums=(0, 1, 2, 3), has_aux=True))(
            x, gate, up, down
        )
    # f32, the same sums per token; the weight gradients add 8 shards' partial sums in another order.
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), atol=1e-5, rtol=1e-5)
    for a, c in zip(g1, g0, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-4, rtol=1e-4)
    assert abs(float(l1) - float(l0)) < 1e-3
