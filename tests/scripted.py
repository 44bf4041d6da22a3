"""A backend whose model is a script (the host contract, lily.backend.Backend, without a
model): the server tests drive the real engine loop with it."""

from __future__ import annotations

import numpy as np

from lily.backend import HostGeneration


class ScriptedBackend:
    """``on_prefill(tokens, all_logits)`` answers every prefill chunk and a generation's
    feed, ``on_decode()`` every later step; both return float32 logits (``[vocab]``, or
    ``[T, vocab]`` for ``all_logits``). Tokens are sampled on the host, as on the reference."""

    name = "scripted"
    prefill_chunk = 128

    def __init__(self, on_prefill, on_decode):
        self.on_prefill, self.on_decode = on_prefill, on_decode
        self.position = 0
        self._gen = None
        self._fed = False

    def reset(self) -> None:
        self.position = 0

    def forward(self, tokens, *, all_logits: bool = False) -> np.ndarray:
        out = self.on_prefill(tokens, all_logits)
        self.position += len(tokens)
        return out

    def prefill(self, tokens) -> None:
        self.forward(tokens)

    def _step(self, tokens) -> np.ndarray:
        if not self._fed:
            self._fed = True
            return self.forward(tokens)
        out = self.on_decode()
        self.position += 1
        return out

    def start(self, feed, steps, history, params, constraint=None) -> None:
        self._fed = False
        self._gen = HostGeneration(self._step, feed, steps, history, params, constraint)

    def next(self):
        return self._gen.next()

    def finish(self) -> None:
        self._gen = None

    def snapshot(self) -> "ScriptedSnapshot":
        return ScriptedSnapshot(self.position)

    def restore(self, snap: "ScriptedSnapshot") -> None:
        self.position = snap.position


class ScriptedSnapshot:
    """The scripted session's state (its position); ``nbytes`` lets the prompt cache size it."""

    nbytes = 8

    def __init__(self, position: int):
        self.position = position
