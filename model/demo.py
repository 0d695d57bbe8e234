"""python -m model.demo --config=configs/tiny.py

The model alone, end to end: builds the MoE model sharded over a data/expert/tensor mesh (8 fake CPU
devices on a CPU host), trains it for a few AdamW steps on a synthetic next-token rule (forward + backward,
MoE aux losses included), prints the loss, the expert load and the parameter shardings, then the memory
plan of the same config.
"""

import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import model  # noqa: E402
from model import plan, sharding  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Model config file.")
_MESH = flags.DEFINE_string("mesh", "data:2,expert:2,tensor:2", "Mesh axis sizes, axis:size,...")
_STEPS = flags.DEFINE_integer("steps", 60, "Training steps on the synthetic task.")


def synthetic_batch(key, batch: int, length: int, vocab: int) -> jax.Array:
    """Random starts, then x[t + 1] = (5 x[t] + 3) mod V: a next-token rule the model can learn."""
    start_B = jax.random.randint(key, (batch,), 0, vocab, jnp.int32)

    def step(x_B, _):
        nxt = (5 * x_B + 3) % vocab
        return nxt, x_B

    _, toks_TB = jax.lax.scan(step, start_B, None, length=length)
    return toks_TB.T


def main(argv):
    del argv
    cfg = _CONFIG.value
    cfg.mesh.shape.update(plan.parse_mesh(_MESH.value))
    mesh = sharding.make_mesh(cfg.mesh.shape)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; mesh {dict(mesh.shape)}")
    m = model.build(cfg, mesh=mesh)
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"parameters: {n_params:,}")
    blocks = params["moe_layers"]["blocks"] if m.moe_layers is not None else None
    if blocks is not None:
        print(f"expert gate sharding: {blocks['mlp']['gate'][...].sharding.spec}")
    optimizer = optax.adamw(1e-2, b2=0.98, weight_decay=0.01)

    def loss_fn(params, toks):
        logits, aux = nnx.merge(graphdef, params, rest)(toks)
        return model.next_token_loss(logits, toks) + aux["moe_loss"], aux

    @jax.jit
    def step(params, opt_state, toks):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, toks)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux

    batch_sharding = NamedSharding(
        mesh, sharding.logical_to_spec(("act_batch", "act_length"), cfg.mesh.rules)
    )
    with jax.set_mesh(mesh):
        opt_state = optimizer.init(params)
        t0 = time.perf_counter()
        for i in range(_STEPS.value):
            key = jax.random.key(i)
            toks = synthetic_batch(key, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size)
            params, opt_state, loss, aux = step(params, opt_state, jax.device_put(toks, batch_sharding))
            if i % 15 == 0 or i == _STEPS.value - 1:
                load = aux.get("expert_load")
                load_txt = "" if load is None else f"  expert load (layer 0): {jnp.round(load[0], 2)}"
                print(f"step {i:3d}  loss {float(loss):.3f}{load_txt}")
        print(f"{_STEPS.value} steps in {time.perf_counter() - t0:.1f} s (including compilation)")
    print()
    print(plan.format_table(plan.plan(cfg, dict(cfg.mesh.shape), cfg.batch_size, cfg.seq_len)))
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
