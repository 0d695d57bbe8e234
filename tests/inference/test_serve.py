"""inference.serve: the OpenAI-compatible server, driven by the official `openai` client over 127.0.0.1.

One server (tiny config, random weights, the small engine sizes of tests/engines.py so the compiled
steps are shared) serves `tiny` and `tiny-fast` (n-gram drafter) for the whole module; a reference `Engine`
over the same weights gives the expected tokens and log-probs. Also here: `Engine.cancel` /
`Engine.in_flight` (the engine API the server needs). `inference.serve.text` is tested in test_serve_text.py,
loading a run directory or an HF directory in test_serve_load.py.
"""

import concurrent.futures
import http.client
import json
import re
import socket
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import serving  # noqa: E402
from engines import small_engine  # noqa: E402

import model  # noqa: E402
from configs import tiny  # noqa: E402
from inference import (  # noqa: E402
    Engine,
    GroupDrafter,
    MTPDrafter,
    NgramDrafter,
    SamplingParams,
)
from inference.serve import api as serve_api  # noqa: E402
from inference.serve import load as serve_load  # noqa: E402
from inference.serve import server as serve_server  # noqa: E402
from inference.serve.loop import EngineLoop  # noqa: E402
from model.io.tokenizer import ByteTokenizer  # noqa: E402

ECFG = small_engine()
MAX_QUEUE = 32  # capacity 36 sequences: the 32 concurrent clients fit, 37 do not
MAX_N = 8
MAX_BODY = 2**16
WAIT_S = 600  # bound on every wait for the server (the first run compiles every step shape)
ATOL = 1e-5  # served raw log-probs vs a teacher-forced forward (tests/inference/test_engine.py's bound)


class Live:
    """A server run by uvicorn in a thread on a free 127.0.0.1 port."""

    def __init__(self, server: serve_server.Server):
        self.server = server
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(server.app(), log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        assert serving.poll(lambda: self.uv.started, 30)

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def client(self, **kwargs) -> "openai.OpenAI":
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kwargs
        )

    def raw(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def weights():
    cfg = tiny.get_config()
    return cfg, model.build(cfg, seed=0)


@pytest.fixture(scope="module")
def live(weights):
    cfg, m = weights
    loaded = serve_load.Loaded(cfg, m, ByteTokenizer(cfg.model.vocab_size), "tiny")
    server = serve_server.Server.build(
        loaded, ECFG, draft="ngram", max_queue=MAX_QUEUE, max_n=MAX_N, max_body_bytes=MAX_BODY
    )
    server.start()
    live = Live(server)
    try:
        for loop in server.loops.values():
            assert loop.ready.wait(WAIT_S), f"{loop.name} did not warm up: {loop.error}"
        yield live
    finally:
        live.close()
        server.stop()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


@pytest.fixture(scope="module")
def reference(weights):
    cfg, m = weights
    return Engine(cfg, m, ECFG)


TOK = ByteTokenizer(256)
EOS = TOK.eos_id


def _greedy(reference, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = reference.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n, stop_tokens=(EOS,)))
    return [[t for t in o.tokens if t != EOS] for o in outs]


def _released(live: Live, name: str) -> Engine:
    """Waits until the engine loop has nothing in flight; its pages are then all free or prefix-cached."""
    loop = live.server.loops[name]
    assert serving.poll(lambda: loop.outstanding == 0 and not loop.engine.has_work(), 60)
    eng = loop.engine
    eng.table.check()
    assert eng.pool.num_free + len(list(eng.prefix.held_pages())) == eng.pool.num_pages - 1
    return eng


def _ids(logprobs) -> list[int]:
    """Token ids of a chat choice's log-prob entries (the byte tokenizer: one byte each)."""
    return [e.bytes[0] for e in logprobs.content]


# --- endpoints ---------------------------------------------------------------------------------------------


def test_models_health_and_metrics(live, client):
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-fast"]
    status, body = live.raw("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    client.completions.create(model="tiny", prompt="metrics", max_tokens=4, temperature=0)
    status, body = live.raw("GET", "/metrics")
    text = body.decode()
    assert status == 200
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$|^# (HELP|TYPE) ')
    assert all(sample.match(line) for line in text.splitlines()), text
    for name in (
        "serve_queue_depth",
        "serve_running_sequences",
        "serve_tokens_per_second",
        "serve_prefix_lookup_tokens_total",
        "serve_prefix_hit_tokens_total",
        "serve_prefix_host_offloads_total",
        "serve_prefix_host_reloads_total",
    ):
        assert f'{name}{{model="tiny"}}' in text
    ttft = re.search(r'serve_time_to_first_token_seconds_count\{model="tiny"\} (\d+)', text)
    tpot = re.search(r'serve_time_per_output_token_seconds_bucket\{model="tiny",le="\+Inf"\} (\d+)', text)
    assert int(ttft.group(1)) >= 1 and int(tpot.group(1)) >= 1


def test_completion_is_the_engines_greedy_output(live, client, reference):
    prompts = ["The quick brown fox", "a", "x" * 40]  # 40 > prefill_chunk: a chunked prefill
    want = _greedy(reference, [TOK.encode(p) for p in prompts], 12)
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, tokens in zip(r.choices, want):
        assert c.text == TOK.decode(tokens)
        assert c.finish_reason == ("length" if len(tokens) == 12 else "stop")
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert r.usage.completion_tokens == sum(min(len(t) + 1, 12) for t in want)  # an eos counts, unseen
    assert r.object == "text_completion" and r.model == "tiny"
    _released(live, "tiny")


def test_chat_applies_the_chat_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    prompt = TOK.encode_chat(messages, add_generation_prompt=True)
    (want,) = _greedy(reference, [prompt], 10)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == TOK.decode(want)
    assert r.usage.prompt_tokens == len(prompt)
    # Content parts are joined; the default max_tokens is the rest of the context.
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}
    ]
    r = client.chat.completions.create(
        model="tiny", messages=parts, temperature=0, extra_body={"ignore_eos": True}
    )
    prompt = TOK.encode_chat([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    assert r.usage.completion_tokens == ECFG.max_seq_len - len(prompt)


def test_streaming_matches_the_full_response(client):
    args = dict(model="tiny", prompt="stream me", max_tokens=24, temperature=0.8, seed=4, n=2)
    full = client.completions.create(**args)
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert usage == full.usage
    messages = [{"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, seed=5)
    chunks = list(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, seed=5, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_n_and_seed_reproducibility(client):
    args = dict(
        model="tiny", prompt="seeded", max_tokens=12, temperature=1.0, n=3, extra_body={"ignore_eos": True}
    )
    a = client.completions.create(**args, seed=11)
    b = client.completions.create(**args, seed=11)
    c = client.completions.create(**args, seed=12)
    texts = lambda r: [ch.text for ch in r.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts(a) == texts(b)
    assert texts(a) != texts(c)
    assert len(set(texts(a))) == 3  # the n samples draw with their own keys
    assert a.usage.completion_tokens == 36


def test_logprobs_are_the_engines(client, reference):
    prompt = "log-probs"
    ids = TOK.encode(prompt)
    (want,) = _greedy(reference, [ids], 10)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.tokens == [TOK.decode([t]) for t in want] and lp.text_offset[0] == 0
    (raw,) = reference.score([ids], [want])
    np.testing.assert_allclose(lp.token_logprobs, raw, atol=ATOL)  # the model's softmax, as OpenAI reports
    # Sampled, chat: raw and "processed" (the distribution the token was drawn from).
    messages = [{"role": "user", "content": "sample"}]
    sp = dict(temperature=0.7, top_p=0.9, seed=3, max_tokens=10)
    r = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, **sp)
    prompt_ids = TOK.encode_chat(messages, add_generation_prompt=True)
    tokens = _ids(r.choices[0].logprobs)
    assert TOK.decode(tokens) == r.choices[0].message.content
    (raw,) = reference.score([prompt_ids], [tokens])
    np.testing.assert_allclose([e.logprob for e in r.choices[0].logprobs.content], raw, atol=ATOL)
    r = client.chat.completions.create(
        model="tiny", messages=messages, logprobs=True, extra_body={"logprobs_mode": "processed"}, **sp
    )
    assert _ids(r.choices[0].logprobs) == tokens  # same seed, same draws
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10)
    (processed,) = reference.score([prompt_ids], [tokens], params)
    np.testing.assert_allclose([e.logprob for e in r.choices[0].logprobs.content], processed, atol=ATOL)
    # Alternatives are not computed by the engine: refused, naming the field.
    with pytest.raises(openai.BadRequestError, match="top_logprobs") as e:
        client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match="logprobs") as e:
        client.completions.create(model="tiny", prompt="x", logprobs=2)
    assert e.value.body["param"] == "logprobs"


def _stop_pair(text: str) -> tuple[str, int] | None:
    """A two-character stop string (two tokens) first occurring at index >= 2 of `text`."""
    for i in range(2, len(text) - 8):  # well before the end: the engine must not finish it anyway
        pair = text[i : i + 2]
        if "\ufffd" not in pair and text.find(pair) == i:
            return pair, i
    return None


def test_stop_string_spanning_two_tokens(live, client):
    args = dict(model="tiny", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    for prompt in ("stop here", "another prompt", "a third one", "fourth"):
        full = client.completions.create(prompt=prompt, **args).choices[0].text
        found = _stop_pair(full)
        if found:
            break
    assert found, "no two-character stop candidate in four greedy outputs"
    stop, at = found
    before = live.server.loops["tiny"].engine.stats().get("cancelled", 0)
    r = client.completions.create(prompt=prompt, stop=["never seen", stop], **args)
    assert r.choices[0].text == full[:at] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(prompt=prompt, stop=stop, stream=True, **args)
    chunks = [c.choices[0] for c in streamed]
    assert "".join(c.text for c in chunks) == full[:at] and chunks[-1].finish_reason == "stop"
    # The stopped samples left their slots at once (cancelled in the engine, not run to max_tokens).
    eng = _released(live, "tiny")
    assert eng.stats()["cancelled"] == before + 2


def test_32_concurrent_clients(live, reference):
    prompts = [f"client {i}: " + "abc"[: i % 4] for i in range(32)]
    want = _greedy(reference, [TOK.encode(p) for p in prompts], 8)

    def one(i: int) -> str:
        c = live.client()
        try:
            return (
                c.completions.create(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0)
                .choices[0]
                .text
            )
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32), timeout=WAIT_S))
    assert got == [TOK.decode(t) for t in want]
    _released(live, "tiny")


def test_disconnect_mid_stream_frees_the_slot(live, monkeypatch):
    loop = live.server.loops["tiny"]
    before, cancelled = loop.engine.stats().get("cancelled", 0), loop.metrics.requests["cancelled"]
    c = live.client()
    stream = c.completions.create(
        model="tiny", prompt="a long one", max_tokens=80, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    c.close()
    eng = _released(live, "tiny")
    assert eng.stats()["cancelled"] == before + 1  # dropped by the disconnect, not finished
    # Without streaming: the handler notices the closed connection while it waits (it looks every
    # serve_server.DISCONNECT_POLL_S = 0.1 s). On a quiet machine the tiny model decoded both waves
    # (2 x 90 steps) before the first look, so nothing was left to cancel: each engine step now waits 10 ms
    # first (>= 1.8 s for the request, well past the poll).
    step = loop.engine.step
    monkeypatch.setattr(loop.engine, "step", lambda *a, **k: (time.sleep(0.01), step(*a, **k))[1])
    long = {"model": "tiny", "prompt": "gone", "max_tokens": 90, "n": MAX_N, "ignore_eos": True}  # 2 waves
    body = json.dumps(long).encode()
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert serving.poll(lambda: loop.outstanding == MAX_N, 30)
    eng = _released(live, "tiny")
    monkeypatch.undo()
    assert eng.stats()["cancelled"] > before + 1
    assert loop.metrics.requests["cancelled"] == cancelled + 2


def test_queue_full_answers_429(live, client):
    loop = live.server.loops["tiny"]
    long = dict(model="tiny", prompt="q", max_tokens=90, stream=True, extra_body={"ignore_eos": True})
    streams = [client.completions.create(n=MAX_N, **long) for _ in range(4)]
    streams.append(client.completions.create(n=4, **long))
    try:
        assert loop.outstanding == loop.capacity == 36
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt="one more", max_tokens=2)
        assert e.value.body["code"] == "queue_full"
    finally:
        for s in streams:
            s.close()
    _released(live, "tiny")
    assert client.completions.create(model="tiny", prompt="after", max_tokens=2).choices[0].text is not None


BAD = [
    # (body, status, param or None, text the message contains)
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (b'\xff\xfe{"model": "tiny", "prompt": "a"}', 400, None, "UTF-8"),
    (b'{"model": "tiny", "prompt": "a", "temperature": NaN}', 400, None, "NaN"),
    (b"[" * 60_000, 400, None, "JSON"),  # nested past the parser's recursion limit
    (b'{"model": "tiny", "prompt": "\\ud800"}', 400, "prompt", "surrogate"),
    ({"model": "tiny", "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ({"model": "tiny", "prompt": "a", "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    (
        {"model": "tiny", "prompt": "a", "max_tokens": 10**30},
        400,
        "max_tokens",
        "maximum context length is 96",
    ),
    ({"model": "tiny", "prompt": "a" * 200}, 400, "prompt", "maximum context length is 96"),
    ({"model": "tiny", "prompt": "a", "bogus": 1}, 400, "bogus", "unrecognized"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt", "empty"),
    ({"model": "tiny", "prompt": []}, 400, "prompt", "non-empty"),
    ({"model": "tiny", "prompt": [[1, 2], "x", 3]}, 400, "prompt", "token ids"),
    ({"model": "tiny", "prompt": [300]}, 400, "prompt", "vocabulary"),
    ({"model": "tiny", "prompt": "a", "n": MAX_N + 1}, 400, "n", f"in [1, {MAX_N}]"),
    ({"model": "tiny", "prompt": "a", "n": 0}, 400, "n", "in [1"),
    ({"model": "tiny", "prompt": "a", "temperature": "hot"}, 400, "temperature", "number"),
    ({"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p", "(0.0, 1.0]"),
    ({"model": "tiny", "prompt": "a", "stop": [1]}, 400, "stop", "string"),
    ({"model": "tiny", "prompt": "a", "stop": [""]}, 400, "stop", "1 to"),
    ({"model": "tiny", "prompt": "a", "stream": "yes"}, 400, "stream", "true or false"),
    ({"model": "tiny", "prompt": "a", "frequency_penalty": 0.5}, 400, "frequency_penalty", "not supported"),
    ({"model": "tiny", "prompt": "a", "seed": 1.5}, 400, "seed", "integer"),
    ({"prompt": "a"}, 400, "model", "required"),
    ({"model": "nope", "prompt": "a"}, 404, "model", "does not exist"),
]
BAD_CHAT = [
    ({"model": "tiny", "messages": []}, 400, "messages", "non-empty"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages", "non-empty"),
    (
        {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        "not one of",
    ),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        None,
        "text",
    ),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        None,
        ">=",
    ),
]


@pytest.mark.parametrize("path,cases", [("/v1/completions", BAD), ("/v1/chat/completions", BAD_CHAT)])
def test_bad_inputs_get_4xx_json_errors(live, client, path, cases):
    for body, status, param, text in cases:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, reply = live.raw("POST", path, raw)
        assert got == status, (body, got, reply)
        error = json.loads(reply)["error"]
        assert text in error["message"] and error["type"], (body, error)
        if param is not None:
            assert error["param"] == param, (body, error)
    got, reply = live.raw("POST", path, b"x" * (live.server.limits.max_body_bytes + 1))
    assert got == 413 and "larger than" in json.loads(reply)["error"]["message"]
    got, reply = live.raw("GET", "/v1/nowhere")
    assert got == 404 and "error" in json.loads(reply)
    assert live.raw("GET", "/health")[0] == 200
    assert (
        client.completions.create(model="tiny", prompt="still here", max_tokens=3).usage.completion_tokens
        >= 1
    )


def test_warming_up_answers_503(weights):
    cfg, m = weights
    tok = ByteTokenizer(256)
    loop = EngineLoop(Engine(cfg, m, ECFG), tok, name="cold")  # never started: still warming up
    server = serve_server.Server({"cold": loop}, tok, serve_api.Limits(ECFG.max_seq_len, 256))
    cold = Live(server)
    try:
        status, body = cold.raw("GET", "/health")
        assert status == 503 and json.loads(body)["status"] == "warming_up"
        with pytest.raises(openai.InternalServerError) as e:
            cold.client().completions.create(model="cold", prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and "warming up" in e.value.body["message"]
    finally:
        cold.close()


def test_fast_variant_greedy_equals_plain(live, client):
    fast = live.server.loops["tiny-fast"].engine
    before = fast.stats().get("accepted_tokens", 0)
    messages = [{"role": "user", "content": "repeat after me: abc abc abc"}]
    for prompt in ("abcabcabc", "hello hello", "zz"):
        args = dict(prompt=prompt, max_tokens=40, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
        plain = client.completions.create(model="tiny", **args).choices[0]
        quick = client.completions.create(model="tiny-fast", **args).choices[0]
        assert quick.text == plain.text and quick.logprobs.tokens == plain.logprobs.tokens
        np.testing.assert_allclose(quick.logprobs.token_logprobs, plain.logprobs.token_logprobs, atol=ATOL)
    args = dict(messages=messages, max_tokens=30, temperature=0)
    plain = client.chat.completions.create(model="tiny", **args).choices[0].message.content
    assert client.chat.completions.create(model="tiny-fast", **args).choices[0].message.content == plain
    assert fast.stats()["accepted_tokens"] > before  # the drafts were used, not only proposed
    _released(live, "tiny-fast")


def test_light_load_routes_plain_requests_to_fast(live, client):
    server = live.server
    server.route_fast_below = 4
    try:
        r = client.completions.with_raw_response.create(model="tiny", prompt="route", max_tokens=3)
        assert r.headers["x-engine"] == "tiny-fast" and r.parse().model == "tiny"
        seeded = client.completions.with_raw_response.create(
            model="tiny", prompt="route", max_tokens=3, seed=1
        )
        assert seeded.headers["x-engine"] == "tiny"  # a seed's draws are reproducible per engine
    finally:
        server.route_fast_below = 0
    assert (
        client.completions.with_raw_response.create(model="tiny", prompt="r", max_tokens=3).headers[
            "x-engine"
        ]
        == "tiny"
    )


def test_fast_variant_drafter_choice():
    # the model's MTP head
    assert isinstance(serve_load.make_drafter(tiny.get_config("deepseek")), MTPDrafter)
    assert isinstance(serve_load.make_drafter(tiny.get_config()), NgramDrafter)
    assert serve_load.make_drafter(tiny.get_config(), "none") is None
    with pytest.raises(ValueError, match="--draft='model'"):
        serve_load.make_drafter(tiny.get_config(), "model")


# --- the engine API the server needs -----------------------------------------------------------------------


def test_engine_cancel_frees_queued_and_running_samples(weights):
    cfg, m = weights
    eng = Engine(cfg, m, ECFG)
    sp = SamplingParams(max_new_tokens=20, n=3, seed=1, stop_tokens=())
    ids = eng.submit([TOK.encode("one"), TOK.encode("two"), TOK.encode("three")], sp)
    eng.step()  # 4 slots: request 0's three samples and one of request 1's run; the rest wait
    running = {(c.request_id, c.sample_index) for c in eng.in_flight() if c.tokens}
    assert running == {(ids[0], 0), (ids[0], 1), (ids[0], 2), (ids[1], 0)}
    assert len(eng.in_flight()) == 9 and eng.stats()["running"] == 4 and eng.stats()["queued"] == 5
    assert eng.cancel(ids[1], [1]) == 1  # one queued sample; its sibling holds the context pages
    assert eng.cancel(ids[0]) == 3  # running
    assert eng.cancel(ids[2]) == 3  # queued, never admitted
    assert eng.cancel(ids[2]) == 0 and eng.cancel(12345) == 0
    done = []
    while eng.has_work():
        done += eng.step()
    assert sorted((c.request_id, c.sample_index) for c in done) == [(ids[1], 0), (ids[1], 2)]
    assert all(len(c.tokens) == 20 for c in done)
    eng.table.check()
    assert eng.pool.num_free + len(list(eng.prefix.held_pages())) == eng.pool.num_pages - 1
    assert eng.stats()["cancelled"] == 7


def test_engine_cancel_with_group_drafter(weights):
    cfg, m = weights
    eng = Engine(cfg, m, ECFG, draft=GroupDrafter(3))
    sp = SamplingParams(max_new_tokens=12, n=3, seed=2, stop_tokens=())
    (rid,) = eng.submit([TOK.encode("group")], sp)
    eng.step()
    assert eng.cancel(rid, [0, 2]) == 2
    done = []
    while eng.has_work():
        done += eng.step()
    assert [(c.sample_index, len(c.tokens)) for c in done] == [(1, 12)]
    assert not eng.scheduler.groups  # the request's index went with its last sample
    (rid,) = eng.submit([TOK.encode("group")], sp)
    eng.step()
    assert eng.cancel(rid) == 3 and not eng.scheduler.groups and not eng.has_work()
