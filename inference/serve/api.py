"""The OpenAI request and response formats of `inference.serve`: parsing, limits, errors, bodies.

Nothing here imports FastAPI or JAX: `parse` turns a request body (bytes) into an `APIRequest` or raises
`APIError` with an OpenAI-style body (`{"error": {"message", "type", "param", "code"}}`) naming the field,
and the `*_body` functions build the JSON a client reads. Every client mistake is an `APIError` with a 4xx
status: malformed JSON or UTF-8, wrong types, unknown fields, out-of-range values, empty prompts, a request
longer than the context.

Fields: those of OpenAI's completions and chat completions that the engine serves (`model`, `prompt` /
`messages`, `max_tokens` / `max_completion_tokens`, `n`, `temperature`, `top_p`, `seed`, `stop`, `stream`,
`stream_options.include_usage`, `logprobs`, `top_logprobs`), a few common extensions (`top_k`, `min_p`,
`ignore_eos`, `logprobs_mode`), and OpenAI fields the engine does not implement, accepted only at their
neutral value (`frequency_penalty: 0`, `echo: false`, ...) and refused otherwise. Any other field is refused.

Log-probs: the engine returns each sampled token's log-prob, under the model's softmax (`logprobs_mode:
"raw"`, the default, as OpenAI reports) or under the distribution it was sampled from after temperature /
top-k / top-p (`"processed"`). It never computes the other tokens' log-probs, so `top_logprobs > 0` (and
the completions endpoint's `logprobs > 0`, which asks for that many alternatives) is refused with a 400
naming the field rather than answered with made-up alternatives.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from inference.sampling import SamplingParams
from inference.serve.text import Token
from model.io.tokenizer import ChatTemplateError, Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI fields the engine does not implement: accepted at the value that changes nothing, else refused.
NEUTRAL = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
FREE = ("user", "metadata", "store", "service_tier")  # accepted with any value: they change no output
COMMON = (
    "model",
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "ignore_eos",
    "logprobs_mode",
)
FIELDS = {
    "completion": frozenset(COMMON + ("prompt",) + FREE) | frozenset(NEUTRAL),
    "chat": frozenset(COMMON + ("messages", "max_completion_tokens", "top_logprobs") + FREE)
    | frozenset(NEUTRAL),
}


class APIError(Exception):
    """A request the server will not serve: HTTP status and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, *, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server accepts: context (the engine's max_seq_len), vocabulary, n, prompts, stops, body."""

    max_seq_len: int
    vocab_size: int
    max_n: int = 16
    max_prompts: int = 16
    max_stops: int = 16
    max_stop_chars: int = 256
    max_body_bytes: int = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class APIRequest:
    """A parsed, checked request (before tokenization)."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: tuple[str | tuple[int, ...], ...] = ()  # completion: text or token ids, one per prompt
    messages: tuple[dict[str, str], ...] = ()  # chat: {"role", "content"} with string contents
    max_tokens: int | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    raw_logprobs: bool = True
    ignore_eos: bool = False


# --- parsing -----------------------------------------------------------------------------------------------


def parse(kind: str, body: bytes, limits: Limits) -> APIRequest:
    """The request in `body` (JSON bytes) for endpoint `kind` ("completion" or "chat"), or `APIError`."""
    obj = _json(body)
    unknown = sorted(set(obj) - FIELDS[kind])
    if unknown:
        raise invalid(unknown[0], "unrecognized request argument.", code="unknown_parameter")
    for name, allowed in NEUTRAL.items():
        if name in obj and not any(obj[name] == a and type(obj[name]) is type(a) for a in allowed):
            if name == "best_of" and obj[name] == obj.get("n", 1) and _is_int(obj[name]):
                continue
            values = ", ".join(json.dumps(a) for a in allowed)
            raise invalid(name, f"{_short(obj[name])} is not supported; the server accepts only {values}.")
    get = lambda name, default=None: default if obj.get(name) is None else obj[name]
    model = get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "a model name (string) is required; GET /v1/models lists them.")
    n = _int(get("n", 1), "n", 1, limits.max_n)
    max_tokens = get("max_completion_tokens", get("max_tokens"))
    which = "max_completion_tokens" if obj.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None:
        max_tokens = _int(max_tokens, which, 1, None)
    elif kind == "completion":
        max_tokens = 16  # OpenAI's default for completions; chat defaults to the rest of the context
    fields = dict(
        kind=kind,
        model=model,
        max_tokens=max_tokens,
        n=n,
        temperature=_float(get("temperature", 1.0), "temperature", 0.0, 2.0),
        top_p=_float(get("top_p", 1.0), "top_p", 0.0, 1.0, open_low=True),
        top_k=max(_int(get("top_k", 0), "top_k", -1, None), 0),  # -1 and 0: off
        min_p=_float(get("min_p", 0.0), "min_p", 0.0, 1.0),
        seed=None if obj.get("seed") is None else _int(obj["seed"], "seed", -(2**63), 2**64 - 1),
        stop=_stops(get("stop", ()), limits),
        stream=_bool(get("stream", False), "stream"),
        ignore_eos=_bool(get("ignore_eos", False), "ignore_eos"),
    )
    options = get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise invalid("stream_options", 'must be an object like {"include_usage": true}.')
    fields["include_usage"] = _bool(options.get("include_usage") or False, "stream_options.include_usage")
    mode = get("logprobs_mode", "raw")
    if mode not in ("raw", "processed"):
        raise invalid("logprobs_mode", f'{mode!r} is not one of "raw", "processed".')
    fields["raw_logprobs"] = mode == "raw"
    if kind == "completion":
        fields["prompts"] = _prompts(obj.get("prompt"), limits)
        top = get("logprobs")
        if top is not None:
            top = _int(top, "logprobs", 0, 5)
            if top > 0:
                raise invalid(
                    "logprobs",
                    f"{top} alternatives per token are not served (the engine returns the sampled token's "
                    "log-prob only); use logprobs=0.",
                    code="unsupported_value",
                )
            fields["logprobs"] = True
    else:
        fields["messages"] = _messages(obj.get("messages"))
        fields["logprobs"] = _bool(get("logprobs", False), "logprobs")
        top = _int(get("top_logprobs", 0), "top_logprobs", 0, 20)
        if top > 0:
            raise invalid(
                "top_logprobs",
                f"{top} alternatives per token are not served (the engine returns the sampled token's "
                "log-prob only); use top_logprobs=0 or leave it out.",
                code="unsupported_value",
            )
    return APIRequest(**fields)


def _json(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start}).") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(obj).__name__}.")
    return obj


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any, name: str, lo: int | None, hi: int | None) -> int:
    if not _is_int(v):
        raise invalid(name, f"expected an integer, got {type(v).__name__} {_short(v)}.")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(name, f"{v} must be {bounds}.")
    return v


def _float(v: Any, name: str, lo: float, hi: float, *, open_low: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(name, f"expected a number, got {type(v).__name__} {_short(v)}.")
    if not (lo < v if open_low else lo <= v) or v > hi:
        raise invalid(name, f"{v} must be in {'(' if open_low else '['}{lo}, {hi}].")
    return float(v)


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise invalid(name, f"expected true or false, got {type(v).__name__} {_short(v)}.")
    return v


def _text(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise invalid(name, f"expected a string, got {type(v).__name__} {_short(v)}.")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(name, "the string is not valid Unicode (a lone surrogate escape).") from None
    return v


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _stops(v: Any, limits: Limits) -> tuple[str, ...]:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, (list, tuple)):
        raise invalid("stop", f"expected a string or a list of strings, got {type(v).__name__}.")
    if len(stops) > limits.max_stops:
        raise invalid("stop", f"{len(stops)} stop strings; at most {limits.max_stops}.")
    out = []
    for s in stops:
        s = _text(s, "stop")
        if not s or len(s) > limits.max_stop_chars:
            raise invalid("stop", f"each stop string needs 1 to {limits.max_stop_chars} characters.")
        out.append(s)
    return tuple(out)


def _prompts(v: Any, limits: Limits) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of strings, a list of token ids or a list of lists of token ids."""
    if isinstance(v, str) or (isinstance(v, list) and v and all(_is_int(t) for t in v)):
        prompts = [v]
    elif isinstance(v, list) and v:
        prompts = v
    else:
        raise invalid("prompt", "expected a non-empty string, list of strings or list of token ids.")
    if len(prompts) > limits.max_prompts:
        raise invalid("prompt", f"{len(prompts)} prompts in one request; at most {limits.max_prompts}.")
    out: list[str | tuple[int, ...]] = []
    for p in prompts:
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            bad = [t for t in p if not 0 <= t < limits.vocab_size]
            if bad:
                raise invalid(
                    "prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})."
                )
            out.append(tuple(p))
        elif isinstance(p, str):
            out.append(_text(p, "prompt"))
        else:
            raise invalid(
                "prompt", f"each prompt must be a string or a non-empty list of token ids, got {_short(p)}."
            )
    return tuple(out)


def _messages(v: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(v, list) or not v:
        raise invalid("messages", "expected a non-empty list of {role, content} objects.")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"expected an object, got {type(m).__name__}.")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"{_short(role)} is not one of {', '.join(ROLES)}.")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise invalid(f"{where}.{unknown[0]}", "is not supported (text messages only).")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: text only
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise invalid(
                        f"{where}.content[{j}]", 'only {"type": "text", "text": ...} parts are served.'
                    )
                parts.append(_text(part.get("text"), f"{where}.content[{j}].text"))
            content = "".join(parts)
        out.append({"role": role, "content": _text(content, f"{where}.content")})
        if m.get("name") is not None:
            _text(m["name"], f"{where}.name")
    return tuple(out)


# --- tokens and sampling -----------------------------------------------------------------------------------


def encode(req: APIRequest, tokenizer: Tokenizer, limits: Limits) -> list[list[int]]:
    """The token ids of each prompt: text with the tokenizer's special tokens (a bos where it has one),
    token ids as given, chat messages through the tokenizer's chat template. Empty prompts are refused."""
    if req.kind == "chat":
        try:
            ids = tokenizer.encode_chat(list(req.messages), add_generation_prompt=True)
        except (ChatTemplateError, TypeError, ValueError) as e:
            raise invalid("messages", f"the chat template refused them: {e}") from None
        prompts = [ids]
    else:
        prompts = [
            list(p) if isinstance(p, tuple) else tokenizer.encode(p, add_special_tokens=True)
            for p in req.prompts
        ]
    for i, p in enumerate(prompts):
        if not p:
            raise invalid(
                "prompt", f"prompt {i} is empty (no tokens); give at least one character or token id."
            )
        if any(not 0 <= t < limits.vocab_size for t in p):
            raise invalid("prompt", f"prompt {i} has token ids outside the model's vocabulary.")
    return prompts


def max_new_tokens(req: APIRequest, prompts: Sequence[Sequence[int]], limits: Limits) -> int:
    """The request's max_tokens (chat default: the rest of the context), or a 400 naming the context."""
    longest = max(len(p) for p in prompts)
    room = limits.max_seq_len - longest
    context = f"This model's maximum context length is {limits.max_seq_len} tokens"
    if room < 1:
        raise APIError(
            400,
            f"{context}; the prompt has {longest} tokens, which leaves no room for a completion.",
            param="messages" if req.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    want = req.max_tokens if req.max_tokens is not None else room
    if want > room:
        raise APIError(
            400,
            f"{context}; the request needs {longest} prompt tokens + {want} max_tokens = {longest + want}. "
            "Shorten the prompt or lower max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return want


def sampling_params(req: APIRequest, max_tokens: int, stop_ids: Sequence[int], seed: int) -> SamplingParams:
    """The engine's parameters for `req`: the tokenizer's stop ids unless ignore_eos; `seed` is the request's
    own, or one the server drew when it gave none."""
    return SamplingParams(
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        min_p=req.min_p,
        max_new_tokens=max_tokens,
        n=req.n,
        seed=seed,
        stop_tokens=() if req.ignore_eos else tuple(stop_ids),
    )


# --- response bodies ---------------------------------------------------------------------------------------


def _logprob(x: float) -> float:
    return max(float(x), -9999.0)  # JSON has no -inf (OpenAI clamps the same way)


def logprobs_body(kind: str, tokens: Sequence[Token]) -> dict[str, Any]:
    if kind == "completion":
        return {
            "tokens": [t.text for t in tokens],
            "token_logprobs": [_logprob(t.logprob) for t in tokens],
            "top_logprobs": None,
            "text_offset": [t.offset for t in tokens],
        }
    content = [
        {"token": t.text, "logprob": _logprob(t.logprob), "bytes": t.bytes, "top_logprobs": []}
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def choice_body(
    req: APIRequest, index: int, text: str, tokens: Sequence[Token], finish: str | None, *, delta: bool
) -> dict[str, Any]:
    """One choice of a response (`delta`: of a stream chunk)."""
    body: dict[str, Any] = {"index": index}
    if req.kind == "completion":
        body["text"] = text
    elif delta:
        body["delta"] = {"content": text} if text else {}
    else:
        body["message"] = {"role": "assistant", "content": text, "refusal": None}
    body["logprobs"] = logprobs_body(req.kind, tokens) if req.logprobs else None
    body["finish_reason"] = finish
    return body


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_body(
    req: APIRequest,
    rid: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None,
    *,
    chunk: bool,
) -> dict[str, Any]:
    obj = (
        "text_completion"
        if req.kind == "completion"
        else ("chat.completion.chunk" if chunk else "chat.completion")
    )
    body = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body
