"""Tiny Hugging Face models for the parity tests, built with `transformers` (torch, CPU) from a fixed seed and
saved with `save_pretrained`, and the checks that hold our model against them.

- `make_hf(name, path)`: a Qwen3-MoE, Qwen3, Qwen2, Llama 3, Mixtral or Qwen2-MoE model of `ARCHS`.
- `make_deepseek(name, path)`: a DeepSeek-V3 model of `GEOMETRIES`, with a random selection bias;
  `make_deepseek_mtp(path)`: one with an MTP module, and `hand_mtp_forward`, that module computed by hand.
- `checkpoints_fixture`: each model of a table, saved; `assert_logits_match` and
  `assert_logits_and_greedy_match` (logits, left-padded logits and greedy tokens) against transformers';
  `sharded_logits`: ours on a mesh.
- `write_byte_tokenizer`, `hf_model` and `hf_logits` (transformers' model of a directory and its logits) and
  `jit_logits` (ours of a train state), for the main-job tests that post-train such a checkpoint.

Importing this module skips the importing test module where torch or transformers is not installed (the
`parity` extra that `make test` installs).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from safetensors.numpy import load_file, save_file

from model import sharding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# f32 on both sides; the two implementations add the same products in a different order (and MLA's absorbed
# form in decode).
LOGIT_ATOL = 1e-4

# What every tiny model here shares: its width, MLP width and query heads; an init wider than the HF default
# (0.02) so that router probabilities (and DeepSeek's group scores) are well separated: a near-tie in the
# top-k would make both sides' choice of experts depend on the last bit.
TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    initializer_range=0.2,
    tie_word_embeddings=False,
)

# ---------------------------------------------------------------------------------------------------------
# Qwen, Llama and Mixtral
# ---------------------------------------------------------------------------------------------------------

VOCAB = 128
COMMON = dict(TINY, vocab_size=VOCAB, num_hidden_layers=2, num_key_value_heads=2)
ARCHS = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=8, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500_000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # A dense first layer (mlp_only_layers), a shared expert wider than a routed one, unnormalised top-k.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
    ),
}


def _zero_gates_random_biases(net) -> None:
    """Qwen2-MoE as our model can hold it: shared-expert gates of zero (sigmoid 1/2 on the shared expert; a
    trained gate is refused), and random q/k/v biases (HF starts them at zero), so that they are tested."""
    with torch.no_grad():
        for layer in net.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(0.2 * torch.randn(proj.bias.shape))
            if hasattr(layer.mlp, "shared_expert_gate"):
                layer.mlp.shared_expert_gate.weight.zero_()


PREPARE = {"qwen2_moe": _zero_gates_random_biases}


def make_hf(name: str, path, dtype=torch.float32, **overrides):
    """transformers' model `ARCHS[name]` (config fields `overrides` changed), seed 0, saved to `path`."""
    config_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    net = getattr(transformers, model_cls)(config)
    PREPARE.get(name, lambda net: None)(net)
    net = net.to(dtype).eval()
    net.save_pretrained(path)
    return net


# ---------------------------------------------------------------------------------------------------------
# DeepSeek-V3
# ---------------------------------------------------------------------------------------------------------

DEEPSEEK_VOCAB = 96
DEEPSEEK = dict(
    TINY,
    vocab_size=DEEPSEEK_VOCAB,
    moe_intermediate_size=16,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    n_shared_experts=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    num_mtp_layers=0,
)
GEOMETRIES = {
    # q low-rank path, 2 groups of 4 (a token uses 1), one dense layer
    "qlora_groups": dict(
        num_hidden_layers=3,
        q_lora_rank=16,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    # V2-Lite style: no q low-rank path, no groups, two dense layers
    "no_qlora": dict(
        num_hidden_layers=4,
        q_lora_rank=None,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
    ),
    # 4 groups (a token uses 2), YaRN with mscale / mscale_all_dim, rotate-half RoPE, unnormalised top-k
    "yarn_groups": dict(
        num_hidden_layers=2,
        q_lora_rank=8,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        rope_interleave=False,
        max_position_embeddings=64,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10_000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=1.0,
        ),
    ),
}


def randomize_selection_bias(net) -> None:
    """A random e_score_correction_bias in each MoE layer (HF starts it at zero), so that it is tested."""
    with torch.no_grad():
        for layer in net.model.layers[net.config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(net.config.n_routed_experts))


def _deepseek(geometry: str, attn_implementation: str | None, selection_bias: bool, **overrides):
    """transformers' DeepSeek-V3 of `GEOMETRIES[geometry]` (config fields `overrides` changed), seed 0."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**DEEPSEEK, **GEOMETRIES[geometry], **overrides})
    if attn_implementation:
        config._attn_implementation = attn_implementation
    net = transformers.DeepseekV3ForCausalLM(config).eval()
    if selection_bias:
        randomize_selection_bias(net)
    return net


def make_deepseek(name: str, path, dtype=torch.float32, selection_bias: bool = True, **overrides):
    """transformers' DeepSeek-V3 of `GEOMETRIES[name]` (config fields `overrides` changed), seed 0, with a
    random selection bias unless told not to, saved to `path`."""
    net = _deepseek(name, None, selection_bias, **overrides).to(dtype)
    net.save_pretrained(path)
    return net


# The MTP checkpoint's decoder layers; transformers' model has one more, the MTP module's block.
MTP_LAYERS = 2


def make_deepseek_mtp(path, **overrides):
    """(transformers' model, the MTP module's own tensors) of a DeepSeek-V3 checkpoint written to `path` with
    MTP_LAYERS decoder layers, a random selection bias and one MTP module: transformers' model of the
    qlora_groups geometry has MTP_LAYERS + 1 layers, whose last becomes the MTP module's block (transformers
    does not run MTP itself). Its attention is eager: `hand_mtp_forward` passes an explicit causal mask."""
    # Eager attention repeats the kv heads num_attention_heads // num_key_value_heads times.
    overrides = dict(num_key_value_heads=4, num_hidden_layers=MTP_LAYERS + 1, **overrides)
    net = _deepseek("qlora_groups", "eager", True, **overrides)
    net.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    d = net.config.hidden_size
    rng = np.random.RandomState(0)
    extra = {
        "enorm.weight": 1 + 0.2 * rng.randn(d),
        "hnorm.weight": 1 + 0.2 * rng.randn(d),
        "eh_proj.weight": 0.2 * rng.randn(d, 2 * d),
        "shared_head.norm.weight": 1 + 0.2 * rng.randn(d),
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "shared_head.head.weight": tensors["lm_head.weight"],
    }
    tensors.update({f"model.layers.{MTP_LAYERS}.{k}": np.asarray(v, np.float32) for k, v in extra.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg_json = json.loads((path / "config.json").read_text())
    cfg_json.update(num_hidden_layers=MTP_LAYERS, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(cfg_json))
    return net, {k: torch.tensor(np.asarray(v, np.float32)) for k, v in extra.items()}


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def hand_mtp_forward(net, extra, tokens_BT):
    """(main logits, MTP module 1's logits), torch [B, T, V] each, of `make_deepseek_mtp`'s model by hand
    around transformers' decoder layers: module 1 at position i reads token i + 1 (padding at the last)."""
    inner, eps = net.model, net.config.rms_norm_eps
    tokens = torch.tensor(np.asarray(tokens_BT), dtype=torch.long)
    t = tokens.shape[1]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        h = inner.embed_tokens(tokens)
        rope = inner.rotary_emb(h, pos)
        for layer in inner.layers[:MTP_LAYERS]:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        main = net.lm_head(inner.norm(h))
        nxt = torch.nn.functional.pad(tokens[:, 1:], (0, 1))  # token i + 1 at position i
        e = _rms(inner.embed_tokens(nxt), extra["enorm.weight"], eps)
        x = torch.cat([e, _rms(h, extra["hnorm.weight"], eps)], dim=-1) @ extra["eh_proj.weight"].T
        x = inner.layers[MTP_LAYERS](x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        out = _rms(x, extra["shared_head.norm.weight"], eps) @ extra["shared_head.head.weight"].T
    return main, out


# ---------------------------------------------------------------------------------------------------------
# Checks and the main job's pieces
# ---------------------------------------------------------------------------------------------------------


def checkpoints_fixture(make, names):
    """A module-scoped fixture `checkpoints`: {name: (folder, transformers' model)}, `make(name, folder)` for
    each of `names` in a folder of its own."""

    @pytest.fixture(scope="module")
    def checkpoints(tmp_path_factory):
        out = {}
        for name in names:
            path = tmp_path_factory.mktemp(name)
            out[name] = (path, make(name, path))
        return out

    return checkpoints


def greedy(m, prompt_BT, steps: int) -> np.ndarray:
    """`steps` greedy tokens of our model `m` after `prompt_BT`, decoded with its KV cache."""
    b, t = prompt_BT.shape
    cache = m.init_cache(batch=b, max_len=t + steps, dtype=jnp.float32)
    step = nnx.jit(lambda m, toks, cache: m(toks, kv_cache=cache))
    logits, aux = step(m, jnp.asarray(prompt_BT), cache)
    out = []
    for _ in range(steps):
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        out.append(np.asarray(nxt))
        logits, aux = step(m, nxt, aux["kv_cache"])
    return np.concatenate(out, axis=1)


def assert_logits_match(got_BTV, ref, toks_BT) -> None:
    """Our logits `got_BTV` of `toks_BT` are transformers' model `ref`'s, within LOGIT_ATOL."""
    with torch.no_grad():
        want = ref(torch.tensor(toks_BT)).logits.numpy()
    np.testing.assert_allclose(np.asarray(got_BTV), want, atol=LOGIT_ATOL, rtol=0)


def sharded_logits(m, cfg, mesh, toks_BT) -> jax.Array:
    """Our model `m`'s logits of `toks_BT` under jit on `mesh`, the batch sharded by `cfg`'s rules."""
    with jax.set_mesh(mesh):
        spec = sharding.logical_to_spec(("act_batch", "act_length"), cfg.mesh.rules)
        toks = jax.device_put(jnp.asarray(toks_BT), NamedSharding(mesh, spec))
        return jax.jit(lambda m, t: m(t)[0])(m, toks)


def assert_logits_and_greedy_match(m, ref, vocab: int) -> None:
    """Our model `m` against transformers' `ref`: the logits of two random rows of 12 tokens, of the same
    rows with the first 4 of row 0 masked out (left padding), within LOGIT_ATOL; and 20 greedy tokens after
    their first 6, equal."""
    rng = np.random.RandomState(0)
    toks = rng.randint(0, vocab, (2, 12))
    assert_logits_match(m(jnp.asarray(toks))[0], ref, toks)

    # Left-padded batch: HF takes the attention mask and position ids, we take segment ids and positions.
    mask = np.ones((2, 12), np.int64)
    mask[0, :4] = 0
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    with torch.no_grad():
        want = ref(
            torch.tensor(toks), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
        ).logits.numpy()
    got = np.asarray(
        m(jnp.asarray(toks), jnp.asarray(positions, jnp.int32), segment_ids=jnp.asarray(mask))[0]
    )
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=LOGIT_ATOL, rtol=0)

    prompt = toks[:, :6]
    with torch.no_grad():
        want_ids = ref.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones_like(torch.tensor(prompt)),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        ).numpy()[:, 6:]
    np.testing.assert_array_equal(greedy(m, prompt, 20), want_ids)


def write_byte_tokenizer(path) -> None:
    """A byte-level BPE without merges (one token per byte) and an eos token, ids 0..256, into `path`."""
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    vocab = {c: i for i, c in enumerate(sorted(byte_level.alphabet()))}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))


def hf_model(path):
    """transformers' model of a checkpoint directory, eager attention (it skips an MTP layer, which it does
    not run)."""
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()


def hf_logits(path, toks_BT) -> np.ndarray:
    """transformers' logits of `toks_BT` by `hf_model(path)`."""
    with torch.no_grad():
        return hf_model(path)(torch.tensor(toks_BT)).logits.numpy()


def jit_logits(model_def, state, toks):
    """Our model's logits of `toks` for a train state, under jit (not op by op)."""
    forward = jax.jit(lambda params, rest, t: model_def.merge(params, rest)(t)[0])
    return np.asarray(forward(state.params, state.model_state, jnp.asarray(toks)))
