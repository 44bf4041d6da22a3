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


class ContextLengthError(LilyError, ValueError):
    """A prompt or generation does not fit in the session's context window."""


class DeviceError(LilyError):
    """A requested device is unknown or not available on this machine or build."""
