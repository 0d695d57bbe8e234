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
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
from absl import flags

from configs import cli
from configs.errors import UserError
from envs.pool import EnvPool
from envs.qa import gate as qa
from inference import Engine
from model.io.tokenizer import load_tokenizer
from rl import batch as batch_lib
from rl import (
    checkpoint,
    curriculum,
    data,
    distributed,
    evaluate,
    losses,
    metrics,
    pipeline,
    rollout,
    run,
    run_log,
    sampler,
    step_metrics,
    train_state,
    train_step,
    validate,
    warm_start,
)


def train(cfg, workdir: str, *, sft_only: bool = False, run_eval: bool = True) -> dict[str, Any]:
    """Runs (or resumes) the job; returns {"before", "after", "steps", "engine"} (+ "preempted")."""

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
    phase = run.Phase(say)
    handle = checkpoint.install_preemption_handler(phase.on_signal)
    try:
        if rl.quality_gate:
            say(f"quality gate: {len(domains)} domain(s), {rl.quality_gate_n} tasks each")
            domains = curriculum.admit_domains(
                domains,
                gate=lambda d: qa.run_checks(d, n=rl.quality_gate_n, env_kwargs=env_kwargs.get(d, {})),
            )
        pool = EnvPool(
            rl.env_workers, domains={d: env_kwargs.get(d, {}) for d in domains}, timeout_s=rl.env_timeout_s
        )
        say(f"environments: {rl.env_workers} worker process(es) for {', '.join(domains)}")
        # The train split (rl.data.holdout / selection say which prompts are not in it), rl.levels, rl.env.
        streams = data.TaskMixer(
            {d: data.domain_stream(cfg, d, "train", env_kwargs.get(d, {})) for d in domains}
        )
        scheduler = curriculum.from_config(rl, domains, seed=rl.seed)
        source = data.TaskSource(cfg, streams, scheduler, tokenizer)
        logger = (
            metrics.MetricsLogger(workdir, tensorboard=rl.tensorboard or False, total_steps=rl.steps)
            if primary
            else metrics.NullLogger()
        )

        # ---- Train state: restore, or build (or load rl.init_from) and warm-start by SFT -------------------
        draft_cfg = validate.draft_model_config(cfg) if rl.engine.draft == "model" else None
        # rl.init_from starts a new run; a resumed one restores its own state
        pretrained = (
            train_state.load_pretrained(cfg, mesh, say, logger) if meta is None and rl.init_from else {}
        )
        model_def, state = train_state.init_state(cfg, mesh=mesh, seed=rl.seed, **pretrained)
        say(
            f"model: {sum(x.size for x in jax.tree.leaves(state.params)) / 1e6:.2f}M parameters on "
            f"{mesh.size} device(s), mesh {dict(mesh.shape)}"
        )
        draft_def, draft_state = (
            (None, None) if draft_cfg is None else train_state.sft_state(draft_cfg, rl.seed, mesh=mesh)
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
                _, state = train_state.sft_state(cfg, rl.seed, params=state.params, mesh=mesh)
            target = run.pack(state, None if in_sft else ref_params, draft_state)
            tree, meta = ckpt.restore(target_state=target)
            state, restored_ref, draft_state = run.unpack(tree)
            ref_params = restored_ref if restored_ref is not None else ref_params
            source.set_state(meta)
            start_step, version = meta["step"], meta["version"]
        if sft_done < rl.sft.steps:
            state, draft_state, sft_done = warm_start.warm_start(
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
                    0, run.pack(state, None, draft_state), source.state(0, 0, sft_step=sft_done), force=True
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
            ckpt.save(0, run.pack(state, ref_params, draft_state), source.state(0, 0), force=True)
        if sft_only:
            ckpt.wait()
            return {"steps": 0}

        # ---- Reference, drafter, engine --------------------------------------------------------------------
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
            draft=sampler.make_drafter(rl.engine, draft_cfg, draft_state, sampler_weights),
            mesh=place.mesh,
            placed=place.placed,
        )
        env = sampler.SharedPool(pool, place) if place.lockstep else pool  # the group's shared results
        # False for a finished run started again: it compiles nothing the steps would use.
        steps_left = start_step < rl.steps
        push_weights = sampler.weight_push(cfg, engine, place, processes)
        if steps_left and rl.weight_sync_delta >= 0 and processes == 1:  # the delta program compiles now:
            push_weights(train_state.weights(state))  # the first push sends every leaf,
            push_weights(train_state.weights(state))  # the second runs the delta program (nothing changed)
        engine.version = version
        update = train_step.make_grpo_update(cfg, model_def, mesh=mesh)
        rows_here = cfg.batch_size // processes
        if steps_left:
            say("compiling the engine and the GRPO update")
            t0 = time.perf_counter()
            train_step.warm_up(cfg, engine, update, mesh, state, ref_params, rows_here)
            say(f"compiled in {time.perf_counter() - t0:.1f} s")
        elif run_eval:  # the held-out evaluation still samples
            engine.warmup()
        distill = None if draft_cfg is None else train_step.make_sft_step(draft_cfg, draft_def, mesh=mesh)

        # ---- Held-out evaluation ---------------------------------------------------------------------------
        heldout = data.heldout_tasks(cfg, tokenizer) if run_eval else {}

        def evaluate_heldout(tag: str, step: int, *, greedy: bool = False) -> dict[str, Any]:
            if handle.requested:  # a signal came while compiling: stop now, not after the evaluation
                raise run.Preempted(handle.signum)
            say(f"held-out evaluation ({tag}{', greedy' if greedy else ''}): {len(heldout)} domain(s)")
            with phase.interruptible():
                results = evaluate.heldout(cfg, engine, env, tokenizer, heldout, greedy=greedy)
            if primary:
                evaluate.write_heldout(workdir, tag, greedy, results)
            logger.log(step, evaluate.flatten(results, "eval_greedy" if greedy else "eval"), progress=False)
            return results

        before = greedy_before = None
        try:
            if run_eval and start_step == 0:
                before = evaluate_heldout("before", 0)
                greedy_before = evaluate_heldout("before", 0, greedy=True) if rl.eval.greedy else None
            elif run_eval:  # resumed: the first start's numbers
                before = run.read_json(workdir, "eval_before.json")
                greedy_before = run.read_json(workdir, "eval_before_greedy.json")
        except run.Preempted:
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
            drawn = step_metrics.global_draws(drawn, domains) if processes > 1 else drawn
            batch, stats = None, {}
            # Else every group (of every process) was filtered out: nothing to learn from this round.
            if samples or (processes > 1 and distributed.any_process(bool(samples))):
                batch, stats = batch_lib.make_batch(
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
                step_metrics.rollout_metrics(counts, stats, drawn, samples),
                domains=drawn,
                samples=samples[: rl.log_samples],
                dropped=dropped[: rl.log_samples],
            )

        source.set_batch_index(start_step)
        pipe = pipeline.Pipeline(
            produce, asynchronous=rl.async_rollout, max_staleness=rl.max_staleness, max_queue=rl.max_queue
        )
        step, counts_before = start_step, step_metrics.engine_counts(engine)
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
                        pack = run.pack(state, ref_params, draft_state)
                        ckpt.save(step, pack, source.state(step, engine.version), force=True)
                    ckpt.wait()
                    return run_log.stopped(
                        say, workdir, handle, f"GRPO step {step}", steps=step, engine=engine.stats()
                    )
                item, logged = pipe.get(engine.version)
                t0 = time.perf_counter()
                idle.observe(item)
                if item.batch is None:  # no group with a reward signal: no update this step
                    logged["train/skipped"] = 1.0
                else:
                    shardings = train_state.batch_shardings(cfg, tuple(item.batch), mesh, cfg.batch_size)
                    batch = distributed.global_batch(item.batch, shardings, train_state.ROW_AXIS)
                    state, update_metrics = update(state, batch, ref_params=ref_params)
                    logged.update({f"train/{k}": v for k, v in update_metrics.items()})
                    logged.update(push_weights(train_state.weights(state)))  # with the selection biases
                    if distill is not None:
                        draft_batch = {k: batch[k] for k in train_state.SFT_KEYS}
                        for _ in range(rl.draft_train_steps):
                            draft_state, dm = distill(draft_state, draft_batch)
                        logged["draft/cross_entropy"] = float(dm["cross_entropy"])
                        targets = engine.weight_shardings(draft=True)
                        draft_weights = place.to_engine(train_state.weights(draft_state), targets)
                        engine.update_draft_params(draft_weights, placed=place.placed)
                    # The replaced states and engine weights go now: nnx's tree flattening (flax's
                    # flatten_to_sequence) leaves reference cycles that would hold them (a second copy on
                    # every device) until Python's next cyclic collection.
                    t_gc = time.perf_counter()
                    gc.collect(1)
                    logged["memory/gc_s"] = time.perf_counter() - t_gc
                logged["pipeline/train_s"] = time.perf_counter() - t0
                step += 1
                logged.update(item.metrics)
                logged.update(source.update_curriculum(step, item.domains))
                if step % rl.log_every == 0 or step == rl.steps:
                    logged.update(step_metrics.memory(state, ref_params, engine))
                    counts_now = step_metrics.engine_counts(engine)
                    logged.update(
                        step_metrics.engine_metrics(counts_before, counts_now, rl.engine.host_cache_pages > 0)
                    )
                    counts_before = counts_now
                    logger.log(step, logged)
                    if primary:
                        run_log.log_samples(workdir, step, item.samples, kept=True)
                        run_log.log_samples(workdir, step, item.dropped, kept=False)
                if ckpt.should_save(step) or idle.stuck:
                    ckpt.save(
                        step,
                        run.pack(state, ref_params, draft_state),
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
                step, run.pack(state, ref_params, draft_state), source.state(step, engine.version), force=True
            )
        ckpt.wait()
        after = greedy_after = None
        try:
            if run_eval:
                after = evaluate_heldout("after", step)
                greedy_after = evaluate_heldout("after", step, greedy=True) if rl.eval.greedy else None
        except run.Preempted:
            return run_log.stopped(
                say,
                workdir,
                handle,
                f"nothing new (checkpoint {step} holds the run)",
                steps=step,
                engine=engine.stats(),
            )
        if after is not None and primary:
            print(evaluate.format_before_after(before or {}, after, greedy_before, greedy_after), flush=True)
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
    cli.take_block_overrides(sys.argv)  # before --config: its default is read (and overridden) when defined
    _CONFIG, _WORKDIR = run.define_flags(
        "configs/grpo.py:test",
        config_help="GRPO config file.",
        workdir_help="Run directory (checkpoints, metrics, eval).",
    )
    _SFT_ONLY = flags.DEFINE_boolean("sft_only", False, "Run the SFT warm start, save it, and stop.")
    _EVAL = flags.DEFINE_boolean("eval", True, "Evaluate held-out tasks before and after training.")
    cli.run(main)
