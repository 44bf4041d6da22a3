"""The host contract: what a device provides to :class:`lily.engine.Engine`, and the host
sampling loop that backends without a device sampler (the reference) or requests the
device sampler cannot serve (constrained decoding) use behind the same contract.

Every backend holds one session (KV cache, conv and recurrent state) at ``position``
tokens. Input is checked by the engine before it reaches a backend: token ids are a 1-D
integer array inside the vocabulary, and they fit in the context window. A backend keeps
only the guards it needs for memory safety (the native core's bounds checks).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np

from lily.constraints import Constraint, apply_mask
from lily.sampling import Sampler, SamplingParams, TokenLogprob

Step = tuple[int, TokenLogprob | None]


class Backend(Protocol):
    """One session of the model on one device.

    Generation runs as ``start`` / ``next`` ... / ``finish``: ``start`` takes the tokens
    still to feed (>= 1), ``next`` returns one generated token at a time (and its
    :class:`TokenLogprob` when ``params.logprobs``), ``None`` once ``steps`` tokens were
    returned; ``finish`` ends the generation. Afterwards ``position`` counts the feed and
    every returned token except possibly the last (the engine reads ``position`` to know
    which tokens are in the state; a device may have run one speculative step ahead and
    discards it).
    """

    name: str
    #: Tokens per prefill chunk: the device's choice (scratch memory is sized for one
    #: chunk on native devices). The engine checks cancellation between chunks.
    prefill_chunk: int

    @property
    def position(self) -> int: ...
    def reset(self) -> None: ...
    def forward(self, tokens: np.ndarray, *, all_logits: bool) -> np.ndarray:
        """Run ``tokens`` (int64 ``[T]``) at ``position``; float32 logits ``[vocab]`` of the
        last one, or ``[T, vocab]`` with ``all_logits``."""
    def prefill(self, tokens: np.ndarray) -> None:
        """Run ``tokens`` (int64 ``[T]``) at ``position`` without computing logits."""
    def start(self, feed: np.ndarray, steps: int, history: Sequence[int], params: SamplingParams,
              constraint: Constraint | None = None) -> None:
        """Begin a generation: ``feed`` (int64, >= 1 tokens not yet in the session), at most
        ``steps`` tokens, ``history`` the session's tokens including the feed (the
        repetition penalty's prompt set)."""
    def next(self) -> Step | None: ...
    def finish(self) -> None: ...
    def snapshot(self) -> object: ...
    def restore(self, snap: object) -> None: ...
    def snapshot_arrays(self, snap: object) -> tuple[dict[str, np.ndarray], dict]:
        """``snap`` (from :meth:`snapshot`) as named arrays plus JSON metadata with its
        ``kind`` and ``position``: the form a prompt cache file stores."""
    def snapshot_from_arrays(self, arrays: dict[str, np.ndarray], meta: dict) -> object:
        """The snapshot :meth:`snapshot_arrays` stored, ready for :meth:`restore`. Raises
        ``ValueError`` or ``KeyError`` for arrays of another form."""


class HostGeneration:
    """``start``/``next``/``finish`` with the token chosen on the host: each ``next`` runs
    the pending tokens through ``forward`` (the feed first, then the previous token), masks
    the logits with the constraint, and samples with :class:`lily.sampling.Sampler`.

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
        if self._constraint is not None:
            logits = apply_mask(logits, self._constraint.allowed())
        tok = self._sampler.sample(logits)
        lp = self._sampler.logprob(logits, tok) if self._logprobs else None
        if self._constraint is not None:
            self._constraint.advance(tok)
        self._left -= 1
        self._pending = np.array([tok], dtype=np.int64)
        return tok, lp
