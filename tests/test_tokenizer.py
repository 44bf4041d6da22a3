"""Tests for lily.tokenizer: ids, decoding, token bytes, chat template, detokenizer, errors.

References are transformers' tokenizers: ``PreTrainedTokenizerFast(tokenizer_file=...)`` for
the real Qwen3.5 tokenizer fixture (``tests/data/qwen3.5-moe-tokenizer``, unpacked once per
session) and ``AutoTokenizer`` for the demo checkpoint's small tokenizer.
"""

from __future__ import annotations

import json
import lzma
import random
import shutil
import time
from pathlib import Path

import pytest

from lily.errors import TokenizerError
from lily.tokenizer import IncrementalDetokenizer, Tokenizer, _compile_template

TESTS = Path(__file__).resolve().parent
QWEN_FIXTURE = TESTS / "data" / "qwen3.5-moe-tokenizer"
DEMO_DIR = TESTS.parent / "src" / "lily" / "demo_model"

# --------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.5 tokenizer fixture with ``tokenizer.json`` unpacked, in a session temp dir."""
    out = tmp_path_factory.mktemp("qwen3.5-tokenizer")
    with (
        lzma.open(QWEN_FIXTURE / "tokenizer.json.xz") as src,
        open(out / "tokenizer.json", "wb") as dst,
    ):
        shutil.copyfileobj(src, dst)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QWEN_FIXTURE / name, out / name)
    return out


@pytest.fixture(scope="session")
def qwen(qwen_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(qwen_dir)


@pytest.fixture(scope="session")
def demo() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_DIR)


@pytest.fixture(scope="session")
def hf_qwen(qwen_dir: Path):
    """transformers' fast tokenizer on the fixture's tokenizer.json, exactly as written.

    (``AutoTokenizer`` on this directory would build a ``Qwen2Tokenizer``, which swaps in the
    Qwen2 pre-tokenisation regex; the fixture's own regex is the verified one.)
    """
    transformers = pytest.importorskip("transformers")
    config = json.loads((qwen_dir / "tokenizer_config.json").read_text())
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(qwen_dir / "tokenizer.json"),
        eos_token=config["eos_token"],
        pad_token=config["pad_token"],
        chat_template=(qwen_dir / "chat_template.jinja").read_text(encoding="utf-8"),
    )


@pytest.fixture(scope="session")
def hf_demo():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))


def _copy_demo(dest: Path, *, template: bool = True, config: dict | None = None) -> Path:
    """A tokenizer directory made from the demo model's files, optionally altered."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEMO_DIR / "tokenizer.json", dest / "tokenizer.json")
    cfg = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    if config is not None:
        cfg.update(config)
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    if template:
        shutil.copy(DEMO_DIR / "chat_template.jinja", dest / "chat_template.jinja")
    return dest


# --------------------------------------------------------------------------------------
# test strings
# --------------------------------------------------------------------------------------

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. I'm sure you'LL see it's fine; we'd've known.",
    "Numbers: 3.14159, 1,000,000 and 2026-11-29T17:44:37Z; 0x7fff_ffff.",
    "   leading and trailing   ",
    "tabs\tand\t\tnewlines\n\n\nand\r\nwindows\r\n line  endings \n",
    "  \n \n\t  \u3000 \u00a0 x",
    "日本語のテキストを分割します。中文也可以。한국어 문장입니다.",
    "Emoji: 🎉🔥 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 🏳️‍🌈 ❤️",
    "Combining: e\u0301 a\u0308\u0323 x\u0301\u0302y Ω\u0304\u0327 Z\u0335\u0336",
    "Devanagari नमस्ते दुनिया, Thai ภาษาไทย, Arabic مرحبا بالعالم, Hebrew שלום",
    "Кириллица: Съешь же ещё этих мягких французских булок.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>",
    "<|endoftext|><|endoftext|>text<|im_end|>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    '<tool_response>\n{"temp": 21.5, "unit": "°C"}\n</tool_response>',
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "Mixed: café naïve Straße — “quotes” ‘single’ … €100 ½ ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚",
    "<|im_start|> not special without the right spelling: <|im_start <im_end|>",
    "\ufffd already a replacement char and a lone \u200b zero width",
]


def _random_unicode_texts(count: int, seed: int = 1234) -> list[str]:
    """Seeded strings dense in multi-byte characters (CJK, emoji, marks, symbols)."""
    rng = random.Random(seed)
    pools = [
        (0x4E00, 0x9FFF),  # CJK
        (0x1F300, 0x1F64F),  # emoji
        (0x1F900, 0x1F9FF),
        (0x0300, 0x036F),  # combining marks
        (0x0900, 0x097F),  # Devanagari
        (0xAC00, 0xD7A3),  # Hangul
        (0x0400, 0x04FF),  # Cyrillic
        (0x2000, 0x206F),  # punctuation incl. ZWJ
        (0x10330, 0x1034A),  # Gothic (4-byte)
        (0x20, 0x7E),  # ASCII
    ]
    texts = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randrange(1, 40)):
            lo, hi = rng.choice(pools)
            chars.append(chr(rng.randrange(lo, hi + 1)))
        texts.append("".join(chars))
    return texts


# --------------------------------------------------------------------------------------
# vocabulary and special tokens
# --------------------------------------------------------------------------------------


def test_qwen_vocabulary_and_specials(qwen: Tokenizer, hf_qwen) -> None:
    assert qwen.vocab_size == 248077 == len(hf_qwen)
    assert qwen.eos_token_ids == frozenset({248046})
    assert qwen.pad_token_id == 248044
    assert qwen.special_token_ids == frozenset(range(248044, 248077))
    assert qwen.token_to_id("<|im_start|>") == 248045
    assert qwen.token_to_id("<think>") == 248068
    assert qwen.token_to_id("no such token at all") is None
    assert qwen.id_to_token(248046) == "<|im_end|>"
    assert qwen.id_to_token(-1) is None
    assert qwen.id_to_token(qwen.vocab_size) is None
    for i in (0, 220, 1814, 100_000, 248043):
        assert qwen.token_to_id(qwen.id_to_token(i)) == i
    assert qwen.has_chat_template
    assert qwen.special_tokens_map == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_demo_vocabulary_and_specials(demo: Tokenizer, hf_demo) -> None:
    assert demo.vocab_size == 8192 == len(hf_demo)
    assert demo.token_to_id("<|endoftext|>") == 8166
    assert demo.token_to_id("<|im_start|>") == 8167
    assert demo.token_to_id("<|im_end|>") == 8168
    assert demo.eos_token_ids == frozenset({8168})
    assert demo.pad_token_id == 8166
    assert set(range(8166, 8192)) <= demo.special_token_ids
    assert demo.has_chat_template


# --------------------------------------------------------------------------------------
# encode / decode against transformers
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["qwen", "demo"])
def test_encode_matches_transformers(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    hf = request.getfixturevalue(f"hf_{which}")
    for text in TEXTS + _random_unicode_texts(60):
        expected = hf.encode(text, add_special_tokens=False)
        assert tok.encode(text) == expected, text
        assert tok.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)


def test_special_tokens_in_text_are_single_ids(qwen: Tokenizer) -> None:
    assert qwen.encode("<|im_start|>") == [248045]
    ids = qwen.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 248045 and ids[-1] == 248046
    assert qwen.encode("<tool_call></tool_call>") == [248058, 248059]


def test_encode_rejects_non_str(qwen: Tokenizer) -> None:
    with pytest.raises(TypeError):
        qwen.encode(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("which", ["qwen", "demo"])
def test_decode_matches_transformers(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    hf = request.getfixturevalue(f"hf_{which}")
    for text in TEXTS + _random_unicode_texts(30, seed=7):
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)


def test_decode_round_trip_and_errors(qwen: Tokenizer) -> None:
    text = "<|im_start|>assistant\n日本 🎉<|im_end|>"
    ids = qwen.encode(text)
    assert qwen.decode(ids) == text
    assert qwen.decode(tuple(ids)) == text
    assert qwen.decode(ids, skip_special_tokens=True) == "assistant\n日本 🎉"
    with pytest.raises(TokenizerError, match="out of range"):
        qwen.decode([1, qwen.vocab_size])
    with pytest.raises(TokenizerError, match="out of range"):
        qwen.decode([-1])


# --------------------------------------------------------------------------------------
# token bytes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["qwen", "demo"])
def test_token_bytes_concatenate_to_decode(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    partial = 0
    for text in TEXTS + _random_unicode_texts(40, seed=3):
        ids = tok.encode(text)
        pieces = [tok.token_bytes(i) for i in ids]
        assert b"".join(pieces).decode("utf-8", "replace") == tok.decode(ids)
        for piece in pieces:
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError:
                partial += 1
    assert partial > 0  # some tokens really hold part of a character


def test_token_bytes_values(qwen: Tokenizer) -> None:
    assert qwen.token_bytes(qwen.token_to_id("Ġworld")) == b" world"
    assert qwen.token_bytes(qwen.token_to_id("Ċ")) == b"\n"
    assert qwen.token_bytes(248046) == b"<|im_end|>"
    assert qwen.token_bytes(248046) is qwen.token_bytes(248046)  # cached
    single_bytes = {
        qwen.token_bytes(i) for i in range(qwen.vocab_size) if len(qwen.token_bytes(i)) == 1
    }
    assert single_bytes == {bytes([b]) for b in range(256)}  # every byte has a token
    for bad in (-1, qwen.vocab_size, 10**12):
        with pytest.raises(TokenizerError):
            qwen.token_bytes(bad)


# --------------------------------------------------------------------------------------
# incremental detokenizer
# --------------------------------------------------------------------------------------


def _stream(
    tok: Tokenizer, ids: list[int], **kwargs
) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = tok.detokenizer(**kwargs)
    chunks = [detok.add(i) for i in ids]
    tail = detok.flush()
    return chunks, tail, detok


@pytest.mark.parametrize("which", ["qwen", "demo"])
def test_detokenizer_matches_decode(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    held_back = 0
    for text in TEXTS + _random_unicode_texts(150, seed=11):
        ids = tok.encode(text)
        chunks, tail, detok = _stream(tok, ids)
        assert "".join(chunks) + tail == tok.decode(ids), text
        assert detok.text == tok.decode(ids)
        assert tail == ""
        held_back += chunks.count("")
        if "\ufffd" not in text:
            assert not any("\ufffd" in c for c in chunks), text
        for chunk in chunks:
            chunk.encode("utf-8")  # a whole string of whole characters

        skipped, tail, _ = _stream(tok, ids, skip_special_tokens=True)
        assert "".join(skipped) + tail == tok.decode(ids, skip_special_tokens=True)
    assert held_back > 0  # characters really did span tokens


def test_detokenizer_holds_back_split_character(demo: Tokenizer) -> None:
    byte_ids = {
        demo.token_bytes(i)[0]: i for i in range(demo.vocab_size) if len(demo.token_bytes(i)) == 1
    }
    ids = [byte_ids[b] for b in "🎉".encode()]  # four single-byte tokens
    detok = demo.detokenizer()
    assert [detok.add(i) for i in ids[:3]] == ["", "", ""]
    assert detok.pending_bytes == "🎉".encode()[:3]
    assert detok.text == ""
    assert detok.add(ids[3]) == "🎉"
    assert detok.pending_bytes == b""
    assert detok.flush() == ""
    assert detok.text == "🎉"


def test_detokenizer_invalid_and_truncated_bytes(demo: Tokenizer) -> None:
    byte_ids = {
        demo.token_bytes(i)[0]: i for i in range(demo.vocab_size) if len(demo.token_bytes(i)) == 1
    }
    # a lead byte followed by ASCII can never complete: replaced, like decode()
    ids = [byte_ids[0xE6], byte_ids[ord("a")], byte_ids[0xFF], byte_ids[ord("b")]]
    chunks, tail, _ = _stream(demo, ids)
    assert "".join(chunks) + tail == demo.decode(ids) == "\ufffda\ufffdb"
    # a character cut off at the end comes out of flush() as U+FFFD
    ids = [byte_ids[b] for b in "日".encode()[:2]]
    chunks, tail, detok = _stream(demo, ids)
    assert chunks == ["", ""]
    assert tail == "\ufffd" == demo.decode(ids)
    assert detok.text == "\ufffd"


def test_detokenizer_is_linear(qwen: Tokenizer) -> None:
    ids = qwen.encode("日本語のテキスト 🎉 and some English words. " * 3000)
    assert len(ids) > 30_000
    detok = qwen.detokenizer()
    start = time.perf_counter()
    for i in ids:
        detok.add(i)
    detok.flush()
    elapsed = time.perf_counter() - start
    assert detok.text == qwen.decode(ids)
    assert elapsed < 3.0, f"{len(ids)} tokens took {elapsed:.2f}s"


# --------------------------------------------------------------------------------------
# chat template against transformers
# --------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city — returns °C by default.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich or 東京"},
                "units": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}

CHAT_CASES: dict[str, dict] = {
    "plain_multi_turn": dict(
        messages=[
            {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke about 🐍."},
        ]
    ),
    "system_prompt": dict(
        messages=[
            {"role": "system", "content": "  You are a helpful assistant.\n"},
            {"role": "user", "content": "What is 2+2?"},
        ]
    ),
    "no_generation_prompt": dict(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ],
        add_generation_prompt=False,
    ),
    "thinking_disabled": dict(
        messages=[{"role": "user", "content": "日本の首都は？"}],
        enable_thinking=False,
    ),
    "thinking_enabled_explicitly": dict(
        messages=[{"role": "user", "content": "Why is the sky blue?"}],
        enable_thinking=True,
    ),
    "tools_with_calls_and_responses": dict(
        messages=[
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "Weather in Paris and Tokyo? Also search for news."},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I should call the weather tool twice.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris", "units": "c"},
                        },
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "東京"}},
                    },
                    {
                        "type": "function",
                        "function": {
                            "name": "search",
                            "arguments": {
                                "query": "news",
                                "limit": 3,
                                "filters": {"lang": ["en", "fr"]},
                            },
                        },
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18, "unit": "°C"}'},
            {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 24}'},
            {"role": "tool", "content": "[]"},
        ],
        tools=[WEATHER_TOOL, SEARCH_TOOL],
    ),
    "tools_full_round_then_followup": dict(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "sunny, 21"},
            {
                "role": "assistant",
                "content": "It is sunny and 21 °C.",
                "reasoning_content": "Easy.",
            },
            {"role": "user", "content": "Thanks!"},
        ],
        tools=[WEATHER_TOOL],
        enable_thinking=False,
    ),
    "tools_with_system_prompt_no_history": dict(
        messages=[
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Search for 'lily engine'."},
        ],
        tools=[SEARCH_TOOL],
    ),
    "reasoning_content_in_history": dict(
        messages=[
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": "First answer", "reasoning_content": "first thoughts"},
            {"role": "user", "content": "Second question"},
            {
                "role": "assistant",
                "content": "Second answer",
                "reasoning_content": "\nsecond thoughts\n",
            },
        ],
        add_generation_prompt=False,
    ),
    "reasoning_alias_and_think_in_content": dict(
        messages=[
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\ninline thoughts\n</think>\n\nA1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning": "aliased thoughts"},
        ],
        add_generation_prompt=False,
    ),
    "content_parts": dict(
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "System part."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Part one. "},
                    {"type": "text", "text": "Part two."},
                ],
            },
        ]
    ),
}


def _chat_kwargs(case: dict) -> tuple[list[dict], dict]:
    case = dict(case)
    messages = case.pop("messages")
    return messages, case


@pytest.mark.parametrize("name", sorted(CHAT_CASES))
@pytest.mark.parametrize("which", ["qwen", "demo"])
def test_chat_template_matches_transformers(
    name: str, which: str, request: pytest.FixtureRequest
) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    hf = request.getfixturevalue(f"hf_{which}")
    messages, kwargs = _chat_kwargs(CHAT_CASES[name])
    hf_kwargs = {"add_generation_prompt": True, **kwargs}
    expected = hf.apply_chat_template(messages, tokenize=False, **hf_kwargs)
    rendered = tok.apply_chat_template(messages, **kwargs)
    assert rendered == expected
    assert tok.encode_chat(messages, **kwargs) == hf.encode(expected, add_special_tokens=False)


def test_chat_template_shapes(qwen: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert qwen.apply_chat_template(messages).endswith("<|im_start|>assistant\n<think>\n")
    assert qwen.apply_chat_template(messages, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert qwen.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    ids = qwen.encode_chat(messages)
    assert ids[0] == 248045 and ids[-2:] == [248068, 198]


def test_chat_template_does_not_modify_messages(qwen: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "thinking": "t", "tool_calls": None},
        {"role": "user", "content": "q2"},
    ]
    snapshot = json.dumps(messages)
    qwen.apply_chat_template(messages)
    assert json.dumps(messages) == snapshot


CUSTOM_TEMPLATE = """\
{{- bos_token }}
{%- set ns = namespace(count=0, seen=[]) %}
{%- for m in messages %}
    {%- if m.role == 'skip' %}{% continue %}{% endif %}
    {%- if loop.index > 4 %}{% break %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
    <{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>
{% endfor %}
{%- if tools %}
{{ tools | tojson }}
{{ tools | tojson(indent=2) }}
{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}
{{ tools | tojson(ensure_ascii=true) }}
{%- endif %}
{%- set d = dict(a=1, b='<&>') %}
{{ d | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }} count={{ ns.count }}
{{ "%s" | format(strftime_now("%Y") | length) }}
    {% if messages | length > 2 %}
  block lines keep their own indent
    {% endif %}
{% generation %}{{ custom_var | default('no custom') }}{% endgeneration %}
{{- eos_token if add_generation_prompt else pad_token }}
"""


@pytest.fixture(scope="session")
def custom_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = _copy_demo(
        tmp_path_factory.mktemp("custom"), template=False, config={"bos_token": "<|endoftext|>"}
    )
    (out / "chat_template.jinja").write_text(CUSTOM_TEMPLATE, encoding="utf-8")
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"add_generation_prompt": False},
        {"tools": [WEATHER_TOOL, SEARCH_TOOL], "custom_var": "ünïcode <b>"},
        {"eos_token": "OVERRIDDEN"},
    ],
)
def test_custom_template_features_match_transformers(custom_dir: Path, kwargs: dict) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(custom_dir))
    tok = Tokenizer.from_dir(custom_dir)
    messages = [
        {"role": "system", "content": "  sys  "},
        {"role": "skip", "content": "hidden"},
        {"role": "user", "content": 'naïve <tag> & "quotes"'},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "never rendered"},
    ]
    full = {"add_generation_prompt": True, **kwargs}
    expected = hf.apply_chat_template(messages, tokenize=False, **full)
    assert tok.apply_chat_template(messages, **kwargs) == expected
    assert expected.startswith("<|endoftext|>")


def test_compiled_template_is_cached(qwen: Tokenizer, qwen_dir: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    qwen.apply_chat_template(messages)
    hits = _compile_template.cache_info().hits
    qwen.apply_chat_template(messages)
    Tokenizer.from_dir(DEMO_DIR).apply_chat_template(messages)  # same template text
    assert _compile_template.cache_info().hits >= hits + 2


# --------------------------------------------------------------------------------------
# template sources
# --------------------------------------------------------------------------------------


def test_jinja_file_wins_over_config_field(tmp_path: Path) -> None:
    directory = _copy_demo(
        tmp_path / "both", config={"chat_template": "CONFIG {{ messages[0].content }}"}
    )
    tok = Tokenizer.from_dir(directory)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]).startswith(
        "<|im_start|>user\nx"
    )


def test_config_field_template(tmp_path: Path) -> None:
    directory = _copy_demo(
        tmp_path / "field",
        template=False,
        config={"chat_template": "CONFIG {{ messages[0].content }}"},
    )
    tok = Tokenizer.from_dir(directory)
    assert tok.has_chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "CONFIG x"


def test_named_templates_in_config(tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": "DEFAULT"},
        {"name": "tool_use", "template": "TOOLS {{ tools | length }}"},
    ]
    tok = Tokenizer.from_dir(
        _copy_demo(tmp_path / "named", template=False, config={"chat_template": named})
    )
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "DEFAULT"
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL]) == "TOOLS 1"


def test_no_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_copy_demo(tmp_path / "none", template=False))
    assert not tok.has_chat_template
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert tok.encode("plain text still works") == Tokenizer.from_dir(DEMO_DIR).encode(
        "plain text still works"
    )


def test_missing_tokenizer_config_is_tolerated(tmp_path: Path) -> None:
    directory = tmp_path / "bare"
    directory.mkdir()
    shutil.copy(DEMO_DIR / "tokenizer.json", directory / "tokenizer.json")
    tok = Tokenizer.from_dir(directory)
    assert tok.eos_token_ids == frozenset()
    assert tok.pad_token_id is None
    assert not tok.has_chat_template


def test_eos_as_added_token_dict_and_special_tokens_map(tmp_path: Path) -> None:
    directory = _copy_demo(
        tmp_path / "dict",
        config={"eos_token": {"content": "<|endoftext|>", "lstrip": False}, "pad_token": None},
    )
    (directory / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|im_end|>"}))
    tok = Tokenizer.from_dir(directory)
    assert tok.eos_token_ids == frozenset({8166})
    assert tok.pad_token_id is None  # the config's explicit null wins over the map


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    directory = _copy_demo(tmp_path / "missing")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(directory)


def test_corrupt_tokenizer_json(tmp_path: Path) -> None:
    directory = _copy_demo(tmp_path / "corrupt")
    (directory / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(directory)


def test_corrupt_tokenizer_config(tmp_path: Path) -> None:
    directory = _copy_demo(tmp_path / "badcfg")
    (directory / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(directory)


def test_unknown_eos_token(tmp_path: Path) -> None:
    directory = _copy_demo(tmp_path / "badeos", config={"eos_token": "<|not_a_token|>"})
    with pytest.raises(TokenizerError, match="eos_token"):
        Tokenizer.from_dir(directory)


def test_template_syntax_error_names_file(tmp_path: Path) -> None:
    directory = _copy_demo(tmp_path / "syntax")
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja.*syntax error"):
        Tokenizer.from_dir(directory)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "No messages provided."),
        ([{"role": "assistant", "content": "only me"}], "No user query found in messages."),
        (
            [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}],
            "System message must be at the beginning.",
        ),
        (
            [{"role": "wizard", "content": "x"}, {"role": "user", "content": "u"}],
            "Unexpected message role.",
        ),
        ([{"role": "user", "content": 42}], "Unexpected content type."),
    ],
)
def test_template_raise_exception(demo: Tokenizer, messages: list, message: str) -> None:
    with pytest.raises(TokenizerError) as info:
        demo.apply_chat_template(messages)
    assert message in str(info.value)


def test_template_runtime_errors_and_sandbox(tmp_path: Path) -> None:
    cases = {
        "type": "{{ messages[0].content + 1 }}",
        "sandbox": "{{ ''.__class__.__mro__ }}",
        "mutation": "{% set xs = [] %}{{ xs.append(1) }}",
        "namespace": "{% set ns = namespace(_secret=1) %}{{ ns }}",
    }
    for name, source in cases.items():
        directory = _copy_demo(tmp_path / name, template=False)
        (directory / "chat_template.jinja").write_text(source)
        tok = Tokenizer.from_dir(directory)
        with pytest.raises(TokenizerError):
            tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_messages_and_tools(demo: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="messages"):
        demo.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match=r"messages\[1\]"):
        demo.apply_chat_template([{"role": "user", "content": "x"}, "oops"])  # type: ignore[list-item]
    with pytest.raises(TokenizerError, match=r"tools\[0\]"):
        demo.apply_chat_template([{"role": "user", "content": "x"}], tools=["not a dict"])  # type: ignore[list-item]


def test_tool_call_arguments_as_json_string_render_like_a_dict(qwen):
    from lily.errors import TokenizerError
    tok = qwen
    def conv(args):
        return [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "content": "sunny"}]
    want = tok.apply_chat_template(conv({"city": "Oslo", "days": 2}))
    assert tok.apply_chat_template(conv('{"city": "Oslo", "days": 2}')) == want
    assert "<parameter=city>" in want
    for bad, match in (("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")):
        with pytest.raises(TokenizerError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: .*" + match):
            tok.apply_chat_template(conv(bad))
