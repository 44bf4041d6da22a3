"""OpenAI's chat completions (``POST /v1/chat/completions``) and legacy completions
(``POST /v1/completions``) over the shared core (:mod:`lily.server.core`,
:mod:`lily.server.errors`, :mod:`lily.server.streaming`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from lily.chat_output import ChatAccumulator, ChatOutputParser, Delta, prompt_opens_reasoning
from lily.errors import TokenizerError
from lily.server import streaming
from lily.server.core import (ServerState, cache_key, check_tools, check_unicode, effort_thinking, finite,
                              forces_format, openai_usage, request_constraint, state_of)
from lily.server.errors import JSONOut, dumps, engine_error
from lily.server.streaming import (ChatRun, ClientGone, JobStream, collect, job_events, log_gone, sse,
                                   stream_failed)
from lily.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from lily.structured import template_tools
from lily.tokenizer import tool_call_arguments

router = APIRouter()

_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "documents"}
# switches that the Qwen3.5 chat template tests with `is false` / `if`: a string such as
# "no" would be truthy (or not `false`) and silently leave the switch on
_BOOL_TEMPLATE_KWARGS = {"enable_thinking", "add_vision_id"}
#: reasoning_effort values of OpenAI's Chat Completions reference
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


# ----------------------------------------------------------------------------------------
# chat
# ----------------------------------------------------------------------------------------


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as the chat template takes them (400 for unsupported parts,
    missing content or tool-call arguments that are not a JSON object)."""
    out = []
    for i, m in enumerate(req.messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        c = m.content
        if isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                if part.type not in ("text", "input_text") or not isinstance(part.text, str):
                    raise APIError(400, f"content part type '{part.type}' is not supported: this "
                                        "model takes text only", param=f"messages.{i}.content.{j}",
                                   code="invalid_value")
                texts.append(part.text)
            c = "\n".join(texts)
        if c is None and m.role in ("user", "system", "developer", "tool"):
            raise APIError(400, f"a {m.role} message needs content", param=f"messages.{i}.content",
                           code="invalid_value")
        d["content"] = c
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            d["reasoning_content"] = reasoning
        if m.tool_calls:
            calls = []
            for j, tc in enumerate(m.tool_calls):
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    args = tool_call_arguments(tc.function.arguments, param)
                except TokenizerError as exc:
                    raise APIError(400, str(exc), param=param, code="invalid_value") from None
                call = {"type": "function", "function": {"name": tc.function.name, "arguments": args}}
                if tc.id is not None:
                    call["id"] = tc.id
                calls.append(call)
            d["tool_calls"] = calls
        out.append(d)
    return out


def tool_param(i: int, field: str) -> str:
    """Tool ``i``'s ``field`` as a chat request spells it (for error params)."""
    return f"tools.{i}.function.{field}"


def tool_setup(req: ChatCompletionRequest) -> tuple[list[dict] | None, bool]:
    """Tools to render and whether to parse tool calls."""
    tools = template_tools([t.model_dump(exclude_none=True) for t in req.tools]) if req.tools else None
    check_tools(tools, tool_param)
    choice = req.tool_choice
    if choice is None or choice == "auto":
        return tools, tools is not None
    if choice == "none":
        return None, False
    if choice == "required" or isinstance(choice, dict):
        if not tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if name is None:
                raise APIError(400, 'tool_choice.function.name is missing: a forced function is named as '
                                    '{"type": "function", "function": {"name": ...}}', param="tool_choice.function.name",
                               code="invalid_value")
            if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
                raise APIError(400, f"tool_choice names a function that is not in tools: {name!r}",
                               param="tool_choice", code="invalid_value")
        return tools, True
    raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                   param="tool_choice", code="invalid_value")


def chat_logprobs(tok, lps) -> list[dict]:
    def entry(tid: int, lp: float) -> dict:
        b = tok.piece_bytes(tid)
        return {"token": b.decode("utf-8", "replace"), "logprob": finite(lp), "bytes": list(b)}

    out = []
    for lp in lps:
        e = entry(lp.token_id, lp.logprob)
        e["top_logprobs"] = [entry(t, l) for t, l in lp.top]
        out.append(e)
    return out


def delta_of(events: list[Delta]) -> dict:
    """Parser deltas as one chat-completion chunk ``delta``."""
    d: dict[str, Any] = {}
    calls: list[dict] = []
    for ev in events:
        if ev.kind == "reasoning":
            d["reasoning_content"] = d.get("reasoning_content", "") + ev.text
            d["reasoning"] = d["reasoning_content"]
        elif ev.kind == "content":
            d["content"] = d.get("content", "") + ev.text
        elif ev.kind == "tool_start":
            calls.append({"index": ev.index, "id": ev.call_id, "type": "function",
                          "function": {"name": ev.name, "arguments": ""}})
        elif ev.kind == "tool_args":
            if calls and calls[-1]["index"] == ev.index:
                calls[-1]["function"]["arguments"] += ev.text
            else:
                calls.append({"index": ev.index, "function": {"arguments": ev.text}})
    if calls:
        d["tool_calls"] = calls
    return d


def check_template_kwargs(kwargs: dict) -> dict:
    """``chat_template_kwargs`` checked: no reserved names, boolean switches boolean
    (``null`` = the template's default, dropped)."""
    kwargs = dict(kwargs or {})
    bad = _RESERVED_TEMPLATE_KWARGS & set(kwargs)
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(sorted(bad))}",
                       param="chat_template_kwargs", code="invalid_value")
    for name in sorted(_BOOL_TEMPLATE_KWARGS & set(kwargs)):
        if kwargs[name] is None:  # null: the template's default
            del kwargs[name]
        elif not isinstance(kwargs[name], bool):
            raise APIError(400, f"chat_template_kwargs.{name} must be true, false or null (the template's "
                                f"default), got {dumps(kwargs[name])}", param=f"chat_template_kwargs.{name}",
                           code="invalid_value")
    return kwargs


def requested_thinking(effort, template_kwargs: dict) -> bool | None:
    """What a chat request asks of thinking: ``chat_template_kwargs.enable_thinking`` (checked,
    taken out of ``template_kwargs``), else ``reasoning_effort``
    (:func:`~lily.server.core.effort_thinking`; a value outside OpenAI's reference is a 400),
    else None."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {dumps(effort)}",
                       param="reasoning_effort", code="invalid_value")
    explicit = template_kwargs.pop("enable_thinking", None)  # the explicit template switch wins
    return explicit if explicit is not None else effort_thinking(effort)



@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    state = state_of(request)
    t_start = time.perf_counter()
    state.check_model(req.model)
    state.check_n(req.n)
    bias = state.logit_bias(getattr(req, "logit_bias", None))
    kwargs = check_template_kwargs(req.chat_template_kwargs)
    thinking = requested_thinking(getattr(req, "reasoning_effort", None), kwargs)
    top_lp = req.top_logprobs
    if top_lp is not None and top_lp > 0 and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs",
                       code="invalid_value")
    limit_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    messages = template_messages(req)
    tools, parse_tools = tool_setup(req)
    forced = req.tool_choice if isinstance(req.tool_choice, dict) or req.tool_choice == "required" else None
    if isinstance(forced, dict):
        forced = (forced.get("function") or {}).get("name")
    constraint = request_constraint(state, format=req.response_format, tool_choice=forced, tools=tools,
                                    parallel=req.parallel_tool_calls is not False,
                                    tool_param=tool_param)
    kwargs.update(state.thinking_kwargs(thinking, forced is not None or forces_format(req.response_format)))
    prompt_text, ids = await state.render_chat(messages, tools, kwargs)
    max_tokens = state.max_tokens_for(len(ids), getattr(req, limit_field), field=limit_field, prompt="messages")
    params = state.sampling_params(req, max_tokens, bool(req.logprobs), top_lp or 0, logit_bias=bias)
    parser = ChatOutputParser(reasoning=prompt_opens_reasoning(prompt_text), tools=tools,
                              parse_tools=parse_tools)
    job = state.submit(ids, params, constraint=constraint, prompt_cache_key=cache_key(req))
    run = ChatRun(job, parser)
    rid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": state.model_name, "system_fingerprint": None}
    tok = state.engine.tokenizer

    def finish_reason(reason: str) -> str:
        if reason == "length":
            return "length"
        return "tool_calls" if parser.n_tool_calls else "stop"

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return JobStream(_stream_chat(state, run, base, include_usage, finish_reason, bool(req.logprobs),
                                      t_start, tool_call_only=forced is not None), job, "chat (stream)")

    acc = ChatAccumulator()
    lps: list = []

    def consume(deltas, ev) -> None:
        acc.add(deltas)
        if ev is not None and ev.logprobs:
            lps.extend(ev.logprobs)

    gone = await collect(state, run, request, "chat", consume, t_start)
    if gone is not None:
        return gone
    last = run.last
    message: dict[str, Any] = {"role": "assistant",
                               "content": acc.content if (acc.content or not acc.tool_calls) else None}
    if acc.reasoning:
        message["reasoning_content"] = acc.reasoning
        message["reasoning"] = acc.reasoning
    if acc.tool_calls:
        message["tool_calls"] = acc.tool_calls
    choice = {"index": 0, "message": message,
              "logprobs": {"content": chat_logprobs(tok, lps)} if req.logprobs else None,
              "finish_reason": finish_reason(last.finish_reason)}
    return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
            "system_fingerprint": None, "choices": [choice],
            "usage": openai_usage(last.prompt_tokens, last.completion_tokens, run.n_reasoning, last.cached_tokens)}


def _chunk(base: dict, include_usage: bool, choice: dict) -> str:
    """One chunk of a stream: ``base`` with one choice (and a null usage when usage is asked for)."""
    obj = dict(base)
    obj["choices"] = [choice]
    if include_usage:
        obj["usage"] = None
    return sse(obj)


async def _openai_stream(what: str, state: ServerState, job, base: dict, include_usage: bool, t_start: float,
                         body, last, final_choice, usage, tool_calls=lambda: 0):
    """The stream of both endpoints: ``body``'s chunks; then, unless it was cancelled before
    its first event (``last()`` is None), the chunk of ``final_choice(last)``, the usage chunk
    when asked for and ``[DONE]``. A failure after the start ends it with an error event."""
    try:
        async with contextlib.aclosing(body):
            async for text in body:
                yield text
        end = last()
        if end is None:
            return
        yield _chunk(base, include_usage, final_choice(end))
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(end)})
        yield "data: [DONE]\n\n"
        state.log_done(what, job, end, t_start, tool_calls())
    except Exception as exc:
        yield sse(stream_failed(what, job, exc).body())
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()


def _stream_chat(state: ServerState, run: ChatRun, base: dict, include_usage: bool, finish_reason,
                 want_logprobs: bool, t_start: float, tool_call_only: bool = False):
    tok = state.engine.tokenizer

    def chunk(delta: dict, logprobs=None, finish=None) -> str:
        return _chunk(base, include_usage, {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    async def body():
        # a forced tool call has no content: null, as the non-streaming message says
        yield chunk({"role": "assistant", "content": None if tool_call_only else ""})
        async for deltas, ev in run.steps(None, streaming.KEEPALIVE_S):
            if ev is None:
                yield ": keep-alive\n\n"
                continue
            delta = delta_of(deltas)
            lp = {"content": chat_logprobs(tok, ev.logprobs)} if (want_logprobs and ev.logprobs) else None
            if delta or lp:
                yield chunk(delta, logprobs=lp)

    return _openai_stream(
        "chat (stream)", state, run.job, base, include_usage, t_start, body(), lambda: run.last,
        lambda last: {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason(last.finish_reason)},
        lambda last: openai_usage(last.prompt_tokens, last.completion_tokens, run.n_reasoning, last.cached_tokens),
        lambda: run.parser.n_tool_calls)


# ----------------------------------------------------------------------------------------
# completions
# ----------------------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    state = state_of(request)
    t_start = time.perf_counter()
    state.check_model(req.model)
    state.check_n(req.n, req.best_of)
    bias = state.logit_bias(getattr(req, "logit_bias", None))
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="invalid_value")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt",
                           code="invalid_value")
        prompt = prompt[0]
    tok = state.engine.tokenizer
    if isinstance(prompt, str):
        check_unicode(prompt, "prompt")
        ids = await asyncio.to_thread(tok.encode, prompt)
    else:
        ids = [int(t) for t in prompt]
    state.check_prompt_ids(ids, "prompt")
    n_lp = req.logprobs
    if n_lp is not None and not 0 <= n_lp <= 20:
        raise APIError(400, f"logprobs must be in [0, 20], got {n_lp}", param="logprobs",
                       code="invalid_value")
    max_tokens = state.max_tokens_for(len(ids), req.max_tokens, field="max_tokens", prompt="prompt", default=16)
    params = state.sampling_params(req, max_tokens, n_lp is not None, n_lp or 0, logit_bias=bias)
    echo_text = tok.decode_lenient(ids) if req.echo else ""  # a prompt may hold ids without a token
    score_prompt = bool(req.echo) and n_lp is not None  # OpenAI: echoed tokens get logprobs too
    job = state.submit(ids, params, prompt_logprobs=n_lp if score_prompt else None,
                       **({} if score_prompt else {"prompt_cache_key": cache_key(req)}))
    rid = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "system_fingerprint": None}

    def legacy_logprobs(lps, offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            s = tok.piece_bytes(lp.token_id).decode("utf-8", "replace")
            out["tokens"].append(s)
            out["token_logprobs"].append(finite(lp.logprob))
            out["top_logprobs"].append({tok.piece_bytes(t).decode("utf-8", "replace"): finite(l)
                                        for t, l in lp.top} if n_lp else None)
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def echo_logprobs() -> dict:
        """The echoed prompt's tokens: the first has no logprob (nothing precedes it)."""
        plps = job.prompt_logprobs
        first = tok.piece_bytes(ids[0]).decode("utf-8", "replace")
        out = legacy_logprobs(plps[1:], len(first))
        return {"tokens": [first] + out["tokens"], "token_logprobs": [None] + out["token_logprobs"],
                "top_logprobs": [None] + out["top_logprobs"], "text_offset": [0] + out["text_offset"]}

    def finish(last) -> str:
        return "length" if last.finish_reason == "length" else "stop"

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        seen: list = []  # the last event so far

        def chunk(text, logprobs=None) -> str:
            return _chunk(base, include_usage, {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None})

        async def body():
            offset = len(echo_text)
            if echo_text and not score_prompt:
                yield chunk(echo_text)
            async for ev in job_events(job, None, streaming.KEEPALIVE_S):
                if ev is None:
                    yield ": keep-alive\n\n"
                    continue
                if not seen and score_prompt:  # the prompt has been scored by now
                    yield chunk(echo_text, logprobs=echo_logprobs())
                lp = None
                if n_lp is not None and ev.logprobs:
                    lp = legacy_logprobs(ev.logprobs, offset)
                offset += len(ev.text)
                if ev.text or lp:
                    yield chunk(ev.text, logprobs=lp)
                seen[:] = [ev]

        gen = _openai_stream(
            "completion (stream)", state, job, base, include_usage, t_start, body(),
            lambda: seen[0] if seen else None,
            lambda last: {"index": 0, "text": "", "logprobs": None, "finish_reason": finish(last)},
            lambda last: openai_usage(last.prompt_tokens, last.completion_tokens, cached_tokens=last.cached_tokens))
        return JobStream(gen, job, "completion (stream)")

    texts: list[str] = []
    lps: list = []
    last = None
    try:
        async for ev in job_events(job, request):
            texts.append(ev.text)
            if ev.logprobs:
                lps.extend(ev.logprobs)
            last = ev
    except ClientGone:
        log_gone("completion", job)
        return JSONOut(error_body("client disconnected"), status_code=499)
    except Exception as exc:
        raise engine_error(exc) from None
    finally:
        job.cancel.set()
    if last is None:
        raise APIError(503, "the generation was cancelled", type="server_error")
    state.log_done("completion", job, last, t_start)
    logprobs = None
    if n_lp is not None:
        logprobs = legacy_logprobs(lps, len(echo_text))
        if score_prompt:
            head = echo_logprobs()
            logprobs = {k: head[k] + logprobs[k] for k in head}
    choice = {"index": 0, "text": echo_text + "".join(texts), "logprobs": logprobs,
              "finish_reason": finish(last)}
    usage = openai_usage(last.prompt_tokens, last.completion_tokens, cached_tokens=last.cached_tokens)
    return {**base, "choices": [choice], "usage": usage}
