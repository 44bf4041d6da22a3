"""Lily: a local inference engine for Qwen3.6-35B-A3B (``qwen3_5_moe``).

Public names only; see ``docs/`` for the guide.
"""

from lily.errors import (
    CheckpointError,
    ConfigError,
    ContextLengthError,
    DeviceError,
    InvalidParameterError,
    LilyError,
    TokenizerError,
)

from lily.engine import Engine, GenerationResult, StreamEvent, default_model_path
from lily.prompt_cache import PromptCache, PromptCacheError
from lily.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
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
    "__version__",
]
