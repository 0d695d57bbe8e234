"""DeepSeek-V3 / Kimi K2 architecture against `transformers`' DeepseekV3ForCausalLM: logits (also on a
left-padded batch) and 20 greedy tokens through our KV cache (MLA's absorbed form), for geometries with
and without the query low-rank path, one and several expert groups, one and several dense first layers,
YaRN with DeepSeek's softmax-scale correction; the same greedy tokens from `inference.Engine`, which carries
the routers' selection bias beside the parameters (also through `update_params`); bit-exact save round
trips; FP8 block-quantized weights dequantized on load against a hand-computed block; a checkpoint whose
config.json counts an MTP module its files lack (as transformers writes one) loads without MTP modules.
"""

import copy
import json
import logging
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hf_models import (
    DEEPSEEK_VOCAB,
    GEOMETRIES,
    assert_logits_and_greedy_match,
    assert_logits_match,
    checkpoints_fixture,
    make_deepseek,
    randomize_selection_bias,
    sharded_logits,
)
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file

from inference import Engine, EngineConfig, SamplingParams
from model import sharding
from model.io import hf
from model.moe.layer import ExpertBias

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = DEEPSEEK_VOCAB


checkpoints = checkpoints_fixture(make_deepseek, GEOMETRIES)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_logits_and_greedy_decoding_match_transformers(checkpoints, name):
    path, ref = checkpoints[name]
    cfg, m = hf.load_model(path)
    assert cfg.model.attention_kind == "mla"
    assert cfg.model.moe.n_group == GEOMETRIES[name]["n_group"]
    assert_logits_and_greedy_match(m, ref, VOCAB)


def _hf_greedy_choices(net, prompt_BT, tokens_BT) -> list[list[int]]:
    """transformers' argmax at each generated position, teacher-forced on prompt + tokens: equal to
    `tokens` exactly when they are its greedy continuation. (Its own `generate` is not the reference here:
    with a random selection bias its cached and full forwards can route a near-tied token differently.)"""
    seq = np.concatenate([prompt_BT, np.asarray(tokens_BT)], axis=1)
    with torch.no_grad():
        logits = net(torch.tensor(seq)).logits.numpy()
    return logits[:, prompt_BT.shape[1] - 1 : -1].argmax(-1).tolist()


def test_engine_carries_the_selection_bias(checkpoints, tmp_path):
    """The sigmoid router's e_score_correction_bias is model state, not an nnx.Param: the engine takes it
    with the parameters (a Param-only state is refused) and decodes transformers' greedy tokens, keeps it
    when `update_params` gets Params only, and switches to a new one passed with them, without compiling."""
    path, ref = checkpoints["qlora_groups"]
    cfg, m = hf.load_model(path)
    ecfg = EngineConfig(
        max_batch=2, max_seq_len=32, page_size=4, num_pages=40, prefill_chunk=8, prefill_batch=2, min_bucket=8
    )
    with pytest.raises(ValueError, match="sigmoid router"):
        Engine(cfg, nnx.state(m, nnx.Param), ecfg)
    engine = Engine(cfg, m, ecfg)
    engine.warmup()
    prompt = np.random.RandomState(1).randint(0, VOCAB, (2, 6))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    decode = lambda: [c.tokens for c in engine.generate(prompt.tolist(), greedy)]
    first = decode()
    assert first == _hf_greedy_choices(ref, prompt, first)

    engine.update_params(nnx.state(m, nnx.Param))  # the same weights, no bias given: the bias stays
    assert decode() == first

    # Another bias, written into a transformers copy and a checkpoint of it, loaded with the Params.
    other = copy.deepcopy(ref)
    randomize_selection_bias(other)
    other.save_pretrained(tmp_path)
    _, state = hf.load(tmp_path, variables=(nnx.Param, ExpertBias))
    engine.update_params(state)
    second = decode()
    assert second != first  # the bias changes the routing enough to change the greedy text
    assert second == _hf_greedy_choices(other, prompt, second)
    assert engine.stats()["compiles_after_warmup"] == 0


def test_checkpoint_without_mtp_tensors_loads_without_mtp_modules(tmp_path, caplog):
    """transformers' `save_pretrained` writes num_nextn_predict_layers=1 (its default) but no MTP layer, as
    most DeepSeek-V3 / Kimi K2 fine-tunes are stored: the model loads without MTP modules (one warning says
    so) and computes transformers' logits, and the main job refuses at start what needs MTP modules."""
    from configs import grpo
    from configs.schema import ConfigError
    from rl import validate

    net = make_deepseek("qlora_groups", tmp_path, selection_bias=False, num_mtp_layers=1)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    layers = net.config.num_hidden_layers
    assert not any(
        k.startswith(f"model.layers.{layers}.") for k in load_file(str(tmp_path / "model.safetensors"))
    )

    with caplog.at_level(logging.WARNING, logger="model.io.hf"):
        cfg, m = hf.load_model(tmp_path)
    assert cfg.model.mtp_layers == 0 and cfg.model.num_layers == layers and not hasattr(m, "mtp")
    said = [r.getMessage() for r in caplog.records if "num_nextn_predict_layers" in r.getMessage()]
    assert len(said) == 1 and "hold 0; loading model.mtp_layers=0" in said[0], said
    toks = np.random.RandomState(0).randint(0, VOCAB, (2, 12))
    assert_logits_match(m(jnp.asarray(toks))[0], net, toks)

    for field, value in (("sft.mtp_weight", 0.5), ("engine.draft", "mtp")):
        run = grpo.get_config("test")
        run.rl.init_from = str(tmp_path)
        parent, leaf = field.split(".")
        run.rl[parent][leaf] = value
        with pytest.raises(ConfigError, match=re.escape(f"rl.{field}={value!r}") + ".* has no MTP tensors"):
            validate.validate(run)


@pytest.mark.parametrize("name", ["qlora_groups", "no_qlora"])
def test_save_round_trip_is_bit_exact(checkpoints, tmp_path, name):
    path, _ = checkpoints[name]
    cfg, state = hf.load(path, variables=(nnx.Param, ExpertBias))
    hf.save(cfg, state, tmp_path / "one")
    original = load_file(str(path / "model.safetensors"))
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert sorted(one) == sorted(original)
    for k, v in original.items():
        assert one[k].dtype == v.dtype and one[k].tobytes() == v.tobytes(), k
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"


def test_fp8_block_quantized_weights_dequantize_on_load(checkpoints, tmp_path):
    """A checkpoint written as DeepSeek ships it: e4m3 weights with `weight_scale_inv` per 4x4 block (the
    test's block size; DeepSeek's is 128x128). One block is checked against a value computed by hand."""
    path, _ = checkpoints["qlora_groups"]
    tensors = load_file(str(path / "model.safetensors"))
    block = 4
    out = {}
    for name, w in tensors.items():
        if name.endswith("proj.weight") and w.ndim == 2:
            o, i = w.shape
            nb_o, nb_i = -(-o // block), -(-i // block)
            scale = np.ones((nb_o, nb_i), np.float32)
            for bo in range(nb_o):
                for bi in range(nb_i):
                    blk = w[bo * block : (bo + 1) * block, bi * block : (bi + 1) * block]
                    scale[bo, bi] = np.abs(blk).max() / 448.0  # e4m3's largest finite value
            q = (w / np.repeat(np.repeat(scale, block, 0), block, 1)[:o, :i]).astype(ml_dtypes.float8_e4m3fn)
            out[name], out[name + "_scale_inv"] = q, scale
        else:
            out[name] = w
    # Hand-computed block of kv_b_proj (layer 0, rows 0-3, cols 4-7): e4m3 codes times the block scale.
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    out[name][0:4, 4:8] = np.array([[1, -2, 0.5, 448]] * 4, np.float32).astype(ml_dtypes.float8_e4m3fn)
    out[name + "_scale_inv"][0, 1] = 0.25
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    save_file(out, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    config["dtype"] = "float32"
    (fp8_dir / "config.json").write_text(json.dumps(config))

    cfg, params = hf.load(fp8_dir)
    kv_b = np.asarray(params["dense_layers"]["blocks"]["attn"]["kv_b"][...])  # [L, R, N, n + v]
    # HF row r of kv_b_proj is head r // 14, channel r % 14; column c is latent c. Ours: [layer, c, head, ch].
    got_block = kv_b[0, 4:8, 0, 0:4].T  # rows 0-3 (head 0, channels 0-3) x cols 4-7
    np.testing.assert_array_equal(got_block, np.array([[0.25, -0.5, 0.125, 112.0]] * 4, np.float32))
    # Every other weight: the e4m3 value times its block's scale, within e4m3's 2^-4 relative step.
    q_b = np.asarray(params["moe_layers"]["blocks"]["attn"]["q_b"][...])  # [L, Q, N, H]
    want = tensors["model.layers.1.self_attn.q_b_proj.weight"].T.reshape(q_b.shape[1:])
    np.testing.assert_allclose(q_b[0], want, rtol=2**-4, atol=1e-6)


def test_sharded_load_on_8_devices_gives_the_same_logits(checkpoints):
    """DeepSeek-V3 loaded straight onto a data 2 x expert 2 x tensor 2 mesh of the 8 fake CPU devices: the
    routed experts split over `expert` and their hidden width over `tensor`, MLA's per-head up-projection
    over `tensor` (heads), and the sharded forward gives transformers' logits."""
    path, ref = checkpoints["qlora_groups"]
    mesh = sharding.make_mesh({a: 1 for a in sharding.MESH_AXES} | {"data": 2, "expert": 2, "tensor": 2})
    cfg, m = hf.load_model(path, mesh=mesh)
    gate = m.moe_layers.blocks.mlp.gate[...]  # [L_moe, E, D, F]: ('layers', 'exp', 'embed', 'mlp')
    assert gate.sharding.spec == PartitionSpec(None, "expert", None, "tensor")
    assert gate.addressable_shards[0].data.shape == (2, 4, 32, 8)  # 2 MoE layers, 8 / 2 experts, 16 / 2
    q_b = m.moe_layers.blocks.attn.q_b[...]  # [L_moe, q_lora, N, qk head]: heads over tensor
    assert q_b.sharding.spec[2] == "tensor" and q_b.addressable_shards[0].data.shape[2] == 2
    toks = np.random.RandomState(3).randint(0, VOCAB, (4, 10))
    assert_logits_match(sharded_logits(m, cfg, mesh, toks), ref, toks)
