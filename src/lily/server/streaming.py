"""The generation's way out to a client, shared by every chat-shaped API: the job's events
(:func:`job_events`) read as parser deltas (:class:`ChatRun`) and as output blocks
(:class:`BlockSequencer`), the SSE response that cancels its generation however it ends
(:class:`JobStream`), and the two ends of a request: collecting a non-streaming reply
(:func:`collect`) and a stream's failure (:func:`stream_failed`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from lily.chat_output import Delta
from lily.server.core import ServerState
from lily.server.errors import JSONOut, dumps, engine_error, error_payload
from lily.server.protocol import APIError
from lily.server.worker import Job

log = logging.getLogger("lily.server")

_DISCONNECT_POLL_S = 0.25
KEEPALIVE_S = 10.0  # SSE comment while a stream waits (queue, long prefill)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


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


async def job_events(job: Job, request: Request | None, keepalive: float | None = None) -> AsyncIterator:
    """Yield the job's StreamEvents; raise the engine's exception if it failed.

    With ``request`` given (non-streaming responses), the client connection is polled so a
    disconnect cancels the generation. With ``keepalive`` (streaming responses), ``None``
    is yielded after that many idle seconds (queue wait, long prefill) so the caller can
    send an SSE comment; also once when the engine has prepared the session of a job
    submitted with ``report_start`` (``job.cached_tokens`` is then set).
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
            if kind == "start":
                job.cached_tokens = payload
                if keepalive is not None:  # the stream that asked may now report the split
                    yield None
            elif kind == "event":
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
        self.token_ids: list[int] = []  # every generated token (for stop_string_hit)
        self.text = ""  # the engine's visible text, before parsing

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
            self.token_ids.extend(ev.token_ids)
            self.text += ev.text
            deltas = parser.feed(ev.text)
            if ev.finish_reason is not None:
                deltas = deltas + self.finish()
            self.last = ev
            yield deltas, ev

    def stop_string_hit(self, tokenizer, stops) -> str | None:
        """The stop string that ended the generation, or ``None`` (it ended on EOS, length,
        or there were no stop strings). The engine drops the stop string from the text and
        ends a stop-string hit on an event that carries the token (EOS: none); the string is
        found in what the generated tokens decode to beyond the visible text."""
        last = self.last
        stops = [s for s in (stops or ()) if s]
        if not stops or last is None or last.finish_reason != "stop" or not last.token_ids:
            return None
        full = tokenizer.decode_lenient(self.token_ids)
        rest = full[len(self.text):] if full.startswith(self.text) else full
        hits = [(rest.find(s), s) for s in stops if s in rest]
        return min(hits)[1] if hits else stops[0]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prompt cache (0 when the engine does not say)."""
        return int(getattr(self.last, "cached_tokens", 0) or 0)


@dataclass
class Block:
    """One output block of a chat reply: ``kind`` is ``"reasoning"``, ``"content"`` or
    ``"tool"``; ``text`` the block's text (for a tool call: its JSON arguments), ``index``
    its position in the reply; tool calls also have ``name`` and ``call_id``."""

    kind: str
    index: int
    text: str = ""
    name: str = ""
    call_id: str = ""


class BlockSequencer:
    """Parser deltas as a sequence of blocks, each started, extended and stopped before the
    next starts: the output structure of the Anthropic Messages and OpenAI Responses APIs
    (content blocks, output items). :meth:`feed` and :meth:`close` return ``(what, block,
    text)`` steps, ``what`` being ``"start"``, ``"delta"`` (with the new ``text``) or
    ``"stop"``; ``blocks`` holds every block so far."""

    def __init__(self):
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self._calls: dict[int, Block] = {}  # parser call index -> its block

    def _start(self, out: list, kind: str, **kw) -> Block:
        out.extend(self.close())
        block = Block(kind, len(self.blocks), **kw)
        self.blocks.append(block)
        self.open = block
        out.append(("start", block, ""))
        return block

    def feed(self, deltas: list[Delta]) -> list[tuple[str, Block, str]]:
        out: list[tuple[str, Block, str]] = []
        for d in deltas:
            if d.kind in ("reasoning", "content"):
                if not d.text:
                    continue
                block = self.open
                if block is None or block.kind != d.kind:
                    block = self._start(out, d.kind)
            elif d.kind == "tool_start":
                self._calls[d.index] = self._start(out, "tool", name=d.name, call_id=d.call_id)
                continue
            elif d.kind == "tool_args":
                block = self._calls.get(d.index)
                if block is None or not d.text:
                    continue
            else:
                continue
            block.text += d.text
            out.append(("delta", block, d.text))
        return out

    def close(self) -> list[tuple[str, Block, str]]:
        """Stop the open block (at the end of the reply)."""
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [("stop", block, "")]

    async def stream(self, run: ChatRun, keepalive: float | None):
        """Yield the steps of a streamed generation as they come, the last block's stop
        included, and ``None`` after ``keepalive`` idle seconds (for a keep-alive)."""
        async for deltas, ev in run.steps(None, keepalive):
            if ev is None:
                yield None
                continue
            for step in self.feed(deltas):
                yield step
        if run.last is not None:
            for step in self.feed(run.finish()) + self.close():
                yield step


async def collect(state: ServerState, run: ChatRun, request: Request, kind: str, consume,
                  t_start: float) -> JSONOut | None:
    """Run a non-streaming chat generation to its end, handing every ``(deltas, event)``
    step to ``consume`` (the parser's last deltas with event ``None``), and log it.

    Returns ``None`` when done, or the 499 answer when the client went away (the generation
    is cancelled). Raises the engine's failure as an :class:`APIError`, and a 503 when the
    job was cancelled before it started (shutdown).
    """
    job = run.job
    try:
        async for deltas, ev in run.steps(request):
            consume(deltas, ev)
    except ClientGone:
        log_gone(kind, job)
        return JSONOut(error_payload(request.url.path, APIError(499, "client disconnected")), status_code=499)
    except Exception as exc:
        raise engine_error(exc) from None
    finally:
        job.cancel.set()
    consume(run.finish(), None)
    if run.last is None:
        raise APIError(503, "the generation was cancelled", type="server_error")
    state.log_done(kind, job, run.last, t_start, run.parser.n_tool_calls)
    return None


def stream_failed(kind: str, job: Job, exc: Exception) -> APIError:
    """A stream's failure after it started, as the APIError to send (and logged once)."""
    err = engine_error(exc)
    job.logged = True
    log.info("%s failed after %d completion tokens: %s", kind, job.completion_tokens, err.message)
    return err
