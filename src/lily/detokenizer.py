"""The incremental detokenizer: generated ids to text in O(1) amortised work per token,
never splitting a UTF-8 character across pieces."""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lily.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Turn generated ids into text one token at a time, without splitting characters.

    Each :meth:`add` feeds the token's raw bytes (:meth:`Tokenizer.token_bytes`) to an
    incremental UTF-8 decoder, so the work per token is O(1) amortised and a character whose
    bytes span several tokens is emitted whole, once its last byte arrives. Bytes that can
    never form a character become U+FFFD exactly as in :meth:`Tokenizer.decode`, so the
    concatenation of all returned pieces plus :meth:`flush` equals ``decode(ids)``.

    Parameters
    ----------
    tokenizer : Tokenizer
    skip_special_tokens : bool
        Emit nothing for ids in ``tokenizer.special_token_ids``.
    """

    __slots__ = ("_decoder", "_pieces", "_skip", "_text", "_token_bytes")

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._token_bytes = tokenizer.token_bytes
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []
        self._text = ""

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes (possibly ``""``).

        The result never ends in part of a character: bytes of an unfinished character are
        held back until a later token completes it (or :meth:`flush`).

        Raises
        ------
        TokenizerError
            If ``token_id`` is not a valid id.
        """
        if token_id in self._skip:
            return ""
        piece = self._decoder.decode(self._token_bytes(token_id))
        if piece:
            self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """Return the held-back bytes decoded with ``errors="replace"`` and clear them."""
        piece = self._decoder.decode(b"", final=True)
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def pending_bytes(self) -> bytes:
        """bytes: the bytes held back as the start of an unfinished character."""
        return self._decoder.getstate()[0]

    @property
    def text(self) -> str:
        """str: all text emitted so far (by :meth:`add` and :meth:`flush`)."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text
