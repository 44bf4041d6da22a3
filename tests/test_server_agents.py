"""Issue 29: agents never see a failed request. What agent clients send, end to end:

* forced tool use and forced formats do not think unless asked (Anthropic refuses thinking
  with a forced tool: so does Lily, naming both fields);
* a Claude-Code-shaped conversation (system blocks headed by the per-request billing line,
  tools, tool_use / tool_result turns, thinking) reuses its prompt from the prompt cache turn
  after turn, the previous reply included;
* Codex-shaped Responses requests (hosted tool types Lily does not run, the full history
  re-sent) are served, and ``/v1/models`` has the shape Codex reads;
* a request that sets no limit or no thinking gets the server's defaults.
"""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import pytest

from lily.engine import Engine
from lily.server import create_app
from test_server import Server, wait_idle
from test_server_apis import ASK, Recording, aclient

pytestmark = pytest.mark.timeout(300)

THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
THINK_ON = "<|im_start|>assistant\n<think>\n"
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
A_TOOL = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]
C_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
R_TOOL = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]


@pytest.fixture(scope="module")
def engine():
    return Recording.load(max_context=4096)


@pytest.fixture(scope="module")
def demo():
    """The demo model, shared by this module's end-to-end tests (each starts from an empty
    session and prompt cache): its weights are dequantized once. The reference: the protocols
    and the prompt cache's reuse are the point, not the device (on the simulator, twice the time)."""
    return Engine.load(device="reference", max_context=2048)


def _fresh(engine: Engine) -> Engine:
    engine.reset()
    engine.prompt_cache.clear()
    return engine


@pytest.fixture(scope="module")
def srv(engine):
    s = Server(create_app(engine, model_name="forced"))
    yield s
    s.stop()


def _generation_prompt(engine, srv, path: str, body: dict) -> str:
    """The request's 200 answer's generation prompt: ``THINK_ON`` or ``THINK_OFF``."""
    engine.set_script(CALL)
    engine.reset()
    r = httpx.post(srv.base + path, json=body, timeout=60)
    assert r.status_code == 200, (path, body, r.text)
    head = engine.prompt[engine.prompt.rindex("<|im_start|>assistant"):]
    assert head in (THINK_ON, THINK_OFF), head
    return head


def test_forced_tool_use_under_thinking_never_calls_the_tool(engine, srv):
    """Issue 29 item 2. /v1/messages with tool_choice any / tool and no thinking field thought
    first (the template's default) and never reached the tool_use under a modest
    max_tokens. Now a forced tool choice, a forced function or a JSON response format does
    not think unless the request's own field asks for it, in every API; Anthropic's API
    refuses thinking together with forced tool use, and so does /v1/messages (count_tokens
    too), naming both fields."""
    msg = {"model": "m", "max_tokens": 200, "messages": ASK, "tools": A_TOOL}
    chat = {"messages": ASK, "tools": C_TOOL, "max_tokens": 200}
    resp = {"input": "Weather in Paris?", "tools": R_TOOL, "max_output_tokens": 200}
    off = [("/v1/messages", {**msg, "tool_choice": {"type": "any"}}),
           ("/v1/messages", {**msg, "tool_choice": {"type": "tool", "name": "get_weather"}}),
           ("/v1/messages", {**msg, "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"}}),
           ("/v1/chat/completions", {**chat, "tool_choice": "required"}),
           ("/v1/chat/completions", {**chat, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
           ("/v1/chat/completions", {"messages": ASK, "max_tokens": 50, "response_format": {"type": "json_object"}}),
           ("/v1/responses", {**resp, "tool_choice": "required"}),
           ("/v1/responses", {**resp, "tool_choice": {"type": "function", "name": "get_weather"}}),
           ("/v1/responses", {"input": "hi", "max_output_tokens": 50, "text": {"format": {"type": "json_object"}}})]
    for path, body in off:
        assert _generation_prompt(engine, srv, path, body) == THINK_OFF, (path, body)
    on = [("/v1/messages", {**msg}),  # auto: the template's default
          ("/v1/chat/completions", {**chat, "tool_choice": "required", "chat_template_kwargs": {"enable_thinking": True}}),
          ("/v1/chat/completions", {**chat, "tool_choice": "required", "reasoning_effort": "high"}),
          ("/v1/responses", {**resp, "tool_choice": "required", "reasoning": {"effort": "medium"}})]
    for path, body in on:
        engine.set_script("Thinking.\n</think>\n\n" + CALL)
        assert _generation_prompt(engine, srv, path, body) == THINK_ON, (path, body)
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = {**msg, "max_tokens": 2000, "tool_choice": {"type": "any"}, "thinking": thinking}
            r = httpx.post(srv.base + path, json=body, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"].startswith("thinking: "), err
            assert "tool_choice" in err["message"] and "'any'" in err["message"], err


# ----------------------------------------------------------------------------------------
# a Claude-Code-shaped conversation on the demo model, through the prompt cache
# ----------------------------------------------------------------------------------------

INSTRUCTIONS = (
    "You are an interactive command line tool that helps users with software engineering tasks. "
    "Use the instructions below and the tools available to you to assist the user. "
    + " ".join(f"Rule {i}: keep answers short, read files before editing them, run the tests after every change, "
               f"and never invent file contents you have not seen." for i in range(2)))
CC_TOOLS = [
    {"name": "Read", "description": "Reads a file from the local filesystem.", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string", "maxLength": 12}}, "required": ["file_path"]}},
    {"name": "Bash", "description": "Executes a bash command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string", "maxLength": 16}}, "required": ["command"]}},
    {"name": "Edit", "description": "Replaces text in a file.", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string", "maxLength": 12},
                                         "old_string": {"type": "string", "maxLength": 12},
                                         "new_string": {"type": "string", "maxLength": 12}},
        "required": ["file_path", "old_string", "new_string"]}},
]


def _cc_system(nonce: int, instructions: str = INSTRUCTIONS) -> list[dict]:
    """Claude Code's system blocks: the per-request billing line first (its cch nonce changes
    with every request), then the fixed prompt."""
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; "
                                     f"cch={nonce:05x};"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": instructions, "cache_control": {"type": "ephemeral"}}]


# (the user turn's content, the request's options); each reply is sent back as returned. The
# demo model writes no tool call of its own: a forced tool choice makes it (thinking off).
OFF = {"thinking": {"type": "disabled"}}
CC_THINKING_OFF = [
    ("Fix the failing test in main.py.", {"tool_choice": {"type": "tool", "name": "Read"}, "max_tokens": 48}),
    ("TOOL_RESULT:assert 3 == 4", {**OFF, "max_tokens": 4}),
    ("Why?", {**OFF, "max_tokens": 4}),
]
ON = {"thinking": {"type": "adaptive"}}  # the demo model thinks until max_tokens: thinking blocks
CC_THINKING_ON = [("Fix the failing test in main.py.", {**ON, "max_tokens": 4}), ("Why?", {**ON, "max_tokens": 4})]


def _cc_conversation(server: Server, engine: Engine, turns, instructions: str = INSTRUCTIONS,
                     tools: list[dict] | None = CC_TOOLS) -> list[dict]:
    """Run ``turns`` as Claude Code would, each request with a new billing nonce and the whole
    conversation; per turn: prompt tokens, cached, and the tokens the prompt shares with the
    previous request's prompt and output (``engine.tokens`` after it)."""
    client = anthropic.Anthropic(base_url=server.base, api_key="k", max_retries=0, timeout=120)
    messages, out, previous = [], [], []
    for n, (text, options) in enumerate(turns):
        if text.startswith("TOOL_RESULT:"):
            call = next(b for b in messages[-1]["content"] if b["type"] == "tool_use")
            content = [{"type": "tool_result", "tool_use_id": call["id"], "content": text[12:]}]
        else:
            content = [{"type": "text", "text": text}]
        messages.append({"role": "user", "content": content})
        m = client.messages.create(model="claude-sonnet-4-5", system=_cc_system(0x1F00 + 37 * n, instructions),
                                   messages=messages, **({"tools": tools} if tools else {}), **options)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
        wait_idle(server)  # the engine has stored the session (after the reply was sent)
        tokens = engine.tokens
        shared = next((i for i, (a, b) in enumerate(zip(tokens[:prompt], previous)) if a != b),
                      min(prompt, len(previous)))
        out.append({"prompt": prompt, "cached": m.usage.cache_read_input_tokens, "shared": shared,
                    "blocks": [b.type for b in m.content], "stop": m.stop_reason})
        previous = tokens
    return out


def test_claude_code_conversation_reuses_the_prompt_every_turn(demo):
    """Issue 29 item 4. Claude Code's first system block carries a nonce that changes with
    every request, so every prompt differed from the previous one in its first tokens and
    missed the cache; and with thinking off the template rendered the previous reply without
    the empty thinking block it was generated after (and a forced answer could start with
    blank space the template drops), so the reply was computed again every turn. Now the
    billing line is dropped and replies render as generated: from the second turn on each
    request reuses at least 95% of its prompt and of everything it shares with the previous
    request, with thinking off (tool_use, tool_result and text turns: the previous reply is
    reused) and on (the template drops earlier thinking, by Qwen's design: the previous reply
    is computed again, the rest reused). A reply is reused up to the first token where its
    re-encoding differs from the tokens generated (a constrained value's end, ',' then '\n'
    generated where BPE writes ',\n'): the cache needs token equality. Without the stripping (the server switch) the second
    turn reuses nothing past the first few tokens."""
    engine = _fresh(demo)
    s = Server(create_app(engine))
    try:
        off = _cc_conversation(s, engine, CC_THINKING_OFF)
        on = _cc_conversation(s, engine, CC_THINKING_ON)
    finally:
        s.stop()
    print("\n".join(json.dumps(t) for t in off + on))
    assert [t["blocks"][-1] for t in off] == ["tool_use", "text", "text"], off
    assert [t["blocks"] for t in on] == [["thinking"]] * 2, on
    for t in off[1:] + on[1:]:
        assert t["cached"] >= 0.95 * t["prompt"], (off, on)
        assert t["cached"] >= 0.95 * t["shared"] and t["shared"] > 0, (off, on)
    # thinking off, each reply reused: the whole tool call; the text reply up to the token or
    # two where its re-encoding may differ from what was generated (a trailing '\n' merged)
    assert off[1]["cached"] == off[1]["shared"] >= off[0]["prompt"] + 20, off
    assert off[2]["shared"] >= off[1]["prompt"] + 2 and off[2]["cached"] >= off[2]["shared"] - 2, off
    control = _fresh(demo)
    s = Server(create_app(control, strip_billing_header=False))
    try:
        turns = _cc_conversation(s, control, [("Hi.", {**OFF, "max_tokens": 2})] * 2, instructions="Be brief.",
                                 tools=None)
    finally:
        s.stop()
    assert turns[1]["cached"] < 0.2 * turns[1]["prompt"], turns


# ----------------------------------------------------------------------------------------
# Codex-shaped Responses requests
# ----------------------------------------------------------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string", "maxLength": 10}},
                    "required": ["cmd"], "additionalProperties": False}},
    {"type": "web_search", "external_web_access": False},
    {"type": "image_generation", "output_format": "png"},
    {"type": "local_shell"},
    {"type": "custom", "name": "apply_patch", "description": "Applies a patch.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "namespace", "name": "mcp__docs", "tools": []},
]


def test_codex_tool_types_are_left_out_not_refused(engine, srv, caplog):
    """Issue 29 item 5. A Responses request with tool types Lily does not run (Codex sends
    web_search, image_generation, local_shell, custom and namespace tools) was a 400. Now
    they are left out with a warning in the log and the function tools are served (the
    prompt shows only them; a call of one comes back); the Messages API's server tools
    alike."""
    engine.set_script('<tool_call>\n<function=exec_command>\n<parameter=cmd>\nls\n</parameter>\n</function>\n'
                      '</tool_call>')
    engine.reset()
    with caplog.at_level(logging.WARNING, logger="lily.server"):
        r = httpx.post(srv.base + "/v1/responses", timeout=60, json={
            "model": "gpt-5.1-codex", "instructions": "You are Codex.", "input": "List the files.",
            "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False, "store": False,
            "stream": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "conv-1"})
    assert r.status_code == 200, r.text
    calls = [o for o in r.json()["output"] if o["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("exec_command", {"cmd": "ls"})]
    assert '"name": "exec_command"' in engine.prompt
    assert "apply_patch" not in engine.prompt and "web_search" not in engine.prompt
    assert "custom, image_generation, local_shell, namespace, web_search" in caplog.text
    r = httpx.post(srv.base + "/v1/responses", json={"input": "hi", "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.name", r.text
    # Anthropic's server tools alike (Claude Code may send web search), and errors still name
    # the request's own index of a served tool
    engine.set_script(CALL)
    server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    with caplog.at_level(logging.WARNING, logger="lily.server"):
        m = aclient(srv).messages.create(model="m", max_tokens=200, messages=ASK, tools=[server_tool, *A_TOOL])
    assert m.stop_reason == "tool_use" and m.content[-1].name == "get_weather"
    assert "web_search_20250305" in caplog.text
    bad = {**A_TOOL[0], "input_schema": {"type": "object", "required": "city"}}
    r = httpx.post(srv.base + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": ASK,
                                                    "tools": [server_tool, bad]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools.1.input_schema"), r.text


def test_several_system_and_developer_messages_become_one_system_message(engine, srv):
    """Codex sends ``instructions`` and ``developer`` input items together; chat clients a
    system and a developer message. Qwen's template takes one system message, first (it
    raised 'System message must be at the beginning.', a 400): their text is joined, in
    order, into one at the start. A forced hosted tool is refused naming its type."""
    engine.set_script("ok")
    engine.reset()
    r = httpx.post(srv.base + "/v1/responses", timeout=60, json={
        "model": "m", "instructions": "You are Codex.", "store": False, "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: on."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]})
    assert r.status_code == 200, r.text
    assert engine.prompt.startswith("<|im_start|>system\nYou are Codex.\n\nSandbox: on.<|im_end|>\n"
                                    "<|im_start|>user\nList the files.<|im_end|>"), engine.prompt
    assert engine.prompt.count("<|im_start|>system") == 1
    engine.reset()
    r = httpx.post(srv.base + "/v1/chat/completions", timeout=60, json={"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "developer", "content": "D"}]})
    assert r.status_code == 200, r.text
    assert engine.prompt.startswith("<|im_start|>system\nS\n\nD<|im_end|>\n<|im_start|>user\nU<|im_end|>")
    r = httpx.post(srv.base + "/v1/responses", json={"input": "hi", "tools": [{"type": "web_search"}],
                                                     "tool_choice": {"type": "web_search"}})
    assert r.status_code == 400 and "'web_search'" in r.json()["error"]["message"], r.text


def test_codex_full_history_each_turn_and_models_shape(demo):
    """Codex re-sends the whole conversation every turn (``store: false``, reasoning,
    function_call and function_call_output items): the second request reuses what the first
    computed. ``GET /v1/models`` (Codex's OSS providers read ``data[].id``; Codex adds
    ``client_version``) and the model-load probe Codex sends (``input: ""``,
    ``max_output_tokens: 1``) answer 200."""
    s = Server(create_app(_fresh(demo)))
    try:
        models = httpx.get(s.base + "/v1/models", params={"client_version": "0.99.0"}).json()
        assert [m["id"] for m in models["data"]] == ["lily-demo-shakespeare"]
        probe = httpx.post(s.base + "/v1/responses", json={"model": "lily-demo-shakespeare", "input": "",
                                                          "max_output_tokens": 1}, timeout=60)
        assert probe.status_code == 200, probe.text
        history = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]}]
        body = {"model": "m", "instructions": "You are Codex, a coding agent.", "tools": CODEX_TOOLS,
                "store": False, "prompt_cache_key": "c1", "max_output_tokens": 48, "parallel_tool_calls": False}
        first = httpx.post(s.base + "/v1/responses", json={**body, "input": history, "tool_choice": "required"},
                           timeout=120).json()
        call = next(o for o in first["output"] if o["type"] == "function_call")
        history += [{k: v for k, v in o.items() if k not in ("id", "status")} for o in first["output"]]
        history.append({"type": "function_call_output", "call_id": call["call_id"], "output": "a.py\nb.py"})
        second = httpx.post(s.base + "/v1/responses", json={**body, "input": history, "max_output_tokens": 4,
                                                            "reasoning": {"effort": "none"}}, timeout=120).json()
        u1, u2 = first["usage"], second["usage"]
        assert first["status"] == "completed" and second["status"] == "incomplete", (first, second)
        # the whole first request and its function call reused
        assert u2["input_tokens_details"]["cached_tokens"] >= u1["input_tokens"] + u1["output_tokens"] - 1, (u1, u2)
    finally:
        s.stop()


# ----------------------------------------------------------------------------------------
# defaults
# ----------------------------------------------------------------------------------------


def test_a_request_without_a_limit_or_a_thinking_switch_gets_the_server_defaults(engine):
    """Issue 29 item 6. A chat or Responses request without max_tokens ran until the context
    was full (the demo model never stops), and thinking was always the template's default.
    Now the limit defaults to the checkpoint's max_new_tokens (256 for the demo model) or
    4096, ``lily serve --reasoning off`` turns thinking off for requests that do not say,
    and a request's own field still wins."""
    s = Server(create_app(engine, model_name="forced", default_reasoning=False))
    try:
        engine.set_script("word " * 400)
        assert engine.chat_max_tokens == 256
        for path, body, count in [("/v1/chat/completions", {"messages": ASK}, "completion_tokens"),
                                  ("/v1/responses", {"input": "hi"}, "output_tokens")]:
            r = httpx.post(s.base + path, json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"][count] == 256, r.text
        wait_idle(s)
        assert _generation_prompt(engine, s, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2}) == THINK_OFF
        assert _generation_prompt(engine, s, "/v1/messages", {"model": "m", "messages": ASK, "max_tokens": 2}) \
            == THINK_OFF
        assert _generation_prompt(engine, s, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2,
                                                                      "reasoning_effort": "low"}) == THINK_ON
        assert _generation_prompt(engine, s, "/v1/messages", {"model": "m", "messages": ASK, "max_tokens": 2,
                                                              "thinking": {"type": "adaptive"}}) == THINK_ON
    finally:
        s.stop()
    assert "max_tokens 256 (chat, Responses)" in create_app(engine).state.lily.defaults_line()
