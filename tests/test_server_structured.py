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
    engine = Engine.load(max_context=2048)
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
