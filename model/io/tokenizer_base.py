"""What every tokenizer shares: the `Tokenizer` interface, the byte-level `ByteTokenizer`, chat templates
rendered as Hugging Face renders them (`render_chat_template`), and `CheckpointTokenizer`, the special tokens,
stop ids and chat templates that a checkpoint directory's files name (`checkpoint_files` reads them).

`model.io.tokenizer` builds tokenizers (`load_tokenizer`) and holds `HFTokenizer`;
`model.io.tokenizer_tiktoken` holds `TiktokenTokenizer`. This module imports no JAX, torch or transformers,
and `jinja2` (the `hf` extra) only when a template is rendered, so JAX-free worker processes can use it.
"""

from __future__ import annotations

import abc
import datetime
import functools
import json
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from configs.errors import UserError

Message = Mapping[str, Any]


class TokenizerNotFound(UserError, FileNotFoundError):
    """A tokenizer path that holds no tokenizer; the message names the path and the fix."""


class ChatTemplateError(ValueError):
    """A chat template that is missing, does not compile, or refuses a conversation; names the template."""


class Tokenizer(abc.ABC):
    """Text <-> token ids, the special ids, the stop ids and a chat template.

    `encode` adds no special tokens unless asked (prompts come from a chat template, which writes its own),
    and `encode_chat` is `encode(apply_chat_template(...))`, like transformers' `tokenize=True`.
    """

    vocab_size: int  # every id produced is < vocab_size: the model's embedding needs at least this many rows
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    stop_ids: tuple[int, ...]  # eos first, then any other end-of-turn ids from the checkpoint
    special_tokens: dict[str, int]  # token string -> id, for every special token
    bos_token: str | None
    eos_token: str
    pad_token: str | None

    @abc.abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings inside `text` become their ids."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; byte sequences that are not valid UTF-8 decode to U+FFFD instead of raising."""

    @abc.abstractmethod
    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt for `messages`; `add_generation_prompt` ends it with the assistant's turn header."""

    def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of `apply_chat_template(...)`; the template already wrote any bos, so none is added."""
        prompt = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        return self.encode(prompt, add_special_tokens=False)


# --- Byte-level tokenizer ----------------------------------------------------------------------------------

BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 256, 257, 258 when the vocab has room
NUL = "\x00"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; `<|bos|>`, `<|eos|>`, `<|pad|>` at 256, 257, 258 when the vocab has room.

    A vocab with no room for them (256, as the tiny config) still needs an eos to stop generation: byte 0
    (NUL) is eos and pad there, and there is no bos. NUL is the byte least likely to be real text, and being a
    byte it still round-trips through `encode(decode(...))` like any other. Ids from 259 up to vocab_size that
    no token uses decode to U+FFFD.
    """

    def __init__(self, vocab_size: int = 256):
        if vocab_size < 256:
            raise ValueError(f"ByteTokenizer(vocab_size={vocab_size}): needs >= 256, one id per byte")
        self.vocab_size = vocab_size
        if vocab_size >= 256 + len(BYTE_SPECIALS):
            self.special_tokens = {token: 256 + i for i, token in enumerate(BYTE_SPECIALS)}
            self.bos_token, self.eos_token, self.pad_token = BYTE_SPECIALS
        else:
            self.special_tokens = {NUL: 0}
            self.bos_token, self.eos_token, self.pad_token = None, NUL, NUL
        self.bos_id = None if self.bos_token is None else self.special_tokens[self.bos_token]
        self.eos_id = self.special_tokens[self.eos_token]
        self.pad_id = self.special_tokens[self.pad_token]
        self.stop_ids = (self.eos_id,)
        self._id_to_token = {i: token for token, i in self.special_tokens.items()}
        self._split_specials = re.compile("(" + "|".join(map(re.escape, self.special_tokens)) + ")")

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes, special-token strings as their ids; `add_special_tokens` prepends bos if any."""
        ids = [] if self.bos_id is None or not add_special_tokens else [self.bos_id]
        for piece in self._split_specials.split(text):
            if piece in self.special_tokens:
                ids.append(self.special_tokens[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Bytes decoded with errors="replace"; special tokens as their strings unless skipped."""
        pieces: list[str] = []
        run = bytearray()  # bytes since the last non-byte token, decoded together so multi-byte chars survive
        for i in map(int, ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside ByteTokenizer(vocab_size={self.vocab_size})")
            if i in self._id_to_token and skip_special_tokens:
                continue
            if i < 256:
                run.append(i)
                continue
            pieces.append(run.decode("utf-8", errors="replace"))
            run.clear()
            pieces.append(self._id_to_token.get(i, "\ufffd"))
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Plain-text roles, each turn ended by eos and a newline:

            user: What is 2+2?<|eos|>
            assistant: 4<|eos|>
            assistant: <- the generation prompt

        `tools` become a first `tools:` turn holding their JSON, and an assistant's `tool_calls` are appended
        to its content as JSON. Other keyword arguments are accepted and unused, as a jinja template ignores
        variables it does not read, so the RL loop can pass the same ones to every tokenizer. A
        `chat_template` string renders with jinja2 instead (see `render_chat_template`).
        """
        if chat_template is not None:
            named = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
            return render_chat_template(
                chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                variables={**{k: v for k, v in named.items() if v is not None}, **kwargs},
                source="the chat_template argument",
            )
        turns = [("tools", json.dumps(list(tools), ensure_ascii=False))] if tools else []
        turns += [(message["role"], _plain_content(message)) for message in messages]
        text = "".join(f"{role}: {content}{self.eos_token}\n" for role, content in turns)
        return text + "assistant: " if add_generation_prompt else text


def _plain_content(message: Message) -> str:
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise TypeError(
            f"ByteTokenizer's chat template takes string contents, got {type(content).__name__} in "
            f"{message!r}; join content parts into one string first"
        )
    if message.get("tool_calls"):
        content += json.dumps(message["tool_calls"], ensure_ascii=False)
    return content


# --- Chat templates: jinja2 configured as Hugging Face's -------------------------------------------------


@functools.cache
def _environment() -> Any:
    """An immutable sandbox with HF's settings, filters and globals: a checkpoint's template is untrusted."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class GenerationTag(jinja2.ext.Extension):
        # HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks. Templates
        # that use it must parse; the body renders as is, in its own scope like HF's CallBlock.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt the model trained on.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(template: str, source: str) -> Any:
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{source}: the chat template does not compile (line {e.lineno}): {e}") from e


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain_message(message: Message) -> dict[str, Any]:
    """A copy without None values (templates test for a key, not for None); reasoning under all its names.

    transformers fills `reasoning_content` (Qwen3's templates read it) and `thinking` (gpt-oss's) from
    whichever of the three names the caller used.
    """
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages are dicts with 'role' and 'content', got {message!r}")
    plain = {key: value for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in REASONING_FIELDS if key in plain), None)
    return plain if reasoning is None else {"thinking": reasoning, **plain, "reasoning_content": reasoning}


def render_chat_template(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    variables: Mapping[str, Any],
    source: str,
) -> str:
    """Render a jinja2 chat template as `transformers`' `apply_chat_template(..., tokenize=False)` does.

    Messages are copied by `_plain_message`, and the template sees `messages`, `tools`, `documents` (None
    unless in `variables`), `add_generation_prompt` and `variables` (the special-token strings, then the
    caller's keyword arguments). `source` names the template in errors.
    """
    import jinja2

    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise TypeError(f"tools must be JSON-schema dicts, got {tools!r}; write each schema as a dict")
    plain = [_plain_message(message) for message in messages]
    compiled = _compile(template, source)
    context = {"documents": None, **variables}
    try:
        return compiled.render(
            messages=plain,
            tools=None if tools is None else list(tools),
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{source}: the chat template refused this conversation: {e}") from e
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{source}: the chat template failed: {type(e).__name__}: {e}") from e


# --- Checkpoint tokenizers: named special tokens, stop ids and chat templates ------------------------------


class CheckpointTokenizer(Tokenizer):
    """What `HFTokenizer` and `TiktokenTokenizer` share: the special tokens tokenizer_config.json names (which
    also reach the chat template as variables), the stop ids, and the chat templates by name.

    `chat_templates` maps a name to (template, where it came from); the one named "default" is used unless
    `apply_chat_template` is given another name or a template string, or `tools` are given and one is named
    "tool_use" (as in transformers). A subclass sets `source`, `chat_templates` and `template_variables`,
    then calls `_set_special_ids`.
    """

    source: str
    chat_templates: dict[str, tuple[str, str]]
    template_variables: dict[str, str]  # transformers' special_tokens_map, as strings

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of one token given as its string, or None if it is not a single token."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """The string of one token id."""

    def _set_special_ids(self, extra_stop_ids: Sequence[int]) -> None:
        """bos/eos/pad ids of the named tokens; stop ids: eos, then `extra_stop_ids` (generation_config's)."""
        self.bos_token, self.bos_id = self._named("bos_token")
        self.pad_token, self.pad_id = self._named("pad_token")
        eos_token, eos_id = self._named("eos_token")
        stop_ids = [eos_id] if eos_id is not None else []
        stop_ids += [i for i in extra_stop_ids if i not in stop_ids]
        if not stop_ids:
            raise ValueError(
                f"{self.source}: no eos_token in tokenizer_config.json and no eos_token_id in "
                "generation_config.json, so generation could never stop; set eos_token in the former"
            )
        self.stop_ids = tuple(stop_ids)
        self.eos_id = stop_ids[0]
        self.eos_token = eos_token if eos_id is not None else self.id_to_token(self.eos_id)

    def _named(self, name: str) -> tuple[str | None, int | None]:
        token = self.template_variables.get(name)
        token_id = None if token is None else self.token_to_id(token)
        if token is not None and token_id is None:
            raise ValueError(f"{self.source}: {name}={token!r} is not among the tokenizer's tokens")
        return token, token_id

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the checkpoint's chat template; `chat_template` is a template's name or a template string.

        Keyword arguments reach the template as variables (Qwen3's `enable_thinking`, say) and override the
        special-token strings, as in transformers.
        """
        template, source = self._select_template(chat_template, tools)
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            variables={**self.template_variables, **kwargs},
            source=source,
        )

    def _select_template(self, chat_template: str | None, tools: Any) -> tuple[str, str]:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, (chat_template, "the chat_template argument"))
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise ChatTemplateError(
                f"{self.source} has chat templates {sorted(self.chat_templates)} and none is named "
                "'default'; pass chat_template=<one of those names>"
            )
        raise ChatTemplateError(
            f"{self.source} has no chat template (no chat_template in tokenizer_config.json, no "
            "chat_template.jinja, no additional_chat_templates/); it is likely a base model. Pass one with "
            "apply_chat_template(..., chat_template='{% for m in messages %}...{% endfor %}')"
        )


def read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-download it from the checkpoint") from e


def token_string(value: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """`bos_token`, `eos_token`, ... and model-specific `*_token` strings (all reach the chat template)."""
    named = {key: token_string(value) for key, value in config.items() if key.endswith("_token")}
    return {key: value for key, value in named.items() if value is not None}


def _checkpoint_named_tokens(directory: pathlib.Path, config: Mapping[str, Any]) -> dict[str, str]:
    """tokenizer_config.json's named tokens; special_tokens_map.json's for the rest (older checkpoints)."""
    named = _named_tokens(config)
    for key, value in _named_tokens(read_json(directory / "special_tokens_map.json")).items():
        named.setdefault(key, value)
    return named


def _chat_templates(directory: pathlib.Path, config: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Name -> (template, source). Template files, if there are any, replace tokenizer_config.json's."""
    files = {}
    default = directory / "chat_template.jinja"
    if default.is_file():
        files["default"] = (default.read_text(encoding="utf-8"), str(default))
    for file in sorted((directory / "additional_chat_templates").glob("*.jinja")):
        files[file.name.removesuffix(".jinja")] = (file.read_text(encoding="utf-8"), str(file))
    if files:
        return files
    entry = config.get("chat_template")
    source = str(directory / "tokenizer_config.json")
    if isinstance(entry, str):
        return {"default": (entry, f"{source} chat_template")}
    if isinstance(entry, list):
        return {t["name"]: (t["template"], f"{source} chat_template {t['name']!r}") for t in entry}
    return {}


def _generation_eos_ids(path: pathlib.Path) -> tuple[int, ...]:
    """generation_config.json's `eos_token_id`: an int or a list (Llama 3 and Qwen chat models list some)."""
    eos = read_json(path).get("eos_token_id")
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(i) for i in eos)


class CheckpointFiles(NamedTuple):
    """What a checkpoint directory's files beside the vocabulary say: tokenizer_config.json (`config`), its
    named special tokens (with special_tokens_map.json's for the rest), the chat templates by name and the
    extra stop ids of generation_config.json."""

    config: dict[str, Any]
    named_tokens: dict[str, str]
    chat_templates: dict[str, tuple[str, str]]
    extra_stop_ids: tuple[int, ...]


def checkpoint_files(directory: pathlib.Path) -> CheckpointFiles:
    """Read the files of `CheckpointFiles` from `directory`."""
    config = read_json(directory / "tokenizer_config.json")
    return CheckpointFiles(
        config,
        _checkpoint_named_tokens(directory, config),
        _chat_templates(directory, config),
        _generation_eos_ids(directory / "generation_config.json"),
    )
