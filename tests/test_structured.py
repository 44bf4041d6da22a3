"""Structured output (lily.structured): token masks on small grammars checked against brute
force over the vocabulary, and constrained generation on the demo model whose every output
parses and validates (jsonschema), greedy and sampled, on the reference and the simulator.

The generation loop here is the textbook one (mask the logits, sample, advance), so these
tests pin the constraint itself; the engine's own hook is exercised in test_engine /
test_server through the same objects.
"""

from __future__ import annotations

import itertools
import json

import jsonschema
import numpy as np
import pytest

from lily import Engine, InvalidParameterError, parse_chat_output
from lily.errors import ToolError
from lily.sampling import Sampler, SamplingParams
from lily.structured import Grammar

WS = " \t\r\n"

PERSON = {  # nested objects, enums, arrays, numbers, booleans, a pattern
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["merry", "sad", "wroth"]},
        "home": {"type": "object",
                 "properties": {"city": {"enum": ["Verona", "Mantua"]},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["city", "zip"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 1, "maxItems": 3},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "home", "scores", "alive"],
    "additionalProperties": False,
}

# Nothing a Shakespeare model writes on its own: codes, negative numbers, a constant.
NEVER = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "delta": {"type": "integer", "minimum": -9, "maximum": -1},
        "ok": {"const": True},
        "ids": {"type": "array", "items": {"type": "string", "enum": ["x1", "y2"]}, "minItems": 2,
                "maxItems": 2},
    },
    "required": ["code", "delta", "ok", "ids"],
    "additionalProperties": False,
}

WEATHER = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                      "unit": {"enum": ["c", "f"]},
                                      "hourly": {"type": "boolean"}},
                       "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "set_alarm",
        "parameters": {"type": "object",
                       "properties": {"at": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "maxItems": 2}},
                       "required": ["at", "tags"]}}},
]

USER = [{"role": "user", "content": "Who art thou, and whence?"}]


@pytest.fixture(scope="module")
def demo():
    return Engine.load(device="reference", max_context=1024)


def _constraint(engine, grammar, thinking=False):
    return grammar.constraint(engine.tokenizer, vocab_size=engine.config.vocab_size,
                              eos_token_ids=engine.eos_token_ids, thinking=thinking)


_prefilled: dict = {}


def generate(engine, grammar, messages, *, tools=None, thinking=False, forced=(), temperature=0.0,
             seed=0, max_tokens=120):
    """Mask, sample, advance: returns (text, constraint, finish_reason). ``forced`` tokens
    are taken first (each must be allowed by the mask)."""
    kw = {} if thinking else {"enable_thinking": False}
    ids = engine.tokenizer.encode_chat(messages, tools=tools, **kw)
    c = _constraint(engine, grammar, thinking)
    key = (id(engine), tuple(ids))
    if key not in _prefilled:  # each prompt is prefilled once per engine
        engine.reset()
        _prefilled[key] = (engine.prefill(ids), engine.snapshot())
    logits, snap = _prefilled[key]
    engine.restore(snap)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed), ids)
    out: list[int] = []
    forced = list(forced)
    while len(out) < max_tokens:
        mask = c.allowed()
        if forced:
            tok = forced.pop(0)
            assert mask[tok], engine.tokenizer.decode([tok])
        else:
            tok = sampler.sample(np.where(mask, logits, np.float32(-np.inf)))
        if tok in engine.eos_token_ids:
            return engine.tokenizer.decode(out), c, "stop"
        c.advance(tok)
        out.append(tok)
        if c.is_finished():
            return engine.tokenizer.decode(out), c, "stop"
        logits = engine.decode(tok)
    return engine.tokenizer.decode(out), c, "length"


# ----------------------------------------------------------------------------------------
# masks on small grammars, against brute force over the vocabulary
# ----------------------------------------------------------------------------------------


def _expected_mask(tok, answers: list[str]) -> np.ndarray:
    """Tokens whose text keeps the output a prefix of one of ``answers``."""
    mask = np.zeros(tok.vocab_size, dtype=bool)
    for i in range(tok.vocab_size):
        if i in tok.special_token_ids:
            continue
        b = tok.token_bytes(i)
        mask[i] = any(a.startswith(b) for a in answers)
    return mask


def test_mask_of_a_small_grammar_is_exact(demo):
    tok = demo.tokenizer
    g = Grammar.json_schema({"enum": ["yes", "no"]})
    c = _constraint(demo, g)
    words = ['"yes"', '"no"']
    lead = ["".join(p) for k in range(5) for p in itertools.product(WS, repeat=k)]  # 0-4 whitespace
    answers = [(w + a).encode() for w in lead for a in words]
    np.testing.assert_array_equal(c.allowed(), _expected_mask(tok, answers))
    for t in tok.encode('"no"'):
        assert c.allowed()[t] and not c.is_finished()
        c.advance(t)
    assert c.is_finished() and c.is_accepting()
    assert set(np.flatnonzero(c.allowed())) == set(demo.eos_token_ids)  # only the end remains


def test_mask_pads_to_the_model_vocabulary(demo):
    c = Grammar.json_object().constraint(demo.tokenizer, vocab_size=demo.tokenizer.vocab_size + 64)
    m = c.allowed()
    assert m.shape == (demo.tokenizer.vocab_size + 64,) and m.dtype == np.bool_
    assert not m[demo.tokenizer.vocab_size:].any()
    assert m[demo.tokenizer.encode("{")[0]] and not m[min(demo.eos_token_ids)]
    with pytest.raises(InvalidParameterError, match="smaller than the tokenizer"):
        Grammar.json_object().constraint(demo.tokenizer, vocab_size=10)


def test_thinking_is_free_until_the_closing_tag(demo):
    tok = demo.tokenizer
    g = Grammar.json_schema({"enum": ["yes", "no"]})
    plain = _constraint(demo, g).allowed()
    c = _constraint(demo, g, thinking=True)
    m = c.allowed()
    close = tok.token_to_id("</think>")
    def whole_text(i):  # not special, whole UTF-8 characters (a lone continuation byte cannot start)
        try:
            return i not in tok.special_token_ids and bool(tok.token_bytes(i).decode("utf-8"))
        except UnicodeDecodeError:
            return False
    text_tokens = np.array([whole_text(i) for i in range(tok.vocab_size)])
    assert m[close] and (m[:tok.vocab_size] | ~text_tokens).all()  # every text token, and </think>
    assert not any(m[e] for e in demo.eos_token_ids)  # no end before the answer
    assert not m[tok.token_to_id("<tool_call>")]
    for t in tok.encode("Hmm, a \"yes\" or } maybe.\n"):
        c.advance(t)
        assert c.allowed()[close] and not c.is_accepting()
    c.advance(close)
    np.testing.assert_array_equal(c.allowed(), plain)  # then exactly the answer's grammar


def test_tool_call_mask_follows_the_template_syntax(demo):
    tok = demo.tokenizer
    c = _constraint(demo, Grammar.tool_calls(WEATHER, "get_weather"))
    m = c.allowed()
    assert m[tok.token_to_id("<tool_call>")] and not any(m[e] for e in demo.eos_token_ids)
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    for t in tok.encode(call):
        assert c.allowed()[t], tok.decode([t])
        c.advance(t)
    assert c.is_finished()
    msg = parse_chat_output(call, tools=WEATHER)
    assert [(k.name, k.arguments) for k in msg.tool_calls] == [("get_weather", {"city": "Paris", "days": 3})]

    def first_refused(text):
        c = _constraint(demo, Grammar.tool_calls(WEATHER, "get_weather"))
        for t in tok.encode(text):
            if not c.allowed()[t]:
                return tok.decode([t])
            c.advance(t)
        return None
    assert first_refused("<tool_call>\n<function=set_alarm>") is not None  # not the named one
    assert first_refused(call.replace("<parameter=city>", "<parameter=town>")) is not None
    assert first_refused(call.replace("\n3\n", "\n9\n")) is not None  # days <= 7
    assert first_refused(call.replace("<parameter=city>\nParis\n</parameter>\n", "")) is not None  # required


@pytest.mark.parametrize("schema, needle", [
    ({"type": "strng"}, "strng"),
    ({"type": "object", "required": "a"}, "required"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "string", "format": "shoe-size"}, "shoe-size"),
    ({"$ref": "#/$defs/Missing"}, "Missing"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be an object"),
])
def test_invalid_schemas_are_refused_with_the_reason(schema, needle):
    with pytest.raises(InvalidParameterError, match="JSON schema") as e:
        Grammar.json_schema(schema)
    assert needle in str(e.value) and "\n" not in str(e.value) and "%json" not in str(e.value)


def test_invalid_tool_choices_are_refused():
    with pytest.raises(InvalidParameterError, match="not in tools: 'nope'"):
        Grammar.tool_calls(WEATHER, "nope")
    with pytest.raises(InvalidParameterError, match="at least one tool"):
        Grammar.tool_calls([])
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}}}}}
    for tools in ([bad], [*WEATHER, bad]):  # the culprit is named, wherever it stands
        with pytest.raises(ToolError) as e:
            Grammar.tool_calls(tools)
        assert (e.value.index, e.value.name, e.value.field) == (len(tools) - 1, "f", "parameters")
        assert e.value.reason.endswith("cannot be enforced: parameter 'n': Unsatisfiable schema: minimum (3) is "
                                       "greater than maximum (1)")
    Grammar.tool_calls([*WEATHER, bad], WEATHER[0]["function"]["name"])  # only the named tool is compiled


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    import lzma
    import shutil
    from pathlib import Path

    from lily.tokenizer import Tokenizer
    src = Path(__file__).resolve().parent / "data" / "qwen3.5-moe-tokenizer"
    d = tmp_path_factory.mktemp("qwen-tok")
    with lzma.open(src / "tokenizer.json.xz") as fin, open(d / "tokenizer.json", "wb") as fout:
        shutil.copyfileobj(fin, fout)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, d / name)
    return Tokenizer.from_dir(d)


def test_real_qwen_tokenizer_thinking_then_tool_call(qwen_tokenizer):
    """The Qwen3.5/3.6 vocabulary: </think> and <tool_call> are single special tokens; the
    model's logits are padded past the tokenizer (248320 vs 248077)."""
    tok = qwen_tokenizer
    c = Grammar.tool_calls(WEATHER).constraint(tok, vocab_size=248320, thinking=True)
    reply = ("The user wants weather. I'll call it.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\n東京 🌸\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
             "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
             "<function=set_alarm>\n<parameter=at>\n07:30\n</parameter>\n<parameter=tags>\n"
             "[\"wake\"]\n</parameter>\n</function>\n</tool_call>")
    ids = tok.encode(reply)
    assert tok.token_to_id("</think>") in ids and tok.token_to_id("<tool_call>") in ids
    for t in ids:
        m = c.allowed()
        assert m.shape == (248320,) and not m[tok.vocab_size:].any()
        assert m[t], tok.decode([t])
        c.advance(t)
    m = c.allowed()
    assert c.is_accepting() and m[min(tok.eos_token_ids)]  # another call or the end
    msg = parse_chat_output(reply, reasoning=True, tools=WEATHER)
    assert msg.reasoning.startswith("The user wants") and msg.content == ""
    assert [k.arguments for k in msg.tool_calls] == [{"city": "東京 🌸", "days": 2, "unit": "c"},
                                                    {"at": "07:30", "tags": ["wake"]}]


# ----------------------------------------------------------------------------------------
# constrained generation on the demo model: every output parses and validates
# ----------------------------------------------------------------------------------------


def _valid_json(text, schema):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_the_model_would_never_write_it_unconstrained(demo):
    r = demo.chat(USER, max_tokens=30, temperature=0, chat_template_kwargs={"enable_thinking": False})
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        _valid_json(r.content, NEVER)


@pytest.mark.parametrize("schema, temperature, seed", [(PERSON, 0.0, 0), (PERSON, 1.2, 2), (NEVER, 0.9, 1)],
                         ids=["person-greedy", "person-hot", "never-sampled"])
def test_json_schema_outputs_validate(demo, schema, temperature, seed):
    text, c, finish = generate(demo, Grammar.json_schema(schema), USER, temperature=temperature,
                               seed=seed, max_tokens=160)
    assert finish == "stop" and c.is_accepting(), text
    _valid_json(text, schema)


@pytest.mark.parametrize("name, temperature, seed", [(None, 0.0, 0), ("set_alarm", 0.9, 4)])
def test_forced_tool_calls_validate(demo, name, temperature, seed):
    # one call: the demo model, left free to add calls, adds them until max_tokens
    text, c, finish = generate(demo, Grammar.tool_calls(WEATHER, name, parallel=False), USER, tools=WEATHER,
                               temperature=temperature, seed=seed, max_tokens=200)
    assert finish == "stop" and c.is_accepting(), text
    msg = parse_chat_output(text, tools=WEATHER)
    assert msg.tool_calls and msg.content == "", text
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    for call in msg.tool_calls:
        assert name is None or call.name == name
        jsonschema.validate(call.arguments, schemas[call.name])


def test_thinking_then_json(demo):
    """The thinking block is left alone (here a scripted one: the demo model never closes
    it), then the answer follows the schema."""
    forced = demo.tokenizer.encode("Let me see; a code, then numbers.\n</think>\n\n")
    text, _, finish = generate(demo, Grammar.json_schema(NEVER), USER, thinking=True, forced=forced,
                               temperature=0.7, seed=6, max_tokens=200)
    assert finish == "stop", text
    msg = parse_chat_output(text, reasoning=True)
    assert msg.reasoning == "Let me see; a code, then numbers."
    _valid_json(msg.content, NEVER)


@pytest.mark.slow
def test_sim_device_output_validates():
    """The same constraint on the simulator's logits (host-side masking)."""
    engine = Engine.load(device="sim", max_context=256)
    schema = {"type": "object", "properties": {"m": {"enum": ["merry", "sad"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["m", "n"], "additionalProperties": False}
    text, _, finish = generate(engine, Grammar.json_schema(schema), USER, temperature=0.8, seed=2,
                               max_tokens=30)
    assert finish == "stop"
    _valid_json(text, schema)


def test_grammar_for_request_maps_the_api_options(demo):
    from lily.structured import grammar_for_request
    assert grammar_for_request() is None and grammar_for_request(format={"type": "text"}) is None
    assert grammar_for_request(format={"type": "json_object"}).kind == "json_object"
    g = grammar_for_request(format={"type": "json_schema", "json_schema": {"name": "p", "schema": NEVER,
                                                                            "strict": True}})
    assert g.kind == "json_schema"
    assert grammar_for_request(format={"type": "json_object"}, tool_choice="required",
                               tools=WEATHER).kind == "tool_calls"  # the forced call wins
    for bad, needle in [({"type": "yaml"}, "response_format.type"),
                        ({"type": "json_schema"}, "json_schema must be an object"),
                        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is missing"),
                        ({"type": "json_schema", "json_schema": {"schema": {"type": 7}}}, "invalid JSON schema")]:
        with pytest.raises(InvalidParameterError, match=needle):
            grammar_for_request(format=bad)
    with pytest.raises(InvalidParameterError, match="not in tools"):
        grammar_for_request(tool_choice="nope", tools=WEATHER)


def test_for_prompt_detects_an_open_thinking_block(demo):
    g = Grammar.json_schema({"enum": ["yes", "no"]})
    close = demo.tokenizer.token_to_id("</think>")
    thinking = g.for_prompt(demo, demo.tokenizer.encode_chat(USER))
    plain = g.for_prompt(demo, demo.tokenizer.encode_chat(USER, enable_thinking=False))
    assert thinking.allowed()[close] and not plain.allowed()[close]
    assert plain.allowed().shape == (demo.config.vocab_size,)


# ----------------------------------------------------------------------------------------
# through the engine's decoding-constraint hook
# ----------------------------------------------------------------------------------------


def test_engine_chat_takes_a_grammar(demo):
    """``constraint=`` a Grammar: the engine binds it to the prompt (thinking detected)."""
    schema = {"type": "object", "properties": {"m": {"enum": ["merry", "sad"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["m", "n"], "additionalProperties": False}
    r = demo.chat(USER, constraint=Grammar.json_schema(schema), max_tokens=40, temperature=0.8, seed=3,
                  chat_template_kwargs={"enable_thinking": False})
    assert r.finish_reason == "stop"
    _valid_json(r.content, schema)
    # room for the whole call: engine.chat() leaves out a call that max_tokens cuts off
    r = demo.chat(USER, tools=WEATHER, constraint=Grammar.tool_calls(WEATHER, "get_weather", parallel=False),
                  max_tokens=200, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert r.finish_reason == "stop"
    (call,) = r.tool_calls
    jsonschema.validate(call.arguments, WEATHER[0]["function"]["parameters"])


def test_native_host_handoff_counters():
    """What a constraint costs on a native device, counted on the simulator: an
    unconstrained generation never copies logits to the host (the device picks each token
    and hands it to the next step); a constrained one copies ``vocab_size`` float32 logits
    once per generated token (one host round trip each)."""
    engine = Engine.load(device="sim", max_context=256)
    copies: list[int] = []
    forward = engine.backend.forward

    def counting(tokens, *, all_logits=False):
        out = forward(tokens, all_logits=all_logits)
        copies.append(out.nbytes)
        return out
    engine.backend.forward = counting
    kw = {"max_tokens": 6, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    free = engine.chat(USER, **kw)
    assert free.completion_tokens == 6 and copies == []
    g = Grammar.json_schema({"type": "array", "items": {"enum": ["merry", "sad"]}})
    bound = engine.chat(USER, constraint=g, **kw)
    assert bound.completion_tokens == len(copies) > 0
    assert set(copies) == {4 * engine.config.vocab_size}
