"""Tokenizers behind one small interface: a byte-level default and Hugging Face checkpoints.

`Tokenizer` is what the decoding engine and the GRPO loop see: `encode`/`decode`, the special ids (`bos_id`,
`eos_id`, `pad_id`), `stop_ids` (generation stops at any of them) and a chat template that turns a list of
`{"role", "content"}` messages into one prompt string.

- `ByteTokenizer` is the embedded default for the tiny and small configs: ids 0..255 are UTF-8 bytes and the
  special tokens sit just above them when the vocab has room. Its chat template is plain Python (see
  `ByteTokenizer.apply_chat_template`), so it needs neither `tokenizers` nor `jinja2`.
- `HFTokenizer.from_dir` reads a checkpoint directory: `tokenizer.json` with the `tokenizers` library (never
  `transformers`), the special tokens and chat templates from `tokenizer_config.json`,
  `special_tokens_map.json`, `chat_template.jinja` and `additional_chat_templates/`, and extra stop ids from
  `generation_config.json`. Encode, decode and `apply_chat_template` give what `transformers.AutoTokenizer`
  gives for the same directory.
- `model.io.tokenizer_tiktoken.TiktokenTokenizer` reads a checkpoint that ships a tiktoken BPE file
  (`tiktoken.model`, as Kimi K2) instead of tokenizer.json. It and `HFTokenizer` share `CheckpointTokenizer`:
  the named special tokens, stop ids and chat templates.

`Tokenizer`, `ByteTokenizer`, chat templates and `CheckpointTokenizer` live in `model.io.tokenizer_base`;
this module names them too, so importers need one module. Chat templates render in a sandboxed jinja2
environment set up as Hugging Face's is. This module imports no JAX, torch or transformers, and `tokenizers`
and `jinja2` (the `hf` extra) only when they are needed, so JAX-free worker processes can use it.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from configs.errors import require
from model.io.tokenizer_base import (
    ByteTokenizer,
    ChatTemplateError,
    CheckpointTokenizer,
    Tokenizer,
    TokenizerNotFound,
    checkpoint_files,
    render_chat_template,
    token_string,
)
from model.io.tokenizer_tiktoken import TiktokenTokenizer

__all__ = [
    "ByteTokenizer",
    "ChatTemplateError",
    "CheckpointTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerNotFound",
    "load_tokenizer",
    "render_chat_template",
]


class HFTokenizer(CheckpointTokenizer):
    """A `tokenizers.Tokenizer` with a checkpoint's special tokens, stop ids and chat templates.

    Build it with `HFTokenizer.from_dir`; `CheckpointTokenizer` says how a chat template is chosen.
    """

    def __init__(
        self,
        backend: Any,
        *,
        named_tokens: Mapping[str, str],
        chat_templates: Mapping[str, tuple[str, str]],
        extra_stop_ids: Sequence[int] = (),
        clean_up_tokenization_spaces: bool = False,
        source: str = "tokenizer",
    ):
        self.backend = backend
        self.source = source
        self.chat_templates = dict(chat_templates)
        self.template_variables = dict(named_tokens)
        self._clean_up_spaces = clean_up_tokenization_spaces
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        added = backend.get_added_tokens_decoder()
        self.special_tokens = {token.content: i for i, token in added.items() if token.special}
        self._set_special_ids(extra_stop_ids)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> HFTokenizer:
        """Load `tokenizer.json` and the files beside it from a checkpoint directory."""
        directory = pathlib.Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerNotFound(
                f"{tokenizer_file} not found: give a tokenizer directory holding a fast tokenizer's "
                "tokenizer.json (or Kimi K2's tiktoken.model) with rl.tokenizer / --tokenizer, or 'byte' for "
                "the byte-level tokenizer (our own configs' vocab_size 256)"
            )
        tokenizers = require("tokenizers", "a Hugging Face tokenizer (tokenizer.json)")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        files = checkpoint_files(directory)
        config, named = files.config, files.named_tokens
        if backend.padding is not None and "pad_token" not in config:
            named.setdefault("pad_token", backend.padding["pad_token"])  # transformers' last resort for pad
        # transformers' encode and decode never pad or truncate unless asked, whatever tokenizer.json says.
        backend.no_padding()
        backend.no_truncation()
        _add_missing_tokens(backend, config, named)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        # transformers skips this clean-up for BPE models, where it would delete real spaces.
        clean_up = bool(config.get("clean_up_tokenization_spaces")) and type(backend.model).__name__ != "BPE"
        return cls(
            backend,
            named_tokens=named,
            chat_templates=files.chat_templates,
            extra_stop_ids=files.extra_stop_ids,
            clean_up_tokenization_spaces=clean_up,
            source=str(directory),
        )

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens` applies tokenizer.json's post-processor (a Llama checkpoint's bos, say)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text


ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _add_missing_tokens(backend: Any, config: Mapping[str, Any], named: Mapping[str, str]) -> None:
    """Add what tokenizer_config.json declares but tokenizer.json lacks, as transformers does on load."""
    import tokenizers

    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    for _, spec in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0])):
        if spec["content"] not in present:
            flags = {k: spec[k] for k in ADDED_TOKEN_FLAGS if k in spec}
            backend.add_tokens([tokenizers.AddedToken(spec["content"], **flags)])
            present.add(spec["content"])
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = extra.values() if isinstance(extra, Mapping) else extra
    specials = [*named.values(), *filter(None, map(token_string, extra))]
    missing = [token for token in dict.fromkeys(specials) if token not in present]
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in missing])


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: WordPiece-era spacing before punctuation and contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(spaced, joined)
    for spaced, joined in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def load_tokenizer(path: str | os.PathLike | None, vocab_size: int | None = None) -> Tokenizer:
    """None or "byte" -> `ByteTokenizer(vocab_size or 256)`; a checkpoint directory -> `HFTokenizer.from_dir`,
    or `TiktokenTokenizer.from_dir` when it holds `tiktoken.model` and no `tokenizer.json` (Kimi K2).

    With a directory, a given `vocab_size` (the model's) is checked to have a row for every token id, special
    tokens included.
    """
    if path is None or path == "byte":
        return ByteTokenizer(256 if vocab_size is None else vocab_size)
    if not pathlib.Path(path).is_dir():
        raise TokenizerNotFound(
            f"tokenizer path {str(path)!r} is not a directory; give a checkpoint directory holding "
            "tokenizer.json (or tiktoken.model), or 'byte' for the byte-level tokenizer"
        )
    directory = pathlib.Path(path)
    tokenizer: Tokenizer
    if (directory / "tiktoken.model").is_file() and not (directory / "tokenizer.json").is_file():
        tokenizer = TiktokenTokenizer.from_dir(directory)
    else:
        tokenizer = HFTokenizer.from_dir(directory)
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer in {path} has ids up to {tokenizer.vocab_size - 1} but the model's vocab_size is "
            f"{vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}"
        )
    return tokenizer
