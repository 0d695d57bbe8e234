"""Tiktoken BPE checkpoints (Kimi K2): `tiktoken.model` and `tokenizer_config.json`, no tokenizer.json.

`tiktoken.model` holds one line per token: the base64 of its bytes, a space, its rank (which is its id). The
file stores no pre-tokenization regex, so the checkpoint's must be supplied: `KIMI_PATTERN`, the one Kimi's
`tokenization_kimi.py` uses. The special tokens take the ids after the ranks, a block of 256
(`num_reserved_special_tokens`, as Kimi's tokenizer): tokenizer_config.json's `added_tokens_decoder` names
some ("[BOS]", "[EOS]", "<|im_end|>", ...), the rest are `<|reserved_token_{id}|>`, so a sampled reserved
id still decodes. Named tokens, stop ids and chat templates are read as `HFTokenizer` reads them (both are
`CheckpointTokenizer`s), so the rest of the code uses either.

Encode and decode give what Kimi's transformers tokenizer gives: special-token strings in the text become
their ids, `add_special_tokens` adds none (that tokenizer adds none; the chat template writes what it needs),
and bytes that are not valid UTF-8 decode to U+FFFD. `tiktoken` (the `hf` extra) is imported only when a
tokenizer is built.
"""

from __future__ import annotations

import base64
import binascii
import os
import pathlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from model.io.tokenizer_base import CheckpointTokenizer, checkpoint_files, token_string

# Kimi's pre-tokenizer: o200k's with runs of Han characters as their own pieces, Han left out of the letter
# runs. `[A&&[^\p{Han}]]` is character-class intersection (A less Han). Kimi's tokenization_kimi.py hands this
# string to tiktoken.Encoding unchanged, and so do we: tiktoken's Rust regex engine (fancy-regex, which
# leaves character classes to the `regex` crate) supports `&&`. Python's `re` does not (and the `regex`
# package only with its V1 flag), so this pattern must never be compiled in Python.
# test_tiktoken_han_is_its_own_piece fails if tiktoken ever reads it differently.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_RESERVED_SPECIAL_TOKENS = 256  # Kimi K2: ranks 0..163583, special ids 163584..163839
KIMI_DEFAULT_NAMED = {"bos_token": "[BOS]", "eos_token": "[EOS]"}  # Kimi's tokenizer's defaults

# Kimi's encode cuts text before tiktoken sees it: into 400k-character pieces (longer inputs made tiktoken
# panic) and where a run of whitespace or of non-whitespace passes 25k characters (tiktoken's BPE is
# quadratic in a piece's length, openai/tiktoken#195). The cuts change the ids of such text, so we cut alike.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1}}}|\S{{{MAX_RUN_CHARS + 1}}}")


class TiktokenTokenizer(CheckpointTokenizer):
    """A `tiktoken.Encoding` with a checkpoint's special tokens, stop ids and chat templates.

    Build it with `TiktokenTokenizer.from_dir`. `mergeable_ranks` maps token bytes to ids 0..n-1 (every single
    byte among them); `special_tokens` maps each id from n up to `vocab_size - 1` to its string.
    """

    def __init__(
        self,
        mergeable_ranks: Mapping[bytes, int],
        *,
        special_tokens: Mapping[int, str],
        named_tokens: Mapping[str, str],
        chat_templates: Mapping[str, tuple[str, str]],
        extra_stop_ids: Sequence[int] = (),
        pattern: str = KIMI_PATTERN,
        source: str = "tokenizer",
    ):
        import tiktoken

        num_base = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(num_base)):
            raise ValueError(f"{source}: the BPE ranks are not 0..{num_base - 1}, one id each")
        missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
        if missing:
            raise ValueError(
                f"{source}: byte-level BPE needs every single byte as a token; bytes {missing[:8]} are not"
            )
        if sorted(special_tokens) != list(range(num_base, num_base + len(special_tokens))):
            raise ValueError(
                f"{source}: special token ids {sorted(special_tokens)[:4]}... do not follow the "
                f"{num_base} BPE ranks one by one; they must be {num_base}, {num_base + 1}, ..."
            )
        self.source = source
        self.chat_templates = dict(chat_templates)
        self.template_variables = dict(named_tokens)
        self.special_tokens = {token: i for i, token in special_tokens.items()}
        if len(self.special_tokens) != len(special_tokens):
            raise ValueError(f"{source}: two special token ids share one string")
        self._ranks = dict(mergeable_ranks)
        self._special_ids = frozenset(special_tokens)
        self._id_to_special = dict(special_tokens)
        self.encoding = tiktoken.Encoding(
            name=source, pat_str=pattern, mergeable_ranks=self._ranks, special_tokens=self.special_tokens
        )
        self.vocab_size = num_base + len(special_tokens)
        self._set_special_ids(extra_stop_ids)

    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike,
        *,
        pattern: str = KIMI_PATTERN,
        num_reserved_special_tokens: int = NUM_RESERVED_SPECIAL_TOKENS,
    ) -> TiktokenTokenizer:
        """Load `tiktoken.model` and the files beside it from a checkpoint directory.

        The special block is `num_reserved_special_tokens` ids long, or longer if added_tokens_decoder names a
        later id (Kimi-Linear's names 258).
        """
        directory = pathlib.Path(path)
        ranks = read_tiktoken_bpe(directory / "tiktoken.model")
        files = checkpoint_files(directory)
        config, named = files.config, files.named_tokens
        specials = _special_block(ranks, config, num_reserved_special_tokens, source=str(directory))
        for key, token in KIMI_DEFAULT_NAMED.items():
            if token in specials.values():
                named.setdefault(key, token)
        return cls(
            ranks,
            special_tokens=specials,
            named_tokens=named,
            chat_templates=files.chat_templates,
            extra_stop_ids=files.extra_stop_ids,
            pattern=pattern,
            source=str(directory),
        )

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings become their ids; `add_special_tokens` adds none (see the module doc)."""
        ids: list[int] = []
        for piece in _pieces(text):
            ids.extend(self.encoding.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        outside = [i for i in ids if not 0 <= i < self.vocab_size]
        if outside:
            raise ValueError(f"token ids {outside[:4]} are outside {self.source}'s {self.vocab_size} ids")
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self.encoding.decode(ids, errors="replace")

    def token_to_id(self, token: str) -> int | None:
        """A special token's id, or the rank of a token whose bytes are `token`'s UTF-8."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self._ranks.get(token.encode("utf-8"))

    def id_to_token(self, token_id: int) -> str | None:
        """A special token's string, or the token's bytes decoded (U+FFFD for part of a character)."""
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        if not 0 <= token_id < self.vocab_size:
            return None
        return self.encoding.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")


def read_tiktoken_bpe(path: pathlib.Path) -> dict[bytes, int]:
    """Token bytes -> rank from a tiktoken BPE file.

    Read here rather than with `tiktoken.load.load_tiktoken_bpe`, which caches files in a temporary directory
    keyed by their path, so a checkpoint replaced in place would load stale ranks.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: TiktokenTokenizer reads a tiktoken BPE file")
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{path}:{number}: expected '<token's base64> <rank>', got {line[:60]!r}") from e
    return ranks


def _special_block(
    ranks: Mapping[bytes, int], config: Mapping[str, Any], num_reserved: int, *, source: str
) -> dict[int, str]:
    """id -> string for the ids after the ranks: added_tokens_decoder's strings, reserved names elsewhere."""
    num_base = len(ranks)
    named: dict[int, str] = {}
    for key, spec in config.get("added_tokens_decoder", {}).items():
        token_id, token = int(key), token_string(spec)
        if token is None:
            raise ValueError(f"{source}: added_tokens_decoder[{key!r}] has no 'content' string")
        if token_id < num_base:
            raise ValueError(
                f"{source}: added_tokens_decoder gives {token!r} id {token_id}, which is a BPE rank of "
                f"tiktoken.model ({num_base} ranks); special tokens take ids from {num_base}"
            )
        named[token_id] = token
    end = max(num_base + num_reserved, max(named, default=0) + 1)
    return {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(num_base, end)}


def _pieces(text: str) -> Iterator[str]:
    """`text` cut as Kimi's encode cuts it (see MAX_ENCODE_CHARS); usually `text` itself."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[start : start + MAX_ENCODE_CHARS]
        if _LONG_RUN.search(chunk) is None:
            yield chunk
        else:
            yield from _split_long_runs(chunk)


def _split_long_runs(text: str) -> Iterator[str]:
    """Cut before the character that would make a run of whitespace or of non-whitespace MAX_RUN_CHARS + 1
    long; the run then counts again from that character."""
    start, run, in_space = 0, 0, text[:1].isspace()
    for i, char in enumerate(text):
        if char.isspace() != in_space:
            in_space, run = not in_space, 1
            continue
        run += 1
        if run > MAX_RUN_CHARS:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]
