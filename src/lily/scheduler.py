"""Continuous batching (issue 31): several generations decode together on one engine.

A :class:`Scheduler` runs each request as a *row*: a session of the backend (its own
sequence: KV cache, conv and recurrent state, ring, token slots, sampler settings) and the
request's :class:`lily.generation.Generation`. Rows join and leave between steps. Every
iteration of the loop (:meth:`Scheduler.run_until_idle`, or the thread of
:meth:`Scheduler.start`) does, in this order:

1. **admission**: queued requests get a row while there are fewer than ``max_batch`` and the
   device has memory for another sequence (its KV cache at the context window and its
   state, reserved when the row starts; ``Backend.sequence_room``); a finished row's
   session is kept for the next request (its tokens: a request that extends them computes
   only the rest, as the engine's session does), and the prompt cache serves every row;
2. **one prefill chunk** of a row still prefilling, the rows prefilling taking turns (so a
   short prompt arriving behind a long one is not held for the whole long prompt): at most
   ``prefill_interleave`` tokens while other rows run (the whole device chunk for a row
   alone), cut only where it does not change the result (docs/decode.md "Batched decode");
3. **one decode step** of every decoding row whose input is ready (the device's own token,
   or a host-sampled row's token once the host has it), in one command buffer;
4. **take**: the results of everything committed before that step, which stays queued on
   the device while the host turns the tokens into events (the token hand-off of the
   engine's loop, for every row).

So a long prompt delays the running rows by at most one chunk of ``prefill_interleave``
tokens per step, and it reaches its first token after ``ceil(new tokens / interleave)``
of its own chunks, each behind at most one chunk of every other row prefilling then
(:meth:`Scheduler.bounds`); a request that arrives while a row prefills alone also waits
for the chunk already on the device (up to the device chunk). The scheduler records
what it ran in :attr:`Scheduler.trace` (``("chunk", seq, tokens)``, ``("step", seqs)``, and
``("start", seq)`` / ``("end", seq)`` when a row takes and frees a sequence), which the tests
count instead of timing.

Each row's tokens are those it gets alone: the device's batched step computes every row
with its own arithmetic (docs/decode.md), prefill pieces end where the engine's would, and a
piece is cut smaller only on a device whose prefill does not depend on the cuts
(``Backend.chunk_invariant``).

A scheduler borrows the engine's own session for a row when no other holder has it
(saving a sequence's memory): while a row runs on it, the engine's session methods
(``generate``, ``stream``, ``prefill``, ...) refuse to run; between requests they work, and
:attr:`lily.engine.Engine.tokens` shows what the last row left in it. The engine and its
schedulers share one device: drive them from one thread at a time.
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from lily.backend import host_pick
from lily.constraints import Constraint
from lily.errors import InvalidParameterError, LilyError, QueueFullError
from lily.generation import ChatResult, Generation, GenerationResult, StreamEvent, collect
from lily.sampling import Sampler, SamplingParams
from lily.session import Session

#: Rows that decode together at most (the batched kernels' limit, metal/decode_args.h).
MAX_BATCH = 8
DEFAULT_BATCH = 4
#: Requests that may wait for a row by default: an agent's burst of subagents and
#: background calls waits rather than fails.
DEFAULT_QUEUE = 256
#: Tokens of a prefill chunk while other rows decode: each decode step waits for at most one.
DEFAULT_INTERLEAVE = 1024
_TRACE = 4096  # entries of Scheduler.trace kept


class Request:
    """A generation submitted to a :class:`Scheduler` (:meth:`Scheduler.submit`).

    Without callbacks its events queue up for :meth:`events` / :meth:`result`; with
    ``on_event`` (and ``on_error``) they are handed over on the scheduler's thread as they
    come. ``cancel`` (a :class:`threading.Event`) stops it at the next step or chunk (a
    final event with ``finish_reason="cancelled"``); :attr:`started` is None while it waits
    for a row.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, constraint: Constraint | None,
                 cache_key: str | None, cancel: threading.Event | None, on_start, on_event, on_error, score):
        self.prompt_ids = prompt_ids
        self.params = params
        self.constraint = constraint
        self.cache_key = cache_key
        self.cancel = cancel if cancel is not None else threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.finished: float | None = None
        self.cached_tokens: int | None = None
        self.last: StreamEvent | None = None
        self.error: BaseException | None = None
        self._on_start, self._on_event, self._on_error, self._score = on_start, on_event, on_error, score
        self._events: queue.SimpleQueue | None = None if on_event is not None else queue.SimpleQueue()
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        """The final event (or the error) has been handed over."""
        return self._done.is_set()

    def _emit(self, ev: StreamEvent) -> None:
        if ev.finish_reason is not None:
            self.last = ev
            self.finished = time.perf_counter()
        if self._on_event is not None:
            self._on_event(ev)
        else:
            self._events.put(ev)
        if ev.finish_reason is not None:
            self._done.set()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self.finished = time.perf_counter()
        if self._on_error is not None:
            self._on_error(exc)
        elif self._events is not None:
            self._events.put(exc)
        self._done.set()

    def result(self, drive: Callable[[], bool] | None = None) -> GenerationResult:
        """Its events collected into a :class:`lily.generation.GenerationResult` (waits for
        the end; ``drive`` as :meth:`events`)."""
        return collect(self.events(drive))

    def events(self, drive: Callable[[], bool] | None = None) -> Iterator[StreamEvent]:
        """Its events as they come, the final one last; raises the generation's failure.
        ``drive`` (the scheduler's one iteration) runs the loop on this thread when no
        thread does."""
        if self._events is None:
            raise InvalidParameterError("this request hands its events to on_event")
        while True:
            try:
                item = self._events.get(timeout=0.05) if drive is None else self._events.get_nowait()
            except queue.Empty:
                if drive is not None and not drive():
                    time.sleep(0.001)
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


class _Row:
    """One request on one session (module doc); ``state``: ``prefill`` (pieces, then the
    feed), ``decode`` (steps), ``drain`` (ended or budget spent: its steps in flight are
    waited for and their outputs dropped)."""

    def __init__(self, request: Request, session: Session):
        self.request = request
        self.session = session
        self.seq = session.seq
        self.gen: Generation | None = None
        self.state = "prefill"
        self.served = 0  # the scheduler's prefill turn that last ran a chunk of this row (0: none yet)
        self.pieces: collections.deque[list[int]] = collections.deque()
        self.piece: list[int] | None = None  # the piece being run, cut smaller on chunk-invariant devices
        self.offset = 0
        self.feed: list[int] = []  # the feed not yet committed (None until the device run starts)
        self.device = False  # the device picks this row's tokens
        self.sampler: Sampler | None = None
        self.token: int | None = None  # the next step's input when the host knows it
        self.ready = False
        self.untaken = 0  # committed tickets with this row not yet taken
        self.run_steps = 0  # steps of the current device run (the feed's last token's included)
        self.encoded = 0
        self.start_pos = 0
        self.gpu: float | None = None
        self.failed: BaseException | None = None


class Scheduler:
    """Several generations at once on ``engine`` (module doc).

    Parameters
    ----------
    engine : lily.engine.Engine
        The engine whose backend, prompt cache, tokenizer and sampling defaults serve every
        row; its session serves a row when free (module doc).
    max_batch : int
        Rows that decode together, 1 to :data:`MAX_BATCH` (default 4); fewer when the
        device's memory holds fewer sequences.
    max_queue : int
        Requests that may wait for a row (default 256); :meth:`submit` raises
        :class:`lily.errors.QueueFullError` beyond.
    prefill_interleave : int
        Tokens of a prefill chunk while other rows decode (default 1024, at least 16, at
        most the device's chunk): the most a step waits for a new prompt. A device whose
        prefill is not chunk-invariant (the reference) runs its own chunks whole.

    Raises
    ------
    InvalidParameterError
        An option out of range.
    """

    def __init__(self, engine, *, max_batch: int = DEFAULT_BATCH, max_queue: int = DEFAULT_QUEUE,
                 prefill_interleave: int = DEFAULT_INTERLEAVE):
        for name, v, lo, hi in (("max_batch", max_batch, 1, MAX_BATCH), ("max_queue", max_queue, 0, None),
                                ("prefill_interleave", prefill_interleave, 16, None)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise InvalidParameterError(f"{name} must be an integer {bound}, got {v!r}")
        self.engine = engine
        self.backend = engine.backend
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.chunk = self.backend.prefill_chunk
        # a device whose prefill depends on where chunks are cut runs the engine's pieces whole
        self.interleave = min(prefill_interleave, self.chunk) if self.backend.chunk_invariant else self.chunk
        self.trace: collections.deque = collections.deque(maxlen=_TRACE)
        self._turn = 0  # prefill chunks run so far: the rows prefilling take turns (_iterate)
        self._sessions: list[Session] = []  # sequences it opened (and the engine's while a row runs on it)
        self._busy: set[int] = set()  # sequences of the rows
        self._rows: list[_Row] = []
        self._queue: collections.deque[Request] = collections.deque()
        self._inflight: collections.deque = collections.deque()  # (ticket, rows, kind)
        self._cond = threading.Condition()
        self._loop_lock = threading.Lock()  # one loop at a time (a thread, or the callers of run_until_idle)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._served = 0
        self._mean_s: float | None = None  # mean seconds a request held a row

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ public

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               constraint: Constraint | None = None, prompt_cache_key: str | None = None,
               cancel: threading.Event | None = None, on_start: Callable[[int], None] | None = None,
               on_event: Callable[[StreamEvent], None] | None = None,
               on_error: Callable[[BaseException], None] | None = None,
               score: Callable[[np.ndarray], None] | None = None, **overrides) -> Request:
        """Queue a generation of ``prompt`` (text or ids) with ``params`` and ``overrides``
        as :meth:`lily.engine.Engine.stream` takes them (and ``constraint``, a
        :class:`lily.structured.Grammar` included, and ``prompt_cache_key``). ``on_start(cached)``
        is called once the row's session is prepared; ``on_event`` / ``on_error`` receive its
        events and its failure on the scheduler's thread (without them, read
        :meth:`Request.events`). ``score(rows)`` asks for teacher-forced logits of the prompt
        first: the row starts from an empty session, and the prompt but its last token runs
        with every position's float32 logits handed to ``score`` piece by piece.

        Raises :class:`InvalidParameterError` / :class:`lily.errors.ContextLengthError` for
        bad input (checked here, as the engine checks it) and
        :class:`lily.errors.QueueFullError` when ``max_queue`` requests wait already."""
        engine = self.engine
        p = engine.resolve_params(params, overrides)
        ids = engine.encode_prompt(prompt)
        if constraint is not None and hasattr(constraint, "for_prompt"):
            constraint = constraint.for_prompt(engine, ids)
        req = Request(ids, p, constraint, prompt_cache_key, cancel, on_start, on_event, on_error, score)
        with self._cond:
            if self._closed:
                raise InvalidParameterError("the scheduler is closed")
            waiting = sum(1 for r in self._queue if not r.cancel.is_set())
            if len(self._rows) + waiting >= self.max_batch + self.max_queue:  # it would wait beyond the queue
                retry = self.retry_after()
                raise QueueFullError(f"too many requests: {len(self._rows)} generating and {waiting} not yet started, "
                                     f"which fills the batch ({self.max_batch}) and the queue limit "
                                     f"{self.max_queue}; retry in about {retry} s", retry)
            self._queue.append(req)
            self._cond.notify_all()
        return req

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               **kw) -> Iterator[StreamEvent]:
        """:meth:`submit`, then its events as they come (the loop runs on this thread when
        the scheduler has no thread of its own)."""
        req = self.submit(prompt, params, **kw)
        return req.events(None if self.running else self._drive)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 **kw) -> GenerationResult:
        """Like :meth:`stream`, collected into a :class:`lily.generation.GenerationResult`."""
        return collect(self.stream(prompt, params, **kw))

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, **kw) -> ChatResult:
        """:meth:`lily.engine.Engine.chat` through the scheduler (safe to call from several
        threads at once while the scheduler runs on its own, :meth:`start`)."""
        engine = self.engine
        prompt = engine.chat_prompt(messages, tools, chat_template_kwargs)
        return engine.chat_result(self.generate(engine.tokenizer.encode(prompt), params, **kw), prompt, tools)

    def generate_many(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None,
                      **kw) -> list[GenerationResult]:
        """Every prompt at once (up to ``max_batch`` decoding together, the rest queued), each
        collected as :meth:`generate` would; in the order of ``prompts``. Raises the first
        failure."""
        reqs = [self.submit(p, params, **kw) for p in prompts]
        if not self.running:
            self.run_until_idle()
        return [collect(r.events(None if self.running else self._drive)) for r in reqs]

    @property
    def running(self) -> bool:
        """A thread of its own runs the loop (:meth:`start`)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def thread_ident(self) -> int | None:
        """The ident of the loop's own thread (None without one)."""
        return self._thread.ident if self._thread is not None else None

    def start(self) -> None:
        """Run the loop on a thread of its own until :meth:`close` (the server's way)."""
        with self._cond:
            if self._closed:
                raise InvalidParameterError("the scheduler is closed")
            if self.running:
                return
            self._thread = threading.Thread(target=self._run, name="lily-scheduler", daemon=True)
            self._thread.start()

    def run_until_idle(self) -> None:
        """Run the loop on this thread until no request is queued or running."""
        while self._drive() or self._rows or self._inflight or self._pending():
            pass

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the running and queued requests, stop the loop and give the engine its
        session back (the other sequences are freed)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for r in self._queue:
                r.cancel.set()
            for row in self._rows:
                row.request.cancel.set()
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            with self._loop_lock:
                self._finish_all()

    def counts(self) -> tuple[int, int]:
        """``(running, queued)``: requests with a row, and requests waiting (not cancelled)."""
        with self._cond:
            return len(self._rows), sum(1 for r in self._queue if not r.cancel.is_set())

    def retry_after(self) -> int:
        """Seconds after which a request refused for a full queue is likely to be taken:
        the mean time a request held a row so far times the requests that must start before
        it (those queued, and itself), over the rows (1 s per request before any finished);
        at least 1, at most 600."""
        waiting = sum(1 for r in self._queue if not r.cancel.is_set())
        mean = self._mean_s if self._mean_s is not None else 1.0
        return int(min(600, max(1, math.ceil(mean * (waiting + 1) / self.max_batch))))

    def info(self) -> dict:
        """Its state for ``/health``: rows running and allowed, sequences in use, requests
        queued and allowed, whether a new request would wait (``full``), the device memory
        a row reserves and how many more sequences fit (None: no limit known)."""
        running, queued = self.counts()
        room = self.backend.sequence_room()
        idle = len(self._sessions) - running + self.engine.session_free
        can_open = sum(1 for s in self._sessions if s.seq != 0) < self.max_batch and room != 0
        return {"running": running, "queued": queued, "max_batch": self.max_batch, "max_queue": self.max_queue,
                "sequences": len(self._sessions), "row_bytes": self.backend.sequence_bytes(),
                "sequence_room": room,
                "full": queued > 0 or running >= self.max_batch or (idle <= 0 and not can_open),
                "prefill_interleave": self.interleave, "served": self._served}

    def bounds(self, prompt_tokens: int, prefilling: int = 0) -> dict:
        """The scheduler's bounds, in units of work rather than seconds: a prompt of
        ``prompt_tokens`` new tokens, with ``prefilling`` other rows prefilling beside it,
        reaches its first token after at most ``iterations`` loop iterations (each one
        prefill chunk of at most ``interleave`` tokens and one decode step of the rows
        decoding then; the rows prefilling take turns, plus its own first step), and a decode
        step waits for at most ``stall_chunk_tokens`` tokens of other prompts. Not counted: a
        chunk already on the device when the request arrives (up to the device chunk, when
        a row was prefilling alone). Multiply by a chunk's and a step's time
        (``lily estimate``) for seconds."""
        turns = math.ceil(prompt_tokens / self.interleave)
        return {"iterations": turns * (1 + prefilling) + 1, "interleave": self.interleave,
                "stall_chunk_tokens": self.interleave}

    # ------------------------------------------------------------------ the loop

    def _pending(self) -> bool:
        with self._cond:
            return bool(self._queue)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed and not self._rows and not self._inflight:
                    break
                if not self._rows and not self._inflight and not self._queue:
                    self._cond.wait(0.1)
                    continue
            if not self._drive():
                time.sleep(0.001)  # rows waiting for nothing the loop can do now (e.g. a cancel's drain)
        with self._loop_lock:
            self._finish_all()

    def _drive(self) -> bool:
        """One iteration (module doc); whether it did anything."""
        with self._loop_lock:
            try:
                return self._iterate()
            except BaseException as exc:  # the device (or a plug-in) failed: every row in flight ends with it
                err = exc if isinstance(exc, Exception) else RuntimeError(
                    f"generation aborted: {type(exc).__name__}: {exc}")
                self._fail_all(err)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)) and self._thread is None:
                    raise  # the caller's own thread was interrupted
                return True

    def _iterate(self) -> bool:
        did = self._reap()
        did = self._admit() or did
        prefilling = [r for r in self._rows if r.state == "prefill" and not r.failed]
        committed = False
        if prefilling:  # the rows prefilling take turns: the one served longest ago (the oldest first)
            row = min(prefilling, key=lambda r: r.served)
            self._turn += 1
            row.served = self._turn
            self._prefill(row)
            committed = did = True
        ready = [r for r in self._rows
                 if r.state == "decode" and r.ready and r.encoded < r.run_steps and r.untaken < 2]
        if ready:
            self._step(ready)
            committed = did = True
        # everything but the newest work, which stays queued on the device while the host
        # reads the rest, when it has a row the device feeds itself (a host row waits for
        # its logits anyway)
        while self._inflight and (len(self._inflight) > 1 or not committed or
                                  not any(r.device for r in self._inflight[-1][1])):
            self._take()
            did = True
        return self._reap() or did

    # -- admission --------------------------------------------------------------------------

    def _admit(self) -> bool:
        did = False
        while True:
            with self._cond:
                if not self._queue:
                    return did
                req = self._queue[0]
                if req.cancel.is_set() or self._closed:
                    self._queue.popleft()
                    did = True
                    req._emit(StreamEvent("", [], None, "cancelled", len(req.prompt_ids), 0, None, 0))
                    continue
                if len(self._rows) >= self.max_batch:
                    return did
                session = self._free_session(req)
                if session is None:
                    return did
                self._queue.popleft()
            self._start_row(req, session)
            did = True

    def _free_session(self, req: Request) -> Session | None:
        """An idle session for ``req``: the one whose tokens the prompt extends furthest,
        else the least recently used (the engine's own when no one holds it, then those
        opened); a new sequence while fewer than ``max_batch`` are open and the device has
        room; else None (the request waits)."""
        idle = [s for s in self._sessions if s.seq not in self._busy]
        engine = self.engine
        if engine.session_free and engine.session not in self._sessions:
            idle.insert(0, engine.session)
        while idle:
            best = max(idle, key=lambda s: s.reusable(req.prompt_ids))
            if best is engine.session and best not in self._sessions:
                if not engine.lend_session(self):  # the engine took it meanwhile
                    idle.remove(best)
                    continue
                self._sessions.append(best)
            return best
        opened = sum(1 for s in self._sessions if s.seq != 0)
        room = self.backend.sequence_room()
        if opened >= self.max_batch or room == 0:
            return None
        session = Session(self.backend, self.backend.open_sequence(), engine.prompt_cache, engine.im_start)
        self._sessions.append(session)
        return session

    def _start_row(self, req: Request, session: Session) -> None:
        self._sessions.remove(session)
        self._sessions.append(session)  # most recently used last
        self._busy.add(session.seq)
        self.trace.append(("start", session.seq))
        row = _Row(req, session)
        self._rows.append(row)
        engine = self.engine
        session.cache = engine.prompt_cache
        req.started = time.perf_counter()
        try:
            ids = req.prompt_ids
            if req._score is not None:  # the prompt scored first, from an empty session
                session.reset()
                session.cache_key, session.snap_points = req.cache_key, []
                row.pieces = collections.deque(ids[:-1][s:s + self.chunk] for s in range(0, len(ids) - 1, self.chunk))
                new = ids[-1:]  # then the last token extends the scored session (the engine counts
                tail = 0        # the scored tokens as reused, as a request extending a session)
            else:
                new = session.prepare(ids, req.cache_key)
                tail = session.feed_start(new, self.chunk)
                row.pieces = collections.deque(session.pieces(new[:tail], self.chunk))
            cached = len(ids) - len(new)
            req.cached_tokens = cached
            if req._on_start is not None:
                req._on_start(cached)
            row.gen = engine.generation(ids, req.params, req.constraint, cached)
            row.feed = new[tail:]
            row.device = self.backend.samples_on_device and req.constraint is None
        except Exception as exc:  # noqa: BLE001 - reported to its request
            self._fail_row(row, exc)

    # -- prefill ----------------------------------------------------------------------------

    def _cut(self, n: int) -> int:
        """Tokens of the next chunk of a piece with ``n`` tokens left: the interleave while
        other rows run or wait, else the device chunk; never leaving a one-token rest (a
        single token runs as a decode step, other kernels)."""
        if not self.backend.chunk_invariant:
            return n
        limit = self.interleave if len(self._rows) > 1 or self._pending() else self.chunk
        m = min(limit, n)
        return m - 1 if n - m == 1 else m

    def _prefill(self, row: _Row) -> None:
        backend, seq = self.backend, row.seq
        try:
            if row.piece is None and row.pieces:
                row.piece, row.offset = row.pieces.popleft(), 0
            if row.piece is not None:
                rest = row.piece[row.offset:]
                if row.request._score is not None:  # teacher-forced logits of the whole piece
                    logits = backend.forward(np.asarray(rest, dtype=np.int64), all_logits=True, seq=seq)
                    row.request._score(logits)
                    n = len(rest)
                elif len(row.piece) == 1 and backend.chunk_invariant:
                    # a one-token piece runs as a decode step there (other kernels), as the
                    # native forward() runs it; its output is dropped
                    self._commit(backend.submit_step([(seq, rest[0], False)]), [row], "drop")
                    n = 1
                else:
                    n = self._cut(len(rest))
                    backend.submit_chunk(seq, np.asarray(rest[:n], dtype=np.int64))
                self.trace.append(("chunk", seq, n))
                row.offset += n
                if row.offset == len(row.piece):
                    row.session.piece_done(row.piece, snapshot=row.request._score is None)
                    row.piece = None
                return
            self._feed(row)
        except Exception as exc:  # noqa: BLE001 - the row's input: reported to its request
            if isinstance(exc, LilyError) or isinstance(exc, ValueError):
                self._fail_row(row, exc)
            else:
                raise

    def _feed(self, row: _Row) -> None:
        """The device run's start (the feed's first chunk), or its next chunk: the last one
        picks the first token (the device's sampler, or the host from its logits)."""
        backend, seq, gen = self.backend, row.seq, row.gen
        if row.run_steps == 0 and row.encoded == 0 and not row.ready:
            # the run starts: the feed and the steps it may take, as Backend.start counts them
            row.start_pos = row.session.position
            gen.feed = list(row.feed)
            history = row.request.prompt_ids if gen.n_out == 0 else row.session.tokens + gen.feed
            if row.device:
                backend.begin(seq, row.request.params, history)
            else:
                row.sampler = Sampler(row.request.params, history)
            cap = self.engine.max_context - (row.start_pos + len(gen.feed) - 1) if row.device else gen.steps_left
            row.run_steps = max(0, min(gen.steps_left, cap))
            if row.run_steps == 0:
                self._no_steps(row)
                return
        feed = row.feed
        if len(feed) == 1 and (row.device or backend.chunk_invariant):  # step 0 is a decode step
            row.feed = []
            if row.device:
                row.token, row.ready, row.state = feed[0], True, "decode"
                return
            self._commit(backend.submit_step([(seq, feed[0], True)]), [row], "first")
        else:
            n = self._cut(len(feed))
            last = n == len(feed)
            tokens = np.asarray(feed[:n], dtype=np.int64)
            row.feed = feed[n:]
            self.trace.append(("chunk", seq, n))
            if not last:
                backend.submit_chunk(seq, tokens)
                return
            self._commit(backend.submit_chunk(seq, tokens, sample=row.device, logits=not row.device), [row], "first")
        row.encoded = 1
        row.state = "decode"
        row.ready = row.device  # the device hands its token to the next step; the host waits for the logits

    def _no_steps(self, row: _Row) -> None:
        """A run with no step left (the prompt fills the context): the feed runs as the
        engine's would (a device leaves its last token out) and the generation ends."""
        feed = row.feed
        run = feed[:-1] if row.device else feed
        for s in range(0, len(run), self.chunk):
            self.backend.submit_chunk(row.seq, np.asarray(run[s:s + self.chunk], dtype=np.int64))
        row.feed = []
        self._deliver(row, None)

    # -- decode -----------------------------------------------------------------------------

    def _step(self, rows: list[_Row]) -> None:
        ticket = self.backend.submit_step([(r.seq, r.token, not r.device) for r in rows])
        self.trace.append(("step", tuple(r.seq for r in rows)))
        for r in rows:
            r.encoded += 1
            r.token = None
            r.ready = r.device
        self._commit(ticket, rows, "step")

    def _commit(self, ticket: int, rows: list[_Row], kind: str) -> None:
        for r in rows:
            r.untaken += 1
        self._inflight.append((ticket, rows, kind))

    def _take(self) -> None:
        ticket, rows, kind = self._inflight.popleft()
        results, gpu = self.backend.take(ticket)
        for row, res in zip(rows, results):
            row.untaken -= 1
            if gpu is not None:
                row.gpu = (row.gpu or 0.0) + gpu
            if kind == "drop" or row.state != "decode" or row.failed:
                continue
            try:
                if row.device:
                    step = (res.token, res.logprob)
                else:
                    step = host_pick(row.sampler, res.logits, row.gen.constraint, row.request.params.logprobs)
                    row.token, row.ready = step[0], True
                self._deliver(row, step)
            except Exception as exc:  # noqa: BLE001 - the row's own failure (its constraint, sampler)
                self._fail_row(row, exc)

    def _deliver(self, row: _Row, step) -> None:
        gen = row.gen
        gen.device_time(row.gpu)
        row.request._emit(gen.push(step))
        if gen.done or gen.spent:
            row.state = "drain"
        elif row.encoded >= row.run_steps and row.untaken == 0:  # the run has no step left
            row.request._emit(gen.push(None))
            row.state = "drain"

    # -- the end of a row -------------------------------------------------------------------

    def _reap(self) -> bool:
        """Cancelled rows end; drained rows (nothing in flight) finish, or go on after a
        spent thinking budget."""
        did = False
        for row in list(self._rows):
            gen = row.gen
            if row.request.cancel.is_set() and gen is not None and not gen.done and not row.failed:
                row.request._emit(gen.cancelled())
                if row.state == "prefill":  # a partial prefill is no usable state
                    row.session.reset()
                    row.start_pos, gen.feed, gen.outs = 0, [], []
                row.state = "drain"
                did = True
            if row.untaken or not (row.state == "drain" or row.failed):
                continue
            if gen is not None and gen.spent and not gen.done and not row.failed:
                self._restart(row)
            else:
                self._finish(row)
            did = True
        return did

    def _restart(self, row: _Row) -> None:
        """The thinking budget was spent: keep what the device computed, output the close,
        then run the answer from the live session (the close is the next run's feed)."""
        gen, session = row.gen, row.session
        session.tokens.extend(gen.consumed(session.position - row.start_pos))
        while gen.forced and not gen.done:
            if row.request.cancel.is_set():
                row.request._emit(gen.cancelled())
                break
            row.request._emit(gen.forced_token())
        if gen.done:
            row.state = "drain"
            row.start_pos = session.position
            return
        row.feed = gen.restart_feed()
        row.state, row.run_steps, row.encoded, row.ready, row.token = "prefill", 0, 0, False, None

    def _finish(self, row: _Row) -> None:
        try:
            self._end(row)
        finally:
            self._rows.remove(row)
            self._busy.discard(row.seq)
            self.trace.append(("end", row.seq))
            if row.session is self.engine.session:  # the engine's again between requests
                self._sessions.remove(row.session)
                self.engine.return_session(self)

    def _end(self, row: _Row) -> None:
        gen, session = row.gen, row.session
        if row.failed is not None or gen is None:
            try:
                session.reset()
            except Exception:  # noqa: BLE001 - the device may be gone; the row is released anyway
                session.tokens = []
            return
        session.tokens.extend(gen.consumed(session.position - row.start_pos))
        gen.close(row.gpu)
        if gen.finish_reason not in (None, "cancelled"):
            session.store()  # the end of the generated text: the next turn may extend it
        held = time.perf_counter() - (row.request.started or row.request.submitted)
        self._mean_s = held if self._mean_s is None else 0.8 * self._mean_s + 0.2 * held
        self._served += 1

    def _fail_row(self, row: _Row, exc: BaseException) -> None:
        if row.failed is None:
            row.failed = exc
            row.request._fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        """A backend call failed: whatever was in flight is lost; every row ends with the
        failure and its session is emptied (queued requests stay)."""
        while self._inflight:
            ticket = self._inflight.popleft()[0]
            try:
                self.backend.take(ticket)
            except Exception:  # noqa: BLE001 - the same failure, or a later one of the same batch
                pass
        for row in list(self._rows):
            row.untaken = 0
            self._fail_row(row, exc)
            self._finish(row)

    def _finish_all(self) -> None:
        """After the loop stopped: end what is left, free the sequences opened and give the
        engine its session back."""
        for row in list(self._rows):
            self._fail_row(row, InvalidParameterError("the scheduler was closed"))
        if self._rows or self._inflight:
            self._fail_all(InvalidParameterError("the scheduler was closed"))
        with self._cond:
            for r in self._queue:
                r._emit(StreamEvent("", [], None, "cancelled", len(r.prompt_ids), 0, None, 0))
            self._queue.clear()
        for s in self._sessions:
            if s.seq != 0:
                try:
                    self.backend.close_sequence(s.seq)
                except Exception:  # noqa: BLE001 - freeing is best effort at shutdown
                    pass
        self._sessions = []
        self.engine.return_session(self)
