"""The generation queue: HTTP handlers submit jobs to the engine's scheduler
(:class:`lily.scheduler.Scheduler`), which runs up to ``max_batch`` of them at once on its own
thread (continuous batching) and queues the rest; each :class:`~lily.engine.StreamEvent` comes
back to the event loop through the job's ``asyncio.Queue``. Setting ``job.cancel`` stops the
generation at the next decode step or prefill chunk, freeing its row (or drops the job if it
is still waiting).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from lily.errors import QueueFullError
from lily.scheduler import DEFAULT_INTERLEAVE, DEFAULT_QUEUE, DEFAULT_BATCH, Request, Scheduler
from lily.server.protocol import APIError

log = logging.getLogger("lily.server")


class Job:
    """A generation submitted through :meth:`Worker.submit`.

    Items handed to the event loop (``job.items``) are ``(kind, payload)`` pairs: ``"start"``
    with the prompt tokens the engine reuses from its cache (before the prefill; only for a
    job submitted with ``report_start``; the request handler sets ``cached_tokens``),
    ``"event"`` with a StreamEvent, ``"error"`` with an exception, ``"cancelled"`` when the
    job was cancelled before it started.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.cancel = threading.Event()
        self.items: asyncio.Queue = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.request: Request | None = None
        self.completion_tokens = 0  # tokens the request handler has received so far
        self.logged = False  # the request's one log line has been written
        self.prompt_logprobs: list | None = None  # filled on the scheduler's thread when the prompt is scored
        self.cached_tokens: int | None = None  # prompt tokens reused, once the engine has prepared the session

    @property
    def started(self) -> float | None:
        """When the job got a row (``time.perf_counter``), None while it waits."""
        return self.request.started if self.request is not None else None

    def post(self, kind: str, payload=None) -> None:
        """Hand an item to the event loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel.set()

    def abort(self, exc: BaseException) -> None:
        """End the job now with ``exc`` for its request handler and cancel the generation
        (the scheduler stops it at the next prefill chunk or decode step, or drops it)."""
        self.cancel.set()
        self.post("error", exc)

    def _event(self, ev) -> None:
        if ev.finish_reason == "cancelled" and (self.request is None or self.request.started is None):
            self.post("cancelled")  # never started (a shutdown, or its client went away while queued)
        else:
            self.post("event", ev)


class Worker:
    """The engine's scheduler for the server: ``max_batch`` generations decode together,
    ``max_queue`` more may wait (default 256: an agent's burst waits rather than fails);
    :meth:`submit` raises a 429 :class:`APIError` with ``retry_after`` beyond that. Jobs
    cancelled while waiting no longer count. ``prefill_interleave``: the scheduler's."""

    def __init__(self, engine, max_queue: int = DEFAULT_QUEUE, max_batch: int = DEFAULT_BATCH,
                 prefill_interleave: int = DEFAULT_INTERLEAVE):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be a non-negative integer, got {max_queue!r}")
        self.engine = engine
        self.max_queue, self.max_batch, self.prefill_interleave = max_queue, max_batch, prefill_interleave
        self._lock = threading.Lock()
        self._jobs: list[Job] = []
        self.scheduler: Scheduler | None = None
        self.ensure_scheduler()  # its options are checked at once (a ValueError names the bad one)

    def ensure_scheduler(self) -> Scheduler:
        """The scheduler the jobs run on, made (with this worker's options) if there is none."""
        if self.scheduler is None:
            self.scheduler = Scheduler(self.engine, max_batch=self.max_batch, max_queue=self.max_queue,
                                       prefill_interleave=self.prefill_interleave)
        return self.scheduler

    def start(self) -> None:
        """Start the scheduler's thread unless it runs (a new scheduler after :meth:`close`)."""
        self.ensure_scheduler().start()

    def submit(self, job: Job, ids: list[int], params, *, report_start: bool = False, **kw) -> None:
        """Queue ``job``: a generation of ``ids`` with ``params`` and the scheduler's keywords
        (``constraint``, ``prompt_cache_key``, ``score``). Raises a 429 :class:`APIError`
        (``retry_after`` set) when the queue is full."""
        self.start()
        on_start = (lambda cached: job.post("start", cached)) if report_start else None
        def on_error(exc: BaseException) -> None:  # reported to the request; the scheduler lives on
            if not isinstance(exc, (ValueError, LookupError)):
                log.error("generation failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
            job.post("error", exc)

        try:
            job.request = self.scheduler.submit(ids, params, cancel=job.cancel, on_start=on_start,
                                                on_event=job._event, on_error=on_error, **kw)
        except QueueFullError as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                           retry_after=exc.retry_after) from None
        with self._lock:
            self._jobs = [j for j in self._jobs if not (j.request and j.request.done)] + [job]

    def counts(self) -> tuple[int, int]:
        """``(running, queued)``: the generations with a row and the jobs waiting for one
        (not cancelled), read together."""
        return self.scheduler.counts() if self.scheduler is not None else (0, 0)

    def info(self) -> dict:
        """The scheduler's state (:meth:`lily.scheduler.Scheduler.info`)."""
        return self.ensure_scheduler().info()

    @property
    def pending(self) -> int:
        """Running plus queued."""
        return sum(self.counts())

    @property
    def busy(self) -> bool:
        return self.counts()[0] > 0

    def jobs(self) -> list[Job]:
        """The jobs running or waiting."""
        with self._lock:
            return [j for j in self._jobs if not (j.request and j.request.done)]

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the running and waiting jobs and stop the scheduler (waiting at most
        ``timeout`` seconds); a later :meth:`start` makes a new one."""
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is not None:
            scheduler.close(timeout)
