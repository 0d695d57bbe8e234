"""python -m rl.train --config=configs/grpo.py:test --workdir=runs/test

The main job: GRPO post-training over task domains, one step as the README's "GRPO post-training" says.
`train(cfg, workdir)` reads top to bottom in the order a run happens:

1. Config, workdir, console: `rl.validate.validate` checks every field first, then `rl.data.check_domains`
   draws a few tasks of every domain (levels exist, some prompts fit rl.max_prompt_len): a second or so,
   before any process or array exists or the workdir is written; library logs go to `<workdir>/log.txt`.
2. Environments: the quality gate, the worker pool (started before JAX touches a device), the task streams
   and the curriculum.
3. Train state: restored from `<workdir>/checkpoints` when one exists, else built (or, with rl.init_from,
   loaded from a Hugging Face checkpoint, whose model config and tokenizer the run takes:
   `validate.init_from_config`) and warm-started by SFT on reference solutions (the draft model, when there
   is one, learns from the same batches). SIGTERM or Ctrl-C during SFT saves its progress; the next start
   resumes it. `python -m rl.export` writes a run's state back as a Hugging Face checkpoint.
4. Reference (the step-0 policy, for rl.loss.kl_kind), drafter (rl.engine.draft) and the engine; the
   engine's warmup, then the update's compile on an empty batch of the rollout batches' shapes
   (`_warm_up`), so the first step compiles nothing.
5. The held-out evaluation (`rl.data.heldout_tasks`, the tasks `rl.evaluate` scores too).
6. The loop, one rollout batch per step: batch (sampled, scored, filtered; in async mode by a producer
   thread, at most rl.max_staleness versions behind) -> update (rl.ppo_epochs x rl.mini_batches optimizer
   steps) -> weights to the engine (policy version + 1) -> draft distillation -> curriculum -> log ->
   checkpoint. SIGTERM / Ctrl-C saves and exits at the next step boundary.
7. Final checkpoint and evaluation: a before/after table of held-out accuracy per domain.

A run killed with `kill -9` resumes from its last checkpoint (bit-identical in sync mode). Metrics go to
`<workdir>/metrics.jsonl` (and TensorBoard), a few episodes per step to `<workdir>/samples.jsonl`.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_flags

from configs import cli
from configs.errors import UserError

if __name__ == "__main__":  # before --config: with no --config its default is read (and overridden) here
    cli.take_block_overrides(sys.argv)  # --config.rl.levels.math=... (configs/cli.py)
_CONFIG = config_flags.DEFINE_config_file("config", "configs/grpo.py:test", "GRPO config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, eval).")
_SFT_ONLY = flags.DEFINE_boolean("sft_only", False, "Run the SFT warm start, save it, and stop.")
_EVAL = flags.DEFINE_boolean("eval", True, "Evaluate held-out tasks before and after training.")


class Preempted(Exception):
    """Raised by the signal handler while an evaluation runs: there is nothing to save mid-evaluation."""


def train(cfg, workdir: str, *, sft_only: bool = False, run_eval: bool = True) -> dict[str, Any]:
    """Runs (or resumes) the job; returns {"before", "after", "steps", "engine"} (+ "preempted")."""
    import jax

    import envs
    from envs import qa
    from model.io.tokenizer import load_tokenizer
    from rl import (
        checkpoint,
        curriculum,
        data,
        distributed,
        losses,
        metrics,
        pipeline,
        rollout,
        run_log,
        sampler,
        train_state,
        train_step,
        validate,
    )

    # ---- Config, workdir, console -----------------------------------------------------------------------
    validate.validate(cfg)
    cfg = validate.init_from_config(cfg)  # rl.init_from: the checkpoint's model config and tokenizer
    rl = cfg.rl
    tokenizer = load_tokenizer(rl.tokenizer or None, vocab_size=cfg.model.vocab_size)
    data.check_domains(cfg, tokenizer)  # levels exist, prompts fit: refused now, not after the warm start
    with cfg.unlocked():  # derived sizes follow the rl fields (command-line overrides change those)
        cfg.batch_size = rl.prompts_per_step * rl.group_size
        cfg.seq_len = rl.max_prompt_len + rl.max_new_tokens
    # ---- Processes and the trainer's mesh: every host runs this same program (rl.distributed) ------------
    _, processes = distributed.initialize()
    mesh = distributed.trainer_mesh(cfg)
    validate.check_mesh(cfg, processes, batch_shards=train_state.batch_shard_count(cfg, mesh))
    place = sampler.layout(cfg, mesh)  # rl.engine.mesh (engines per process or over several), checked now
    primary = distributed.is_primary()  # process 0 alone writes metrics, samples, evaluations, the table
    say = run_log.say if primary else lambda message: None
    env_kwargs = data.env_kwargs(cfg)
    # The checkpoints' model config is checked before anything is written: a refused run changes nothing.
    ckpt = checkpoint.Checkpointer(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        save_every=rl.checkpoint_every,
        max_to_keep=rl.max_to_keep,
        model_config=cfg.model,
        mesh=mesh,
    )
    try:
        meta = ckpt.read_meta()
    except BaseException:
        ckpt.close()
        raise
    if primary:
        run_log.write_config(workdir, cfg)
    say(f"run {workdir}: " + ("new" if meta is None else run_log.resume_note(meta, rl)))
    for note in validate.notes(cfg):
        say(f"note: {note}")

    # ---- Environments: gate, pool (before JAX touches a device), task streams, curriculum -----------------
    domains = list(rl.domains)
    pool = logger = None
    phase = _Phase(say)
    handle = checkpoint.install_preemption_handler(phase.on_signal)
    try:
        if rl.quality_gate:
            say(f"quality gate: {len(domains)} domain(s), {rl.quality_gate_n} tasks each")
            domains = curriculum.admit_domains(
                domains,
                gate=lambda d: qa.run_checks(d, n=rl.quality_gate_n, env_kwargs=env_kwargs.get(d, {})),
            )
        pool = envs.EnvPool(
            rl.env_workers, domains={d: env_kwargs.get(d, {}) for d in domains}, timeout_s=rl.env_timeout_s
        )
        say(f"environments: {rl.env_workers} worker process(es) for {', '.join(domains)}")
        # The train split (rl.data.holdout / selection say which prompts are not in it), rl.levels, rl.env.
        streams = data.TaskMixer(
            {d: data.domain_stream(cfg, d, "train", env_kwargs.get(d, {})) for d in domains}
        )
        scheduler = curriculum.from_config(rl, domains, seed=rl.seed)
        source = _TaskSource(cfg, streams, scheduler, tokenizer)
        logger = (
            metrics.MetricsLogger(workdir, tensorboard=rl.tensorboard or False, total_steps=rl.steps)
            if primary
            else metrics.NullLogger()
        )

        # ---- Train state: restore, or build (or load rl.init_from) and warm-start by SFT -------------------
        draft_cfg = validate.draft_model_config(cfg) if rl.engine.draft == "model" else None
        # rl.init_from starts a new run; a resumed one restores its own state
        pretrained = _pretrained(cfg, mesh, say, logger) if meta is None and rl.init_from else {}
        model_def, state = train_state.init_state(cfg, mesh=mesh, seed=rl.seed, **pretrained)
        say(
            f"model: {sum(x.size for x in jax.tree.leaves(state.params)) / 1e6:.2f}M parameters on "
            f"{mesh.size} device(s), mesh {dict(mesh.shape)}"
        )
        draft_def, draft_state = (
            (None, None) if draft_cfg is None else _sft_state(draft_cfg, rl.seed, mesh=mesh)
        )
        ref_params = (
            train_state.reference_weights(state, rl.reference_dtype) if rl.loss.kl_kind != "none" else None
        )
        start_step, version, sft_done = 0, 0, 0
        if meta is None and rl.sft.steps:
            say(f"sft: {rl.sft.steps} warm-start steps")
        if meta is not None:
            sft_done = meta.get("sft_step", rl.sft.steps)
            in_sft = sft_done < rl.sft.steps
            if in_sft:
                _, state = _sft_state(cfg, rl.seed, params=state.params, mesh=mesh)
            target = _pack(state, None if in_sft else ref_params, draft_state)
            tree, meta = ckpt.restore(target_state=target)
            state, restored_ref, draft_state = unpack(tree)
            ref_params = restored_ref if restored_ref is not None else ref_params
            source.set_state(meta)
            start_step, version = meta["step"], meta["version"]
        if sft_done < rl.sft.steps:
            state, draft_state, sft_done = _sft(
                cfg,
                state,
                (draft_cfg, draft_def, draft_state),
                source,
                tokenizer,
                logger,
                handle,
                start=sft_done,
                resumed=meta is not None,
                env_kwargs=env_kwargs,
                mesh=mesh,
            )
            if sft_done < rl.sft.steps:  # preempted: keep the progress, resume it next time
                ckpt.save(
                    0, _pack(state, None, draft_state), source.state(0, 0, sft_step=sft_done), force=True
                )
                ckpt.wait()
                return run_log.stopped(
                    say, workdir, handle, f"SFT step {sft_done} of {rl.sft.steps}", steps=0
                )
            model_def, state = train_state.init_state(
                cfg, mesh=mesh, seed=rl.seed, params=state.params, model_state=state.model_state
            )
            if ref_params is not None:
                ref_params = train_state.reference_weights(state, rl.reference_dtype)
            ckpt.save(0, _pack(state, ref_params, draft_state), source.state(0, 0), force=True)
        if sft_only:
            ckpt.wait()
            return {"steps": 0}

        # ---- Reference, drafter, engine --------------------------------------------------------------------
        from inference import Engine

        engine_cfg = validate.engine_config(cfg)
        say(f"sampler: {place.describe()}")
        # One process: the trainer's arrays as they are (the engine moves them); several: one jitted push
        # to every engine's layout at once (rl.sampler).
        sampler_weights = lambda s, draft=False: place.engine_weights(  # noqa: E731
            train_state.weights(s), draft_cfg if draft else cfg, engine_cfg
        )
        engine = Engine(
            cfg,
            sampler_weights(state),
            engine_cfg,
            draft=_drafter(rl.engine, draft_cfg, draft_state, sampler_weights),
            mesh=place.mesh,
            placed=place.placed,
        )
        env = sampler.SharedPool(pool, place) if place.lockstep else pool  # the group's shared results
        # False for a finished run started again: it compiles nothing the steps would use.
        steps_left = start_step < rl.steps
        push_weights = _weight_sync(cfg, engine, place, processes)
        if steps_left and rl.weight_sync_delta >= 0 and processes == 1:  # the delta program compiles now:
            push_weights(train_state.weights(state))  # the first push sends every leaf,
            push_weights(train_state.weights(state))  # the second runs the delta program (nothing changed)
        engine.version = version
        update = train_step.make_grpo_update(cfg, model_def, mesh=mesh)
        rows_here = cfg.batch_size // processes
        if steps_left:
            say("compiling the engine and the GRPO update")
            t0 = time.perf_counter()
            _warm_up(cfg, engine, update, mesh, state, ref_params, rows_here)
            say(f"compiled in {time.perf_counter() - t0:.1f} s")
        elif run_eval:  # the held-out evaluation still samples
            engine.warmup()
        distill = None if draft_cfg is None else train_step.make_sft_step(draft_cfg, draft_def, mesh=mesh)

        # ---- Held-out evaluation ---------------------------------------------------------------------------
        heldout = data.heldout_tasks(cfg, tokenizer) if run_eval else {}

        def evaluate(tag: str, step: int, *, greedy: bool = False) -> dict[str, Any]:
            """rl.eval.k samples per held-out task at rl.temperature, or (greedy) one at temperature 0;
            written to eval_<tag>[_greedy].json."""
            from rl import evaluate as evaluate_lib

            sampling = rollout.sampling_params(rl, tokenizer, seed=evaluate_lib.EVAL_SEED)
            if handle.requested:  # a signal came while compiling: stop now, not after the evaluation
                raise Preempted(handle.signum)
            say(f"held-out evaluation ({tag}{', greedy' if greedy else ''}): {len(heldout)} domain(s)")
            with phase.interruptible():
                results = evaluate_lib.evaluate(
                    engine,
                    env,
                    tokenizer,
                    heldout,
                    k=rl.eval.k,
                    sampling=sampling,
                    max_turns=rl.max_turns,
                    chat=rl.chat,
                    greedy=greedy,
                )
            name = f"eval_{tag}_greedy.json" if greedy else f"eval_{tag}.json"
            if primary:
                with open(os.path.join(workdir, name), "w") as f:
                    json.dump(results, f, indent=2, default=float)
            logger.log(
                step, evaluate_lib.flatten(results, "eval_greedy" if greedy else "eval"), progress=False
            )
            return results

        before = greedy_before = None
        try:
            if run_eval and start_step == 0:
                before = evaluate("before", 0)
                greedy_before = evaluate("before", 0, greedy=True) if rl.eval.greedy else None
            elif run_eval:  # resumed: the first start's numbers
                before = _read_json(workdir, "eval_before.json")
                greedy_before = _read_json(workdir, "eval_before_greedy.json")
        except Preempted:
            return run_log.stopped(
                say, workdir, handle, f"nothing new (checkpoint {start_step} holds the run)", steps=start_step
            )

        # ---- The loop: batch -> update -> weights to the engine -> draft -> curriculum -> log -> checkpoint
        # Each process rolls out its share of every round's global task draw (rl.distributed.TaskShard)
        # into its rows of the global batch (rows_here).

        def produce() -> pipeline.RolloutBatch:
            seed = rollout.derive_seed(rl.seed, "batch", source.next_batch_index())
            version_now = engine.version
            members = len(place.members)  # an engine over several processes: they roll out its groups
            samples, counts, drawn, dropped = rollout.collect(
                engine,
                env,
                source.next_tasks,
                tokenizer,
                groups=rl.prompts_per_step // processes * members,
                shard=distributed.TaskShard(source.next_tasks, members) if processes > 1 else None,
                sampling=rollout.sampling_params(rl, tokenizer, seed=seed, n=rl.group_size),
                **rollout.collect_options(rl),
            )
            if place.lockstep:  # each member trains on its own share; the group's first counts the draws
                samples = place.share(samples, rl.prompts_per_step // processes)
                drawn = drawn if place.leader else {}
            drawn = _global_draws(drawn, domains) if processes > 1 else drawn
            batch, stats = None, {}
            # Else every group (of every process) was filtered out: nothing to learn from this round.
            if samples or (processes > 1 and distributed.any_process(bool(samples))):
                batch, stats = rollout.make_batch(
                    samples,
                    adv_std=rl.advantage_std,
                    length_bucket=cfg.seq_len,
                    max_len=cfg.seq_len,
                    rows=rows_here,
                    routing=rl.routing_replay,
                    domains=tuple(rl.domains) if rl.gradient_projection else None,
                    window=losses.logit_window(cfg, cfg.seq_len),
                )
            versions = [s.version for s in samples if s.version is not None]
            return pipeline.RolloutBatch(
                batch,
                min(versions, default=version_now),
                _rollout_metrics(counts, stats, drawn, samples),
                domains=drawn,
                samples=samples[: rl.log_samples],
                dropped=dropped[: rl.log_samples],
            )

        source.set_batch_index(start_step)
        pipe = pipeline.Pipeline(
            produce, asynchronous=rl.async_rollout, max_staleness=rl.max_staleness, max_queue=rl.max_queue
        )
        step, counts_before = start_step, _engine_counts(engine)
        idle = run_log.NoUpdates(rl.max_skipped_steps)
        if steps_left:
            say(
                f"GRPO: steps {start_step + 1}-{rl.steps}, metrics in "
                f"{os.path.join(workdir, metrics.METRICS_FILE)}"
            )
        try:
            while step < rl.steps:
                if distributed.any_process(handle.requested):
                    if ckpt.latest_step() != step:
                        pack = _pack(state, ref_params, draft_state)
                        ckpt.save(step, pack, source.state(step, engine.version), force=True)
                    ckpt.wait()
                    return run_log.stopped(
                        say, workdir, handle, f"GRPO step {step}", steps=step, engine=engine.stats()
                    )
                item, step_metrics = pipe.get(engine.version)
                t0 = time.perf_counter()
                idle.observe(item)
                if item.batch is None:  # no group with a reward signal: no update this step
                    step_metrics["train/skipped"] = 1.0
                else:
                    shardings = train_state.batch_shardings(cfg, tuple(item.batch), mesh, cfg.batch_size)
                    batch = distributed.global_batch(item.batch, shardings, train_state.ROW_AXIS)
                    state, update_metrics = update(state, batch, ref_params=ref_params)
                    step_metrics.update({f"train/{k}": v for k, v in update_metrics.items()})
                    step_metrics.update(push_weights(train_state.weights(state)))  # with the selection biases
                    if distill is not None:
                        draft_batch = {k: batch[k] for k in train_state.SFT_KEYS}
                        for _ in range(rl.draft_train_steps):
                            draft_state, dm = distill(draft_state, draft_batch)
                        step_metrics["draft/cross_entropy"] = float(dm["cross_entropy"])
                        targets = engine.weight_shardings(draft=True)
                        draft_weights = place.to_engine(train_state.weights(draft_state), targets)
                        engine.update_draft_params(draft_weights, placed=place.placed)
                    # The replaced states and engine weights go now: nnx's tree flattening (flax's
                    # flatten_to_sequence) leaves reference cycles that would hold them (a second copy on
                    # every device) until Python's next cyclic collection.
                    t_gc = time.perf_counter()
                    gc.collect(1)
                    step_metrics["memory/gc_s"] = time.perf_counter() - t_gc
                step_metrics["pipeline/train_s"] = time.perf_counter() - t0
                step += 1
                step_metrics.update(item.metrics)
                step_metrics.update(source.update_curriculum(step, item.domains))
                if step % rl.log_every == 0 or step == rl.steps:
                    step_metrics.update(_memory(state, ref_params, engine))
                    counts_now = _engine_counts(engine)
                    step_metrics.update(
                        _engine_metrics(counts_before, counts_now, rl.engine.host_cache_pages > 0)
                    )
                    counts_before = counts_now
                    logger.log(step, step_metrics)
                    if primary:
                        run_log.log_samples(workdir, step, item.samples, kept=True)
                        run_log.log_samples(workdir, step, item.dropped, kept=False)
                if ckpt.should_save(step) or idle.stuck:
                    ckpt.save(
                        step,
                        _pack(state, ref_params, draft_state),
                        source.state(step, engine.version),
                        force=True,
                    )
                if idle.stuck:  # nothing to learn from: say why instead of running on
                    ckpt.wait()
                    raise run_log.NoLearningSignal(idle.report(step))
        finally:
            pipe.close()

        # ---- Final checkpoint and evaluation --------------------------------------------------------------
        if ckpt.latest_step() != step:
            ckpt.save(
                step, _pack(state, ref_params, draft_state), source.state(step, engine.version), force=True
            )
        ckpt.wait()
        after = greedy_after = None
        try:
            if run_eval:
                after = evaluate("after", step)
                greedy_after = evaluate("after", step, greedy=True) if rl.eval.greedy else None
        except Preempted:
            return run_log.stopped(
                say,
                workdir,
                handle,
                f"nothing new (checkpoint {step} holds the run)",
                steps=step,
                engine=engine.stats(),
            )
        if after is not None and primary:
            from rl import evaluate as evaluate_lib

            print(
                evaluate_lib.format_before_after(before or {}, after, greedy_before, greedy_after), flush=True
            )
        say(run_log.results_note(workdir, step, run_eval))
        return {
            "before": before,
            "after": after,
            "greedy_before": greedy_before,
            "greedy_after": greedy_after,
            "steps": step,
            "engine": engine.stats(),
        }
    finally:
        handle.close()
        for part in (ckpt, logger, pool):
            if part is not None:
                part.close()


# ---- Parts of the run ------------------------------------------------------------------------------------


class _Phase:
    """What a signal does now: in an evaluation it raises `Preempted` (nothing to save there); elsewhere the
    preemption handle's flag is read at the next step boundary."""

    def __init__(self, say=None):
        self._interruptible = False
        self._say = say

    def on_signal(self, signum: int) -> None:
        if self._say is not None:
            self._say(
                f"{signal.Signals(signum).name}: saving at the next step boundary "
                "(again: quit without saving)"
            )
        if self._interruptible:
            raise Preempted(signum)

    def interruptible(self):
        phase = self

        class _Scope:
            def __enter__(self):
                phase._interruptible = True

            def __exit__(self, *exc):
                phase._interruptible = False

        return _Scope()


class _TaskSource:
    """Task streams and curriculum behind one lock (the async producer thread and the trainer share them):
    tasks whose prompt fits rl.max_prompt_len, the batch counter, and their checkpointed state."""

    def __init__(self, cfg, streams, scheduler, tokenizer):
        self.cfg, self.streams, self.scheduler, self.tokenizer = cfg, streams, scheduler, tokenizer
        self.lock = threading.Lock()
        self.skipped_long = 0
        self._batch_index = 0

    def next_tasks(self, n: int, weights: dict[str, float] | None = None) -> list:
        """n tasks split over the domains by the curriculum (or `weights`), skipping (and counting) tasks
        whose prompt is longer than rl.max_prompt_len tokens."""
        from rl import data

        out = []
        with self.lock:
            for _ in range(64):
                want = n - len(out)
                allocation = _split(want, weights) if weights else self.scheduler.allocate(want)
                for task in self.streams.next_tasks(allocation):
                    if data.fits_prompt(task, self.tokenizer, self.cfg):
                        out.append(task)
                    else:
                        self.skipped_long += 1
                if len(out) == n:
                    return out
        raise ValueError(
            f"rl.max_prompt_len={self.cfg.rl.max_prompt_len} is shorter than nearly every prompt of "
            f"{self.cfg.rl.domains}; raise it (seq_len = max_prompt_len + max_new_tokens follows)."
        )

    def next_batch_index(self) -> int:
        with self.lock:
            self._batch_index += 1
            return self._batch_index - 1

    def set_batch_index(self, index: int) -> None:
        self._batch_index = index

    def update_curriculum(self, step: int, draws: dict) -> dict[str, float]:
        with self.lock:
            self.scheduler.observe(step, draws)
            out = self.scheduler.metrics()
        out["rollout/skipped_long_prompts"] = float(self.skipped_long)
        return out

    def state(self, step: int, version: int, **extra) -> dict[str, Any]:
        with self.lock:
            return {
                "step": step,
                "version": version,
                "streams": self.streams.get_state(),
                "curriculum": self.scheduler.state_dict(),
                **extra,
            }

    def set_state(self, meta: dict[str, Any]) -> None:
        self.streams.set_state(meta["streams"])
        self.scheduler.load_state_dict(meta["curriculum"])


def _pretrained(cfg, mesh=None, say=None, logger=None) -> dict:
    """`init_state`'s params and model_state (the sigmoid routers' selection biases) from the rl.init_from
    checkpoint, laid out by cfg's runtime model fields and read slice by slice straight into the trainer's
    shardings on `mesh` (each process reads only what its devices hold; init_state then moves nothing), or
    onto the default device. The bytes each process read are said and logged (`init_from/*`, step 0)."""
    from model.io import hf
    from rl import distributed

    params, model_state, stats = hf.load_sharded(cfg.rl.init_from, cfg, mesh)
    read = distributed.allgather([stats.bytes_read])[:, 0]
    if say is not None:
        said = ", ".join(f"{int(n):,}" for n in read)
        say(f"rl.init_from: read {said} of the checkpoint's {stats.tensor_bytes:,} bytes (per process)")
    if logger is not None:
        logger.log(
            0,
            {
                "init_from/bytes_read_max": float(read.max()),
                "init_from/bytes_read_total": float(read.sum()),
                "init_from/checkpoint_bytes": float(stats.tensor_bytes),
            },
            progress=False,
        )
    return {"params": params, "model_state": model_state}


def _sft_state(cfg, seed: int, *, params=None, model_state=None, mesh=None):
    """(model def, train state) with the SFT optimizer (rl.sft.optim over rl.optim)."""
    from rl import train_state

    sft_cfg = ml_collections.ConfigDict(cfg.to_dict())
    sft_cfg.rl.optim.update(dict(cfg.rl.sft.optim))
    return train_state.init_state(sft_cfg, mesh=mesh, seed=seed, params=params, model_state=model_state)


def _sft(cfg, state, draft, source, tokenizer, logger, handle, *, start, resumed, env_kwargs, mesh):
    """The warm start: rl.sft.steps supervised steps from `start` (the policy, and the draft model on the
    same batches). Returns (state, draft_state, steps done); fewer than rl.sft.steps when preempted."""
    from rl import distributed, sft

    rl = cfg.rl
    draft_cfg, draft_def, draft_state = draft
    sft_cfg = ml_collections.ConfigDict(cfg.to_dict())
    sft_cfg.rl.optim.update(dict(rl.sft.optim))
    if not resumed:  # a fresh state: SFT has its own optimizer settings (the selection biases stay)
        _, state = _sft_state(cfg, rl.seed, params=state.params, model_state=state.model_state, mesh=mesh)
    sft_def, _ = _sft_state(cfg, rl.seed, params=state.params, mesh=mesh)
    weights = {d: float(w) for d, w in rl.sft.weights.items()} or None
    t0 = time.perf_counter()

    def log(i: int, m: dict) -> None:
        logger.log(i, m, progress=False)
        if distributed.is_primary() and ((i + 1) % 100 == 0 or i + 1 == rl.sft.steps):
            ce = m.get("sft/cross_entropy", float("nan"))
            print(f"sft {i + 1}/{rl.sft.steps} | cross-entropy {ce:.4f}", file=sys.stderr, flush=True)

    common = dict(
        steps=rl.sft.steps,
        rows=rl.sft.rows,
        length=cfg.seq_len,
        chat=rl.chat,
        noise=rl.sft.noise,
        seed=rl.seed,
        start=start,
        should_stop=lambda: distributed.any_process(handle.requested),
        env_kwargs=env_kwargs,
        mesh=mesh,
    )
    batches = []  # the draft model learns from the same tasks: record them for it
    next_tasks = lambda n: _recorded(batches, source.next_tasks(n, weights))
    state, done = sft.run_sft(
        sft_cfg, sft_def, state, next_tasks, tokenizer, log=log, mtp_weight=rl.sft.mtp_weight, **common
    )
    if draft_state is not None:
        replay = iter(batches)
        draft_sft = ml_collections.ConfigDict(draft_cfg.to_dict())
        draft_sft.rl.optim.update(dict(rl.sft.optim))
        draft_state, _ = sft.run_sft(
            draft_sft,
            draft_def,
            draft_state,
            lambda n: next(replay),
            tokenizer,
            **{**common, "steps": done, "should_stop": None},
        )
    logger.log(0, {"sft/seconds": time.perf_counter() - t0}, progress=False)
    return state, draft_state, done


def _warm_up(cfg, engine, update, mesh, state, ref_params, rows: int) -> None:
    """Compiles before the first step: the engine's `warmup()` in a thread beside the update's compile
    (`update.compile`) on an empty batch of the rollout batches' shapes and placement, so the first step
    compiles nothing; an error in either is raised here. On a quiet 2-core CPU the overlap saved 0-1 s of
    ~8.4 s (`benchmarks/grpo_ab.py`: XLA:CPU's compiles already use both cores); it is for hosts with more
    cores than one compile keeps busy."""
    from rl import distributed, rollout, train_state

    rl = cfg.rl
    local = rollout.empty_batch(
        rows,
        cfg.seq_len,
        routing=(engine.num_moe_layers, cfg.model.moe.top_k) if rl.routing_replay else None,
        domains=tuple(rl.domains) if rl.gradient_projection else None,
    )
    shardings = train_state.batch_shardings(cfg, tuple(local), mesh, cfg.batch_size)
    failed: list[BaseException] = []

    def warm_engine() -> None:
        try:
            engine.warmup()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            failed.append(e)

    thread = threading.Thread(target=warm_engine, name="engine-warmup", daemon=True)
    thread.start()
    try:
        batch = distributed.global_batch(local, shardings, train_state.ROW_AXIS)
        update.compile(state, batch, ref_params=ref_params)
    finally:
        thread.join()
    if failed:
        raise failed[0]


def _recorded(batches: list, tasks: list) -> list:
    batches.append(tasks)
    return tasks


def _pack(state, ref_params, draft_state):
    """The checkpointed tree: the train state alone, or with the reference and the draft state."""
    if ref_params is None and draft_state is None:
        return state
    tree = {"train": state}
    if ref_params is not None:
        tree["reference"] = ref_params
    if draft_state is not None:
        tree["draft"] = draft_state
    return tree


def checkpoint_target(cfg, state, meta: dict):
    """The restore target of a checkpoint with `meta`: the train state, with the reference and the draft
    state when the run keeps them (shapes from `cfg`; values are placeholders)."""
    from rl import train_state, validate

    rl = cfg.rl
    in_sft = meta.get("sft_step", rl.sft.steps) < rl.sft.steps
    draft_state = None
    if rl.engine.draft == "model":
        draft_state = _sft_state(validate.draft_model_config(cfg), rl.seed)[1]
    ref = (
        None
        if in_sft or rl.loss.kl_kind == "none"
        else train_state.reference_weights(state, rl.reference_dtype)
    )
    return _pack(state, ref, draft_state)


def unpack(tree):
    """(train state, reference weights or None, draft state or None) of a checkpointed tree."""
    if not isinstance(tree, dict):
        return tree, None, None
    return tree["train"], tree.get("reference"), tree.get("draft")


def _drafter(engine_cfg, draft_cfg, draft_state, sampler_weights):
    from inference import GroupDrafter, ModelDrafter, MTPDrafter, NgramDrafter

    kind = engine_cfg.draft
    if kind == "mtp":
        return MTPDrafter()
    if kind == "ngram":
        return NgramDrafter(engine_cfg.draft_ngram)
    if kind == "group":
        return GroupDrafter(engine_cfg.draft_ngram)
    if kind == "model":
        return ModelDrafter(draft_cfg, sampler_weights(draft_state, draft=True))
    return None


def _weight_sync(cfg, engine, place, processes: int):
    """`push(weights) -> metrics`: the trainer's weights to the engine after each update. One process: the
    engine is on the trainer's devices (colocated: one jitted reshard to the inference layout) or on its own
    (rl.sampler_devices: disaggregated, device to device), every leaf or, with rl.weight_sync_delta >= 0, the
    changed ones (`inference.WeightSync`). Across processes: one jitted push to every engine's layout at once
    (`rl.sampler.Layout.push`), taken by the engine as it is."""
    import time

    from inference.drafters import model_weights
    from inference.weight_sync import WeightSync

    rl = cfg.rl
    if processes > 1:

        def push_placed(weights) -> dict:
            t0 = time.perf_counter()
            weights = model_weights("params", weights, engine.params, keep=engine.params)
            local, moved = place.push(weights, engine.weight_shardings())
            engine.update_params(local, placed=True)
            return {"sync/seconds": time.perf_counter() - t0, "sync/bytes": float(moved)}

        return push_placed
    mode = "disaggregated" if rl.sampler_devices else "colocated"
    delta = float(rl.weight_sync_delta) if rl.weight_sync_delta >= 0 else None
    sync = WeightSync(engine, mode, delta_threshold=delta)
    return lambda weights: {k: float(v) for k, v in sync.push(weights).items()}


def _memory(state, ref_params, engine) -> dict[str, float]:
    """`memory/*` of the logged step, each the largest over every process: the bytes any one device holds
    in live arrays, and in each part (params, optimizer state, reference, sampler weights, KV pages), and
    the peak resident memory of a process (`rl.memory`; the planner's figure: `model.plan --sampler`)."""
    from rl import distributed, memory

    parts = {
        "params": state.params,
        "optimizer": state.opt_state,
        "reference": ref_params,
        "sampler_weights": (engine.params, engine.draft_params),
        "kv_pages": (engine.kv, engine.draft_kv, engine.mtp_kv),
    }
    mine = memory.snapshot(parts)
    return dict(zip(mine, distributed.allgather(list(mine.values())).max(axis=0)))


def _global_draws(drawn: dict, domains: Sequence[str]) -> dict:
    """Every process's draws per domain, summed (the curriculum is replicated: it must see them all)."""
    from rl import distributed
    from rl.rollout import DomainDraw

    zero = DomainDraw()
    local = [drawn.get(d, zero) for d in domains]
    rows = distributed.allgather(
        [x for d in local for x in (d.samples, d.reward_sum, d.tokens, d.sandbox_seconds)]
    )
    total = rows.sum(axis=0).reshape(len(domains), 4)
    out = {}
    for d, (n, reward, tokens, seconds) in zip(domains, total):
        if n:
            out[d] = DomainDraw(int(round(n)), float(reward), int(round(tokens)), float(seconds))
    return out


def _rollout_metrics(counts, stats, drawn, samples) -> dict[str, float]:
    """Dashboard metrics of one rollout batch (names for people; the curriculum reads `drawn`)."""
    out = {f"rollout/{k}": float(v) for k, v in {**counts, **stats}.items() if _is_number(v)}
    total = sum(d.samples for d in drawn.values())
    if total:
        out["reward"] = sum(d.reward_sum for d in drawn.values()) / total
    for d, draw in drawn.items():
        out[f"reward/{d}"] = draw.mean_reward
        out[f"tokens/{d}"] = float(draw.tokens)
        out[f"sandbox_seconds/{d}"] = draw.sandbox_seconds
    if samples:
        out["kept_reward"] = float(np.mean([s.reward for s in samples]))
    for d in sorted({s.task.domain for s in samples}):
        out[f"kept_ok/{d}"] = float(np.mean([s.status == "ok" for s in samples if s.task.domain == d]))
    return out


_ENGINE_COUNTS = (
    "generated_tokens",
    "target_row_forwards",
    "proposed_tokens",
    "accepted_tokens",
    "preemptions",
)
_PREFIX_COUNTS = ("lookup_tokens", "hit_tokens", "offloads", "reloads")


def _engine_counts(engine) -> dict[str, float]:
    """The engine's running counters (this process's engine) that `_engine_metrics` turns into rates."""
    stats = engine.stats()
    prefix = stats.get("prefix_cache", {})
    out = {k: float(stats.get(k, 0)) for k in _ENGINE_COUNTS}
    out.update({f"prefix_{k}": float(prefix.get(k, 0)) for k in _PREFIX_COUNTS})
    return out


def _engine_metrics(before: dict[str, float], now: dict[str, float], host_tier: bool) -> dict[str, float]:
    """Since the last log line: tokens per target forward, draft acceptance, the prefix cache's hit rate
    (prompt tokens whose K/V it held over those looked up: the groups' shared prompts, a multi-turn episode's
    earlier turns), preemptions, and with a host tier the pages it moved out and back."""
    d = {k: now[k] - before[k] for k in now}
    out = {
        "engine/tokens_per_target_forward": d["generated_tokens"] / max(d["target_row_forwards"], 1.0),
        "engine/preemptions": d["preemptions"],
    }
    if d["proposed_tokens"]:
        out["engine/acceptance_rate"] = d["accepted_tokens"] / d["proposed_tokens"]
    if d["prefix_lookup_tokens"]:
        out["engine/prefix_hit_rate"] = d["prefix_hit_tokens"] / d["prefix_lookup_tokens"]
    if host_tier:
        out["engine/host_offloads"], out["engine/host_reloads"] = d["prefix_offloads"], d["prefix_reloads"]
    return out


def _split(n: int, weights: dict[str, float]) -> dict[str, int]:
    """n split by weights, largest remainders first (sums to n)."""
    total = sum(weights.values())
    exact = {d: n * w / total for d, w in weights.items()}
    out = {d: int(x) for d, x in exact.items()}
    for d in sorted(exact, key=lambda d: exact[d] - out[d], reverse=True)[: n - sum(out.values())]:
        out[d] += 1
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _read_json(workdir: str, name: str):
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# ---- CLI ---------------------------------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    """The CLI: 0 when the run ends, 128 + the signal's number (130 Ctrl-C, 143 SIGTERM) when a signal stopped
    it after saving (a scheduler tells a preempted run from a finished one)."""
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {list(argv[1:])}; flags look like --workdir=DIR")
    if not _WORKDIR.value:
        raise UserError("--workdir is required: the run directory (checkpoints, metrics and evaluations)")
    cli.quiet_console(_WORKDIR.value)
    cfg = cli.with_block_overrides(_CONFIG.value)  # --config.rl.levels.math=... (configs/cli.py)
    result = train(cfg, _WORKDIR.value, sft_only=_SFT_ONLY.value, run_eval=_EVAL.value)
    if result.get("preempted"):
        return 128 + (result.get("signal") or signal.SIGTERM)
    return 0


if __name__ == "__main__":
    cli.run(main)
