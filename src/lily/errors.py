"""Lily's exception hierarchy.

Every error Lily raises on bad input is a :class:`LilyError`. Subclasses that describe a
bad argument also derive from :class:`ValueError` so generic callers can catch them.
"""

from __future__ import annotations


class LilyError(Exception):
    """Base class of every error Lily raises on bad input or unusable state."""


class CheckpointError(LilyError):
    """A checkpoint directory is missing, truncated, mis-shaped or of an unknown architecture,
    or a floating tensor holds NaN or Inf.

    The message names the file and, where relevant, the tensor with its expected and
    actual shape or dtype, or the index of its first non-finite element.
    """


class ConfigError(CheckpointError):
    """``config.json`` is missing, unreadable, or describes a model Lily does not run."""


class TokenizerError(LilyError):
    """Tokenizer files are missing or unreadable, or a chat template failed to render."""


class InvalidParameterError(LilyError, ValueError):
    """A sampling or engine parameter is out of range or of the wrong type."""


class ToolSchemaError(InvalidParameterError):
    """A forced tool call's grammar cannot be built from one tool's parameters schema: it is
    valid JSON Schema but unsatisfiable (``minimum`` > ``maximum``) or uses what the grammar
    engine cannot enforce (look-around in ``pattern``, an unknown ``format``, a ``$ref``
    that does not resolve).

    ``index`` is the tool's position in the ``tools`` list given, ``name`` its name and
    ``reason`` why, in one line (no grammar listing).
    """

    def __init__(self, index: int, name: str, reason: str):
        super().__init__(f"tools[{index}] ({name}): parameters cannot be enforced: {reason}")
        self.index = index
        self.name = name
        self.reason = reason


class ContextLengthError(LilyError, ValueError):
    """A prompt or generation does not fit in the session's context window."""


class DeviceError(LilyError):
    """A requested device is unknown or not available on this machine or build."""
