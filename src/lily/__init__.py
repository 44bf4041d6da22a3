"""Lily: a local inference engine for Qwen3.6-35B-A3B (``qwen3_5_moe``).

Public names only; see ``docs/`` for the guide.
"""

from lily.errors import (
    CheckpointError,
    ConfigError,
    QuantizationError,
    ContextLengthError,
    DeviceError,
    InvalidParameterError,
    LilyError,
    TokenizerError,
)

from lily.chat_output import ChatMessage, ToolCall, parse_chat_output
from lily.engine import ChatResult, Engine, GenerationResult, StreamEvent, default_model_path
from lily.prompt_cache import PromptCache, PromptCacheError
from lily.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "ChatMessage",
    "ChatResult",
    "CheckpointError",
    "ConfigError",
    "QuantizationError",
    "ContextLengthError",
    "DeviceError",
    "Engine",
    "GenerationResult",
    "SamplingParams",
    "StreamEvent",
    "default_model_path",
    "InvalidParameterError",
    "LilyError",
    "PromptCache",
    "PromptCacheError",
    "TokenizerError",
    "ToolCall",
    "__version__",
    "parse_chat_output",
]
