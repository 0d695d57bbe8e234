"""TiktokenTokenizer: a Kimi K2-style checkpoint (tiktoken.model, tokenizer_config.json) built in the test.

The BPE file holds the 256 single bytes (rank = the byte's value) and 16 merges with hand-written ranks, so
every expected id below is derived by hand from the merges, in a comment, not read off the code.
"""

import base64
import json

import pytest

from model.io.tokenizer import HFTokenizer, load_tokenizer
from model.io.tokenizer_tiktoken import MAX_RUN_CHARS, TiktokenTokenizer, _pieces

HAN = "中".encode()  # e4 b8 ad
MERGES = [  # rank 256 + position
    b"he",  # 256
    b"ll",  # 257
    b"hell",  # 258
    b"hello",  # 259
    b" w",  # 260
    b"or",  # 261
    b" wor",  # 262
    b"ld",  # 263
    b" world",  # 264
    b"a" + HAN[:1],  # 265  "a" and 中 in one piece would merge through 265, 266, 267
    b"a" + HAN[:2],  # 266
    b"a" + HAN,  # 267
    HAN[:2],  # 268
    HAN,  # 269 中
    b"\n\n",  # 270
    b"20",  # 271
]
NUM_BASE = 256 + len(MERGES)  # 272: special ids start here and run for 256 ids, to 527
SPECIALS = {
    272: "[BOS]",
    273: "[EOS]",
    274: "<|im_end|>",
    275: "<|im_user|>",
    276: "<|im_assistant|>",
    278: "<|im_system|>",  # 277 is left unnamed: <|reserved_token_277|>
    279: "<|im_middle|>",
    527: "[PAD]",  # the last of the block, as Kimi K2's [PAD] (163839)
}
KIMI_TEMPLATE = """\
{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi.<|im_end|>
  {%- endif -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>user<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>assistant<|im_middle|>
  {%- else -%}
    <|im_system|>{{ message['role'] }}<|im_middle|>
  {%- endif -%}
  {{ message['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""


def write_checkpoint(directory, *, specials=SPECIALS, merges=MERGES):
    lines = [base64.b64encode(bytes([b])) + b" %d" % b for b in range(256)]
    lines += [base64.b64encode(token) + b" %d" % (256 + i) for i, token in enumerate(merges)]
    (directory / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    config = {
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in specials.items()},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "chat_template": KIMI_TEMPLATE,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 274}))
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def tok(checkpoint):
    return TiktokenTokenizer.from_dir(checkpoint)


@pytest.mark.parametrize(
    "text, ids",
    [
        # One piece, "hello": h e l l o -> he(256) l l o -> he ll(257) o -> hell(258) o -> hello(259).
        ("hello", [259]),
        # Pieces "hello", " world" (the space leads the letters). " world": " w"(260) o r l d -> " w" or(261)
        # l d -> " wor"(262) l d -> " wor" ld(263) -> " world"(264).
        ("hello world", [259, 264]),
        # Case matters: H e l l o has no "He" or "el" merge, only ll(257).
        ("Hello", [72, 101, 257, 111]),
        # Pieces "hello", "\n\n" (\s*[\r\n]+) -> 270, "world": w o r l d -> w or(261) l d -> w or ld(263).
        ("hello\n\nworld", [259, 270, 119, 261, 263]),
        # Digits go in threes: "202" -> 20(271) 2, then "0". As one piece "2020" would be 20 20.
        ("2020", [271, 50, 48]),
        # Special-token strings in the text are their ids.
        ("hello<|im_end|>", [259, 274]),
        ("", []),
    ],
)
def test_tiktoken_ids_of_short_texts(tok, text, ids):
    assert tok.encode(text) == ids
    assert tok.encode(text, add_special_tokens=True) == ids  # Kimi's tokenizer adds no bos or eos


def test_tiktoken_han_is_its_own_piece(tok):
    # Kimi's pattern keeps Han out of letter runs ([...\p{Lo}...&&[^\p{Han}]]): "a中" is pieces "a", "中".
    # 中 = e4 b8 ad -> e4b8(268) ad -> 中(269). Had "a中" been one piece (the intersection ignored, 中 being
    # \p{Lo}), a e4 b8 ad -> a·e4(265) b8 ad -> a·e4b8(266) ad -> a中(267) would give [267].
    assert tok.encode("a中") == [97, 269]
    assert tok.encode("中a") == [269, 97]


@pytest.mark.parametrize(
    "text",
    [
        "hello world\n\n中文 a中 and 日本語のテキスト",
        "  runs   of\tspaces\r\n\n\nand newlines  ",
        "héllo wörld — ça va? Ünïcödé 🚀 👩‍👩‍👧 2020-01-01",
        "<|im_user|>user<|im_middle|>你好\n<|im_end|>[EOS]",
    ],
)
def test_tiktoken_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_tiktoken_special_ids_and_vocab_size(tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (272, 273, 527)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("[BOS]", "[EOS]", "[PAD]")
    assert tok.stop_ids == (273, 274)  # eos, then generation_config.json's eos_token_id
    # 272 ranks and a block of 256 special ids (272..527), named or reserved.
    assert tok.vocab_size == 528
    assert len(tok.special_tokens) == 256
    assert {tok.special_tokens[t] for t in SPECIALS.values()} == set(SPECIALS)
    assert tok.special_tokens["<|reserved_token_277|>"] == 277
    assert tok.decode([259, 277, 274]) == "hello<|reserved_token_277|><|im_end|>"
    assert tok.decode([259, 277, 274, 264], skip_special_tokens=True) == "hello world"
    assert tok.decode([228, 184]) == "\ufffd"  # the first two bytes of 中 are no character
    with pytest.raises(ValueError, match=r"token ids \[528\] are outside .*'s 528 ids"):
        tok.decode([259, 528])
    assert [tok.token_to_id(t) for t in ("<|im_end|>", "hello", "zz")] == [274, 259, None]
    assert (tok.id_to_token(274), tok.id_to_token(264)) == ("<|im_end|>", " world")


def test_tiktoken_chat_template_maps_special_tokens_to_their_ids(tok):
    chat = [{"role": "user", "content": "hello world"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert prompt == (
        "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>hello world"
        "<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    # Between the special tokens, "system", "You are Kimi.", "user" and "assistant" contain no merge's bytes
    # (no he, ll, " w", or, ld, 20, \n\n, a·e4, e4b8), so they stay single bytes; "hello world" is 259 264.
    assert tok.encode_chat(chat, add_generation_prompt=True) == [
        278, *b"system", 279, *b"You are Kimi.", 274,
        275, *b"user", 279, 259, 264, 274,
        276, *b"assistant", 279,
    ]  # fmt: skip


def test_tiktoken_works_with_the_rollout_prompts(tok):
    from envs import Task
    from rl import rollout

    task = Task(id="t", domain="d", prompt="hello")
    assert rollout.format_prompt(task, tok, chat=False) == [272, 259, 10]  # bos, hello, "\n"
    assert rollout.format_prompt(task, tok, chat=True) == [
        278, *b"system", 279, *b"You are Kimi.", 274,
        275, *b"user", 279, 259, 274,
        276, *b"assistant", 279,
    ]  # fmt: skip
    # After the model's <|im_end|> (274, the stop token): the user turn with the observation, then the
    # assistant's header. "out" has no merge: bytes.
    assert rollout.observation_tokens(tok, "out", chat=True, stop_token=274) == [
        275, *b"user", 279, *b"out", 274, 276, *b"assistant", 279,
    ]  # fmt: skip


def test_load_tokenizer_picks_tiktoken_and_checks_the_model_vocab(checkpoint, tmp_path):
    assert isinstance(load_tokenizer(checkpoint, vocab_size=528), TiktokenTokenizer)
    with pytest.raises(
        ValueError, match=r"has ids up to 527 but the model's vocab_size is 527; set model.vocab_size >= 528"
    ):
        load_tokenizer(checkpoint, vocab_size=527)
    # With a tokenizer.json beside tiktoken.model, the directory is a Hugging Face one.
    import tokenizers

    both = write_checkpoint(tmp_path)
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"[EOS]": 0}, unk_token="[EOS]")).save(
        str(both / "tokenizer.json")
    )
    assert isinstance(load_tokenizer(both), HFTokenizer)


def test_tiktoken_chat_template_file_takes_priority(tmp_path):
    directory = write_checkpoint(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ messages[0].content }}<|im_end|>")
    tok = TiktokenTokenizer.from_dir(directory)
    assert tok.encode_chat([{"role": "user", "content": "hello"}]) == [259, 274]


def test_tiktoken_refuses_special_ids_among_the_ranks(tmp_path):
    write_checkpoint(tmp_path, specials={**SPECIALS, 100: "<|bad|>"})
    with pytest.raises(ValueError, match=r"'<\|bad\|>' id 100, which is a BPE rank .* ids from 272"):
        TiktokenTokenizer.from_dir(tmp_path)


def test_tiktoken_names_a_bad_line(tmp_path):
    write_checkpoint(tmp_path)
    with (tmp_path / "tiktoken.model").open("ab") as f:
        f.write(b"not-base64!\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:273: expected '<token's base64> <rank>'"):
        TiktokenTokenizer.from_dir(tmp_path)


def test_tiktoken_a_later_config_id_extends_the_block(tmp_path):
    tok = TiktokenTokenizer.from_dir(write_checkpoint(tmp_path, specials={**SPECIALS, 529: "<|extra|>"}))
    assert tok.vocab_size == 530 and tok.special_tokens["<|reserved_token_528|>"] == 528
    assert tok.encode("<|extra|>") == [529]


def test_tiktoken_long_runs_are_cut_as_kimi_cuts():
    # A run of non-whitespace is cut before its (MAX_RUN_CHARS + 1)-th character; the run then restarts, and
    # a switch between whitespace and non-whitespace restarts it too.
    run = "a" * (MAX_RUN_CHARS + 1)
    assert list(_pieces(run + " b")) == ["a" * MAX_RUN_CHARS, "a b"]
    assert list(_pieces("a" * MAX_RUN_CHARS + " b")) == ["a" * MAX_RUN_CHARS + " b"]
    spaces = " " * (2 * MAX_RUN_CHARS + 1)
    assert list(_pieces("x" + spaces)) == ["x" + " " * MAX_RUN_CHARS, " " * MAX_RUN_CHARS, " "]
