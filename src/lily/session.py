"""A session: one sequence of a backend (its KV cache, conv and recurrent state) and the
tokens whose effect is in it, with the one place where state is reused (the session's own
tokens, the prompt cache) and the one chunked-prefill loop that feeds it.

:class:`lily.engine.Engine` keeps one (sequence 0, :attr:`lily.engine.Engine.tokens`);
:class:`lily.scheduler.Scheduler` keeps one per row.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Sequence

import numpy as np

from lily.prompt_cache import PromptCache, snapshot_points


class Session:
    """Sequence ``seq`` of ``backend`` and ``tokens``, the ids whose effect is in its state.

    ``cache`` is the prompt cache it restores from and stores into (None: none);
    ``im_start`` the ``<|im_start|>`` id that places snapshots (:func:`snapshot_points`).
    """

    def __init__(self, backend, seq: int = 0, cache: PromptCache | None = None, im_start: int | None = None):
        self.backend = backend
        self.seq = seq
        # the session's calls name no sequence: a backend of one session serves the engine
        self._on = {} if seq == 0 else {"seq": seq}
        self.cache = cache
        self.im_start = im_start
        self.tokens: list[int] = []
        self.snap_points: list[int] = []  # positions of the running prefill to snapshot
        self.cache_key: str | None = None  # the running request's prompt_cache_key

    @property
    def position(self) -> int:
        """Tokens in the sequence's state (the backend's count)."""
        return self.backend.position if self.seq == 0 else self.backend.sequence_position(self.seq)

    def reset(self) -> None:
        """Empty the state and the tokens."""
        self.backend.reset(**self._on)
        self.tokens = []

    def prepare(self, prompt_ids: list[int], cache_key: str | None = None) -> list[int]:
        """Prepare the state for ``prompt_ids`` and return the tokens still to compute (at
        least one: the last prompt token's logits select the first output): the one place
        where state is reused. ``len(prompt_ids) - len(result)`` is the request's
        ``cached_tokens``.

        The state is kept when the prompt extends its tokens; otherwise the longest prefix
        in the prompt cache is restored when it is longer (a restore that fails drops that
        entry and starts from an empty state). Sets the snapshot positions of the prefill
        that follows (:func:`lily.prompt_cache.snapshot_points`); ``cache_key`` is the
        request's ``prompt_cache_key`` hint for the cache's eviction."""
        n = len(self.tokens)
        start = n if n < len(prompt_ids) and prompt_ids[:n] == self.tokens else 0
        cache = self.cache
        self.cache_key = cache_key
        entry = cache.lookup(prompt_ids, len(prompt_ids) - 1, cache_key) if cache is not None else None
        if entry is not None and entry.length > start:
            try:
                self.backend.restore(entry.state, **self._on)
                self.tokens = entry.tokens.tolist()
                start = entry.length
            except Exception:  # noqa: BLE001 - a bad entry must not take the engine down
                cache.discard(entry)
                start = 0
        if start == 0:
            self.reset()
        self.snap_points = snapshot_points(prompt_ids, start, self.im_start) if cache is not None else []
        if cache is not None:
            cache.record(start, len(prompt_ids) - start)
        return prompt_ids[start:]

    def reusable(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens :meth:`prepare` would keep from the state itself (not the cache)."""
        n = len(self.tokens)
        return n if n < len(prompt_ids) and list(prompt_ids[:n]) == self.tokens else 0

    def pieces(self, new: list[int], chunk: int) -> Iterator[list[int]]:
        """``new`` (the tokens after the session's) in prefill pieces of at most ``chunk``
        tokens that end at the snapshot positions."""
        base, s = len(self.tokens), 0
        for p in self.snap_points + [base + len(new)]:
            while base + s < p:
                e = min(p - base, s + chunk)
                yield new[s:e]
                s = e

    def feed_start(self, new: list[int], chunk: int) -> int:
        """Where the feed of a generation starts in ``new``: the last prefill chunk, or after
        the last snapshot position (every snapshot is taken while prefilling, before the
        device starts generating)."""
        tail = len(new) - ((len(new) - 1) % chunk + 1)
        if self.snap_points:
            tail = max(tail, self.snap_points[-1] - len(self.tokens))
        return tail

    def run_pieces(self, pieces, cancel: threading.Event | None, on_logits: Callable | None = None,
                   snapshot: bool = True) -> bool:
        """The one chunked-prefill loop: run ``pieces`` (lists of checked ids) into the
        state in order, ``cancel`` checked before each; with ``snapshot`` the prompt cache
        stores the session at the planned positions. ``on_logits``: each piece then runs
        with every position's logits, passed on as float32 ``[len(piece), vocab_size]``.
        Returns False when cancelled; a cancel or a failure leaves an empty session (a
        partial prefill is no usable state)."""
        try:
            for piece in pieces:
                if cancel is not None and cancel.is_set():
                    self.reset()
                    return False
                arr = np.asarray(piece, dtype=np.int64)
                if on_logits is None:
                    self.backend.prefill(arr, **self._on)
                else:
                    logits = self.backend.forward(arr, all_logits=True, **self._on)
                self.piece_done(arr.tolist(), snapshot)
                if on_logits is not None:
                    on_logits(logits)
        except BaseException:
            self.reset()
            raise
        return True

    def piece_done(self, piece: list[int], snapshot: bool = True) -> None:
        """After a prefill piece ran: its tokens are in the state; with ``snapshot`` the
        prompt cache stores the session at a planned position."""
        self.tokens.extend(piece)
        if snapshot and self.cache is not None and len(self.tokens) in self.snap_points:
            self.store()

    def store(self) -> None:
        """Store the state in the prompt cache (when it holds exactly :attr:`tokens`)."""
        if self.cache is not None and self.tokens and len(self.tokens) == self.position:
            self.cache.insert(self.tokens, self.backend.snapshot(**self._on), key=self.cache_key)
