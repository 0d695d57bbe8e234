"""python -m benchmarks routing_replay [--seeds=0,1,2] [--batches=16] [--dtypes=bfloat16,float32]

Routing replay (`rl.routing_replay`) measured on the same batches with and without the recorded experts.

Per seed, the main job's SFT warm start of `configs/grpo.py:test` (`rl.train.train(sft_only=True)`, f32: the
tiny MoE model, 2 MoE layers of 4 experts, top-2) is restored from its checkpoint. Then, per compute dtype,
the same parameters go to an engine that records routing (`rl.validate.engine_config` turns
`record_routing` on with rl.routing_replay), and `--batches` rollout batches are collected as the main job
collects them (`rl.rollout.collect` on the `debug` domain, `batch_lib.make_batch(routing=True)`). Each batch
goes to the main job's GRPO update (`rl.train_step.make_grpo_update`) twice, each time on a fresh copy of
the same train state: once with rl.routing_replay (the training forward uses the experts the engine chose)
and once without (the trainer routes afresh). The update's metrics come from the forward before its
parameter change, so its `mismatch_kl` (k3), `mismatch_kl_k1`, `mismatch_out_of_band` and
`mismatch_ratio_max` / `_min` are what the main job logs as `train/mismatch_*` for that batch, on the same
sampled tokens, engine log-probs and parameters; the updated states are dropped (the learning rate plays no
part). Also per batch: `routing_flips`, the fraction of (MoE layer, fed token) rows whose expert set in the
trainer's fresh routing differs from the record (only those rows can differ between the two arms).

Bytes: what the engine stores per cached token (`engine.kv["experts"]` [L_moe, pages, page_size, k], int8
when num_experts <= 127 else int16: `inference.routing`) beside its K/V bytes per token, and what the
trainer's batch carries per token (`expert_indices` int32 [L_moe, B, T, k]); the same record's bytes for
`configs/deepseek_v3.py` (`routing.init_pages`, not allocated).

Lines: `routing_replay_run` (command, load), one `routing_replay` line per (seed, dtype, batch), one
`routing_replay_summary` per dtype (mean, min and max over the batches; each seed's mean KL), and
`routing_replay_bytes`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import job_batch  # noqa: E402
from benchmarks.record import emit, loadavg  # noqa: E402
from configs import deepseek_v3, grpo  # noqa: E402
from inference import routing  # noqa: E402
from model import config as model_config  # noqa: E402
from rl import batch as batch_lib
from rl import run as run_dir

METRICS = (  # the update's `rl.grpo.mismatch_metrics` of each arm; the summary takes the first three
    "mismatch_kl",
    "mismatch_kl_k1",
    "mismatch_out_of_band",
    "mismatch_ratio_max",
    "mismatch_ratio_min",
)


def config(seed: int, dtype: str = "float32", replay: bool = True):
    cfg = grpo.get_config("test")
    cfg.model.compute_dtype = dtype
    cfg.rl.seed, cfg.rl.routing_replay = seed, replay
    return cfg


def warm_start(seed: int):
    """The train state after the main job's SFT warm start of `config(seed)`, restored from its checkpoint."""
    from rl import train

    cfg = config(seed)
    with tempfile.TemporaryDirectory(prefix="routing_replay_") as workdir:
        train.train(cfg, workdir, sft_only=True, run_eval=False)
        state, _ = run_dir.restore_state(cfg, workdir)
    return state


def fed_rows(mask_BT: np.ndarray) -> np.ndarray:
    """[B, T] True at the positions the engine fed (and recorded): every position before a row's last token
    (its last completion token is never fed); padding rows have none."""
    t = np.arange(mask_BT.shape[1])
    last_B = np.where(mask_BT.any(axis=1), mask_BT.shape[1] - 1 - np.argmax(mask_BT[:, ::-1] > 0, axis=1), 0)
    return t[None, :] < last_B[:, None]


def routing_flips(fresh_LBTk: np.ndarray, recorded_LBTk: np.ndarray, fed_BT: np.ndarray) -> float:
    """Fraction of (MoE layer, fed position) rows whose expert sets differ."""
    differ_LBT = np.any(np.sort(fresh_LBTk, -1) != np.sort(recorded_LBTk, -1), axis=-1)
    return float(differ_LBT[:, fed_BT].mean())


def measure(seed: int, dtype: str, params, model_state, pool, batches: int, out: list[dict]) -> dict:
    """The paired metrics of `batches` rollout batches of one engine; returns the engine's bytes per token."""
    from inference import Engine
    from model.io.tokenizer import load_tokenizer
    from rl import data, losses, rollout, train_state, train_step, validate

    cfg = config(seed, dtype)
    rl = cfg.rl
    model_def, state = train_state.init_state(cfg, seed=seed, params=params, model_state=model_state)
    engine = Engine(cfg, train_state.weights(state), validate.engine_config(cfg))
    tokenizer = load_tokenizer(None, vocab_size=cfg.model.vocab_size)
    stream = data.domain_stream(cfg, "debug", "train")
    updates = {r: train_step.make_grpo_update(config(seed, dtype, r), model_def) for r in (False, True)}
    fresh = jax.jit(
        lambda params, rest, batch: losses.policy_forward(
            cfg, model_def, params, batch, replay=False, rest=rest
        )[1]["expert_indices"]
    )
    for b in range(batches):
        samples, counts = rollout.collect(
            engine,
            pool,
            stream.next_tasks,
            tokenizer,
            groups=rl.prompts_per_step,
            sampling=rollout.sampling_params(
                rl, tokenizer, seed=rollout.derive_seed(rl.seed, "batch", b), n=rl.group_size
            ),
            **rollout.collect_options(rl),
        )[:2]
        line = {"bench": "routing_replay", "seed": seed, "dtype": dtype, "batch": b, "loadavg": loadavg()}
        if not samples:
            out.append(emit({**line, "skipped": "every group filtered out", "counts": counts}))
            continue
        batch, _ = job_batch(cfg, samples, routing=True)
        for replay, update in updates.items():
            copy = jax.tree.map(lambda x: jnp.array(x, copy=True), state)  # the update donates its state
            _, metrics = update(copy, batch)
            line["replay" if replay else "no_replay"] = {k: float(f"{metrics[k]:.6g}") for k in METRICS}
        fresh_LBTk = np.asarray(fresh(state.params, state.model_state, batch))
        line["routing_flips"] = round(
            routing_flips(fresh_LBTk, batch["expert_indices"], fed_rows(batch["mask_BT"])), 6
        )
        line["tokens"] = int(batch["mask_BT"].sum())
        out.append(emit(line))
    experts = engine.kv["experts"]  # [L_moe, pages, page_size, k]
    layers, pages, page_size, k = experts.shape
    slots = pages * page_size
    kv = sum(x.nbytes for name, x in engine.kv.items() if name != "experts")
    # the trainer's [L, 1, 1, k]
    in_batch = batch_lib.empty_batch(1, 1, routing=(layers, k))["expert_indices"]
    return {
        "dtype": dtype,
        "record_dtype": str(experts.dtype),
        "record_bytes_per_cached_token": experts.nbytes // slots,
        "kv_bytes_per_cached_token": kv // slots,
        "trainer_batch_bytes_per_token": in_batch.nbytes,
    }


def summary(dtype: str, lines: list[dict]) -> dict:
    done = [line for line in lines if line["dtype"] == dtype and "replay" in line]
    stats = lambda xs: {"mean": float(f"{np.mean(xs):.4g}"), "min": min(xs), "max": max(xs)}  # noqa: E731
    out: dict = {"bench": "routing_replay_summary", "dtype": dtype, "batches": len(done)}
    for arm in ("no_replay", "replay"):
        out[arm] = {k: stats([line[arm][k] for line in done]) for k in METRICS[:3]}
    out["routing_flips"] = stats([line["routing_flips"] for line in done])
    out["tokens"] = sum(line["tokens"] for line in done)
    seeds = sorted({line["seed"] for line in done})
    seed_mean = lambda arm, seed: np.mean([x[arm]["mismatch_kl"] for x in done if x["seed"] == seed])  # noqa: E731
    out["mismatch_kl_mean_per_seed"] = {
        arm: {seed: float(f"{seed_mean(arm, seed):.4g}") for seed in seeds} for arm in ("no_replay", "replay")
    }
    without, with_ = out["no_replay"]["mismatch_kl"]["mean"], out["replay"]["mismatch_kl"]["mean"]
    out["kl_ratio_without_over_with"] = float(f"{without / with_:.4g}") if with_ else None
    return out


def record_bytes(m) -> dict:
    """The record's dtype and bytes per cached token for model config `m`, from `routing.init_pages`."""
    layers = model_config.layer_counts(m)[1]
    one = jax.eval_shape(lambda: routing.init_pages(layers, 1, 1, m.moe.top_k, m.moe.num_experts))
    return {
        "moe_layers": layers,
        "top_k": m.moe.top_k,
        "num_experts": m.moe.num_experts,
        "dtype": str(one.dtype),
        "bytes": one.size * one.dtype.itemsize,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--seeds", default="0,1,2", help="rl.seed values, each its own warm start")
    p.add_argument("--batches", type=int, default=16, help="rollout batches per seed and dtype")
    p.add_argument("--dtypes", default="bfloat16,float32", help="model.compute_dtype values")
    a = p.parse_args(argv)
    from envs.pool import EnvPool
    from rl import data

    seeds = [int(s) for s in a.seeds.split(",") if s]
    dtypes = [d for d in a.dtypes.split(",") if d]
    emit(
        {
            "bench": "routing_replay_run",
            "backend": jax.default_backend(),
            "cpus": os.cpu_count(),
            "loadavg": loadavg(),
        }
    )
    t0 = time.perf_counter()
    lines: list[dict] = []
    stored: dict = {}
    cfg = config(0)
    pool_args = dict(domains=data.env_kwargs(cfg), timeout_s=cfg.rl.env_timeout_s)
    with EnvPool(cfg.rl.env_workers, **pool_args) as pool:
        for seed in seeds:
            state = warm_start(seed)
            for dtype in dtypes:
                stored[dtype] = measure(seed, dtype, state.params, state.model_state, pool, a.batches, lines)
    for dtype in dtypes:
        emit(summary(dtype, lines))
    m = cfg.model
    emit(
        {
            "bench": "routing_replay_bytes",
            "config": "configs/grpo.py:test",
            "moe_layers": model_config.layer_counts(m)[1],
            "top_k": m.moe.top_k,
            "num_experts": m.moe.num_experts,
            "engine": list(stored.values()),
            "deepseek_v3": record_bytes(deepseek_v3.get_config().model),
            "loadavg": loadavg(),
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    )


if __name__ == "__main__":
    main()
