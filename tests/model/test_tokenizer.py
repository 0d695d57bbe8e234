"""The byte-level tokenizer (the default) and `load_tokenizer`; Hugging Face checkpoints' tokenizers are in
tests/model/test_hf_tokenizer.py."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from model.io.tokenizer import ByteTokenizer, load_tokenizer

# --- ByteTokenizer ----------------------------------------------------------------------------------------

TEXTS = [
    "",
    "hello, world",
    "  runs   of\tspaces\n\n\nand newlines  ",
    "héllo wörld — ça va? 日本語",
    "emoji 🚀 and a family 👩‍👩‍👧 (ZWJ sequence)",
]


@pytest.mark.parametrize("vocab_size", [256, 8192])
@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(vocab_size, text):
    tok = ByteTokenizer(vocab_size)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")), "ids 0..255 are exactly the UTF-8 bytes"
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == text, "arrays of ids decode too"


def test_byte_multibyte_lengths():
    tok = ByteTokenizer(256)
    assert len(tok.encode("é")) == 2 and len(tok.encode("日")) == 3 and len(tok.encode("🚀")) == 4


def test_byte_invalid_sequences_decode_with_replacement():
    tok = ByteTokenizer(8192)
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"  # 0xFF is never valid UTF-8
    rocket = list("🚀".encode())
    assert tok.decode([*rocket[:3], ord("x")]) == "\ufffdx"  # a truncated 4-byte character
    # Split by a special token: the lead pair is one bad sequence, each stray continuation byte another.
    assert tok.decode([*rocket[:2], 257, *rocket[2:]]) == "\ufffd<|eos|>\ufffd\ufffd"
    assert tok.decode([300]) == "\ufffd", "an id above the specials that no token uses"
    with pytest.raises(ValueError, match=r"token id 8192 is outside ByteTokenizer\(vocab_size=8192\)"):
        tok.decode([8192])


def test_byte_specials_above_bytes_when_the_vocab_has_room():
    tok = ByteTokenizer(8192)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (256, 257, 258, (257,))
    assert tok.special_tokens == {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258}
    assert tok.encode("hi", add_special_tokens=True) == [256, 104, 105]
    assert tok.encode("a<|eos|>b<|pad|>") == [97, 257, 98, 258], "special strings in text are their ids"
    assert tok.decode([256, 104, 105, 257, 258]) == "<|bos|>hi<|eos|><|pad|>"
    assert tok.decode([256, 104, 105, 257, 258], skip_special_tokens=True) == "hi"


@pytest.mark.parametrize("vocab_size", [256, 257, 258])
def test_byte_nul_is_eos_and_pad_without_room(vocab_size):
    tok = ByteTokenizer(vocab_size)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (None, 0, 0, (0,))
    assert tok.special_tokens == {"\x00": 0}
    assert tok.encode("hi", add_special_tokens=True) == [104, 105], "no bos to add"
    assert tok.decode([104, 105, 0, 0]) == "hi\x00\x00"
    assert tok.decode([104, 105, 0, 0], skip_special_tokens=True) == "hi"


def test_byte_vocab_must_hold_every_byte():
    with pytest.raises(ValueError, match=r"ByteTokenizer\(vocab_size=255\): needs >= 256"):
        ByteTokenizer(255)


CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4, naïvely."},
]


def test_byte_chat_template_two_turns():
    tok = ByteTokenizer(8192)
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == (
        "user: What is 2+2?<|eos|>\nassistant: 4, naïvely.<|eos|>\n"
    )
    prompt = CONVERSATION[:1]
    assert tok.apply_chat_template(prompt) == "user: What is 2+2?<|eos|>\nassistant: "
    assert tok.encode_chat(prompt) == [*b"user: What is 2+2?", 257, *b"\nassistant: "]


def test_byte_chat_template_256_ends_turns_with_nul():
    tok = ByteTokenizer(256)
    text = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, enable_thinking=False)
    assert text == "user: What is 2+2?\x00\nassistant: 4, naïvely.\x00\nassistant: "
    ids = tok.encode_chat(CONVERSATION, add_generation_prompt=False)
    assert ids.count(tok.eos_id) == 2 and ids[-2:] == [0, ord("\n")]


def test_byte_chat_template_tools_and_tool_calls():
    tok = ByteTokenizer(8192)
    tools = [{"name": "add", "description": "a <b>sum</b> & more"}]
    calls = [{"name": "add", "arguments": {"a": 2}}]
    messages = [
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    assert tok.apply_chat_template(messages, tools=tools, add_generation_prompt=False) == (
        'tools: [{"name": "add", "description": "a <b>sum</b> & more"}]<|eos|>\n'
        "user: 2+2<|eos|>\n"
        'assistant: [{"name": "add", "arguments": {"a": 2}}]<|eos|>\n'
    )


def test_byte_takes_a_jinja_chat_template():
    tok = ByteTokenizer(8192)
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
    assert tok.apply_chat_template(CONVERSATION, chat_template=template) == (
        "[user]What is 2+2?<|eos|>[assistant]4, naïvely.<|eos|>"
    )


def test_load_tokenizer_byte():
    assert load_tokenizer(None).vocab_size == 256
    tok = load_tokenizer("byte", vocab_size=8192)
    assert isinstance(tok, ByteTokenizer) and tok.eos_id == 257


def test_module_imports_no_jax_torch_or_transformers():
    # `model` stands in as a bare package, so its __init__ (which builds the JAX model) does not run: what
    # is imported is model.io.tokenizer and the modules it imports.
    path = pathlib.Path(__file__).parents[2] / "model"
    code = (
        "import sys, types\n"
        f"package = types.ModuleType('model'); package.__path__ = [{str(path)!r}]\n"
        "sys.modules['model'] = package\n"
        "import model.io.tokenizer as module\n"
        "module.ByteTokenizer(8192).apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "print(sorted({'jax', 'torch', 'transformers', 'tokenizers', 'jinja2'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", "the byte tokenizer needs none of these; tokenizers/jinja2 load on demand"
