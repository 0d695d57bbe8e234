"""`Engine`: paged KV cache, continuous batching, prefix reuse, exact speculative decoding, log-probs.

A sequence is its context (tokens whose K/V are in its pages) plus one pending token; admission, prefix reuse,
chunked prefill, copy-on-write forks of the n samples of a prompt, continuous or static batching and
preemption are `inference.scheduler`'s. Every decode step feeds each active row its pending token and
samples the next one, so all samples draw their first token with their own key. With a drafter the step
proposes k tokens, verifies them with one target forward over k + 1 positions and rolls the pages back past
the first rejection. Without one, `EngineConfig.decode_steps` = N > 1 runs up to N decode steps per device
call (`steps.decode_many`: sampling, stop tokens and lengths checked on the device, the same per-token keys,
so the same tokens as N single steps); the host admits and retires sequences between calls.

Streaming use: `submit` queues requests, `step` runs one scheduler step and returns the completions that
finished, `in_flight` shows how far the unfinished ones got and `cancel` drops a request (its pages freed);
`generate` is submit + step until done. `update_params` may be called between steps: sequences in
flight continue with the new weights (their cached K/V stays), each token keeps the log-prob it was sampled
with, and `Completion.policy_versions` says which version sampled each token. `update_draft_params` swaps a
`ModelDrafter`'s weights the same way.

With a `mesh` the engine runs on its devices in the inference layout (`inference.layout`: weights tensor
parallel over heads and MLP, experts over `expert`, replicated over data / fsdp; K/V pages over the tensor
axis; rows over the data axes), every step jitted with explicit in/out shardings; greedy and seeded tokens
are those of one device (f32 sums in another order move log-probs by ~1e-6). `update_params` takes weights
in any layout: on the engine's devices (the trainer's FSDP shards) or on other ones (a trainer on its own
devices), moved without a host round trip (`inference.weight_sync`, which also syncs deltas).

With `EngineConfig.record_routing` every target forward also writes the experts each MoE layer chose into
routing pages beside the K/V, and `Completion.expert_indices` carries them (`inference.routing`).

The weights the engine runs on are the model's `nnx.Param`s and, with a sigmoid router, its selection biases
(`model.moe.layer.ExpertBias`, DeepSeek-V3's e_score_correction_bias): one state, swapped together.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.engine import EngineConfig
from inference import layout, routing, steps, weight_sync
from inference import warmup as warmup_lib
from inference.compiles import Counting
from inference.completion import Completion
from inference.drafters import (
    GroupDrafter,
    ModelDrafter,
    MTPDrafter,
    check_drafter,
    model_weights,
    split_weights,
)
from inference.sampling import SamplingParams
from inference.scheduler import Emitted, Scheduler, Seq, StepPlan, budget, pow2
from inference.score import score as score_rows
from inference.weights import graph_config, weight_shardings
from model import config as model_config

__all__ = ["Engine", "EngineConfig", "graph_config", "weight_shardings"]
# The engine's caches indexed by pool page (each a dict of page arrays, or None): the target's K/V (or MLA
# latent) with the routing record, a ModelDrafter's K/V, the MTP drafter's. A page's contents are its slice
# of every one of them, so the host tier and copy-on-write move them together.
PAGED_CACHES = ("kv", "draft_kv", "mtp_kv")


class Engine:
    """`Engine(cfg, params, engine_cfg, *, draft=None, mesh=None)`: see the module docstring. `draft` is
    one of `inference.drafters.DRAFTERS` or None. `mesh` (`model.sharding.make_mesh`): the engine's devices
    and the inference layout (`inference.layout`); None keeps the weights where they are and the cache on
    their device.
    `scheduler` (`inference.scheduler.Scheduler`) holds the sequences and pages and plans each step; the
    engine holds the weights and caches and runs the device calls."""

    def __init__(
        self,
        cfg,
        params,
        engine_cfg: EngineConfig | None = None,
        *,
        draft=None,
        mesh: jax.sharding.Mesh | None = None,
        placed: bool = False,
    ):
        self.cfg, self.ecfg, self.mesh = cfg, engine_cfg or EngineConfig(), mesh
        e = self.ecfg
        if mesh is not None:
            layout.check_mesh(mesh)
        self._graphdef, abstract = split_weights(self._model_cfg(cfg))
        params = model_weights("params", params, abstract)
        if mesh is None:  # where they are (committed by the copy: weights placed alike hit its executables)
            self._weight_shardings = jax.tree.map(lambda a: a.sharding, params)
        else:
            self._weight_shardings = layout.weight_shardings(abstract, mesh, self._rules)
        self.params, _ = weight_sync.to_layout(params, self._weight_shardings, copy=not placed)
        self.version = 0
        self.vocab = cfg.model.vocab_size
        check_drafter(draft, cfg, e)
        self.draft = draft
        self._resample_from = "residual"  # "p": the deliberately biased variant, for the tests only
        self._stats = collections.Counter()
        self.scheduler = Scheduler(e, self.vocab, self, self._stats)
        self.pool, self.table, self.prefix = self.scheduler.pool, self.scheduler.table, self.scheduler.prefix
        dtype = e.cache_dtype or cfg.model.compute_dtype
        model = nnx.merge(self._graphdef, self.params)
        m = cfg.model
        kv_heads = model.cache_rows()[1]
        kv = jax.eval_shape(lambda: model.init_paged_cache(e.pool_pages, e.page_size, dtype))
        self.num_moe_layers = model_config.layer_counts(m)[1]
        if e.record_routing and self.num_moe_layers:
            kv["experts"] = jax.eval_shape(
                lambda: routing.init_pages(
                    self.num_moe_layers, e.pool_pages, e.page_size, m.moe.top_k, m.moe.num_experts
                )
            )
        self.kv = self._zeros(kv, kv_heads)
        self.draft_kv = self.draft_params = self._draft_graphdef = None
        if isinstance(draft, ModelDrafter):
            # The engine's own copy, swapped by update_draft_params.
            self._draft_graphdef, draft_abstract = split_weights(self._model_cfg(draft.cfg))
            self._draft_shardings = (
                jax.tree.map(lambda a: a.sharding, draft.params)
                if mesh is None
                else layout.weight_shardings(draft_abstract, mesh, self._rules)
            )
            self.draft_params, _ = weight_sync.to_layout(draft.params, self._draft_shardings, copy=not placed)
            draft_model = nnx.merge(self._draft_graphdef, self.draft_params)
            shapes = jax.eval_shape(lambda: draft_model.init_paged_cache(e.pool_pages, e.page_size, dtype))
            self.draft_kv = self._zeros(shapes, draft_model.cache_rows()[1])
        self.mtp_kv = self._mtp_carry = None
        if isinstance(draft, MTPDrafter):
            shapes = jax.eval_shape(lambda: model.init_mtp_paged_cache(e.pool_pages, e.page_size, dtype))
            self.mtp_kv = self._zeros(shapes, kv_heads)
            rows, compute = e.max_batch, jnp.dtype(m.compute_dtype)
            carry = steps.MTPCarry(
                jax.ShapeDtypeStruct((rows,), jnp.int32),
                jax.ShapeDtypeStruct((rows, self.vocab), jnp.float32),
                jax.ShapeDtypeStruct((rows, m.d_model), compute),
            )
            self._mtp_carry = self._zeros(carry, None)
        # MTP drafter: (sequence id, start) whose next first draft each slot's carry holds, else None.
        self._carry_for: list[tuple[int, int] | None] = [None] * e.max_batch
        self._build_steps()
        # step(): wall seconds inside it, and those spent blocked on the device's results (the rest is the
        # host's admission, page and bookkeeping work, which the device waits for between calls)
        self._seconds = {"step_s": 0.0, "device_wait_s": 0.0}
        self._compiles = [0]
        self._warm_compiles: int | None = None
        self._lock = threading.RLock()  # one scheduler step, submit or weight swap at a time
        self._waiting: dict[int, list[Completion]] = {}  # request id -> completions, for `generate`

    # --- public API ------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """n completions per prompt (`SamplingParams.n`), ordered by (prompt, sample). Thread-safe: other
        threads may generate, step or update the weights meanwhile (each step is atomic)."""
        with self._lock:
            ids = self.submit(prompts, sampling)
            want = {rid: p.n for rid, p in zip(ids, self._submitted_params(prompts, sampling))}
            for rid in ids:
                self._waiting[rid] = []
        try:
            while any(len(self._waiting[rid]) < n for rid, n in want.items()):
                if not self.has_work():
                    raise RuntimeError("engine queue emptied before the requests finished (a bug)")
                self.step()
            return [c for rid in ids for c in sorted(self._waiting[rid], key=lambda c: c.sample_index)]
        finally:
            with self._lock:
                for rid in ids:
                    self._waiting.pop(rid, None)

    @staticmethod
    def _submitted_params(prompts, sampling) -> list[SamplingParams]:
        sampling = SamplingParams() if sampling is None else sampling
        return [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[int]:
        """Queues prompts; returns one request id per prompt (`Completion.request_id`)."""
        params = self._submitted_params(prompts, sampling)
        if len(params) != len(prompts):
            raise ValueError(
                f"{len(params)} SamplingParams for {len(prompts)} prompts; pass one or one each."
            )
        prompts = [[int(t) for t in prompt] for prompt in prompts]
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            self.scheduler.check(i, prompt, p)  # all of them before queueing any
        group = self.draft.group if isinstance(self.draft, GroupDrafter) else None
        with self._lock:
            return self.scheduler.add(prompts, params, group)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Completion]:
        """Admits what fits, runs one decode (or speculative) step; returns the finished completions
        (those of requests a `generate` call waits for are also handed to it)."""
        with self._counting():
            t0 = time.perf_counter()
            plan = self.scheduler.schedule(self._growth())
            if plan is None:
                return []
            finished = self._spec_step(plan) if self.draft is not None else self._decode_step(plan)
            done = self._complete(finished)
            for c in done:
                if c.request_id in self._waiting:
                    self._waiting[c.request_id].append(c)
            self._seconds["step_s"] += time.perf_counter() - t0
            return done

    def _results(self, tree):
        """jax.device_get, timed as device wait."""
        t0 = time.perf_counter()
        out = jax.device_get(tree)
        self._seconds["device_wait_s"] += time.perf_counter() - t0
        return out

    def in_flight(self) -> list[Completion]:
        """Every unfinished sample of every submitted request as far as it got (running, queued or
        preempted; `finish_reason` ""): copies, for a driver that streams tokens between steps."""
        with self._lock:
            return self.scheduler.in_flight()

    def cancel(self, request_id: int, samples: Collection[int] | None = None) -> int:
        """Drops the unfinished samples of a submitted request (all, or those in `samples`), queued or
        running, and frees their pages; returns how many it dropped (0 for an unknown or finished request).
        For `submit` / `step` drivers (a server whose client went away); a `generate` call must not wait on
        the request."""
        with self._lock:
            return self.scheduler.cancel(request_id, samples)

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Completion | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[np.ndarray]:
        """Teacher-forced f32 log-probs of each completion's tokens from a plain forward pass (the trainer's
        model code): under `sampling`'s processing when given, else the raw softmax."""
        params = self._submitted_params(prompts, sampling)
        e = self.ecfg
        run = lambda tokens, arrays: self._score(self.params, tokens, arrays)
        with self._counting():
            return score_rows(
                run,
                prompts,
                completions,
                params,
                processed=sampling is not None,
                batch=e.score_batch,
                min_bucket=e.min_bucket,
            )

    def update_params(self, params, *, send: Sequence[bool] | None = None, placed: bool = False) -> int:
        """Swaps in new weights (same tree, shapes, dtypes: no recompile); bumps and returns the policy
        version. `params` is the module or its `nnx.Param` state, with the selection biases of a sigmoid
        router (`drafters.model_weights`); a Param-only state keeps the current biases. They may be in any
        layout, on the engine's devices or on others (`weight_sync.to_layout`; `stats()["weight_bytes"]`
        counts what moved). `send` (a bool per leaf, `jax.tree.leaves` order): only those leaves are
        taken, the others stay as they are (`weight_sync.WeightSync`'s delta sync). The prefix cache is
        emptied: its K/V came from the old weights. `placed`: `params` are a fresh copy already in the
        engine's layout (`weight_shardings()`), taken as they are."""
        params = model_weights("params", params, self.params, keep=self.params)
        with self._counting():
            # A copy: the trainer donates its params to the next step while sampling may still run.
            self.params, moved = weight_sync.to_layout(
                params, self._weight_shardings, current=self.params, send=send, copy=not placed
            )
            self._stats["weight_bytes"] += moved
            self._stats["weight_syncs"] += 1
            self.prefix.clear()
            self.version += 1
            return self.version

    def update_draft_params(self, params, *, placed: bool = False) -> None:
        """Swaps in new weights of the `ModelDrafter` (same tree, shapes, dtypes: no recompile), copied so
        the caller may donate its own. Sequences in flight and cached prefixes keep the draft K/V of the old
        weights: that only lowers acceptance, never exactness (each draft token is verified against the q it
        was sampled from)."""
        if not isinstance(self.draft, ModelDrafter):
            raise ValueError(
                f"update_draft_params needs an engine built with a ModelDrafter, not {self.draft!r}."
            )
        params = model_weights("draft params", params, self.draft_params, keep=self.draft_params)
        with self._counting():
            self.draft_params, _ = weight_sync.to_layout(params, self._draft_shardings, copy=not placed)

    def longest_prefill_bucket(self) -> int:
        """The longest prefill length bucket a call can use: `prefill_chunk`, or the bucket of `max_seq_len`
        where that is shorter (no context is longer). Warmup compiles no longer bucket: the test config
        (24 + 8 tokens, chunk 64) compiled three 64-token prefills it could never run."""
        e = self.ecfg
        return min(e.prefill_chunk, max(e.min_bucket, pow2(e.max_seq_len)))

    def warmup(self, *, score_lengths: Sequence[int] = ()) -> None:
        """Compiles every shape `step` can use (prefill buckets, decode / speculative step, page copies,
        host-tier moves) and the scoring buckets for `score_lengths`; later calls never compile
        (`stats()["compiles_after_warmup"]`)."""
        with self._counting():
            warmup_lib.run_every_shape(self, score_lengths)
        jax.block_until_ready(self.kv)
        self._warm_compiles = self._compiles[0]

    def stats(self) -> dict:
        s = dict(self._stats)
        s.update({k: round(v, 6) for k, v in self._seconds.items()})
        forwards = max(s.get("target_row_forwards", 0), 1)
        s["tokens_per_target_forward"] = s.get("generated_tokens", 0) / forwards
        s["acceptance_rate"] = s.get("accepted_tokens", 0) / max(s.get("proposed_tokens", 0), 1)
        s["compiles"] = self._compiles[0]
        if self._warm_compiles is not None:
            s["compiles_after_warmup"] = self._compiles[0] - self._warm_compiles
        s["policy_version"] = self.version
        s["prefix_cache"] = self.prefix.stats()
        s["free_pages"] = self.pool.num_free
        s["running"] = self.scheduler.num_active()  # sequences in decode slots
        s["queued"] = len(self.scheduler.queue)  # sequences waiting for a slot (preempted ones included)
        return s

    # --- one step ------------------------------------------------------------------------------------

    def _growth(self):
        """The positions each running sequence reserves for this step: one decode step's 1, a speculative
        step's num_draft + 1, or for a call of several steps the tokens it may still emit plus the
        num_draft positions a last speculative step writes past them."""
        if self._spec_many is not None or self._decode_many is not None:
            most, extra = self._many
            return lambda seq: budget(seq, most) + extra
        return 1 if self.draft is None else self.ecfg.num_draft + 1

    @property
    def _many(self) -> tuple[int, int]:
        """(most tokens a row emits, positions written past them) of a call of several steps."""
        e = self.ecfg
        if self._spec_many is not None:
            return e.decode_steps * (e.num_draft + 1), e.num_draft
        return e.decode_steps, 0

    def _decode_step(self, plan: StepPlan) -> list[Seq]:
        if self._decode_many is not None:
            return self._decode_many_step(plan)
        self.kv, nxt, logp, raw = self._decode(self.params, self.kv, plan.rows)
        nxt, logp, raw = self._results((nxt, logp, raw))
        self._stats["target_row_forwards"] += len(plan.active)
        self._stats["decode_steps"] += 1
        return self.scheduler.update(plan, Emitted(nxt[:, None], logp[:, None], raw[:, None]), self.version)

    def _decode_many_step(self, plan: StepPlan) -> list[Seq]:
        """Up to decode_steps tokens per row in one call (`steps.decode_many`)."""
        stop_BS, budget_B = self.scheduler.budgets(plan, self._many[0])
        self.kv, *out = self._decode_many(self.params, self.kv, plan.rows, stop_BS, budget_B)
        tokens, logp, raw, count = self._results(out)
        self._stats["target_row_forwards"] += int(count.sum())
        self._stats["decode_steps"] += int(count.max(initial=0))
        self._stats["decode_calls"] += 1
        return self.scheduler.update(plan, Emitted(tokens, logp, raw, count, "unfinished"), self.version)

    def _propose(self, seq: Seq, k: int) -> list[int]:
        if isinstance(self.draft, GroupDrafter):
            return self.scheduler.groups[seq.request_id].propose(seq.sample, k)
        return self.draft.propose(seq.prompt + seq.tokens, k)

    def _spec_step(self, plan: StepPlan) -> list[Seq]:
        if self._spec_many is not None:
            return self._spec_many_step(plan)
        k, active, rows = self.ecfg.num_draft, plan.active, plan.rows
        draft = np.zeros((self.ecfg.max_batch, k), np.int32)
        num_draft = np.zeros(self.ecfg.max_batch, np.int32)
        if isinstance(self.draft, ModelDrafter):
            num_draft[:] = k
        elif isinstance(self.draft, MTPDrafter):  # the carry holds a first draft for rows that ran before
            for b, seq in active:
                num_draft[b] = k if self._carry_for[b] == (seq.id, int(rows.start_B[b])) else 0
        else:
            for b, seq in active:
                proposal = self._propose(seq, k)
                draft[b, : len(proposal)], num_draft[b] = proposal, len(proposal)
        accepted, out, logp, raw = self._results(self._run_spec(rows, draft, num_draft))
        self._stats["target_row_forwards"] += len(active)
        self._stats["spec_steps"] += 1
        self._carry_for = [None] * self.ecfg.max_batch
        for b, seq in active:
            a = int(accepted[b])
            self._carry_for[b] = (seq.id, int(rows.start_B[b]) + a + 1)
            self._stats["proposed_tokens"] += int(num_draft[b])
            self._stats["accepted_tokens"] += a
        return self.scheduler.update(plan, Emitted(out, logp, raw, accepted + 1, "always"), self.version)

    def _spec_many_step(self, plan: StepPlan) -> list[Seq]:
        """Up to decode_steps speculative steps per row in one call (`steps.speculative_model_many`); a step
        writes num_draft positions past the last token it may emit, so those are reserved too."""
        k = self.ecfg.num_draft
        stop_BS, budget_B = self.scheduler.budgets(plan, self._many[0])
        self.kv, self.draft_kv, *out = self._spec_many(
            self.params, self.draft_params, self.kv, self.draft_kv, plan.rows, stop_BS, budget_B
        )
        tokens, logp, raw, count, accepted, steps_run = self._results(out)
        self._stats["target_row_forwards"] += int(steps_run.sum())
        self._stats["spec_steps"] += int(steps_run.max(initial=0))
        self._stats["spec_calls"] += 1
        self._stats["proposed_tokens"] += k * int(steps_run.sum())
        self._stats["accepted_tokens"] += int(accepted.sum())
        return self.scheduler.update(plan, Emitted(tokens, logp, raw, count, "unfinished"), self.version)

    def _complete(self, finished: list[Seq]) -> list[Completion]:
        """Completions of the sequences that finished this step: reads their routing records (one device
        read for all) before their pages are freed."""
        records = [None] * len(finished)
        if self.ecfg.record_routing:
            lengths = [len(seq.prompt) + len(seq.tokens) for seq in finished]
            if "experts" in self.kv:
                pages = [self.table.pages(seq.id) for seq in finished]
                records = routing.read(self.kv["experts"], list(zip(pages, lengths)))
            else:  # a dense model: no MoE layer
                records = [routing.empty(n, self.cfg.model.moe.top_k) for n in lengths]
        out = []
        for seq, record in zip(finished, records):
            self.scheduler.release(seq)
            out.append(
                Completion(
                    seq.prompt_index,
                    seq.tokens,
                    seq.logprobs,
                    seq.finish_reason,
                    seq.sample,
                    seq.raw,
                    seq.versions,
                    seq.request_id,
                    expert_indices=record,
                )
            )
        return out

    # --- page arrays (the scheduler's device side) -------------------------------------------------------

    def offload_prefix(self, n: int) -> int:
        """Moves up to n idle prefix-cache blocks (least recently used first) to the host tier, every page
        array of each (`PAGED_CACHES`), and frees their device pages; returns how many it moved. A later
        prompt with that prefix reloads them. Needs `EngineConfig.host_cache_pages` > 0."""
        if not self.ecfg.host_cache_pages:
            raise ValueError("offload_prefix needs engine.host_cache_pages > 0 (the host tier is off)")
        return self.prefix.offload_lru(n, self._page_arrays())

    def _page_arrays(self) -> dict:
        """Every device array indexed by pool page, as 'cache/name' -> array (`PAGED_CACHES`)."""
        caches = ((c, getattr(self, c)) for c in PAGED_CACHES)
        return {f"{c}/{name}": a for c, tree in caches if tree is not None for name, a in tree.items()}

    def _set_page_arrays(self, arrays: dict) -> None:
        for key, a in arrays.items():
            cache, name = key.split("/")
            getattr(self, cache)[name] = a

    # --- device calls ----------------------------------------------------------------------------------

    def _build_steps(self) -> None:
        """The jitted steps, shared by every engine over the same model graph and sizes (no re-tracing
        when an engine is rebuilt)."""
        g, e, place = self._graphdef, self.ecfg, self._placement()
        self._prefill_fn = steps.jitted("prefill", g, place=place)
        rows, spec_rows = e.max_batch, e.max_batch * (e.num_draft + 1)  # the matmul rows of each call
        self._decode = steps.jitted("decode", g, place=place, rows=rows)
        self._decode_many = (
            steps.jitted("decode_many", g, e.decode_steps, place=place, rows=rows)
            if e.decode_steps > 1
            else None
        )
        self._score = steps.jitted("score", g, place=place)
        self._spec_many = None
        self._copy = steps.jitted("copy", place=place)
        self._copy_draft = self._copy_mtp = self._copy
        if place is not None:  # `copy` copies the pages of place.kv
            if self.draft_kv is not None:
                self._copy_draft = steps.jitted("copy", place=dataclasses.replace(place, kv=place.draft_kv))
            if self.mtp_kv is not None:
                self._copy_mtp = steps.jitted("copy", place=dataclasses.replace(place, kv=place.mtp_kv))
        if isinstance(self.draft, ModelDrafter):
            draft_g = self._draft_graphdef
            draft_place = (
                None
                if place is None
                else dataclasses.replace(place, params=place.draft_params, kv=place.draft_kv)
            )
            self._draft_prefill = steps.jitted("prefill", draft_g, place=draft_place)
            self._spec = steps.jitted(
                "spec_model", g, draft_g, e.num_draft, self._resample_from, place=place, rows=spec_rows
            )
            if e.decode_steps > 1:
                self._spec_many = steps.jitted(
                    "spec_model_many",
                    g,
                    draft_g,
                    e.num_draft,
                    e.decode_steps,
                    self._resample_from,
                    place=place,
                    rows=spec_rows,
                )
        elif isinstance(self.draft, MTPDrafter):
            self._prefill_fn = steps.jitted("prefill_mtp", g, place=place)
            self._spec = steps.jitted(
                "spec_mtp", g, e.num_draft, self._resample_from, place=place, rows=spec_rows
            )
        elif self.draft is not None:  # one-hot proposals from the host
            self._spec = steps.jitted(
                "spec_tokens", g, self.vocab, self._resample_from, place=place, rows=spec_rows
            )

    def _placement(self) -> layout.Placement | None:
        trees = (self.params, self.kv, self.draft_params, self.draft_kv, self.mtp_kv)
        return None if self.mesh is None else layout.placement(self.mesh, *trees)

    @property
    def _rules(self) -> tuple:
        return layout.inference_rules(tuple(self.cfg.mesh.rules))

    def _model_cfg(self, cfg):
        return graph_config(cfg, self.ecfg, self.mesh)

    def _zeros(self, shapes, kv_heads: int | None):
        return layout.cache_zeros(shapes, self.mesh, kv_heads)

    def weight_shardings(self, draft: bool = False):
        """The shardings of the engine's weights (or its draft model's): where `placed` weights must be."""
        return self._draft_shardings if draft else self._weight_shardings

    @property
    def devices(self) -> set:
        """The devices holding the engine's weights."""
        return {d for a in jax.tree.leaves(self.params) for d in a.sharding.device_set}

    def _run_prefill(self, tokens, next_tokens, table, start, num) -> None:
        if self.mtp_kv is not None:
            self.kv, self.mtp_kv = self._prefill_fn(
                self.params, self.kv, self.mtp_kv, tokens, next_tokens, table, start, num
            )
            return
        self.kv = self._prefill_fn(self.params, self.kv, tokens, table, start, num)
        if self.draft_kv is not None:
            self.draft_kv = self._draft_prefill(self.draft_params, self.draft_kv, tokens, table, start, num)

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies, padded to max_batch (one shape); more are applied in chunks."""
        if not copies and self._warm_compiles is not None:
            return
        n = self.ecfg.max_batch
        for i in range(0, max(len(copies), 1), n):
            chunk = copies[i : i + n]
            src, dst = np.zeros(n, np.int32), np.zeros(n, np.int32)
            if chunk:
                src[: len(chunk)], dst[: len(chunk)] = zip(*chunk)
            self.kv = self._copy(self.kv, src, dst)
            if self.draft_kv is not None:
                self.draft_kv = self._copy_draft(self.draft_kv, src, dst)
            if self.mtp_kv is not None:
                self.mtp_kv = self._copy_mtp(self.mtp_kv, src, dst)

    def _run_spec(self, rows: steps.Rows, draft, num_draft):
        if isinstance(self.draft, ModelDrafter):
            self.kv, self.draft_kv, *out = self._spec(
                self.params, self.draft_params, self.kv, self.draft_kv, rows
            )
        elif isinstance(self.draft, MTPDrafter):
            self.kv, self.mtp_kv, self._mtp_carry, *out = self._spec(
                self.params, self.kv, self.mtp_kv, self._mtp_carry, rows, num_draft
            )
        else:
            self.kv, *out = self._spec(self.params, self.kv, rows, draft, num_draft)
        return out

    def _counting(self):
        return Counting(self._compiles, self._lock)
