"""Hugging Face checkpoints: logit and greedy-decoding parity with `transformers` for every supported
architecture, bit-exact save round trips, sharded loading, and errors that name the tensor. Our models with
shared experts export as Qwen2-MoE (its shared-expert gate stored as zeros, the shared down_proj doubled).

The tiny random models are tests/hf_models.py's, built with `transformers` (torch, CPU) and saved with
`save_pretrained` (the `parity` extra that `make test` installs).
"""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import (
    ARCHS,
    VOCAB,
    assert_logits_and_greedy_match,
    assert_logits_match,
    checkpoints_fixture,
    make_hf,
    sharded_logits,
)
from safetensors.numpy import load_file, save_file

import model
from configs import tiny
from model import sharding
from model.io import hf, hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


checkpoints = checkpoints_fixture(make_hf, ARCHS)


@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_and_greedy_decoding_match_transformers(checkpoints, name):
    path, ref = checkpoints[name]
    _, m = hf.load_model(path)
    assert_logits_and_greedy_match(m, ref, VOCAB)


@pytest.mark.parametrize("name", ["qwen3_moe", "llama3", "qwen2_moe"])
def test_save_round_trip_is_bit_exact(checkpoints, tmp_path, name):
    path, _ = checkpoints[name]
    cfg, params = hf.load(path)
    hf.save(cfg, params, tmp_path / "one")
    hf.save(cfg, params, tmp_path / "sharded", max_shard_bytes=20_000)  # several files and an index
    original = load_file(str(path / "model.safetensors"))
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert sorted(one) == sorted(original)
    for k, v in original.items():
        assert one[k].dtype == v.dtype and one[k].tobytes() == v.tobytes(), k
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(original)
    assert len(set(index["weight_map"].values())) > 1
    _, params2 = hf.load(tmp_path / "sharded")
    chex.assert_trees_all_equal(nnx.to_pure_dict(params2), nnx.to_pure_dict(params))
    exported = json.loads((tmp_path / "one" / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    assert type(loaded).__name__ == exported["architectures"][0]


def test_bf16_checkpoint_loads_in_bf16_and_saves_bit_exact(tmp_path):
    make_hf("qwen3_moe", tmp_path / "bf16", dtype=torch.bfloat16)
    cfg, params = hf.load(tmp_path / "bf16")
    assert cfg.model.param_dtype == "bfloat16"
    assert nnx.to_flat_state(params)[0][1][...].dtype == jnp.bfloat16
    hf.save(cfg, params, tmp_path / "out")
    a = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    b = load_file(str(tmp_path / "out" / "model.safetensors"))
    for k, v in a.items():
        assert b[k].dtype == v.dtype and b[k].tobytes() == v.tobytes(), k


def test_dtype_argument_casts_on_load(checkpoints):
    path, ref = checkpoints["qwen2"]
    cfg, m = hf.load_model(path, dtype="bfloat16")
    assert cfg.model.param_dtype == cfg.model.compute_dtype == "bfloat16"
    assert m.dense_layers.blocks.attn.q[...].dtype == jnp.bfloat16
    _, m32 = hf.load_model(path)
    toks = jnp.asarray(np.random.RandomState(2).randint(0, VOCAB, (1, 8)))
    # bf16 weights and activations: logits move by about 2^-8 relative to their scale.
    np.testing.assert_allclose(m(toks)[0], m32(toks)[0], atol=0.05 * float(jnp.abs(m32(toks)[0]).max()))


def test_our_model_exports_to_transformers(tmp_path):
    cfg = tiny.get_config()
    cfg.model.moe.num_shared_experts = 0  # Qwen3-MoE has no shared expert
    m = model.build(cfg, seed=3)
    _, params, _ = nnx.split(m, nnx.Param, ...)
    hf.save(cfg, params, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    toks = np.random.RandomState(1).randint(0, cfg.model.vocab_size, (2, 10))
    assert_logits_match(m(jnp.asarray(toks))[0], ref, toks)


def test_our_shared_expert_model_exports_as_qwen2_moe(tmp_path):
    """configs/tiny.py's MoE (its shared expert) without qk_norm, which Qwen2-MoE lacks, with two shared
    experts (one SwiGLU of twice the width in the file) and a dense first layer: transformers' logits are
    ours, the file holds zero gates (sigmoid 1/2) beside a doubled shared down_proj and zero q/k/v biases, and
    our loader gives back every parameter bit for bit (the biases as zeros: Qwen2-MoE always has them)."""
    cfg = tiny.get_config()
    m = cfg.model
    m.qk_norm, m.moe.num_shared_experts, m.moe.first_dense_layers = False, 2, 1
    net = model.build(cfg, seed=3)
    _, params, _ = nnx.split(net, nnx.Param, ...)
    hf.save(cfg, params, tmp_path / "out")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(ref).__name__ == "Qwen2MoeForCausalLM"
    toks = np.random.RandomState(1).randint(0, m.vocab_size, (2, 10))
    assert_logits_match(net(jnp.asarray(toks))[0], ref, toks)

    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    ours = nnx.to_pure_dict(params)
    shared = ours["moe_layers"]["blocks"]["mlp"]["shared"]  # [L, ...] (scanned), the MoE layer is HF layer 1
    mlp = "model.layers.1.mlp."
    assert tensors[mlp + "shared_expert.down_proj.weight"].shape == (m.d_model, 2 * m.moe.shared_d_ff)
    np.testing.assert_array_equal(tensors[mlp + "shared_expert.down_proj.weight"], 2 * shared["down"][0].T)
    np.testing.assert_array_equal(tensors[mlp + "shared_expert.up_proj.weight"], shared["up"][0].T)
    np.testing.assert_array_equal(tensors[mlp + "shared_expert_gate.weight"], np.zeros((1, m.d_model)))
    assert not any(k.startswith("model.layers.0.mlp.shared") for k in tensors)  # the dense layer
    for layer in range(m.num_layers):
        for x in "qkv":
            assert not tensors[f"model.layers.{layer}.self_attn.{x}_proj.bias"].any()

    cfg2, params2 = hf.load(tmp_path / "out")
    assert cfg2.model.attention_bias and (cfg2.model.moe.num_shared_experts, cfg2.model.moe.shared_d_ff) == (
        1,
        128,
    )
    before, after = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(params2))
    for path, var in before.items():
        assert np.asarray(after[path][...]).tobytes() == np.asarray(var[...]).tobytes(), path
    extra = set(after) - set(before)
    assert {p[-1] for p in extra} == {"q_bias", "k_bias", "v_bias"}
    assert not any(np.asarray(after[p][...]).any() for p in extra)
    hf.save(cfg2, params2, tmp_path / "again")
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert sorted(again) == sorted(tensors)
    assert all(again[k].tobytes() == v.tobytes() for k, v in tensors.items())


@pytest.mark.parametrize("arg", ["tiny", "small"])
def test_stock_models_name_the_ways_out_of_an_export(arg):
    """Every stock model has qk_norm and a shared expert, which no supported format holds together."""
    from configs import small

    cfg = (tiny if arg == "tiny" else small).get_config()
    with pytest.raises(ValueError, match="model.qk_norm=False.*Qwen2MoeForCausalLM.*num_shared_experts=0"):
        hf_config.to_hf(cfg)


def test_load_places_each_parameter_with_its_sharding(checkpoints):
    path, ref = checkpoints["qwen3_moe"]
    shape = {"data": 2, "expert": 2, "tensor": 2}
    full = {a: 1 for a in sharding.MESH_AXES} | shape
    mesh = sharding.make_mesh(full)
    cfg, m = hf.load_model(path, mesh=mesh)
    gate = m.moe_layers.blocks.mlp.gate[...]  # [L, E, D, F]: ('layers', 'exp', 'embed', 'mlp')
    assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "expert", None, "tensor")
    assert gate.addressable_shards[0].data.shape == (2, 2, 32, 12)
    toks = np.random.RandomState(0).randint(0, VOCAB, (4, 8))
    assert_logits_match(sharded_logits(m, cfg, mesh, toks), ref, toks)


def _copy(path, tmp_path, *, edit_tensors=None, edit_config=None):
    out = tmp_path / "edited"
    out.mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_errors_name_the_architecture_or_the_tensor(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3_moe"]
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    bad = _copy(path, tmp_path, edit_config=lambda c: c.update(architectures=["DeepseekV2ForCausalLM"]))
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM is not supported .*DeepSeek-V2 routing"):
        hf.load(bad)

    cases = [
        (lambda t: t.pop(name), "missing 1 tensor.*experts.3.up_proj"),
        (
            lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": np.zeros(3, np.float32)}),
            "shared_expert",
        ),
        (lambda t: t.update({name: np.zeros((3, 3), np.float32)}), f"tensor {name}: shape \\(3, 3\\)"),
        (lambda t: t.update({name: t[name].astype(np.int32)}), f"tensor {name}: dtype I32"),
    ]
    for i, (edit, pattern) in enumerate(cases):
        sub = tmp_path / f"case{i}"
        sub.mkdir()
        with pytest.raises(ValueError, match=pattern):
            hf.load(_copy(path, sub, edit_tensors=edit))


def test_a_trained_shared_expert_gate_is_refused(checkpoints, tmp_path):
    """Our model has no gate on its shared expert: a Qwen2-MoE checkpoint loads only when the gates are zero
    (refused by read_config too, which rl.init_from's checks use), and one must be there."""
    path, _ = checkpoints["qwen2_moe"]
    gate = "model.layers.1.mlp.shared_expert_gate.weight"
    (tmp_path / "trained").mkdir()
    (tmp_path / "no_gate").mkdir()
    trained = _copy(path, tmp_path / "trained", edit_tensors=lambda t: t.update({gate: t[gate] + 0.01}))
    for read in (hf.load, hf.read_config):
        with pytest.raises(ValueError, match=f"{gate} is not zero: our model has no gated shared expert"):
            read(trained)
    with pytest.raises(ValueError, match=f"missing {gate}"):
        hf.load(_copy(path, tmp_path / "no_gate", edit_tensors=lambda t: t.pop(gate)))
