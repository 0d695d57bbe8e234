"""Aux-loss-free balancing in the main job: with a sigmoid router, every optimizer step of rl.train (SFT warm
start and GRPO) moves each MoE layer's selection bias by +-model.moe.bias_update_rate (the sign of the
layer's load deficit over the step's batch), the engine samples with the trained bias after every weight
push, and the checkpoint holds it."""

import os

import numpy as np

from configs import grpo
from inference import Engine


def _bias(state) -> np.ndarray:
    """[MoE layers, experts]: each layer's bias in order (the test config unrolls its layers)."""
    blocks = state["moe_layers"]["blocks"]
    return np.stack([np.asarray(blocks[i]["mlp"]["expert_bias"][...]) for i in sorted(blocks)])


def test_main_job_trains_the_selection_bias_and_pushes_it_to_the_engine(tmp_path, monkeypatch):
    from rl import checkpoint, train, train_state

    cfg = grpo.get_config("test")
    cfg.model.moe.router = "sigmoid"
    rate = cfg.model.moe.bias_update_rate = 0.01
    held = []  # the bias the engine holds after each weight push (recorded around the real method)
    push = Engine.update_params

    def recording(self, params):
        version = push(self, params)
        held.append(_bias(self.params))
        return version

    monkeypatch.setattr(Engine, "update_params", recording)
    out = train.train(cfg, str(tmp_path), run_eval=False)
    assert out["steps"] == 4 and out["engine"]["compiles_after_warmup"] == 0

    _, target = train_state.init_state(cfg, seed=cfg.rl.seed)
    assert not _bias(target.model_state).any()  # it starts at zero
    ckpt = checkpoint.Checkpointer(os.path.join(tmp_path, "checkpoints"), save_every=2)
    state, _ = ckpt.restore(target_state=target)
    ckpt.close()
    final = _bias(state.model_state)  # [MoE layers, experts]
    assert final.shape == (cfg.model.num_layers, cfg.model.moe.num_experts)

    # Each update moves each entry by exactly -rate, 0 or +rate: after the 6 SFT updates and one update per
    # GRPO step every entry is a multiple of rate, at most 6 + 4 of them, and some moved.
    units = final / rate
    np.testing.assert_allclose(units, np.round(units), atol=1e-3)
    assert np.abs(units).max() <= cfg.rl.sft.steps + 4 + 1e-3
    assert np.abs(units).max() >= 1 - 1e-3
    # The engine got every update's bias: the last push is the checkpointed one, consecutive pushes differ
    # by one update's step per entry, and the bias moved while sampling continued.
    assert len(held) == 4
    np.testing.assert_array_equal(held[-1], final)
    for a, b in zip(held, held[1:]):
        steps = (b - a) / rate
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
        assert np.abs(np.round(steps)).max() <= 1
    assert not np.array_equal(held[0], held[-1])
