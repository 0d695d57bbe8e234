"""`Engine`: paged KV cache, continuous batching, prefix reuse, exact speculative decoding, log-probs.

A sequence is its context (tokens whose K/V are in its pages) plus one pending token. A new request's context
is its prompt without the last token: the longest page-aligned prefix of it already in the prefix cache is
adopted (no compute), the rest is prefilled in chunks of at most `prefill_chunk` tokens (bucketed lengths),
once per distinct context; the n samples of a prompt fork that sequence (copy-on-write pages). Every decode
step then feeds each active row its pending token and samples the next one, so all samples draw their first
token with their own key. With a drafter the step proposes k tokens, verifies them with one target forward
over k + 1 positions and rolls the pages back past the first rejection.

Scheduling (`EngineConfig.scheduler`): "continuous" admits queued sequences into free decode slots before
every step (as soon as one finishes); "static" admits only into an empty batch (the baseline). When the
pool runs out of pages mid-decode the most recently admitted sequence is preempted: its pages are freed and
it re-enters the queue with its generated tokens, to be re-prefilled (mostly from the prefix cache).

Streaming use: `submit` queues requests, `step` runs one scheduler step and returns the completions that
finished; `generate` is submit + step until done. `update_params` may be called between steps: sequences in
flight continue with the new weights (their cached K/V stays), each token keeps the log-prob it was sampled
with, and `Completion.policy_versions` says which version sampled each token.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import model as model_lib
from inference import kv_pages, steps
from inference.drafters import ModelDrafter, NgramDrafter, _check_params
from inference.engine_config import Completion, EngineConfig
from inference.sampling import SamplingParams, sampling_arrays

_NO_RELOAD = kv_pages.HostReload([], None, None)


@dataclasses.dataclass
class _Seq:
    id: int
    request_id: int
    prompt_index: int
    sample: int
    params: SamplingParams
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    raw: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    admitted: int = -1

    @property
    def pending(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt[-1]

    @property
    def context(self) -> list[int]:
        return (self.prompt + self.tokens)[:-1]


# Lowerings (new executables, whether compiled or read from the persistent cache) in engine calls.
_TLS = threading.local()


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and getattr(_TLS, "counter", None):
        _TLS.counter[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Engine:
    """`Engine(cfg, params, engine_cfg, *, draft=None)`: see the module docstring."""

    def __init__(self, cfg, params, engine_cfg: EngineConfig | None = None, *, draft=None):
        self.cfg, self.ecfg = cfg, engine_cfg or EngineConfig()
        e = self.ecfg
        abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
        self._graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        _check_params("params", params, abstract_params)
        # Committed placements, so that weights from update_params (placed alike) hit the same executables.
        self.params = _committed(params)
        self._param_shardings = jax.tree.map(lambda a: a.sharding, self.params)
        self._copy_params = jax.jit(
            lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=self._param_shardings
        )
        self.version = 0
        self.vocab = cfg.model.vocab_size
        if draft is not None and not isinstance(draft, (ModelDrafter, NgramDrafter)):
            raise TypeError(f"draft={draft!r} must be an inference.ModelDrafter, NgramDrafter or None.")
        if isinstance(draft, ModelDrafter) and draft.cfg.model.vocab_size != self.vocab:
            raise ValueError(
                f"draft model vocab_size={draft.cfg.model.vocab_size} != target vocab_size={self.vocab}."
            )
        if draft is not None and e.host_cache_pages:
            raise ValueError(
                "engine.host_cache_pages must be 0 with a drafter (the host tier moves target pages only)."
            )
        self.draft = draft
        self._resample_from = "residual"  # "p": the deliberately biased variant, for the tests only
        self.pool = kv_pages.PagePool(e.pool_pages, e.page_size)
        self.table = kv_pages.SequenceTable(self.pool, e.pages_per_seq)
        self.prefix = kv_pages.PrefixCache(self.pool, e.page_size, e.prefix_pages, e.host_cache_pages)
        dtype = e.cache_dtype or cfg.model.compute_dtype
        model = nnx.merge(self._graphdef, self.params)
        self.kv = _committed(model.init_paged_cache(e.pool_pages, e.page_size, dtype))
        self.draft_kv = None
        if isinstance(draft, ModelDrafter):
            draft_model = nnx.merge(draft.graphdef, draft.params)
            self.draft_kv = _committed(draft_model.init_paged_cache(e.pool_pages, e.page_size, dtype))
        self._build_steps()
        self._slots: list[_Seq | None] = [None] * e.max_batch
        self._queue: collections.deque[_Seq] = collections.deque()
        self._holders: dict[int, int] = {}  # request id -> sequence holding its context for queued samples
        self._next_seq = self._next_request = self._admissions = 0
        self._stats = collections.Counter()
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
            self._check_prompt(i, prompt, p)  # all of them before queueing any
        ids = []
        with self._lock:
            return self._queue_requests(prompts, params, ids)

    def _queue_requests(self, prompts, params, ids) -> list[int]:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = self._next_request
            self._next_request += 1
            ids.append(rid)
            for s in range(p.n):
                self._queue.append(_Seq(self._next_seq, rid, i, s, p, prompt))
                self._next_seq += 1
        return ids

    def has_work(self) -> bool:
        return bool(self._queue) or any(s is not None for s in self._slots)

    def step(self) -> list[Completion]:
        """Admits what fits, runs one decode (or speculative) step; returns the finished completions
        (those of requests a `generate` call waits for are also handed to it)."""
        with self._counting():
            self._admit()
            active = [(b, s) for b, s in enumerate(self._slots) if s is not None]
            if not active:
                return []
            done = self._spec_step(active) if self.draft is not None else self._decode_step(active)
            for c in done:
                if c.request_id in self._waiting:
                    self._waiting[c.request_id].append(c)
            return done

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Completion | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[np.ndarray]:
        """Teacher-forced f32 log-probs of each completion's tokens from a plain forward pass (the trainer's
        model code): under `sampling`'s processing when given, else the raw softmax."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
        params = self._submitted_params(prompts, sampling)
        rows = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            toks = list(c.tokens if isinstance(c, Completion) else c)
            rows.append((i, [int(t) for t in p], toks))
        out: list[np.ndarray | None] = [None] * len(rows)
        by_len = sorted(rows, key=lambda r: len(r[1]) + len(r[2]))
        with self._counting():
            for start in range(0, len(by_len), self.ecfg.score_batch):
                chunk = by_len[start : start + self.ecfg.score_batch]
                t = max(self.ecfg.min_bucket, _pow2(max(len(p) + len(c) for _, p, c in chunk)))
                b = _pow2(len(chunk))
                tokens = np.zeros((b, t), np.int32)
                for r, (_, p, c) in enumerate(chunk):
                    tokens[r, : len(p) + len(c)] = p + c
                arrays = sampling_arrays(
                    [params[i] for i, _, _ in chunk] + [SamplingParams()] * (b - len(chunk))
                )
                processed, raw = jax.device_get(self._score(self.params, tokens, arrays))
                chosen = processed if sampling is not None else raw
                for r, (i, p, c) in enumerate(chunk):
                    out[i] = chosen[r, len(p) : len(p) + len(c)]
        return out

    def update_params(self, params) -> int:
        """Swaps in new weights (same tree, shapes, dtypes: no recompile); bumps and returns the policy
        version. The prefix cache is emptied: its K/V came from the old weights."""
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        _check_params("params", params, self.params)
        with self._counting():
            # A copy: the trainer donates its params to the next step while sampling may still run.
            self.params = self._copy_params(jax.device_put(params, self._param_shardings))
            self.prefix.clear()
            self.version += 1
            return self.version

    def warmup(self, *, score_lengths: Sequence[int] = ()) -> None:
        """Compiles every shape `step` can use (prefill buckets, decode / speculative step, page copies,
        host-tier moves) and the scoring buckets for `score_lengths`; later calls never compile
        (`stats()["compiles_after_warmup"]`)."""
        e = self.ecfg
        with self._counting():
            zeros = lambda *shape: np.zeros(shape, np.int32)
            t = e.min_bucket
            while t <= e.prefill_chunk:
                b = 1
                while b <= e.prefill_batch:
                    self._run_prefill(zeros(b, t), zeros(b, e.pages_per_seq), zeros(b), zeros(b))
                    b *= 2
                t *= 2
            self._apply_copies([])
            rows = e.max_batch
            arrays = sampling_arrays([SamplingParams()] * rows)
            keys = tuple(zeros(rows) for _ in range(4))
            table = zeros(rows, e.pages_per_seq)
            dummy = steps.Rows(zeros(rows), table, zeros(rows), zeros(rows), arrays, keys)
            if self.draft is None:
                self.kv, *_ = self._decode(self.params, self.kv, dummy)
            else:
                self._run_spec(dummy, zeros(rows, e.num_draft), zeros(rows))
            if e.host_cache_pages:
                n = 1
                while n <= _pow2(e.pages_per_seq):
                    pages = [kv_pages.NULL_PAGE] * n
                    host = kv_pages.gather_pages(self.kv["k"], self.kv["v"], pages)
                    self.kv["k"], self.kv["v"] = kv_pages.scatter_pages(
                        self.kv["k"], self.kv["v"], pages, *host
                    )
                    n *= 2
            for length in score_lengths:
                b = 1
                while b <= e.score_batch:
                    self.score([[0]] * b, [[0] * max(length - 1, 1)] * b)
                    b *= 2
            self.params = self._copy_params(self.params)
        jax.block_until_ready(self.kv)
        self._warm_compiles = self._compiles[0]

    def stats(self) -> dict:
        s = dict(self._stats)
        forwards = max(s.get("target_row_forwards", 0), 1)
        s["tokens_per_target_forward"] = s.get("generated_tokens", 0) / forwards
        s["acceptance_rate"] = s.get("accepted_tokens", 0) / max(s.get("proposed_tokens", 0), 1)
        s["compiles"] = self._compiles[0]
        if self._warm_compiles is not None:
            s["compiles_after_warmup"] = self._compiles[0] - self._warm_compiles
        s["policy_version"] = self.version
        s["prefix_cache"] = self.prefix.stats()
        s["free_pages"] = self.pool.num_free
        return s

    # --- scheduling ------------------------------------------------------------------------------------

    def _check_prompt(self, i: int, prompt: list[int], p: SamplingParams) -> None:
        if not prompt:
            raise ValueError(f"prompts[{i}] is empty; a prompt needs at least one token (e.g. a BOS id).")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(
                f"prompts[{i}] has token ids {bad[:5]} outside the vocabulary [0, {self.vocab})."
            )
        if len(prompt) + p.max_new_tokens > self.ecfg.max_seq_len:
            raise ValueError(
                f"prompts[{i}]: {len(prompt)} prompt tokens + max_new_tokens={p.max_new_tokens} exceed "
                f"engine.max_seq_len={self.ecfg.max_seq_len}; raise max_seq_len or lower max_new_tokens."
            )
        if any(not 0 <= t < self.vocab for t in p.stop_tokens):
            raise ValueError(f"stop_tokens={p.stop_tokens} must be ids in [0, {self.vocab}).")

    def _admit(self) -> None:
        e = self.ecfg
        free = [b for b, s in enumerate(self._slots) if s is None]
        if e.scheduler == "static" and len(free) < e.max_batch:
            return
        jobs = []
        while free and self._queue:
            leader = self._queue[0]
            group = [leader]
            for seq in list(self._queue)[1 : len(free)]:
                if seq.request_id != leader.request_id or seq.tokens or leader.tokens:
                    break
                group.append(seq)
            context = leader.context
            need = -(-len(context) // e.page_size) + len(group)
            if self.pool.num_free + self.prefix.reclaimable() < need and (jobs or self._num_active()):
                break
            donor = None if leader.tokens else self._holders.get(leader.request_id)
            try:
                if donor is not None:  # a later sample of an admitted request: share its context pages
                    self.table.fork(donor, leader.id)
                    self.table.truncate(leader.id, len(context))
                    start = len(context)
                else:
                    start = self._start(leader, context)
            except kv_pages.OutOfPages:
                if jobs or self._num_active():
                    break
                raise RuntimeError(
                    f"engine.num_pages={e.pool_pages} cannot hold one sequence of {len(context)} tokens; "
                    "raise engine.num_pages."
                ) from None
            for seq in group[1:]:
                self.table.fork(leader.id, seq.id)
            for seq in group:
                self._queue.popleft()
                seq.admitted = self._admissions
                self._admissions += 1
                self._slots[free.pop(0)] = seq
            jobs.append((leader, start, context))
            queued = any(q.request_id == leader.request_id and not q.tokens for q in self._queue)
            if queued and leader.request_id not in self._holders:
                # Samples still waiting for a slot: keep the context pages until the last one is admitted.
                self._holders[leader.request_id] = holder = self._next_seq
                self._next_seq += 1
                self.table.fork(leader.id, holder)
        for rid in [r for r in self._holders if not any(q.request_id == r for q in self._queue)]:
            self.table.free(self._holders.pop(rid))
        if jobs:
            self._prefill(jobs)

    def _num_active(self) -> int:
        return sum(s is not None for s in self._slots)

    def _start(self, seq: _Seq, context: list[int]) -> int:
        """New sequence over the cached prefix of `context`; reserves pages for the rest. Returns the
        number of context tokens already cached."""
        hit = self.prefix.lookup(context) if self.ecfg.prefix_pages else kv_pages.PrefixHit([], 0, _NO_RELOAD)
        if hit.reload.pages:
            self.kv["k"], self.kv["v"] = hit.reload.apply(self.kv["k"], self.kv["v"])
        self.table.new(seq.id, hit.pages, hit.num_tokens)
        try:
            self.table.append_tokens(seq.id, len(context) - hit.num_tokens)
        except kv_pages.OutOfPages:
            self.table.free(seq.id)
            raise
        return hit.num_tokens

    def _prefill(self, jobs: list[tuple[_Seq, int, list[int]]]) -> None:
        e = self.ecfg
        work = [[seq, start, context] for seq, start, context in jobs if start < len(context)]
        self._stats["prefill_tokens"] += sum(len(c) - s for _, s, c in work)
        while work:
            work.sort(key=lambda w: len(w[2]) - w[1], reverse=True)
            batch = work[: e.prefill_batch]
            t = min(e.prefill_chunk, max(e.min_bucket, _pow2(max(len(c) - s for _, s, c in batch))))
            b = _pow2(len(batch))
            tokens, table = np.zeros((b, t), np.int32), np.zeros((b, e.pages_per_seq), np.int32)
            start_B, num_B = np.zeros(b, np.int32), np.zeros(b, np.int32)
            for r, (seq, start, context) in enumerate(batch):
                n = min(t, len(context) - start)
                tokens[r, :n] = context[start : start + n]
                table[r] = self.table.page_table([seq.id])[0]
                start_B[r], num_B[r] = start, n
            self._run_prefill(tokens, table, start_B, num_B)
            self._stats["prefill_calls"] += 1
            for r, w in enumerate(batch):
                w[1] += int(num_B[r])
            work = [w for w in work if w[1] < len(w[2])]
        for seq, _, context in jobs if self.ecfg.prefix_pages else ():
            self.prefix.insert(context, self.table.pages(seq.id))
        self._offload_cold()

    def _offload_cold(self) -> None:
        """Keeps free device pages for new work by moving idle prefix blocks to the host tier."""
        if not self.ecfg.host_cache_pages:
            return
        want = self.ecfg.max_batch - self.pool.num_free
        if want > 0:
            n = min(_pow2(want), _pow2(self.ecfg.pages_per_seq))
            pages = self.prefix.offload_candidates(n)
            if pages:
                padded = pages + [kv_pages.NULL_PAGE] * (_pow2(len(pages)) - len(pages))
                k, v = kv_pages.gather_pages(self.kv["k"], self.kv["v"], padded)
                self.prefix.offload(pages, k[:, : len(pages)], v[:, : len(pages)])

    def _grow(self, active: list[tuple[int, _Seq]], n: int) -> list[tuple[int, _Seq]]:
        """Reserves n more slots for each active sequence (preempting the youngest when out of pages) and
        applies the copy-on-write copies. Returns the rows still active."""
        copies, grown = {}, []
        for b, seq in sorted(active, key=lambda a: a[1].admitted):
            while seq in self._slots:  # (a sequence preempted for an older one is skipped)
                try:
                    copies[seq.id] = self.table.append_tokens(seq.id, n).copies
                    grown.append((b, seq))
                    break
                except kv_pages.OutOfPages:
                    victim = max((s for s in self._slots if s is not None), key=lambda s: s.admitted)
                    self._preempt(victim)
                    grown = [(bb, s) for bb, s in grown if s is not victim]
                    if victim is seq:
                        break
        # A preempted sequence's copies are dropped: its pages may already belong to someone else.
        self._apply_copies([c for _, seq in grown for c in copies[seq.id]])
        return sorted(grown)

    def _preempt(self, seq: _Seq) -> None:
        self.table.free(seq.id)
        self._slots[self._slots.index(seq)] = None
        self._queue.appendleft(seq)
        self._stats["preemptions"] += 1

    def _rows(self, active):
        """Per-slot arrays: pending tokens, page tables, starts, active flags, sampling, keys."""
        e = self.ecfg
        rows = e.max_batch
        tokens, start = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        act = np.zeros(rows, np.int32)
        table = np.zeros((rows, e.pages_per_seq), np.int32)
        seed, req, sample, stepi = (np.zeros(rows, np.int32) for _ in range(4))
        params = [SamplingParams()] * rows
        for b, seq in active:
            tokens[b], act[b] = seq.pending, 1
            start[b] = len(seq.prompt) + len(seq.tokens) - 1
            table[b] = self.table.page_table([seq.id])[0]
            seed[b], req[b], sample[b], stepi[b] = (
                seq.params.seed,
                seq.prompt_index,
                seq.sample,
                len(seq.tokens),
            )
            params[b] = seq.params
        return steps.Rows(tokens, table, start, act, sampling_arrays(params), (seed, req, sample, stepi))

    def _decode_step(self, active) -> list[Completion]:
        active = self._grow(active, 1)
        self.kv, nxt, logp, raw = self._decode(self.params, self.kv, self._rows(active))
        nxt, logp, raw = jax.device_get((nxt, logp, raw))
        self._stats["target_row_forwards"] += len(active)
        self._stats["decode_steps"] += 1
        return [c for b, seq in active if (c := self._emit(seq, [nxt[b]], [logp[b]], [raw[b]]))]

    def _spec_step(self, active) -> list[Completion]:
        k = self.ecfg.num_draft
        active = self._grow(active, k + 1)
        rows = self._rows(active)
        draft = np.zeros((self.ecfg.max_batch, k), np.int32)
        num_draft = np.zeros(self.ecfg.max_batch, np.int32)
        if isinstance(self.draft, NgramDrafter):
            for b, seq in active:
                proposal = self.draft.propose(seq.prompt + seq.tokens, k)
                draft[b, : len(proposal)], num_draft[b] = proposal, len(proposal)
        else:
            num_draft[:] = k
        accepted, out, logp, raw = jax.device_get(self._run_spec(rows, draft, num_draft))
        self._stats["target_row_forwards"] += len(active)
        self._stats["spec_steps"] += 1
        finished = []
        for b, seq in active:
            a = int(accepted[b])
            self._stats["proposed_tokens"] += int(num_draft[b])
            self._stats["accepted_tokens"] += a
            self.table.truncate(seq.id, int(rows.start_B[b]) + a + 1)
            c = self._emit(seq, out[b, : a + 1], logp[b, : a + 1], raw[b, : a + 1])
            if c:
                finished.append(c)
        return finished

    def _emit(self, seq: _Seq, tokens, logps, raws) -> Completion | None:
        """Appends emitted tokens up to a stop token or max_new_tokens; frees a finished sequence."""
        p, reason = seq.params, None
        for tok, lp, raw in zip(tokens, logps, raws):
            seq.tokens.append(int(tok))
            seq.logprobs.append(float(lp))
            seq.raw.append(float(raw))
            seq.versions.append(self.version)
            self._stats["generated_tokens"] += 1
            if int(tok) in p.stop_tokens:
                reason = "stop"
            elif len(seq.tokens) >= p.max_new_tokens:
                reason = "length"
            if reason:
                break
        if reason is None:
            return None
        self.table.free(seq.id)
        self._slots[self._slots.index(seq)] = None
        self._stats["completions"] += 1
        return Completion(
            seq.prompt_index,
            seq.tokens,
            seq.logprobs,
            reason,
            seq.sample,
            seq.raw,
            seq.versions,
            seq.request_id,
        )

    # --- device calls ----------------------------------------------------------------------------------

    def _build_steps(self) -> None:
        """The jitted steps, shared by every engine over the same model graph and sizes (no re-tracing
        when an engine is rebuilt)."""
        g, e = self._graphdef, self.ecfg
        self._prefill_fn = _jitted("prefill", g)
        self._decode = _jitted("decode", g)
        self._score = _jitted("score", g)
        self._copy = _jitted("copy")
        if isinstance(self.draft, ModelDrafter):
            self._draft_prefill = _jitted("prefill", self.draft.graphdef)
            self._spec = _jitted("spec_model", g, self.draft.graphdef, e.num_draft, self._resample_from)
        elif isinstance(self.draft, NgramDrafter):
            self._spec = _jitted("spec_tokens", g, self.vocab, self._resample_from)

    def _run_prefill(self, tokens, table, start, num) -> None:
        self.kv = self._prefill_fn(self.params, self.kv, tokens, table, start, num)
        if self.draft_kv is not None:
            self.draft_kv = self._draft_prefill(self.draft.params, self.draft_kv, tokens, table, start, num)

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
                self.draft_kv = self._copy(self.draft_kv, src, dst)

    def _run_spec(self, rows: steps.Rows, draft, num_draft):
        if isinstance(self.draft, ModelDrafter):
            self.kv, self.draft_kv, *out = self._spec(
                self.params, self.draft.params, self.kv, self.draft_kv, rows
            )
        else:
            self.kv, *out = self._spec(self.params, self.kv, rows, draft, num_draft)
        return out

    def _counting(self):
        return _Counting(self._compiles, self._lock)


class _Counting:
    """Holds the engine lock and counts lowerings in this thread while inside an engine call."""

    def __init__(self, counter: list[int], lock: threading.RLock):
        self.counter, self.lock = counter, lock

    def __enter__(self):
        self.lock.acquire()
        self.saved = getattr(_TLS, "counter", None)
        _TLS.counter = self.counter

    def __exit__(self, *exc):
        _TLS.counter = self.saved
        self.lock.release()


@functools.lru_cache(maxsize=64)
def _jitted(kind: str, *static):
    if kind == "prefill":
        return jax.jit(functools.partial(steps.prefill, *static), donate_argnums=1)
    if kind == "decode":
        return jax.jit(functools.partial(steps.decode, *static), donate_argnums=1)
    if kind == "score":
        return jax.jit(functools.partial(steps.score, *static))
    if kind == "copy":
        return jax.jit(steps.copy_pages, donate_argnums=0)
    if kind == "spec_model":
        g, draft_g, k, resample_from = static
        fn = functools.partial(steps.speculative_model, g, draft_g, num_draft=k, resample_from=resample_from)
        return jax.jit(fn, donate_argnums=(2, 3))
    g, vocab, resample_from = static
    fn = functools.partial(steps.speculative_tokens, g, vocab=vocab, resample_from=resample_from)
    return jax.jit(fn, donate_argnums=1)


def _committed(tree):
    """Commits arrays to their current placement: jit caches executables per committed-ness, so arrays
    that later come back from jitted steps (committed) must start out committed too."""
    return jax.device_put(tree, jax.tree.map(lambda a: a.sharding, tree))
