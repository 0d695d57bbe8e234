"""The server's metrics in the Prometheus text format (version 0.0.4), written by hand: a few counters,
gauges and two histograms per served model need no client library and no process-global registry (tests
run several servers in one process).

Per model (label `model`): queue depth (sequences accepted and not in a decode slot), running sequences,
generated tokens (total, and per second over the last `WINDOW_S` seconds), requests by outcome, time to
first token and time per output token histograms, the engine's prefix-cache counters and its draft tokens
proposed / accepted. Per server:
rejected requests by HTTP status.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

WINDOW_S = 10.0
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus reads them."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*map(_num, self.buckets), "+Inf"), self.counts):
            total += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {total}')
        out += [f"{name}_sum{{{labels}}} {_num(self.sum)}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class LoopMetrics:
    """What one engine loop records (from its thread) and the server renders (from another)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.requests: collections.Counter[str] = collections.Counter()  # outcome -> count
        self.generated = 0
        self._window: collections.deque[tuple[float, int]] = collections.deque()

    def tokens(self, n: int, now: float) -> None:
        with self.lock:
            self.generated += n
            self._window.append((now, n))
            while self._window and self._window[0][0] < now - WINDOW_S:
                self._window.popleft()

    def tokens_per_second(self, now: float) -> float:
        with self.lock:
            recent = [n for t, n in self._window if t >= now - WINDOW_S]
        return sum(recent) / WINDOW_S

    def observe(self, *, ttft: float | None = None, tpot: float | None = None, outcome: str | None = None):
        with self.lock:
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            if outcome is not None:
                self.requests[outcome] += 1


def render(models: Mapping[str, tuple[LoopMetrics, Mapping]], rejected: Mapping[int, int]) -> str:
    """The exposition text: `models` maps a model name to (its metrics, a snapshot of the engine loop's
    gauges: queue_depth, running, prefix_lookups, prefix_lookup_tokens, prefix_hit_tokens,
    prefix_host_offloads, prefix_host_reloads, draft_proposed_tokens, draft_accepted_tokens)."""
    now = time.monotonic()
    blocks: dict[str, tuple[str, str, list[str]]] = {}

    def add(name: str, kind: str, doc: str, lines: Iterable[str]) -> None:
        blocks.setdefault(name, (kind, doc, []))[2].extend(lines)

    for model, (m, gauges) in models.items():
        lab = f'model="{_escape(model)}"'
        add(
            "serve_queue_depth",
            "gauge",
            "sequences accepted and waiting for a decode slot",
            [f"serve_queue_depth{{{lab}}} {gauges.get('queue_depth', 0)}"],
        )
        add(
            "serve_running_sequences",
            "gauge",
            "sequences in decode slots",
            [f"serve_running_sequences{{{lab}}} {gauges.get('running', 0)}"],
        )
        with m.lock:
            generated, requests = m.generated, dict(m.requests)
            ttft, tpot = (
                m.ttft.lines("serve_time_to_first_token_seconds", lab),
                m.tpot.lines("serve_time_per_output_token_seconds", lab),
            )
        add(
            "serve_generated_tokens_total",
            "counter",
            "tokens generated",
            [f"serve_generated_tokens_total{{{lab}}} {generated}"],
        )
        add(
            "serve_tokens_per_second",
            "gauge",
            f"tokens generated per second over the last {WINDOW_S:g} s",
            [f"serve_tokens_per_second{{{lab}}} {_num(m.tokens_per_second(now))}"],
        )
        add(
            "serve_requests_total",
            "counter",
            "requests the engine loop finished, by outcome",
            [f'serve_requests_total{{{lab},outcome="{o}"}} {c}' for o, c in sorted(requests.items())],
        )
        add("serve_time_to_first_token_seconds", "histogram", "arrival to first generated token", ttft)
        add(
            "serve_time_per_output_token_seconds",
            "histogram",
            "per sample: (last - first token) / (n - 1)",
            tpot,
        )
        for key, doc in (
            ("prefix_lookups", "prefix-cache lookups"),
            ("prefix_hit_tokens", "prompt tokens whose K/V came from the prefix cache"),
            ("prefix_lookup_tokens", "prompt tokens looked up in the prefix cache"),
            ("prefix_host_offloads", "prefix-cache pages moved to the host tier (engine.host_cache_pages)"),
            ("prefix_host_reloads", "prefix-cache pages brought back from the host tier"),
            ("draft_proposed_tokens", "draft tokens proposed (fast variant)"),
            ("draft_accepted_tokens", "draft tokens the target accepted (fast variant)"),
        ):
            add(
                f"serve_{key}_total",
                "counter",
                doc,
                [f"serve_{key}_total{{{lab}}} {_num(gauges.get(key, 0))}"],
            )
    add(
        "serve_rejected_requests_total",
        "counter",
        "requests answered with an error status, by status",
        [f'serve_rejected_requests_total{{status="{s}"}} {c}' for s, c in sorted(rejected.items())],
    )
    out = []
    for name, (kind, doc, lines) in blocks.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
