"""Tests for the Anthropic Messages API (``/v1/messages``), the OpenAI Responses API
(``/v1/responses``) and model-name handling, driven with the official ``anthropic`` and
``openai`` clients against a loopback server.

Most tests use ``ForcedEngine`` (tests/test_server.py): the engine's real generation loop
forced through a scripted reply with reasoning and a tool call, which the demo model never
writes; a few run the embedded demo model end to end.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from lily.engine import Engine
from lily.server import create_app
from test_server import SCRIPT, ForcedEngine, Server, wait_idle

pytestmark = pytest.mark.timeout(120)

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"}}}
A_TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER_SCHEMA}]
R_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast",
            "parameters": WEATHER_SCHEMA}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ARGS = {"city": "Paris", "days": 3, "code": "x = \"<b>\" if a < b else '</parameter>'"}


class Recording(ForcedEngine):
    """``ForcedEngine`` that also keeps every token prefilled since :meth:`reset`
    (``prompt``: the whole prompt of the next request after a reset)."""

    seen: list[int] = []

    def reset(self) -> None:
        super().reset()
        self.seen = []

    def _on_prefill(self, tokens, all_logits: bool):
        self.seen = self.seen + [int(t) for t in tokens]
        return super()._on_prefill(tokens, all_logits)

    @property
    def prompt(self) -> str:
        return self.tokenizer.decode(self.seen)


@pytest.fixture(scope="module")
def engine():
    return Recording.load(max_context=4096)


@pytest.fixture(scope="module")
def srv(engine):
    s = Server(create_app(engine, model_name="forced", max_stored_responses=4))
    yield s
    s.stop()


def aclient(srv: Server, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=srv.base, max_retries=0, timeout=60, **kw)


def _sse_events(text: str) -> list[tuple[str, dict]]:
    """``(event name, data)`` pairs of an SSE body (comments skipped); the name must agree
    with the data's ``type``."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = [ln for ln in chunk.split("\n") if not ln.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        out.append((name, data))
    return out


def _blocks(message) -> list[tuple]:
    """A Message's content without the per-call ids."""
    out = []
    for b in message.content:
        if b.type == "thinking":
            out.append(("thinking", b.thinking))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            assert b.type == "tool_use" and b.id.startswith("toolu_")
            out.append(("tool_use", b.name, b.input))
    return out


# ----------------------------------------------------------------------------------------
# Anthropic Messages
# ----------------------------------------------------------------------------------------


def test_messages_tool_use_both_modes(srv, engine):
    engine.set_script(SCRIPT)
    c = aclient(srv)
    kw = dict(model="claude-anything", max_tokens=300, messages=ASK, tools=A_TOOLS)
    m = c.messages.create(**kw)
    want = [("thinking", "I should look up the weather."), ("text", "Let me check."),
            ("tool_use", "get_weather", ARGS)]
    assert _blocks(m) == want
    assert m.stop_reason == "tool_use" and m.stop_sequence is None and m.model == "forced"
    assert m.usage.output_tokens == len(engine.script_ids)
    assert m.usage.cache_read_input_tokens == 0 and m.usage.input_tokens > 0
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == want and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.input_tokens == m.usage.input_tokens
    count = c.messages.count_tokens(model="any", messages=ASK, tools=A_TOOLS)
    assert count.input_tokens == m.usage.input_tokens


def test_messages_stream_event_sequence(srv, engine):
    engine.set_script(SCRIPT)
    body = {"model": "m", "max_tokens": 300, "messages": ASK, "tools": A_TOOLS, "stream": True}
    r = httpx.post(srv.base + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "ping" in names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    # blocks: start, deltas of the block's own kind, stop; one block open at a time
    open_index, kinds, partial = None, [], {}
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(kinds)
            open_index = data["index"]
            kinds.append(data["content_block"]["type"])
        elif name == "content_block_delta":
            assert data["index"] == open_index
            want = {"thinking": "thinking_delta", "text": "text_delta", "tool_use": "input_json_delta"}
            assert data["delta"]["type"] == want[kinds[-1]]
            if kinds[-1] == "tool_use":
                partial[open_index] = partial.get(open_index, "") + data["delta"]["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None and kinds == ["thinking", "text", "tool_use"]
    assert json.loads(partial[2]) == ARGS
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(engine.script_ids)


def test_messages_tool_result_round_trip(srv, engine):
    """The assistant's thinking + tool_use and the user's tool_result go back through the
    chat template; the next reply is plain text."""
    engine.set_script("</think>It is sunny in Paris.")
    c = aclient(srv)
    history = ASK + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]}]
    engine.reset()  # the whole prompt is prefilled (and recorded)
    m = c.messages.create(model="m", max_tokens=100, system=[{"type": "text", "text": "Be brief."}],
                          messages=history, tools=A_TOOLS)
    assert _blocks(m) == [("text", "It is sunny in Paris.")] and m.stop_reason == "end_turn"
    prompt = engine.prompt
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "Be brief." in system and "get_weather" in system
    assert "<think>\nNeed the tool.\n</think>" in prompt
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    # text after the tool results in the same user turn comes after them
    history[-1]["content"].append({"type": "text", "text": "Thanks!"})
    engine.reset()
    c.messages.create(model="m", max_tokens=100, messages=history, tools=A_TOOLS)
    assert engine.prompt.index("<tool_response>") < engine.prompt.rindex("Thanks!")


def test_messages_thinking_stop_sequences_and_max_tokens(srv, engine):
    c = aclient(srv)
    engine.set_script("Hello there. STOP and more")
    engine.reset()  # the whole prompt is prefilled (and recorded)
    m = c.messages.create(model="m", max_tokens=50, messages=ASK, thinking={"type": "disabled"},
                          stop_sequences=["NEVER", "STOP"])
    assert engine.prompt.endswith("<think>\n\n</think>\n\n")  # enable_thinking=false
    assert _blocks(m) == [("text", "Hello there. ")]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    engine.set_script("Hello there, a long answer")
    m = c.messages.create(model="m", max_tokens=2, messages=ASK, thinking={"type": "disabled"})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    engine.set_script("Hello.")
    m = c.messages.create(model="m", max_tokens=20, messages=ASK, thinking={"type": "disabled"},
                          stop_sequences=["zzz"])
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    # thinking left on: the reasoning comes back as a thinking block
    engine.set_script("Let me think.</think>Hi!")
    with c.messages.stream(model="m", max_tokens=50, messages=ASK) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert _blocks(final) == [("thinking", "Let me think."), ("text", "Hi!")]
    assert "thinking_delta" in kinds and "text_delta" in kinds


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


def test_messages_errors_have_anthropic_shape(srv, engine):
    engine.set_script("ok")
    url = srv.base + "/v1/messages"
    ok = {"model": "m", "max_tokens": 10, "messages": ASK}
    for bad in ({"max_tokens": None}, {"max_tokens": "10"}, {"max_tokens": 0}, {"messages": []},
                {"messages": [{"role": "system", "content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                {"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
                {"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
                {"tool_choice": {"type": "any"}}, {"tool_choice": {"type": "sometimes"}},
                {"thinking": {"type": "maybe"}}, {"temperature": -1}, {"top_k": 1 << 40},
                {"stream": "yes"}, {"system": [{"type": "image"}]},
                {"messages": [{"role": "user", "content": "word " * 5000}]}):
        body = {k: v for k, v in {**ok, **bad}.items() if v is not None}
        _anthropic_error(httpx.post(url, json=body), 400, "invalid_request_error")
    _anthropic_error(httpx.post(url, content=b"{broken", headers={"content-type": "application/json"}),
                     400, "invalid_request_error")
    raw = b'{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"Hi \\ud83d"}]}'
    _anthropic_error(httpx.post(url, content=raw, headers={"content-type": "application/json"}),
                     400, "invalid_request_error")
    _anthropic_error(httpx.post(url + "/count_tokens", json={"model": "m", "messages": []}),
                     400, "invalid_request_error")
    _anthropic_error(httpx.post(url + "/nothing"), 404, "not_found_error")
    _anthropic_error(httpx.get(url), 405, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        aclient(srv).messages.create(model="m", max_tokens=0, messages=ASK)
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_messages_auth_queue_and_strict_model(engine):
    engine.set_script("word " * 100, delay=0.05)
    s = Server(create_app(engine, model_name="forced", api_key="k", max_queue=0, max_batch=1, strict_model_name=True))
    try:
        url = s.base + "/v1/messages"
        body = {"model": "forced", "max_tokens": 50, "messages": ASK, "stream": True}
        msg = _anthropic_error(httpx.post(url, json=body), 401, "authentication_error")
        assert "'x-api-key: <key>' or 'Authorization: Bearer <key>'" in msg  # what the gate takes
        with pytest.raises(anthropic.AuthenticationError):
            aclient(s, api_key="wrong").messages.create(model="forced", max_tokens=5, messages=ASK)
        for headers in ({"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            _anthropic_error(httpx.post(url + "/count_tokens", json=body, headers=headers), 401,
                             "authentication_error")
        # both headers work here as on every /v1/ path; OpenAI's message names Bearer first
        r = httpx.post(url + "/count_tokens", json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200, r.text
        r = httpx.post(s.base + "/v1/chat/completions", json={"messages": ASK}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "'Authorization: Bearer <key>' or 'x-api-key: <key>'" in r.json()["error"]["message"]
        with pytest.raises(anthropic.NotFoundError) as e:  # --strict-model-name
            aclient(s, api_key="k").messages.create(model="claude-x", max_tokens=5, messages=ASK)
        assert e.value.body["error"]["type"] == "not_found_error"
        with httpx.stream("POST", url, json=body, headers={"x-api-key": "k"}, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: dropping it unread closes the connection (httpx)
            next(lines)
            r2 = httpx.post(url, json=body, headers={"x-api-key": "k"})
            _anthropic_error(r2, 429, "rate_limit_error")
            assert int(r2.headers["retry-after"]) >= 1  # the scheduler's estimate, whole seconds
        wait_idle(s)
    finally:
        s.stop()


def test_messages_engine_failure_mid_stream(srv, engine):
    engine.set_script("</think>" + "word " * 20)
    engine.fail_at, engine.fail_exc = 3, RuntimeError("device lost")
    body = {"model": "m", "max_tokens": 50, "messages": ASK, "stream": True}
    r = httpx.post(srv.base + "/v1/messages", json=body, timeout=60)
    events = _sse_events(r.text)
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
    assert "device lost" in events[-1][1]["error"]["message"]
    engine.set_script("</think>" + "word " * 20)
    engine.fail_at, engine.fail_exc = 3, RuntimeError("device lost")
    r = httpx.post(srv.base + "/v1/messages", json=dict(body, stream=False), timeout=60)
    _anthropic_error(r, 500, "api_error")


# ----------------------------------------------------------------------------------------
# OpenAI Responses
# ----------------------------------------------------------------------------------------


def oclient(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def _items(resp) -> list[tuple]:
    out = []
    for item in resp.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            assert item.type == "function_call" and item.call_id.startswith("call_")
            out.append(("function_call", item.name, json.loads(item.arguments)))
    return out


def test_responses_function_call_both_modes(srv, engine):
    engine.set_script(SCRIPT)
    c = oclient(srv)
    resp = c.responses.create(model="gpt-4o-mini", input="Weather in Paris?", tools=R_TOOLS)
    want = [("reasoning", "I should look up the weather."), ("message", "Let me check."),
            ("function_call", "get_weather", ARGS)]
    assert _items(resp) == want and resp.status == "completed" and resp.model == "forced"
    assert resp.output_text == "Let me check."
    u = resp.usage
    assert u.output_tokens == len(engine.script_ids) and u.input_tokens_details.cached_tokens == 0
    assert 0 < u.output_tokens_details.reasoning_tokens < u.output_tokens
    assert u.total_tokens == u.input_tokens + u.output_tokens
    events = list(c.responses.create(model="gpt-4o-mini", input="Weather in Paris?", tools=R_TOOLS,
                                     stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    names = [e.type for e in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    for needed in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                   "response.reasoning_text.delta", "response.function_call_arguments.delta",
                   "response.output_text.done", "response.function_call_arguments.done",
                   "response.content_part.done", "response.output_item.done"):
        assert needed in names, needed
    final = events[-1].response
    assert _items(final) == want and final.usage.output_tokens == u.output_tokens
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == "Let me check." and json.loads(args) == ARGS
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in done] == [i.id for i in final.output]


def test_responses_previous_response_id_round_trip(srv, engine):
    engine.set_script(SCRIPT)
    c = oclient(srv)
    first = c.responses.create(model="m", instructions="Be brief.", input="Weather in Paris?", tools=R_TOOLS)
    call = first.output[-1]
    engine.set_script("</think>Sunny, 20 degrees.")
    engine.reset()  # the whole prompt is prefilled (and recorded)
    second = c.responses.create(model="m", previous_response_id=first.id, tools=R_TOOLS,
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": "sunny, 20C"}])
    assert second.output_text == "Sunny, 20 degrees." and second.previous_response_id == first.id
    prompt = engine.prompt
    assert "Be brief." not in prompt  # instructions are not carried over (as OpenAI)
    assert "Weather in Paris?" in prompt and "<function=get_weather>" in prompt
    assert "<think>\nI should look up the weather.\n</think>" in prompt
    assert "<tool_response>\nsunny, 20C\n</tool_response>" in prompt
    assert c.responses.retrieve(second.id).output_text == "Sunny, 20 degrees."
    # store=false: not kept; unknown ids are a 404 in OpenAI's shape
    engine.set_script("</think>ok")
    unstored = c.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="m", input="again", previous_response_id=unstored.id)
    err = e.value.body
    assert err["code"] == "previous_response_not_found" and err["param"] == "previous_response_id"
    # the store is bounded (4 here): the oldest response is dropped first
    for _ in range(4):
        c.responses.create(model="m", input="fill")
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


def test_responses_input_items_and_options(srv, engine):
    c = oclient(srv)
    engine.set_script("A long answer that goes on")
    engine.reset()
    resp = c.responses.create(model="m", max_output_tokens=3, reasoning={"effort": "none"}, input=[
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"role": "user", "content": "Again"}])
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3
    prompt = engine.prompt
    assert "<|im_start|>system\nAnswer in French." in prompt and "Bonjour" in prompt
    assert prompt.endswith("<think>\n\n</think>\n\n")  # effort none: thinking off


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_responses_errors_have_openai_shape(srv, engine):
    engine.set_script("ok")
    url = srv.base + "/v1/responses"
    for bad in ({}, {"input": 5}, {"input": [{"type": "image_generation_call"}]},
                {"input": [{"role": "wizard", "content": "x"}]},
                {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]},
                {"input": [{"type": "function_call_output", "output": "x"}]},
                {"input": "hi", "tools": [{"type": "function"}]},
                {"input": "hi", "tool_choice": "required"}, {"input": "hi", "max_output_tokens": 0},
                {"input": "hi", "max_output_tokens": "5"}, {"input": "hi", "stream": 1},
                {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strng"}}}},
                {"input": []},
                {"input": "word " * 5000}):
        _openai_error(httpx.post(url, json=bad), 400)
    _openai_error(httpx.post(url, content=b"[1,", headers={"content-type": "application/json"}), 400)
    _openai_error(httpx.post(url, content=b'{"input":"Hi \\ud83d"}', headers={"content-type": "application/json"}),
                  400)
    assert _openai_error(httpx.get(url + "/resp_nope"), 404)["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError):
        oclient(srv).responses.create(model="m", input=[{"role": "user", "content": [{"type": "input_file"}]}])


@pytest.mark.parametrize("path, extra, param, needle", [
    ("/v1/responses", {"text": {"format": "json"}}, "text.format", "must be an object"),
    ("/v1/responses", {"text": {"format": {"type": "yaml"}}}, "text.format.type", "got 'yaml'"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "missing"),
    ("/v1/responses", {"max_output_tokens": 2**40}, "max_output_tokens", "in [1, 2147483647]"),
    ("/v1/responses", {"parallel_tool_calls": "no"}, "parallel_tool_calls", "valid boolean"),
    ("/v1/chat/completions", {"parallel_tool_calls": "no"}, "parallel_tool_calls", "valid boolean"),
])
def test_request_fields_are_named_as_the_api_spells_them(srv, engine, path, extra, param, needle):
    """Each API's errors name its own fields (not another API's response_format or max_tokens),
    and a field of the wrong type is a 400, not silently taken."""
    engine.set_script("ok")
    body = {"input": "hi"} if path == "/v1/responses" else {"messages": ASK}
    err = _openai_error(httpx.post(srv.base + path, json={**body, **extra}), 400)
    assert err["param"] == param and needle in err["message"], err
    assert "response_format" not in err["message"] and "max_tokens" not in err["message"], err


def test_malformed_bodies_say_what_is_wrong(srv, engine):
    engine.set_script("ok")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                 "/v1/messages/count_tokens"):
        for body in (b"[1, 2]", b'"x"', b"7", b"null"):
            r = httpx.post(srv.base + path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "the request body must be a JSON object" in r.text, (path, body, r.text)
    # the stop list is named, not echoed (17 strings of 1000 characters)
    err = _openai_error(httpx.post(srv.base + "/v1/chat/completions", json={"messages": ASK, "stop": ["x" * 1000] * 17}), 400)
    assert err["param"] == "stop" and "at most 16 stop strings" in err["message"] and len(err["message"]) < 200, err
    err = _openai_error(httpx.post(srv.base + "/v1/completions", json={"prompt": "x", "stop": ["y" * 1000, ""]}), 400)
    assert err["param"] == "stop" and "stop string 1" in err["message"] and len(err["message"]) < 200, err


def test_responses_echo_parallel_tool_calls(srv, engine):
    engine.set_script("ok")
    for sent in (None, False, True):
        extra = {} if sent is None else {"parallel_tool_calls": sent}
        r = httpx.post(srv.base + "/v1/responses", json={"input": "hi", **extra})
        assert r.status_code == 200 and r.json()["parallel_tool_calls"] is (sent is not False), r.text


# ----------------------------------------------------------------------------------------
# model names
# ----------------------------------------------------------------------------------------


def test_any_model_name_unless_strict(srv, engine):
    engine.set_script("</think>ok")
    c = oclient(srv)
    r = c.chat.completions.create(model="gpt-4o-mini", messages=ASK)
    assert r.choices[0].message.content == "ok" and r.model == "forced"
    assert c.completions.create(model="text-davinci", prompt="x", max_tokens=2).model == "forced"
    with pytest.raises(openai.NotFoundError):  # looking up another model is still a 404
        c.models.retrieve("gpt-4o-mini")
    strict = Server(create_app(engine, model_name="forced", strict_model_name=True))
    try:
        sc = oclient(strict)
        with pytest.raises(openai.NotFoundError) as e:
            sc.chat.completions.create(model="gpt-nope", messages=ASK)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        with pytest.raises(openai.NotFoundError):
            sc.completions.create(model="gpt-nope", prompt="x")
        with pytest.raises(openai.NotFoundError):
            sc.responses.create(model="gpt-nope", input="x")
        assert sc.chat.completions.create(model="forced", messages=ASK).choices[0].message.content == "ok"
    finally:
        strict.stop()


# ----------------------------------------------------------------------------------------
# the demo model end to end
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    s = Server(create_app(Engine.load(device="reference")))  # the APIs are the point, not the device
    yield s
    s.stop()


def test_demo_model_through_both_new_apis(real):
    a = aclient(real)
    # the current anthropic client sends sampling fields only as extra body fields
    kw = dict(model="lily-demo-shakespeare", max_tokens=8, extra_body={"temperature": 0.0}, messages=[
        {"role": "user", "content": "ROMEO:"}])
    m = a.messages.create(**kw)
    with a.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(m) and m.stop_reason in ("max_tokens", "end_turn")
    assert m.usage.output_tokens <= 8 and final.usage.output_tokens == m.usage.output_tokens
    # the same prompt again: the engine's prompt cache serves its prefix
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total
    # a streamed reply's message_start already has the cache split its message_delta reports
    body = {"model": "m", "max_tokens": 8, "temperature": 0.0, "stream": True,
            "messages": [{"role": "user", "content": "ROMEO:"}]}
    events = _sse_events(httpx.post(real.base + "/v1/messages", json=body, timeout=60).text)
    start, delta = events[0][1]["message"]["usage"], events[-2][1]["usage"]
    split = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert events[0][0] == "message_start" and start["cache_read_input_tokens"] > 0, events[0]
    assert {k: start[k] for k in split} == {k: delta[k] for k in split}, (start, delta)
    o = oclient(real)
    r = o.responses.create(model="lily-demo-shakespeare", input="ROMEO:", max_output_tokens=8, temperature=0.0)
    events = list(o.responses.create(model="x", input="ROMEO:", max_output_tokens=8, temperature=0.0,
                                     stream=True))
    assert _items(events[-1].response) == _items(r) and r.usage.output_tokens <= 8
    assert events[-1].type in ("response.completed", "response.incomplete")
    cached = events[-1].response.usage.input_tokens_details.cached_tokens
    assert 0 < cached < events[-1].response.usage.input_tokens


def test_logit_bias_steers_the_demo_model(real, engine):
    """OpenAI's logit_bias reaches the sampler: +100 on a token makes greedy decoding emit it
    at every step (both endpoints); -100 on the unbiased first token changes the text."""
    tok = engine.tokenizer.encode(" the")[0]  # the demo's tokenizer (the scripted engine's too)
    base = {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0.0}
    url = real.base + "/v1/completions"
    forced = httpx.post(url, json={**base, "logit_bias": {str(tok): 100}}).json()["choices"][0]["text"]
    assert forced == engine.tokenizer.decode([tok] * 4)
    r = httpx.post(real.base + "/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 3, "temperature": 0.0, "logit_bias": {str(tok): 100},
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    plain = httpx.post(url, json={**base, "logprobs": 1}).json()["choices"][0]
    first = engine.tokenizer.encode(plain["logprobs"]["tokens"][0])[0]
    banned = httpx.post(url, json={**base, "logit_bias": {str(first): -100}}).json()["choices"][0]["text"]
    assert banned != plain["text"] and not banned.startswith(plain["logprobs"]["tokens"][0])


# ----------------------------------------------------------------------------------------
# bad input in every API: a 400 naming what is wrong (context room, thinking budget, a
# conversation without a user turn), and valid tools without a description
# ----------------------------------------------------------------------------------------

CTX = 4096  # the module engine's max_context


def _prompt_tokens(srv: Server, path: str, body: dict) -> int:
    """The prompt length of ``body`` (a request that fits), from its usage."""
    r = httpx.post(srv.base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return u.get("prompt_tokens", u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0))


# (path, the body without its limit, the API's limit field, its words for the prompt)
LIMITS = [
    ("/v1/chat/completions", {"messages": ASK}, "max_tokens", "messages"),
    ("/v1/chat/completions", {"messages": ASK}, "max_completion_tokens", "messages"),
    ("/v1/completions", {"prompt": "Weather in Paris?"}, "max_tokens", "prompt"),
    ("/v1/responses", {"input": "Weather in Paris?"}, "max_output_tokens", "input"),
    ("/v1/messages", {"model": "m", "messages": ASK}, "max_tokens", "messages"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body, field, words", LIMITS)
def test_a_limit_beyond_the_context_is_a_400_naming_the_numbers(srv, engine, path, body, field, words, stream):
    """prompt + max_tokens > the context window: refused before anything is queued, as
    OpenAI's API and vLLM do, with the prompt's tokens, the limit and the window named; a
    limit that exactly fills the window is served."""
    engine.set_script("</think>ok")
    n = _prompt_tokens(srv, path, {**body, field: 5})
    room = CTX - n
    r = httpx.post(srv.base + path, json={**body, field: room, "stream": stream}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(srv.base + path, json={**body, field: room + 1, "stream": stream}, timeout=60)
    want = (f"This model's maximum context length is {CTX} tokens. However, you requested {CTX + 1} tokens "
            f"({n} in the {words}, {room + 1} in {field}). Please reduce the length of the {words} or {field} "
            f"(or start the server with --clamp-max-tokens to cap {field} to the room left).")
    if path == "/v1/messages":
        assert _anthropic_error(r, 400, "invalid_request_error") == want
    else:
        err = _openai_error(r, 400)
        assert err["message"] == want and err["param"] == field and err["code"] == "context_length_exceeded", err


@pytest.mark.parametrize("path, body, field, words", LIMITS)
def test_clamp_max_tokens_serves_a_limit_beyond_the_context(engine, path, body, field, words):
    """With clamp_max_tokens (lily serve --clamp-max-tokens) the same request is served,
    capped to the room left: the generation ends for length when the window is full."""
    tok = engine.tokenizer
    engine.set_ids(tok.encode("</think>") + tok.encode("x")[:1] * CTX)  # never ends by itself
    s = Server(create_app(engine, model_name="forced", clamp_max_tokens=True))
    try:
        n = _prompt_tokens(s, path, {**body, field: 5})
        r = httpx.post(s.base + path, json={**body, field: CTX}, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        u = out["usage"]
        assert u.get("completion_tokens", u.get("output_tokens")) == CTX - n, (u, n)
        reason = out.get("stop_reason") or out.get("status") or out["choices"][0]["finish_reason"]
        assert reason in ("length", "max_tokens", "incomplete"), reason
    finally:
        s.stop()


@pytest.mark.parametrize("path, body, field, words", LIMITS)
def test_a_prompt_beyond_the_context_says_so_in_the_same_words(srv, engine, path, body, field, words):
    """The prompt alone too long: the same sentence, without a limit (none was given)."""
    engine.set_script("</think>ok")
    long = "word " * 5000
    body = {"/v1/chat/completions": {"messages": [{"role": "user", "content": long}]},
            "/v1/completions": {"prompt": long}, "/v1/responses": {"input": long},
            "/v1/messages": {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": long}]}}[path]
    r = httpx.post(srv.base + path, json=body, timeout=60)
    head = f"This model's maximum context length is {CTX} tokens. However, your {words} resulted in "
    if path == "/v1/messages":
        msg = _anthropic_error(r, 400, "invalid_request_error")
    else:
        err = _openai_error(r, 400)
        msg = err["message"]
        assert err["param"] == words and err["code"] == "context_length_exceeded", err
    assert msg.startswith(head) and msg.endswith(f" tokens. Please reduce the length of the {words}."), msg
    assert int(msg[len(head):].split()[0]) > CTX


def test_no_limit_fills_the_context(srv, engine):
    """Without a limit (chat, Responses: the room left; completions: 16, capped to it) a
    prompt that fills the window is served and ends for length at once."""
    engine.set_script("abc")
    ids = engine.tokenizer.encode("word " * 5000)[:CTX]
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": ids}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0


def test_thinking_budget_is_checked_as_anthropic_states(srv, engine):
    """``thinking: {"type": "enabled"}`` needs ``budget_tokens`` >= 1024 and < max_tokens
    (Anthropic's Messages API reference), in /v1/messages and count_tokens alike."""
    engine.set_script("Let me think.</think>Hi!")
    url = srv.base + "/v1/messages"
    base = {"model": "m", "max_tokens": 2000, "messages": ASK}
    for thinking, needle in [({"type": "enabled"}, "thinking.budget_tokens: required"),
                             ({"type": "enabled", "budget_tokens": 1023}, "must be at least 1024, got 1023"),
                             ({"type": "enabled", "budget_tokens": 0}, "must be at least 1024, got 0"),
                             ({"type": "enabled", "budget_tokens": "2000"}, "thinking.budget_tokens"),
                             ({"type": "enabled", "budget_tokens": 2000}, "must be less than max_tokens (2000), got 2000"),
                             ({"type": "enabled", "budget_tokens": 4000}, "must be less than max_tokens (2000), got 4000")]:
        msg = _anthropic_error(httpx.post(url, json={**base, "thinking": thinking}), 400, "invalid_request_error")
        assert needle in msg, (thinking, msg)
        if "max_tokens" not in needle:  # count_tokens has no max_tokens
            msg = _anthropic_error(httpx.post(url + "/count_tokens", json={**base, "thinking": thinking}), 400,
                                   "invalid_request_error")
            assert needle in msg, (thinking, msg)
    ok = {**base, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    r = httpx.post(url, json=ok)
    assert r.status_code == 200 and [b["type"] for b in r.json()["content"]] == ["thinking", "text"], r.text
    assert httpx.post(url + "/count_tokens", json={**ok, "max_tokens": None}).status_code == 200
    for other in ({"type": "disabled", "budget_tokens": 5}, {"type": "adaptive"}):  # no budget to check
        assert httpx.post(url, json={**base, "thinking": other}).status_code == 200, other


def test_thinking_budget_ends_the_thinking_block(srv, engine, monkeypatch):
    """``budget_tokens`` is enforced: a model that would think on gets its thinking cut
    after exactly that many tokens, the thinking block ends and the text block follows
    (the engine's close is fed to the model, which answers from there), streamed and not."""
    tok = engine.tokenizer
    endless = tok.encode("Hmm, what now?" * 400)  # more than the budget, never closed
    answer = tok.encode("Hi there!")
    close_id = tok.token_to_id("</think>")
    on_prefill = engine.backend.on_prefill

    def prefill(tokens, all_logits):  # the continuation after the close: the script answers
        out = on_prefill(tokens, all_logits)
        if close_id in [int(t) for t in tokens]:
            engine.script_ids = answer
            out = engine._forced()
        return out

    monkeypatch.setattr(engine.backend, "on_prefill", prefill)
    budget = 1024
    thinking = tok.decode(endless[:budget])
    body = {"model": "m", "max_tokens": 1100, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": budget}}
    engine.set_ids(endless)
    r = httpx.post(srv.base + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    m = r.json()
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in m["content"]] == [
        ("thinking", thinking), ("text", "Hi there!")]
    assert m["stop_reason"] == "end_turn" and m["usage"]["output_tokens"] == budget + 3 + len(answer)
    engine.set_ids(endless)
    r = httpx.post(srv.base + "/v1/messages", json={**body, "stream": True}, timeout=60)
    events = _sse_events(r.text)
    seq = [(n, d["index"], d["content_block"]["type"] if n == "content_block_start" else d.get("delta", {}).get("type"))
           for n, d in events if n.startswith("content_block")]
    text = {0: "", 1: ""}
    for n, d in events:
        if n == "content_block_delta":
            text[d["index"]] += d["delta"].get("thinking", d["delta"].get("text", ""))
    assert seq[0] == ("content_block_start", 0, "thinking")
    stop0 = seq.index(("content_block_stop", 0, None))
    assert {x for x in seq[1:stop0]} == {("content_block_delta", 0, "thinking_delta")}
    assert seq[stop0 + 1] == ("content_block_start", 1, "text")
    assert {x for x in seq[stop0 + 2:-1]} == {("content_block_delta", 1, "text_delta")}
    assert seq[-1] == ("content_block_stop", 1, None) and text == {0: thinking, 1: "Hi there!"}
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    assert events[-2][1]["usage"]["output_tokens"] == budget + 3 + len(answer)


NO_DESC_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                   "code": {"type": "string"}}}


@pytest.mark.parametrize("forced", [False, True])
def test_tools_without_a_description_work_in_every_api(srv, engine, forced):
    """A tool without ``description`` is valid in all three APIs: it is rendered without one
    (one layout: the three prompts are the same tokens) and its calls come back parsed."""
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": NO_DESC_PARAMS}}
    resp_tool = {"type": "function", "name": "get_weather", "parameters": NO_DESC_PARAMS}
    msg_tool = {"name": "get_weather", "input_schema": NO_DESC_PARAMS}
    calls = [
        ("/v1/chat/completions", {"messages": ASK, "tools": [chat_tool], "max_tokens": 300,
                                  **({"tool_choice": "required"} if forced else {})}),
        ("/v1/responses", {"input": "Weather in Paris?", "tools": [resp_tool], "max_output_tokens": 300,
                           **({"tool_choice": "required"} if forced else {})}),
        ("/v1/messages", {"model": "m", "messages": ASK, "tools": [msg_tool], "max_tokens": 300,
                          **({"tool_choice": {"type": "any"}} if forced else {})}),
    ]
    prompts = []
    for path, body in calls:
        # forced: calls only, and no thinking (a forced tool choice turns it off)
        engine.set_script(SCRIPT.split("Let me check.\n\n")[1] if forced else SCRIPT)
        engine.reset()
        r = httpx.post(srv.base + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
        out = r.json()
        if path == "/v1/chat/completions":
            (call,) = out["choices"][0]["message"]["tool_calls"]
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        elif path == "/v1/responses":
            (call,) = [o for o in out["output"] if o["type"] == "function_call"]
            name, args = call["name"], json.loads(call["arguments"])
        else:
            (call,) = [b for b in out["content"] if b["type"] == "tool_use"]
            name, args = call["name"], call["input"]
        assert (name, args) == ("get_weather", ARGS), path
        prompts.append(engine.prompt)
        assert '{"type": "function", "function": {"name": "get_weather", "parameters": ' in engine.prompt
        assert '"description"' not in engine.prompt, path
    assert prompts[0] == prompts[1] == prompts[2]


NO_USER = [  # (path, body): conversations without a user turn
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "Hello."}]}),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "tool_call_id": "c", "content": "sunny"}]}),
    ("/v1/responses", {"input": [{"role": "system", "content": "Be brief."}]}),
    ("/v1/responses", {"input": [], "instructions": "Be brief."}),
    ("/v1/responses", {"input": [{"type": "message", "role": "assistant", "content": "Hello."}]}),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "sunny"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": "Hello."}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "system": "Be brief.", "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "sunny"}]}]}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "assistant", "content": "Hello."}]}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", NO_USER)
def test_a_conversation_without_a_user_turn_is_a_clear_400(srv, engine, path, body, stream):
    engine.set_script("ok")
    if stream and path.endswith("count_tokens"):
        pytest.skip("count_tokens does not stream")
    r = httpx.post(srv.base + path, json={**body, **({"stream": True} if stream else {})}, timeout=60)
    field = "input" if path == "/v1/responses" else "messages"
    if path.startswith("/v1/messages"):
        msg = _anthropic_error(r, 400, "invalid_request_error")
    else:
        err = _openai_error(r, 400)
        assert err["param"] == field and err["code"] == "invalid_value", err
        msg = err["message"]
    assert msg.startswith(f"{field} has no user message: "), msg
    assert "template" not in msg, msg  # the fault in the request's terms, not the template's


def test_an_anthropic_user_turn_without_blocks_is_a_clear_400(srv, engine):
    engine.set_script("ok")
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": []}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        msg = _anthropic_error(httpx.post(srv.base + path, json=body), 400, "invalid_request_error")
        assert msg.startswith("messages.0.content: a user message needs at least one text or tool_result block"), msg


def test_what_real_clients_send_is_honoured_or_refused(srv, engine):
    """Fields the official clients send, as the API references define them: temperature in
    OpenAI's [0, 2] and Anthropic's [0, 1]; logit_bias with token-id string keys and values in
    [-100, 100], a bad entry a 400 naming it; reasoning_effort "none" turning thinking off as the
    Responses API's reasoning.effort does; count_tokens counting beyond the window (agents
    count to decide when to compact); the Responses usage's cache_write_tokens; a forced tool
    call's stream starting with content null, as its non-streaming message has it."""
    engine.set_script("</think>ok")
    chat = srv.base + "/v1/chat/completions"
    for t, status in ((2.0, 200), (2.5, 400), (-0.1, 400)):
        r = httpx.post(chat, json={"messages": ASK, "max_tokens": 2, "temperature": t})
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["param"] == "temperature" and "[0, 2]" in r.json()["error"]["message"]
    r = httpx.post(srv.base + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "temperature": 2.5})
    assert _openai_error(r, 400)["param"] == "temperature"
    msgs = srv.base + "/v1/messages"
    base = {"model": "m", "max_tokens": 2, "messages": ASK}
    assert httpx.post(msgs, json={**base, "temperature": 1.0}).status_code == 200
    msg = _anthropic_error(httpx.post(msgs, json={**base, "temperature": 1.5}), 400, "invalid_request_error")
    assert "temperature" in msg and "[0, 1]" in msg, msg
    # logit_bias: applied (test_logit_bias_steers_the_demo_model); a bad entry is a 400 naming it
    V = engine.config.vocab_size
    bad_entries = [({"x": 1}, '"x"'), ({"-1": 1}, '"-1"'), ({"1.5": 1}, '"1.5"'), ({" 5": 1}, '" 5"'),
                   ({str(V): 1}, "outside the vocabulary"), ({"5": 100.5}, "100.5"), ({"5": -101}, "-101"),
                   ({"5": "1"}, '"5": "1"'), ({"5": None}, "null"), ({"5": True}, "true"), ({"5": 1, "05": 2}, "twice"),
                   ([5], "object"), ({str(t): 1 for t in range(1025)}, "at most 1024"),
                   ({"9" * 5000: 1}, "outside the vocabulary"), ({"5": 10 ** 400}, "must be a number")]
    for path, body in ((chat, {"messages": ASK}), (srv.base + "/v1/completions", {"prompt": "x"})):
        for ok in ({}, None, {"5": -100}, {"7": 2.5, str(V - 1): 100, "0": 0}):
            assert httpx.post(path, json={**body, "max_tokens": 2, "logit_bias": ok}).status_code == 200
        for bias, needle in bad_entries:
            err = _openai_error(httpx.post(path, json={**body, "max_tokens": 2, "logit_bias": bias}), 400)
            assert err["param"] == "logit_bias" and needle in err["message"], (bias, err)
    # reasoning_effort
    engine.reset()
    httpx.post(chat, json={"messages": ASK, "max_tokens": 2, "reasoning_effort": "none"}).raise_for_status()
    assert engine.prompt.rstrip().endswith("<think>\n\n</think>"), engine.prompt[-80:]  # thinking closed
    engine.reset()
    httpx.post(chat, json={"messages": ASK, "max_tokens": 2, "reasoning_effort": "high"}).raise_for_status()
    assert engine.prompt.rstrip().endswith("<think>"), engine.prompt[-80:]  # thinking stays on
    err = _openai_error(httpx.post(chat, json={"messages": ASK, "reasoning_effort": "max"}), 400)
    assert err["param"] == "reasoning_effort", err
    # count_tokens beyond the window
    long = [{"role": "user", "content": "word " * 5000}]
    r = httpx.post(msgs + "/count_tokens", json={"model": "m", "messages": long})
    assert r.status_code == 200 and r.json()["input_tokens"] > CTX, r.text
    # Responses usage
    u = httpx.post(srv.base + "/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()["usage"]
    assert u["input_tokens_details"] == {"cached_tokens": u["input_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0}
    # a forced tool call's stream
    engine.set_script("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                      "</tool_call>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
    r = httpx.post(chat, json={"messages": ASK, "tools": tools, "tool_choice": "required", "stream": True,
                               "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
    first = json.loads(r.text.split("\n\n")[0][len("data: "):])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}, first


def test_seed_reproduces_a_sampled_reply_in_both_new_apis(real):
    """`seed`, an extra field in the Messages and Responses APIs (docs/server.md), makes a
    sampled reply reproducible; other seeds draw other replies."""
    def messages(seed):
        body = {"model": "m", "max_tokens": 12, "temperature": 1.0, "seed": seed,
                "messages": [{"role": "user", "content": "ROMEO:"}]}
        r = httpx.post(real.base + "/v1/messages", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return json.dumps(r.json()["content"])

    def responses(seed):
        body = {"input": "ROMEO:", "max_output_tokens": 12, "temperature": 1.0, "seed": seed}
        r = httpx.post(real.base + "/v1/responses", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return json.dumps(r.json()["output"][-1]["content"])

    for reply in (messages, responses):
        assert reply(7) == reply(7)
        assert len({reply(s) for s in range(1, 5)}) > 1
