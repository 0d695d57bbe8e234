"""The memory planner against real models, hand-derived counts and the CLI."""

import json
import math
import pathlib
import subprocess
import sys
import time

import jax
import pytest
from flax import nnx

import model
from configs import deepseek_v3, moe_1t, small, tiny
from model import plan, sharding
from rl.plan import rollout as plan_rollout
from rl.plan import xla as plan_xla

REPO = pathlib.Path(__file__).resolve().parents[2]


def _real_param_count(cfg) -> int:
    """The built model's parameter count, from its shapes (traced, not initialized: small's 95M parameters
    took 14 s to draw op by op)."""
    params = nnx.state(nnx.eval_shape(lambda: model.build(cfg)), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


CONFIGS = {
    "tiny": tiny.get_config,
    "tiny:dense": lambda: tiny.get_config("dense"),
    "small": small.get_config,
}


@pytest.mark.parametrize("name", CONFIGS)
def test_total_params_match_built_model(name):
    cfg = CONFIGS[name]()
    assert plan.count_params(cfg)["total"] == _real_param_count(cfg)


def test_tiny_active_params_and_flops_by_hand():
    # configs/tiny.py: V=256, D=64, 2 layers (both MoE), 4 query / 2 kv heads of H=16, qk_norm,
    # 4 routed experts (top-2) of width 96, one shared expert of width 64, untied embeddings.
    # Per layer:
    #   attention q, o: 64*4*16 = 4096 each; k, v: 64*2*16 = 2048 each        -> 12288
    #   q_norm, k_norm: 16 + 16                                                 ->    32
    #   attn_norm, mlp_norm: 64 + 64                                            ->   128
    #   router: 64*4                                                            ->   256
    #   routed experts gate, up, down: 3*4*64*96 = 73728 total, top-2 of 4 active -> 36864
    #   shared expert: 3*64*64                                                  -> 12288
    # active per layer = 12288 + 32 + 128 + 256 + 36864 + 12288 = 61856; two layers 123712.
    # embedding 256*64 = 16384, unembedding 64*256 = 16384, final norm 64.
    # active = 123712 + 16384 + 16384 + 64 = 156544
    # total  = 2 * (61856 + 36864) + 32832 = 230272
    cfg = tiny.get_config()
    counts = plan.count_params(cfg)
    assert counts["active"] == 156544
    assert counts["total"] == 230272
    assert counts["experts"] == 2 * 73728
    assert counts["embedding"] == counts["unembedding"] == 16384
    # Forward: 2 * (active - input embedding) + attention 2*2*L*N*H*T/2 = 2*2*4*16*32 at T=32.
    forward = 2 * (156544 - 16384) + 2 * 2 * 4 * 16 * 32
    assert plan.flops_per_token(cfg, 32, training=False) == forward == 288512
    assert plan.flops_per_token(cfg, 32) == 3 * forward


def test_tied_embedding_counts_once_as_a_matmul():
    cfg = tiny.get_config()
    cfg.model.tie_embeddings = True
    counts = plan.count_params(cfg)
    assert counts["unembedding"] == 0
    assert counts["active"] == 156544 - 16384  # the tiny numbers above, less the unembedding
    # The one table is the output projection: all active params are matmul params.
    assert plan.flops_per_token(cfg, 32, training=False) == 2 * counts["active"] + 8192


def test_moe_1t_plans_without_allocation():
    cfg = moe_1t.get_config()
    start = time.perf_counter()
    p = plan.plan(cfg, {"data": 8, "fsdp": 32, "expert": 64, "tensor": 4}, 2048, 8192)
    seconds = time.perf_counter() - start
    # Measured 0.13-0.3 s on a 2-core CPU; materialising its 4 TB of f32 parameters could not run.
    assert seconds < 30
    assert 0.95e12 <= p["params_total"] <= 1.1e12
    assert 25e9 <= p["params_active"] <= 40e9
    assert p["devices"] == 65536
    assert p["total_bytes_per_device"] == (
        p["param_bytes_per_device"]
        + p["grad_bytes_per_device"]
        + p["adamw_bytes_per_device"]
        + p["activation_bytes_per_device"]
    )


def _tiny_mla():
    cfg = tiny.get_config()
    m = cfg.model
    m.attention_kind, m.qk_norm = "mla", False
    m.mla.update(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    return cfg


def test_mla_params_by_hand_and_match_built_model():
    # tiny with MLA (D=64, N=4, q_lora 16, kv_lora 12, qk_nope 8, qk_rope 4, v 6) per layer:
    #   q_a 64*16 = 1024, q_a_norm 16, q_b 16*4*(8+4) = 768, kv_a 64*(12+4) = 1024, kv_a_norm 12,
    #   kv_b 12*4*(8+6) = 672, o 4*6*64 = 1536                                   -> 5052
    # GQA tiny's attention was 12288 + 32 (qk_norm) = 12320 per layer; two layers.
    cfg = _tiny_mla()
    assert plan.count_params(cfg)["total"] == 230272 - 2 * (12320 - 5052) == _real_param_count(cfg)
    # Forward attention FLOPs: 2 * L * N * (12 + 6) * T / 2 at T=32 = 2 * 2 * 4 * 18 * 16.
    active = 156544 - 2 * (12320 - 5052)
    assert plan.flops_per_token(cfg, 32, training=False) == 2 * (active - 16384) + 2 * 2 * 4 * 18 * 16


def test_kv_cache_bytes_per_token():
    # DeepSeek-V3 in bf16: 61 layers x (kv_lora 512 + qk_rope 64) x 2 bytes = 70,272 (the ~70 KB of the
    # paper); Kimi K2 has the same cache row. The GQA geometry moe_1t had before (8 kv heads of 128):
    # 61 x 2 x 8 x 128 x 2 = 249,856 bytes, 3.56x more.
    assert plan.kv_cache_bytes_per_token(deepseek_v3.get_config()) == 70_272
    assert plan.kv_cache_bytes_per_token(moe_1t.get_config()) == 70_272
    gqa = moe_1t.get_config()
    gqa.model.update(attention_kind="gqa", num_kv_heads=8, head_dim=128)
    assert plan.kv_cache_bytes_per_token(gqa) == 249_856
    assert plan.kv_cache_bytes_per_token(tiny.get_config(), "float32") == 2 * 2 * 2 * 16 * 4


@pytest.mark.parametrize(
    "get, total, active",
    [(moe_1t.get_config, 1.04e12, 32e9), (deepseek_v3.get_config, 671e9, 37e9)],
    ids=["kimi_k2", "deepseek_v3"],
)
def test_published_geometries_match_published_counts(get, total, active):
    # Published: Kimi K2 1.04T total / 32B activated; DeepSeek-V3 671B / 37B (its 14B MTP module apart).
    # Activated here excludes the input embedding (a lookup, not a matmul): with it Kimi K2 counts
    # 32.86B, 2.7% above the rounded "32B"; without it 31.69B. DeepSeek-V3: 37.55B with, 36.62B without.
    counts = plan.count_params(get())
    assert abs(counts["total"] / total - 1) < 0.02
    assert abs((counts["active"] - counts["embedding"]) / active - 1) < 0.02


def test_expert_bytes_shrink_over_expert_axis():
    cfg = small.get_config()
    one = plan.plan(cfg, {}, 8, 512)
    eight = plan.plan(cfg, {"expert": 8}, 8, 512)
    # 8 layers of 16 experts of gate, up, down (512 x 384) in f32; expert:8 leaves 2 per device.
    assert eight["expert_param_bytes_per_device"] == 8 * 2 * 3 * 512 * 384 * 4
    assert one["expert_param_bytes_per_device"] == 8 * eight["expert_param_bytes_per_device"]
    # Nothing else carries the `exp` axis, so everything else stays where it was.
    saved = one["expert_param_bytes_per_device"] - eight["expert_param_bytes_per_device"]
    assert one["param_bytes_per_device"] - eight["param_bytes_per_device"] == saved


def test_fsdp_and_tensor_split_the_embedding():
    cfg = small.get_config()
    cfg.model.scan_layers = True  # one stacked [layers, ...] parameter per weight
    shards = plan.param_bytes_per_device(cfg, {"fsdp": 4, "tensor": 2})
    # (vocab 8192 over tensor 2) x (embed 512 over fsdp 4), f32.
    assert shards["embed/embedding"].bytes_per_device == (8192 // 2) * (512 // 4) * 4
    # Norm scales are replicated: 8 layers x 512.
    assert shards["moe_layers/blocks/attn_norm/scale"].bytes_per_device == 8 * 512 * 4


def test_uneven_dims_round_up_and_warn():
    cfg = tiny.get_config()
    p = plan.plan(cfg, {"fsdp": 3}, 8, 32)
    shards = plan.param_bytes_per_device(cfg, {"fsdp": 3})
    assert shards["embed/embedding"] == plan.Shard(256 * 22 * 4, even=False, expert=False)
    assert any("embed/embedding" in w for w in p["warnings"])
    assert any("batch 8" in w for w in p["warnings"])


def test_planned_bytes_equal_real_shards():
    mesh_shape = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    cfg = tiny.get_config()
    cfg.mesh.shape.update(mesh_shape)
    m = model.build(cfg, mesh=sharding.make_mesh(mesh_shape))
    planned = plan.param_bytes_per_device(cfg, mesh_shape)
    real = {
        "/".join(map(str, path)): v.get_value().addressable_shards[0].data.nbytes
        for path, v in nnx.to_flat_state(nnx.state(m, nnx.Param))
    }
    assert real == {path: s.bytes_per_device for path, s in planned.items()}


def test_activations_follow_remat_and_batch_sharding():
    cfg = small.get_config()
    by_remat = {}
    for remat in ("none", "dots_saveable", "full"):
        cfg.model.remat = remat
        by_remat[remat] = plan.activation_bytes_per_device(cfg, {}, 8, 512)
    assert by_remat["none"] > by_remat["dots_saveable"] > by_remat["full"] > 0
    # Every term is linear in the rows a device holds, so doubling the data axis halves it.
    assert plan.activation_bytes_per_device(cfg, {"data": 2}, 8, 512) * 2 == by_remat["full"]


def test_parse_mesh():
    assert plan.parse_mesh("data:8,tensor:4") == {
        "data": 8,
        "fsdp": 1,
        "expert": 1,
        "tensor": 4,
        "sequence": 1,
    }
    with pytest.raises(ValueError, match="pipeline"):
        plan.parse_mesh("pipeline:2")
    with pytest.raises(ValueError, match="axis:size"):
        plan.parse_mesh("data=8")


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rl.plan", "--config=configs/tiny.py", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def _cli(*args: str) -> str:
    done = _run_cli(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cli_json_line():
    out = _cli(
        "--json",
        "--mesh=data:2,tensor:2",
        "--seq_len=16",
        "--config.model.d_ff=64",
        "--inference_mesh=expert:2,tensor:2",
        "--context=64",
    )
    lines = out.strip().splitlines()
    assert len(lines) == 1
    p = json.loads(lines[0])
    assert p["mesh"] == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 2, "sequence": 1}
    assert (p["batch"], p["seq_len"]) == (8, 16)
    cfg = tiny.get_config()
    cfg.model.d_ff = 64
    assert p["params_total"] == plan.count_params(cfg)["total"]
    for key in (
        "params_active",
        "flops_per_token_train",
        "flops_per_token_forward",
        "param_bytes_per_device",
        "grad_bytes_per_device",
        "adamw_bytes_per_device",
        "activation_bytes_per_device",
        "total_bytes_per_device",
        "fits",
    ):
        assert key in p
    # The rollout entries: the hand-derived tiny figures of test_rollout_weights_kv_and_sequences_by_hand.
    assert p["kv_bytes_per_token_per_device"] == 256
    assert (p["context"], p["inference_devices"]) == (64, 4)
    assert p["train_a2a"] == {}  # no expert axis in --mesh
    assert p["rollout_a2a"]["a2a_tokens_per_device"] == 4 * 16  # 8 rows over data 2, 16 tokens each


def test_cli_table():
    out = _cli("--hbm_gib=80")
    assert "fits 80 GiB" in out and "params" in out


def test_gradients_are_f32_whatever_param_dtype():
    # The train step accumulates gradients in f32 (rl.train_step: the micro-batch scan's carry).
    # tiny in bf16 on one device: 230272 params, of which the routers' 2 x 64 x 4 = 512 stay f32.
    cfg = tiny.get_config()
    cfg.model.param_dtype = "bfloat16"
    p = plan.plan(cfg, {}, 8, 32)
    assert p["param_bytes_per_device"] == (230272 - 512) * 2 + 512 * 4 == 461_568
    assert p["grad_bytes_per_device"] == 230272 * 4
    assert p["adamw_bytes_per_device"] == 2 * 461_568


# --- rollout memory ----------------------------------------------------------------------------------------


def test_rollout_bytes_equal_the_engine_layout():
    # The engine's own shardings (inference.layout) on 8 fake devices, tiny's 2 kv heads on tensor 4:
    # every weight's shard and the K/V pages' split match what the planner counts.
    from inference import layout

    cfg = tiny.get_config()
    mesh_shape = {"expert": 2, "tensor": 4}
    mesh = sharding.make_mesh(mesh_shape)
    abstract = plan.abstract_params(cfg)
    placed = layout.weight_shardings(abstract, mesh, layout.inference_rules(tuple(cfg.mesh.rules)))
    shapes = dict(nnx.to_flat_state(abstract))
    engine = {
        "/".join(map(str, path)): math.prod(v.get_value().shard_shape(shapes[path].shape))
        * shapes[path].dtype.itemsize
        for path, v in nnx.to_flat_state(placed)
    }
    planned = plan_rollout.inference_weight_bytes_per_device(cfg, mesh_shape)
    assert engine == {path: s.bytes_per_device for path, s in planned.items()}
    pages = layout.page_shardings({"k": None, "v": None}, mesh, cfg.model.num_kv_heads)
    assert pages["k"].spec == jax.sharding.PartitionSpec()  # 2 kv heads on tensor 4: replicated
    assert not plan_rollout.kv_sharded_over_tensor(cfg, 4) and plan_rollout.kv_sharded_over_tensor(cfg, 2)


def test_rollout_weights_kv_and_sequences_by_hand():
    # tiny (f32) on expert:2 x tensor:2, inference layout (embed replicated), elements per device:
    #   embedding 256 x 64 and unembedding 64 x 256, vocab over tensor: 128 x 64 each   -> 16384
    #   final norm                                                                      ->    64
    #   per layer: q (64, 4 heads, 16) and o, heads over tensor: 64 x 2 x 16 each        ->  4096
    #              k, v (64, 2 kv heads, 16), kv heads over tensor: 64 x 1 x 16 each     ->  2048
    #              q_norm, k_norm 16 each; attn_norm, mlp_norm 64 each; router 64 x 4   ->   416
    #              experts gate, up, down (4, 64, 96): 2 experts x 64 x 48 each          -> 18432
    #              shared gate, up, down 64 x 64, mlp over tensor: 64 x 32 each          ->  6144
    #   per layer 31136; two layers 62272; total 78720 elements = 314,880 bytes in f32.
    cfg = tiny.get_config()
    mesh = {"expert": 2, "tensor": 2}
    # KV: 2 layers x (k, v) x 2 kv heads x 16 x 4 bytes = 512 per token; 2 kv heads over tensor 2: 256.
    # HBM 1 MiB: (1,048,576 - 314,880) // (64 tokens x 256) = 733,696 // 16,384 = 44 sequences per
    # device (45 would need 737,280); 4 devices / tensor 2 = 2 groups hold 88.
    r = plan_rollout.rollout_plan(cfg, mesh, context=64, hbm_gib=1 / 1024)
    assert r["weight_bytes_per_device"] == 78720 * 4 == 314_880
    assert r["expert_weight_bytes_per_device"] == 2 * 18432 * 4
    assert r["kv_cache_bytes_per_token"] == 512
    assert r["kv_sharded_over_tensor"] and r["kv_bytes_per_token_per_device"] == 256
    assert r["kv_bytes_per_sequence_per_device"] == 16_384
    assert (r["sequences_per_device"], r["sequences_on_mesh"]) == (44, 88)
    assert r["rollout_warnings"] == []
    # Weights in bf16 halve; 2 kv heads do not divide over tensor 4, so the cache is replicated there.
    half = plan_rollout.rollout_plan(cfg, mesh, context=64, hbm_gib=1 / 1024, weight_dtype="bfloat16")
    assert half["weight_bytes_per_device"] == 78720 * 2
    assert plan_rollout.kv_bytes_per_token_per_device(cfg, 4) == 512
    # On tensor 4 the 2 kv heads of k and v do not divide: the engine keeps them whole on every device,
    # 2 layers x 64 x 2 x 16 each instead of a split, and says so.
    shards = plan_rollout.inference_weight_bytes_per_device(cfg, {"tensor": 4})
    assert shards["moe_layers/blocks/attn/k"] == plan.Shard(2 * 64 * 2 * 16 * 4, even=False, expert=False)
    assert shards["moe_layers/blocks/attn/q"].bytes_per_device == 2 * 64 * 1 * 16 * 4  # 4 heads split


def test_rollout_mla_cache_replicated_over_tensor():
    # tiny:deepseek's MLA cache row: kv_lora 32 + qk_rope 8 = 40 values per layer, 2 layers, f32:
    # 320 bytes per token, the same on every device of a tensor group (one latent for all heads).
    cfg = tiny.get_config("deepseek")
    r = plan_rollout.rollout_plan(cfg, {"tensor": 2}, context=8, hbm_gib=1.0)
    assert r["kv_cache_bytes_per_token"] == r["kv_bytes_per_token_per_device"] == 2 * 40 * 4
    assert not r["kv_sharded_over_tensor"]


def test_rollout_refuses_and_warns():
    cfg = tiny.get_config()
    with pytest.raises(ValueError, match="--context"):
        plan_rollout.rollout_plan(cfg, {}, context=0)
    with pytest.raises(ValueError, match="--kv_dtype='bf16'"):
        plan_rollout.rollout_plan(cfg, {}, context=8, kv_dtype="bf16")
    r = plan_rollout.rollout_plan(cfg, {}, context=8, hbm_gib=1 / 2**20)  # 1 KiB: below the weights
    assert r["sequences_per_device"] == 0
    assert any("exceed" in w for w in r["rollout_warnings"])


def test_moe_1t_rollout_on_v5p_512_layout():
    # 512 chips as expert:64 x tensor:8; MLA's 70,272 bytes per token sit whole on every chip.
    r = plan_rollout.rollout_plan(
        moe_1t.get_config(), {"expert": 64, "tensor": 8}, context=32768, weight_dtype="bfloat16"
    )
    assert r["inference_devices"] == 512
    assert r["kv_bytes_per_token_per_device"] == 70_272
    assert r["kv_bytes_per_sequence_per_device"] == 32768 * 70_272
    free = 95 * 2**30 - r["weight_bytes_per_device"]
    assert r["sequences_per_device"] == free // (32768 * 70_272) > 0
    assert r["sequences_on_mesh"] == r["sequences_per_device"] * 64


# --- MoE all-to-all ----------------------------------------------------------------------------------------


def _balanced_a2a_bytes(tokens: int, top_k: int, d: int, itemsize: int, ep: int, num_experts: int) -> int:
    """An independent count: a device's tokens * top_k assignments go round-robin over all experts
    (balanced when num_experts divides them), expert e lives on device e // (num_experts / ep); the
    rows whose expert is on another device are sent once to dispatch and once to combine."""
    import numpy as np

    expert_A = np.arange(tokens * top_k) % num_experts
    home = 0  # by symmetry every device sends the same; take device 0
    remote = np.count_nonzero(expert_A // (num_experts // ep) != home)
    return 2 * int(remote) * d * itemsize


def test_all_to_all_bytes_by_hand_and_by_count():
    # 16 tokens, top-2, D 64, f32, expert axis 4: 2 * 16 * 2 * 64 * 4 * 3/4 = 12,288 bytes.
    # Counted: 32 assignments over 4 experts (1 per device), 8 stay, 24 rows of 256 bytes leave, twice.
    assert plan_rollout.all_to_all_bytes_per_layer(16, 2, 64, 4, 4) == 12_288
    assert _balanced_a2a_bytes(16, 2, 64, 4, 4, 4) == 12_288
    # Kimi K2 geometry: 4096 tokens, top-8, D 7168, bf16, 64 expert shards of 6 experts each.
    kimi = plan_rollout.all_to_all_bytes_per_layer(4096, 8, 7168, 2, 64)
    assert kimi == 2 * 4096 * 8 * 7168 * 2 * 63 // 64 == 924_844_032
    # Counted on 48 tokens (384 assignments, one per expert: exactly balanced): 378 leave device 0.
    assert plan_rollout.all_to_all_bytes_per_layer(48, 8, 7168, 2, 64) == 2 * 378 * 7168 * 2
    assert _balanced_a2a_bytes(48, 8, 7168, 2, 64, 384) == 2 * 378 * 7168 * 2
    assert plan_rollout.all_to_all_bytes_per_layer(4096, 8, 7168, 2, 1) == 0  # one shard: all local


def test_tokens_per_device():
    # 8 rows over data 2 x expert 2 (act_batch), 30 tokens over sequence 4 rounded up: 2 x 8.
    assert plan.tokens_per_device({"data": 2, "expert": 2, "sequence": 4}, 8, 30) == 16


def test_all_to_all_plan_totals():
    # tiny on expert:2, 32 tokens per device: 2 * 32 * 2 * 64 * 4 / 2 = 16,384 per layer; 2 MoE layers;
    # forward + backward of 3 micro-batches: 6 x 32,768.
    cfg = tiny.get_config()
    a = plan_rollout.all_to_all_plan(cfg, {"expert": 2}, 32, micro_batches=3)
    assert a["a2a_bytes_per_layer"] == 16_384
    assert a["a2a_bytes_per_forward"] == 2 * 16_384
    assert a["a2a_bytes_per_train_step"] == 6 * 2 * 16_384
    assert plan_rollout.all_to_all_plan(cfg, {"data": 2}, 32) == {}  # no expert axis: no all-to-all


def test_expert_parallel_buffer_bytes_by_hand():
    # tiny (4 experts, top-2, d_model 64, f32) on expert 4 x data 2, batch 8 x 16: one row of T' = 16 tokens
    # per device; J = 4, X = 1. Dropless C = 16 * min(2, 1) = 16: one buffer 4 * 16 * 64 * 4 = 16,384 bytes.
    # ep_capacity_factor 1: C = ceil(1 * 16 * 2 / 4) = 8, 8,192 bytes. Neither is in the total.
    cfg = tiny.get_config()
    mesh = {"expert": 4, "data": 2}
    p = plan.plan(cfg, mesh, 8, 16)
    assert (p["ep_capacity_factor"], p["ep_buffer_bytes_dropless"], p["ep_buffer_bytes"]) == (
        0.0,
        16_384,
        16_384,
    )
    cfg.model.moe.ep_capacity_factor = 1.0
    p = plan.plan(cfg, mesh, 8, 16)
    assert (p["ep_buffer_bytes_dropless"], p["ep_buffer_bytes"]) == (16_384, 8192)
    assert p["total_bytes_per_device"] == plan.plan(tiny.get_config(), mesh, 8, 16)["total_bytes_per_device"]
    assert "0.02 MiB dropless, 0.01 MiB at ep_capacity_factor 1" in plan.format_table(p)
    assert plan.plan(cfg, {"data": 8}, 8, 16)["ep_buffer_bytes"] is None  # no expert axis


# --- XLA check ---------------------------------------------------------------------------------------------

# Arguments (state + batch), outputs (state + metrics) and the donated state are exact quantities; the
# estimate leaves out only scalars: the step, optax's two counts and the rng key (20 bytes) in the
# arguments, ~180 f32 metrics in the outputs (~0.1% of tiny's ~0.5 MB state per device). 1% bounds
# that; a wrong sharding or dtype of any parameter or moment would be off by far more.
EXACT_RTOL = 0.01


def test_xla_check_tiny_on_a_mesh():
    mesh = {"fsdp": 2, "tensor": 2}
    cfg = tiny.get_config()
    p = plan.plan(cfg, mesh, 8, 32)
    xla = plan_xla.train_step_memory(cfg, mesh, 8, 32)
    est = plan_xla.estimate(p, plan_xla.batch_bytes_per_device(plan_xla.with_rl(cfg), mesh, 8, 32))
    assert min(xla.argument, xla.output, xla.alias, xla.temp) > 0 and xla.generated_code >= 0
    # Batch by hand: 8 rows over fsdp 2 = 4 rows of 32: tokens, positions (int32), mask, behaviour
    # log-probs (f32) 4 x 32 x 4 bytes each, advantages 4 x 4.
    assert est.argument - est.output == 4 * 4 * 32 * 4 + 4 * 4
    for name in ("argument", "output", "alias"):
        assert abs(getattr(xla, name) / getattr(est, name) - 1) < EXACT_RTOL, name
    # The activation model counts the named intermediates, a subset of what autodiff keeps, and XLA
    # adds its scratch: the estimate's temp is below XLA's (rl/plan/xla.py says what makes up the rest).
    assert est.temp < xla.temp


def test_xla_check_needs_the_devices():
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=16"):
        plan_xla.mesh_devices({"data": 16})  # conftest gives 8 fake CPU devices
