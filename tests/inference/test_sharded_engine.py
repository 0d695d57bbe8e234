"""inference.Engine on a mesh of the 8 fake CPU devices against the one-device engine, and weight sync.

The tiny MoE model (4 experts, 4 query / 2 kv heads) on data 4 x tensor 2 and on data 2 x expert 2 x
tensor 2: greedy tokens and T=1 samples equal the one-device engine's, log-probs within `LOGP_ATOL`, no
compile after warmup. `inference.weight_sync`: the trainer's FSDP-sharded params reach the engine exactly,
on the same devices and across two disjoint halves of them, without a host round trip; a delta sync sends
exactly the leaves that changed beyond the threshold (by hand).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_checks import prompts as _prompts
from engines import small_engine, tiny_target
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import model
from configs import tiny
from inference import layout, weight_sync
from inference.engine import Engine
from inference.sampling import SamplingParams
from model import sharding

# Small sizes: one prefill length bucket (contexts past 16 tokens are prefilled in chunks), two row buckets.
ECFG = small_engine(max_seq_len=64, num_pages=64, prefill_chunk=16, score_batch=2)
SCORE_LENGTHS = (32,)
# The sharded forward adds the same f32 terms in another order (tensor-parallel partial sums, then an
# all-reduce): a sum of n <= 128 terms may move by ~n * 2**-24 of its magnitude, ~1e-5 of the O(1) logits
# and log-probs here (measured: at most 2.2e-6).
LOGP_ATOL = 1e-5
MESHES = {
    "data4_tensor2": {"data": 4, "tensor": 2},
    "data2_expert2_tensor2": {"data": 2, "expert": 2, "tensor": 2},
}


@pytest.fixture(scope="module")
def target():
    cfg, _, params = tiny_target()
    return cfg, params


@pytest.fixture(scope="module")
def reference(target):
    cfg, params = target
    eng = Engine(cfg, params, ECFG)
    eng.warmup(score_lengths=SCORE_LENGTHS)
    return eng


@pytest.fixture(scope="module", params=list(MESHES))
def sharded(request, target):
    cfg, params = target
    eng = Engine(cfg, params, ECFG, mesh=sharding.make_mesh(MESHES[request.param]))
    eng.warmup(score_lengths=SCORE_LENGTHS)
    return eng


@pytest.fixture(scope="module")
def tp_mesh():
    return sharding.make_mesh(MESHES["data4_tensor2"])


def _trainer_params(cfg, seed, devices):
    """Params as the trainer holds them: built on an FSDP mesh of `devices` with the training rules."""
    m = model.build(cfg, seed=seed, mesh=sharding.make_mesh({"fsdp": len(devices)}, devices))
    return nnx.state(m, nnx.Param)


def _assert_weights_equal(eng, params):
    for got, want in zip(jax.tree.leaves(eng.params), jax.tree.leaves(params)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _assert_in_engine_layout(eng, shardings):
    for a, s in zip(jax.tree.leaves(eng.params), jax.tree.leaves(shardings)):
        assert a.sharding == s


def _received_bytes(src, dst, shape, itemsize) -> int:
    """Independent of `weight_sync.moved_bytes`: per destination device, the elements of its block that
    the same device does not hold under `src`, counted with boolean masks."""
    held = src.devices_indices_map(shape)
    total = 0
    for device, index in dst.devices_indices_map(shape).items():
        want = np.zeros(shape, bool)
        want[index] = True
        have = np.zeros(shape, bool)
        if device in held:
            have[held[device]] = True
        total += int((want & ~have).sum())
    return total * itemsize


# --- Layout -----------------------------------------------------------------------------------------------


def test_inference_rules_drop_fsdp_from_weights_only():
    rules = dict(layout.inference_rules(tiny.get_config().mesh.rules))
    assert rules["embed"] is None  # training: fsdp
    assert (rules["heads"], rules["kv_heads"], rules["mlp"], rules["vocab"]) == ("tensor",) * 4
    assert rules["exp"] == "expert"
    assert rules["act_batch"] == ("data", "fsdp", "expert")  # rows still spread over the data axes
    assert rules["act_length"] is None  # training: sequence
    mixed = dict(layout.inference_rules((("mlp", ("fsdp", "tensor")), ("act_tokens", ("data", "fsdp")))))
    assert mixed == {"mlp": "tensor", "act_tokens": ("data", "fsdp")}


def test_pages_split_over_tensor_only_when_kv_heads_divide():
    pages = {"k": None, "v": None, "latent": None, "experts": None}
    mesh = sharding.make_mesh({"data": 4, "tensor": 2})
    specs = {k: s.spec for k, s in layout.page_shardings(pages, mesh, kv_heads=2).items()}
    assert specs == {"k": PartitionSpec("tensor"), "v": PartitionSpec("tensor")} | {
        "latent": PartitionSpec(),
        "experts": PartitionSpec(),
    }
    mesh4 = sharding.make_mesh({"data": 2, "tensor": 4})
    assert all(s.spec == PartitionSpec() for s in layout.page_shardings(pages, mesh4, kv_heads=2).values())


def test_weights_follow_the_inference_rules_and_replicate_what_does_not_divide():
    cfg = tiny.get_config()
    abstract = nnx.eval_shape(lambda: model.Transformer(layout.inference_config(cfg), rngs=nnx.Rngs(0)))
    abstract = nnx.state(abstract, nnx.Param)
    rules = layout.inference_rules(cfg.mesh.rules)
    spec = lambda mesh, path: dict(
        (jax.tree_util.keystr(p), s.spec)
        for p, s in jax.tree_util.tree_leaves_with_path(layout.weight_shardings(abstract, mesh, rules))
    )[path]
    mesh = sharding.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    attn, mlp = "['moe_layers']['blocks']['attn']", "['moe_layers']['blocks']['mlp']"
    assert spec(mesh, attn + "['q'].value") == PartitionSpec(None, None, "tensor", None)  # [L, D, N, H]
    assert spec(mesh, attn + "['k'].value") == PartitionSpec(None, None, "tensor", None)  # [L, D, K, H]
    assert spec(mesh, mlp + "['gate'].value") == PartitionSpec(None, "expert", None, "tensor")  # [L, E, D, F]
    assert spec(mesh, "['embed']['embedding'].value") == PartitionSpec("tensor", None)  # [V, D]: no fsdp
    mesh4 = sharding.make_mesh({"data": 2, "tensor": 4})  # 2 kv heads over 4: each kv head whole
    assert spec(mesh4, attn + "['k'].value") == PartitionSpec(None, None, None, None)
    assert spec(mesh4, attn + "['q'].value") == PartitionSpec(None, None, "tensor", None)


def test_engine_refuses_a_sequence_axis(target):
    cfg, params = target
    with pytest.raises(ValueError, match="sequence=2"):
        Engine(cfg, params, ECFG, mesh=sharding.make_mesh({"data": 4, "sequence": 2}))


def test_moved_bytes_by_hand():
    devices = np.asarray(jax.devices())
    axes = sharding.MESH_AXES
    fsdp8 = Mesh(devices.reshape(1, 8, 1, 1, 1), axes)
    tp = Mesh(devices.reshape(4, 1, 1, 2, 1), axes)
    src = NamedSharding(fsdp8, PartitionSpec("fsdp"))  # [8, 4]: device i holds row i
    dst = NamedSharding(
        tp, PartitionSpec(None, "tensor")
    )  # device (a, b) = 2a + b: all rows, columns 2b..2b+1
    # Each device needs 8 x 2 = 16 elements and already holds 2 of them (its row, its two columns): 14 x 8
    # devices x 4 bytes.
    assert weight_sync.moved_bytes(src, dst, (8, 4), 4) == 14 * 8 * 4
    assert weight_sync.moved_bytes(dst, dst, (8, 4), 4) == 0
    # Rows over devices 0-3, the engine on 4-7 (disjoint): every block travels, 16 elements x 4 devices.
    first_half = NamedSharding(Mesh(devices[:4].reshape(1, 4, 1, 1, 1), axes), PartitionSpec("fsdp"))
    second_half = NamedSharding(Mesh(devices[4:].reshape(2, 1, 1, 2, 1), axes), PartitionSpec(None, "tensor"))
    assert weight_sync.moved_bytes(first_half, second_half, (8, 4), 4) == 16 * 4 * 4
    assert weight_sync.moved_bytes(None, second_half, (8, 4), 4) == 16 * 4 * 4  # from the host


# --- Decoding on a mesh equals one device -------------------------------------------------------------------


def test_weights_and_pages_are_placed_by_the_layout(sharded):
    k = sharded.kv["k"]  # [L * K, P, S, H] = [4, 64, 8, 16], 2 kv heads over tensor 2
    assert k.sharding.spec == PartitionSpec("tensor")
    assert {s.data.shape for s in k.addressable_shards} == {(2, 64, 8, 16)}
    assert len(k.sharding.device_set) == 8
    q = sharded.params["moe_layers"]["blocks"]["attn"]["q"][...]  # [L, D, N, H] = [2, 64, 4, 16]
    assert {s.data.shape for s in q.addressable_shards} == {(2, 64, 2, 16)}


def test_greedy_equals_one_device(reference, sharded):
    # A one-token prompt (nothing to prefill), page boundaries (8, 9), chunked prefills (17, 40 > 16).
    prompts = _prompts(0, [1, 8, 9, 17, 40])
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, n=2)
    want, got = reference.generate(prompts, sp), sharded.generate(prompts, sp)
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=LOGP_ATOL)
        assert g.logprobs == [0.0] * 12


def test_sampling_at_temperature_one_gives_the_same_tokens(reference, sharded):
    # Each token's key is (seed, request, sample, step), and threefry bits do not depend on the layout.
    prompts = _prompts(1, [5, 23])
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=7)
    want, got = reference.generate(prompts, sp), sharded.generate(prompts, sp)
    assert len({tuple(c.tokens) for c in want}) > 3  # really sampled
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=LOGP_ATOL)
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=LOGP_ATOL)


def test_score_equals_one_device(reference, sharded):
    prompts = _prompts(2, [3, 11])
    completions = _prompts(3, [20, 9])
    sp = SamplingParams(temperature=0.8, top_k=30)
    for w, g in zip(reference.score(prompts, completions, sp), sharded.score(prompts, completions, sp)):
        np.testing.assert_allclose(g, w, atol=LOGP_ATOL)


def test_no_recompiles_after_warmup_on_the_mesh(target, sharded):
    cfg, params = target
    rng = np.random.default_rng(4)
    for i in range(4):
        sp = SamplingParams(
            temperature=float(rng.choice([0.0, 0.7])),
            top_p=float(rng.choice([1.0, 0.9])),
            max_new_tokens=int(rng.integers(1, 20)),
            n=int(rng.choice([1, 3])),
            seed=i,
        )
        sharded.generate(_prompts(10 + i, rng.integers(1, 40, int(rng.integers(1, 4)))), sp)
    sharded.score(_prompts(20, [4]), _prompts(21, [20]))  # the 32-token bucket
    sharded.update_params(jax.tree.map(lambda a: a * 1.01, params))
    sharded.generate(_prompts(22, [13]), SamplingParams(max_new_tokens=4))
    assert sharded.stats()["compiles_after_warmup"] == 0


def test_decode_steps_on_the_mesh_give_the_same_tokens(target, reference, tp_mesh):
    # engine.decode_steps: the while_loop of decode steps under the mesh's shardings (one call per 4 tokens).
    cfg, params = target
    eng = Engine(cfg, params, dataclasses.replace(ECFG, decode_steps=4), mesh=tp_mesh)
    eng.warmup()
    prompts = _prompts(15, [6, 19, 2])
    sp = SamplingParams(temperature=1.0, max_new_tokens=11, n=2, seed=9)
    want, got = reference.generate(prompts, sp), eng.generate(prompts, sp)
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=LOGP_ATOL)
    assert eng.stats()["decode_calls"] == 2 * 3  # 6 sequences in 4 slots: two waves of ceil(11 / 4) calls
    assert eng.stats()["compiles_after_warmup"] == 0


def test_host_tier_on_the_mesh_keeps_the_pages_sharded(target, reference, tp_mesh):
    cfg, params = target
    eng = Engine(cfg, params, dataclasses.replace(ECFG, host_cache_pages=32), mesh=tp_mesh)
    eng.warmup()
    prompts = _prompts(14, [41, 26])
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=4)
    first = eng.generate(prompts, sp)
    assert eng.offload_prefix(64) > 0
    second = eng.generate(prompts, sp)
    assert eng.stats()["prefix_cache"]["reloads"] > 0
    want = [c.tokens for c in reference.generate(prompts, sp)]
    assert [c.tokens for c in first] == [c.tokens for c in second] == want
    assert eng.kv["k"].sharding.spec == PartitionSpec("tensor")
    assert eng.stats()["compiles_after_warmup"] == 0


# --- Weight sync --------------------------------------------------------------------------------------------


def test_colocated_sync_from_fsdp_params_is_exact_and_compiles_nothing(target, reference, tp_mesh):
    cfg, _ = target
    devices = list(tp_mesh.devices.flat)
    trainer = _trainer_params(cfg, 1, devices)
    assert trainer["embed"]["embedding"][...].sharding.spec == PartitionSpec(None, "fsdp")
    eng = Engine(cfg, trainer, ECFG, mesh=tp_mesh)  # the trainer's layout, resharded once here
    eng.warmup()
    layout_now = jax.tree.map(lambda a: a.sharding, eng.params)
    new = jax.jit(lambda t: jax.tree.map(lambda a: a * 0.5 + 0.25, t))(trainer)  # still FSDP-sharded
    metrics = weight_sync.WeightSync(eng, "colocated").push(new)
    _assert_weights_equal(eng, new)
    _assert_in_engine_layout(eng, layout_now)
    leaves = jax.tree.leaves(new)
    want = sum(
        _received_bytes(a.sharding, s, a.shape, a.dtype.itemsize)
        for a, s in zip(leaves, jax.tree.leaves(layout_now))
    )
    assert metrics["sync/bytes"] == want > 0
    assert metrics["sync/leaves_sent"] == metrics["sync/leaves"] == len(leaves)
    assert eng.stats()["compiles_after_warmup"] == 0
    # The engine decodes with them: the one-device engine over the same values agrees.
    same = Engine(cfg, jax.tree.map(jnp.asarray, jax.device_get(new)), ECFG)
    prompts, sp = _prompts(5, [6, 19]), SamplingParams(temperature=0.0, max_new_tokens=8)
    assert [c.tokens for c in eng.generate(prompts, sp)] == [c.tokens for c in same.generate(prompts, sp)]
    with pytest.raises(ValueError, match="mode='disaggregated'"):
        weight_sync.WeightSync(eng, "colocated").push(_trainer_params(cfg, 1, devices[:4]))


def test_disaggregated_sync_between_disjoint_devices_is_exact(target, monkeypatch):
    cfg, _ = target
    devices = jax.devices()
    trainer = _trainer_params(cfg, 2, devices[:4])
    eng = Engine(cfg, trainer, ECFG, mesh=sharding.make_mesh({"data": 2, "tensor": 2}, devices[4:]))
    assert eng.devices == set(devices[4:])
    layout_now = jax.tree.map(lambda a: a.sharding, eng.params)
    new = jax.jit(lambda t: jax.tree.map(lambda a: a - 0.125, t))(trainer)
    # No host round trip: a spy on the real host read of a device array (`ArrayImpl._value`, what
    # `np.asarray` and a resharding `device_put` go through); the control shows it sees one.
    first = jax.tree.leaves(new)[0]
    array_type, reads = type(first), []
    read = array_type.__dict__["_value"].fget
    monkeypatch.setattr(array_type, "_value", property(lambda a: reads.append(a.shape) or read(a)))
    metrics = weight_sync.WeightSync(eng, "disaggregated").push(new)
    jax.block_until_ready(eng.params)
    assert reads == []
    jax.device_put(first, jax.tree.leaves(layout_now)[0]).block_until_ready()  # control: a plain put
    assert first.shape in reads
    monkeypatch.undo()
    _assert_weights_equal(eng, new)
    _assert_in_engine_layout(eng, layout_now)
    # Nothing is on the engine's devices beforehand: every block of every engine device travels.
    want = sum(
        _received_bytes(a.sharding, s, a.shape, a.dtype.itemsize)
        for a, s in zip(jax.tree.leaves(new), jax.tree.leaves(layout_now))
    )
    total = sum(sum(s.data.nbytes for s in a.addressable_shards) for a in jax.tree.leaves(eng.params))
    assert metrics["sync/bytes"] == want == total
    same = Engine(cfg, jax.tree.map(jnp.asarray, jax.device_get(new)), ECFG)
    prompts, sp = _prompts(6, [7]), SamplingParams(temperature=0.0, max_new_tokens=6)
    assert eng.generate(prompts, sp)[0].tokens == same.generate(prompts, sp)[0].tokens
    # A delta sync across the two halves: after the first push, only the doubled unembedding travels.
    delta = weight_sync.WeightSync(eng, "disaggregated", delta_threshold=0.0)
    assert delta.push(new)["sync/leaves_sent"] == len(jax.tree.leaves(new))
    doubled = jax.tree.map(lambda a: a, new)
    doubled["unembed"] = doubled["unembed"].replace(new["unembed"][...] * 2)
    m = delta.push(doubled)
    unembed, target = doubled["unembed"][...], jax.tree.leaves(layout_now["unembed"])[0]
    assert m["sync/leaves_sent"] == 1
    assert m["sync/bytes"] == _received_bytes(unembed.sharding, target, unembed.shape, 4)
    _assert_weights_equal(eng, doubled)
    with pytest.raises(ValueError, match="mode='colocated'"):
        weight_sync.WeightSync(eng, "disaggregated").push(jax.device_put(new, layout_now))


def test_delta_sync_sends_only_what_changed_beyond_the_threshold(target, tp_mesh):
    cfg, _ = target
    p0 = _trainer_params(cfg, 3, list(tp_mesh.devices.flat))
    eng = Engine(cfg, p0, ECFG, mesh=tp_mesh)
    layout_now = jax.tree.map(lambda a: a.sharding, eng.params)
    sync = weight_sync.WeightSync(eng, "colocated", delta_threshold=0.1)
    first = sync.push(p0)  # nothing sent before: everything goes
    assert first["sync/leaves_sent"] == first["sync/leaves"]
    _assert_weights_equal(eng, p0)
    eng.warmup()  # steps shared with the data4_tensor2 engine above; later pushes must compile nothing

    def changed(params, unembed=0.0, norm=0.0):
        """`unembed[0, 0]` moved by `unembed` and every final-norm scale by `norm`; the rest as is."""
        out = jax.tree.map(lambda a: a, params)
        out["unembed"] = out["unembed"].replace(out["unembed"][...].at[0, 0].add(unembed))
        out["final_norm"]["scale"] = out["final_norm"]["scale"].replace(
            out["final_norm"]["scale"][...] + norm
        )
        return out

    # 0.5 > 0.1: unembed goes; 0.01 <= 0.1: the norm stays as sent (its change is reported).
    p1 = changed(p0, unembed=0.5, norm=0.01)
    m1 = sync.push(p1)
    assert m1["sync/leaves_sent"] == 1
    unembed = p1["unembed"][...]
    target = jax.tree.leaves(layout_now["unembed"])[0]
    assert m1["sync/bytes"] == _received_bytes(unembed.sharding, target, unembed.shape, 4)
    assert abs(m1["sync/max_unsent_change"] - 0.01) < 1e-6
    np.testing.assert_array_equal(np.asarray(eng.params["unembed"][...]), np.asarray(unembed))
    np.testing.assert_array_equal(
        np.asarray(eng.params["final_norm"]["scale"][...]), np.asarray(p0["final_norm"]["scale"][...])
    )
    # Another 0.095 on the norm: 0.105 since it was last sent > 0.1, so it goes now (unembed did not move).
    p2 = changed(p1, norm=0.095)
    m2 = sync.push(p2)
    assert m2["sync/leaves_sent"] == 1
    _assert_weights_equal(eng, p2)
    _assert_in_engine_layout(eng, layout_now)
    # Nothing changed: nothing sent.
    m3 = sync.push(p2)
    assert (m3["sync/leaves_sent"], m3["sync/bytes"], m3["sync/max_unsent_change"]) == (0, 0, 0.0)
    assert eng.stats()["compiles_after_warmup"] == 0
