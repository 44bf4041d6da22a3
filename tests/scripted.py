"""A backend whose model is a script (the host contract, lily.backend.Backend, without a
model): the server tests drive the real engine loop and the scheduler with it."""

from __future__ import annotations

import numpy as np

from lily.backend import HostBatch, HostGeneration


class _State:
    """A scripted sequence: its position, and whether its next step is a generation's feed
    (answered by ``on_prefill``, as the engine's loop feeds it)."""

    def __init__(self):
        self.position = 0
        self.feed = True


class ScriptedBackend(HostBatch):
    """``on_prefill(tokens, all_logits)`` answers every prefill chunk and a generation's
    feed, ``on_decode()`` every later step; both return float32 logits (``[vocab]``, or
    ``[T, vocab]`` for ``all_logits``). Tokens are sampled on the host, as on the reference."""

    name = "scripted"
    prefill_chunk = 128

    def __init__(self, on_prefill, on_decode):
        self.on_prefill, self.on_decode = on_prefill, on_decode
        self._init_sequences(_State())
        self._gen = None

    def _new_state(self) -> _State:
        return _State()

    def begin(self, seq: int, params, history) -> None:
        self._state(seq).feed = True

    def _forward_rows(self, seqs, tokens) -> np.ndarray:
        rows = []
        for seq, tok in zip(seqs, tokens):
            st = self._state(seq)
            rows.append(self.on_prefill(np.asarray([tok]), False) if st.feed else self.on_decode())
            st.feed = False
            st.position += 1
        return np.stack(rows)

    @property
    def position(self) -> int:
        return self.states[0].position

    def reset(self, seq: int = 0) -> None:
        self.states[seq] = _State()

    def forward(self, tokens, *, all_logits: bool = False, seq: int = 0) -> np.ndarray:
        st = self._state(seq)
        out = self.on_prefill(tokens, all_logits)
        st.feed = False
        st.position += len(tokens)
        return out

    def prefill(self, tokens, seq: int = 0) -> None:
        self.forward(tokens, seq=seq)

    def _step(self, tokens) -> np.ndarray:
        st = self.states[0]
        if not self._fed:
            self._fed = True
            return self.forward(tokens)
        out = self.on_decode()
        st.position += 1
        return out

    def start(self, feed, steps, history, params, constraint=None) -> None:
        self._fed = False
        self._gen = HostGeneration(self._step, feed, steps, history, params, constraint)

    def next(self):
        return self._gen.next()

    def finish(self) -> None:
        self._gen = None

    def snapshot(self, seq: int = 0) -> "ScriptedSnapshot":
        return ScriptedSnapshot(self._state(seq).position)

    def restore(self, snap: "ScriptedSnapshot", seq: int = 0) -> None:
        self._state(seq).position = snap.position


class ScriptedSnapshot:
    """The scripted session's state (its position); ``nbytes`` lets the prompt cache size it."""

    nbytes = 8

    def __init__(self, position: int):
        self.position = position
