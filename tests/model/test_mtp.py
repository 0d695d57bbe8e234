"""Multi-token prediction (DeepSeek-V3 MTP modules) loaded from an HF checkpoint: module 1's logits against
the module computed by hand in torch around transformers' own DeepSeek-V3 decoder layer (HF layer
num_hidden_layers, with enorm / hnorm / eh_proj / shared_head.norm; transformers does not run MTP itself);
the checkpoint round-trips bit-exactly; `mtp_loss` against a hand-computed value."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from model import mtp
from model.io import hf
from model.moe.layer import ExpertBias

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # f32 on both sides, sums in a different order
VOCAB, D, LAYERS = 96, 32, 2
HF_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=D,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,  # eager attention repeats kv heads by num_attention_heads // this
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    q_lora_rank=16,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    initializer_range=0.2,
    tie_word_embeddings=False,
    num_mtp_layers=0,
)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A DeepSeek-V3 checkpoint of LAYERS decoder layers and one MTP module: a transformers model of
    LAYERS + 1 layers whose last layer becomes the MTP block, plus the module's own tensors."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**HF_CONFIG, num_hidden_layers=LAYERS + 1)
    config._attn_implementation = "eager"
    net = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in net.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(config.n_routed_experts))
    path = tmp_path_factory.mktemp("mtp")
    net.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.RandomState(0)
    prefix = f"model.layers.{LAYERS}."
    extra = {
        "enorm.weight": 1 + 0.2 * rng.randn(D),
        "hnorm.weight": 1 + 0.2 * rng.randn(D),
        "eh_proj.weight": 0.2 * rng.randn(D, 2 * D),
        "shared_head.norm.weight": 1 + 0.2 * rng.randn(D),
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "shared_head.head.weight": tensors["lm_head.weight"],
    }
    tensors.update({prefix + k: np.asarray(v, np.float32) for k, v in extra.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg_json = json.loads((path / "config.json").read_text())
    cfg_json.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(cfg_json))
    return path, net, {k: torch.tensor(np.asarray(v, np.float32)) for k, v in extra.items()}


def _reference(net, extra, toks):
    """(main logits, MTP module 1's logits) by hand around transformers' decoder layers."""
    inner, eps = net.model, net.config.rms_norm_eps
    tokens = torch.tensor(toks)
    t = tokens.shape[1]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        h = inner.embed_tokens(tokens)
        rope = inner.rotary_emb(h, pos)
        for layer in inner.layers[:LAYERS]:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        main = net.lm_head(inner.norm(h))
        nxt = torch.nn.functional.pad(tokens[:, 1:], (0, 1))  # token i + 1 at position i
        e = _rms(inner.embed_tokens(nxt), extra["enorm.weight"], eps)
        x = torch.cat([e, _rms(h, extra["hnorm.weight"], eps)], dim=-1) @ extra["eh_proj.weight"].T
        x = inner.layers[LAYERS](x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        out = _rms(x, extra["shared_head.norm.weight"], eps) @ extra["shared_head.head.weight"].T
    return main.numpy(), out.numpy()


def test_mtp_module_matches_hand_reference(checkpoint):
    path, net, extra = checkpoint
    cfg, m = hf.load_model(path)
    assert cfg.model.mtp_layers == 1 and cfg.model.num_layers == LAYERS
    toks = np.random.RandomState(1).randint(0, VOCAB, (2, 12))
    want_main, want_mtp = _reference(net, extra, toks)
    graphdef, state = nnx.split(m)

    @jax.jit  # op by op, the model compiles each operation on its own (~280 programs here)
    def run(state, tokens):
        net = nnx.merge(graphdef, state)
        logits, aux = net(tokens)
        return logits, net.mtp_logits(aux["hidden"], tokens)

    logits, got = run(state, jnp.asarray(toks))
    np.testing.assert_allclose(np.asarray(logits), want_main, atol=LOGIT_ATOL, rtol=0)
    got = np.asarray(got)
    assert got.shape == (1, 2, 12, VOCAB)
    # The last position reads a padding token (its target, token i + 2, does not exist anyway).
    np.testing.assert_allclose(got[0, :, :-1], want_mtp[:, :-1], atol=LOGIT_ATOL, rtol=0)


def test_mtp_checkpoint_round_trip_is_bit_exact(checkpoint, tmp_path):
    path, _, _ = checkpoint
    cfg, state = hf.load(path, variables=(nnx.Param, ExpertBias))
    hf.save(cfg, state, tmp_path)
    original = load_file(str(path / "model.safetensors"))
    again = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(again) == sorted(original)
    for k, v in original.items():
        assert again[k].dtype == v.dtype and again[k].tobytes() == v.tobytes(), k
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_mtp_loss_by_hand():
    # One depth, vocab 2, tokens [0, 1, 1, 0]: position i predicts token i + 2, so positions 0 and 1 count
    # (targets 1 and 0). Logits there: [0, log 3] -> p(1) = 3/4; [log 4, 0] -> p(0) = 4/5.
    logits = np.zeros((1, 1, 4, 2), np.float32)
    logits[0, 0, 0] = [0.0, np.log(3.0)]
    logits[0, 0, 1] = [np.log(4.0), 0.0]
    logits[0, 0, 2:] = [[50.0, -50.0], [-50.0, 50.0]]  # ignored: no target
    tokens = jnp.asarray([[0, 1, 1, 0]])
    want = -(np.log(3 / 4) + np.log(4 / 5)) / 2
    np.testing.assert_allclose(float(mtp.mtp_loss(jnp.asarray(logits), tokens)), want, rtol=1e-6)
    # A mask on the target tokens: only target index 3 (position 1) counts.
    mask = jnp.asarray([[1, 1, 0, 1]])
    np.testing.assert_allclose(
        float(mtp.mtp_loss(jnp.asarray(logits), tokens, mask)), -np.log(4 / 5), rtol=1e-6
    )
