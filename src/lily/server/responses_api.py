"""OpenAI's Responses API: ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

``input`` (a string or a list of items: messages, ``function_call``,
``function_call_output``, ``reasoning``) and ``instructions`` become the chat template's
messages; the reply comes back as output items (``reasoning``, ``message``,
``function_call``), streamed with the Responses API's typed events. ``previous_response_id``
continues a stored conversation: responses are kept in a bounded in-memory
:class:`ResponseStore` unless the request says ``store: false``. Errors have OpenAI's shape.
"""

from __future__ import annotations

import collections
import time
import uuid
from typing import Any, Callable, Optional, Union

from fastapi import APIRouter, Request
from pydantic import StrictBool, StrictInt

from lily.chat_output import ChatOutputParser, prompt_opens_reasoning
from lily.errors import TokenizerError
from lily.server import streaming
from lily.server.core import (INT32_MAX, ServerState, cache_key, check_tools, effort_thinking, forces_format, log,
                              request_constraint, state_of)
from lily.server.errors import dumps
from lily.server.streaming import BlockSequencer, ChatRun, JobStream, collect, stream_failed
from lily.server.protocol import APIError, SamplingFields
from lily.structured import template_tools
from lily.tokenizer import tool_call_arguments

router = APIRouter()


class ResponseStore:
    """The last ``capacity`` stored responses, by id: each with the conversation it ends
    (its input items, those of the responses before it, and its output items), so that
    ``previous_response_id`` can continue it. The oldest is dropped first."""

    def __init__(self, capacity: int = 256):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"max_stored_responses must be a non-negative integer, got {capacity!r}")
        self.capacity = capacity
        self._items: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.capacity == 0:
            return
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]]:
        """``(response, conversation)``; 404 ``previous_response_not_found`` when unknown."""
        try:
            return self._items[rid]
        except KeyError:
            raise APIError(404, f"no stored response with id '{rid}' (responses made with store=false are "
                                f"not kept, and this server keeps the last {self.capacity})",
                           param="previous_response_id", code="previous_response_not_found") from None

    def __len__(self) -> int:
        return len(self._items)


# ----------------------------------------------------------------------------------------
# request model (only the fields Lily acts on are typed; others are accepted and ignored)
# ----------------------------------------------------------------------------------------


class ResponsesRequest(SamplingFields):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    max_output_tokens: Optional[StrictInt] = None
    store: Optional[StrictBool] = True
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    text: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[StrictBool] = None


# ----------------------------------------------------------------------------------------
# items -> chat template
# ----------------------------------------------------------------------------------------


def _part_text(content, param: str) -> str:
    """A message's or tool output's text: a string, or text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of content parts", param=param,
                       code="invalid_value")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{param}.{j}: content part type {kind!r} is not supported: this model "
                                "takes text only", param=f"{param}.{j}", code="invalid_value")
        texts.append(part["text"])
    return "\n".join(texts)


def _str_field(item: dict, key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise APIError(400, f"{param}.{key} must be a non-empty string", param=f"{param}.{key}",
                       code="invalid_value")
    return v


def normalize_input(inp: Union[str, list[dict]]) -> list[dict]:
    """The request's input as a list of items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": inp}] if isinstance(inp, str) else list(inp)


def template_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Items as the chat template's messages: ``instructions`` as the system message, user /
    system / developer / assistant messages, consecutive ``function_call`` items as one
    assistant turn's tool calls, ``function_call_output`` as tool messages, and a
    ``reasoning`` item as the next assistant turn's reasoning."""
    out: list[dict] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    reasoning: list[str] = []
    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{param}.role must be user, assistant, system or developer, got {role!r}",
                               param=f"{param}.role", code="invalid_value")
            d: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": _part_text(item.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning:
                d["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            out.append(d)
        elif kind == "function_call":
            pname = f"{param}.arguments"
            try:
                args = tool_call_arguments(item.get("arguments"), pname)
            except TokenizerError as exc:
                raise APIError(400, str(exc), param=pname, code="invalid_value") from None
            call = {"type": "function", "id": _str_field(item, "call_id", param),
                    "function": {"name": _str_field(item, "name", param), "arguments": args}}
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant" and (prev.get("tool_calls") or not reasoning):
                prev.setdefault("tool_calls", []).append(call)
            else:
                d = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    d["reasoning_content"] = "\n".join(reasoning)
                    reasoning = []
                out.append(d)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", param),
                        "content": _part_text(item.get("output", ""), f"{param}.output")})
        elif kind == "reasoning":
            texts = [c.get("text") for c in item.get("content") or [] if isinstance(c, dict)]
            texts = texts or [s.get("text") for s in item.get("summary") or [] if isinstance(s, dict)]
            reasoning.extend(t for t in texts if isinstance(t, str))
        else:
            raise APIError(400, f"{param}: input item type {kind!r} is not supported (messages, "
                                "function_call, function_call_output and reasoning are)", param=param,
                           code="invalid_value")
    return out


def tool_param(i: int, field: str) -> str:
    """Tool ``i``'s ``field`` as a Responses request spells it (for error params)."""
    return f"tools.{i}.{field}"


def tool_setup(req: ResponsesRequest) -> tuple[list[dict] | None, bool, str | None, Callable[[int, str], str]]:
    """``(tools in the chat form, parse tool calls, forced, param)`` with ``forced``
    ``"required"`` or a function's name when ``tool_choice`` forces a call, and ``param(i,
    field)`` the request's spelling of tool ``i``'s field (``i`` counts the tools served).

    Only function tools run here. Tools of other types (OpenAI's hosted tools, which Codex
    and other agents send by default: ``web_search``, ``image_generation``, ``file_search``,
    ``local_shell``, ``custom`` freeform tools, ``namespace``, ...) are left out with a
    warning in the log, so that such a request is served with its function tools rather
    than refused; a function tool without a name is a 400."""
    tools, where = None, []  # where[i]: the request's index of served tool i

    def param(i: int, field: str) -> str:
        return tool_param(where[i] if i < len(where) else i, field)

    if req.tools:
        tools = []
        skipped = sorted({str(t.get("type")) if isinstance(t, dict) else type(t).__name__
                          for t in req.tools if not (isinstance(t, dict) and t.get("type") == "function")})
        if skipped:
            log.warning("responses: tools of type %s left out (this server runs function tools only)",
                        ", ".join(skipped))
        for i, t in enumerate(req.tools):
            if not (isinstance(t, dict) and t.get("type") == "function"):
                continue
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise APIError(400, f"tools.{i}: a function tool needs a name", param=f"tools.{i}.name",
                               code="invalid_value")
            params = t.get("parameters")
            where.append(i)
            tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description"),
                "parameters": {"type": "object", "properties": {}} if params is None else params}})
        check_tools(tools, param)
        tools = template_tools(tools) or None  # the one rendered layout (no description: none shown)
    choice = req.tool_choice
    if choice is None or choice == "auto":
        return tools, tools is not None, None, param
    if choice == "none":
        return None, False, None, param
    if choice == "required" or isinstance(choice, dict):
        if isinstance(choice, dict) and choice.get("type") != "function":  # a hosted tool, left out above
            raise APIError(400, f"tool_choice.type must be 'function' (Lily has function tools only), got "
                                f"{choice.get('type')!r}", param="tool_choice.type", code="invalid_value")
        if not tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        if choice == "required":
            return tools, True, "required", param
        name = choice.get("name")
        if name is None:
            raise APIError(400, 'tool_choice.name is missing: a forced function is named as {"type": "function", '
                                '"name": ...}', param="tool_choice.name", code="invalid_value")
        if name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names a function that is not in tools: {name!r}",
                           param="tool_choice", code="invalid_value")
        return tools, True, name, param
    raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                   param="tool_choice", code="invalid_value")


def response_format(req: ResponsesRequest) -> dict | None:
    """``text.format`` in ``response_format``'s form (for :func:`request_constraint`); 400
    naming the ``text.format`` field when it is not an object, of an unknown type, or a
    ``json_schema`` without ``schema``."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, 'text.format must be an object such as {"type": "json_schema", "name": ..., '
                            f'"schema": {{...}}}}, got {type(fmt).__name__}', param="text.format", code="invalid_value")
    kind = fmt.get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param="text.format.type", code="invalid_value")
    if kind != "json_schema":
        return fmt
    if "schema" not in fmt:
        raise APIError(400, "text.format.schema is missing: a json_schema format carries its schema",
                       param="text.format.schema", code="invalid_value")
    # the Responses API flattens the schema's fields
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def requested_thinking(req: ResponsesRequest) -> bool | None:
    """What ``reasoning.effort`` asks of thinking (:func:`~lily.server.core.effort_thinking`)."""
    return effort_thinking((req.reasoning or {}).get("effort"))


# ----------------------------------------------------------------------------------------
# output items
# ----------------------------------------------------------------------------------------


def _item_id(block, rid: str) -> str:
    prefix = {"reasoning": "rs_", "content": "msg_", "tool": "fc_"}[block.kind]
    return f"{prefix}{rid[5:21]}{block.index:03d}"


def output_item(block, rid: str, status: str = "completed", final: bool = True) -> dict:
    """A block as a Responses output item: complete (``final``) or as ``output_item.added``
    shows it."""
    iid = _item_id(block, rid)
    text = block.text if final else ""
    if block.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": text}] if final else []
        return {"id": iid, "type": "reasoning", "summary": [], "content": content, "status": status}
    if block.kind == "content":
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if final else []
        return {"id": iid, "type": "message", "role": "assistant", "status": status, "content": content}
    return {"id": iid, "type": "function_call", "call_id": block.call_id, "name": block.name,
            "arguments": text, "status": status}


def _as_input(item: dict) -> dict:
    """An output item as the input item a later turn sends back."""
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    return {k: v for k, v in item.items() if k != "status"}


def _usage(run: ChatRun) -> dict:
    last = run.last
    # the prompt cache is automatic: nothing is charged for writing it (Anthropic's usage says 0 too)
    return {"input_tokens": last.prompt_tokens, "input_tokens_details": {"cached_tokens": run.cached_tokens,
                                                                         "cache_write_tokens": 0},
            "output_tokens": last.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": run.n_reasoning},
            "total_tokens": last.prompt_tokens + last.completion_tokens}


# ----------------------------------------------------------------------------------------
# endpoints
# ----------------------------------------------------------------------------------------


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict:
    response, _ = state_of(request).responses.get(response_id)
    return response


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, request: Request):
    state = state_of(request)
    t_start = time.perf_counter()
    state.check_model(req.model)
    if req.max_output_tokens is not None and not 1 <= req.max_output_tokens <= INT32_MAX:
        raise APIError(400, f"max_output_tokens must be in [1, {INT32_MAX}], got {req.max_output_tokens}",
                       param="max_output_tokens", code="invalid_value")
    history: list[dict] = []
    if req.previous_response_id is not None:
        _, history = state.responses.get(req.previous_response_id)
    items = history + normalize_input(req.input)
    messages = template_messages(req.instructions, items)
    if not messages:
        raise APIError(400, "input is empty", param="input", code="invalid_value")
    tools, parse_tools, forced, param = tool_setup(req)
    fmt = response_format(req)
    constraint = request_constraint(state, format=fmt, tool_choice=forced, tools=tools,
                                    param="text.format", tool_param=param,
                                    parallel=req.parallel_tool_calls is not False)
    kwargs = state.thinking_kwargs(requested_thinking(req), forced is not None or forces_format(fmt))
    prompt_text, ids = await state.render_chat(messages, tools, kwargs, param="input")
    max_tokens = state.max_tokens_for(len(ids), req.max_output_tokens, field="max_output_tokens", prompt="input")
    params = state.sampling_params(req, max_tokens, stop=())
    parser = ChatOutputParser(reasoning=prompt_opens_reasoning(prompt_text), tools=tools,
                              parse_tools=parse_tools)
    job = state.submit(ids, params, constraint=constraint, prompt_cache_key=cache_key(req))
    run = ChatRun(job, parser)
    rid = "resp_" + uuid.uuid4().hex
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": state.model_name, "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "reasoning": req.reasoning or {"effort": None, "summary": None},
            "text": req.text or {"format": {"type": "text"}}, "store": req.store is not False,
            "truncation": "disabled", "metadata": getattr(req, "metadata", None) or {}, "usage": None}

    def finished(seq: BlockSequencer) -> dict:
        """The completed response (stored unless store=false)."""
        status = "incomplete" if run.last.finish_reason == "length" else "completed"
        item_status = "incomplete" if status == "incomplete" else "completed"
        output = [output_item(b, rid, item_status) for b in seq.blocks]
        resp = dict(base, status=status, output=output, usage=_usage(run))
        if status == "incomplete":
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        if req.store is not False:
            state.responses.put(resp, items + [_as_input(o) for o in output])
        return resp

    if req.stream:
        return JobStream(_stream(state, run, base, rid, finished, t_start), job, "responses (stream)")

    seq = BlockSequencer()
    gone = await collect(state, run, request, "responses", lambda deltas, _: seq.feed(deltas), t_start)
    if gone is not None:
        return gone
    seq.close()
    return finished(seq)


async def _stream(state: ServerState, run: ChatRun, base: dict, rid: str, finished, t_start: float):
    job = run.job
    seq = BlockSequencer()
    n = 0

    def event(kind: str, **fields) -> str:
        nonlocal n
        obj = {"type": kind, "sequence_number": n, **fields}
        n += 1
        return f"event: {kind}\ndata: {dumps(obj)}\n\n"

    def step_events(what: str, block, text: str) -> list[str]:
        out = []
        iid = _item_id(block, rid)
        at = {"item_id": iid, "output_index": block.index}
        if what == "start":
            out.append(event("response.output_item.added", output_index=block.index,
                             item=output_item(block, rid, "in_progress", final=False)))
            if block.kind == "content":
                out.append(event("response.content_part.added", **at, content_index=0,
                                 part={"type": "output_text", "text": "", "annotations": []}))
            elif block.kind == "reasoning":
                out.append(event("response.content_part.added", **at, content_index=0,
                                 part={"type": "reasoning_text", "text": ""}))
        elif what == "delta":
            if block.kind == "content":
                out.append(event("response.output_text.delta", **at, content_index=0, delta=text,
                                 logprobs=[]))
            elif block.kind == "reasoning":
                out.append(event("response.reasoning_text.delta", **at, content_index=0, delta=text))
            else:
                out.append(event("response.function_call_arguments.delta", **at, delta=text))
        else:
            item = output_item(block, rid)
            if block.kind == "content":
                out.append(event("response.output_text.done", **at, content_index=0, text=block.text,
                                 logprobs=[]))
                out.append(event("response.content_part.done", **at, content_index=0,
                                 part=item["content"][0]))
            elif block.kind == "reasoning":
                out.append(event("response.reasoning_text.done", **at, content_index=0, text=block.text))
                out.append(event("response.content_part.done", **at, content_index=0,
                                 part=item["content"][0]))
            else:
                out.append(event("response.function_call_arguments.done", **at, arguments=block.text))
            out.append(event("response.output_item.done", output_index=block.index, item=item))
        return out

    try:
        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        async for step in seq.stream(run, streaming.KEEPALIVE_S):
            if step is None:
                yield ": keep-alive\n\n"
                continue
            for line in step_events(*step):
                yield line
        if run.last is None:  # cancelled before it started
            return
        resp = finished(seq)
        kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
        yield event(kind, response=resp)
        state.log_done("responses (stream)", job, run.last, t_start, run.parser.n_tool_calls)
    except Exception as exc:
        err = stream_failed("responses (stream)", job, exc)
        yield event("error", code=err.code or err.type, message=err.message, param=err.param)
        failed = dict(base, status="failed", error={"code": err.code or err.type, "message": err.message})
        yield event("response.failed", response=failed)
    finally:
        job.cancel.set()
