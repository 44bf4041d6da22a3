"""Errors and the admission gate of Lily's HTTP APIs: JSON encoding that never fails, the
mapping of engine failures to :class:`~lily.server.protocol.APIError`, each API's own error
shape (:func:`register_error_shape`, :func:`error_response`), the app's exception handlers,
and :class:`Gate`, the middleware that checks the API key and reads POST bodies as JSON.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lily.errors import ContextLengthError, LilyError
from lily.server.protocol import APIError

log = logging.getLogger("lily.server")

_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "null"}


def dumps(obj: Any) -> str:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # an unpaired surrogate echoed from the request: escape it
        text = json.dumps(obj, ensure_ascii=True, separators=(",", ":"))
    return text


class JSONOut(JSONResponse):
    """JSON responses that never fail to encode (see :func:`dumps`)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def param_of(message: str) -> str | None:
    m = re.search(r"parameter (\w+)=", message)
    return m.group(1) if m else None


def shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, (LilyError, ValueError)):
        return APIError(400, str(exc), param=param_of(str(exc)))
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


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
    headers = {"Retry-After": str(err.retry_after or 1)} if err.status in (429, 503) else None
    return JSONOut(error_payload(path, err), status_code=err.status, headers=headers)


def validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the first field pydantic rejected (and how many more there are)."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    # drop "body" and pydantic's union-member tags ("str", "list[str]", ...) from the path
    loc = [str(p) for p in first.get("loc", ())
           if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    param = ".".join(loc) or None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object", code="invalid_value")
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


def _auth_hint(path: str) -> str:
    """The 401 message: both headers work on every path (see :class:`Gate`); Anthropic's
    clients send ``x-api-key``, so its API names that one first."""
    bearer, x_key = "'Authorization: Bearer <key>'", "'x-api-key: <key>'"
    first, second = (x_key, bearer) if path.startswith("/v1/messages") else (bearer, x_key)
    return f"invalid or missing API key: send it as {first} or {second}"


class Gate:
    """ASGI middleware in front of ``/v1/``: checks the API key (``Authorization: Bearer``
    or ``x-api-key``) before anything else is looked at, and reads POST bodies as JSON
    whatever their declared type (``curl -d`` sends ``application/x-www-form-urlencoded``
    unless told otherwise)."""

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
                if scheme.lower() != b"bearer":  # Anthropic's clients send the key as x-api-key
                    token = next((v for k, v in headers if k == b"x-api-key"), b"")
                if not token.strip() or not hmac.compare_digest(token.strip(), self.api_key):
                    log.info("%s %s -> 401 bad or missing API key", scope.get("method"), scope.get("path"))
                    err = APIError(401, _auth_hint(scope.get("path", "")), code="invalid_api_key")
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
