"""The OpenAI-compatible HTTP API (FastAPI): chat completions, completions, models, health.

Use :func:`create_app` to get an ASGI app around a loaded engine, or :func:`serve` to run it
with uvicorn (what ``lily serve`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import re
import time
import uuid
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lily.chat_output import ChatAccumulator, ChatOutputParser, Delta, prompt_opens_reasoning
from lily.errors import ContextLengthError, LilyError, TokenizerError
from lily.tokenizer import tool_call_arguments
from lily.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from lily.server.worker import Job, Worker

log = logging.getLogger("lily.server")

DEMO_MODEL_NAME = "lily-demo-shakespeare"
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "documents"}
# switches that the Qwen3.5 chat template tests with `is false` / `if`: a string such as
# "no" would be truthy (or not `false`) and silently leave the switch on
_BOOL_TEMPLATE_KWARGS = {"enable_thinking", "add_vision_id"}
_INT32_MAX = (1 << 31) - 1
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "seed")
_MIN_LOGPROB = -9999.0
_DISCONNECT_POLL_S = 0.25
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "null"}
_KEEPALIVE_S = 10.0  # SSE comment while a stream waits (queue, long prefill)


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def _dumps(obj: Any) -> str:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # an unpaired surrogate echoed from the request: escape it
        text = json.dumps(obj, ensure_ascii=True, separators=(",", ":"))
    return text


class _JSON(JSONResponse):
    """JSON responses that never fail to encode (see :func:`_dumps`)."""

    def render(self, content: Any) -> bytes:
        return _dumps(content).encode("utf-8")


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def _default_model_name(engine) -> str:
    try:
        from lily.engine import default_model_path
        if engine.path is not None and str(engine.path) == str(default_model_path()):
            return DEMO_MODEL_NAME
    except Exception:
        pass
    path = getattr(engine, "path", None)
    return getattr(path, "name", None) or "lily"


def _check_unicode(text: str, param: str) -> None:
    """400 for text with an unpaired surrogate (JSON allows ``"\\ud800"``; it is not Unicode
    text and no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} contains an unpaired surrogate (U+{ord(text[exc.start]):04X} at "
                            f"character {exc.start}): not valid Unicode text", param=param,
                       code="invalid_value") from None


def _param_of(message: str) -> str | None:
    m = re.search(r"parameter (\w+)=", message)
    return m.group(1) if m else None


def _shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")


class _State:
    def __init__(self, engine, model_name: str, api_key: str | None, max_queue: int,
                 default_max_tokens: int | None):
        self.closing = False
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.worker = Worker(max_queue)
        self.created = int(time.time())
        self.default_max_tokens = default_max_tokens
        tok = engine.tokenizer
        vocab = getattr(tok, "vocab_size", None)
        cfg = getattr(engine, "config", None)
        if cfg is not None and getattr(cfg, "vocab_size", None):
            vocab = min(vocab or cfg.vocab_size, cfg.vocab_size)
        self.vocab_size = vocab

    def begin_shutdown(self) -> None:
        """Take no more generations and end the running and queued ones now: their requests
        get a 503 (streams a final error event and ``data: [DONE]``), and the generation
        stops at its next prefill chunk or decode step. Call it on the event loop when the
        server is asked to exit, before waiting for connections to close
        (:func:`serve` does)."""
        if self.closing:
            return
        self.closing = True
        jobs = self.worker.jobs()
        if jobs:
            log.info("shutting down: ending %d running or queued generation(s)", len(jobs))
        for job in jobs:
            job.abort(_shutdown_error())


def _log_gone(kind: str, job: Job) -> None:
    if job.started is None:
        log.info("%s: client disconnected while queued, request dropped", kind)
    else:
        log.info("%s: client disconnected after %d completion tokens, generation cancelled",
                 kind, job.completion_tokens)


class _JobStream(StreamingResponse):
    """An SSE response that cancels its generation however the response ends
    (finished, client disconnected, or task cancelled), and logs the request's line if the
    stream itself did not (the client went away)."""

    def __init__(self, content, job: Job, kind: str):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job
        self.kind = kind

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            job = self.job
            job.cancel.set()
            if not job.logged:
                job.logged = True
                _log_gone(self.kind, job)


class _ClientGone(Exception):
    pass


class _Gate:
    """ASGI middleware in front of ``/v1/``: checks the API key before anything else is
    looked at, and reads POST bodies as JSON whatever their declared type (``curl -d``
    sends ``application/x-www-form-urlencoded`` unless told otherwise)."""

    _LAX = (b"", b"application/x-www-form-urlencoded", b"text/plain")

    def __init__(self, app, api_key: str | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            headers = list(scope.get("headers") or [])
            if self.api_key is not None:
                auth = next((v for k, v in headers if k == b"authorization"), b"")
                scheme, _, token = auth.partition(b" ")
                if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                    log.info("%s %s -> 401 bad or missing API key", scope.get("method"), scope.get("path"))
                    body = _dumps(error_body("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                             code="invalid_api_key")).encode()
                    await send({"type": "http.response.start", "status": 401,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()),
                                            (b"www-authenticate", b"Bearer")]})
                    await send({"type": "http.response.body", "body": body})
                    return
            if scope.get("method") == "POST":
                ctype = next((v for k, v in headers if k == b"content-type"), b"")
                if ctype.split(b";")[0].strip().lower() in self._LAX:
                    headers = [(k, v) for k, v in headers if k != b"content-type"]
                    headers.append((b"content-type", b"application/json"))
                    scope = dict(scope, headers=headers)
        await self.app(scope, receive, send)


async def _job_events(job: Job, request: Request | None, keepalive: float | None = None) -> AsyncIterator:
    """Yield the job's StreamEvents; raise the engine's exception if it failed.

    With ``request`` given (non-streaming responses), the client connection is polled so a
    disconnect cancels the generation. With ``keepalive`` (streaming responses), ``None``
    is yielded after that many idle seconds (queue wait, long prefill) so the caller can
    send an SSE comment.
    """
    getter: asyncio.Task | None = None
    next_check = time.monotonic() + _DISCONNECT_POLL_S
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(job.items.get())
            if request is None:
                done, _ = await asyncio.wait({getter}, timeout=keepalive)
                if not done:
                    yield None
                    continue
            else:
                done, _ = await asyncio.wait({getter}, timeout=_DISCONNECT_POLL_S)
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + _DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        job.cancel.set()
                        raise _ClientGone()
                if not done:
                    continue
            kind, payload = getter.result()
            getter = None
            if kind == "event":
                job.completion_tokens += len(payload.token_ids)
                yield payload
                if payload.finish_reason is not None:
                    return
            elif kind == "error":
                raise payload
            else:  # "end" without a final event, or "cancelled" while waiting
                return
    finally:
        if getter is not None:
            getter.cancel()


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, (LilyError, ValueError)):
        return APIError(400, str(exc), param=_param_of(str(exc)))
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


def _usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _scored_stream(engine, job: Job, ids: list[int], params, n_top: int, cancel) -> Iterator:
    """Run on the worker thread for ``/v1/completions`` with ``echo`` and ``logprobs``: score
    the prompt, then generate.

    ``job.prompt_logprobs`` gets one entry per prompt token, ``None`` for the first and
    otherwise the :class:`~lily.sampling.TokenLogprob` of ``ids[i]`` under the model's
    distribution after ``ids[:i]`` (raw logits, with ``n_top`` alternatives, as for
    generated tokens). The pass prefills ``ids[:-1]`` with ``all_logits=True`` into a fresh
    session (the engine's ``prefill`` appends to whatever the session holds) in
    ``engine.prefill_chunk`` pieces, checking ``cancel`` between them; the generation then extends
    that session, so only the last prompt token is prefilled again. A cancelled or failed
    pass leaves an empty session.
    """
    from lily.sampling import Sampler, SamplingParams

    chunk = engine.prefill_chunk

    scorer = Sampler(SamplingParams(top_logprobs=n_top, seed=0))
    scored: list = [None]
    head = ids[:-1]
    engine.reset()
    try:
        for s in range(0, len(head), chunk):
            if cancel.is_set():
                engine.reset()
                return
            logits = engine.prefill(head[s:s + chunk], all_logits=True)
            for j, row in enumerate(logits):
                scored.append(scorer.logprob(row, ids[s + j + 1]))
    except BaseException:
        engine.reset()
        raise
    job.prompt_logprobs = scored
    yield from engine.stream(ids, params, cancel=cancel)


# ----------------------------------------------------------------------------------------
# app factory
# ----------------------------------------------------------------------------------------


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 8, default_max_tokens: int | None = None) -> FastAPI:
    """An ASGI app serving ``engine`` through the OpenAI API.

    Parameters
    ----------
    engine : lily.engine.Engine
        A loaded engine (anything with the same ``stream``/``tokenizer``/``max_context``/
        ``generation_defaults`` interface).
    model_name : str | None
        The model id clients must use (default: ``lily-demo-shakespeare`` for the embedded
        demo model, otherwise the checkpoint directory's name).
    api_key : str | None
        When set, ``/v1/*`` requests need ``Authorization: Bearer <api_key>``.
    max_queue : int
        Requests that may wait while one generates; more get HTTP 429.
    default_max_tokens : int | None
        Chat completions without ``max_tokens`` stop after this many tokens (default: when
        the context window is full, as OpenAI's API does). ``/v1/completions`` defaults to 16.
    """
    state = _State(engine, model_name or _default_model_name(engine), api_key, max_queue,
                   default_max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.closing = False
        state.worker.start()
        try:
            yield
        finally:
            state.begin_shutdown()
            state.worker.close(timeout=2.0)

    app = FastAPI(title="Lily", description="OpenAI-compatible API of the Lily inference engine",
                  version="0.1.0", lifespan=lifespan, default_response_class=_JSON)
    app.state.lily = state
    app.add_middleware(_Gate, api_key=api_key)

    # -- errors ------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        log.info("%s %s -> %d %s", request.method, request.url.path, exc.status, exc.message)
        # a full queue or a shutdown is temporary: say when a retry makes sense (RFC 9110 10.2.3)
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return _JSON(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        # drop "body" and pydantic's union-member tags ("str", "list[str]", ...) from the path
        loc = [str(p) for p in first.get("loc", ())
               if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            msg = "the request body is not valid JSON"
            detail = (first.get("ctx") or {}).get("error")
            if detail:
                msg += f": {detail}"
            param = None
        else:
            msg = first.get("msg", "invalid request")
            if param:
                msg = f"{param}: {msg}"
            if len(errors) > 1:
                msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
        log.info("%s %s -> 400 %s", request.method, request.url.path, msg)
        return _JSON(error_body(msg, param=param, code="invalid_value" if param else None),
                     status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _JSON(error_body(str(exc.detail), code=code), status_code=exc.status_code,
                     headers=getattr(exc, "headers", None))

    @app.exception_handler(LilyError)
    async def _lily_error(request: Request, exc: LilyError):
        err = _engine_error(exc)
        return _JSON(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _JSON(error_body(f"internal error: {type(exc).__name__}", type="server_error"),
                     status_code=500)

    # -- auth and common checks ----------------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{state.model_name}'", param="model", code="model_not_found")

    def check_n(n: int | None, best_of: int | None = None) -> None:
        if n is not None and n != 1:
            raise APIError(400, f"n={n} is not supported: only n=1", param="n", code="invalid_value")
        if best_of is not None and best_of != 1:
            raise APIError(400, f"best_of={best_of} is not supported: only 1", param="best_of",
                           code="invalid_value")

    def sampling_params(req, max_tokens: int | None, logprobs: bool, top_logprobs: int):
        kw: dict[str, Any] = {}
        for name in _SAMPLING_FIELDS:
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        top_k = kw.get("top_k")
        if top_k is not None and not -1 <= top_k <= _INT32_MAX:
            raise APIError(400, f"invalid sampling parameter top_k={top_k}: must be -1 or 0 (both disable "
                                f"top-k) or a count in [1, {_INT32_MAX}]", param="top_k", code="invalid_value")
        if top_k == -1:  # vLLM's "disabled"
            kw["top_k"] = 0
        if req.stop is not None:
            kw["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        kw["logprobs"] = bool(logprobs)
        kw["top_logprobs"] = top_logprobs if logprobs else 0
        try:
            return state.engine.generation_defaults.replace(**kw)
        except (LilyError, ValueError, TypeError) as exc:
            msg = str(exc)
            raise APIError(400, msg, param=_param_of(msg), code="invalid_value") from None

    def check_prompt_ids(ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        if state.vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                               param="prompt", code="invalid_value")
        if len(ids) >= state.engine.max_context:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the context window is "
                                f"{state.engine.max_context} tokens", param=param,
                           code="context_length_exceeded")

    def submit(request: Request, ids: list[int], params, prompt_logprobs: int | None = None) -> Job:
        """Queue the generation. With ``prompt_logprobs`` (the number of alternatives), the
        job first scores the prompt (see :func:`_scored_stream`) into ``job.prompt_logprobs``."""
        if state.closing:
            raise _shutdown_error()
        engine = state.engine
        if prompt_logprobs is None:
            def start(cancel):
                return engine.stream(ids, params, cancel=cancel)
        else:
            def start(cancel):
                return _scored_stream(engine, job, ids, params, prompt_logprobs, cancel)
        job = Job(start, asyncio.get_running_loop())
        state.worker.submit(job)
        return job

    def log_done(kind: str, job: Job, last, started: float) -> None:
        if last is None:
            return
        job.logged = True
        t = last.timings
        wait = (job.started - job.submitted) if job.started else 0.0
        log.info("%s: %d prompt + %d completion tokens, finish=%s, queued %.2fs, prefill %.1f tok/s, "
                 "decode %.1f tok/s, total %.2fs", kind, last.prompt_tokens, last.completion_tokens,
                 last.finish_reason, wait, t.prefill_tokens_per_s if t else 0.0,
                 t.decode_tokens_per_s if t else 0.0, time.perf_counter() - started)

    # -- endpoints ----------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict:
        running, queued = state.worker.counts()
        return {"status": "ok", "model": state.model_name, "busy": running > 0, "running": running,
                "queued": queued, "pending": running + queued}

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "lily", "max_model_len": state.engine.max_context}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        check_model(model_id)
        return model_card()

    # -- chat ----------------------------------------------------------------------------

    def template_messages(req: ChatCompletionRequest) -> list[dict]:
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

    def tool_setup(req: ChatCompletionRequest) -> tuple[list[dict] | None, bool]:
        """Tools to render and whether to parse tool calls."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
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
                if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
                    raise APIError(400, f"tool_choice names a function that is not in tools: {name!r}",
                                   param="tool_choice", code="invalid_value")
            return tools, True
        raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                       param="tool_choice", code="invalid_value")

    def chat_logprobs(lps) -> list[dict]:
        tok = state.engine.tokenizer

        def entry(tid: int, lp: float) -> dict:
            b = tok.token_bytes(tid)
            return {"token": b.decode("utf-8", "replace"), "logprob": _finite(lp), "bytes": list(b)}

        out = []
        for lp in lps:
            e = entry(lp.token_id, lp.logprob)
            e["top_logprobs"] = [entry(t, l) for t, l in lp.top]
            out.append(e)
        return out

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        t_start = time.perf_counter()
        check_model(req.model)
        check_n(req.n)
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format other than 'text' is not supported",
                           param="response_format", code="invalid_value")
        kwargs = dict(req.chat_template_kwargs or {})
        bad = _RESERVED_TEMPLATE_KWARGS & set(kwargs)
        if bad:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(sorted(bad))}",
                           param="chat_template_kwargs", code="invalid_value")
        for name in sorted(_BOOL_TEMPLATE_KWARGS & set(kwargs)):
            if kwargs[name] is None:  # null: the template's default
                del kwargs[name]
            elif not isinstance(kwargs[name], bool):
                raise APIError(400, f"chat_template_kwargs.{name} must be true or false, got "
                                    f"{_dumps(kwargs[name])}", param=f"chat_template_kwargs.{name}",
                               code="invalid_value")
        top_lp = req.top_logprobs
        if top_lp is not None and top_lp > 0 and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs",
                           code="invalid_value")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        messages = template_messages(req)
        tools, parse_tools = tool_setup(req)
        tok = state.engine.tokenizer

        def render():
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kwargs)
            _check_unicode(text, "messages")
            return text, tok.encode(text)

        try:
            prompt_text, ids = await asyncio.to_thread(render)
        except (LilyError, ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from None
        check_prompt_ids(ids, "messages")
        if max_tokens is None:
            max_tokens = state.default_max_tokens or max(1, state.engine.max_context - len(ids))
        params = sampling_params(req, max_tokens, bool(req.logprobs), top_lp or 0)
        parser = ChatOutputParser(reasoning=prompt_opens_reasoning(prompt_text), tools=tools,
                                  parse_tools=parse_tools)
        job = submit(request, ids, params)
        rid = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": state.model_name, "system_fingerprint": None}

        def finish_reason(reason: str) -> str:
            if reason == "length":
                return "length"
            return "tool_calls" if parser.n_tool_calls else "stop"

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _JobStream(stream_chat(job, parser, base, include_usage, finish_reason, bool(req.logprobs),
                                          t_start), job, "chat (stream)")

        acc = ChatAccumulator()
        lps: list = []
        last = None
        n_reasoning = 0
        try:
            async for ev in _job_events(job, request):
                if parser.mode == "reasoning":
                    n_reasoning += len(ev.token_ids)
                acc.add(parser.feed(ev.text))
                if ev.logprobs:
                    lps.extend(ev.logprobs)
                last = ev
        except _ClientGone:
            _log_gone("chat", job)
            return _JSON(error_body("client disconnected"), status_code=499)
        except Exception as exc:
            raise _engine_error(exc) from None
        finally:
            job.cancel.set()
        acc.add(parser.finish())
        if last is None:
            raise APIError(503, "the generation was cancelled", type="server_error")
        log_done("chat", job, last, t_start)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": acc.content if (acc.content or not acc.tool_calls) else None}
        if acc.reasoning:
            message["reasoning_content"] = acc.reasoning
            message["reasoning"] = acc.reasoning
        if acc.tool_calls:
            message["tool_calls"] = acc.tool_calls
        choice = {"index": 0, "message": message,
                  "logprobs": {"content": chat_logprobs(lps)} if req.logprobs else None,
                  "finish_reason": finish_reason(last.finish_reason)}
        return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "system_fingerprint": None, "choices": [choice],
                "usage": _usage(last.prompt_tokens, last.completion_tokens, n_reasoning)}

    def delta_of(events: list[Delta]) -> dict:
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

    async def stream_chat(job: Job, parser: ChatOutputParser, base: dict, include_usage: bool,
                          finish_reason, want_logprobs: bool, t_start: float):
        def chunk(delta: dict, finish=None, logprobs=None) -> str:
            obj = dict(base)
            obj["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        last = None
        n_reasoning = 0
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for ev in _job_events(job, None, _KEEPALIVE_S):
                if ev is None:
                    yield ": keep-alive\n\n"
                    continue
                if parser.mode == "reasoning":
                    n_reasoning += len(ev.token_ids)
                events = parser.feed(ev.text)
                if ev.finish_reason is not None:
                    events = events + parser.finish()
                delta = delta_of(events)
                lp = {"content": chat_logprobs(ev.logprobs)} if (want_logprobs and ev.logprobs) else None
                if delta or lp:
                    yield chunk(delta, logprobs=lp)
                last = ev
            if last is None:  # cancelled before it started
                return
            yield chunk({}, finish=finish_reason(last.finish_reason))
            if include_usage:
                obj = dict(base)
                obj["choices"] = []
                obj["usage"] = _usage(last.prompt_tokens, last.completion_tokens, n_reasoning)
                yield _sse(obj)
            yield "data: [DONE]\n\n"
            log_done("chat (stream)", job, last, t_start)
        except Exception as exc:
            err = _engine_error(exc)
            job.logged = True
            log.info("chat (stream) failed after %d completion tokens: %s", job.completion_tokens, err.message)
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()

    # -- completions ---------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        t_start = time.perf_counter()
        check_model(req.model)
        check_n(req.n, req.best_of)
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
            _check_unicode(prompt, "prompt")
            ids = await asyncio.to_thread(tok.encode, prompt)
        else:
            ids = [int(t) for t in prompt]
        check_prompt_ids(ids, "prompt")
        n_lp = req.logprobs
        if n_lp is not None and not 0 <= n_lp <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {n_lp}", param="logprobs",
                           code="invalid_value")
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        params = sampling_params(req, max_tokens, n_lp is not None, n_lp or 0)
        echo_text = tok.decode(ids) if req.echo else ""
        score_prompt = bool(req.echo) and n_lp is not None  # OpenAI: echoed tokens get logprobs too
        job = submit(request, ids, params, prompt_logprobs=n_lp if score_prompt else None)
        rid = "cmpl-" + uuid.uuid4().hex
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "system_fingerprint": None}

        def legacy_logprobs(lps, offset: int) -> dict:
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for lp in lps:
                s = tok.token_bytes(lp.token_id).decode("utf-8", "replace")
                out["tokens"].append(s)
                out["token_logprobs"].append(_finite(lp.logprob))
                out["top_logprobs"].append({tok.token_bytes(t).decode("utf-8", "replace"): _finite(l)
                                            for t, l in lp.top} if n_lp else None)
                out["text_offset"].append(offset)
                offset += len(s)
            return out

        def echo_logprobs() -> dict:
            """The echoed prompt's tokens: the first has no logprob (nothing precedes it)."""
            plps = job.prompt_logprobs
            first = tok.token_bytes(ids[0]).decode("utf-8", "replace")
            out = legacy_logprobs(plps[1:], len(first))
            return {"tokens": [first] + out["tokens"], "token_logprobs": [None] + out["token_logprobs"],
                    "top_logprobs": [None] + out["top_logprobs"], "text_offset": [0] + out["text_offset"]}

        def finish(last) -> str:
            return "length" if last.finish_reason == "length" else "stop"

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def gen():
                last = None
                offset = len(echo_text)

                def chunk(text, finish=None, logprobs=None) -> str:
                    obj = dict(base)
                    obj["choices"] = [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]
                    if include_usage:
                        obj["usage"] = None
                    return _sse(obj)

                try:
                    if echo_text and not score_prompt:
                        yield chunk(echo_text)
                    async for ev in _job_events(job, None, _KEEPALIVE_S):
                        if ev is None:
                            yield ": keep-alive\n\n"
                            continue
                        if last is None and score_prompt:  # the prompt has been scored by now
                            yield chunk(echo_text, logprobs=echo_logprobs())
                        lp = None
                        if n_lp is not None and ev.logprobs:
                            lp = legacy_logprobs(ev.logprobs, offset)
                        offset += len(ev.text)
                        if ev.text or lp:
                            yield chunk(ev.text, logprobs=lp)
                        last = ev
                    if last is None:
                        return
                    yield chunk("", finish=finish(last))
                    if include_usage:
                        obj = dict(base)
                        obj["choices"] = []
                        obj["usage"] = _usage(last.prompt_tokens, last.completion_tokens)
                        yield _sse(obj)
                    yield "data: [DONE]\n\n"
                    log_done("completion (stream)", job, last, t_start)
                except Exception as exc:
                    err = _engine_error(exc)
                    job.logged = True
                    log.info("completion (stream) failed after %d completion tokens: %s",
                             job.completion_tokens, err.message)
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"
                finally:
                    job.cancel.set()

            return _JobStream(gen(), job, "completion (stream)")

        texts: list[str] = []
        lps: list = []
        last = None
        try:
            async for ev in _job_events(job, request):
                texts.append(ev.text)
                if ev.logprobs:
                    lps.extend(ev.logprobs)
                last = ev
        except _ClientGone:
            _log_gone("completion", job)
            return _JSON(error_body("client disconnected"), status_code=499)
        except Exception as exc:
            raise _engine_error(exc) from None
        finally:
            job.cancel.set()
        if last is None:
            raise APIError(503, "the generation was cancelled", type="server_error")
        log_done("completion", job, last, t_start)
        logprobs = None
        if n_lp is not None:
            logprobs = legacy_logprobs(lps, len(echo_text))
            if score_prompt:
                head = echo_logprobs()
                logprobs = {k: head[k] + logprobs[k] for k in head}
        choice = {"index": 0, "text": echo_text + "".join(texts), "logprobs": logprobs,
                  "finish_reason": finish(last)}
        return {**base, "choices": [choice], "usage": _usage(last.prompt_tokens, last.completion_tokens)}

    return app


# ----------------------------------------------------------------------------------------
# serve
# ----------------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
          model_name: str | None = None, max_queue: int = 8, default_max_tokens: int | None = None,
          log_level: str = "info") -> None:
    """Serve ``engine`` over HTTP with uvicorn until interrupted (``lily serve``).

    Binds to loopback by default; binding another address without ``api_key`` logs a
    warning. See :func:`create_app` for the other parameters. SIGINT (Ctrl-C) or SIGTERM
    stops the server: running and queued generations are cancelled at once (their
    requests get a 503, open streams a final error event and ``data: [DONE]``), and the
    function returns.

    Raises
    ------
    OSError
        The address cannot be bound (e.g. the port is taken); nothing has been served.
    """
    import uvicorn

    if not logging.getLogger().handlers and not log.handlers:
        logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(getattr(logging, log_level.upper(), logging.INFO))
    if not _is_loopback(host) and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach this address can use "
                    "the model (pass --api-key)", host)
    app = create_app(engine, model_name=model_name, api_key=api_key, max_queue=max_queue,
                     default_max_tokens=default_max_tokens)
    state: _State = app.state.lily

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname() if self.servers else (host, port)
                shown = f"[{bound[0]}]" if ":" in str(bound[0]) else bound[0]
                log.info("serving %s on http://%s:%d/v1", state.model_name, shown, bound[1])

        async def shutdown(self, sockets=None):
            state.begin_shutdown()  # before uvicorn waits for the open responses to finish
            await super().shutdown(sockets=sockets)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # A signal is how a server is meant to stop: return normally once it is down
            # rather than have uvicorn raise the signal again (KeyboardInterrupt, or death
            # by SIGTERM).
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    sock = _bind(host, port)
    try:
        Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                              timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        sock.close()


def _bind(host: str, port: int):
    """The listening socket, bound before anything says the server is up (as uvicorn binds
    it: IPv6 for an address with a colon, SO_REUSEADDR)."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except BaseException:
        sock.close()
        raise
    return sock
