"""python -m benchmarks grpo_step

Seconds per GRPO step of the main job (`python -m rl.train`) on the Tunix peer's shapes, beside Tunix's
own step (`--tunix_python`: a venv with google-tunix, running `--peer_script`: the peer's
`tunix_grpo_step_bench.py`; neither is part of this repository, so both are given by path).

Shapes (the peer's defaults; `decode.PEER_DIMS` / `PEER_MOE`): a random-init Qwen3-like model (4 layers,
d_model 256, 4 query / 2 kv heads of 64, vocab 8192, qk-norm, rope theta 1e6, f32), dense d_ff 1024
(`qwen3`) or 8 experts top-2 of d_ff 256 (`qwen3moe`); 4 prompts x 4 samples, prompts of bos + 31 random ids,
64 new tokens at T=1 with no stop token (the peer's eos is never emitted: every completion is 64 tokens),
the GRPO loss of Tunix's GRPOConfig defaults (clip 0.2, sequence-mean-token-mean, k1 KL to the step-0
reference with beta 0.04), AdamW at lr 1e-4; reward: the fraction of completion ids that are even, read
from the completion's text (ids joined by spaces), as the peer scores it.

One step is what the main job's loop does per step, built from its own functions: `rl.rollout.collect`
(`inference.Engine.generate` with `rollout.sampling_params`, then the reward through the pool's
`score_many`), `rl.batch.make_batch` (group advantages, padding to the fixed [rows, seq_len]),
`rl.distributed.global_batch`, the update of `rl.train_step.make_grpo_update` (reference log-probs of the
frozen copy, then the jitted train step) and the main job's weight sync (`rl.sampler.weight_push`:
`WeightSync.push` -> `Engine.update_params`), on the main job's engine config (`validate.engine_config`)
and meshes. Not `rl.train.train` itself: its prompts are task text from envs domains scored in worker
processes, so random-id prompts and this reward need a stand-in for the env pool (in this process; one
rollout round, `max_attempts=1`, so no back-fill round changes the work).

Phases (generate, reward, rollout bookkeeping, advantages + batch, reference log-probs, train, weight
sync) end with `jax.block_until_ready` on their outputs, so a phase's time is its own (the reference
log-probs are timed inside the update: `timed_update`); the step is their sum plus the loop's glue. The
engine compiles in `warmup()` before the first step, as in the main job: `step_s_first` excludes it,
`step_s_first_incl_warmup` adds it. `phase_s_all` lists every step's phases of 5 ms or more (on a shared VM a
step's time can move by a third between runs: it shows which phase moved).

Per arch one `grpo_step` line (ours), then with --tunix_python one `grpo_step_tunix` line (the peer's JSON,
same dims and steps, run right after ours so both see the same machine load) and one `grpo_step_compare`
line (ratios tunix / ours and every difference between the two measurements we know of); finally a
`grpo_step_summary` line with the targets (step ratio >= 2, first step <= Tunix's) and whether they are met.

    python -m benchmarks grpo_step --quick
    python -m benchmarks grpo_step --steps=5 --tunix_python=TUNIX_VENV/bin/python \
        --peer_script=PEERS/tunix_grpo_step_bench.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time
from collections import defaultdict
from unittest import mock

import jax
import numpy as np

from benchmarks import matmul_peak
from benchmarks.common import PEER_DIMS, PEER_MOE, check_peers, job_batch, model_config
from benchmarks.record import emit, loadavg
from configs import grpo as grpo_config  # noqa: E402
from configs import schema  # noqa: E402
from envs import Score, Task  # noqa: E402
from inference import Engine  # noqa: E402
from model import plan  # noqa: E402
from rl import distributed, losses, rollout, sampler, train_state, train_step, validate  # noqa: E402

SHAPES = dict(prompts=4, group=4, prompt_len=32, new_tokens=64, beta=0.04, lr=1e-4)
TARGETS = dict(step_ratio=2.0, first_step_ratio=1.0)  # tunix / ours: at least these
_COMPILES = {"n": 0, "s": 0.0}


def _on_compile(event: str, duration: float, **kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["n"] += 1
        _COMPILES["s"] += duration


def grpo_cfg(arch: str):
    """The peer's model (decode.model_config) with the main job's `rl` block set to the peer's workload."""
    cfg = model_config(**PEER_DIMS, **(PEER_MOE if arch == "qwen3moe" else {}))
    rl = cfg.rl = schema.build(grpo_config.RL)
    rl.prompts_per_step, rl.group_size = SHAPES["prompts"], SHAPES["group"]
    rl.max_prompt_len, rl.max_new_tokens, rl.temperature = SHAPES["prompt_len"], SHAPES["new_tokens"], 1.0
    # The peer's objective (Tunix GRPOConfig defaults, google-tunix 0.1.7): KL mode "kl" (k1), loss_agg_mode
    # sequence-mean-token-mean, epsilon 0.2 on both sides. The TIS correction stays (our default).
    rl.loss.update(
        kl_kind="k1", kl_coef=SHAPES["beta"], aggregation="seq-mean-token-mean", clip_low=0.2, clip_high=0.2
    )
    # optax.adamw(1e-4) as the peer has it: constant lr, its default weight decay; our clipping stays.
    rl.optim.update(lr=SHAPES["lr"], warmup_steps=0, min_lr_ratio=1.0, weight_decay=1e-4)
    rl.max_attempts, rl.quality_gate = 1, False
    # The engine sized for the step, as the peer's sampler is (batch 16, its cache the prompt + new tokens):
    # one decode slot per row (the default 32 slots would run 16 idle rows every decode step) and one
    # prefill shape for the step's 4 prompts of 31 tokens (min_bucket = prefill_chunk = 32 and
    # min_prefill_batch = prefill_batch = 4: the engine compiles prefill at 4 x 32 only, not also at 16
    # tokens or 1 and 2 rows), as the peer's sampler compiles its one shape.
    rl.engine.update(
        max_batch=rl.prompts_per_step * rl.group_size,
        prefill_chunk=32,
        min_bucket=32,
        prefill_batch=rl.prompts_per_step,
        min_prefill_batch=rl.prompts_per_step,
    )
    cfg.batch_size = rl.prompts_per_step * rl.group_size
    cfg.seq_len = rl.max_prompt_len + rl.max_new_tokens
    validate.validate(cfg)
    return cfg


class IdTokenizer:
    """Ids as space-separated text, bos 1 and no stop id (the peer's IntTokenizer, whose eos is never
    sampled): what rollout needs of a `model.io.tokenizer.Tokenizer` for random-id prompts."""

    bos_id, eos_id, pad_id, stop_ids = 1, None, 0, ()

    def encode(self, text: str, **kw) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **kw) -> str:
        return " ".join(str(int(i)) for i in ids)


class Phases:
    """Wall seconds per phase name, one dict per step; `phase(name)` times a block."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def new_step(self) -> None:
        self.steps.append(defaultdict(float))

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        yield
        self.steps[-1][name] += time.perf_counter() - t0


class TimedEngine:
    """The engine as `rollout.collect` sees it, with `generate` timed (its completions are host lists)."""

    def __init__(self, engine: Engine, phases: Phases):
        self.engine, self.ecfg, self.phases = engine, engine.ecfg, phases

    def generate(self, prompts, sampling):
        with self.phases.phase("generate"):
            return self.engine.generate(prompts, sampling)


class EvenIdScorer:
    """Stands in for `envs.EnvPool` in single-turn `rollout.collect` (only `score_many` is called): the
    peer's reward, the fraction of even ids in the completion's text, scored in this process."""

    def __init__(self, phases: Phases):
        self.phases = phases

    def score_many(self, pairs) -> list[Score]:
        with self.phases.phase("reward"):
            out = []
            for _, text in pairs:
                ids = text.split()
                out.append(Score(sum(int(t) % 2 == 0 for t in ids) / max(1, len(ids)), "ok"))
            return out


def timed_update(cfg, model_def, mesh, phases: Phases):
    """`rl.train_step.make_grpo_update` as the main job builds it, with the log-prob functions it makes
    timed (each call until its output is ready: the train step needs it before it starts anyway). The
    builder looks `make_logprobs` up in its module when it runs, so the timed wrapper is in place only
    while it builds; the reference's is the one made with processed=False."""
    make_logprobs = train_step.make_logprobs

    def timed_make_logprobs(*args, processed: bool = True, **kwargs):
        fn = make_logprobs(*args, processed=processed, **kwargs)
        name = "proximal_logprobs" if processed else "reference_logprobs"

        def timed(*fn_args, **fn_kwargs):
            with phases.phase(name):
                return jax.block_until_ready(fn(*fn_args, **fn_kwargs))

        timed.compile = fn.compile  # the main job's warm-up compiles it (update.compile), untimed
        return timed

    with mock.patch.object(train_step, "make_logprobs", timed_make_logprobs):
        return train_step.make_grpo_update(cfg, model_def, mesh=mesh)


def run_ours(arch: str, steps: int, trace_dir: str = "") -> dict:
    cfg = grpo_cfg(arch)
    rl = cfg.rl
    load_start, compiles_start = loadavg(), dict(_COMPILES)
    mesh = distributed.trainer_mesh(cfg)
    model_def, state = train_state.init_state(cfg, mesh=mesh, seed=rl.seed)
    ref_params = train_state.reference_weights(state, rl.reference_dtype)
    params_before = jax.tree.map(np.asarray, state.params)
    engine = Engine(
        cfg,
        train_state.weights(state),
        validate.engine_config(cfg),
        mesh=sampler.layout(cfg, mesh).mesh,
    )
    push_weights = sampler.weight_push(cfg, engine, sampler.layout(cfg, mesh), 1)
    phases, tokenizer = Phases(), IdTokenizer()
    update = timed_update(cfg, model_def, mesh, phases)
    t0, before_warmup = time.perf_counter(), _COMPILES["n"]
    # The main job's warm-up: the engine's warmup() beside the update's compile (rl.train_step.warm_up)
    train_step.warm_up(cfg, engine, update, mesh, state, ref_params, cfg.batch_size)
    warmup_s = time.perf_counter() - t0
    warm_compiles = _COMPILES["n"] - before_warmup
    timed_engine, scorer = TimedEngine(engine, phases), EvenIdScorer(phases)
    rng = np.random.default_rng(0)
    vocab, body = cfg.model.vocab_size, SHAPES["prompt_len"] - 1  # bos + 31 ids, as the peer's prompts

    def next_tasks(n: int) -> list[Task]:
        ids = rng.integers(3, vocab, (n, body))
        return [
            Task(f"{len(phases.steps)}-{i}", "even_ids", " ".join(map(str, row))) for i, row in enumerate(ids)
        ]

    step_s, records, compiles_before_first, compiles_after_first = [], [], 0, 0
    for i in range(1 + steps):
        phases.new_step()
        if i == 0:
            compiles_before_first = _COMPILES["n"]
        if i == 1:
            compiles_after_first = _COMPILES["n"]
        t0 = time.perf_counter()
        with phases.phase("rollout"):  # generate and reward inside; the rest is rollout bookkeeping
            samples, counts, _, _ = rollout.collect(
                timed_engine,
                scorer,
                next_tasks,
                tokenizer,
                groups=rl.prompts_per_step,
                sampling=rollout.sampling_params(
                    rl, tokenizer, seed=rollout.derive_seed(rl.seed, "batch", i), n=rl.group_size
                ),
                multi_turn=lambda domain: False,
                **rollout.collect_options(rl),
            )
        with phases.phase("advantages_batch"):
            batch, stats = job_batch(cfg, samples)
        tracing = trace_dir and i == steps  # the last step, under jax.profiler
        if tracing:
            jax.profiler.start_trace(os.path.join(os.path.abspath(trace_dir), arch))
        with phases.phase("update"):  # reference log-probs inside; the rest is the train step
            shardings = train_state.batch_shardings(cfg, tuple(batch), mesh, cfg.batch_size)
            batch = distributed.global_batch(batch, shardings, train_state.ROW_AXIS)
            state, metrics = update(state, batch, ref_params=ref_params)
            jax.block_until_ready(state.params)
        if tracing:
            jax.profiler.stop_trace()
        with phases.phase("weight_sync"):
            push_weights(train_state.weights(state))
            jax.block_until_ready(engine.params)
        step_s.append(time.perf_counter() - t0)
        records.append(dict(stats, **counts, **{f"train/{k}": v for k, v in metrics.items()}))
    # Read before the measurements below (the matmul peak compiles its own programs).
    compiles_in_later_steps = _COMPILES["n"] - compiles_after_first

    per_step = []
    for s, total in zip(phases.steps, step_s):
        p = {k: s[k] for k in ("generate", "reward")}
        p["rollout_bookkeeping"] = s["rollout"] - s["generate"] - s["reward"]  # Samples, filter, text
        p["advantages_batch"] = s["advantages_batch"]
        p["reference_logprobs"] = s["reference_logprobs"]
        p["train"] = s["update"] - s["reference_logprobs"]
        p["weight_sync"] = s["weight_sync"]
        p["glue"] = total - sum(p.values())
        per_step.append(p)
    delta = sum(
        float(np.abs(np.asarray(a) - b).sum())
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params_before))
    )
    median = statistics.median(step_s[1:]) if steps else None
    rows = cfg.batch_size
    # Train phase MFU: the policy's forward + backward and the reference forward over the [rows, seq_len]
    # batch (model.plan's matmul FLOPs) less the unembedding of the positions outside the logit window
    # (2 * d_model * vocab FLOPs a position forward, 3x that trained), against the f32 matmul peak measured
    # in this process.
    tokens = rows * cfg.seq_len
    window = losses.logit_window(cfg, cfg.seq_len)
    skipped = 2 * cfg.model.d_model * cfg.model.vocab_size * rows * (cfg.seq_len - window) if window else 0
    flops = {
        "train": plan.flops_per_token(cfg, cfg.seq_len, training=True) * tokens - 3 * skipped,
        "reference_logprobs": plan.flops_per_token(cfg, cfg.seq_len, training=False) * tokens - skipped,
    }
    peak = matmul_peak.measure(sizes=(2048,))["peak_flops"]
    mfu = {}
    if steps:
        for name, f in flops.items():
            seconds = statistics.median(p[name] for p in per_step[1:])
            mfu[name] = {"gflop": round(f / 1e9, 2), "gflop_s": round(f / seconds / 1e9, 1)}
            mfu[name]["mfu"] = round(f / seconds / peak, 4)
        mfu["peak_gflop_s"] = round(peak / 1e9, 1)
    return {
        "bench": "grpo_step",
        "arch": arch,
        "device": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "versions": {"jax": jax.__version__},
        "dims": {
            **PEER_DIMS,
            **(PEER_MOE if arch == "qwen3moe" else {}),
            "dtype": f"{cfg.model.param_dtype}/{cfg.model.compute_dtype}",
            "scan_layers": cfg.model.scan_layers,
            "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params_before)),
        },
        **SHAPES,
        "rows_per_step": rows,
        "engine": {
            k: getattr(engine.ecfg, k, None)
            for k in (
                "max_batch",
                "page_size",
                "prefill_chunk",
                "prefill_batch",
                "min_prefill_batch",
                "min_bucket",
                "scheduler",
                "decode_steps",
            )
        },
        "logit_window": losses.logit_window(cfg, cfg.seq_len),
        "warmup_s": round(warmup_s, 3),  # engine warmup beside the update compile (rl.train_step.warm_up)
        "warmup_compiles": warm_compiles,
        "jit_compiles_in_first_step": compiles_after_first - compiles_before_first if steps else None,
        "step_s_first": round(step_s[0], 3),
        "step_s_first_incl_warmup": round(step_s[0] + warmup_s, 3),
        "step_s_median": round(median, 3) if median else None,
        "step_s_all": [round(s, 3) for s in step_s],
        "gen_tok_per_s_in_step": round(rows * SHAPES["new_tokens"] / median, 1) if median else None,
        "phase_s_first": {k: round(v, 4) for k, v in per_step[0].items()},
        "phase_s_median_after_first": {
            k: round(statistics.median(p[k] for p in per_step[1:]), 4) for k in per_step[0]
        }
        if steps
        else None,
        "phase_s_all": [{k: round(v, 4) for k, v in p.items() if v >= 0.005} for p in per_step],
        "train_mfu": mfu,
        "generated_tokens_mean": [r["generated_tokens_mean"] for r in records],
        "stop_fraction_max": max(r["stop_fraction"] for r in records),
        "dropped_zero_variance_groups": sum(r.get("dropped_zero_variance_groups", 0) for r in records),
        "reward_mean_per_step": [round(r["reward_mean"], 4) for r in records],
        "kl_per_step": [round(r["train/kl"], 6) for r in records],
        "actor_param_abs_delta": round(delta, 4),
        "compiles_after_warmup": engine.stats()["compiles_after_warmup"],
        "jit_compiles_after_first_step": compiles_in_later_steps if steps else None,
        "compile_s_total": round(_COMPILES["s"] - compiles_start["s"], 3),  # this arch: init, engine, steps
        "timing": "perf_counter around each step; every phase ends with block_until_ready on its outputs",
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }


def run_tunix(arch: str, steps: int, python: str, script: str) -> dict:
    """The peer script in its own interpreter, same dims; its --steps counts the first (compiling) step."""
    d, moe = PEER_DIMS, arch == "qwen3moe"
    dims = {k: d[k] for k in ("layers", "d_model", "heads", "kv_heads", "head_dim", "vocab")}
    dims.update(
        ffn=PEER_MOE["expert_ffn"] if moe else d["ffn"],
        experts=PEER_MOE["experts"],
        top_k=PEER_MOE["top_k"],
        prompts=SHAPES["prompts"],
        num_generations=SHAPES["group"],
        prompt_len=SHAPES["prompt_len"],
        new_tokens=SHAPES["new_tokens"],
        temperature=1.0,
        beta=SHAPES["beta"],
        lr=SHAPES["lr"],
        steps=1 + steps,
    )
    cmd = [python, script, "--arch", arch]
    for k, v in dims.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    load_start = loadavg()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    line = {"bench": "grpo_step_tunix", "arch": arch, "loadavg_start": load_start, "loadavg_end": loadavg()}
    if proc.returncode:
        return {**line, "error": proc.stderr.strip().splitlines()[-5:]}
    return {**line, **json.loads(proc.stdout.strip().splitlines()[-1]), "bench": "grpo_step_tunix"}


def differences(ours: dict, tunix: dict) -> list[str]:
    """Every difference between the two measurements that we know of."""
    calls = tunix.get("phase_calls", {})
    out = [
        "step boundaries: ours perf_counter around each step, every phase ended by block_until_ready; "
        "Tunix's the times its learner pulls a batch from the iterator (async dispatch may move work across)",
        "first step: Tunix's includes all its compiles (sampler, reference, actor update); ours compiles "
        "before the loop, as the main job does (rl.train_step.warm_up: the engine's warmup in a thread "
        "beside the update's compile, warmup_s; jit_compiles_in_first_step counts what the first step still "
        "compiled): compare both step_s_first and step_s_first_incl_warmup",
        f"dtype: ours params/compute {ours['dims']['dtype']}, Tunix {tunix.get('dims', {}).get('dtype')}",
        "rollout: ours inference.Engine (paged KV cache, continuous batching, each prompt prefilled once for "
        "its 4 samples via SamplingParams.n, 16 decode slots, engine.decode_steps=8 tokens per device call, "
        "MoE decode steps running every expert on their 16 tokens); Tunix the vanilla Sampler (one jitted "
        "while_loop for all 64 tokens, every expert on every token) on the prompts repeated 4 times",
        "reward: both the even-id fraction of the completion's text (ids joined by spaces); ours through an "
        "in-process stand-in for envs.EnvPool.score_many (the main job scores in worker processes)",
        "behaviour log-probs: ours the engine's sampling log-probs (no recomputation; one update per batch, "
        "so the proximal policy is the train forward's own, stop-gradient)"
        + (
            f"; Tunix calls get_old_per_token_logps {calls['get_old_per_token_logps']} times"
            if calls.get("get_old_per_token_logps")
            else "; Tunix recomputes none either (num_iterations=1)"
        ),
        "reference log-probs: ours one jitted forward of a frozen f32 copy of the step-0 params; Tunix a "
        "second model built with the same seed",
        f"logits: ours (train and reference forwards) at {ours['logit_window']} positions per row from the "
        "one before its first completion token (rl.losses.logit_window: single-turn rows train on at "
        "most rl.max_new_tokens tokens); Tunix at every position, then the last 64 sliced",
        "loss: both GRPO with clip 0.2 both sides, sequence-mean-token-mean aggregation and the k1 KL "
        "(beta 0.04) as Tunix GRPOConfig's defaults; ours adds TIS weights from the behaviour log-probs "
        "(cap 2, about 1 on-policy) and the train/inference mismatch metrics",
        "optimizer: ours global-norm clipping at 1.0 then AdamW (lr 1e-4 constant, weight decay 1e-4); "
        "Tunix optax.adamw(1e-4) without clipping",
        "batch: ours padded to the fixed [16, 96] shape; zero-variance groups are filtered (padding rows, "
        f"{ours['dropped_zero_variance_groups']} dropped here), one rollout round; Tunix filters nothing",
        "weight sync: ours WeightSync.push -> Engine.update_params (a copy into the engine's layout, blocked "
        "until ready); Tunix syncs only when rollout and actor do not share weights (vanilla rollout on the "
        "actor's mesh shares them: no copy)",
        f"layers: ours unrolled (scan_layers={ours['dims']['scan_layers']}); model init: each its own "
        "random init (the work does not depend on the values)",
        "per-step extras: Tunix's step includes its metrics logging; ours logs nothing (the main job writes "
        "metrics.jsonl, updates the curriculum and checkpoints every rl.checkpoint_every steps)",
        f"versions: ours jax {ours['versions']['jax']}, Tunix's venv {tunix.get('versions')}",
    ]
    ref = tunix.get("phase_s_median_after_first", {}).get("get_ref_per_token_logps")
    if ref is not None:
        out.append(
            "phases: Tunix's are the wall times of its RLCluster calls under async dispatch (its reference "
            f"log-probs return in {ref} s, their compute lands in a later phase); ours end ready, so only "
            "the step totals compare"
        )
    if ours["arch"] == "qwen3moe":
        out.append(
            "MoE: ours ragged dropless dispatch (each token through its top-2 experts) and load-balance "
            "(0.01) and router z (1e-3) losses in the objective; Tunix's Qwen3 MoE on CPU (empty mesh) runs "
            "every expert on every token (one-hot dispatch: 4x the routed FLOPs at top-2 of 8), no aux loss"
        )
    return out


def compare(ours: dict, tunix: dict) -> dict:
    line = {"bench": "grpo_step_compare", "arch": ours["arch"]}
    if "error" in tunix or not tunix.get("step_s_median"):
        return {**line, "error": tunix.get("error", "no step_s_median from the peer")}
    r = lambda a, b: round(a / b, 3)
    return {
        **line,
        "ours_step_s_median": ours["step_s_median"],
        "tunix_step_s_median": tunix["step_s_median"],
        "step_ratio_tunix_over_ours": r(tunix["step_s_median"], ours["step_s_median"]),
        "ours_step_s_first": ours["step_s_first"],
        "ours_step_s_first_incl_warmup": ours["step_s_first_incl_warmup"],
        "tunix_step_s_first": tunix["step_s_first"],
        "first_ratio_tunix_over_ours": r(tunix["step_s_first"], ours["step_s_first"]),
        "first_ratio_tunix_over_ours_incl_warmup": r(tunix["step_s_first"], ours["step_s_first_incl_warmup"]),
        "differences": differences(ours, tunix),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--archs", default="qwen3,qwen3moe")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the first (compiling) one")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 steps after the first")
    p.add_argument("--tunix_python", default="", help="python of a venv with google-tunix (none: skip)")
    p.add_argument(
        "--trace_dir",
        default="",
        help="trace the last step's update into DIR/ARCH for profile_ops.py (the profiler slows that step)",
    )
    p.add_argument("--peer_script", default="", help="PATH of the peer's tunix_grpo_step_bench.py")
    a = p.parse_args()
    check_peers(p, {"tunix_python": "peer_script"}, a)
    steps = 2 if a.quick else a.steps
    jax.monitoring.register_event_duration_secs_listener(_on_compile)
    summary = {"bench": "grpo_step_summary", "steps": steps, "loadavg_start": loadavg(), "archs": {}}
    for arch in a.archs.split(","):
        ours = emit(run_ours(arch, steps, a.trace_dir))
        entry = {"ours_step_s_median": ours["step_s_median"], "ours_step_s_first": ours["step_s_first"]}
        if a.tunix_python:
            cmp = emit(compare(ours, emit(run_tunix(arch, steps, a.tunix_python, a.peer_script))))
            if "error" not in cmp:
                step, first = cmp["step_ratio_tunix_over_ours"], cmp["first_ratio_tunix_over_ours"]
                first_warm = cmp["first_ratio_tunix_over_ours_incl_warmup"]
                entry.update(
                    step_ratio=step,
                    step_ratio_met=step >= TARGETS["step_ratio"],
                    first_ratio=first,
                    first_step_met=first >= TARGETS["first_step_ratio"],
                    first_ratio_incl_warmup=first_warm,
                    first_step_incl_warmup_met=first_warm >= TARGETS["first_step_ratio"],
                )
            else:
                entry["error"] = cmp["error"]
        summary["archs"][arch] = entry
    summary.update(targets=TARGETS, loadavg_end=loadavg())
    emit(summary)


if __name__ == "__main__":
    main()
