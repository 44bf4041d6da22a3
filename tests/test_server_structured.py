"""Structured output through the HTTP APIs on the demo model: OpenAI chat completions
``response_format`` (json_object, json_schema; the ``openai`` client's ``parse`` helper),
``tool_choice`` required and named; every reply validates against its schema (jsonschema),
streaming and not; invalid schemas are a 400 in the API's error shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient

from lily import Engine
from lily.server import create_app

pytestmark = pytest.mark.timeout(600)

NO_THINK = {"enable_thinking": False}
MOOD = {"type": "object",
        "properties": {"mood": {"enum": ["merry", "sad", "wroth"]},
                       "n": {"type": "integer", "minimum": -9, "maximum": -1},
                       "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}},
        "required": ["mood", "n", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}]
USER = [{"role": "user", "content": "Speak, friend."}]


@pytest.fixture(scope="module")
def client():
    engine = Engine.load(device="reference", max_context=2048)  # the grammar is the point, not the device
    with TestClient(create_app(engine, model_name="demo")) as c:
        yield c


def chat(client, **body):
    body = {"model": "demo", "messages": USER, "max_tokens": 120, "chat_template_kwargs": NO_THINK, **body}
    return client.post("/v1/chat/completions", json=body)


def test_json_schema_response_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "mood", "schema": MOOD, "strict": True}}
    r = chat(client, response_format=fmt, temperature=0.9, seed=3)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), MOOD)


def test_json_schema_streamed_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "mood", "schema": MOOD}}
    text = ""
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": "demo", "messages": USER, "max_tokens": 120, "stream": True,
                             "chat_template_kwargs": NO_THINK, "response_format": fmt, "seed": 1,
                             "temperature": 1.0}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["delta"].get("content") or ""
    jsonschema.validate(json.loads(text), MOOD)


def test_openai_client_parse_helper(client):
    """``client.chat.completions.parse`` with a pydantic model: strict json_schema."""
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal

    class Verdict(pydantic.BaseModel):
        guilty: bool
        plea: Literal["mercy", "justice"]

    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    r = oc.chat.completions.parse(model="demo", messages=USER, response_format=Verdict, max_tokens=60,
                                  temperature=0, extra_body={"chat_template_kwargs": NO_THINK})
    assert isinstance(r.choices[0].message.parsed, Verdict), r.choices[0].message.content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_validates(client, tool_choice):
    r = chat(client, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, temperature=0.8, seed=2,
             max_tokens=80)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "strng"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3,
                                                                       "maximum": 1}}}, "minimum"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is missing"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_invalid_format_is_a_400_in_openai_shape(client, fmt, needle):
    r = chat(client, response_format=fmt)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == "response_format" and err["type"] == "invalid_request_error"
    assert_short(err["message"])


def assert_short(message: str) -> None:
    """An error message with the reason alone: one line, no listing of the generated grammar."""
    assert "\n" not in message and "%json" not in message and "x-guidance" not in message, message


def test_anthropic_forced_tool_use_validates(client):
    anthropic = pytest.importorskip("anthropic")
    ac = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=client)
    tool = {"name": "get_weather", "description": "Weather for a city",
            "input_schema": TOOLS[0]["function"]["parameters"]}
    # Sampled unseeded, so max_tokens must hold the calls a draw can make: 56 tokens besides the
    # city (days included), the city's 10 characters as literal UTF-8 at most 40 byte tokens, up
    # to 4 of leading whitespace and the end of turn make at most 101 (58..63 seen in 400 draws;
    # \u escapes, if the grammar admits them, could be longer: not seen); 80 left a
    # 10-character non-ASCII city short of its end (a 'max_tokens' stop).
    for choice in ({"type": "any", "disable_parallel_tool_use": True},):  # "tool": the OpenAI test's named case
        m = ac.messages.create(model="demo", max_tokens=128, messages=USER, tools=[tool], tool_choice=choice,
                               thinking={"type": "disabled"}, extra_body={"temperature": 0.7})
        assert m.stop_reason == "tool_use", m
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "get_weather"
        jsonschema.validate(use.input, tool["input_schema"])
    bad = dict(tool, input_schema={"type": "object", "properties": {"d": {"type": "integer", "minimum": 5,
                                                                           "maximum": 1}}})
    r = client.post("/v1/messages", json={"model": "demo", "max_tokens": 8, "messages": USER, "tools": [bad],
                                          "tool_choice": {"type": "any"}})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "minimum" in r.json()["error"]["message"]


def test_responses_text_format_validates(client):
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    if not hasattr(oc, "responses"):
        pytest.skip("this openai client has no Responses API")
    r = oc.responses.create(model="demo", input="Speak, friend.", max_output_tokens=120, temperature=0.9,
                            reasoning={"effort": "none"},
                            text={"format": {"type": "json_schema", "name": "mood", "schema": MOOD, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), MOOD)
    bad = client.post("/v1/responses", json={"model": "demo", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "m", "schema": {"type": "strng"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format", bad.text


# ----------------------------------------------------------------------------------------
# invalid tool definitions: a 400 in the API's own shape before anything is generated
# ----------------------------------------------------------------------------------------

BAD_SCHEMAS = [  # (parameters, what the message must name)
    ({"type": "nonsense"}, "'nonsense' is not valid"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": "3"}}}, "properties/n/minimum"),
    ({"type": "object", "required": "city"}, "'city' is not of type 'array'"),
]


@pytest.fixture
def no_generation(client, monkeypatch):
    """Fails a test whose request reaches the generation queue."""
    queued = []
    monkeypatch.setattr(client.app.state.lily, "submit", lambda *a, **kw: queued.append(a) or 1 / 0)
    yield
    assert not queued, "a refused request was queued for generation"


def _fn(name="get_weather", parameters=None):
    return {"type": "function", "function": {"name": name, "description": "d",
                                             "parameters": {} if parameters is None else parameters}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("params, needle", BAD_SCHEMAS)
def test_chat_invalid_tool_schema_is_a_400(client, no_generation, params, needle, stream):
    # the bad tool is second, and tool_choice "auto" builds no grammar: only the check refuses it
    r = chat(client, tools=[TOOLS[0], _fn("lookup", params)], stream=stream)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["param"] == "tools.1.function.parameters" and err["type"] == "invalid_request_error"
    assert "'lookup'" in err["message"] and needle in err["message"], err


@pytest.mark.parametrize("name", ["", "get.weather", "get weather", "x" * 65, "<tool>"])
def test_chat_invalid_tool_name_is_a_400(client, no_generation, name):
    r = chat(client, tools=[_fn(name)], tool_choice="none")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools.0.function.name" and "letters, digits, underscores or dashes" in err["message"]
    assert repr(name) in err["message"]


def test_chat_valid_tool_edge_cases_are_accepted(client):
    """What the check must not refuse: a 64-character name with dashes, no parameters, a
    pattern Python's re cannot compile (ECMA's \\p{L}), an older draft named by $schema."""
    ok = [_fn("a-" + "b" * 62), {"type": "function", "function": {"name": "bare"}},
          _fn("word", {"type": "object", "properties": {"w": {"type": "string", "pattern": "^\\p{L}+$"}}}),
          _fn("old", {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                      "properties": {"a": {"type": "string"}}, "dependencies": {"a": ["b"]}})]
    r = chat(client, tools=ok, max_tokens=2)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_invalid_tool_is_a_400_in_anthropic_shape(client, no_generation, stream):
    good = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    body = {"model": "demo", "max_tokens": 8, "messages": USER, "stream": stream}
    for tools, needle in [([good, {"name": "lookup", "input_schema": {"type": "nonsense"}}],
                           "tools.1.input_schema (tool 'lookup'): invalid JSON schema"),
                          ([{"name": "look.up", "input_schema": {"type": "object"}}], "tools.0.name: tool name 'look.up'")]:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = client.post(path, json={**body, "tools": tools})
            assert r.status_code == 400, r.text
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
            assert needle in r.json()["error"]["message"], r.text


def test_responses_invalid_tool_is_a_400(client, no_generation):
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "required": "city"}}
    r = client.post("/v1/responses", json={"model": "demo", "input": "x", "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.parameters", r.text
    r = client.post("/v1/responses", json={"model": "demo", "input": "x", "tools": [dict(tool, parameters=[1])]})
    assert r.status_code == 400 and "must be an object" in r.json()["error"]["message"], r.text


# ----------------------------------------------------------------------------------------
# forced tool calls whose (valid) schema cannot be enforced: a 400 naming the tool
# ----------------------------------------------------------------------------------------

UNENFORCEABLE = [  # (the tool's properties, what the reason must say): each passes the metaschema
    ({"d": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum (5) is greater than maximum (1)"),
    ({"u": {"type": "string", "pattern": "(?<=a)b"}}, "look-around"),
    ({"u": {"type": "string", "enum": [1, 2]}}, "enum has no string value"),
    ({"u": {"$ref": "#/$defs/Missing"}}, "unresolvable $ref"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("props, needle", UNENFORCEABLE)
def test_chat_forced_unenforceable_tool_is_a_400_naming_it(client, no_generation, props, needle, named, stream):
    choice = {"type": "function", "function": {"name": "lookup"}} if named else "required"
    r = chat(client, tools=[TOOLS[0], _fn("lookup", {"type": "object", "properties": props})], tool_choice=choice,
             stream=stream)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["param"] == "tools.1.function.parameters" and err["type"] == "invalid_request_error", err
    assert err["message"].startswith("tools.1.function.parameters (tool 'lookup'): ") and needle in err["message"]
    assert f"parameter {next(iter(props))!r}: " in err["message"]  # the parameter at fault
    assert_short(err["message"])


def test_chat_named_tool_ignores_an_unenforceable_other_tool(client):
    """Only the forced tool's schema becomes a grammar: naming a good tool next to an
    unenforceable one is served."""
    bad = _fn("lookup", {"type": "object", "properties": UNENFORCEABLE[0][0]})
    r = chat(client, tools=[TOOLS[0], bad], tool_choice={"type": "function", "function": {"name": "get_weather"}},
             max_tokens=2)
    assert r.status_code == 200, r.text


def test_responses_forced_unenforceable_tool_is_a_400_naming_it(client, no_generation):
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": UNENFORCEABLE[0][0]}}
    for choice in ("required", {"type": "function", "name": "lookup"}):
        r = client.post("/v1/responses", json={"model": "demo", "input": "x", "tools": [tool], "tool_choice": choice})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools.0.parameters" and "(tool 'lookup')" in err["message"], err
        assert UNENFORCEABLE[0][1] in err["message"]
        assert_short(err["message"])
    fmt = {"type": "json_schema", "name": "m", "schema": UNENFORCEABLE[0][0]["d"]}
    r = client.post("/v1/responses", json={"model": "demo", "input": "x", "text": {"format": fmt}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert UNENFORCEABLE[0][1] in r.json()["error"]["message"]
    assert_short(r.json()["error"]["message"])


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_forced_unenforceable_tool_is_a_400_naming_it(client, no_generation, stream):
    good = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    bad = {"name": "lookup", "input_schema": {"type": "object", "properties": UNENFORCEABLE[1][0]}}
    for choice in ({"type": "any"}, {"type": "tool", "name": "lookup"}):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = client.post(path, json={"model": "demo", "max_tokens": 8, "messages": USER, "stream": stream,
                                        "tools": [good, bad], "tool_choice": choice})
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and UNENFORCEABLE[1][1] in err["message"], err
            assert err["message"].startswith("tools.1.input_schema (tool 'lookup'): ")
            assert_short(err["message"])


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_duplicate_tool_names_are_a_400_in_every_api(client, no_generation, choice):
    """Two tools of one name: which schema a call of it follows would be a guess."""
    r = chat(client, tools=[TOOLS[0], _fn("lookup"), _fn("get_weather")], tool_choice=choice)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.2.function.name", r.text
    assert "'get_weather' is already used by tools.0.function.name" in r.json()["error"]["message"]
    tool = {"type": "function", "name": "f"}
    r = client.post("/v1/responses", json={"model": "demo", "input": "x", "tools": [tool, tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.1.name", r.text
    body = {"model": "demo", "max_tokens": 8, "messages": USER, "tools": [{"name": "f", "input_schema": {}}] * 2}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "tools.1.name: tool name 'f' is already used by tools.0.name" \
            in r.json()["error"]["message"], r.text


def test_a_forced_tool_without_a_name_is_a_clear_400(client, no_generation):
    for choice in ({"type": "function"}, {"type": "function", "function": {}}):
        r = chat(client, tools=TOOLS, tool_choice=choice)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function.name", r.text
        assert "is missing" in r.json()["error"]["message"]
    tool = {"type": "function", "name": "f"}
    for choice, param in [({"type": "function"}, "tool_choice.name"), ({"type": "web_search"}, "tool_choice.type")]:
        r = client.post("/v1/responses", json={"model": "demo", "input": "x", "tools": [tool], "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/v1/messages", json={"model": "demo", "max_tokens": 8, "messages": USER, "tool_choice": {"type": "tool"},
                                          "tools": [{"name": "f", "input_schema": {}}]})
    assert r.status_code == 400 and "tool_choice.name is missing" in r.json()["error"]["message"], r.text


def test_anthropic_server_tools_are_left_out_and_a_tool_without_schema_is_a_400(client, no_generation):
    """Server tools (web search, ...), which Lily does not run, are left out of the prompt
    (issue 29: not refused); a custom tool without input_schema is a 400."""
    body = {"model": "demo", "messages": USER}
    plain = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    r = client.post("/v1/messages/count_tokens", json={**body, "tools": [{"type": "web_search_20250305",
                                                                          "name": "web_search"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] == plain, r.text
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = client.post(path, json={**body, "max_tokens": 8, "tools": [{"name": "f"}]})
        assert r.status_code == 400 and "tools.0.input_schema: required" in r.json()["error"]["message"], r.text


# ----------------------------------------------------------------------------------------
# look-around in a pattern: llguidance's regular expressions have none; the 400 says so and
# names the pattern and where it is
# ----------------------------------------------------------------------------------------

LOOKAROUND = ["^(?=a)a+$", "(?<!x)y", "a(?!b)", "x(?<=x)"]


def assert_names_lookaround(message: str, pattern: str, where: str) -> None:
    assert f"{where}: the pattern {json.dumps(pattern)} at properties.code.pattern uses look-around" in message, message
    assert "not supported" in message and "regex parse error" not in message, message
    assert "(?s:.*)" not in message, message  # our wrapping of an unanchored pattern is not shown
    assert_short(message)


@pytest.mark.parametrize("pattern", LOOKAROUND)
def test_lookaround_pattern_in_a_format_is_a_clear_400(client, no_generation, pattern):
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}}
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format", err
    assert_names_lookaround(err["message"], pattern, "JSON schema cannot be enforced")
    r = client.post("/v1/responses", json={"model": "demo", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "m", "schema": schema}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert_names_lookaround(r.json()["error"]["message"], pattern, "JSON schema cannot be enforced")


@pytest.mark.parametrize("pattern", LOOKAROUND)
def test_lookaround_pattern_in_a_forced_tool_is_a_clear_400(client, no_generation, pattern):
    props = {"code": {"type": "string", "pattern": pattern}}
    r = chat(client, tools=[_fn("lookup", {"type": "object", "properties": props})], tool_choice="required")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools.0.function.parameters" and "(tool 'lookup')" in err["message"], err
    assert_names_lookaround(err["message"], pattern, "parameter 'code'")
    tool = {"name": "lookup", "input_schema": {"type": "object", "properties": props}}
    r = client.post("/v1/messages", json={"model": "demo", "max_tokens": 8, "messages": USER, "tools": [tool],
                                          "tool_choice": {"type": "any"}})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert_names_lookaround(r.json()["error"]["message"], pattern, "parameter 'code'")


def test_lookalikes_of_lookaround_are_served(client):
    """Escaped parentheses and character classes are not look-around: such patterns compile."""
    schema = {"type": "string", "pattern": "^\\(\\?=[(?=]$", "maxLength": 5}
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
             max_tokens=8)
    assert r.status_code == 200, r.text
