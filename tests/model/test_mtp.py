"""Multi-token prediction (DeepSeek-V3 MTP modules) loaded from an HF checkpoint: module 1's logits against
the module computed by hand in torch around transformers' own DeepSeek-V3 decoder layer (HF layer
num_hidden_layers, with enorm / hnorm / eh_proj / shared_head.norm; transformers does not run MTP itself;
checkpoint and hand computation are tests/hf_models.py's); the checkpoint round-trips bit-exactly;
`mtp_loss` against a hand-computed value."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import DEEPSEEK_VOCAB, LOGIT_ATOL, MTP_LAYERS, hand_mtp_forward, make_deepseek_mtp
from safetensors.numpy import load_file

from model import mtp
from model.io import hf
from model.moe.layer import ExpertBias

VOCAB, LAYERS = DEEPSEEK_VOCAB, MTP_LAYERS


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tests/hf_models.py's DeepSeek-V3 checkpoint of LAYERS decoder layers and one MTP module."""
    path = tmp_path_factory.mktemp("mtp")
    return path, *make_deepseek_mtp(path)


def test_mtp_module_matches_hand_reference(checkpoint):
    path, net, extra = checkpoint
    cfg, m = hf.load_model(path)
    assert cfg.model.mtp_layers == 1 and cfg.model.num_layers == LAYERS
    toks = np.random.RandomState(1).randint(0, VOCAB, (2, 12))
    want_main, want_mtp = (x.numpy() for x in hand_mtp_forward(net, extra, toks))
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
