"""The incremental detokenizer: generated ids to text in O(1) amortised work per token,
never splitting a UTF-8 character across pieces."""

from __future__ import annotations

import codecs
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lily.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

log = logging.getLogger("lily")


class IncrementalDetokenizer:
    """Turn generated ids into text one token at a time, without splitting characters.

    Each :meth:`add` feeds the token's raw bytes (:meth:`Tokenizer.piece_bytes`) to an
    incremental UTF-8 decoder, so the work per token is O(1) amortised and a character whose
    bytes span several tokens is emitted whole, once its last byte arrives. Bytes that can
    never form a character become U+FFFD exactly as in :meth:`Tokenizer.decode`, so the
    concatenation of all returned pieces plus :meth:`flush` equals ``decode(ids)`` (for ids
    the tokenizer has; others give no text, :meth:`Tokenizer.decode_lenient`).

    Parameters
    ----------
    tokenizer : Tokenizer
    skip_special_tokens : bool
        Emit nothing for ids in ``tokenizer.special_token_ids``.
    """

    __slots__ = ("_decoder", "_pieces", "_skip", "_text", "_token_bytes", "_warn")

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._token_bytes = tokenizer.piece_bytes
        self._warn = True  # once per detokenizer (one generation)
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []
        self._text = ""

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes (possibly ``""``).

        The result never ends in part of a character: bytes of an unfinished character are
        held back until a later token completes it (or :meth:`flush`).

        An id the tokenizer has no token for (:meth:`Tokenizer.piece_bytes`: the padding rows
        of a model's embedding) gives no text and logs one warning.

        Raises
        ------
        TokenizerError
            If ``token_id`` is not an integer.
        """
        if token_id in self._skip:
            return ""
        data = self._token_bytes(token_id)
        if not data and self._warn:  # an id without a token (the model's padding): no text
            self._warn = False
            log.warning("token id %s has no token in the tokenizer: it gives no text", token_id)
        piece = self._decoder.decode(data)
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
