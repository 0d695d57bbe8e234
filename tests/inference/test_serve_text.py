"""inference.serve.text: stop strings held back and characters split across tokens, by hand."""

from inference.serve.text import TextStream
from model.io.tokenizer import ByteTokenizer, Tokenizer

TOK = ByteTokenizer(256)
EOS = TOK.eos_id

# --- text: stop strings and incremental decoding -----------------------------------------------------------


class _Replacing(Tokenizer):
    """A minimal non-byte tokenizer: id 1 is "a", every other id decodes to U+FFFD."""

    vocab_size, stop_ids = 4, ()

    def encode(self, text, *, add_special_tokens=False):
        return [1] * len(text)

    def decode(self, ids, *, skip_special_tokens=False):
        return "".join("a" if i == 1 else "\ufffd" for i in ids)

    def apply_chat_template(self, messages, **kwargs):
        return ""


def _feed(stream: TextStream, text: bytes | str | list[int]) -> list[str]:
    out = []
    for b in text.encode() if isinstance(text, str) else text:
        stream.add(b, -1.0)
        out.append(stream.take()[0])
    return out


def test_text_stream_holds_back_stop_prefixes():
    s = TextStream(TOK, ("ab", "xyz"))
    assert _feed(s, "qa") == ["q", ""]  # "a" may start "ab"
    assert _feed(s, "c") == ["ac"]  # it did not
    assert _feed(s, "xya") == ["", "", "xy"]  # "xy" may start "xyz", then "a" may start "ab"
    assert _feed(s, "b") == [""] and s.stopped
    s.add(ord("z"), 0.0)  # ignored after the stop
    assert s.text == "qacxy" and s.num_generated == 7 and s.take() == ("", [])
    # Tokens are released with their text; the stop's tokens are dropped.
    s = TextStream(TOK, ("c",))
    _feed(s, "abc")
    assert [t.text for t in s.tokens] == ["a", "b"] and [t.offset for t in s.tokens] == [0, 1]


def test_text_stream_decodes_split_characters_and_hides_stop_tokens():
    s = TextStream(TOK, (), hidden_ids=(EOS,))
    assert _feed(s, "é€".encode()) == ["", "é", "", "", "€"]
    s.add(EOS, 0.0)
    s.finish()
    assert s.text == "é€" and s.num_generated == 6 and len(s.tokens) == 5
    assert [t.offset for t in s.tokens] == [0, 0, 1, 1, 1] and s.tokens[0].bytes == [0xC3]
    s = TextStream(TOK, ("€",))
    assert _feed(s, b"a\xe2\x82") == ["a", "", ""]
    _feed(s, b"\xac")
    assert s.stopped and s.text == "a"
    # Bytes that cannot complete a character, and unused ids (U+FFFD alone), are not held.
    assert _feed(TextStream(TOK), b"\x80\xff\xe2a") == ["\ufffd", "\ufffd", "", "\ufffda"]
    assert _feed(TextStream(ByteTokenizer(512)), [300, 0xC3, 301]) == ["\ufffd", "", "\ufffd\ufffd"]
    # Another tokenizer: a trailing U+FFFD is held for MAX_HELD_TOKENS tokens at most.
    assert _feed(TextStream(_Replacing()), [1, 2, 2, 2, 2, 1]) == ["a", "", "", "", "\ufffd" * 4, "a"]
    s = TextStream(TOK)
    _feed(s, b"\xe2\x82")  # cut: finish shows what is there
    s.finish()
    assert s.take()[0] == "\ufffd"
