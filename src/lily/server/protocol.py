"""Request models of the OpenAI-compatible API and the OpenAI error object.

Only the fields Lily acts on are declared with types; other fields OpenAI clients send
(``user``, ``metadata``, ...) are accepted and ignored. Numbers and
booleans are strict, as OpenAI's API is: ``"max_tokens": "2"`` or ``"stream": "yes"`` is a 400.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt


class APIError(Exception):
    """An error answered with OpenAI's error object and an HTTP status; ``retry_after``:
    seconds for the ``Retry-After`` header of a temporary refusal (429, 503)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: Optional[StrictBool] = False


class ContentPart(_Open):
    type: str
    text: Optional[str] = None


class FunctionCall(_Open):
    name: str
    arguments: Union[str, dict[str, Any], None] = None


class ToolCall(_Open):
    id: Optional[str] = None
    type: Optional[str] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class FunctionDef(_Open):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class SamplingFields(_Open):
    """The sampling and streaming fields every request model takes with the same types and
    defaults (OpenAI chat/completions, the Responses API, Anthropic Messages): their one home."""

    temperature: Optional[StrictFloat] = None
    top_p: Optional[StrictFloat] = None
    top_k: Optional[StrictInt] = None
    stream: Optional[StrictBool] = False


class _Sampling(SamplingFields):
    model: Optional[str] = None
    max_tokens: Optional[StrictInt] = None
    min_p: Optional[StrictFloat] = None
    presence_penalty: Optional[StrictFloat] = None
    frequency_penalty: Optional[StrictFloat] = None
    repetition_penalty: Optional[StrictFloat] = None
    seed: Optional[StrictInt] = None
    stop: Union[str, list[str], None] = None
    n: Optional[StrictInt] = 1
    stream_options: Optional[StreamOptions] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    response_format: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[StrictBool] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[StrictBool] = False
    logprobs: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = None
    suffix: Optional[str] = None
