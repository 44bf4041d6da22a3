"""The Lily HTTP server: :func:`create_app` assembles the APIs (one module each, over the
shared core in :mod:`lily.server.core`, :mod:`lily.server.errors` and
:mod:`lily.server.streaming`) into a FastAPI app; :func:`serve` runs it with uvicorn
(what ``lily serve`` does).

The APIs: OpenAI chat completions and completions (:mod:`lily.server.openai_api`), the
model card and health (:mod:`lily.server.models`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging

from fastapi import FastAPI

from lily.engine import DEMO_MODEL_NAME, model_display_name
from lily.scheduler import DEFAULT_BATCH, DEFAULT_INTERLEAVE, DEFAULT_QUEUE
from lily.server import anthropic_api, models, openai_api, responses_api
from lily.server.core import ServerState, log
from lily.server.errors import Gate, JSONOut, install_error_handlers

__all__ = ["DEMO_MODEL_NAME", "create_app", "serve"]


def _default_model_name(engine) -> str:
    """:attr:`lily.engine.Engine.name` (one rule with the chat banner); "lily" for an engine
    stand-in without a path."""
    path = getattr(engine, "path", None)
    return model_display_name(path) if path is not None else "lily"


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None,
               max_queue: int = DEFAULT_QUEUE, default_max_tokens: int | None = None,
               strict_model_name: bool = False, max_stored_responses: int = 256,
               clamp_max_tokens: bool = False, max_batch: int = DEFAULT_BATCH,
               prefill_interleave: int = DEFAULT_INTERLEAVE, default_reasoning: bool | None = None,
               strip_billing_header: bool = True) -> FastAPI:
    """An ASGI app serving ``engine`` through the OpenAI chat completions, completions and
    Responses APIs and the Anthropic Messages API.

    Parameters
    ----------
    engine : lily.engine.Engine
        A loaded engine (anything with the same ``stream``/``tokenizer``/``max_context``/
        ``generation_defaults`` interface).
    model_name : str | None
        The model id the server advertises (default:
        :func:`lily.engine.model_display_name`: ``lily-demo-shakespeare`` for the embedded
        demo model, otherwise the checkpoint directory's name).
    api_key : str | None
        When set, ``/v1/*`` requests need ``Authorization: Bearer <api_key>`` (or
        ``x-api-key: <api_key>``, as Anthropic clients send it).
    max_queue : int
        Requests that may wait for a place in the batch (default 256); more get HTTP 429
        with ``Retry-After``.
    default_max_tokens : int | None
        Chat completions and Responses without ``max_tokens`` / ``max_output_tokens`` stop
        after this many tokens (default: :attr:`lily.engine.Engine.chat_max_tokens`, 4096
        or the checkpoint's ``max_new_tokens``; always capped to the room left in the
        context). ``/v1/completions`` defaults to 16, as OpenAI's API.
    strict_model_name : bool
        Refuse requests naming another model (404 ``model_not_found``); by default any name
        means the one model served.
    max_stored_responses : int
        Responses kept for ``previous_response_id`` (the oldest is dropped first).
    clamp_max_tokens : bool
        A request whose prompt + ``max_tokens`` (``max_output_tokens``, ...) exceeds the
        context window is served with the limit capped to the room left instead of getting
        HTTP 400 ``context_length_exceeded`` (the default, as OpenAI's and Anthropic's APIs
        do). For agent tools that send a fixed limit larger than a local window.
    max_batch : int
        Generations that decode together (continuous batching, 1 to 8, default 4; fewer
        when the device's memory holds fewer sequences): :class:`lily.scheduler.Scheduler`.
    prefill_interleave : int
        Tokens of a new prompt's prefill chunk while other requests decode (default 1024):
        the most one of their steps waits for it (docs/server.md "Several requests at once").
    default_reasoning : bool | None
        Whether a request that does not say thinks (None: the chat template's default, on
        for Qwen3.6); each API's own field overrides it (docs/server.md, "Reasoning").
    strip_billing_header : bool
        Leave Claude Code's ``x-anthropic-billing-header: ... cch=<nonce>`` line out of a
        Messages request's system prompt (:func:`lily.server.anthropic_api.system_text`):
        its nonce changes with every request and would defeat the prompt cache.

    Raises
    ------
    lily.errors.InvalidParameterError
        ``max_batch``, ``max_queue`` or ``prefill_interleave`` out of range.
    """
    state = ServerState(engine, model_name or _default_model_name(engine), api_key, max_queue,
                        default_max_tokens, strict_model_name, clamp_max_tokens, max_batch, prefill_interleave,
                        default_reasoning, strip_billing_header)
    state.responses = responses_api.ResponseStore(max_stored_responses)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.closing = False
        state.worker.start()
        try:
            yield
        finally:
            state.begin_shutdown()
            state.worker.close(timeout=2.0)

    app = FastAPI(title="Lily", description="OpenAI- and Anthropic-compatible API of the Lily inference engine",
                  version="0.1.0", lifespan=lifespan, default_response_class=JSONOut)
    app.state.lily = state
    app.add_middleware(Gate, api_key=api_key)
    install_error_handlers(app)
    for api in (models, openai_api, anthropic_api, responses_api):
        app.include_router(api.router)
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
          model_name: str | None = None, strict_model_name: bool = False, max_queue: int = DEFAULT_QUEUE,
          default_max_tokens: int | None = None, log_level: str = "info",
          clamp_max_tokens: bool = False, max_batch: int = DEFAULT_BATCH,
          prefill_interleave: int = DEFAULT_INTERLEAVE, default_reasoning: bool | None = None,
          strip_billing_header: bool = True) -> None:
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
                     default_max_tokens=default_max_tokens, strict_model_name=strict_model_name,
                     clamp_max_tokens=clamp_max_tokens, max_batch=max_batch, prefill_interleave=prefill_interleave,
                     default_reasoning=default_reasoning, strip_billing_header=strip_billing_header)
    state: ServerState = app.state.lily

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname() if self.servers else (host, port)
                shown = f"[{bound[0]}]" if ":" in str(bound[0]) else bound[0]
                log.info("serving %s on http://%s:%d/v1; %s", state.model_name, shown, bound[1],
                         state.defaults_line())

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
