"""Tokens to text for the server: incremental detokenization and stop strings that may span tokens.

`TextStream` turns one sample's tokens, fed one at a time as the engine emits them, into the text a client
sees. Decoding is incremental (the prefix-offset scheme of Hugging Face's text-generation-inference): a
token's text is the growth of `decode(tokens[prefix:])` over `decode(tokens[prefix:read])`, and is held while
it ends in U+FFFD because a multi-byte character is cut between tokens (the byte tokenizer makes one token
per byte: there the cut is read off the bytes; other tokenizers hold at most `MAX_HELD_TOKENS` tokens).

Stop strings are searched in the decoded text, so they match across token boundaries. Text that could be the
start of a stop string is held back until it either completes the stop (the text is cut before it and the
sample ends) or stops being a prefix of one (it is released). The held part is always shorter than the
longest stop string, so a stop occurrence always starts at or after the released text.

Each kept token carries its character offset in the text (`Token.offset`), so log-prob entries line up with
the text they are released with; the engine's stop tokens (eos, end of turn) are counted but never shown.
"""

from __future__ import annotations

from typing import NamedTuple

from model.io.tokenizer import ByteTokenizer, Tokenizer

REPLACEMENT = "\ufffd"
# Tokens held for an incomplete character at most (tokenizers other than the byte one, where the cut is
# read off the bytes): a UTF-8 character is at most 4 bytes, so 4 tokens that still end in U+FFFD are
# invalid bytes or ids that decode to U+FFFD alone (unused ids), not a split character.
MAX_HELD_TOKENS = 4


class Token(NamedTuple):
    """One generated token as a client sees it: id, text, bytes, log-prob, offset of its text."""

    id: int
    text: str
    bytes: list[int]
    logprob: float
    offset: int


class TextStream:
    """One sample's text: `add` each emitted token, `finish` at the end, `take` what may be shown so far."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = (), hidden_ids: tuple[int, ...] = ()):
        self.tokenizer, self.stops, self.hidden = tokenizer, tuple(s for s in stops if s), set(hidden_ids)
        self.ids: list[int] = []  # the decodable tokens (hidden ones left out)
        self.text = ""
        self.tokens: list[Token] = []  # kept tokens, with their offsets
        self.num_generated = 0  # every token the engine emitted for this sample, hidden ones included
        self.stopped = False  # a stop string ended the sample
        self.finished = False
        self._prefix = self._read = 0  # incremental decoding offsets into `ids`
        self._sent_text = self._sent_tokens = 0  # how much `take` has released

    def add(self, token: int, logprob: float) -> None:
        """Feeds one emitted token; does nothing once a stop string matched or `finish` was called."""
        if self.stopped or self.finished:
            return
        self.num_generated += 1
        if token in self.hidden:
            return
        offset = len(self.text)
        self.ids.append(token)
        self.tokens.append(Token(token, self._token_text(token), self._token_bytes(token), logprob, offset))
        prefix = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if len(full) > len(prefix) and not (full.endswith(REPLACEMENT) and self._incomplete()):
            self._append(full[len(prefix) :])
            self._prefix, self._read = self._read, len(self.ids)

    def finish(self) -> None:
        """The sample ended: decodes what was held for an incomplete character, releases everything."""
        if not self.stopped and not self.finished and self._read < len(self.ids):
            prefix = self._decode(self.ids[self._prefix : self._read])
            self._append(self._decode(self.ids[self._prefix :])[len(prefix) :])
        self.finished = True

    @property
    def done(self) -> bool:
        return self.stopped or self.finished

    def take(self) -> tuple[str, list[Token]]:
        """The text and tokens released since the last call: all of it once done, else all but a tail that
        may begin a stop string (and the tokens whose text starts in that tail)."""
        end = len(self.text) if self.done else len(self.text) - self._held()
        tokens = self.tokens[self._sent_tokens :]
        if not self.done:
            tokens = [t for t in tokens if t.offset < end]
        text = self.text[self._sent_text : end]
        self._sent_text, self._sent_tokens = end, self._sent_tokens + len(tokens)
        return text, tokens

    def _append(self, piece: str) -> None:
        start = len(self.text)
        self.text += piece
        if not self.stops:
            return
        # A stop can only start in the unreleased text (see the module docstring).
        search = max(self._sent_text, start - max(map(len, self.stops)) + 1)
        hits = [i for i in (self.text.find(s, search) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            self.text = self.text[:cut]
            self.tokens = [t for t in self.tokens if t.offset < cut]
            self.stopped = True

    def _incomplete(self) -> bool:
        """Whether the undecoded tail may still become a character. The byte tokenizer: exactly, when its
        last bytes are a UTF-8 sequence cut short. Others: for `MAX_HELD_TOKENS` tokens at most."""
        if not isinstance(self.tokenizer, ByteTokenizer):
            return len(self.ids) - self._read < MAX_HELD_TOKENS
        tail = self.ids[-3:]  # a cut sequence has at most 3 of its 4 bytes
        for k in range(1, len(tail) + 1):
            b = tail[-k]
            need = 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 0
            if need:  # the lead byte of the last character, followed by k - 1 continuation bytes
                return need > k
            if not 0x80 <= b <= 0xBF:  # ASCII, a special id or an invalid byte: nothing is cut
                return False
        return False

    def _held(self) -> int:
        """Length of the longest unreleased tail of the text that is a proper prefix of a stop string."""
        tail = self.text[self._sent_text :]
        for n in range(min(len(tail), max(map(len, self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _token_bytes(self, token: int) -> list[int]:
        if isinstance(self.tokenizer, ByteTokenizer) and token < 256:
            return [token]
        return list(self._token_text(token).encode("utf-8"))
