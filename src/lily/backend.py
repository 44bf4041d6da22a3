"""The host contract: what a device provides to :class:`lily.engine.Engine` and
:class:`lily.scheduler.Scheduler`, and the host sampling loop that backends without a device
sampler (the reference) or requests the device sampler cannot serve (constrained decoding)
use behind the same contract.

Every backend holds sequences, each a session (KV cache, conv and recurrent state) at its
own position: sequence 0 is the engine's session, the others are opened for the rows of a
batch. Input is checked by the engine before it reaches a backend: token ids are a 1-D
integer array inside the vocabulary, and they fit in the context window. A backend keeps
only the guards it needs for memory safety (the native core's bounds checks).
"""

from __future__ import annotations

import itertools
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from lily.constraints import Constraint, apply_mask
from lily.sampling import Sampler, SamplingParams, TokenLogprob

Step = tuple[int, TokenLogprob | None]


class RowResult(NamedTuple):
    """One row's result of a batched call (:meth:`Backend.take`): the sequence, the position
    of the input token, and either the token the device chose (with its
    :class:`TokenLogprob` when the generation asked for logprobs) or the row's float32
    logits ``[vocab]`` for the host to sample."""

    seq: int
    position: int
    token: int | None
    logprob: TokenLogprob | None
    logits: np.ndarray | None


class Backend(Protocol):
    """Sessions of the model on one device.

    Generation on the engine's session (sequence 0) runs as ``start`` / ``next`` ... /
    ``finish``: ``start`` takes the tokens still to feed (>= 1), ``next`` returns one
    generated token at a time (and its :class:`TokenLogprob` when ``params.logprobs``),
    ``None`` once ``steps`` tokens were returned; ``finish`` ends the generation.
    Afterwards ``position`` counts the feed and every returned token except possibly the
    last (the engine reads ``position`` to know which tokens are in the state; a device
    may have run one speculative step ahead and discards it).

    Several sequences decode together through the batched calls (``submit_chunk``,
    ``submit_step``, ``take``), which :class:`lily.scheduler.Scheduler` drives: work is
    committed at once and taken in commit order, so a device that runs asynchronously keeps
    the next step queued while the host reads the last one.
    """

    name: str
    #: Tokens per prefill chunk: the device's choice (scratch memory is sized for one
    #: chunk on native devices). The engine checks cancellation between chunks.
    prefill_chunk: int
    #: Whether the device picks the tokens of an unconstrained generation itself (the GPU
    #: token hand-off); otherwise every row's logits come to the host.
    samples_on_device: bool
    #: Whether prefill results do not depend on where the chunks are cut (the native
    #: kernels are row-local: two chunks equal one bit for bit; docs/prefill.md), so a
    #: scheduler may cut a prompt into smaller pieces to interleave it with decode steps.
    chunk_invariant: bool

    @property
    def position(self) -> int: ...
    def reset(self, seq: int = 0) -> None: ...
    def forward(self, tokens: np.ndarray, *, all_logits: bool, seq: int = 0) -> np.ndarray:
        """Run ``tokens`` (int64 ``[T]``) at the sequence's position; float32 logits
        ``[vocab]`` of the last one, or ``[T, vocab]`` with ``all_logits``."""
    def prefill(self, tokens: np.ndarray, seq: int = 0) -> None:
        """Run ``tokens`` (int64 ``[T]``) at the sequence's position without computing logits."""
    def start(self, feed: np.ndarray, steps: int, history: Sequence[int], params: SamplingParams,
              constraint: Constraint | None = None) -> None:
        """Begin a generation on the session: ``feed`` (int64, >= 1 tokens not yet in the
        session), at most ``steps`` tokens, ``history`` the session's tokens including the
        feed (the repetition penalty's prompt set)."""
    def next(self) -> Step | None: ...
    def finish(self) -> None: ...
    def snapshot(self, seq: int = 0) -> object: ...
    def restore(self, snap: object, seq: int = 0) -> None: ...
    def snapshot_arrays(self, snap: object) -> tuple[dict[str, np.ndarray], dict]:
        """``snap`` (from :meth:`snapshot`) as named arrays plus JSON metadata with its
        ``kind`` and ``position``: the form a prompt cache file stores."""
    def snapshot_from_arrays(self, arrays: dict[str, np.ndarray], meta: dict) -> object:
        """The snapshot :meth:`snapshot_arrays` stored, ready for :meth:`restore`. Raises
        ``ValueError`` or ``KeyError`` for arrays of another form."""

    # -- sequences and batched calls ----------------------------------------------------
    def open_sequence(self) -> int:
        """A new empty sequence's id. Raises :class:`lily.errors.DeviceError` when the device
        has no room for it."""
    def close_sequence(self, seq: int) -> None: ...
    def sequence_position(self, seq: int) -> int: ...
    def sequence_room(self) -> int | None:
        """How many more sequences fit the device's memory (None: no limit known)."""
    def sequence_bytes(self) -> int:
        """Memory one more sequence takes (its KV cache at the context window and its state)."""
    def begin(self, seq: int, params: SamplingParams, history: Sequence[int]) -> None:
        """The device sampler's settings for a generation of ``seq`` (``samples_on_device``
        backends; ``history``: the repetition penalty's prompt set)."""
    def submit_chunk(self, seq: int, tokens: np.ndarray, *, sample: bool = False, logits: bool = False) -> int:
        """Commit one prefill chunk (at most :attr:`prefill_chunk` tokens, >= 2 unless it is
        the whole input) of ``seq``. ``sample``: the device picks the first generated token
        from its last row (``samples_on_device`` only); ``logits``: the last row's logits
        come to the host. Returns the ticket of :meth:`take`, 0 when neither."""
    def submit_step(self, rows: Sequence[tuple[int, int | None, bool]]) -> int:
        """Commit one decode step of ``rows``, each ``(seq, token, logits)``: the input token
        (None: the one the device picked at the sequence's last step or sampling chunk) and
        whether its logits come to the host (else the device samples). Returns the ticket."""
    def take(self, ticket: int) -> tuple[list[RowResult], float | None]:
        """The results of a ticket (in commit order) and the device seconds of its work
        (None when not measured)."""


def host_pick(sampler: Sampler, logits: np.ndarray, constraint: Constraint | None, logprobs: bool) -> Step:
    """A token picked on the host from one row's ``logits``: masked by the constraint,
    sampled, its :class:`TokenLogprob` when ``logprobs``; the constraint is advanced with it."""
    if constraint is not None:
        logits = apply_mask(logits, constraint.allowed())
    tok = sampler.sample(logits)
    lp = sampler.logprob(logits, tok) if logprobs else None
    if constraint is not None:
        constraint.advance(tok)
    return tok, lp


class HostGeneration:
    """``start``/``next``/``finish`` with the token chosen on the host: each ``next`` runs
    the pending tokens through ``forward`` (the feed first, then the previous token), masks
    the logits with the constraint, and samples with :class:`lily.sampling.Sampler`
    (:func:`host_pick`).

    Used by the reference device for every request and by native devices for constrained
    requests (the logits come to the host each step). The constraint is advanced with each
    token returned.
    """

    def __init__(self, forward: Callable[[np.ndarray], np.ndarray], feed: np.ndarray, steps: int,
                 history: Sequence[int], params: SamplingParams, constraint: Constraint | None = None):
        self._forward = forward
        self._pending = np.asarray(feed, dtype=np.int64)
        self._fed = False
        self._left = int(steps)
        self._sampler = Sampler(params, history)
        self._logprobs = params.logprobs
        self._constraint = constraint

    def next(self) -> Step | None:
        if self._fed and self._left == 0:
            return None
        logits = self._forward(self._pending)  # the feed runs even when no step is left
        self._fed = True
        if self._left == 0:
            return None
        tok, lp = host_pick(self._sampler, logits, self._constraint, self._logprobs)
        self._left -= 1
        self._pending = np.array([tok], dtype=np.int64)
        return tok, lp


class HostBatch:
    """The sequences and the batched calls of a backend whose tokens are picked on the host
    (the reference device and test doubles), over its own ``forward`` / ``prefill``: work
    runs when it is submitted, and :meth:`take` hands out the stored results. A subclass
    keeps its states in ``self.states`` (sequence id -> a state with a ``position``, 0 the
    session's; :meth:`_init_sequences`), makes new ones with ``_new_state()``, and may run
    one decode step of several rows at once in ``_forward_rows(seqs, tokens)`` (default:
    one row after another). Calls on the session (sequence 0) name no sequence, so a
    wrapped single-session ``forward`` / ``prefill`` sees them as the engine's own."""

    samples_on_device = False
    chunk_invariant = False

    def _init_sequences(self, state) -> None:
        self.states = {0: state}
        self._results: dict[int, list[RowResult]] = {}
        self._tickets = itertools.count(1)

    def _state(self, seq: int):
        try:
            return self.states[seq]
        except KeyError:
            raise ValueError(f"sequence {seq} is not open") from None

    @staticmethod
    def _on(seq: int) -> dict:
        return {} if seq == 0 else {"seq": seq}

    def _forward_rows(self, seqs: list[int], tokens: np.ndarray) -> np.ndarray:
        return np.stack([self.forward(tokens[i:i + 1], all_logits=False, **self._on(seq))
                         for i, seq in enumerate(seqs)])

    def open_sequence(self) -> int:
        seq = max(self.states) + 1
        self.states[seq] = self._new_state()
        return seq

    def close_sequence(self, seq: int) -> None:
        if seq == 0:
            raise ValueError("sequence 0 is the session, not opened")
        self._state(seq)
        del self.states[seq]

    def sequence_position(self, seq: int) -> int:
        return self._state(seq).position

    def sequence_room(self) -> int | None:
        return None

    def sequence_bytes(self) -> int:
        return 0

    def begin(self, seq: int, params: SamplingParams, history: Sequence[int]) -> None:
        self._state(seq)  # the host samples: nothing to set on the device

    def submit_chunk(self, seq: int, tokens: np.ndarray, *, sample: bool = False, logits: bool = False) -> int:
        if sample:
            raise ValueError(f"{self.name}: the host picks the tokens (sample=False)")
        position = self.sequence_position(seq)
        tokens = np.asarray(tokens, dtype=np.int64)
        if not logits:
            self.prefill(tokens, **self._on(seq))
            return 0
        out = self.forward(tokens, all_logits=False, **self._on(seq))
        ticket = next(self._tickets)
        self._results[ticket] = [RowResult(seq, position + len(tokens) - 1, None, None, out)]
        return ticket

    def submit_step(self, rows: Sequence[tuple[int, int | None, bool]]) -> int:
        if any(tok is None or not want for _, tok, want in rows):
            raise ValueError(f"{self.name}: the host picks the tokens (every row has its token and logits)")
        seqs = [seq for seq, _, _ in rows]
        positions = [self.sequence_position(seq) for seq in seqs]
        logits = self._forward_rows(seqs, np.asarray([tok for _, tok, _ in rows], dtype=np.int64))
        ticket = next(self._tickets)
        self._results[ticket] = [RowResult(seq, pos, None, None, logits[i])
                                 for i, (seq, pos) in enumerate(zip(seqs, positions))]
        return ticket

    def take(self, ticket: int) -> tuple[list[RowResult], float | None]:
        return self._results.pop(ticket), None
