"""The decoding-constraint hook: which tokens may come next.

A constraint (a grammar, a JSON schema, a fixed choice) is passed to
``Engine.stream/generate/stream_chat/chat(..., constraint=...)``. Before each token is
chosen the engine asks it for a mask; tokens outside the mask get logit ``-inf`` before
penalties, temperature, top-k/p/min-p and the draw (greedy or random), and the reported
logprobs are those of the masked distribution. After each token the constraint is advanced
with it; once it reports ``is_finished()`` the generation ends with ``finish_reason="stop"``.

Cost model: on the reference device nothing changes (it samples on the host anyway). On the
native devices an unconstrained request keeps the GPU token hand-off (the device samples and
feeds the next step while the host reads ids one step behind); a constrained request gives
it up: every step waits for the logits (``vocab_size`` float32, 1 MiB for the full model),
masks and samples on the host, and only then encodes the next step, so the device idles for
the host's share of each step. See docs/usage.md ("Constrained decoding").
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from lily.errors import InvalidParameterError


@runtime_checkable
class Constraint(Protocol):
    """A stateful token filter driven by the engine, one per request."""

    def allowed(self) -> np.ndarray | None:
        """Bool mask ``[vocab_size]`` of the tokens allowed next, or None when any token is."""

    def advance(self, token: int) -> None:
        """Record that ``token`` was generated (it was allowed by the last mask)."""

    def is_finished(self) -> bool:
        """True once the constrained output is complete (the generation stops)."""


def apply_mask(logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """``logits`` (float32 ``[vocab]``) with the tokens outside ``mask`` set to ``-inf`` (a new
    array; ``logits`` itself when ``mask`` is None).

    Raises :class:`InvalidParameterError` when ``mask`` is not a bool array of the logits'
    shape or allows no token at all."""
    if mask is None:
        return logits
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ or mask.shape != logits.shape:
        raise InvalidParameterError(f"a constraint's mask must be bool {list(logits.shape)}, got "
                                    f"{mask.dtype} {list(mask.shape)}")
    if not mask.any():
        raise InvalidParameterError("the constraint allows no token at this step")
    return np.where(mask, logits, np.float32(-np.inf))


class AllowedTokens:
    """A simple constraint: every token from ``tokens``, at most ``length`` of them (then
    finished). For tests and as an example of the protocol."""

    def __init__(self, vocab_size: int, tokens, length: int):
        self.mask = np.zeros(vocab_size, dtype=bool)
        self.mask[np.asarray(list(tokens), dtype=np.int64)] = True
        self.length = length
        self.generated: list[int] = []

    def allowed(self) -> np.ndarray:
        return self.mask

    def advance(self, token: int) -> None:
        self.generated.append(int(token))

    def is_finished(self) -> bool:
        return len(self.generated) >= self.length
