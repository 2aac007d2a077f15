"""What the OpenAI endpoints answer, as pydantic models: they document the responses
(the OpenAPI document) and let tests check the handlers' output against them. Lenient
on input (``OpenAIResponseModel``), since they only describe.

Pure code: never imports trio or torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .chat_parts import FunctionCall
from .schema_base import OpenAIResponseModel


class Usage(OpenAIResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ToolCall(OpenAIResponseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(OpenAIResponseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None


class TopLogprob(OpenAIResponseModel):
    token: str
    logprob: float | None
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(OpenAIResponseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


FinishReason = Literal["stop", "length", "tool_calls", "abort", "content_filter"]


class ChatChoice(OpenAIResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIResponseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None
    system_fingerprint: str | None = None


class DeltaFunctionCall(OpenAIResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(OpenAIResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(OpenAIResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIResponseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(OpenAIResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(OpenAIResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIResponseModel):
    """Also each streamed chunk of a completion (``object`` "text_completion" in both)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ErrorDetail(OpenAIResponseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(OpenAIResponseModel):
    error: ErrorDetail


class ModelCard(OpenAIResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(OpenAIResponseModel):
    object: Literal["list"]
    data: list[ModelCard]
