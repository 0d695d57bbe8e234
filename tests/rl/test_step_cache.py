"""The per-process caches of jitted programs: the train, SFT and log-prob steps (`rl.train_step`, keyed on
`step_config`, the graph definition, the mesh and the batch keys) and the sharded model init
(`model.transformer.build`, keyed on the model and mesh sections). A key that misses a field the program
reads would run a program built for another config, so: every field the steps read changes the key; fields
they do not read (the run's length, checkpoints, evaluation, domains without projection) do not; the step
config holds nothing else (a read of another field fails); a second update built from an equal config
traces and compiles nothing; the cached init gives every seed its own parameters, equal to the unsharded
init's."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax import monitoring

from configs import grpo
from model import seeds, sharding
from model import transformer as model
from rl import train_state
from rl import train_step as ts


def _cfg():
    return grpo.get_config("test")


@pytest.fixture(scope="module")
def graph():
    model_def, _ = train_state.init_state(_cfg(), seed=0)
    return model_def


# One changed value per field the steps read (rl.STEP_RL_FIELDS, the model, the mesh).
READ = {
    "rl.micro_batches": 2,
    "rl.optim.lr": 1e-2,
    "rl.optim.weight_decay": 0.5,
    "rl.loss.clip_eps": 0.3,
    "rl.loss.kl_kind": "k3",
    "rl.routing_replay": True,
    "rl.top_k": 5,
    "rl.top_p": 0.9,
    "rl.temperature": 0.7,
    "rl.max_new_tokens": 6,
    "rl.max_turns": 2,
    "rl.mismatch_band": 3.0,
    "model.moe.bias_update_rate": 0.01,
    "model.moe.load_balance_weight": 0.5,
    "mesh.rules": (("batch", None),),
}
# Fields no step reads: equal programs.
UNREAD = {
    "rl.steps": 99,
    "rl.checkpoint_every": 7,
    "rl.seed": 5,
    "rl.sft.steps": 1,
    "rl.eval.k": 9,
    "rl.domains": ("debug", "arith"),  # read only under rl.gradient_projection
    "rl.ppo_epochs": 3,  # reaches the step only through its batch keys (proximal_logp_BT), a key of its own
}


def _with(cfg, dotted: str, value):
    *parents, leaf = dotted.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[leaf] = value
    return cfg


def test_every_read_field_is_in_the_step_config():
    base = ts.step_config(_cfg())
    for dotted, value in READ.items():
        changed = ts.step_config(_with(_cfg(), dotted, value))
        assert changed != base and hash(changed) != hash(base), dotted
    for dotted, value in UNREAD.items():
        assert ts.step_config(_with(_cfg(), dotted, value)) == base, dotted


def test_the_step_config_holds_nothing_else():
    cfg = ts.step_config(_cfg())
    assert set(cfg) == {"model", "mesh", "rl"}
    assert set(cfg.rl) == set(ts.STEP_RL_FIELDS)
    with pytest.raises(AttributeError):
        cfg.rl.steps  # noqa: B018 - the read itself is what fails
    projected = ts.step_config(_with(_with(_cfg(), "rl.gradient_projection", True), "rl.domains", ("a", "b")))
    assert projected.rl.domains == ("a", "b")


def test_steps_are_shared_exactly_when_their_configs_are(graph):
    step = ts.make_train_step(_cfg(), graph)
    assert ts.make_train_step(_with(_cfg(), "rl.steps", 99), graph) is step
    assert ts.make_train_step(_with(_cfg(), "rl.optim.lr", 1e-2), graph) is not step
    # ppo_epochs is not in the step config, but a step of several updates reads the proximal log-probs.
    assert ts.make_train_step(_with(_cfg(), "rl.ppo_epochs", 2), graph) is not step
    sft = ts.make_sft_step(_cfg(), graph)
    assert sft is not step and ts.make_sft_step(_with(_cfg(), "rl.eval.k", 9), graph) is sft
    # Another model: another graph definition, another step.
    other, _ = train_state.init_state(_with(_cfg(), "model.d_ff", 64), seed=0)
    assert ts.make_train_step(_with(_cfg(), "model.d_ff", 64), other) is not step
    # Another mesh.
    mesh = sharding.make_mesh({"data": 8})
    assert ts.make_train_step(_cfg(), graph, mesh=mesh) is not step


def test_a_second_update_traces_and_compiles_nothing(graph):
    """Two GRPO updates (KL, 2 PPO epochs: reference, proximal and train programs) from configs that differ
    only in fields no step reads: the second compiles nothing, and gives the same result."""
    cfg = _with(_with(_cfg(), "rl.loss.kl_kind", "k3"), "rl.ppo_epochs", 2)
    cfg.rl.loss.kl_coef = 0.1
    _, state = train_state.init_state(cfg, seed=0)
    rows, length = 8, cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
    rng = np.random.default_rng(0)
    mask = np.zeros((rows, length), np.float32)
    mask[:, cfg.rl.max_prompt_len :] = 1
    batch = {
        "tokens_BT": rng.integers(0, 256, (rows, length)).astype(np.int32),
        "positions_BT": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
        "mask_BT": mask,
        "advantages_B": np.linspace(-1, 1, rows).astype(np.float32),
        "behaviour_logp_BT": (-5.0 * mask).astype(np.float32),
    }
    copy = lambda s: jax.tree.map(lambda x: x.copy(), s)  # noqa: E731
    first, m1 = ts.make_grpo_update(cfg, graph)(copy(state), batch, ref_params=state.params)
    events = []
    listener = lambda event, secs, **kw: events.append(event)  # noqa: E731
    monitoring.register_event_duration_secs_listener(listener)
    try:
        again = _with(_with(cfg.copy_and_resolve_references(), "rl.steps", 99), "rl.checkpoint_every", 7)
        second, m2 = ts.make_grpo_update(again, graph)(copy(state), batch, ref_params=state.params)
    finally:
        monitoring.unregister_event_duration_listener(listener)
    compiled = [e for e in events if e.endswith(("jaxpr_trace_duration", "backend_compile_duration"))]
    assert compiled == []
    assert m1["updates"] == m2["updates"] == 2.0
    np.testing.assert_array_equal(jax.tree.leaves(first.params)[0], jax.tree.leaves(second.params)[0])
    assert float(np.abs(jax.tree.leaves(first.params)[0] - jax.tree.leaves(state.params)[0]).max()) > 0


def test_the_cached_sharded_init_gives_each_seed_its_own_unsharded_values():
    """The sharded init equals the unsharded init of the same seed, both jitted (one program each: eager
    and jitted inits round some values 1 ulp apart, so the reference is jitted too, as build's was)."""
    cfg = _cfg()
    mesh = sharding.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    cfg.mesh.shape.update({"data": 2, "expert": 2, "tensor": 2})
    unsharded = jax.jit(lambda key: nnx.state(model.Transformer(cfg, rngs=nnx.Rngs(params=key)), nnx.Param))
    by_seed = {}
    for seed in (0, 3):
        sharded = nnx.state(model.build(cfg, seed=seed, mesh=mesh), nnx.Param)
        single = unsharded(seeds.key(seed))
        for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        by_seed[seed] = [np.asarray(x) for x in jax.tree.leaves(single)]
    assert all(not np.array_equal(a, b) for a, b in zip(by_seed[0], by_seed[3], strict=True) if a.std() > 0)
    assert any(
        len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
        for leaf in jax.tree.leaves(nnx.state(model.build(cfg, seed=0, mesh=mesh), nnx.Param))
    )
