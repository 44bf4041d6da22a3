"""The shared core of Lily's HTTP APIs: server state, request checks, the generation queue
and its streaming plumbing, error handling, and the app's middleware.

Each API lives in its own module (:mod:`lily.server.openai_api`, :mod:`lily.server.models`)
as a FastAPI router; the handlers reach the :class:`ServerState` through
``request.app.state.lily`` (:func:`state_of`). Errors are raised as
:class:`~lily.server.protocol.APIError` and answered in the shape of the API the request
was sent to (:func:`error_response`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import time
from typing import Any, AsyncIterator, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lily.errors import ContextLengthError, LilyError
from lily.server.protocol import APIError
from lily.server.worker import Job, Worker

log = logging.getLogger("lily.server")

DEMO_MODEL_NAME = "lily-demo-shakespeare"
_INT32_MAX = (1 << 31) - 1
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "seed")
_MIN_LOGPROB = -9999.0
_DISCONNECT_POLL_S = 0.25
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "null"}
KEEPALIVE_S = 10.0  # SSE comment while a stream waits (queue, long prefill)


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def dumps(obj: Any) -> str:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # an unpaired surrogate echoed from the request: escape it
        text = json.dumps(obj, ensure_ascii=True, separators=(",", ":"))
    return text


class JSONOut(JSONResponse):
    """JSON responses that never fail to encode (see :func:`_dumps`)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def check_unicode(text: str, param: str) -> None:
    """400 for text with an unpaired surrogate (JSON allows ``"\\ud800"``; it is not Unicode
    text and no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} contains an unpaired surrogate (U+{ord(text[exc.start]):04X} at "
                            f"character {exc.start}): not valid Unicode text", param=param,
                       code="invalid_value") from None


def param_of(message: str) -> str | None:
    m = re.search(r"parameter (\w+)=", message)
    return m.group(1) if m else None


def shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")


class ServerState:
    """What every API handler shares: the engine, the generation worker, the served model's
    name and the server-wide options. One per app, as ``app.state.lily``."""

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
        (:func:`lily.server.serve` does)."""
        if self.closing:
            return
        self.closing = True
        jobs = self.worker.jobs()
        if jobs:
            log.info("shutting down: ending %d running or queued generation(s)", len(jobs))
        for job in jobs:
            job.abort(shutdown_error())

    # -- request checks ------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        """404 ``model_not_found`` for a model name other than the one served."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    @staticmethod
    def check_n(n: int | None, best_of: int | None = None) -> None:
        if n is not None and n != 1:
            raise APIError(400, f"n={n} is not supported: only n=1", param="n", code="invalid_value")
        if best_of is not None and best_of != 1:
            raise APIError(400, f"best_of={best_of} is not supported: only 1", param="best_of",
                           code="invalid_value")

    def sampling_params(self, req, max_tokens: int | None, logprobs: bool = False, top_logprobs: int = 0,
                        stop: tuple[str, ...] | None = None):
        """The engine's :class:`~lily.sampling.SamplingParams` for a request: the checkpoint's
        defaults with the request's sampling fields (those of ``_SAMPLING_FIELDS`` that ``req``
        has and sets), its ``stop`` strings (or ``stop``) and ``max_tokens``. 400 when a value
        is out of range."""
        kw: dict[str, Any] = {}
        for name in _SAMPLING_FIELDS:
            v = getattr(req, name, None)
            if v is not None:
                kw[name] = v
        top_k = kw.get("top_k")
        if top_k is not None and not -1 <= top_k <= _INT32_MAX:
            raise APIError(400, f"invalid sampling parameter top_k={top_k}: must be -1 or 0 (both disable "
                                f"top-k) or a count in [1, {_INT32_MAX}]", param="top_k", code="invalid_value")
        if top_k == -1:  # vLLM's "disabled"
            kw["top_k"] = 0
        req_stop = getattr(req, "stop", None) if stop is None else stop
        if req_stop is not None:
            kw["stop"] = (req_stop,) if isinstance(req_stop, str) else tuple(req_stop)
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        kw["logprobs"] = bool(logprobs)
        kw["top_logprobs"] = top_logprobs if logprobs else 0
        try:
            return self.engine.generation_defaults.replace(**kw)
        except (LilyError, ValueError, TypeError) as exc:
            msg = str(exc)
            raise APIError(400, msg, param=param_of(msg), code="invalid_value") from None

    def check_prompt_ids(self, ids: list[int], param: str) -> None:
        """400 for an empty prompt, a token id outside the vocabulary, or a prompt that
        fills the context window (``context_length_exceeded``)."""
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        if self.vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt", code="invalid_value")
        if len(ids) >= self.engine.max_context:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the context window is "
                                f"{self.engine.max_context} tokens", param=param,
                           code="context_length_exceeded")

    def default_max_tokens_for(self, n_prompt: int) -> int:
        """``max_tokens`` of a chat request that sets none: ``--default-max-tokens``, else
        the room left in the context window."""
        return self.default_max_tokens or max(1, self.engine.max_context - n_prompt)

    # -- generation ------------------------------------------------------------------------

    def submit(self, ids: list[int], params, prompt_logprobs: int | None = None, **engine_kw) -> Job:
        """Queue the generation (429 when the line is full, 503 while shutting down). With
        ``prompt_logprobs`` (the number of alternatives), the job first scores the prompt
        (see :func:`scored_stream`) into ``job.prompt_logprobs``. ``engine_kw`` goes to
        ``engine.stream`` as is."""
        if self.closing:
            raise shutdown_error()
        engine = self.engine
        if prompt_logprobs is None:
            def start(cancel):
                return engine.stream(ids, params, cancel=cancel, **engine_kw)
        else:
            def start(cancel):
                return scored_stream(engine, job, ids, params, prompt_logprobs, cancel)
        job = Job(start, asyncio.get_running_loop())
        self.worker.submit(job)
        return job

    @staticmethod
    def log_done(kind: str, job: Job, last, started: float) -> None:
        """The request's one log line: token counts, finish reason, queue wait and speeds."""
        if last is None:
            return
        job.logged = True
        t = last.timings
        wait = (job.started - job.submitted) if job.started else 0.0
        log.info("%s: %d prompt + %d completion tokens, finish=%s, queued %.2fs, prefill %.1f tok/s, "
                 "decode %.1f tok/s, total %.2fs", kind, last.prompt_tokens, last.completion_tokens,
                 last.finish_reason, wait, t.prefill_tokens_per_s if t else 0.0,
                 t.decode_tokens_per_s if t else 0.0, time.perf_counter() - started)


def state_of(request: Request) -> ServerState:
    """The app's :class:`ServerState` (a FastAPI dependency)."""
    return request.app.state.lily

def log_gone(kind: str, job: Job) -> None:
    if job.started is None:
        log.info("%s: client disconnected while queued, request dropped", kind)
    else:
        log.info("%s: client disconnected after %d completion tokens, generation cancelled",
                 kind, job.completion_tokens)


class JobStream(StreamingResponse):
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
                log_gone(self.kind, job)


class ClientGone(Exception):
    pass


class Gate:
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
                    err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                   code="invalid_api_key")
                    body = dumps(error_payload(scope.get("path", ""), err)).encode()
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


async def job_events(job: Job, request: Request | None, keepalive: float | None = None) -> AsyncIterator:
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
                        raise ClientGone()
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


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, (LilyError, ValueError)):
        return APIError(400, str(exc), param=param_of(str(exc)))
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


def openai_usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def scored_stream(engine, job: Job, ids: list[int], params, n_top: int, cancel) -> Iterator:
    """Run on the worker thread for ``/v1/completions`` with ``echo`` and ``logprobs``: score
    the prompt, then generate.

    ``job.prompt_logprobs`` gets one entry per prompt token, ``None`` for the first and
    otherwise the :class:`~lily.sampling.TokenLogprob` of ``ids[i]`` under the model's
    distribution after ``ids[:i]`` (raw logits, with ``n_top`` alternatives, as for
    generated tokens). The pass prefills ``ids[:-1]`` with ``all_logits=True`` into a fresh
    session (the engine's ``prefill`` appends to whatever the session holds) in
    ``PREFILL_CHUNK`` pieces, checking ``cancel`` between them; the generation then extends
    that session, so only the last prompt token is prefilled again. A cancelled or failed
    pass leaves an empty session.
    """
    from lily.engine import PREFILL_CHUNK
    from lily.sampling import Sampler, SamplingParams

    scorer = Sampler(SamplingParams(top_logprobs=n_top, seed=0))
    scored: list = [None]
    head = ids[:-1]
    engine.reset()
    try:
        for s in range(0, len(head), PREFILL_CHUNK):
            if cancel.is_set():
                engine.reset()
                return
            logits = engine.prefill(head[s:s + PREFILL_CHUNK], all_logits=True)
            for j, row in enumerate(logits):
                scored.append(scorer.logprob(row, ids[s + j + 1]))
    except BaseException:
        engine.reset()
        raise
    job.prompt_logprobs = scored
    yield from engine.stream(ids, params, cancel=cancel)


# ----------------------------------------------------------------------------------------
# errors: one handler set, each API's own error shape
# ----------------------------------------------------------------------------------------

# (path prefix, body of an APIError): the first matching prefix wins; OpenAI's shape otherwise
_ERROR_SHAPES: list[tuple[str, Callable[[APIError], dict]]] = []


def register_error_shape(prefix: str, shape: Callable[[APIError], dict]) -> None:
    """Answer errors of requests whose path starts with ``prefix`` with ``shape(err)``
    (an API module calls this for its paths)."""
    _ERROR_SHAPES[:] = [(p, s) for p, s in _ERROR_SHAPES if p != prefix] + [(prefix, shape)]
    _ERROR_SHAPES.sort(key=lambda ps: -len(ps[0]))


def error_payload(path: str, err: APIError) -> dict:
    """The JSON body of ``err`` in the shape of the API that ``path`` belongs to."""
    for prefix, shape in _ERROR_SHAPES:
        if path.startswith(prefix):
            return shape(err)
    return err.body()


def error_response(path: str, err: APIError) -> JSONOut:
    # a full queue or a shutdown is temporary: say when a retry makes sense (RFC 9110 10.2.3)
    headers = {"Retry-After": "1"} if err.status in (429, 503) else None
    return JSONOut(error_payload(path, err), status_code=err.status, headers=headers)


def validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the first field pydantic rejected (and how many more there are)."""
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
    return APIError(400, msg, param=param, code="invalid_value" if param else None)


def install_error_handlers(app: FastAPI) -> None:
    """Every error a request can meet becomes a JSON answer in its API's shape: APIError,
    body validation, unknown routes and methods, LilyError, and (500) anything else."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        log.info("%s %s -> %d %s", request.method, request.url.path, exc.status, exc.message)
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = validation_error(exc)
        log.info("%s %s -> 400 %s", request.method, request.url.path, err.message)
        return error_response(request.url.path, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code)
        return JSONOut(error_payload(request.url.path, err), status_code=exc.status_code,
                       headers=getattr(exc, "headers", None))

    @app.exception_handler(LilyError)
    async def _lily_error(request: Request, exc: LilyError):
        return error_response(request.url.path, engine_error(exc))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        err = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
        return JSONOut(error_payload(request.url.path, err), status_code=500)


# ----------------------------------------------------------------------------------------
# chat generations: engine events -> parser deltas, for every chat-shaped API
# ----------------------------------------------------------------------------------------


class ChatRun:
    """One chat generation read as parser output: the single place where the engine's
    StreamEvents become reasoning / content / tool-call :class:`~lily.chat_output.Delta`
    batches, which each API then encodes in its own wire format.

    Iterate :meth:`steps`; afterwards ``last`` is the final StreamEvent (``None`` when the
    job was cancelled before it started) and ``n_reasoning`` the generated tokens that went
    to the reasoning (the closing tag included).
    """

    def __init__(self, job: Job, parser):
        self.job = job
        self.parser = parser
        self.last = None
        self.n_reasoning = 0
        self.finished = False

    def finish(self) -> list:
        """The parser's last deltas if the generation ended without a final event."""
        if self.finished:
            return []
        self.finished = True
        return self.parser.finish()

    async def steps(self, request: Request | None = None, keepalive: float | None = None):
        """Yield ``(deltas, event)`` per engine event (the parser flushed on the final one),
        or ``(None, None)`` after ``keepalive`` idle seconds; arguments as :func:`job_events`.
        Raises the engine's exception, or :class:`ClientGone`."""
        parser = self.parser
        async for ev in job_events(self.job, request, keepalive):
            if ev is None:
                yield None, None
                continue
            if parser.mode == "reasoning":
                self.n_reasoning += len(ev.token_ids)
            deltas = parser.feed(ev.text)
            if ev.finish_reason is not None:
                deltas = deltas + self.finish()
            self.last = ev
            yield deltas, ev
