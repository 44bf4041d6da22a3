"""Lily's exception hierarchy, and :func:`notice` for what it tells the user without failing.

Every error Lily raises on bad input is a :class:`LilyError`. Subclasses that describe a
bad argument also derive from :class:`ValueError` so generic callers can catch them.
"""

from __future__ import annotations

import sys


def notice(msg: str) -> None:
    """A one-line notice on stderr, written above a progress bar that is showing (tqdm's
    ``write``: the bar is cleared, the line printed, the bar drawn again below it). Used for
    the no-Metal fallback, the weight cache and the runtime's load-time fallbacks."""
    from tqdm import tqdm
    tqdm.write(msg, file=sys.stderr)


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


class QuantizationError(ConfigError):
    """The checkpoint is quantized in a format the native kernels (devices ``sim`` and
    ``metal``) do not read: they need MLX affine 4-bit weights in groups of 64 with an 8-bit
    router and shared-expert gate (``mlx_lm convert -q --q-bits 4 --q-group-size 64``). The
    message names the first module that differs, its format and the expected one; the
    reference device runs any MLX affine format."""


class TokenizerError(LilyError):
    """Tokenizer files are missing or unreadable, or a chat template failed to render."""


class InvalidParameterError(LilyError, ValueError):
    """A sampling or engine parameter is out of range or of the wrong type."""


class ToolError(InvalidParameterError):
    """A tool definition that cannot be used: not an object of the expected form, a name
    that breaks the tool-name rule, parameters that are not a valid JSON Schema, or (in a
    forced tool call) a valid schema that is unsatisfiable (``minimum`` > ``maximum``) or
    uses what the grammar engine cannot enforce (look-around in ``pattern``, a ``$ref``
    that does not resolve).

    ``index`` is the tool's position in the ``tools`` list given, ``name`` its name (None
    when it has none), ``field`` the field at fault (``"name"``, ``"parameters"`` or
    ``""``: the whole tool), ``reason`` what is wrong in one line, and ``param`` the field
    as the caller's input spells it (``tools[i].field`` by default; see :meth:`spelled`).
    The message is ``"<param> (tool 'NAME'): <reason>"``.
    """

    def __init__(self, index: int, name: str | None, field: str, reason: str, param: str | None = None):
        self.index, self.name, self.field, self.reason = index, name, field, reason
        self.param = param or (f"tools[{index}].{field}" if field else f"tools[{index}]")
        super().__init__(f"{self.param}{f' (tool {name!r})' if name is not None else ''}: {reason}")

    def spelled(self, param) -> ToolError:
        """The same error with ``param(index, field)`` as its ``param`` (e.g. an API's
        ``tools.1.function.parameters``)."""
        return ToolError(self.index, self.name, self.field, self.reason, param(self.index, self.field))


class ContextLengthError(LilyError, ValueError):
    """A prompt or generation does not fit in the session's context window."""


class DeviceError(LilyError):
    """A requested device is unknown or not available on this machine or build."""


class QueueFullError(LilyError):
    """A :class:`lily.scheduler.Scheduler` already has as many requests waiting as it may
    queue. ``retry_after`` is the number of seconds after which a retry is likely to be
    taken (an estimate from the requests served so far)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after
