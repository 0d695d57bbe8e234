"""Warming an engine up: one call of every shape its steps can use, so that serving or sampling never
compiles (`Engine.warmup`, `stats()["compiles_after_warmup"]`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inference import kv_pages, routing, steps, weight_sync
from inference.sampling import SamplingParams, sampling_arrays
from inference.scheduler import pow2


def run_every_shape(engine, score_lengths: Sequence[int] = ()) -> None:
    """Runs `engine`'s prefill at every length and batch bucket, its page copies, its decode or speculative
    step, its routing reads and host-tier moves at every page-count bucket, scoring at `score_lengths`, and
    places its weights as its steps take them. The caller holds the engine's lock."""
    e = engine.ecfg
    zeros = lambda *shape: np.zeros(shape, np.int32)
    t, longest = e.min_bucket, engine.longest_prefill_bucket()
    while t <= longest:
        b = e.min_prefill_batch
        while b <= e.prefill_batch:
            engine._run_prefill(zeros(b, t), zeros(b, t), zeros(b, e.pages_per_seq), zeros(b), zeros(b))
            b *= 2
        t *= 2
    engine._apply_copies([])
    rows = e.max_batch
    arrays = sampling_arrays([SamplingParams()] * rows)
    keys = tuple(zeros(rows) for _ in range(4))
    table = zeros(rows, e.pages_per_seq)
    dummy = steps.Rows(zeros(rows), table, zeros(rows), zeros(rows), arrays, keys)
    stop_BS = np.full((rows, e.max_stop_tokens), -1, np.int32)
    if engine._spec_many is not None:
        engine.kv, engine.draft_kv, *_ = engine._spec_many(
            engine.params, engine.draft_params, engine.kv, engine.draft_kv, dummy, stop_BS, zeros(rows)
        )
    elif engine._decode_many is not None:
        engine.kv, *_ = engine._decode_many(engine.params, engine.kv, dummy, stop_BS, zeros(rows))
    elif engine.draft is None:
        engine.kv, *_ = engine._decode(engine.params, engine.kv, dummy)
    else:
        engine._run_spec(dummy, zeros(rows, e.num_draft), zeros(rows))
    if "experts" in engine.kv:
        n = 1
        while n <= pow2(e.max_batch * e.pages_per_seq):
            routing.gather(engine.kv["experts"], [kv_pages.NULL_PAGE] * n)
            n *= 2
    if e.host_cache_pages:  # the host tier's gather and scatter, at every page-count bucket
        n = 1
        while n <= pow2(e.pages_per_seq):
            pages = [kv_pages.NULL_PAGE] * n
            host = kv_pages.gather_pages(engine._page_arrays(), pages)
            engine._set_page_arrays(kv_pages.scatter_pages(engine._page_arrays(), pages, host))
            n *= 2
    for length in score_lengths:
        b = 1
        while b <= e.score_batch:
            engine.score([[0]] * b, [[0] * max(length - 1, 1)] * b)
            b *= 2
    engine.params, _ = weight_sync.to_layout(engine.params, engine._weight_shardings)
    if engine.draft_params is not None:
        engine.draft_params, _ = weight_sync.to_layout(engine.draft_params, engine._draft_shardings)
