"""python -m benchmarks plan_pod [--out=benchmarks/results/plan_pod.jsonl] [--markdown=FILE]

The planner's answer to "which model does each pod layout hold": for each machine (TPU v5p-256 and v5p-512
slices, one node of 8 H100), trainer and sampler layout and model (configs/moe_1t.py, configs/deepseek_v3.py,
configs/moe_30b.py; each in its own param_dtype, f32, and in bf16), the bytes one device holds, from the
config alone (nothing allocated):

- live between steps (`rl.plan.memory.device_bytes`, what the main job logs as memory/*): params, AdamW
  state, the colocated engine's weights, other; the KL reference is off (configs/grpo.py's default);
- the train step on top (`model.plan.plan`): f32 gradients and activations of one 4,096-token row per
  device (remat full, the configs' own);
- KV pages of the engine at a 32,768-token context (max_prompt_len 2,048 + max_new_tokens 30,720;
  page_size 16, num_draft 4, the default prefix cache of half the slots' pages), per decode slot.

`decode_slots` is the largest engine max_batch whose pages fit beside the rest in the chip's HBM (0: not
even one; `fits` is decode_slots >= 1). HBM: v5p 95 GiB a chip (read as GiB, as `rl.plan.rollout`
does: the spec sheet's "95 GB"), H100 80 GiB. A v5p-N slice has N TensorCores, N / 2 chips (Cloud TPU's
v5p topologies: v5p-256 is 4x4x8, 128 chips; v5p-512 is 4x8x8, 256 chips); JAX sees one device per chip.

One JSON line per row to --out (first line: the command and settings), and with --markdown the table of
the largest model each layout holds.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.record import emit  # noqa: E402
from configs import deepseek_v3, moe_1t, moe_30b  # noqa: E402
from model import plan as plan_lib  # noqa: E402
from rl import validate  # noqa: E402
from rl.plan import memory as plan_memory  # noqa: E402
from rl.plan.memory import with_rl  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONTEXT_PROMPT, CONTEXT_NEW = 2048, 30_720
ROW_TOKENS = 4096

MACHINES = {
    # name: (chips, HBM GiB per chip, [(trainer mesh, sampler mesh), ...])
    "v5p-256": (
        128,
        95.0,
        [
            ({"fsdp": 2, "expert": 64}, {"expert": 64, "tensor": 2}),
            ({"fsdp": 128}, {"expert": 64, "tensor": 2}),
            ({"expert": 32, "tensor": 4}, {"expert": 32, "tensor": 4}),
        ],
    ),
    "v5p-512": (
        256,
        95.0,
        [
            ({"fsdp": 4, "expert": 64}, {"expert": 64, "tensor": 4}),
            ({"fsdp": 256}, {"expert": 64, "tensor": 4}),
            ({"expert": 64, "tensor": 4}, {"expert": 64, "tensor": 4}),
        ],
    ),
    "8xH100": (
        8,
        80.0,
        [
            ({"expert": 8}, {"expert": 8}),
            ({"fsdp": 8}, {"expert": 8}),
            ({"expert": 4, "tensor": 2}, {"expert": 4, "tensor": 2}),
        ],
    ),
}
MODELS = {"moe_1t": moe_1t, "deepseek_v3": deepseek_v3, "moe_30b": moe_30b}
DTYPES = ("float32", "bfloat16")


def _config(name: str, param_dtype: str):
    cfg = with_rl(MODELS[name].get_config())
    cfg.model.param_dtype = param_dtype
    cfg.rl.max_prompt_len, cfg.rl.max_new_tokens = CONTEXT_PROMPT, CONTEXT_NEW
    cfg.rl.engine.max_batch = 1
    return cfg


def _mesh_text(sizes: dict) -> str:
    return ",".join(f"{a}:{s}" for a, s in sizes.items() if s > 1) or "one device"


def row(machine: str, name: str, dtype: str, trainer: dict, sampler: dict) -> dict:
    chips, hbm_gib, _ = MACHINES[machine]
    cfg = _config(name, dtype)
    trainer = plan_lib.mesh_sizes({**trainer, "data": chips // math.prod(trainer.values())})
    sampler = {**sampler, "data": chips // math.prod(sampler.values())}
    live = plan_memory.device_bytes(cfg, trainer, sampler)
    rows = trainer["data"] * trainer["fsdp"] * trainer["expert"]
    step = plan_lib.plan(cfg, trainer, rows, ROW_TOKENS, hbm_gib=hbm_gib)
    ecfg = validate.engine_config(cfg)
    page = live["kv_pages"] // ecfg.pool_pages  # bytes of one page on a device (every page array has a P dim)
    fixed = (
        live["total"] - live["kv_pages"] + step["grad_bytes_per_device"] + step["activation_bytes_per_device"]
    )
    free_pages = (int(hbm_gib * 2**30) - fixed) // page
    m = ecfg.pages_per_seq
    slots = 0
    while 1 + (slots + 1) * m + (slots + 1) * m // 2 <= free_pages:  # EngineConfig.pool_pages, default prefix
        slots += 1
    return {
        "bench": "plan_pod",
        "pod": machine,
        "chips": chips,
        "hbm_gib": hbm_gib,
        "config": f"configs/{name}.py",
        "params_total": step["params_total"],
        "param_dtype": dtype,
        "trainer_mesh": _mesh_text(trainer),
        "sampler_mesh": _mesh_text(sampler),
        **{f"{k}_bytes": v for k, v in live.items() if k not in ("kv_pages", "total")},
        "live_bytes_without_kv": live["total"] - live["kv_pages"],
        "grad_bytes": step["grad_bytes_per_device"],
        "activation_bytes": step["activation_bytes_per_device"],
        "kv_bytes_per_page": page,
        "kv_bytes_per_slot": page * (m + m // 2),
        "peak_bytes_without_kv": fixed,
        "decode_slots": slots,
        "fits": slots >= 1,
        "warnings": step["warnings"],
    }


def _short(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16"}[dtype]


def markdown(lines: list[dict]) -> str:
    """Per machine and layout: each model's decode slots (or how far over it is), and the largest held."""
    heads = [(name, dtype) for name in MODELS for dtype in DTYPES]
    out = [
        "Decode slots (engine max_batch) at a 32k context that fit in each chip's HBM beside the train state "
        "(params, AdamW mu and nu in param_dtype), the colocated engine's weights, and the train step's f32 "
        "gradients and activations of one 4k-token row per chip (`python -m benchmarks plan_pod`, planner "
        "estimates); no (+X GiB): one slot would exceed HBM by X.",
        "",
        "| machine | trainer mesh | sampler mesh | "
        + " | ".join(f"{n} {_short(d)}" for n, d in heads)
        + " | largest held |",
        "|---" * (len(heads) + 4) + "|",
    ]
    keyed = {(x["pod"], x["trainer_mesh"], x["config"], x["param_dtype"]): x for x in lines}
    for machine, (chips, hbm_gib, layouts) in MACHINES.items():
        for trainer, sampler in layouts:
            t = _mesh_text({**trainer, "data": chips // math.prod(trainer.values())})
            s = _mesh_text({**sampler, "data": chips // math.prod(sampler.values())})
            cells, held = [], {}  # model -> (params, dtypes that fit)
            for name, dtype in heads:
                x = keyed[(machine, t, f"configs/{name}.py", dtype)]
                if x["fits"]:
                    cells.append(f"{x['decode_slots']} slots")
                    held.setdefault(name, (x["params_total"], []))[1].append(_short(dtype))
                else:
                    over = (x["peak_bytes_without_kv"] + x["kv_bytes_per_slot"]) / 2**30 - hbm_gib
                    cells.append(f"no (+{over:.0f} GiB)")
            largest = max(held.items(), key=lambda kv: kv[1][0], default=None)
            held = "none" if largest is None else f"{largest[0]} ({', '.join(largest[1][1])})"
            out.append(
                f"| {machine} ({chips} x {hbm_gib:g} GiB) | {t} | {s} | " + " | ".join(cells) + f" | {held} |"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(RESULTS, "plan_pod.jsonl"))
    ap.add_argument("--markdown", default="", help="also write the Markdown table to this file")
    args = ap.parse_args()
    settings = (
        f"context {CONTEXT_PROMPT} + {CONTEXT_NEW} tokens, one {ROW_TOKENS}-token training row per "
        "device, configs/grpo.py rl defaults otherwise (KL off, engine colocated, prefix cache half the "
        "slots' pages)"
    )
    open(args.out, "w").close()  # the file holds one run: the settings line, then one line per row
    emit({"bench": "plan_pod_settings", "settings": settings}, out=args.out)
    lines = []
    for machine, (_, _, layouts) in MACHINES.items():
        for trainer, sampler in layouts:
            for name in MODELS:
                for dtype in DTYPES:
                    lines.append(emit(row(machine, name, dtype, trainer, sampler), out=args.out))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(lines) + "\n")


if __name__ == "__main__":
    main()
