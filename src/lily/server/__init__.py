"""Lily's HTTP server (``lily serve``): OpenAI chat completions, completions and Responses,
and Anthropic Messages.

:func:`create_app` builds the FastAPI app around a loaded :class:`~lily.engine.Engine`;
:func:`serve` runs it with uvicorn. See ``docs/server.md``.
"""

from lily.chat_output import ChatAccumulator, ChatOutputParser, parse_complete
from lily.server.app import create_app, serve

__all__ = ["ChatAccumulator", "ChatOutputParser", "create_app", "parse_complete", "serve"]
