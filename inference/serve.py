"""python -m inference.serve --workdir=runs/<run> [--step=N] | --hf_dir=DIR | --config=configs/tiny.py
[--mesh=expert:2,tensor:2]

An OpenAI-compatible HTTP server for any checkpoint: a training run's (`--workdir`, its latest checkpoint or
`--step`, restored as `rl.evaluate` restores it), a Hugging Face directory (`--hf_dir`, `model.hf.load_model`)
or a config with random weights (`--config`, for tests and benchmarks), on `--host` / `--port`.

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the tokenizer's chat
template), both with server-sent-event streaming; `GET /health` (200 when ready, 503 while warming up);
`GET /metrics` (Prometheus text: `inference.serve_metrics`). Request fields and errors:
`inference.serve_api`.

The same weights are served as `<name>` and `<name>-fast`: the fast one is a second `inference.Engine` with
a speculative drafter (`--draft`: the model's MTP head where it has one, else the n-gram drafter), whose
exact verification keeps each request's output distribution (greedy outputs are the plain ones). With
`--route_fast_below=N`, requests for `<name>` that give no `seed` go to the fast engine while it holds
fewer than N sequences (speculation pays at small batch); a request with a seed stays on the engine it
named, because draws are reproducible per engine configuration only.

Each engine is driven by one thread (`inference.serve_loop.EngineLoop`); handlers enqueue requests and await
their updates, and concurrent requests share the engine's continuous batching. A client that disconnects
cancels its request (its pages are freed at once); a full queue answers 429.

`--mesh=expert:2,tensor:2` (axes of `model.sharding.MESH_AXES`, data the rest) runs both engines sharded
over this process's devices in the inference layout (`inference.layout`), sharing one copy of the weights;
with `--hf_dir` every parameter is read straight into that layout, a model larger than one device included.

Loading: `inference.serve_load` (`--workdir` needs `rl`, for the run's config and checkpoint format, and
imports it only then).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import jax

try:  # the serve extra: without it main() (and create_app) say so in one line
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError:
    FastAPI = Request = JSONResponse = PlainTextResponse = StreamingResponse = HTTPException = None

from configs.errors import require
from inference import serve_api, serve_metrics
from inference.engine import Engine
from inference.engine_config import EngineConfig
from inference.serve_api import APIError, APIRequest, Limits
from inference.serve_load import DRAFTS, Loaded, load_hf, load_random, load_run, make_drafter, parse_mesh
from inference.serve_loop import EngineLoop, Submission, Update
from model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
FAST_SUFFIX = "-fast"
DISCONNECT_POLL_S = 0.1  # how often a non-streaming handler checks that its client is still there


# --- the server -----------------------------------------------------------------------------------------


class Server:
    """The served models (name -> engine loop), the tokenizer and the limits; `app()` is its ASGI app."""

    def __init__(
        self,
        loops: Mapping[str, EngineLoop],
        tokenizer: Tokenizer,
        limits: Limits,
        *,
        fast_of: Mapping[str, str] | None = None,
        route_fast_below: int = 0,
    ):
        self.loops, self.tokenizer, self.limits = dict(loops), tokenizer, limits
        self.fast_of = dict(fast_of or {})  # plain name -> fast name
        self.route_fast_below = route_fast_below
        self.rejected: collections.Counter[int] = collections.Counter()
        self.created = int(time.time())

    @classmethod
    def build(
        cls,
        loaded: Loaded,
        engine_cfg: EngineConfig,
        *,
        draft: str = "auto",
        max_queue: int = 64,
        max_n: int = 16,
        route_fast_below: int = 0,
        warmup: bool = True,
        max_body_bytes: int = 4 * 2**20,
        mesh: jax.sharding.Mesh | None = None,
    ) -> Server:
        """A plain engine and, unless `draft="none"`, a fast one over the same weights, both on `mesh`
        (`serve_load.parse_mesh`; None: the weights' device). The fast engine takes the plain one's weights
        as they are (no step donates them): one copy on the devices."""
        name, tok = loaded.name, loaded.tokenizer
        plain = Engine(loaded.cfg, loaded.weights, engine_cfg, mesh=mesh, placed=loaded.placed)
        loops = {name: EngineLoop(plain, tok, name=name, max_queue=max_queue, warmup=warmup)}
        fast_of = {}
        drafter = make_drafter(loaded.cfg, draft)
        if drafter is not None:
            fast = name + FAST_SUFFIX
            engine = Engine(loaded.cfg, plain.params, engine_cfg, draft=drafter, mesh=mesh, placed=True)
            loops[fast] = EngineLoop(engine, tok, name=fast, max_queue=max_queue, warmup=warmup)
            fast_of[name] = fast
        limits = Limits(
            engine_cfg.max_seq_len, loaded.cfg.model.vocab_size, max_n=max_n, max_body_bytes=max_body_bytes
        )
        return cls(loops, tok, limits, fast_of=fast_of, route_fast_below=route_fast_below)

    def start(self) -> None:
        for loop in self.loops.values():
            loop.start()

    def stop(self) -> None:
        for loop in self.loops.values():
            loop.stop()

    def app(self):
        return create_app(self)

    # --- requests ------------------------------------------------------------------------------------------

    def pick(self, req: APIRequest) -> EngineLoop:
        """The engine loop for `req.model`, or a 404; plain requests may be routed to the fast engine."""
        loop = self.loops.get(req.model)
        if loop is None:
            raise APIError(
                404,
                f"The model {req.model!r} does not exist; served: {', '.join(self.loops)}.",
                param="model",
                code="model_not_found",
            )
        fast = self.loops.get(self.fast_of.get(req.model, ""))
        seqs = req.n * max(len(req.prompts), 1)
        light = fast is not None and fast.ready.is_set() and fast.outstanding + seqs < self.route_fast_below
        return fast if light and req.seed is None else loop

    async def handle(self, request: Request, kind: str):
        try:
            body = await _read_body(request, self.limits.max_body_bytes)
            req = serve_api.parse(kind, body, self.limits)
            loop = self.pick(req)
            prompts = serve_api.encode(req, self.tokenizer, self.limits)
            max_tokens = serve_api.max_new_tokens(req, prompts, self.limits)
            seed = req.seed if req.seed is not None else secrets.randbits(31)
            sampling = serve_api.sampling_params(req, max_tokens, self.tokenizer.stop_ids, seed)
            events: asyncio.Queue[Update] = asyncio.Queue()
            sub = Submission(
                prompts,
                sampling,
                req.stop,
                _deliver(events),
                raw_logprobs=req.raw_logprobs,
                incremental=req.stream,
            )
            loop.submit(sub)
        except APIError as e:
            return self.error(e)
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        headers = {"x-engine": loop.name}
        if req.stream:
            chunks = self._stream(loop, sub, events, req, rid)
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        result = await self._collect(request, loop, sub, events, req, rid)
        if isinstance(result, APIError):
            return self.error(result)
        return JSONResponse(result, headers=headers)

    def error(self, e: APIError) -> JSONResponse:
        self.rejected[e.status] += 1
        return JSONResponse(e.body(), status_code=e.status)

    async def _collect(self, request, loop, sub, events, req, rid):
        k = sub.num_sequences
        texts, tokens, reasons = [""] * k, [[] for _ in range(k)], [None] * k
        done, checked = False, time.monotonic()
        try:
            while True:
                try:
                    update = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    update = None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return APIError(499, "the client closed the request.")
                if update is None:
                    continue
                if update.error is not None:
                    done = True
                    return update.error
                for c in update.choices:
                    texts[c.index] += c.text
                    tokens[c.index] += c.tokens
                    reasons[c.index] = c.finish_reason
                if update.done:
                    done = True
                    break
        finally:
            if not done:
                loop.cancel(sub)
        choices = [
            serve_api.choice_body(req, i, texts[i], tokens[i], reasons[i], delta=False) for i in range(k)
        ]
        usage = serve_api.usage_body(update.prompt_tokens, update.completion_tokens)
        return serve_api.response_body(req, rid, int(time.time()), choices, usage, chunk=False)

    async def _stream(self, loop, sub, events, req, rid) -> AsyncIterator[str]:
        created, done = int(time.time()), False
        usage = {"usage": None} if req.include_usage else {}

        def chunk(choices, **extra):
            body = serve_api.response_body(req, rid, created, choices, None, chunk=True)
            return _sse({**body, **usage, **extra})

        try:
            if req.kind == "chat":
                for i in range(sub.num_sequences):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    yield chunk([{**first, "finish_reason": None}])
            while not done:
                update = await events.get()
                if update.error is not None:
                    done = True
                    yield _sse(update.error.body())
                    break
                for c in update.choices:
                    yield chunk(
                        [serve_api.choice_body(req, c.index, c.text, c.tokens, c.finish_reason, delta=True)]
                    )
                if update.done:
                    done = True
                    if req.include_usage:
                        total = serve_api.usage_body(update.prompt_tokens, update.completion_tokens)
                        yield chunk([], usage=total)
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (the response task was cancelled) or the server stops
                loop.cancel(sub)

    # --- other endpoints -----------------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "moe-post-train",
                "max_model_len": self.limits.max_seq_len,
            }
            for name in self.loops
        ]
        return {"object": "list", "data": data}

    def health(self) -> tuple[int, dict[str, Any]]:
        states = {
            name: "ok" if loop.ready.is_set() else ("error: " + loop.error if loop.error else "warming_up")
            for name, loop in self.loops.items()
        }
        ok = all(s == "ok" for s in states.values())
        status = (
            "ok" if ok else ("error" if any(s.startswith("error") for s in states.values()) else "warming_up")
        )
        return (200 if ok else 503), {"status": status, "models": states}

    def metrics_text(self) -> str:
        models = {name: (loop.metrics, loop.gauges()) for name, loop in self.loops.items()}
        return serve_metrics.render(models, self.rejected)


def _deliver(events: asyncio.Queue):
    """A thread-safe callback that puts an update on `events` in the calling event loop."""
    aloop = asyncio.get_running_loop()

    def deliver(update: Update) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed: nobody waits any more
            aloop.call_soon_threadsafe(events.put_nowait, update)

    return deliver


async def _read_body(request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes.", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def create_app(server: Server) -> FastAPI:
    """The FastAPI app over `server` (which the caller starts and stops)."""
    require("fastapi", "inference.serve")
    app = FastAPI(title="moe-post-train inference.serve", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return server.error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return server.error(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await server.handle(request, "chat")

    @app.get("/health")
    async def health():
        status, body = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4")

    return app


# --- CLI ------------------------------------------------------------------------------------------------


def main() -> None:
    from absl import flags
    from ml_collections import config_flags

    from configs import cli
    from configs.errors import UserError

    given = cli.config_given(sys.argv)
    cli.take_block_overrides(sys.argv, every=not given)  # --config.rl.<block>.<key>=... (configs/cli.py)
    if not given and cli.taken():  # --workdir / --hf_dir: the model is the run's or the checkpoint's
        cli.exit_with(
            f"--config.{cli.taken()[0][0]}: config overrides need --config (a run or a checkpoint is served "
            "as saved)"
        )
    if any(arg.lstrip("-").startswith("workdir") for arg in sys.argv[1:]):
        # Restoring a run imports rl.train, whose module defines --config and --workdir: import it first and
        # let ours replace them (as rl.evaluate's CLI does).
        from rl import train  # noqa: F401
    config = config_flags.DEFINE_config_file(
        "config", None, "Model config (random weights), e.g. configs/tiny.py.", allow_override=True
    )
    workdir = flags.DEFINE_string(
        "workdir", None, "A training run directory (config.json, checkpoints/).", allow_override=True
    )
    step = flags.DEFINE_integer("step", None, "With --workdir: the checkpoint step (default: the latest).")
    hf_dir = flags.DEFINE_string("hf_dir", None, "A Hugging Face checkpoint directory.")
    mesh_flag = flags.DEFINE_string(
        "mesh",
        None,
        "Run the engines sharded on a mesh of this process's devices, e.g. expert:2,tensor:2 (data: the "
        "rest); default: one device.",
    )
    tokenizer = flags.DEFINE_string(
        "tokenizer", None, "Tokenizer directory or 'byte' (default: the model's)."
    )
    host = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
    port = flags.DEFINE_integer("port", 8000, "Port to bind.")
    name = flags.DEFINE_string(
        "served_model_name", None, "Model name (default: the run/directory/config name)."
    )
    draft = flags.DEFINE_enum(
        "draft", "auto", DRAFTS, "The -fast variant's drafter (auto: mtp if the model has it)."
    )
    num_draft = flags.DEFINE_integer("num_draft", 4, "Tokens proposed per speculative step.")
    route = flags.DEFINE_integer(
        "route_fast_below", 0, "Route unseeded plain requests to -fast below N sequences."
    )
    max_batch = flags.DEFINE_integer("max_batch", 16, "Decode slots per engine.")
    max_seq_len = flags.DEFINE_integer("max_seq_len", 1024, "Prompt + completion tokens of one sequence.")
    page_size = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
    prefill_chunk = flags.DEFINE_integer("prefill_chunk", 256, "Longest prefill call (a power of two).")
    prefill_batch = flags.DEFINE_integer("prefill_batch", 4, "Rows per prefill call (a power of two).")
    num_pages = flags.DEFINE_integer(
        "num_pages", 0, "KV pages per engine (0: enough for max_batch full sequences and the prefix cache)."
    )
    prefix_cache_pages = flags.DEFINE_integer(
        "prefix_cache_pages", -1, "Device pages the prefix cache may keep (-1: the engine's default; 0: off)."
    )
    host_cache_pages = flags.DEFINE_integer(
        "host_cache_pages",
        0,
        "Host-memory pages for cold prefix blocks, e.g. long shared system prompts (0: off).",
    )
    max_queue = flags.DEFINE_integer(
        "max_queue", 64, "Sequences that may wait beyond the decode slots (429 past)."
    )
    max_n = flags.DEFINE_integer("max_n", 16, "Largest n per request.")
    seed = flags.DEFINE_integer("seed", 0, "With --config: the random weights' seed.")
    warmup = flags.DEFINE_bool("warmup", True, "Compile every step shape before serving (503 until then).")

    def _main(argv) -> None:
        require("fastapi", "python -m inference.serve")
        uvicorn = require("uvicorn", "python -m inference.serve")
        if len(argv) > 1:
            raise UserError(f"unexpected arguments {list(argv[1:])}; flags look like --port=8000")
        given = [
            f
            for f, v in (("--workdir", workdir.value), ("--hf_dir", hf_dir.value), ("--config", config.value))
            if v
        ]
        if len(given) != 1:
            raise UserError(f"give exactly one of --workdir, --hf_dir, --config (got {given or 'none'})")
        mesh = parse_mesh(mesh_flag.value)  # before minutes of loading and compiling, as the port
        cli.check_port(host.value, port.value)
        cli.quiet_console(workdir.value or None)
        if hf_dir.value and not os.path.isfile(os.path.join(hf_dir.value, "config.json")):
            raise UserError(
                f"--hf_dir={hf_dir.value} holds no config.json: give a Hugging Face checkpoint dir"
            )
        ecfg = EngineConfig(
            max_batch=max_batch.value,
            max_seq_len=max_seq_len.value,
            page_size=page_size.value,
            prefill_chunk=prefill_chunk.value,
            prefill_batch=prefill_batch.value,
            num_draft=num_draft.value,
            num_pages=num_pages.value,
            prefix_cache_pages=prefix_cache_pages.value,
            host_cache_pages=host_cache_pages.value,
        )
        if workdir.value:
            loaded = load_run(workdir.value, step.value, tokenizer=tokenizer.value)
        elif hf_dir.value:
            loaded = load_hf(hf_dir.value, tokenizer=tokenizer.value, mesh=mesh, engine_cfg=ecfg)
        else:
            path = config_flags.get_config_filename(flags.FLAGS["config"])
            loaded = load_random(
                cli.with_block_overrides(config.value),
                name=_config_name(path),
                seed=seed.value,
                tokenizer=tokenizer.value,
            )
        if name.value:
            loaded.name = name.value
        server = Server.build(
            loaded,
            ecfg,
            draft=draft.value,
            max_queue=max_queue.value,
            max_n=max_n.value,
            route_fast_below=route.value,
            warmup=warmup.value,
            mesh=mesh,
        )
        loaded.weights = None  # the engines hold theirs (a copy unless they were placed)
        server.start()
        print(f"serving {', '.join(server.loops)} on http://{host.value}:{port.value}/v1", file=sys.stderr)
        try:
            uvicorn.run(server.app(), host=host.value, port=port.value, log_level="info")
        finally:
            server.stop()

    cli.run(_main)


def _config_name(spec: str) -> str:
    """configs/tiny.py -> tiny, configs/tiny.py:dense -> tiny-dense."""
    path, _, arg = spec.partition(":")
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{stem}-{arg.replace(',', '-')}" if arg else stem


if __name__ == "__main__":
    main()
