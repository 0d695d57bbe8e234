"""`Server`: the served models (name -> engine loop) and `create_app`, its FastAPI app (`inference.serve`).

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the tokenizer's chat
template), both with server-sent-event streaming; `GET /health` (200 when ready, 503 while warming up);
`GET /metrics` (Prometheus text: `inference.serve.metrics`). Request fields and errors:
`inference.serve.api`.

The same weights are served as `<name>` and `<name>-fast`: the fast one is a second `inference.Engine` with
a speculative drafter (`inference.serve.load.make_drafter`), whose exact verification keeps each request's
output distribution (greedy outputs are the plain ones). With `route_fast_below=N`, requests for `<name>`
that give no `seed` go to the fast engine while it holds fewer than N sequences (speculation pays at small
batch); a request with a seed stays on the engine it named, because draws are reproducible per engine
configuration only.

Each engine is driven by one thread (`inference.serve.loop.EngineLoop`); handlers enqueue requests and await
their updates, and concurrent requests share the engine's continuous batching. A client that disconnects
cancels its request (its pages are freed at once); a full queue answers 429.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import secrets
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

from configs.engine import EngineConfig
from configs.errors import require
from inference.engine import Engine
from inference.serve import api as serve_api
from inference.serve import metrics as serve_metrics
from inference.serve.api import APIError, APIRequest, Limits
from inference.serve.load import Loaded, make_drafter
from inference.serve.loop import EngineLoop, Submission, Update
from model.io.tokenizer import Tokenizer

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
        (`inference.serve.load.parse_mesh`; None: the weights' device). The fast engine takes the plain
        one's weights as they are (no step donates them): one copy on the devices."""
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
