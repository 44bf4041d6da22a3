"""Tests for lily.server: the OpenAI-compatible HTTP API.

Three layers:

* parser unit tests - the incremental reasoning / tool-call parser fed text directly;
* end-to-end tests against a real uvicorn server (background thread, free loopback port)
  running the embedded demo model, driven with the official ``openai`` client;
* end-to-end tests with ``ForcedEngine``, a test double of :class:`lily.engine.Engine` that
  skips the model and forces a scripted token sequence through the engine's real generation
  loop (detokenizer, stop strings, max_tokens, EOS), so reasoning and tool calls - which the
  Shakespeare demo model never writes - go through the HTTP layer.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn

from lily.engine import Engine
from lily.server import create_app
from scripted import ScriptedBackend
from server_process import free_port, running_server, serve_argv
from lily.chat_output import (ChatAccumulator, ChatOutputParser, convert_value, parse_complete,
                                prompt_opens_reasoning)

pytestmark = pytest.mark.timeout(120)

MODEL = "lily-demo-shakespeare"
HI = [{"role": "user", "content": "Hi"}]


# ----------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------


class ForcedEngine(Engine):
    """The demo engine with the model replaced by a script: every step's logits make the next
    scripted token the only choice (EOS after the script). Optional per-token delay."""

    script_ids: list[int] = []
    delay = 0.0
    prefill_delay = 0.0
    prefill_calls = 0
    fail_at: int | None = None  # decode step at which to raise fail_exc
    fail_exc: BaseException | None = None

    def set_script(self, text: str, delay: float = 0.0, prefill_delay: float = 0.0) -> None:
        self.set_ids(self.tokenizer.encode(text), delay, prefill_delay)

    def set_ids(self, ids, delay: float = 0.0, prefill_delay: float = 0.0) -> None:
        self.script_ids = [int(t) for t in ids]
        self.delay = delay
        self.prefill_delay = prefill_delay
        self.prefill_calls = 0
        self.fail_at = None
        self.fail_exc = None

    def _forced(self) -> np.ndarray:
        logits = np.full(self.config.vocab_size, -1e4, dtype=np.float32)
        eos = min(self.eos_token_ids)
        tok = self.script_ids[self._pos] if self._pos < len(self.script_ids) else eos
        logits[tok] = 10.0
        return logits

    @classmethod
    def load(cls, *args, **kw) -> "ForcedEngine":
        kw.setdefault("prompt_cache_bytes", 0)  # a script: no state to cache
        engine = super().load(*args, **kw)
        engine.backend = ScriptedBackend(engine._on_prefill, engine._on_decode)
        engine.prompt_cache = None  # scripted answers: every request computes its prompt
        return engine

    def _on_prefill(self, tokens, all_logits: bool):
        self.prefill_calls += 1
        if self.prefill_delay:
            time.sleep(self.prefill_delay)
        self.last_prompt = self.tokenizer.decode([int(t) for t in tokens])
        self._pos = 0
        return self._forced()

    def _on_decode(self):
        if self.delay:
            time.sleep(self.delay)
        self._pos += 1
        if self.fail_at is not None and self._pos >= self.fail_at:
            raise self.fail_exc
        return self._forced()


class Server:
    def __init__(self, app):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            assert time.time() - t0 < 20, "server did not start"
            time.sleep(0.02)

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.base + "/v1", max_retries=0, timeout=60, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def real():
    # the numpy engine, named: these tests are about the protocol, and some about its chunked
    # prefill (cancelled between chunks); a native device's prefill is one 4096-row chunk
    srv = Server(create_app(Engine.load(device="reference")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def forced_engine():
    return ForcedEngine.load(max_context=4096, prompt_cache_bytes=0)  # a script: no state to cache


@pytest.fixture(scope="module")
def forced(forced_engine):
    srv = Server(create_app(forced_engine, model_name="forced"))
    yield srv
    srv.stop()


def wait_idle(srv: Server, timeout: float = 10.0) -> float:
    t0 = time.time()
    while True:
        h = httpx.get(srv.base + "/health").json()
        if not h["busy"] and h["pending"] == 0:
            return time.time() - t0
        assert time.time() - t0 < timeout, f"server still busy: {h}"
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------
# parser unit tests
# ----------------------------------------------------------------------------------------

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
        "code": {"type": "string"}, "maybe": {"type": ["integer", "null"]}}}}}]


def _norm(acc: ChatAccumulator):
    return acc.reasoning, acc.content, [(c["function"]["name"], c["function"]["arguments"])
                                        for c in acc.tool_calls]


def _feed_pieces(pieces, **kw) -> ChatAccumulator:
    p = ChatOutputParser(**kw)
    acc = ChatAccumulator()
    for piece in pieces:
        acc.add(p.feed(piece))
    acc.add(p.finish())
    return acc


REPLY = ("The user wants weather.\nCheck it.\n</think>\n\nSure, checking.\n\n<tool_call>\n"
         "<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n<parameter=temp>\n-2.5\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n"
         "<parameter=opts>\n{\"a\": [1, 2], \"b\": null}\n</parameter>\n<parameter=tags>\n[\"x\", 1]\n"
         "</parameter>\n<parameter=code>\nif a < b and c > d:\n    s = \"</parameter>\"\n<b>bold</b>\n"
         "</parameter>\n<parameter=maybe>\nnull\n</parameter>\n</function>\n</tool_call>")


def test_parser_reasoning_content_and_typed_tool_call():
    acc = parse_complete(REPLY, reasoning=True, tools=WEATHER_TOOLS)
    assert acc.reasoning == "The user wants weather.\nCheck it."
    assert acc.content == "Sure, checking."
    assert len(acc.tool_calls) == 1 and acc.tool_calls[0]["id"].startswith("call_")
    assert acc.tool_calls[0]["type"] == "function"
    assert acc.tool_calls[0]["function"]["name"] == "get_weather"
    args = json.loads(acc.tool_calls[0]["function"]["arguments"])
    assert args == {"city": "New York", "days": 3, "temp": -2.5, "metric": False,
                    "opts": {"a": [1, 2], "b": None}, "tags": ["x", 1],
                    "code": 'if a < b and c > d:\n    s = "</parameter>"\n<b>bold</b>', "maybe": None}
    assert isinstance(args["days"], int)


def test_parser_every_split_point_and_random_chunks():
    want = _norm(parse_complete(REPLY, reasoning=True, tools=WEATHER_TOOLS))
    for i in range(len(REPLY) + 1):
        got = _feed_pieces([REPLY[:i], REPLY[i:]], reasoning=True, tools=WEATHER_TOOLS)
        assert _norm(got) == want, i
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(REPLY)), 25))
        pieces = [REPLY[a:b] for a, b in zip([0] + cuts, cuts + [len(REPLY)])]
        assert _norm(_feed_pieces(pieces, reasoning=True, tools=WEATHER_TOOLS)) == want
    assert _norm(_feed_pieces(list(REPLY), reasoning=True, tools=WEATHER_TOOLS)) == want


def test_parser_reasoning_split_across_tokens(forced_engine):
    """Real token boundaries of the demo tokenizer, and the closing tag cut at every point."""
    text = "Hmm, let me think.\n</think>\n\nHello there."
    ids = forced_engine.tokenizer.encode(text)
    detok = forced_engine.tokenizer.detokenizer()
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    acc = _feed_pieces(pieces, reasoning=True)
    assert (acc.reasoning, acc.content) == ("Hmm, let me think.", "Hello there.")
    tag_text = "Hmm.</think>Hi"
    for i in range(len(tag_text) + 1):
        for j in range(i, len(tag_text) + 1):
            acc = _feed_pieces([tag_text[:i], tag_text[i:j], tag_text[j:]], reasoning=True)
            assert (acc.reasoning, acc.content) == ("Hmm.", "Hi"), (i, j)


def test_parser_model_opened_think_and_no_reasoning():
    assert _norm(parse_complete("<think>\nplan\n</think>\n\nAnswer", reasoning=False)) == ("plan", "Answer", [])
    assert _norm(parse_complete("Just text </b> <think", reasoning=False))[:2] == ("", "Just text </b> <think")
    assert _norm(parse_complete("Plain answer.", reasoning=False)) == ("", "Plain answer.", [])


def test_parser_truncated_reasoning():
    acc = parse_complete("I am still thinking about </th", reasoning=True)
    assert acc.reasoning == "I am still thinking about </th" and acc.content == "" and not acc.tool_calls


def test_parser_keeps_trailing_whitespace_where_the_output_ends():
    # cut by a stop string or max_tokens inside a channel: the text is the engine's, to the
    # space; whitespace next to a tag is still dropped; identical for every split point
    for text, want in (("Answer: yes \n", ("", "Answer: yes \n")),
                       ("\n\nplan \n</think>\n\nEnter a ", ("plan", "Enter a ")),
                       ("still thinking  ", ("still thinking  ", ""))):
        reasoning = "</think>" in text or text.startswith("still")
        for i in range(len(text) + 1):
            acc = _feed_pieces([text[:i], text[i:]], reasoning=reasoning)
            assert (acc.reasoning, acc.content) == want, (text, i)


def test_parser_tool_call_ends_reasoning():
    text = "Need data.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    r, c, calls = _norm(parse_complete(text, reasoning=True, tools=WEATHER_TOOLS))
    assert (r, c) == ("Need data.", "")
    assert calls == [("get_weather", '{"city": "Oslo"}')]


def test_parser_truncated_tool_call_every_prefix():
    for i in range(len(REPLY) + 1):
        acc = parse_complete(REPLY[:i], reasoning=True, tools=WEATHER_TOOLS)
        for call in acc.tool_calls:
            args = json.loads(call["function"]["arguments"])  # always valid JSON
            assert isinstance(args, dict)
        assert "<tool_call>" not in acc.content and "<parameter" not in acc.content
    acc = parse_complete(REPLY[:REPLY.index("<parameter=temp>") + 20], reasoning=True, tools=WEATHER_TOOLS)
    assert json.loads(acc.tool_calls[0]["function"]["arguments"]) == {"city": "New York", "days": 3}


def test_parse_chat_output_leaves_out_a_call_cut_by_the_end():
    """The stream (and parse_complete) keeps a cut call, closed into valid JSON; the Python
    API's whole-reply result leaves it out, so an agent never runs a call with missing
    arguments. A complete call is kept."""
    from lily import parse_chat_output
    cut = REPLY[:REPLY.index("<parameter=temp>") + 20]
    assert len(parse_complete(cut, reasoning=True, tools=WEATHER_TOOLS).tool_calls) == 1
    assert parse_chat_output(cut, reasoning=True, tools=WEATHER_TOOLS).tool_calls == []
    calls = parse_chat_output(REPLY, reasoning=True, tools=WEATHER_TOOLS).tool_calls
    assert [c.name for c in calls] == ["get_weather"] and calls[0].arguments["city"] == "New York"


def test_parser_multiple_calls_json_form_and_without_tools():
    text = ("<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"b\", \"arguments\": {\"y\": \"z\"}}\n</tool_call>")
    r, c, calls = _norm(parse_complete(text, reasoning=False))
    assert (r, c) == ("", "")
    assert calls == [("a", '{"x": 1}'), ("b", '{"y": "z"}')]
    # tool parsing off: markup stays in the content
    assert parse_complete(text, reasoning=False, parse_tools=False).content == text


def test_parser_long_value_with_close_tag_text():
    value = "s = '</parameter>'  # not the end\n" * 300 + "</parameter>x"
    text = f"<tool_call>\n<function=write>\n<parameter=body>\n{value}\n</parameter>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"body": {"type": "string"}}}}}]
    for step in (1, 7):
        acc = _feed_pieces([text[i:i + step] for i in range(0, len(text), step)], tools=tools)
        assert json.loads(acc.tool_calls[0]["function"]["arguments"]) == {"body": value}


def test_convert_value_by_schema():
    assert convert_value("42", {"type": "string"}) == "42"
    assert convert_value("42", {"type": "integer"}) == 42
    assert convert_value("4.0", {"type": "integer"}) == 4
    assert convert_value("1e3", {"type": "number"}) == 1000.0
    assert convert_value("yes", {"type": "boolean"}) == "yes"  # not a boolean: kept verbatim
    assert convert_value("[1, 2]", {"anyOf": [{"type": "array"}, {"type": "string"}]}) == [1, 2]
    assert convert_value("{not json", {"type": "object"}) == "{not json"
    assert convert_value("7", None) == 7 and convert_value("seven", None) == "seven"


def test_prompt_opens_reasoning_with_template(forced_engine):
    tok = forced_engine.tokenizer
    assert prompt_opens_reasoning(tok.apply_chat_template(HI))
    assert not prompt_opens_reasoning(tok.apply_chat_template(HI, enable_thinking=False))


# ----------------------------------------------------------------------------------------
# real engine through HTTP
# ----------------------------------------------------------------------------------------


def test_chat_nonstreaming_and_streaming_agree(real):
    c = real.client()
    r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.created > 0
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.role == "assistant"
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4
    # the template opens <think>: the demo model's words land in the reasoning field
    reasoning = ch.message.model_extra.get("reasoning_content")
    assert reasoning and ch.message.model_extra.get("reasoning") == reasoning

    chunks = list(c.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join((k.choices[0].delta.model_extra or {}).get("reasoning_content", "")
                       for k in chunks if k.choices)
    content = "".join(k.choices[0].delta.content or "" for k in chunks if k.choices)
    assert streamed == reasoning and content == (ch.message.content or "")
    finals = [k.choices[0].finish_reason for k in chunks if k.choices and k.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert r.usage.completion_tokens_details.reasoning_tokens == 4  # all of it was thinking
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 4
    assert all(k.usage is None for k in chunks[:-1])
    assert len({k.id for k in chunks}) == 1


def test_chat_without_thinking_gives_content(real):
    r = real.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Speak"},
                                                            {"type": "text", "text": "now"}]}],
        max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    assert m.content and not (m.model_extra or {}).get("reasoning_content")


def test_completions_stream_and_logprobs(real, caplog):
    caplog.set_level(logging.INFO, logger="lily.server")
    c = real.client()
    r = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=5, logprobs=2)
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "lily.server"]
    assert any("prefill" in m and "decode" in m and "tok/s" in m for m in logged), logged
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == 5
    assert len(ch.logprobs.tokens) == 5 and "".join(ch.logprobs.tokens) == ch.text
    assert all(len(t) <= 2 for t in ch.logprobs.top_logprobs)
    chunks = list(c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=5, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(k.choices[0].text for k in chunks if k.choices) == ch.text
    assert chunks[-1].usage.completion_tokens == 5


def test_chat_logprobs(real):
    r = real.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3, logprobs=True,
                                              top_logprobs=2)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 3 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lp)


def test_seed_reproducibility(real):
    c = real.client()
    kw = dict(model=MODEL, prompt="KING:", max_tokens=6, temperature=1.0, seed=1234)
    a = c.completions.create(**kw).choices[0].text
    b = c.completions.create(**kw).choices[0].text
    assert a == b and a


def test_stop_strings(real):
    c = real.client()
    base = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=8).choices[0].text
    stripped = base.strip()
    assert len(stripped) >= 2
    stop = stripped[len(stripped) // 2:][:3]
    r = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=8, stop=[stop, "\u2603"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(stop)]


def test_invalid_requests(real):
    c = real.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=HI, n=2)
    assert e.value.body["param"] == "n"
    for bad in ({"temperature": -1}, {"temperature": 1000}, {"top_p": 0}, {"max_tokens": 0}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=HI, **bad)
        assert e.value.body["param"] == next(iter(bad)), bad
    # another model name: accepted by default, 404 with strict_model_name (test_server_apis.py)
    with pytest.raises(openai.BadRequestError):  # image parts are not supported
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])

    url = real.base + "/v1/chat/completions"
    for body, headers in ((b'{"model": "x", "messages": [', {"content-type": "application/json"}),
                          (b"not json at all", {}),
                          (b"[1, 2]", {"content-type": "application/json"})):
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    for payload in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                    {"messages": HI, "max_tokens": "lots"}, {"messages": HI, "stop": 5},
                    {"messages": HI, "top_logprobs": 3}, {"messages": HI, "tool_choice": "maybe"},
                    {"messages": HI, "chat_template_kwargs": {"add_generation_prompt": False}},
                    {"messages": [{"role": "assistant", "content": "x"}]},
                    {"messages": HI, "seed": 1 << 70}, {"messages": HI, "stream": "yes"},
                    {"messages": HI, "max_tokens": "2"}, {"messages": HI, "max_tokens": 2.0},
                    {"messages": HI, "temperature": "0.5"}, {"messages": HI, "logprobs": 1},
                    {"messages": HI, "stream": True, "stream_options": {"include_usage": "y"}},
                    {"messages": [{"role": "user"}]}):
        r = httpx.post(url, json=payload)
        assert r.status_code == 400, (payload, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(url, json={"messages": HI, "temperature": 0, "max_tokens": 2})  # an int is a number
    assert r.status_code == 200, r.text
    r = httpx.post(real.base + "/v1/completions", json={"prompt": [99999999]})
    assert r.status_code == 400
    r = httpx.post(real.base + "/v1/completions", json={"prompt": ""})
    assert r.status_code == 400
    r = httpx.get(real.base + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_models_and_health(real):
    models = real.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert real.client().models.retrieve(MODEL).id == MODEL
    assert httpx.get(real.base + "/health").json()["status"] == "ok"


def test_disconnect_mid_stream_cancels(real):
    c = real.client()
    stream = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=400, stream=True)
    got = 0
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.model_extra or {}).get("reasoning_content"):
            got += 1
            if got == 2:
                break
    stream.close()
    assert wait_idle(real) < 5.0  # 400 tokens would take far longer: the generation was cancelled
    r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_disconnect_nonstreaming_cancels(real):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(real.base + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 400},
                   timeout=1.5)
    assert wait_idle(real) < 5.0


# ----------------------------------------------------------------------------------------
# scripted engine through HTTP: reasoning and tool calls
# ----------------------------------------------------------------------------------------

SCRIPT = ("I should look up the weather.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
          "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=code>\n"
          "x = \"<b>\" if a < b else '</parameter>'\n</parameter>\n</function>\n</tool_call>")


def _collect_stream(chunks):
    reasoning, content, calls, finish = "", "", {}, None
    for k in chunks:
        if not k.choices:
            continue
        d = k.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content", "") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        finish = k.choices[0].finish_reason or finish
    return reasoning, content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish


def _collect_message(r):
    m = r.choices[0].message
    return ((m.model_extra or {}).get("reasoning_content", ""), m.content or "",
            [(t.function.name, t.function.arguments) for t in m.tool_calls or []], r.choices[0].finish_reason)


@pytest.mark.parametrize("max_tokens", [None, 40])
def test_reasoning_and_tool_call_both_modes(forced, forced_engine, max_tokens, caplog):
    caplog.set_level(logging.INFO, logger="lily.server")
    forced_engine.set_script(SCRIPT)
    c = forced.client()
    kw = dict(model="forced", messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=WEATHER_TOOLS)
    if max_tokens:
        kw["max_tokens"] = max_tokens
    full = _collect_message(c.chat.completions.create(**kw))
    streamed = _collect_stream(c.chat.completions.create(stream=True, **kw))
    assert full == streamed
    reasoning, content, calls, finish = full
    assert reasoning == "I should look up the weather." and content == "Let me check."
    if max_tokens is None:
        assert finish == "tool_calls"
        # the log line says how the reply ended as the API does (not the engine's "stop"); a
        # stream logs after its last chunk, so its line may come a moment after the client is done
        deadline = time.time() + 10
        while True:
            logged = [rec.getMessage() for rec in caplog.records if rec.name == "lily.server"]
            if sum("finish=tool_calls (1)" in m for m in logged) == 2 or time.time() > deadline:
                break
            time.sleep(0.05)
        assert sum("finish=tool_calls (1)" in m for m in logged) == 2, logged  # both modes
        assert [n for n, _ in calls] == ["get_weather"]
        assert json.loads(calls[0][1]) == {"city": "Paris", "days": 3,
                                           "code": "x = \"<b>\" if a < b else '</parameter>'"}
    else:  # cut inside the call: still well-formed, finish_reason length
        assert finish == "length"
        for _, args in calls:
            assert isinstance(json.loads(args), dict)


def test_truncated_reasoning_both_modes(forced, forced_engine):
    forced_engine.set_script("A long chain of thought that never ends " * 4)
    c = forced.client()
    kw = dict(model="forced", messages=HI, max_tokens=12)
    full = _collect_message(c.chat.completions.create(**kw))
    assert full == _collect_stream(c.chat.completions.create(stream=True, **kw))
    assert full[0].startswith("A long chain") and full[1] == "" and full[3] == "length"


def test_history_with_tool_calls_and_reasoning(forced, forced_engine):
    forced_engine.set_script("Done.")
    c = forced.client()
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning": "Need the tool.",
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = c.chat.completions.create(model="forced", messages=messages, tools=WEATHER_TOOLS,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "Done." and r.choices[0].finish_reason == "stop"
    prompt = forced_engine.last_prompt
    assert "<think>\nNeed the tool.\n</think>" in prompt
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    for bad in ("{not json", "[1]", '"x"'):
        messages[1]["tool_calls"][0]["function"]["arguments"] = bad
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="forced", messages=messages, tools=WEATHER_TOOLS)
    for empty in ("", "  "):  # as documented: taken as {} (a call without arguments)
        messages[1]["tool_calls"][0]["function"]["arguments"] = empty
        r = c.chat.completions.create(model="forced", messages=messages, tools=WEATHER_TOOLS,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].message.content == "Done."
        assert "<function=get_weather>\n</function>" in forced_engine.last_prompt


def test_queue_overflow_429(forced_engine):
    forced_engine.set_script("word " * 200, delay=0.05)
    srv = Server(create_app(forced_engine, model_name="forced", max_queue=1, max_batch=1))
    try:
        body = {"model": "forced", "messages": HI, "stream": True, "max_tokens": 100}
        with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b:
            with a.stream("POST", srv.base + "/v1/chat/completions", json=body) as ra:
                assert ra.status_code == 200
                with b.stream("POST", srv.base + "/v1/chat/completions", json=body) as rb:
                    assert rb.status_code == 200  # waits in the queue
                    r = httpx.post(srv.base + "/v1/chat/completions", json=body)
                    # Retry-After: the scheduler's estimate, in whole seconds
                    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                    assert r.json()["error"]["type"] == "rate_limit_error"
        wait_idle(srv)
        forced_engine.set_script("ok")
        r = httpx.post(srv.base + "/v1/chat/completions", json={"messages": HI})
        assert r.status_code == 200
    finally:
        srv.stop()


def test_api_key(forced_engine):
    forced_engine.set_script("fine")
    srv = Server(create_app(forced_engine, model_name="forced", api_key="s3cret"))
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        r = httpx.post(srv.base + "/v1/chat/completions", json={"messages": HI})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(srv.base + "/v1/chat/completions", content=b"{broken",
                       headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401  # the key is checked before the body is read
        ok = srv.client(api_key="s3cret")
        assert ok.models.list().data[0].id == "forced"
        r = ok.chat.completions.create(model="forced", messages=HI)
        assert r.choices[0].message.model_extra["reasoning_content"] == "fine"
        assert httpx.get(srv.base + "/health").status_code == 200  # health needs no key
    finally:
        srv.stop()


def test_disconnect_during_prefill(forced, forced_engine):
    """The engine checks the cancel flag between prefill chunks (``PREFILL_CHUNK`` tokens)."""
    forced_engine.set_script("never sent", prefill_delay=0.6)
    long_prompt = "To be or not to be, that is the question. " * 120  # about 1400 tokens: 11 chunks
    body = {"model": "forced", "messages": [{"role": "user", "content": long_prompt}], "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", forced.base + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            # keep the line iterator: dropping it unread closes the connection (httpx)
            lines = r.iter_lines()
            next(lines)  # the role chunk is sent before the prefill
            t0 = time.time()
            while forced_engine.prefill_calls == 0:  # the first chunk is running (0.6 s)
                assert time.time() - t0 < 10, "the prefill did not start"
                time.sleep(0.01)
    assert wait_idle(forced) < 1.5
    assert forced_engine.prefill_calls == 1
    forced_engine.set_script("again", prefill_delay=0.0)
    r = forced.client().chat.completions.create(model="forced", messages=HI)
    assert r.choices[0].finish_reason == "stop"


def test_context_length_and_echo(forced, forced_engine):
    forced_engine.set_script("abc")
    r = httpx.post(forced.base + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "word " * 5000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    # the engine's one rule: a prompt filling the window (4096) is served, ending for length,
    # when the request sets no limit; a limit that does not fit after it is a 400
    ids = forced_engine.tokenizer.encode("word " * 5000)[:4096]
    r = httpx.post(forced.base + "/v1/completions", json={"prompt": ids})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    r = httpx.post(forced.base + "/v1/completions", json={"prompt": ids, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "max_tokens" and "4101 tokens (4096 in the prompt" in r.json()["error"]["message"]
    r = httpx.post(forced.base + "/v1/completions", json={"prompt": ids + ids[:1]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(forced.base + "/v1/completions", json={"prompt": [10**7]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    c = forced.client()
    r = c.completions.create(model="forced", prompt="Hello", echo=True, max_tokens=5)
    assert r.choices[0].text == "Helloabc" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(forced_engine.script_ids)


def test_keepalive_comments_while_waiting(forced, forced_engine, monkeypatch):
    import lily.server.streaming as server_streaming
    monkeypatch.setattr(server_streaming, "KEEPALIVE_S", 0.1)
    forced_engine.set_script("</think>late", prefill_delay=0.5)
    body = {"model": "forced", "messages": HI, "stream": True}
    with httpx.stream("POST", forced.base + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
    forced_engine.set_script("</think>late", prefill_delay=0.5)
    chunks = list(forced.client().chat.completions.create(model="forced", messages=HI, stream=True))
    assert "".join(k.choices[0].delta.content or "" for k in chunks) == "late"


def test_serve_entry_point(tmp_path):
    """``lily.server.serve`` as the CLI calls it: loopback, given port, API key."""
    port = free_port()
    argv = serve_argv(port, api_key="k", log_level="warning")
    with running_server(argv, port, tmp_path / "server.log", timeout=30) as server:
        assert httpx.get(server.base + "/v1/models").status_code == 401
        r = httpx.get(server.base + "/v1/models", headers={"Authorization": "Bearer k"})
        assert r.json()["data"][0]["id"] == MODEL


def test_modes_agree_at_every_truncation_point(forced, forced_engine):
    """max_tokens cuts the scripted reasoning + tool-call reply at every token: streaming and
    non-streaming give the same message, arguments always parse, finish_reason is length."""
    forced_engine.set_script(SCRIPT)
    n = len(forced_engine.script_ids)
    c = forced.client()
    kw = dict(model="forced", messages=[{"role": "user", "content": "Weather?"}], tools=WEATHER_TOOLS)
    for max_tokens in range(1, n + 1):
        full = _collect_message(c.chat.completions.create(max_tokens=max_tokens, **kw))
        assert full == _collect_stream(c.chat.completions.create(max_tokens=max_tokens, stream=True, **kw))
        assert full[3] == "length"
        assert "</think>" not in full[0] + full[1] and "<tool_call>" not in full[1]
        for _, args in full[2]:
            assert isinstance(json.loads(args), dict)


# ----------------------------------------------------------------------------------------
# stop strings across token boundaries, multi-byte characters split across tokens
# ----------------------------------------------------------------------------------------

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
STOP_TEXT = "Good morrow, sweet prince of Denmark; the rest is silence, and more words follow here."


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """``ForcedEngine`` with the real Qwen3.5 tokenizer (byte-level BPE: rare CJK characters
    and emoji are split across tokens) behind a loopback server: ``(engine, server)``."""
    import dataclasses
    import lzma
    import shutil
    from pathlib import Path

    from lily.tokenizer import Tokenizer

    src = Path(__file__).resolve().parent / "data" / "qwen3.5-moe-tokenizer"
    if not (src / "tokenizer.json.xz").is_file():
        pytest.skip(f"tokenizer fixture missing: {src}")
    d = tmp_path_factory.mktemp("qwen-tokenizer")
    with lzma.open(src / "tokenizer.json.xz") as fin, open(d / "tokenizer.json", "wb") as fout:
        shutil.copyfileobj(fin, fout)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, d / name)
    tok = Tokenizer.from_dir(d)
    eng = ForcedEngine.load(max_context=4096, prompt_cache_bytes=0)  # a script: no state to cache
    eng.tokenizer = tok
    eng.config = dataclasses.replace(eng.config, vocab_size=tok.vocab_size)
    eng.sample_vocab = tok.vocab_size
    eng.eos_token_ids = frozenset(tok.eos_token_ids)
    srv = Server(create_app(eng, model_name="qwen-forced"))
    yield eng, srv
    srv.stop()


def _token_spans(tok, ids) -> list[tuple[int, int]]:
    """Character span of each token in the decoded text (tokens of whole characters)."""
    spans, pos = [], 0
    for t in ids:
        piece = tok.decode([t])
        spans.append((pos, pos + len(piece)))
        pos += len(piece)
    assert pos == len(tok.decode(ids))
    return spans


def _spanning_stop(tok, text: str, n_tokens: int) -> tuple[str, int]:
    """A stop string that starts strictly inside one token of ``text`` and ends strictly
    inside the token ``n_tokens - 1`` later; returns it and where it starts."""
    spans = _token_spans(tok, tok.encode(text))
    for i in range(4, len(spans) - n_tokens):
        (a0, a1), (b0, b1) = spans[i], spans[i + n_tokens - 1]
        if a1 - a0 >= 3 and b1 - b0 >= 2 and not text[a0 + 1].isspace():
            a, b = a0 + 2, b0 + min(2, b1 - b0 - 1)
            stop = text[a:b]
            if text.find(stop) == a and not text[a - 1].isspace():
                return stop, a
    raise AssertionError("no spanning stop string found")


def _chat_deltas(chunks) -> tuple[list[str], list[str], str | None]:
    """(reasoning deltas, content deltas, finish_reason) of a streamed chat reply."""
    reasoning, content, finish = [], [], None
    for k in chunks:
        if not k.choices:
            continue
        d = k.choices[0].delta
        r = (d.model_extra or {}).get("reasoning_content")
        if r:
            reasoning.append(r)
        if d.content:
            content.append(d.content)
        finish = k.choices[0].finish_reason or finish
    return reasoning, content, finish


def _assert_clean(pieces, where: str) -> None:
    """No replacement character and no surrogate in any piece."""
    for p in pieces:
        assert "\ufffd" not in p, (where, p, pieces)
        assert not any(0xD800 <= ord(ch) <= 0xDFFF for ch in p), (where, p, pieces)


@pytest.mark.parametrize("n_tokens", [2, 3])
def test_stop_string_spanning_tokens(forced, forced_engine, n_tokens):
    """A stop string that starts inside one token and ends inside a later one: nothing of it
    reaches any delta, in chat and completions, streaming and not; finish_reason is stop."""
    tok = forced_engine.tokenizer
    stop, at = _spanning_stop(tok, STOP_TEXT, n_tokens)
    assert len(stop) >= 2
    forced_engine.set_script(STOP_TEXT)
    c = forced.client()
    stops = ["\u2603 never", stop]
    want = STOP_TEXT[:at]

    r = c.completions.create(model="forced", prompt="Q", max_tokens=100, stop=stops)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(c.completions.create(model="forced", prompt="Q", max_tokens=100, stop=stops, stream=True))
    texts = [k.choices[0].text for k in chunks]
    assert all(stop not in t for t in texts) and "".join(texts) == want
    assert chunks[-1].choices[0].finish_reason == "stop"

    kw = dict(model="forced", messages=HI, max_tokens=100, stop=stops)
    r = c.chat.completions.create(extra_body=NO_THINK, **kw)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, "stop")
    _, content, finish = _chat_deltas(c.chat.completions.create(stream=True, extra_body=NO_THINK, **kw))
    assert all(stop not in d for d in content) and "".join(content) == want and finish == "stop"
    # inside the reasoning block too
    reasoning, content, finish = _chat_deltas(c.chat.completions.create(stream=True, **kw))
    assert all(stop not in d for d in reasoning) and "".join(reasoning) == want
    assert content == [] and finish == "stop"
    r = c.chat.completions.create(**kw)
    assert r.choices[0].message.model_extra["reasoning_content"] == want


def test_stop_prefix_not_completed_is_released(forced, forced_engine):
    """Text held back because it could begin a stop string is released once it cannot (a
    false start), at EOS, and at max_tokens."""
    tok = forced_engine.tokenizer
    forced_engine.set_script(STOP_TEXT)
    c = forced.client()
    # "sweet prince" is held until " of" shows it is not "sweet princess"; the reply ends in
    # "here." - the start of the second stop string - and EOS releases it
    stops = ["sweet princess", "here.!!"]
    r = c.completions.create(model="forced", prompt="Q", max_tokens=100, stop=stops)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (STOP_TEXT, "stop")
    texts = [k.choices[0].text for k in c.completions.create(model="forced", prompt="Q", max_tokens=100,
                                                               stop=stops, stream=True)]
    assert "".join(texts) == STOP_TEXT
    _, content, finish = _chat_deltas(c.chat.completions.create(
        model="forced", messages=HI, max_tokens=100, stop=stops, stream=True, extra_body=NO_THINK))
    assert "".join(content) == STOP_TEXT and finish == "stop"
    # cut by max_tokens while the tail is held back: released, finish_reason length
    ids = forced_engine.script_ids
    k = len(ids) // 2
    partial = tok.decode(ids[:k])
    stops = [partial[-4:] + "\u2603"]
    r = c.completions.create(model="forced", prompt="Q", max_tokens=k, stop=stops)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (partial, "length")
    chunks = list(c.completions.create(model="forced", prompt="Q", max_tokens=k, stop=stops, stream=True))
    assert "".join(k_.choices[0].text for k_ in chunks) == partial
    assert chunks[-1].choices[0].finish_reason == "length"
    r = c.chat.completions.create(model="forced", messages=HI, max_tokens=k, stop=stops, extra_body=NO_THINK)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (partial.strip(), "length")


MB_TEXT = "龘🦜 x🦜y 齉齾 𠜎 ☃︎ and 🫠 done"
SAY_TOOLS = [{"type": "function", "function": {"name": "say", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}}}}]


def _split_characters(tok, text: str) -> None:
    """The test text really puts one character's bytes into several tokens."""
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    broken = []
    for t in ids:
        try:
            tok.token_bytes(t).decode("utf-8")
        except UnicodeDecodeError:
            broken.append(t)
    assert len(broken) >= 4, "the text does not split characters across tokens"


@pytest.mark.parametrize("which", ["qwen", "demo"])
def test_multibyte_characters_split_across_tokens(request, which):
    """Emoji and CJK characters whose UTF-8 bytes span tokens never reach a delta broken: no
    U+FFFD, no surrogate, and the deltas join to the full decode - in content, in
    reasoning_content, in a tool call's arguments and in completions text."""
    if which == "qwen":
        eng, srv = request.getfixturevalue("qwen")
    else:
        eng, srv = request.getfixturevalue("forced_engine"), request.getfixturevalue("forced")
    tok = eng.tokenizer
    model = srv.client().models.list().data[0].id
    _split_characters(tok, MB_TEXT)
    c = srv.client()

    eng.set_script(MB_TEXT)
    texts = [k.choices[0].text for k in c.completions.create(model=model, prompt="Q", max_tokens=200,
                                                               stream=True)]
    _assert_clean(texts, "completions")
    assert "".join(texts) == tok.decode(eng.script_ids) == MB_TEXT
    _, content, finish = _chat_deltas(c.chat.completions.create(model=model, messages=HI, stream=True,
                                                                extra_body=NO_THINK))
    _assert_clean(content, "content")
    assert "".join(content) == MB_TEXT and finish == "stop" and len(content) > 5
    assert c.chat.completions.create(model=model, messages=HI, extra_body=NO_THINK).choices[0].message.content \
        == MB_TEXT

    eng.set_script(MB_TEXT + "\n</think>\n\n答案🦜")
    reasoning, content, _ = _chat_deltas(c.chat.completions.create(model=model, messages=HI, stream=True))
    _assert_clean(reasoning + content, "reasoning")
    assert "".join(reasoning) == MB_TEXT and "".join(content) == "答案🦜"
    m = c.chat.completions.create(model=model, messages=HI).choices[0].message
    assert (m.model_extra["reasoning_content"], m.content) == (MB_TEXT, "答案🦜")

    eng.set_script(f"<tool_call>\n<function=say>\n<parameter=text>\n{MB_TEXT}\n</parameter>\n"
                   "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>")
    kw = dict(model=model, messages=HI, tools=SAY_TOOLS, extra_body=NO_THINK)
    fragments, finish = [], None
    for k in c.chat.completions.create(stream=True, **kw):
        if k.choices:
            for tc in k.choices[0].delta.tool_calls or []:
                if tc.function and tc.function.arguments:
                    fragments.append(tc.function.arguments)
            finish = k.choices[0].finish_reason or finish
    _assert_clean(fragments, "tool arguments")
    assert json.loads("".join(fragments)) == {"text": MB_TEXT, "n": 3} and finish == "tool_calls"
    r = c.chat.completions.create(**kw)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"text": MB_TEXT, "n": 3}

    # a stop string that begins with a character split across tokens
    eng.set_script(MB_TEXT)
    for stop, want in (("🦜y", "龘🦜 x"), ("齾", "龘🦜 x🦜y 齉")):
        texts = [k.choices[0].text for k in c.completions.create(model=model, prompt="Q", max_tokens=200,
                                                                   stop=[stop], stream=True)]
        _assert_clean(texts, "completions with stop")
        assert "".join(texts) == want
        _, content, finish = _chat_deltas(c.chat.completions.create(
            model=model, messages=HI, stop=[stop], stream=True, extra_body=NO_THINK))
        _assert_clean(content, "content with stop")
        assert "".join(content) == want and finish == "stop"


# ----------------------------------------------------------------------------------------
# failures and disconnects: nothing hangs, nothing keeps the worker
# ----------------------------------------------------------------------------------------


def test_disconnect_during_prefill_real_engine(real):
    """The real (numpy) engine on a ~1400-token prompt (11 prefill chunks, about 14 s of
    prefill on an idle 2-core machine): a client that goes away during the prefill stops it
    after the chunk in progress, streaming and not, and the next request gives exactly the
    reply it gives on a fresh engine. The backend's ``prefill`` is wrapped to count chunks."""
    c = real.client()
    baseline = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4).choices[0].text
    long_prompt = "To be or not to be, that is the question. " * 120
    engine = real.app.state.lily.engine
    n_chunks = -(-len(engine.tokenizer.encode(long_prompt)) // engine.prefill_chunk)
    assert n_chunks >= 10
    chunks: list[int] = []
    backend = engine.backend
    real_prefill = backend.prefill

    def counting_prefill(tokens):
        chunks.append(len(tokens))
        return real_prefill(tokens)

    backend.prefill = counting_prefill
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}], "stream": True,
                "max_tokens": 4}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", real.base + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()  # kept: dropping it unread closes the connection
                next(lines)  # the role chunk is sent before the prefill
                t0 = time.time()
                while not chunks:  # wait until the prefill runs
                    assert time.time() - t0 < 20, "the prefill did not start"
                    time.sleep(0.01)
        idle_stream = wait_idle(real, 60)
        n_stream = len(chunks)
        chunks.clear()
        # non-streaming: a raw connection, closed once the prefill runs
        raw = json.dumps({"prompt": long_prompt, "max_tokens": 4}).encode()
        with socket.create_connection(("127.0.0.1", real.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw))
            t0 = time.time()
            while not chunks:
                assert time.time() - t0 < 20, "the prefill did not start"
                time.sleep(0.01)
        idle_plain = wait_idle(real, 60)
        n_plain = len(chunks)
    finally:
        del backend.prefill
    print(f"prefill chunks run {n_stream} and {n_plain} of {n_chunks}; worker idle "
          f"{idle_stream:.2f}s / {idle_plain:.2f}s after the disconnects")
    assert n_stream < n_chunks // 2 and n_plain < n_chunks // 2  # 1 or 2 here
    assert c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4).choices[0].text == baseline


class _Abort(BaseException):
    """Not an Exception: what a misbehaving plug-in or a SystemExit would raise."""


@pytest.mark.parametrize("exc", [RuntimeError("device lost"), _Abort("boom")], ids=["exception", "base"])
def test_engine_failure_mid_generation(forced, forced_engine, exc):
    """An engine that fails after a few tokens: 500 (non-streaming) or an error event
    (streaming), the worker survives and serves the next request."""
    c = forced.client()
    for stream in (False, True):
        forced_engine.set_script("one two three four five six")
        forced_engine.fail_at, forced_engine.fail_exc = 3, exc
        if stream:
            got = []
            with pytest.raises(openai.APIError) as e:
                for k in c.completions.create(model="forced", prompt="Q", stream=True, max_tokens=50):
                    got.append(k.choices[0].text)
            assert "".join(got) and e.value.body["type"] == "server_error"
        else:
            with pytest.raises(openai.InternalServerError) as e:
                c.completions.create(model="forced", prompt="Q", max_tokens=50)
            assert "generation failed" in e.value.body["message"]
        wait_idle(forced)
        forced_engine.set_script("fine again")
        r = c.completions.create(model="forced", prompt="Q")
        assert r.choices[0].text == "fine again"


def test_unpaired_surrogates_are_400_not_500(forced, forced_engine):
    """JSON may carry a lone surrogate (``"\\ud800"``); the server answers 400/404, never 500."""
    forced_engine.set_script("ok")
    url = forced.base + "/v1"
    for path, raw, status in (
            ("/chat/completions", '{"messages":[{"role":"user","content":"Hi \\ud83d"}]}', 400),
            ("/chat/completions", '{"messages":[{"role":"user","content":[{"type":"\\ud800"}]}]}', 400),
            # any model name is accepted by default (the reply names the served model)
            ("/chat/completions", '{"model":"\\udc00","messages":[{"role":"user","content":"Hi"}]}', 200),
            ("/completions", '{"prompt":"\\ud800x"}', 400),
            ("/completions", '{"prompt":["\\ud800x"],"stream":true}', 400)):
        r = httpx.post(url + path, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == status, (raw, r.text)
        assert r.json()["choices"] if status == 200 else r.json()["error"]["message"]


# ----------------------------------------------------------------------------------------
# newcomer's report: /health, parameter conventions, logs, echo logprobs
# ----------------------------------------------------------------------------------------


def _health(srv: Server) -> dict:
    return httpx.get(srv.base + "/health").json()


def test_health_counts_running_and_queued(forced_engine):
    """``running`` is the generation in progress, ``queued`` the ones waiting (a queued
    request whose client left no longer counts), ``pending`` their sum."""
    forced_engine.set_script("word " * 200, delay=0.05)
    srv = Server(create_app(forced_engine, model_name="forced", max_queue=2, max_batch=1))
    try:
        h = _health(srv)
        assert (h["busy"], h["running"], h["queued"], h["pending"]) == (False, 0, 0, 0)
        body = {"model": "forced", "messages": HI, "stream": True, "max_tokens": 100}
        with httpx.Client(timeout=30) as a, a.stream("POST", srv.base + "/v1/chat/completions",
                                                     json=body) as ra:
            lines_a = ra.iter_lines()  # kept: dropping it unread closes the connection
            next(lines_a)
            h = _health(srv)
            assert (h["busy"], h["running"], h["queued"], h["pending"]) == (True, 1, 0, 1), h
            with httpx.Client(timeout=30) as b, b.stream("POST", srv.base + "/v1/chat/completions",
                                                         json=body) as rb:
                lines_b = rb.iter_lines()
                next(lines_b)
                h = _health(srv)
                assert (h["running"], h["queued"], h["pending"]) == (1, 1, 2), h
            t0 = time.time()  # b hung up while waiting: it leaves the count at once
            while _health(srv)["queued"]:
                assert time.time() - t0 < 5
                time.sleep(0.02)
            assert _health(srv)["running"] == 1
        wait_idle(srv)
    finally:
        srv.stop()


def test_top_k_and_integer_bounds(forced, forced_engine):
    """top_k -1 and 0 both disable it; out-of-range values name the real bounds (2^31 - 1)."""
    forced_engine.set_script("</think>ok")
    c = forced.client()
    for k in (-1, 0, 5):
        r = c.chat.completions.create(model="forced", messages=HI, extra_body={"top_k": k})
        assert r.choices[0].message.content == "ok"
    for k in (-5, 1 << 31):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="forced", messages=HI, extra_body={"top_k": k})
        assert e.value.body["param"] == "top_k"
        msg = e.value.body["message"]
        assert "-1 or 0" in msg and "2147483647]" in msg and "[0," not in msg, msg
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="forced", messages=HI, max_tokens=1 << 31)
    msg = e.value.body["message"]
    assert e.value.body["param"] == "max_tokens" and "2147483647]" in msg and "2147483648]" not in msg, msg


def test_boolean_template_kwargs_are_checked(forced, forced_engine):
    forced_engine.set_script("</think>hi")
    url = forced.base + "/v1/chat/completions"
    for bad in ("no", "false", 0, 1, [], {}):
        r = httpx.post(url, json={"messages": HI, "chat_template_kwargs": {"enable_thinking": bad}})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
        assert "true, false or null" in r.json()["error"]["message"]
    r = httpx.post(url, json={"messages": HI, "chat_template_kwargs": {"enable_thinking": None}})
    assert r.status_code == 200 and "<think>" in forced_engine.last_prompt[-20:]  # the default: on
    r = httpx.post(url, json={"messages": HI, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and "<think>\n\n</think>" in forced_engine.last_prompt


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_client_disconnect_is_logged(forced, forced_engine, caplog, endpoint):
    caplog.set_level(logging.INFO, logger="lily.server")
    forced_engine.set_script("</think>" + "word " * 200, delay=0.02)
    c = forced.client()
    if endpoint == "chat":
        stream = c.chat.completions.create(model="forced", messages=HI, max_tokens=150, stream=True)
    else:
        stream = c.completions.create(model="forced", prompt="Q", max_tokens=150, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_idle(forced)
    kind = "chat (stream)" if endpoint == "chat" else "completion (stream)"
    t0 = time.time()
    while True:
        logged = [rec.getMessage() for rec in caplog.records if rec.name == "lily.server"]
        hits = [m for m in logged if m.startswith(f"{kind}: client disconnected after")]
        if hits or time.time() - t0 > 5:
            break
        time.sleep(0.05)
    assert len(hits) == 1 and "generation cancelled" in hits[0], logged


def test_echo_logprobs_include_the_prompt(real):
    """``echo`` + ``logprobs`` on /v1/completions: the prompt's tokens come first (the first
    with null logprobs), scored by the model teacher-forced; the generated part is what the
    request without echo gives, and the engine session is left usable."""
    c = real.client()
    prompt = "ROMEO: Is the day so young?"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    plain = c.completions.create(**kw).choices[0]
    echo = c.completions.create(echo=True, **kw).choices[0]
    engine = real.app.state.lily.engine  # its own device's logits, whatever the device
    tok = engine.tokenizer
    ids = tok.encode(prompt)
    n = len(ids)
    assert echo.text == prompt + plain.text
    lp = echo.logprobs
    assert lp.tokens == [tok.token_bytes(t).decode() for t in ids] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:i])) for i in range(n)]
    assert lp.text_offset[n:] == [len(prompt) + o for o in plain.logprobs.text_offset]
    # reference: one teacher-forced prefill of the prompt on a fresh session of the same engine
    engine.reset()
    logits = engine.prefill(ids, all_logits=True).astype(np.float64)
    engine.reset()
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    want = [ref[i - 1, ids[i]] for i in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-4)
    for i in range(1, n):
        top = lp.top_logprobs[i]
        best = np.argsort(-ref[i - 1])[:3]
        assert len(top) == 3 and sorted(top.values(), reverse=True) == pytest.approx(ref[i - 1, best], abs=1e-4)
    # streaming: the echoed text and its logprobs arrive in the first chunk
    chunks = list(c.completions.create(echo=True, stream=True, **kw))
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs.tokens == lp.tokens[:n]
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-6)
    assert "".join(k.choices[0].text for k in chunks) == echo.text
    assert [t for k in chunks if k.choices[0].logprobs for t in k.choices[0].logprobs.tokens] == lp.tokens
    # a one-token prompt has only the null entry; the next plain request is unaffected
    one = c.completions.create(model=MODEL, prompt=[ids[0]], max_tokens=2, temperature=0, logprobs=0,
                               echo=True).choices[0]
    assert one.logprobs.token_logprobs[0] is None and len(one.logprobs.tokens) == 3
    assert c.completions.create(**kw).choices[0].text == plain.text


def test_model_name_is_one_rule_with_the_chat_banner(forced_engine, tmp_path, monkeypatch):
    """The served model id and `lily chat`'s banner come from lily.engine.model_display_name:
    the demo model's name, else the checkpoint directory's (absolute: `--model .` names it;
    a symlink keeps its name); --served-model-name replaces it for the server only."""
    from pathlib import Path

    from fastapi.testclient import TestClient

    from lily.engine import default_model_path, model_display_name
    ck = tmp_path / "Qwen3.6-35B-A3B-4bit"
    ck.mkdir()
    (tmp_path / "qwen").symlink_to(ck)
    monkeypatch.chdir(ck)
    assert model_display_name(None) == model_display_name(default_model_path()) == MODEL
    assert model_display_name(".") == model_display_name(f"{ck}/") == ck.name
    assert model_display_name(tmp_path / "qwen") == "qwen"
    assert forced_engine.name == MODEL
    monkeypatch.setattr(forced_engine, "path", Path("."))
    assert forced_engine.name == ck.name
    with TestClient(create_app(forced_engine)) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == ck.name
        assert c.get("/health").json()["model"] == ck.name
    with TestClient(create_app(forced_engine, model_name="served")) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "served"
