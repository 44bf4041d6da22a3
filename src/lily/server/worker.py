"""One generation at a time: a worker thread that runs engine streams for queued jobs.

The engine is not thread-safe, so every generation runs on the single worker thread. HTTP
handlers (on the asyncio event loop) submit a :class:`Job`; the worker runs it and hands
each :class:`~lily.engine.StreamEvent` back to the loop through an ``asyncio.Queue``.
Setting ``job.cancel`` stops the generation between prefill chunks or decode steps (or
skips the job if it is still waiting), leaving the engine ready for the next job.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Callable, Iterator

from lily.server.protocol import APIError

log = logging.getLogger("lily.server")


class Job:
    """A queued generation: ``start(cancel)`` returns the engine's event iterator."""

    def __init__(self, start: Callable[[threading.Event], Iterator], loop: asyncio.AbstractEventLoop):
        self.start = start
        self.loop = loop
        self.cancel = threading.Event()
        self.items: asyncio.Queue = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.started: float | None = None

    def post(self, kind: str, payload=None) -> None:
        """Hand an item to the event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel.set()


class Worker:
    """The generation thread with a bounded waiting line.

    At most ``max_queue`` jobs wait while one runs; :meth:`submit` raises a 429
    :class:`APIError` beyond that.
    """

    def __init__(self, max_queue: int = 8):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be a non-negative integer, got {max_queue!r}")
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not yet finished (waiting + running)
        self._current: Job | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.start()

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def busy(self) -> bool:
        return self._current is not None

    def start(self) -> None:
        """Start the generation thread unless it is running (again after :meth:`close`).

        After :meth:`close` the new thread gets a new, empty line; if the thread died any
        other way, the new one serves the jobs already waiting (so none is left hanging).
        """
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if self._thread is None:
                self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._run, args=(self._queue,),
                                            name="lily-generation", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        self.start()
        with self._lock:
            if self._pending >= self.max_queue + 1:
                raise APIError(429, f"too many requests: {self._pending} generations are running or "
                                    f"queued (limit {self.max_queue + 1}); retry later",
                               type="rate_limit_error", code="queue_full")
            self._pending += 1
            self._queue.put(job)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the running and waiting jobs and end the thread."""
        with self._lock:
            thread, q = self._thread, self._queue
            self._thread = None
            if thread is None:
                return
            for job in list(q.queue):
                if job is not None:
                    job.cancel.set()
            q.put(None)
            cur = self._current
            if cur is not None:
                cur.cancel.set()
        thread.join(timeout)

    def _run(self, q: queue.Queue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            try:
                if job.cancel.is_set():
                    job.post("cancelled")
                    continue
                self._current = job
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
                self._current = None
                with self._lock:
                    self._pending -= 1
