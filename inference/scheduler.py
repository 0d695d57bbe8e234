"""Scheduling of the engine's sequences: admission, prefix reuse, chunked prefill, page growth, preemption.

`Scheduler` holds the sequences of `inference.Engine` (queue, decode slots, page table, prefix cache) and
decides what runs, as vLLM's v1 engine splits it: `schedule(grow) -> StepPlan` admits what fits (prefilling
it through the engine), reserves the pages the step writes and gives the rows to run; the engine runs its
device step and hands the tokens back with `update(plan, Emitted) -> finished sequences`. The engine is the
scheduler's `device`: it runs the prefill calls and page copies (`_run_prefill`, `_apply_copies`) and owns
the page arrays (`_page_arrays`, `_set_page_arrays`, `offload_prefix`).

A sequence is its context (tokens whose K/V are in its pages) plus one pending token. A new request's context
is its prompt without the last token: the longest page-aligned prefix of it already in the prefix cache is
adopted (no compute), the rest is prefilled in chunks of at most `prefill_chunk` tokens (bucketed lengths),
once per distinct context; the n samples of a prompt fork that sequence (copy-on-write pages).

`EngineConfig.scheduler`: "continuous" admits queued sequences into free decode slots before every step (as
soon as one finishes); "static" admits only into an empty batch (the baseline). When the pool runs out of
pages mid-decode the most recently admitted sequence is preempted: its pages are freed and it re-enters the
queue with its generated tokens, to be re-prefilled (mostly from the prefix cache).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import numpy as np

from configs.engine import EngineConfig
from inference import kv_pages, steps
from inference.completion import Completion
from inference.sampling import SamplingParams, sampling_arrays

_NO_RELOAD = kv_pages.HostReload([], None)


def pow2(n: int) -> int:
    """The bucket of n: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass
class Seq:
    """One sample of a request: its prompt, the tokens emitted so far with their log-probs and policy
    versions, and its admission order (the youngest is preempted first)."""

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
    finish_reason: str = ""

    @property
    def pending(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt[-1]

    @property
    def context(self) -> list[int]:
        return (self.prompt + self.tokens)[:-1]


@dataclasses.dataclass
class StepPlan:
    """What one engine step runs: the (decode slot, sequence) rows, each with the pages it writes reserved,
    and their per-slot arrays (`steps.Rows`: pending tokens, page tables, starts, sampling, keys)."""

    active: list[tuple[int, Seq]]
    rows: steps.Rows


class Emitted(NamedTuple):
    """A device step's tokens for `Scheduler.update`, rows by decode slot: tokens_BW with their processed
    and raw log-probs; `count_B` the tokens of each row that count (None: all W). `truncate`: the row's
    pages past its start + count go back, "always" (a speculative step's rejected positions, before the
    tokens are emitted), "unfinished" (the unused reservations of a row that goes on) or None."""

    tokens_BW: Any
    logp_BW: Any
    raw_BW: Any
    count_B: Any = None
    truncate: str | None = None


class Scheduler:
    """`Scheduler(engine_cfg, vocab, device, stats)`: see the module docstring. `stats` is the engine's
    counter, which it adds to (prefill tokens and calls, preemptions, generated tokens, completions)."""

    def __init__(self, engine_cfg: EngineConfig, vocab: int, device, stats: collections.Counter):
        e = self.ecfg = engine_cfg
        self.vocab, self.device, self._stats = vocab, device, stats
        self.pool = kv_pages.PagePool(e.pool_pages, e.page_size)
        self.table = kv_pages.SequenceTable(self.pool, e.pages_per_seq)
        self.prefix = kv_pages.PrefixCache(self.pool, e.page_size, e.prefix_pages, e.host_cache_pages)
        self.slots: list[Seq | None] = [None] * e.max_batch
        self.queue: collections.deque[Seq] = collections.deque()
        self._holders: dict[int, int] = {}  # request id -> sequence holding its context for queued samples
        self._next_seq = self._next_request = self._admissions = 0
        # GroupDrafter: request id -> its samples' index, kept until the request's last sample finishes.
        self.groups: dict[int, Any] = {}

    # --- requests --------------------------------------------------------------------------------------

    def check(self, i: int, prompt: list[int], p: SamplingParams) -> None:
        """Raises a ValueError naming what is wrong with `prompts[i]` under `p`."""
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
        if self.ecfg.decode_steps > 1 and len(p.stop_tokens) > self.ecfg.max_stop_tokens:
            raise ValueError(
                f"prompts[{i}]: {len(p.stop_tokens)} stop_tokens, more than engine.max_stop_tokens="
                f"{self.ecfg.max_stop_tokens} (the device checks that many with engine.decode_steps > 1); "
                "raise max_stop_tokens."
            )

    def add(self, prompts, params, group: Callable | None = None) -> list[int]:
        """Queues p.n samples of each prompt; returns one request id per prompt. `group(prompt, n)`: the
        GroupDrafter's index of a request's samples."""
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = self._next_request
            self._next_request += 1
            ids.append(rid)
            for s in range(p.n):
                self.queue.append(Seq(self._next_seq, rid, i, s, p, prompt))
                self._next_seq += 1
            if group is not None:
                self.groups[rid] = group(prompt, p.n)
        return ids

    def has_work(self) -> bool:
        return bool(self.queue) or any(s is not None for s in self.slots)

    def in_flight(self) -> list[Completion]:
        """Every unfinished sample as far as it got (`Engine.in_flight`)."""
        seqs = [s for s in self.slots if s is not None] + list(self.queue)
        return [
            Completion(
                s.prompt_index,
                list(s.tokens),
                list(s.logprobs),
                "",
                s.sample,
                list(s.raw),
                list(s.versions),
                s.request_id,
            )
            for s in seqs
        ]

    def cancel(self, request_id: int, samples: Collection[int] | None = None) -> int:
        """Drops the unfinished samples of a request and frees their pages (`Engine.cancel`)."""
        hit = lambda s: s.request_id == request_id and (samples is None or s.sample in samples)
        dropped = [s for s in self.queue if hit(s)]
        self.queue = collections.deque(s for s in self.queue if not hit(s))
        for b, s in enumerate(self.slots):
            if s is not None and hit(s):
                dropped.append(s)
                self.slots[b] = None
        for seq in dropped:
            if seq.id in self.table:  # (a queued or preempted sequence holds no pages)
                self.table.free(seq.id)
            group = self.groups.get(request_id)
            if group is not None and group.finish():
                del self.groups[request_id]
        if request_id in self._holders and not any(q.request_id == request_id for q in self.queue):
            self.table.free(self._holders.pop(request_id))
        self._stats["cancelled"] += len(dropped)
        return len(dropped)

    # --- one step --------------------------------------------------------------------------------------

    def schedule(self, grow) -> StepPlan | None:
        """Admits what fits, then reserves `grow` more positions for each running sequence (an int, or a
        function of the sequence), preempting the youngest when out of pages. None: nothing runs."""
        self._admit()
        active = [(b, s) for b, s in enumerate(self.slots) if s is not None]
        if not active:
            return None
        active = self._grow(active, grow)
        return StepPlan(active, self._rows(active))

    def budgets(self, plan: StepPlan, most: int):
        """For a call of several steps: (stop_BS padded with -1, budget_B), each row's budget the tokens it
        may still emit, at most `most`."""
        e = self.ecfg
        stop_BS = np.full((e.max_batch, e.max_stop_tokens), -1, np.int32)
        budget_B = np.zeros(e.max_batch, np.int32)
        for b, seq in plan.active:
            stop_BS[b, : len(seq.params.stop_tokens)] = seq.params.stop_tokens
            budget_B[b] = budget(seq, most)
        return stop_BS, budget_B

    def update(self, plan: StepPlan, out: Emitted, version: int) -> list[Seq]:
        """Emits each row's tokens (sampled under policy `version`) up to a stop token or max_new_tokens;
        returns the sequences that finished (out of their slots; `release` frees their pages)."""
        finished = []
        for b, seq in plan.active:
            c = out.tokens_BW.shape[1] if out.count_B is None else int(out.count_B[b])
            if out.truncate == "always":
                self.table.truncate(seq.id, int(plan.rows.start_B[b]) + c)
            if self._emit(seq, out.tokens_BW[b, :c], out.logp_BW[b, :c], out.raw_BW[b, :c], version):
                finished.append(seq)
            elif out.truncate == "unfinished":
                self.table.truncate(seq.id, int(plan.rows.start_B[b]) + c)
        return finished

    def release(self, seq: Seq) -> None:
        """Frees a finished sequence's pages; drops its request's group index after the last sample."""
        self.table.free(seq.id)
        self._stats["completions"] += 1
        group = self.groups.get(seq.request_id)
        if group is not None and group.finish():
            del self.groups[seq.request_id]

    def _emit(self, seq: Seq, tokens, logps, raws, version: int) -> bool:
        p, reason, before = seq.params, None, len(seq.tokens)
        for tok, lp, raw in zip(tokens, logps, raws):
            seq.tokens.append(int(tok))
            seq.logprobs.append(float(lp))
            seq.raw.append(float(raw))
            seq.versions.append(version)
            self._stats["generated_tokens"] += 1
            if int(tok) in p.stop_tokens:
                reason = "stop"
            elif len(seq.tokens) >= p.max_new_tokens:
                reason = "length"
            if reason:
                break
        group = self.groups.get(seq.request_id)
        if group is not None:
            group.append(seq.sample, seq.tokens[before:])
        if reason is None:
            return False
        seq.finish_reason = reason
        self.slots[self.slots.index(seq)] = None
        return True

    def _admit(self) -> None:
        e = self.ecfg
        free = [b for b, s in enumerate(self.slots) if s is None]
        if e.scheduler == "static" and len(free) < e.max_batch:
            return
        jobs = []
        while free and self.queue:
            leader = self.queue[0]
            group = [leader]
            for seq in list(self.queue)[1 : len(free)]:
                if seq.request_id != leader.request_id or seq.tokens or leader.tokens:
                    break
                group.append(seq)
            context = leader.context
            need = -(-len(context) // e.page_size) + len(group)
            if self.pool.num_free + self.prefix.reclaimable() < need and (jobs or self.num_active()):
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
                if jobs or self.num_active():
                    break
                raise RuntimeError(
                    f"engine.num_pages={e.pool_pages} cannot hold one sequence of {len(context)} tokens; "
                    "raise engine.num_pages."
                ) from None
            for seq in group[1:]:
                self.table.fork(leader.id, seq.id)
            for seq in group:
                self.queue.popleft()
                seq.admitted = self._admissions
                self._admissions += 1
                self.slots[free.pop(0)] = seq
            jobs.append((leader, start, context))
            queued = any(q.request_id == leader.request_id and not q.tokens for q in self.queue)
            if queued and leader.request_id not in self._holders:
                # Samples still waiting for a slot: keep the context pages until the last one is admitted.
                self._holders[leader.request_id] = holder = self._next_seq
                self._next_seq += 1
                self.table.fork(leader.id, holder)
        for rid in [r for r in self._holders if not any(q.request_id == r for q in self.queue)]:
            self.table.free(self._holders.pop(rid))
        if jobs:
            self._prefill(jobs)

    def num_active(self) -> int:
        return sum(s is not None for s in self.slots)

    def _start(self, seq: Seq, context: list[int]) -> int:
        """New sequence over the cached prefix of `context`; reserves pages for the rest. Returns the
        number of context tokens already cached."""
        hit = self.prefix.lookup(context) if self.ecfg.prefix_pages else kv_pages.PrefixHit([], 0, _NO_RELOAD)
        if hit.reload.pages:
            self.device._set_page_arrays(hit.reload.apply(self.device._page_arrays()))
        self.table.new(seq.id, hit.pages, hit.num_tokens)
        try:
            self.table.append_tokens(seq.id, len(context) - hit.num_tokens)
        except kv_pages.OutOfPages:
            self.table.free(seq.id)
            raise
        return hit.num_tokens

    def _prefill(self, jobs: list[tuple[Seq, int, list[int]]]) -> None:
        e = self.ecfg
        work = [[seq, start, context] for seq, start, context in jobs if start < len(context)]
        self._stats["prefill_tokens"] += sum(len(c) - s for _, s, c in work)
        while work:
            work.sort(key=lambda w: len(w[2]) - w[1], reverse=True)
            batch = work[: e.prefill_batch]
            t = min(e.prefill_chunk, max(e.min_bucket, pow2(max(len(c) - s for _, s, c in batch))))
            b = max(e.min_prefill_batch, pow2(len(batch)))
            tokens, table = np.zeros((b, t), np.int32), np.zeros((b, e.pages_per_seq), np.int32)
            next_tokens = np.zeros((b, t), np.int32)  # the token after each (the MTP drafter reads it)
            start_B, num_B = np.zeros(b, np.int32), np.zeros(b, np.int32)
            for r, (seq, start, context) in enumerate(batch):
                n = min(t, len(context) - start)
                tokens[r, :n] = context[start : start + n]
                next_tokens[r, :n] = (context + [seq.pending])[start + 1 : start + n + 1]
                table[r] = self.table.page_table([seq.id])[0]
                start_B[r], num_B[r] = start, n
            self.device._run_prefill(tokens, next_tokens, table, start_B, num_B)
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
            self.device.offload_prefix(min(pow2(want), pow2(self.ecfg.pages_per_seq)))

    def _grow(self, active: list[tuple[int, Seq]], n) -> list[tuple[int, Seq]]:
        """Reserves n more slots for each active sequence (`n` an int, or a function of the sequence),
        preempting the youngest when out of pages, and applies the copy-on-write copies. Returns the rows
        still active."""
        copies, grown = {}, []
        for b, seq in sorted(active, key=lambda a: a[1].admitted):
            while seq in self.slots:  # (a sequence preempted for an older one is skipped)
                try:
                    grow = n if isinstance(n, int) else n(seq)
                    copies[seq.id] = self.table.append_tokens(seq.id, grow).copies
                    grown.append((b, seq))
                    break
                except kv_pages.OutOfPages:
                    victim = max((s for s in self.slots if s is not None), key=lambda s: s.admitted)
                    self._preempt(victim)
                    grown = [(bb, s) for bb, s in grown if s is not victim]
                    if victim is seq:
                        break
        # A preempted sequence's copies are dropped: its pages may already belong to someone else.
        self.device._apply_copies([c for _, seq in grown for c in copies[seq.id]])
        return sorted(grown)

    def _preempt(self, seq: Seq) -> None:
        self.table.free(seq.id)
        self.slots[self.slots.index(seq)] = None
        self.queue.appendleft(seq)
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
                seq.params.key_seed,
                seq.prompt_index if seq.params.key_index is None else seq.params.key_index,
                seq.sample,
                len(seq.tokens),
            )
            params[b] = seq.params
        return steps.Rows(tokens, table, start, act, sampling_arrays(params), (seed, req, sample, stepi))


def budget(seq: Seq, most: int) -> int:
    """The tokens `seq` may still emit in a call of at most `most`."""
    return min(most, seq.params.max_new_tokens - len(seq.tokens))
