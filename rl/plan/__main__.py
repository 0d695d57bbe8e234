"""python -m rl.plan --config=configs/moe_1t.py --mesh=data:8,fsdp:32,expert:64,tensor:4

The planner of a main job on a mesh given as axis sizes (nothing of model size is allocated): the model's
parameter counts, FLOPs and bytes per device (`model.plan`), the all-to-all bytes and the rollout engine's
weights, KV and sequences per device (`rl.plan.rollout`), the live bytes per device the main job logs as
memory/* (`--sampler`, `rl.plan.memory`), and XLA's own memory analysis of the compiled train step
(`--xla`, `rl.plan.xla`).
"""

from __future__ import annotations

import json

from absl import flags
from ml_collections import config_flags

from configs import cli
from configs.errors import UserError
from model.plan import mesh_sizes, parse_mesh, plan, tokens_per_device
from model.plan_format import format_all
from rl.plan import memory, rollout, xla


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {list(argv[1:])}; flags look like --config=FILE")
    f = flags.FLAGS
    cfg = f.config
    mesh = parse_mesh(f.mesh) if f.mesh else mesh_sizes(dict(cfg.mesh.shape))
    batch = cfg.batch_size if f.batch is None else f.batch
    seq_len = cfg.seq_len if f.seq_len is None else f.seq_len
    result = plan(cfg, mesh, batch, seq_len, hbm_gib=f.hbm_gib)
    micro = result["micro_batches"]
    a2a_tokens = f.a2a_tokens or tokens_per_device(mesh, -(-batch // micro), seq_len)
    result["train_a2a"] = rollout.all_to_all_plan(cfg, mesh, a2a_tokens, micro_batches=micro)
    if f.inference_mesh:
        infer = parse_mesh(f.inference_mesh)
        result.update(
            rollout.rollout_plan(
                cfg,
                infer,
                context=f.context,
                hbm_gib=f.hbm_gib,
                weight_dtype=f.inference_dtype,
                kv_dtype=f.kv_dtype,
            )
        )
        result["rollout_a2a"] = rollout.all_to_all_plan(cfg, infer, a2a_tokens)
    if f.sampler:
        sampler = None if f.sampler == "auto" else parse_mesh(f.sampler)
        result["device_bytes"] = memory.device_bytes(cfg, mesh, sampler)
    if f.xla:
        result.update(xla.xla_plan(cfg, mesh, batch, seq_len, result))
    print(json.dumps(result) if f.json else format_all(result))


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "configs/*.py file (`path:arg` for variants)")
    flags.DEFINE_string("mesh", None, "axis:size,... replacing cfg.mesh.shape; unnamed axes are 1")
    flags.DEFINE_integer("batch", None, "rows per step (default cfg.batch_size)")
    flags.DEFINE_integer("seq_len", None, "tokens per row (default cfg.seq_len)")
    flags.DEFINE_float("hbm_gib", 95.0, "memory of one device in GiB (default: a TPU v5p chip's 95)")
    flags.DEFINE_bool("json", False, "print one JSON line instead of a table")
    flags.DEFINE_bool(
        "xla",
        False,
        "also compile the GRPO train step for --mesh on this machine's devices and print XLA's "
        "memory_analysis() beside the estimate (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)",
    )
    flags.DEFINE_string(
        "inference_mesh",
        None,
        "axis:size,... of the engine's mesh: prints weights, KV and sequences per device",
    )
    flags.DEFINE_integer("context", 32768, "tokens of one rollout sequence (prompt + completion)")
    flags.DEFINE_string("inference_dtype", None, "dtype of the engine's weights (default: param_dtype)")
    flags.DEFINE_string("kv_dtype", None, "dtype of the KV cache (default: compute_dtype)")
    flags.DEFINE_string(
        "sampler",
        None,
        "data:N,expert:N,tensor:N of the engine's mesh, or auto (the main job's: rl.engine.mesh): prints "
        "the live bytes per device the main job logs as memory/* (rl.plan.memory) for --mesh",
    )
    flags.DEFINE_integer(
        "a2a_tokens",
        None,
        "tokens per device for the all-to-all bytes (default: one micro-batch's on --mesh)",
    )
    flags.mark_flag_as_required("config")
    cli.run(main)
