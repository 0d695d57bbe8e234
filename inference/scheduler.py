"""Scheduling of the engine's sequences: admission, prefix reuse, chunked prefill, page growth, preemption.

`Scheduler` is the part of `inference.Engine` that decides which sequences run and keeps their pages: it
reads and writes the engine's page table, prefix cache, queue and decode slots, and calls its device steps
(`_run_prefill`, `_apply_copies`).

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

import dataclasses

import numpy as np

from inference import kv_pages, steps
from inference.sampling import SamplingParams, sampling_arrays

_NO_RELOAD = kv_pages.HostReload([], None)
# The engine's caches indexed by pool page (each a dict of page arrays, or None): the target's K/V (or MLA
# latent) with the routing record, a ModelDrafter's K/V, the MTP drafter's. A page's contents are its slice
# of every one of them, so the host tier and copy-on-write move them together.
PAGED_CACHES = ("kv", "draft_kv", "mtp_kv")


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


class Scheduler:
    """Admission, prefill and page growth of `inference.Engine` (a base class: see the module docstring)."""

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

    def _start(self, seq: Seq, context: list[int]) -> int:
        """New sequence over the cached prefix of `context`; reserves pages for the rest. Returns the
        number of context tokens already cached."""
        hit = self.prefix.lookup(context) if self.ecfg.prefix_pages else kv_pages.PrefixHit([], 0, _NO_RELOAD)
        if hit.reload.pages:
            self._set_page_arrays(hit.reload.apply(self._page_arrays()))
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
            self._run_prefill(tokens, next_tokens, table, start_B, num_B)
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
            self.offload_prefix(min(pow2(want), pow2(self.ecfg.pages_per_seq)))

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

    def _grow(self, active: list[tuple[int, Seq]], n) -> list[tuple[int, Seq]]:
        """Reserves n more slots for each active sequence (`n` an int, or a function of the sequence),
        preempting the youngest when out of pages, and applies the copy-on-write copies. Returns the rows
        still active."""
        copies, grown = {}, []
        for b, seq in sorted(active, key=lambda a: a[1].admitted):
            while seq in self._slots:  # (a sequence preempted for an older one is skipped)
                try:
                    grow = n if isinstance(n, int) else n(seq)
                    copies[seq.id] = self.table.append_tokens(seq.id, grow).copies
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

    def _preempt(self, seq: Seq) -> None:
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
                seq.params.key_seed,
                seq.prompt_index if seq.params.key_index is None else seq.params.key_index,
                seq.sample,
                len(seq.tokens),
            )
            params[b] = seq.params
        return steps.Rows(tokens, table, start, act, sampling_arrays(params), (seed, req, sample, stepi))
