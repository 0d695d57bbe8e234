"""The main job post-trains a Hugging Face DeepSeek-V3 checkpoint and `rl.export` writes it back.

A tiny DeepseekV3ForCausalLM written with transformers (a random selection bias, one MTP module, a byte-level
tokenizer.json) is the rl.init_from of `configs/grpo.py:test`: the SFT warm start (with rl.sft.mtp_weight)
starts from exactly its weights, biases and tokenizer (the step-0 cross-entropy is transformers' on the same
batch, the MTP loss module 1's by hand around transformers' decoder layer), GRPO steps update it on the MLA
engine, a restart restores the run's own checkpoint without reading rl.init_from, and transformers' logits
of the exported directory are our model's of the final state. The run's model is the checkpoint's but for
the runtime fields (an unscanned layout gives transformers' logits too). The rollout drafts with the
checkpoint's MTP module (rl.engine.draft="mtp"), the main-job test of that drafter in the default run.
Bad rl.init_from / rl.sft.mtp_weight values are refused before any work.

A run of our own model exports too: `configs/grpo.py:test` without qk_norm as Qwen2-MoE (its shared expert);
the stock model (qk_norm and a shared expert, which no supported format holds together) is refused before
the checkpoint is read, and an export never leaves a folder behind.
"""

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from hf_models import (
    DEEPSEEK,
    LOGIT_ATOL,
    MTP_LAYERS,
    hand_mtp_forward,
    hf_logits,
    hf_model,
    jit_logits,
    make_deepseek_mtp,
    write_byte_tokenizer,
)
from safetensors.numpy import load_file

from configs import grpo
from configs.errors import UserError
from configs.runs import read_config
from configs.schema import ConfigError
from rl import run as run_dir

torch = pytest.importorskip("torch")

# A mean over tokens of log-softmax values, each within 2 * LOGIT_ATOL when every logit is within LOGIT_ATOL.
CE_ATOL = 2 * LOGIT_ATOL
# 256 byte tokens + eos of the byte-level tokenizer, rounded up; the checkpoint's width and layers.
VOCAB, D, LAYERS = 260, DEEPSEEK["hidden_size"], MTP_LAYERS
MTP_WEIGHT = 0.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tests/hf_models.py's DeepSeek-V3 checkpoint of LAYERS decoder layers, a random selection bias and one
    MTP module, with the byte-level tokenizer's vocab and its tokenizer.json."""
    path = tmp_path_factory.mktemp("deepseek")
    net, extra = make_deepseek_mtp(path, vocab_size=VOCAB)
    write_byte_tokenizer(path)
    return path, net, extra


def _masked_ce(logits, batch, ahead: int) -> float:
    """Mean cross-entropy of tokens[:, t + ahead] given logits[:, t], over the targets where mask is 1."""
    tokens, mask = batch["tokens_BT"], batch["mask_BT"][:, ahead:]
    logp = torch.log_softmax(logits.double()[:, :-ahead], dim=-1).numpy()
    nll = -np.take_along_axis(logp, tokens[:, ahead:, None].astype(np.int64), axis=-1)[..., 0]
    return float((nll * mask).sum() / mask.sum())


def _hf_cross_entropy(path, batch) -> float:
    """The SFT loss by transformers' forward of the checkpoint."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor(batch["tokens_BT"], dtype=torch.long)).logits
    return _masked_ce(logits, batch, 1)


def _hand_mtp_loss(net, extra, batch) -> float:
    """MTP module 1's loss (position i predicts token i + 2), its logits by hand around transformers'
    decoder layers."""
    _, logits = hand_mtp_forward(net, extra, batch["tokens_BT"])
    return _masked_ce(logits, batch, 2)


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _cfg(checkpoint_dir):
    cfg = grpo.get_config("test")
    cfg.rl.init_from = str(checkpoint_dir)
    cfg.rl.sft.mtp_weight = MTP_WEIGHT
    # Four warm-start steps at this rate make the random checkpoint answer right some of the time, so the
    # GRPO steps have groups with a reward signal (found by trying; at the test config's 3e-3 none has).
    cfg.rl.sft.steps, cfg.rl.sft.optim.lr = 4, 3e-2
    cfg.rl.steps, cfg.rl.checkpoint_every = 2, 2
    cfg.rl.engine.draft = "mtp"  # the rollout drafts with the checkpoint's MTP module, on the MLA engine
    # KL to the frozen step-0 reference: with a sigmoid router the reference is the step-0 model whole, its
    # selection biases included (training moves the policy's).
    cfg.rl.loss.kl_kind, cfg.rl.loss.kl_coef = "k3", 0.05
    return cfg


def _restored(cfg, workdir, step: int):
    """(train state, reference weights) of the run's checkpoint at `step`, restored as rl.train does."""
    from rl import checkpoint, train_state

    _, state = train_state.init_state(cfg, seed=cfg.rl.seed)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), save_every=1, model_config=cfg.model)
    try:
        tree, meta = ckpt.restore(
            step, target_state=run_dir.checkpoint_target(cfg, state, ckpt.read_meta(step))
        )
    finally:
        ckpt.close()
    state, ref, _ = run_dir.unpack(tree)
    return state, ref


def _bias(tree, block: int = 0) -> np.ndarray:
    """The selection bias of MoE block `block` in a model state or reference weights (unrolled layers)."""
    return np.asarray(tree["moe_layers"]["blocks"][block]["mlp"]["expert_bias"][...])


def test_post_train_a_deepseek_checkpoint_and_export_it(checkpoint, tmp_path, monkeypatch):
    from model.io import hf
    from rl import export, train, train_state, warm_start

    path, net, extra = checkpoint
    batches = []  # the SFT batches, recorded around the real function
    make_batch = warm_start.sft_batch
    monkeypatch.setattr(
        warm_start, "sft_batch", lambda *a, **k: batches.append(make_batch(*a, **k)) or batches[-1]
    )
    workdir = tmp_path / "run"
    out = train.train(_cfg(path), str(workdir), run_eval=False)
    assert out["steps"] == 2 and out["engine"]["compiles_after_warmup"] == 0
    assert out["engine"]["accepted_tokens"] > 0, out["engine"]  # the MTP drafts were verified and taken

    run_cfg = read_config(str(workdir))  # what rl.train ran with
    assert run_cfg.model.attention_kind == "mla" and run_cfg.model.mtp_layers == 1
    assert run_cfg.model.d_model == D and run_cfg.model.vocab_size == VOCAB  # the checkpoint's, not tiny's
    assert run_cfg.rl.tokenizer == str(path)  # its tokenizer.json (rl.tokenizer was "")
    assert run_cfg.hf.architecture == "DeepseekV3ForCausalLM"

    # SFT step 0 ran on the checkpoint's weights and selection biases: its losses are transformers'.
    records = _records(workdir)
    sft_records = [r for r in records if "sft/cross_entropy" in r]
    assert [r["step"] for r in sft_records] == [0, 1, 2, 3] and len(batches) == 4
    first = sft_records[0]
    want_ce = _hf_cross_entropy(path, batches[0])
    np.testing.assert_allclose(first["sft/cross_entropy"], want_ce, atol=CE_ATOL, rtol=0)
    assert all(np.isfinite(r["sft/mtp_loss"]) for r in sft_records)
    want_mtp = _hand_mtp_loss(net, extra, batches[0])
    np.testing.assert_allclose(first["sft/mtp_loss"], want_mtp, atol=CE_ATOL, rtol=0)
    total = first["sft/cross_entropy"] + first["sft/moe_loss"] + MTP_WEIGHT * first["sft/mtp_loss"]
    np.testing.assert_allclose(first["sft/loss"], total, rtol=1e-5)
    grpo_records = [r for r in records if "train/loss" in r or "train/skipped" in r]
    assert [r["step"] for r in grpo_records] == [1, 2]
    assert any("train/loss" in r for r in grpo_records)  # an update, not only groups without a signal
    assert any("engine/acceptance_rate" in r for r in records)  # the drafter's acceptance is logged

    # The KL reference is the step-0 model (checkpoint 0, after the warm start), biases included: the first
    # update starts from it, so its KL is 0 but for rounding (k3 is quadratic in a log-prob difference, ~1e-7
    # between two programs' f32 forwards; 0.0 here); the policy's biases have moved by step 2, the
    # reference's not. (Before the reference kept its own biases, the second update read the donated first
    # state's and failed.)
    kl = {r["step"]: r["train/kl"] for r in grpo_records if "train/kl" in r}
    assert kl and all(np.isfinite(v) for v in kl.values()), grpo_records
    assert abs(kl[min(kl)]) < 1e-9, kl
    step0, _ = _restored(run_cfg, workdir, 0)
    final, ref = _restored(run_cfg, workdir, 2)
    np.testing.assert_array_equal(_bias(ref), _bias(step0.model_state))
    assert not np.array_equal(_bias(final.model_state), _bias(step0.model_state))

    # A restart finds the run's checkpoints: it restores them and never reads rl.init_from's weights.
    def refuse(*args, **kwargs):
        raise AssertionError("a resumed run read rl.init_from")

    monkeypatch.setattr(hf, "load_model", refuse)
    assert train.train(_cfg(path), str(workdir), run_eval=False)["steps"] == 2
    monkeypatch.undo()

    # Export: config, MTP module, trained selection biases, tokenizer; transformers reads the directory, and
    # its logits are our model's of the final state.
    exported = tmp_path / "exported"
    report = export.export(str(workdir), str(exported))
    assert report["step"] == 2 and "tokenizer.json" in report["tokenizer_files"]
    assert (exported / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    saved = json.loads((exported / "config.json").read_text())
    assert saved["architectures"] == ["DeepseekV3ForCausalLM"] and saved["num_nextn_predict_layers"] == 1
    tensors, original = (
        load_file(str(exported / "model.safetensors")),
        load_file(str(path / "model.safetensors")),
    )
    assert sorted(tensors) == sorted(original)  # MTP module included
    state, _ = run_dir.restore_state(run_cfg, str(workdir))
    bias = f"model.layers.{LAYERS - 1}.mlp.gate.e_score_correction_bias"
    # The test config unrolls its layers: one bias per MoE layer (the stacked layout is test_hf's).
    trained = np.asarray(state.model_state["moe_layers"]["blocks"][0]["mlp"]["expert_bias"][...])
    np.testing.assert_array_equal(tensors[bias], trained)
    assert not np.array_equal(tensors[bias], original[bias])  # moved by training
    assert not np.array_equal(tensors["lm_head.weight"], original["lm_head.weight"])

    model_def, _ = train_state.init_state(run_cfg, seed=run_cfg.rl.seed)
    toks = np.random.RandomState(1).randint(0, VOCAB, (2, 12))
    want = hf_logits(exported, toks)
    np.testing.assert_allclose(jit_logits(model_def, state, toks), want, atol=LOGIT_ATOL, rtol=0)


def test_init_from_takes_the_checkpoints_model_but_the_runtime_fields(checkpoint):
    """The run's model is the checkpoint's whatever the config's was, except the runtime fields (here the
    unscanned layer layout of configs/small.py), by which the weights are laid out: the model built from
    them computes transformers' logits."""
    from rl import train_state, validate

    path, _, _ = checkpoint
    cfg = grpo.get_config("test")
    cfg.rl.init_from = str(path)
    cfg.model.num_layers, cfg.model.scan_layers, cfg.model.remat = 7, False, "full"
    cfg.rl.tokenizer = "byte"
    run = validate.init_from_config(cfg)
    m = run.model
    assert (m.num_layers, m.d_model, m.mtp_layers, m.moe.n_group) == (LAYERS, D, 1, 2)
    assert (m.scan_layers, m.remat) == (False, "full") and run.rl.tokenizer == "byte"
    assert cfg.model.num_layers == 7  # the caller's config is not changed
    validate.validate(cfg)

    pretrained = train_state.load_pretrained(run)
    model_def, state = train_state.init_state(run, seed=0, **pretrained)
    assert list(state.params["moe_layers"]["blocks"].keys()) == [0]  # a list of layers, not one [L, ...] scan
    toks = np.random.RandomState(2).randint(0, VOCAB, (2, 10))
    want = hf_logits(path, toks)
    np.testing.assert_allclose(jit_logits(model_def, state, toks), want, atol=LOGIT_ATOL, rtol=0)


def test_bad_init_from_and_mtp_weight_are_refused_before_any_work(tmp_path):
    """Refused in well under 5 s, naming the field, with the workdir (a file of an earlier run) as it was."""
    from rl import train

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ({"init_from": str(tmp_path / "missing")}, "rl.init_from=", "is not a directory"),
        ({"init_from": str(empty)}, "rl.init_from=", "holds no config.json"),
        ({"sft.mtp_weight": 0.1}, "rl.sft.mtp_weight=0.1", "model.mtp_layers > 0"),
    ]
    for overrides, field, why in cases:
        cfg = grpo.get_config("test")  # the tiny model: no MTP modules
        for dotted, value in overrides.items():
            *parents, leaf = dotted.split(".")
            node = cfg.rl
            for p in parents:
                node = node[p]
            node[leaf] = value
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=re.escape(field) + ".*" + re.escape(why)):
            train.train(cfg, str(workdir))
        assert time.perf_counter() - start < 5.0
        assert sorted(os.listdir(workdir)) == ["metrics.jsonl"]
        assert (workdir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_run_of_the_test_config_exports_as_qwen2_moe(tmp_path, monkeypatch):
    """configs/grpo.py:test without qk_norm, shortened to one SFT step and no GRPO step (checkpoint 0 holds
    the SFT-trained weights; a GRPO step would add its compile and nothing to the format): rl.export writes
    Qwen2MoeForCausalLM, transformers' logits of it are the checkpoint's and model.io.hf.load gives back its
    params bit for bit; an --out with files in it is refused before the checkpoint is read, and a failed
    export leaves nothing behind."""
    from flax import nnx

    from model.io import hf, hf_config
    from rl import export, train, train_state

    cfg = grpo.get_config("test")
    cfg.model.qk_norm = False  # Qwen2-MoE has no qk norm; the stock model is refused (test below)
    cfg.rl.sft.steps, cfg.rl.steps = 1, 0
    workdir, out = tmp_path / "run", tmp_path / "exported"
    train.train(cfg, str(workdir), run_eval=False)
    assert export.export(str(workdir), str(out))["step"] == 0
    assert sorted(os.listdir(tmp_path)) == ["exported", "run"]  # no staging directory left beside it
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2MoeForCausalLM"]

    run_cfg = read_config(str(workdir))
    state, _ = run_dir.restore_state(run_cfg, str(workdir))
    model_def, _ = train_state.init_state(run_cfg, seed=run_cfg.rl.seed)
    toks = np.random.RandomState(1).randint(0, run_cfg.model.vocab_size, (2, 12))
    want = hf_logits(out, toks)
    np.testing.assert_allclose(jit_logits(model_def, state, toks), want, atol=LOGIT_ATOL, rtol=0)
    _, params = hf.load(out, overrides=hf_config.runtime_fields(run_cfg.model))  # the run's layer layout
    loaded = dict(nnx.to_flat_state(params))
    for path, var in nnx.to_flat_state(state.params):
        assert np.asarray(loaded[path][...]).tobytes() == np.asarray(var[...]).tobytes(), path

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(run_dir, "restore_state", refuse)
    with pytest.raises(ValueError, match=re.escape(f"--out={out} is a directory with files in it")):
        export.export(str(workdir), str(out))
    monkeypatch.undo()

    def fail(cfg, params, directory):
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(hf, "save", fail)
    with pytest.raises(OSError, match="No space left"):
        export.export(str(workdir), str(tmp_path / "new" / "deeper" / "exported"))
    assert sorted(os.listdir(tmp_path)) == ["exported", "run"]  # neither the directories made nor a half


def test_export_refuses_the_stock_model_before_reading_the_checkpoint(tmp_path, monkeypatch):
    """The run's model is checked first: one line naming the ways out, no checkpoint read, no folder made."""
    from rl import export

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(grpo.get_config("test").to_json_best_effort())

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(run_dir, "restore_state", refuse)
    ways_out = "cannot export the run in .*: no Hugging Face format .*--config.model.qk_norm=False"
    with pytest.raises(ValueError, match=ways_out + ".*--config.model.moe.num_shared_experts=0") as refused:
        export.export(str(workdir), str(tmp_path / "exported" / "tiny"))
    assert isinstance(refused.value, UserError)  # the CLI prints it as one line
    assert "\n" not in str(refused.value)
    assert sorted(os.listdir(tmp_path)) == ["run"]
