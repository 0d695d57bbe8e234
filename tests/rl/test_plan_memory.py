"""rl.plan.memory: the main job's live bytes per device (memory/*) predicted from the config, against
figures derived by hand for the tiny model and against the arrays a trainer state and an engine really
place on 8 fake CPU devices (what rl/memory.py counts).

The tiny model (configs/grpo.py:test), f32, parameter shapes and logical axes per layer (2 MoE layers):
  q, o      [64, 4, 16] / [4, 16, 64]   embed x heads           4,096 each
  k, v      [64, 2, 16]                 embed x kv_heads        2,048 each
  gate, up  [4, 64, 96], down [4, 96, 64]  exp x embed x mlp   24,576 each
  router    [64, 4]                     embed                     256
  shared    gate, up [64, 64], down [64, 64]  embed x mlp       4,096 each
  norms     q_norm, k_norm [16], attn_norm, mlp_norm [64]         160 (never split)
  = 98,720 per layer; embed [256, 64] and unembed [64, 256] (vocab x embed) 16,384 each; final_norm 64.
Total 2 * 98,720 + 32,768 + 64 = 230,272 parameters, 921,088 bytes.

KV pages: max_batch 32, max_seq_len 24 + 8 = 32, num_draft 4, page_size 16: a sequence spans
ceil((32 + 5) / 16) = 3 pages, the prefix cache 32 * 3 // 2 = 48, the pool 1 + 32 * 3 + 48 = 145 pages.
k and v are [layers * kv heads = 4, 145, 16, 16] f32: 593,920 bytes each, 1,187,840 both.
"""

import json
import pathlib
import subprocess
import sys

import jax
import pytest

from configs import grpo
from model import sharding
from rl.plan import memory as plan_memory

REPO = pathlib.Path(__file__).resolve().parents[2]
PARAMS = 230_272
NORMS = 2 * 160 + 64  # replicated on every mesh
KV = 1_187_840


def _cfg(**rl):
    cfg = grpo.get_config("test")
    for dotted, value in rl.items():
        node = cfg.rl
        *parents, last = dotted.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return cfg


@pytest.mark.parametrize(
    "mesh, params",
    [
        # Nothing split over data: the whole model on every device.
        ({"data": 8}, PARAMS),
        # embed over fsdp 4: every parameter but the norms has an embed dim of 64, 16 per device.
        ({"data": 2, "fsdp": 4}, (PARAMS - NORMS) // 4 + NORMS),
        # expert 2 x tensor 2: per layer k, v 1,024 each; q, o 2,048 each; gate, up, down 4 * 64 * 96 / 4
        # = 6,144 each; shared 2,048 each; router 256; norms 160: 31,136. embed, unembed over vocab 2:
        # 8,192 each; final_norm 64. 2 * 31,136 + 16,384 + 64 = 78,720.
        ({"data": 2, "expert": 2, "tensor": 2}, 78_720),
    ],
)
def test_trainer_parts_by_hand(mesh, params):
    got = plan_memory.device_bytes(_cfg(), mesh)
    assert got["params"] == 4 * params
    # AdamW mu and nu in the params' dtype (f32), sharded like them, plus two int32 counts (clipping and
    # the schedule keep no state of their own).
    assert got["optimizer"] == 2 * 4 * params + 8
    assert got["reference"] == 0  # rl.loss.kl_kind = none
    assert got["other"] == 4 + 8  # the step (int32) and the rng key (2 x uint32); no selection biases


def test_sampler_parts_by_hand():
    cfg = _cfg()
    # Default: the engine takes the trainer mesh's expert and tensor (1 and 1 on data 8): all replicated.
    got = plan_memory.device_bytes(cfg, {"data": 8})
    assert (got["sampler_weights"], got["kv_pages"]) == (4 * PARAMS, KV)
    # expert 2 x tensor 2: the trainer mesh's split without fsdp (78,720 as above); K/V over tensor
    # (2 kv heads divide by 2): layers * kv heads 4 -> 2 rows.
    got = plan_memory.device_bytes(cfg, {"data": 2, "fsdp": 4}, {"data": 2, "expert": 2, "tensor": 2})
    assert (got["sampler_weights"], got["kv_pages"]) == (4 * 78_720, KV // 2)
    # The same engine mesh from the config: rl.engine.mesh.expert / tensor (the main job's sampler layout).
    cfg.rl.engine.mesh.expert = cfg.rl.engine.mesh.tensor = 2
    assert plan_memory.device_bytes(cfg, {"data": 2, "fsdp": 4}) == got
    cfg.rl.engine.mesh.expert = cfg.rl.engine.mesh.tensor = 0
    # tensor 4: 2 kv heads do not divide, so k and v weights stay whole (2,048 each) and so do the pages;
    # q, o 1,024 each; gate, up, down 4 * 64 * 24 = 6,144 each; shared 1,024 each; router 256; norms 160:
    # 28,064 per layer. embed, unembed 4,096 each; final_norm 64. 2 * 28,064 + 8,192 + 64 = 64,384.
    got = plan_memory.device_bytes(cfg, {"data": 8}, {"data": 2, "tensor": 4})
    assert (got["sampler_weights"], got["kv_pages"]) == (4 * 64_384, KV)
    # Colocated (rl.sampler_devices = 0): every part on each device.
    assert got["total"] == sum(got[k] for k in plan_memory.PARTS)


def test_reference_biases_record_sync_copy_and_disaggregation():
    cfg = _cfg(**{"loss.kl_kind": "k1", "reference_dtype": "bfloat16", "routing_replay": True})
    cfg.model.moe.router = "sigmoid"  # a selection bias [4] f32 per MoE layer: 32 bytes in all
    got = plan_memory.device_bytes(cfg, {"data": 8})
    assert got["reference"] == 2 * PARAMS + 32  # params in bf16, biases kept in f32
    assert got["sampler_weights"] == 4 * PARAMS + 32
    # The routing record: [2 MoE layers, 145 pages, 16 slots, top-2] int8 (4 experts), replicated.
    assert got["kv_pages"] == KV + 2 * 145 * 16 * 2
    assert got["other"] == 12 + 2 * 32  # the state's biases and its graph definition's copy
    # Delta weight sync keeps the engine's weights again, in the trainer's layout.
    cfg.rl.weight_sync_delta = 0.0
    synced = plan_memory.device_bytes(cfg, {"data": 8})
    assert synced["other"] == got["other"] + 4 * PARAMS + 32
    # Disaggregated: trainer and sampler on different devices, the larger side is the largest device.
    apart = plan_memory.device_bytes(cfg, {"data": 8}, colocated=False)
    trainer = sum(apart[k] for k in ("params", "optimizer", "reference", "other"))
    assert apart["total"] == max(trainer, apart["sampler_weights"] + apart["kv_pages"]) == trainer


def test_model_file_gets_grpo_defaults_and_sampler_axes_are_checked():
    from configs import tiny

    got = plan_memory.device_bytes(tiny.get_config(), {"data": 8})  # no rl block: configs/grpo.py's defaults
    assert got["params"] == 4 * PARAMS
    with pytest.raises(ValueError, match="--sampler: the engine's mesh has axes"):
        plan_memory.device_bytes(_cfg(), {"data": 8}, {"fsdp": 2})


def test_prediction_equals_the_placed_arrays():
    """A trainer state on data 2 x fsdp 4 and an engine on data 2 x expert 2 x tensor 2 over the same 8
    devices: each part's largest per-device bytes (rl.memory, what the main job logs) equal the prediction."""
    from inference import Engine
    from rl import memory, train_state, validate

    cfg = _cfg(**{"loss.kl_kind": "k1", "reference_dtype": "bfloat16"})
    trainer_shape, sampler_shape = {"data": 2, "fsdp": 4}, {"data": 2, "expert": 2, "tensor": 2}
    cfg.mesh.shape.update({a: 1 for a in sharding.MESH_AXES} | trainer_shape)
    trainer = sharding.make_mesh(trainer_shape)
    _, state = train_state.init_state(cfg, mesh=trainer)
    reference = train_state.reference_weights(state, cfg.rl.reference_dtype)
    engine = Engine(
        cfg, train_state.weights(state), validate.engine_config(cfg), mesh=sharding.make_mesh(sampler_shape)
    )
    largest = lambda tree: max(memory.per_device(jax.tree.leaves(tree)).values())
    measured = {
        "params": largest(state.params),
        "optimizer": largest(state.opt_state),
        "reference": largest(reference),
        "sampler_weights": largest(engine.params),
        "kv_pages": largest(engine.kv),
    }
    predicted = plan_memory.device_bytes(cfg, trainer_shape, sampler_shape)
    assert measured == {k: predicted[k] for k in measured}


def test_cli_prints_the_prediction():
    cmd = [sys.executable, "-m", "rl.plan", "--config=configs/grpo.py:test", "--mesh=data:2,fsdp:4"]
    cmd += ["--sampler=data:2,expert:2,tensor:2", "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])["device_bytes"]
    assert (got["params"], got["sampler_weights"], got["kv_pages"]) == (
        4 * ((PARAMS - NORMS) // 4 + NORMS),
        4 * 78_720,
        KV // 2,
    )
