"""One engine, one thread, many clients: the engine loop behind `inference.serve`.

`EngineLoop` owns an `inference.Engine` and is the only thread that calls it. HTTP handlers hand it a
`Submission` (`submit`, thread-safe) and read `Update`s from the callback they gave (after every step while
streaming, else once per finished choice); the loop submits the
request to the engine, runs `Engine.step` while there is work (continuous batching: new requests join the
running batch at the next step), and after every step turns each sample's new tokens into text
(`inference.serve.text.TextStream`: stop strings, held-back prefixes) and sends what may be shown. A stop
string ends its sample at once (`Engine.cancel` of that sample frees its pages); `cancel` (a client that
went away) drops the whole request the same way.

The loop is bounded: `submit` refuses a request with 429 when its sequences (prompts x n) would take the
sequences accepted and unfinished past `capacity` (the decode slots plus `max_queue`), and with 503 until
the engine is warmed up (every step shape compiled, so no request waits on a compile). An exception in a
step fails the requests in flight with a 500 and drops them from the engine; the loop goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from inference.sampling import SamplingParams
from inference.serve.api import APIError
from inference.serve.metrics import LoopMetrics
from inference.serve.text import TextStream, Token
from model.io.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class ChoiceUpdate(NamedTuple):
    """New text of one choice (index = prompt * n + sample), its tokens, and its finish reason once done."""

    index: int
    text: str
    tokens: list[Token]
    finish_reason: str | None


class Update(NamedTuple):
    """What the loop sends a handler after a step: new text, and at the end usage or an error."""

    choices: list[ChoiceUpdate]
    done: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: APIError | None = None


@dataclasses.dataclass(eq=False)
class Submission:
    """One HTTP request for the loop: prompts (token ids), sampling, stop strings, which log-probs, and the
    thread-safe callback that receives its `Update`s."""

    prompts: list[list[int]]
    sampling: SamplingParams
    stops: tuple[str, ...]
    deliver: Callable[[Update], None]
    raw_logprobs: bool = True
    incremental: bool = True  # send text as it comes (streaming); else each choice once it is done
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # Loop-owned state.
    request_ids: list[int] = dataclasses.field(default_factory=list)
    streams: list[TextStream] = dataclasses.field(default_factory=list)
    reasons: list[str | None] = dataclasses.field(default_factory=list)
    seen: list[int] = dataclasses.field(default_factory=list)  # engine tokens consumed, per choice
    first_token: list[float | None] = dataclasses.field(default_factory=list)
    released: bool = False

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.sampling.n


class EngineLoop:
    """See the module docstring. `name` labels metrics; `warmup` compiles every step shape first."""

    def __init__(self, engine, tokenizer: Tokenizer, *, name: str, max_queue: int = 64, warmup: bool = True):
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.capacity = engine.ecfg.max_batch + max_queue
        self.metrics = LoopMetrics()
        self.error: str | None = None  # why the loop could not start (warmup failed)
        self.ready = threading.Event()
        self._warmup = warmup
        self._lock = threading.Lock()
        self._outstanding = 0  # sequences accepted and not finished
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: list[Submission] = []
        self._gauges: dict = {}
        self._thread: threading.Thread | None = None

    # --- any thread ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._inbox.put(("stop", None))
            self._thread.join(timeout)

    def submit(self, sub: Submission) -> None:
        """Queues `sub`, or raises `APIError` 503 (warming up) / 429 (full)."""
        if not self.ready.is_set():
            why = f"failed to start: {self.error}" if self.error else "warming up (compiling); retry shortly"
            raise APIError(
                503, f"model engine {self.name!r} is {why}.", type="server_error", code="unavailable"
            )
        with self._lock:
            if self._outstanding + sub.num_sequences > self.capacity:
                raise APIError(
                    429,
                    f"engine {self.name!r} is full: {self._outstanding} sequences in flight, capacity "
                    f"{self.capacity} (decode slots + queue); retry later.",
                    type="rate_limit_error",
                    code="queue_full",
                )
            self._outstanding += sub.num_sequences
        self._inbox.put(("submit", sub))

    def cancel(self, sub: Submission) -> None:
        """Drops `sub` (its client went away); a no-op once it finished."""
        self._inbox.put(("cancel", sub))

    @property
    def outstanding(self) -> int:
        """Sequences accepted and not finished."""
        return self._outstanding

    def gauges(self) -> dict:
        """The latest snapshot of queue depth, running sequences and prefix-cache counters."""
        return dict(self._gauges, queue_depth=max(self._outstanding - self._gauges.get("running", 0), 0))

    # --- the loop thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._warmup:
                self.engine.warmup()
        except Exception as e:  # the server stays up and says why in /health
            log.exception("engine %s: warmup failed", self.name)
            self.error = f"{type(e).__name__}: {e}"
            return
        self._snapshot()
        self.ready.set()
        while True:
            try:
                block = not self.engine.has_work()
                for kind, sub in self._drain(block):
                    if kind == "stop":
                        self._shut_down()
                        return
                    if kind == "submit":
                        self._start(sub)
                    else:
                        self._cancel(sub)
                if not self.engine.has_work():
                    continue
                done = self.engine.step()
                self._dispatch(done)
                self._snapshot()
            except Exception as e:
                log.exception("engine %s: step failed; failing the requests in flight", self.name)
                self._fail_all(APIError(500, f"engine error: {type(e).__name__}: {e}", type="server_error"))

    def _drain(self, block: bool) -> list[tuple[str, Submission | None]]:
        items = []
        try:
            items.append(self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait())
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def _start(self, sub: Submission) -> None:
        try:
            sub.request_ids = self.engine.submit(sub.prompts, sub.sampling)
        except ValueError as e:  # the handler checked the limits; this is the engine's word on the rest
            self._finish(sub, "rejected", error=APIError(400, str(e)))
            return
        k = sub.num_sequences
        hidden = sub.sampling.stop_tokens
        sub.streams = [TextStream(self.tokenizer, sub.stops, hidden) for _ in range(k)]
        sub.reasons, sub.seen, sub.first_token = [None] * k, [0] * k, [None] * k
        self._active.append(sub)

    def _cancel(self, sub: Submission) -> None:
        if sub in self._active:
            for rid in sub.request_ids:
                self.engine.cancel(rid)
            self._finish(sub, "cancelled")

    def _fail_all(self, error: APIError) -> None:
        for sub in list(self._active):
            for rid in sub.request_ids:
                try:
                    self.engine.cancel(rid)
                except Exception:
                    log.exception("engine %s: cancel after a failed step", self.name)
            self._finish(sub, "error", error=error)

    def _shut_down(self) -> None:
        """Fails the requests in flight and those still in the inbox with a 503."""
        error = APIError(503, "the server is shutting down.", type="server_error", code="unavailable")
        self._fail_all(error)
        for kind, sub in self._drain(False):
            if kind == "submit":
                self._finish(sub, "error", error=error)

    def _dispatch(self, done) -> None:
        """Feeds every active request's new tokens to its text streams and sends what changed."""
        now = time.perf_counter()
        finished = {(c.request_id, c.sample_index): c for c in done}
        progress = {(c.request_id, c.sample_index): c for c in self.engine.in_flight()}
        new_tokens = 0
        for sub in list(self._active):
            n, changed = sub.sampling.n, []
            for i, rid in enumerate(sub.request_ids):
                for s in range(n):
                    idx, stream = i * n + s, sub.streams[i * n + s]
                    if stream.done:
                        continue
                    c = finished.get((rid, s)) or progress.get((rid, s))
                    if c is None or (len(c.tokens) == sub.seen[idx] and c.finish_reason == ""):
                        continue
                    logprobs = c.raw_logprobs if sub.raw_logprobs else c.logprobs
                    new = range(sub.seen[idx], len(c.tokens))
                    new_tokens += len(new)
                    if new and sub.first_token[idx] is None:
                        sub.first_token[idx] = now
                    for j in new:
                        stream.add(c.tokens[j], logprobs[j])
                    sub.seen[idx] = len(c.tokens)
                    if c.finish_reason:
                        stream.finish()
                        sub.reasons[idx] = "stop" if stream.stopped else c.finish_reason
                    elif stream.stopped:  # a stop string: this sample is done, free its slot now
                        self.engine.cancel(rid, [s])
                        sub.reasons[idx] = "stop"
                    if stream.done:
                        self._observe_tpot(sub, idx, stream, now)
                    if not (sub.incremental or stream.done):
                        continue
                    text, tokens = stream.take()
                    if text or tokens or stream.done:
                        changed.append(ChoiceUpdate(idx, text, tokens, sub.reasons[idx]))
            if changed and all(stream.done for stream in sub.streams):
                self._finish(sub, "ok", changed)
            elif changed:
                sub.deliver(Update(changed))
        if new_tokens:
            self.metrics.tokens(new_tokens, time.monotonic())

    def _observe_tpot(self, sub: Submission, idx: int, stream: TextStream, now: float) -> None:
        first = sub.first_token[idx]
        if first is not None and stream.num_generated > 1:
            self.metrics.observe(tpot=(now - first) / (stream.num_generated - 1))

    def _finish(self, sub: Submission, outcome: str, changed=(), *, error: APIError | None = None) -> None:
        if sub in self._active:
            self._active.remove(sub)
        if sub.released:
            return
        sub.released = True
        with self._lock:
            self._outstanding -= sub.num_sequences
        firsts = [t for t in sub.first_token if t is not None]
        self.metrics.observe(ttft=min(firsts) - sub.arrival if firsts else None, outcome=outcome)
        if outcome == "cancelled":
            return
        update = Update(
            list(changed),
            done=True,
            prompt_tokens=sum(len(p) for p in sub.prompts),
            completion_tokens=sum(s.num_generated for s in sub.streams),
            error=error,
        )
        sub.deliver(update)

    def _snapshot(self) -> None:
        s = self.engine.stats()
        prefix = s.get("prefix_cache", {})
        self._gauges = {
            "running": s.get("running", 0),
            "prefix_lookups": prefix.get("lookups", 0),
            "prefix_lookup_tokens": prefix.get("lookup_tokens", 0),
            "prefix_hit_tokens": prefix.get("hit_tokens", 0),
            "prefix_host_offloads": prefix.get("offloads", 0),
            "prefix_host_reloads": prefix.get("reloads", 0),
            "draft_proposed_tokens": s.get("proposed_tokens", 0),
            "draft_accepted_tokens": s.get("accepted_tokens", 0),
        }
