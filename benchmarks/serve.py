"""python -m benchmarks serve [--configs=tiny,small] [--quick]

Serving figures of `python -m inference.serve`: the server runs as a subprocess on 127.0.0.1 over a config's
random weights (`--config=configs/<name>.py`, the byte tokenizer), and this process drives it with the
official client (`openai.AsyncOpenAI`, streaming, usage in the last chunk): requests arrive as a Poisson
process at each offered rate (requests/s), each a short English prompt with a fixed number of output tokens
(`ignore_eos`, greedy), for the plain model and for `<model>-fast` (the n-gram drafter). Client and server
share the machine's cores, as they would on one host.

One JSON line per (config, variant, rate): requests, offered and achieved request rate, output tokens/s over
the run (first send to last token), time to first token (send to the first streamed text) and time per
output token ((last - first token) / (tokens - 1)) p50 / p99 in ms as the client sees them, end-to-end p50 /
p99, 429s and other errors; from the server's /metrics around the point: draft acceptance and TTFT / TPOT
p50 / p99 (`server_*`, Prometheus' histogram_quantile over the buckets, so as coarse as they are; they are
measured in the engine thread, free of the client's own lag, which at high load reads chunks in bursts and
so understates TPOT and overstates TTFT). Plain and fast alternate at each rate. Then one `serve_knee`
line per (config, variant): the knee of the latency curve, the first offered rate whose client TTFT p50
exceeds `KNEE_FACTOR` x that of the lowest rate (the server then queues faster than it serves), and the
highest rate below it. Every line starts with the record header (`benchmarks.record`: command, load
average, ...).

Random weights: the n-gram drafter's acceptance depends on how repetitive the text is, and an untrained
model's greedy text is neither a trained model's nor the drafter's best case.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from benchmarks import hosts
from benchmarks.record import emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNEE_FACTOR = 2.0
PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Write a short poem about the sea.",
    "Explain why the sky is blue in two sentences.",
    "List three prime numbers greater than one hundred.",
    "Translate 'good morning' into French, German and Spanish.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Summarise the plot of a detective story in one line.",
    "def fibonacci(n):",
)
# Per config: engine flags, output tokens per request, offered rates (req/s), seconds of arrivals per rate.
SETUPS = {
    "tiny": dict(
        flags=["--max_batch=16", "--max_seq_len=256", "--prefill_chunk=64", "--prefill_batch=2"],
        max_tokens=64,
        rates=(2, 8, 16, 24, 32, 48),
        seconds=4.0,
    ),
    "small": dict(
        flags=["--max_batch=8", "--max_seq_len=256", "--prefill_chunk=64", "--prefill_batch=2"],
        max_tokens=32,
        rates=(0.5, 1, 2, 4),
        seconds=6.0,
    ),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def start_server(name: str, flags: list[str], port: int, log_path: str, timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "inference.serve", f"--config=configs/{name}.py", f"--port={port}", *flags]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
            return proc
        time.sleep(1.0)
    proc.terminate()
    raise TimeoutError(f"server not ready after {timeout} s; see {log_path}")


def server_counts(port: int, model: str) -> dict:
    """The server's counters for `model` from /metrics: draft tokens and the TTFT / TPOT histogram buckets."""
    _, text = _get(f"http://127.0.0.1:{port}/metrics")
    lab = re.escape(f'model="{model}"')
    out = {}
    for key in ("proposed", "accepted"):
        m = re.search(rf"serve_draft_{key}_tokens_total\{{{lab}\}} ([0-9.e+]+)", text)
        out[key] = float(m.group(1)) if m else 0.0
    for key, name in (("ttft", "time_to_first_token"), ("tpot", "time_per_output_token")):
        rows = re.findall(rf'serve_{name}_seconds_bucket\{{{lab},le="([^"]+)"\}} (\d+)', text)
        out[key] = [(float(le), int(n)) for le, n in rows]
    return out


def histogram_quantile(q: float, before: list, after: list) -> float | None:
    """Prometheus' histogram_quantile over the observations between two reads of cumulative buckets:
    linear within the bucket holding the q-th observation (the highest finite bound past the last)."""
    counts = [(le, a - b) for (le, a), (_, b) in zip(after, before)]
    total = counts[-1][1] if counts else 0
    if not total:
        return None
    rank, lower, prev = q * total, 0.0, 0
    for le, cum in counts:
        if cum >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - prev) / max(cum - prev, 1)
        lower, prev = le, cum
    return lower


async def one_request(client, model: str, prompt: str, max_tokens: int, start: float, t0: float) -> dict:
    import openai

    await asyncio.sleep(max(start - (time.perf_counter() - t0), 0.0))
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                first = first if first is not None else now
                last = now
    except openai.RateLimitError:
        return {"status": 429}
    except openai.APIError as e:
        return {"status": getattr(e, "status_code", None) or "error", "error": str(e)[:200]}
    if first is None:
        return {"status": "empty"}
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return {
        "status": 200,
        "sent": sent - t0,
        "ttft": first - sent,
        "tpot": tpot,
        "e2e": last - sent,
        "end": last - t0,
        "tokens": tokens,
    }


async def run_rate(port: int, model: str, rate: float, n: int, max_tokens: int, seed: int) -> dict:
    import openai

    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0 / rate, size=n))
    starts -= starts[0]
    prompts = [PROMPTS[i] for i in rng.integers(0, len(PROMPTS), size=n)]
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600
    )
    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(
            *(one_request(client, model, p, max_tokens, float(s), t0) for p, s in zip(prompts, starts))
        )
    finally:
        await client.close()
    ok = [r for r in results if r["status"] == 200]
    pct = lambda key, q: round(1e3 * float(np.percentile([r[key] for r in ok if r[key] is not None], q)), 2)
    span = max(r["end"] for r in ok) - min(r["sent"] for r in ok) if ok else float("nan")
    row = {
        "requests": n,
        "ok": len(ok),
        "rejected_429": sum(r["status"] == 429 for r in results),
        "errors": sum(r["status"] not in (200, 429) for r in results),
        "offered_rps": rate,
        "achieved_rps": round(len(ok) / span, 3) if ok else 0.0,
        "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / span, 1) if ok else 0.0,
    }
    if ok:
        for key in ("ttft", "tpot", "e2e"):
            row[f"{key}_p50_ms"], row[f"{key}_p99_ms"] = pct(key, 50), pct(key, 99)
    return row


def measure(port: int, model: str, rate: float, n: int, max_tokens: int, seed: int) -> dict:
    """One rate point: the client's figures, and the server's from its /metrics around it."""
    before = server_counts(port, model)
    row = asyncio.run(run_rate(port, model, rate, n, max_tokens, seed=seed))
    after = server_counts(port, model)
    proposed = after["proposed"] - before["proposed"]
    if proposed:
        row["draft_acceptance"] = round((after["accepted"] - before["accepted"]) / proposed, 3)
    for key in ("ttft", "tpot"):
        for q in (50, 99):
            x = histogram_quantile(q / 100, before[key], after[key])
            row[f"server_{key}_p{q}_ms"] = None if x is None else round(1e3 * x, 2)
    return row


def knee(rows: list[dict]) -> dict:
    base = rows[0].get("ttft_p50_ms")
    for prev, row in zip([None, *rows], rows):
        if base is None or row.get("ttft_p50_ms") is None or row["ttft_p50_ms"] > KNEE_FACTOR * base:
            return {
                "knee_rps": row["offered_rps"],
                "max_sustained_rps": prev["offered_rps"] if prev else None,
            }
    return {"knee_rps": None, "max_sustained_rps": rows[-1]["offered_rps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tiny,small", help="comma-separated: " + ", ".join(SETUPS))
    parser.add_argument("--quick", action="store_true", help="two rates per config, fewer requests")
    parser.add_argument("--ready_timeout", type=float, default=900.0, help="seconds to wait for warmup")
    parser.add_argument("--log_dir", default="/tmp", help="where the server logs go")
    args = parser.parse_args()
    for name in args.configs.split(","):
        setup = SETUPS[name]
        rates = setup["rates"][:: len(setup["rates"]) - 1] if args.quick else setup["rates"]
        seconds = setup["seconds"] / (2 if args.quick else 1)
        port = _free_port()
        t = time.perf_counter()
        proc = start_server(
            name, setup["flags"], port, os.path.join(args.log_dir, f"serve_{name}.log"), args.ready_timeout
        )
        warmup_s = time.perf_counter() - t
        try:
            models = (name, name + "-fast")
            for model in models:
                asyncio.run(run_rate(port, model, 1.0, 2, setup["max_tokens"], seed=0))  # first-request costs
            by_variant = {model: [] for model in models}
            # Rates outer, variants inner: plain and fast run close in time (the machine's load drifts).
            for i, rate in enumerate(rates):
                n = int(np.clip(round(rate * seconds), 8, 128))
                for model in models:
                    row = measure(port, model, rate, n, setup["max_tokens"], seed=i)
                    row = {
                        "bench": "serve",
                        "config": name,
                        "model": model,
                        "variant": "fast" if model != name else "plain",
                        "max_tokens": setup["max_tokens"],
                        "engine_flags": " ".join(setup["flags"]),
                        "server_ready_s": round(warmup_s, 1),
                        **row,
                    }
                    emit(row)
                    by_variant[model].append(row)
            for model, rows in by_variant.items():
                emit(
                    {
                        "bench": "serve_knee",
                        "config": name,
                        "model": model,
                        "knee_factor": KNEE_FACTOR,
                        **knee(rows),
                    }
                )
        finally:
            hosts.stop(proc, grace=30)


if __name__ == "__main__":
    main()
