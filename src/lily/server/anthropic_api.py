"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Requests are turned into the chat template's messages (system prompt, text, ``tool_use``
and ``tool_result`` blocks, ``thinking`` blocks as the assistant's reasoning); the reply's
reasoning, text and tool calls come back as ``thinking``, ``text`` and ``tool_use`` content
blocks, streamed with Anthropic's server-sent events. Errors have Anthropic's shape
``{"type": "error", "error": {"type": ..., "message": ...}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from lily.chat_output import ChatOutputParser, prompt_opens_reasoning
from lily.errors import TokenizerError
from lily.server import streaming
from lily.server.core import ServerState, check_tools, log, request_constraint, state_of
from lily.server.errors import dumps, register_error_shape
from lily.server.streaming import BlockSequencer, ChatRun, JobStream, collect, stream_failed
from lily.server.protocol import APIError, SamplingFields
from lily.structured import template_tools
from lily.tokenizer import tool_call_arguments

router = APIRouter()

# HTTP status -> Anthropic's error type (their API reference's "HTTP errors" table)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_shape(err: APIError) -> dict:
    """``err`` in Anthropic's error shape (the type follows the HTTP status)."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


register_error_shape("/v1/messages", error_shape)


# ----------------------------------------------------------------------------------------
# request models (only the fields Lily acts on are typed; others are accepted and ignored)
# ----------------------------------------------------------------------------------------


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(_Open):
    type: str
    text: Optional[str] = None
    thinking: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Union[str, list["ContentBlock"], None] = None
    is_error: Optional[StrictBool] = None


class InputMessage(_Open):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class ToolDef(_Open):
    type: Optional[str] = None  # "custom" (or absent); Anthropic's server tools have their own types
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: Optional[dict[str, Any]] = None  # required of custom tools (tool_setup says so)


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[StrictBool] = None


class Thinking(_Open):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[StrictInt] = None


class CountTokensRequest(_Open):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[ContentBlock], None] = None
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None


class MessagesRequest(CountTokensRequest, SamplingFields):
    max_tokens: StrictInt
    stop_sequences: Optional[list[str]] = None


# ----------------------------------------------------------------------------------------
# request -> chat template
# ----------------------------------------------------------------------------------------


def _text_of(blocks, param: str) -> str:
    """The text of a string or a list of text blocks (400 for any other block type)."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, b in enumerate(blocks or []):
        if b.type != "text" or not isinstance(b.text, str):
            raise APIError(400, f"{param}.{j}: content block type '{b.type}' is not supported here "
                                "(this model takes text only)", param=f"{param}.{j}")
        texts.append(b.text)
    return "\n".join(texts)


BILLING_HEADER = "x-anthropic-billing-header:"


def system_text(system, strip_billing_header: bool = True) -> str:
    """The ``system`` field's text (a string or text blocks, joined with newlines). With
    ``strip_billing_header``, Claude Code's per-request attribution line is left out: the
    first line of ``system[0]`` (or of the string) when it starts with
    ``x-anthropic-billing-header:`` (``cc_version=...; cc_entrypoint=...; cch=<nonce>;``),
    and the block with it when nothing else is in it. Its ``cch`` nonce changes with every
    request, so left in it would make every prompt differ from the previous one in its
    first tokens and defeat the prompt cache (claude-code issue 68900; llama.cpp PR 20623
    drops it likewise); it means nothing to the model."""
    _text_of(system, "system")  # only text blocks
    texts = [system] if isinstance(system, str) else [b.text for b in system]
    if strip_billing_header and texts and texts[0].lstrip().startswith(BILLING_HEADER):
        rest = texts[0].lstrip().partition("\n")[2]
        texts = ([rest] if rest else []) + texts[1:]
    return "\n".join(texts)


def template_messages(req: CountTokensRequest, strip_billing_header: bool = True) -> list[dict]:
    """The request as the chat template's messages: the system prompt (:func:`system_text`),
    user turns (their ``tool_result`` blocks become tool messages, before the turn's text),
    assistant turns (``thinking`` blocks as reasoning, ``tool_use`` blocks as tool calls)."""
    out: list[dict] = []
    system = system_text(req.system, strip_billing_header) if req.system else ""
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(m.content):
            param = f"{where}.{j}"
            if b.type == "text" and isinstance(b.text, str):
                texts.append(b.text)
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise APIError(400, f"{param}: a tool_result block needs tool_use_id", param=param)
                result = _text_of(b.content, f"{param}.content") if b.content is not None else ""
                if b.is_error:
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise APIError(400, f"{param}: a tool_use block needs a name", param=param)
                try:
                    args = tool_call_arguments(b.input, f"{param}.input")
                except TokenizerError as exc:
                    raise APIError(400, str(exc), param=f"{param}.input") from None
                call = {"type": "function", "function": {"name": b.name, "arguments": args}}
                if b.id:
                    call["id"] = b.id
                calls.append(call)
            elif b.type == "thinking" and m.role == "assistant" and isinstance(b.thinking, str):
                reasoning.append(b.thinking)
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue  # opaque to us: nothing to render
            else:
                raise APIError(400, f"{param}: content block type '{b.type}' is not supported in a "
                                    f"{m.role} message (this model takes text, tool_use, tool_result "
                                    "and thinking blocks)", param=param)
        if m.role == "user" and not texts and not any(b.type == "tool_result" for b in m.content):
            raise APIError(400, f"{where}: a user message needs at least one text or tool_result block",
                           param=where)
        if texts or m.role == "assistant":
            d: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
            if reasoning:
                d["reasoning_content"] = "\n".join(reasoning)
            if calls:
                d["tool_calls"] = calls
            out.append(d)
    return out


def tool_param(i: int, field: str) -> str:
    """Tool ``i``'s ``field`` as a Messages request spells it (``parameters`` is
    ``input_schema``), for error messages."""
    return f"tools.{i}.{'input_schema' if field == 'parameters' else field}"


def tool_setup(req: CountTokensRequest) -> tuple[list[dict] | None, bool, str | None, Callable[[int, str], str]]:
    """``(tools in OpenAI's form, parse tool calls, forced tool, param)``: ``forced`` is
    ``"required"`` for ``tool_choice: any``, the tool's name for ``tool``, else ``None``;
    ``param(i, field)`` spells field ``field`` of served tool ``i`` as the request counts it.

    Anthropic's server tools (``web_search_20250305``, ``code_execution_...``, ``bash_...``:
    any ``type`` but ``custom``), which this server does not run, are left out with a warning
    in the log, so that a client that sends them is served with its custom tools."""
    served = [(i, t) for i, t in enumerate(req.tools or ()) if t.type in (None, "custom")]
    skipped = sorted({t.type for t in req.tools or () if t.type not in (None, "custom")})
    if skipped:
        log.warning("messages: tools of type %s left out (this server runs custom tools only)", ", ".join(skipped))
    for i, t in served:
        if t.input_schema is None:
            raise APIError(400, f"tools.{i}.input_schema: required (the JSON schema of tool {t.name!r}'s input)",
                           param=f"tools.{i}.input_schema")

    def param(j: int, field: str) -> str:  # tool j of those served, as the request counts it
        return tool_param(served[j][0] if j < len(served) else j, field)

    # template_tools: the one rendered layout (a tool without a description is shown without one)
    tools = template_tools([{"type": "function", "function": {"name": t.name, "description": t.description,
                                                              "parameters": t.input_schema}}
                            for _, t in served]) or None
    check_tools(tools, param)
    choice = req.tool_choice
    if choice is None or choice.type == "auto":
        return tools, tools is not None, None, param
    if choice.type == "none":
        return None, False, None, param
    if not tools:
        raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "any":
        return tools, True, "required", param
    if not choice.name:
        raise APIError(400, "tool_choice.name is missing: tool_choice 'tool' names the tool to call",
                       param="tool_choice.name")
    if choice.name not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"tool_choice names a tool that is not in tools: {choice.name!r}",
                       param="tool_choice.name")
    return tools, True, choice.name, param


MIN_THINKING_BUDGET = 1024  # Anthropic's reference: budget_tokens >= 1024 and < max_tokens


def template_kwargs(state: ServerState, req: CountTokensRequest, forced: str | None) -> dict:
    """The chat template's switches for ``thinking`` (:meth:`ServerState.thinking_kwargs`):
    ``disabled`` turns the reasoning block off, ``enabled`` or ``adaptive`` on; without the
    field a forcing ``tool_choice`` (``forced``) turns it off, else the server's default
    applies (``lily serve --reasoning``; the template's: Qwen3.6 thinks). Thinking enabled
    with a forcing ``tool_choice`` is a 400 naming both fields, as Anthropic's API refuses
    it. ``enabled`` is checked as Anthropic's reference states (``budget_tokens`` given, at
    least 1024 and, when the request has ``max_tokens``, less than it); :func:`thinking_budget`
    is then the engine's cap on the thinking (thinking also counts towards ``max_tokens``)."""
    t = req.thinking
    requested = None if t is None else t.type != "disabled"
    if requested and forced is not None:
        raise APIError(400, f"thinking: may not be enabled when tool_choice forces tool use (tool_choice.type is "
                            f"{req.tool_choice.type!r}): leave thinking out or set it to {{\"type\": \"disabled\"}}, "
                            "or use tool_choice 'auto'", param="thinking")
    kwargs = state.thinking_kwargs(requested, forced is not None)
    if t is None or t.type != "enabled":
        return kwargs
    budget, param = t.budget_tokens, "thinking.budget_tokens"
    if budget is None:
        raise APIError(400, f"{param}: required when thinking.type is 'enabled' (at least "
                            f"{MIN_THINKING_BUDGET} and less than max_tokens)", param=param)
    if budget < MIN_THINKING_BUDGET:
        raise APIError(400, f"{param}: must be at least {MIN_THINKING_BUDGET}, got {budget}", param=param)
    if isinstance(req, MessagesRequest) and budget >= req.max_tokens:
        raise APIError(400, f"{param}: must be less than max_tokens ({req.max_tokens}), got {budget}", param=param)
    return kwargs


def thinking_budget(req: CountTokensRequest) -> int | None:
    """The engine's ``thinking_budget`` for a request (checked by :func:`template_kwargs`):
    ``budget_tokens`` of ``thinking.type == "enabled"``, else None. The engine closes the
    thinking block after that many thinking tokens, so the thinking content block ends
    there and the text block follows."""
    t = req.thinking
    return t.budget_tokens if t is not None and t.type == "enabled" else None


# ----------------------------------------------------------------------------------------
# endpoints
# ----------------------------------------------------------------------------------------


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request):
    state = state_of(request)
    state.check_model(req.model)
    tools, _, forced, param = tool_setup(req)
    forced_tools(state, req, tools, forced, param)  # what /v1/messages refuses, this refuses too
    # counted even beyond the window: agents count to decide when to compact
    _, ids = await state.render_chat(template_messages(req, state.strip_billing_header), tools,
                                     template_kwargs(state, req, forced), fit=False)
    return {"input_tokens": len(ids)}


def forced_tools(state: ServerState, req: CountTokensRequest, tools: list[dict] | None, forced: str | None,
                 param: Callable[[int, str], str]):
    """The constraint of a forcing ``tool_choice`` (400 naming the tool whose schema cannot
    be enforced, as ``param`` spells it), or None."""
    return request_constraint(state, tool_choice=forced, tools=tools, param="tool_choice", tool_param=param,
                              parallel=not (req.tool_choice and req.tool_choice.disable_parallel_tool_use))


def _usage(state: ServerState, run: ChatRun) -> dict:
    last = run.last
    cached = run.cached_tokens
    # Anthropic's input_tokens leaves out the tokens read from the cache
    return {"input_tokens": last.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": last.completion_tokens}


def _stop_reason(run: ChatRun, parser, tok, stops) -> tuple[str, str | None]:
    if run.last.finish_reason == "length":
        return "max_tokens", None
    if parser.n_tool_calls:
        return "tool_use", None
    hit = run.stop_string_hit(tok, stops)
    return ("stop_sequence", hit) if hit is not None else ("end_turn", None)


def _content_block(block, final: bool) -> dict:
    """A block as Anthropic shows it: complete (``final``) or as its start event carries it."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if final else "", "signature": ""}
    if block.kind == "content":
        return {"type": "text", "text": block.text if final else ""}
    args = {}
    if final and block.text.strip():
        try:
            args = json.loads(block.text)
        except ValueError:  # the parser closes cut calls; anything else is shown as given
            args = {"_raw": block.text}
    return {"type": "tool_use", "id": "toolu_" + block.call_id.removeprefix("call_"), "name": block.name,
            "input": args}


_DELTA = {"reasoning": ("thinking_delta", "thinking"), "content": ("text_delta", "text"),
          "tool": ("input_json_delta", "partial_json")}


def _event(name: str, obj: dict) -> str:
    return f"event: {name}\ndata: {dumps(obj)}\n\n"


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request):
    state = state_of(request)
    t_start = time.perf_counter()
    state.check_model(req.model)
    if req.max_tokens < 1:
        raise APIError(400, f"max_tokens: must be at least 1, got {req.max_tokens}", param="max_tokens")
    tools, parse_tools, forced, param = tool_setup(req)
    constraint = forced_tools(state, req, tools, forced, param)
    prompt_text, ids = await state.render_chat(template_messages(req, state.strip_billing_header), tools,
                                               template_kwargs(state, req, forced))
    stops = tuple(req.stop_sequences or ())
    max_tokens = state.max_tokens_for(len(ids), req.max_tokens, field="max_tokens", prompt="messages")
    params = state.sampling_params(req, max_tokens, stop=stops, max_temperature=1.0)
    if (budget := thinking_budget(req)) is not None:
        params = params.replace(thinking_budget=budget)
    parser = ChatOutputParser(reasoning=prompt_opens_reasoning(prompt_text), tools=tools,
                              parse_tools=parse_tools)
    job = state.submit(ids, params, constraint=constraint, report_start=bool(req.stream))  # message_start's split
    run = ChatRun(job, parser)
    tok = state.engine.tokenizer
    mid = "msg_" + uuid.uuid4().hex[:24]
    head = {"id": mid, "type": "message", "role": "assistant", "model": state.model_name}

    if req.stream:
        return JobStream(_stream(state, run, head, len(ids), tok, stops, t_start), job, "messages (stream)")

    seq = BlockSequencer()
    gone = await collect(state, run, request, "messages", lambda deltas, _: seq.feed(deltas), t_start)
    if gone is not None:
        return gone
    seq.close()
    reason, hit = _stop_reason(run, parser, tok, stops)
    return {**head, "content": [_content_block(b, True) for b in seq.blocks], "stop_reason": reason,
            "stop_sequence": hit, "usage": _usage(state, run)}


async def _stream(state: ServerState, run: ChatRun, head: dict, n_prompt: int, tok, stops, t_start: float):
    job = run.job
    seq = BlockSequencer()

    def step_event(what: str, block, text: str) -> str:
        if what == "start":
            return _event("content_block_start", {"type": "content_block_start", "index": block.index,
                                                  "content_block": _content_block(block, False)})
        if what == "delta":
            kind, field = _DELTA[block.kind]
            return _event("content_block_delta", {"type": "content_block_delta", "index": block.index,
                                                  "delta": {"type": kind, field: text}})
        return _event("content_block_stop", {"type": "content_block_stop", "index": block.index})

    def message_start() -> str:
        # sent once the engine has looked the prompt up in its cache, so the split of
        # input_tokens and cache_read_input_tokens is the one message_delta reports
        cached = job.cached_tokens or 0
        usage = {"input_tokens": n_prompt - cached, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": cached, "output_tokens": 0}
        return _event("message_start", {"type": "message_start", "message": {
            **head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})

    started = False
    try:
        async for step in seq.stream(run, streaming.KEEPALIVE_S):
            if not started and (step is not None or job.cached_tokens is not None):
                started = True
                yield message_start()
                yield _event("ping", {"type": "ping"})
                if step is None:
                    continue
            # before message_start only while the job waits in the queue (clients skip pings)
            yield _event("ping", {"type": "ping"}) if step is None else step_event(*step)
        if run.last is None:  # cancelled before it started
            return
        if not started:  # an empty reply: the job ended before any step
            yield message_start()
        reason, hit = _stop_reason(run, run.parser, tok, stops)
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": hit},
                                       "usage": _usage(state, run)})
        yield _event("message_stop", {"type": "message_stop"})
        state.log_done("messages (stream)", job, run.last, t_start, run.parser.n_tool_calls)
    except Exception as exc:
        yield _event("error", error_shape(stream_failed("messages (stream)", job, exc)))
    finally:
        job.cancel.set()
