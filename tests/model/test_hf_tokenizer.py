"""Hugging Face checkpoints' tokenizers, read exactly as `transformers` reads them.

The HF checkpoints are built here, offline: a small byte-level BPE trained on a few paragraphs with the
`tokenizers` library, saved with a Qwen-style (ChatML) or Llama-3-style tokenizer_config.json. `transformers`
is imported only inside the parity tests, as the reference.
"""

import json

import pytest

from model.io.tokenizer import ChatTemplateError, HFTokenizer, load_tokenizer

# --- Hugging Face checkpoints built in the test --------------------------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on and on.",
    "Tokenizers split text into pieces. Byte-level BPE never meets an unknown character, "
    "because every string is a sequence of bytes first.",
    "Héllo wörld! Ça va? Grüße aus Zürich. 日本語のテキストも少し。 Emoji: 🚀🚀 🎉",
    "def add(x, y):\n    return x + y\n\n\nprint(add(2, 2))  # four\n",
    "Don't stop . ? ! , 's 're 've n't — spaces before punctuation stay as written.",
]

QWEN_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures in <tools></tools> tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) \
or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama 3 style: bos_token, strftime_now, raise_exception on a bad role, {% generation %}, and (tool_use)
# loopcontrols and tojson(indent=...).
LLAMA_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
TOOLS{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Conversation roles must be user or assistant, got " + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}
        {{- message['content'] | trim + '<|eot_id|>' }}
        {%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA_TOOLS = """\
{%- for tool in tools %}
    {%- if loop.index > 2 %}{% break %}{% endif %}
    {{- tool | tojson(indent=4) + "\\n\\n" }}
{%- endfor %}
"""

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def _train_wordpiece():
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    backend = Backend(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def _train_bpe(specials, bos=None):
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as Backend

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    # Specials after the learned vocab, as in Qwen and Llama 3; one non-special added token.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    if bos is None:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return backend


def _added_tokens_decoder(backend):
    """tokenizer_config.json's record of the added tokens, as save_pretrained writes it."""
    flags = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
    added = backend.get_added_tokens_decoder().items()
    return {str(i): {flag: getattr(token, flag) for flag in flags} for i, token in added}


def _save(directory, backend, config, generation_config=None):
    directory.mkdir()
    backend.save(str(directory / "tokenizer.json"))
    config = {"model_max_length": 4096, "added_tokens_decoder": _added_tokens_decoder(backend), **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    qwen = _train_bpe(QWEN_SPECIALS)
    im_end, endoftext = qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")
    qwen_config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    llama = _train_bpe(LLAMA_SPECIALS, bos="<|begin_of_text|>")
    eot, end = llama.token_to_id("<|eot_id|>"), llama.token_to_id("<|end_of_text|>")
    python_tag = {"content": "<|python_tag|>", "special": True, "normalized": False}
    llama_config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "__type": "AddedToken", "special": True},
        # Neither is in tokenizer.json: transformers adds them on load, so must we.
        "added_tokens_decoder": {**_added_tokens_decoder(llama), str(llama.get_vocab_size()): python_tag},
        "pad_token": "<|finetune_right_pad_id|>",
        # As in Llama 3's config; transformers ignores it for BPE models, whose real spaces it would delete.
        "clean_up_tokenization_spaces": True,
        "chat_template": [
            {"name": "default", "template": LLAMA_TEMPLATE.replace("TOOLS", "")},
            {"name": "tool_use", "template": LLAMA_TEMPLATE.replace("TOOLS", LLAMA_TOOLS)},
        ],
    }
    # A BERT-style WordPiece, where transformers' decode joins spaces before punctuation.
    wordpiece_config = {
        **{f"{name}_token": f"[{name.upper()}]" for name in ("unk", "pad", "cls", "sep")},
        "eos_token": "[SEP]",
        "clean_up_tokenization_spaces": True,
    }
    # A tokenizer.json that pads and truncates, which transformers' encode ignores unless asked.
    base = _train_bpe(QWEN_SPECIALS)
    base.enable_padding(length=64, pad_id=endoftext, pad_token="<|endoftext|>")
    base.enable_truncation(max_length=8)
    qwen_eos = {"eos_token_id": [im_end, endoftext]}
    overridden = {**qwen_config, "chat_template": "{{ 'overridden by the files' }}"}
    dirs = {
        "qwen": _save(root / "qwen", qwen, {**qwen_config, "chat_template": QWEN_TEMPLATE}, qwen_eos),
        "llama": _save(root / "llama", llama, llama_config, {"eos_token_id": [end, eot]}),
        "base": _save(root / "base", base, {"eos_token": "<|endoftext|>"}, {"eos_token_id": endoftext}),
        "wordpiece": _save(root / "wordpiece", _train_wordpiece(), wordpiece_config),
        "files": _save(root / "files", qwen, overridden),
    }
    # Newer checkpoints ship templates as files, which take priority over tokenizer_config.json's.
    (dirs["files"] / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    (dirs["files"] / "additional_chat_templates").mkdir()
    (dirs["files"] / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools | tojson }}")
    return dirs


@pytest.fixture(scope="module")
def pairs(checkpoints):
    """name -> (ours, the transformers reference) for every checkpoint."""
    from transformers import AutoTokenizer

    return {
        name: (HFTokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)) for name, d in checkpoints.items()
    }


STRINGS = [
    "",
    "Hello, world!",
    "  leading,   runs   of   spaces\t\ttabs\n\n\nnewlines  ",
    "unicode: héllo wörld — 日本語 🚀👩‍👩‍👧 never seen: Ωμέγα",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more<think>reasoning</think>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "Don't stop . ? ! , 's 're",
    "call<|python_tag|>f(x)<|finetune_right_pad_id|>",
]


@pytest.mark.parametrize("name", ["qwen", "llama", "base", "wordpiece"])
def test_hf_encode_decode_match_transformers(pairs, name):
    ours, ref = pairs[name]
    for text in STRINGS:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (
                text
            )
    # Ids that cut a multi-byte character decode to U+FFFD in both.
    ids = ref.encode("🚀🎉日本", add_special_tokens=False)
    for cut in range(len(ids)):
        assert ours.decode(ids[cut:]) == ref.decode(ids[cut:])


@pytest.mark.parametrize("name", ["qwen", "llama", "base", "wordpiece"])
def test_hf_special_ids_match_transformers(pairs, name):
    ours, ref = pairs[name]
    assert ours.vocab_size == len(ref)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert ours.special_tokens == {t.content: i for i, t in ref.added_tokens_decoder.items() if t.special}, (
        "special tokens are the checkpoint's"
    )
    assert "<think>" not in ours.special_tokens


def test_hf_pad_token_missing_from_tokenizer_json_is_added(pairs):
    ours, ref = pairs["llama"]
    assert ours.pad_id == ref.pad_token_id == ours.vocab_size - 1
    assert ours.encode("a<|finetune_right_pad_id|>") == ref.encode(
        "a<|finetune_right_pad_id|>", add_special_tokens=False
    )


def test_hf_stop_ids_from_generation_config(pairs):
    qwen, _ = pairs["qwen"]
    im_end, endoftext = qwen.special_tokens["<|im_end|>"], qwen.special_tokens["<|endoftext|>"]
    assert qwen.stop_ids == (im_end, endoftext), "the tokenizer's eos, then generation_config's list"
    llama, _ = pairs["llama"]
    eot, end = llama.special_tokens["<|eot_id|>"], llama.special_tokens["<|end_of_text|>"]
    assert (llama.eos_id, llama.stop_ids) == (eot, (eot, end)), "a list with the eos in it: no duplicate"
    base, _ = pairs["base"]
    assert base.stop_ids == (endoftext,), "an int eos_token_id equal to the tokenizer's eos"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather <now> & "later" in °C, for a city',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "description": "", "parameters": {}}},
    {
        "type": "function",
        "function": {"name": "third", "description": "cut by {% break %}", "parameters": {}},
    },
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief <b>& kind</b>."},
        {"role": "user", "content": "  What's 2+2?  "},
        {"role": "assistant", "content": "4. 🚀"},
        {"role": "user", "content": "And 日本語?"},
    ],
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
        ],
    },
    {"role": "tool", "content": '{"temp": 21, "unit": "°C"}'},
    {"role": "assistant", "content": "21 °C <sunny>."},
]


@pytest.mark.parametrize("name", ["qwen", "llama", "files"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_hf_chat_template_matches_transformers(pairs, name, add_generation_prompt):
    ours, ref = pairs[name]
    for chat in CHATS:
        for tools in (None, TOOLS):
            kw = {"add_generation_prompt": add_generation_prompt, "tools": tools}
            expected = ref.apply_chat_template(chat, tokenize=False, **kw)
            assert ours.apply_chat_template(chat, **kw) == expected
            assert ours.encode_chat(chat, **kw) == ref.apply_chat_template(
                chat, tokenize=True, return_dict=False, **kw
            )


def test_hf_chat_template_tool_calls_and_kwargs_match_transformers(pairs):
    ours, ref = pairs["qwen"]
    for kw in ({}, {"tools": TOOLS}, {"enable_thinking": False}, {"eos_token": "<|endoftext|>"}):
        expected = ref.apply_chat_template(TOOL_CHAT, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.apply_chat_template(TOOL_CHAT, add_generation_prompt=True, **kw) == expected
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in ours.apply_chat_template(
        CHATS[0], tools=TOOLS
    )


# No whitespace control: relies on trim_blocks and lstrip_blocks, as older Hub templates (Zephyr's) do.
PLAIN_TEMPLATE = """\
{% if documents is defined and documents is none %}
[no documents]
{% endif %}
{% for message in messages %}
    {% if message.reasoning_content is defined %}
<think>{{ message.reasoning_content }}</think>
    {% endif %}
<{{ message.role }}>{{ message.content if message.content is defined else '-' }}</{{ message.role }}>
{% endfor %}
{% if add_generation_prompt %}
<assistant>
{% endif %}
"""


def test_hf_chat_template_argument_matches_transformers(pairs):
    ours, ref = pairs["base"]
    # A None content is dropped (the template sees no key), and reasoning under any name reaches the template
    # as reasoning_content, as transformers does it.
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "reasoning": "think first"},
        {"role": "assistant", "content": "ok", "thinking": "then answer"},
    ]
    expected = ref.apply_chat_template(
        chat, chat_template=PLAIN_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(chat, chat_template=PLAIN_TEMPLATE) == expected
    assert expected == (
        "[no documents]\n<user>hi</user>\n<think>think first</think>\n<assistant>-</assistant>\n"
        "<think>then answer</think>\n<assistant>ok</assistant>\n<assistant>\n"
    )


def test_hf_chat_template_files_take_priority(pairs):
    ours, _ = pairs["files"]
    assert set(ours.chat_templates) == {"default", "tool_use"}
    assert ours.chat_templates["default"][1].endswith("chat_template.jinja")
    assert ours.apply_chat_template(CHATS[0], tools=TOOLS[:1]).startswith('[{"type": "function"')


def test_hf_raise_exception_names_the_template(pairs):
    ours, ref = pairs["llama"]
    chat = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]
    with pytest.raises(Exception, match="Conversation roles must be user or assistant, got tool"):
        ref.apply_chat_template(chat, tokenize=False)
    match = (
        r"tokenizer_config.json chat_template 'default': the chat template refused this conversation: "
        r"Conversation roles must be user or assistant, got tool"
    )
    with pytest.raises(ChatTemplateError, match=match):
        ours.apply_chat_template(chat)


def test_hf_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found.*or .byte. for the byte-level"):
        HFTokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer(tmp_path / "nowhere")


def test_hf_missing_chat_template(pairs):
    ours, _ = pairs["base"]
    with pytest.raises(ChatTemplateError, match=r"has no chat template .* Pass one with .*chat_template="):
        ours.apply_chat_template(CHATS[0])
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"
    assert ours.apply_chat_template(CHATS[0], chat_template=template) == "user: Hi there<|endoftext|>"
    with pytest.raises(
        ChatTemplateError, match=r"the chat_template argument: the chat template does not compile"
    ):
        ours.apply_chat_template(CHATS[0], chat_template="{% for m in messages %}")


def test_hf_templates_without_default_need_a_name(tmp_path, checkpoints):
    directory = tmp_path / "named"
    directory.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (directory / file).write_bytes((checkpoints["qwen"] / file).read_bytes())
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "plain.jinja").write_text("{{ messages[0].content }}")
    tok = HFTokenizer.from_dir(directory)
    with pytest.raises(ChatTemplateError, match=r"chat templates \['plain'\] and none is named 'default'"):
        tok.apply_chat_template(CHATS[0])
    assert tok.apply_chat_template(CHATS[0], chat_template="plain") == "Hi there"


def test_hf_special_tokens_map_json(tmp_path, checkpoints):
    from transformers import AutoTokenizer

    # Older checkpoints name their special tokens only in special_tokens_map.json.
    (tmp_path / "tokenizer.json").write_bytes((checkpoints["qwen"] / "tokenizer.json").read_bytes())
    special = {"eos_token": {"content": "<|im_end|>", "lstrip": False}, "pad_token": "<|endoftext|>"}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(special))
    ours, ref = HFTokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    expected = (ref.convert_tokens_to_ids("<|im_end|>"), ref.convert_tokens_to_ids("<|endoftext|>"))
    assert (ours.eos_id, ours.pad_id) == (ref.eos_token_id, ref.pad_token_id) == expected
    assert ours.stop_ids == (ours.eos_id,)


def test_load_tokenizer_checks_the_model_vocab(checkpoints):
    tok = load_tokenizer(checkpoints["qwen"], vocab_size=1024)
    assert isinstance(tok, HFTokenizer)
    with pytest.raises(
        ValueError, match=rf"has ids up to {tok.vocab_size - 1} but the model's vocab_size is 256"
    ):
        load_tokenizer(checkpoints["qwen"], vocab_size=256)
