"""One generation at a time: a worker thread that runs engine streams for queued jobs.

The engine is not thread-safe, so every generation runs on the single worker thread. HTTP
handlers (on the asyncio event loop) submit a :class:`Job`; the worker runs it and hands
each :class:`~lily.engine.StreamEvent` back to the loop through an ``asyncio.Queue``.
Setting ``job.cancel`` stops the generation between prefill chunks or decode steps (or
skips the job if it is still waiting), leaving the engine ready for the next job.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Callable, Iterator

from lily.server.protocol import APIError

log = logging.getLogger("lily.server")


class Job:
    """A queued generation: ``start(cancel)`` returns the engine's event iterator.

    Items handed to the event loop (``job.items``) are ``(kind, payload)`` pairs: ``"start"``
    with the prompt tokens the engine reuses from its cache (before the prefill; only for a
    job submitted with ``report_start``; the request handler sets ``cached_tokens``), ``"event"`` with a StreamEvent, ``"error"`` with
    an exception, ``"end"`` when the iterator is exhausted, ``"cancelled"`` when the job was
    cancelled before it started.
    """

    def __init__(self, start: Callable[[threading.Event], Iterator], loop: asyncio.AbstractEventLoop):
        self.start = start
        self.loop = loop
        self.cancel = threading.Event()
        self.items: asyncio.Queue = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.completion_tokens = 0  # tokens the request handler has received so far
        self.logged = False  # the request's one log line has been written
        self.prompt_logprobs: list | None = None  # set on the worker thread when the prompt is scored
        self.cached_tokens: int | None = None  # prompt tokens reused, once the engine has prepared the session

    def post(self, kind: str, payload=None) -> None:
        """Hand an item to the event loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel.set()

    def abort(self, exc: BaseException) -> None:
        """End the job now with ``exc`` for its request handler and cancel the generation
        (the worker stops it at the next prefill chunk or decode step, or skips it)."""
        self.cancel.set()
        self.post("error", exc)


class Worker:
    """The generation thread with a bounded waiting line.

    At most ``max_queue`` jobs wait while one runs; :meth:`submit` raises a 429
    :class:`APIError` beyond that. Jobs cancelled while waiting (their client went away)
    no longer count.
    """

    def __init__(self, max_queue: int = 8):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be a non-negative integer, got {max_queue!r}")
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._current: Job | None = None
        self._thread: threading.Thread | None = None
        self.start()

    def _counts(self) -> tuple[int, int]:
        running = 1 if self._current is not None else 0
        return running, sum(1 for j in self._waiting if not j.cancel.is_set())

    def counts(self) -> tuple[int, int]:
        """``(running, queued)``: the generation in progress (0 or 1) and the jobs waiting
        for it (not cancelled), read together."""
        with self._cond:
            return self._counts()

    @property
    def pending(self) -> int:
        """Running plus queued."""
        return sum(self.counts())

    @property
    def busy(self) -> bool:
        return self.counts()[0] == 1

    def start(self) -> None:
        """Start the generation thread unless it is running (again after :meth:`close`).

        After :meth:`close` the new thread gets a new, empty line; if the thread died any
        other way, the new one serves the jobs already waiting (so none is left hanging).
        """
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            if self._thread is None:
                self._waiting = collections.deque()
            self._thread = threading.Thread(target=self._run, name="lily-generation", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        self.start()
        with self._cond:
            running, queued = self._counts()
            if running + queued >= self.max_queue + 1:
                raise APIError(429, f"too many requests: {running + queued} generations are running or "
                                    f"queued (limit {self.max_queue + 1}); retry later",
                               type="rate_limit_error", code="queue_full")
            self._waiting.append(job)
            self._cond.notify_all()

    def jobs(self) -> list[Job]:
        """The running job (if any) and the waiting ones."""
        with self._cond:
            return ([self._current] if self._current is not None else []) + list(self._waiting)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the running and waiting jobs and end the thread (waiting at most
        ``timeout`` seconds for the running generation to stop)."""
        with self._cond:
            thread = self._thread
            self._thread = None
            if thread is None:
                return
            waiting, self._waiting = list(self._waiting), collections.deque()
            cur = self._current
            if cur is not None:
                cur.cancel.set()
            self._cond.notify_all()
        for job in waiting:
            job.cancel.set()
            job.post("cancelled")
        if thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while self._thread is me and not self._waiting:
                    self._cond.wait()
                if self._thread is not me:  # closed
                    return
                job = self._waiting.popleft()
                if job.cancel.is_set():
                    job.post("cancelled")
                    continue
                self._current = job  # dequeued and running in one step: counts() stays exact
            job.started = time.perf_counter()
            try:
                for ev in job.start(job.cancel):
                    job.post("event", ev)
                job.post("end")
            except BaseException as exc:  # reported to the request; the worker lives on
                if not isinstance(exc, (ValueError, LookupError)):
                    log.exception("generation failed")
                if not isinstance(exc, Exception):  # e.g. SystemExit raised by a plug-in
                    exc = RuntimeError(f"generation aborted: {type(exc).__name__}: {exc}")
                job.post("error", exc)
            finally:
                with self._cond:
                    if self._current is job:
                        self._current = None
