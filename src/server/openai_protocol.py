"""The OpenAI generation requests as pydantic v2 models: one source of truth.

The rules every body model follows and ``parse_request`` live in ``schema_base``,
the parts of a chat (messages, tools, structured outputs) in ``chat_parts``, the
response models in ``openai_shapes``; this module re-exports their names.

Requests are validated *strictly* (no coercion: ``"1"`` is not a number,
``true`` is not an integer), unknown fields are ignored as OpenAI and vLLM
do, and every error names its field the way a client reads it:
``messages[0].content``, ``tools[1].function.name``,
``response_format.json_schema.schema`` (:func:`validation_error`). Unions
that a JSON value's type decides (a string or a list of parts ...) are
tagged by that type, so an error points into the member that applies
instead of listing every member.

The models validate shapes and types, and are the only parser of a body: a
generation request builds its engine parameters itself
(``to_sampling_params()``), and value ranges (temperature, top_p ...) are
``SamplingParams``' to check, so that rule lives in one place. Known OpenAI
features the engine lacks (``suffix``, ``functions``, chat's ``best_of``) are
refused rather than silently ignored; ``null`` means "not given".

Pure code: never imports trio or torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

from pydantic import ConfigDict, Field, field_validator

from ..protocol.errors import ValidationError
from ..protocol.params import RequestOutputKind, SamplingParams
from ..protocol.structured import StructuredOutputsParams
from .chat_parts import (
    FUNCTION_NAME as FUNCTION_NAME,
)
from .chat_parts import (  # re-exported: this module held them before it was split
    ChatMessage as ChatMessage,
)
from .chat_parts import (
    FunctionCall as FunctionCall,
)
from .chat_parts import (
    FunctionDefinition as FunctionDefinition,
)
from .chat_parts import (
    JsonSchemaFormat as JsonSchemaFormat,
)
from .chat_parts import (
    JsonSchemaValue as JsonSchemaValue,
)
from .chat_parts import (
    MessageContent as MessageContent,
)
from .chat_parts import (
    NamedFunction as NamedFunction,
)
from .chat_parts import (
    NamedToolChoice as NamedToolChoice,
)
from .chat_parts import (
    ResponseFormat as ResponseFormat,
)
from .chat_parts import (
    StreamOptions as StreamOptions,
)
from .chat_parts import (
    StructuredOutputsOptions as StructuredOutputsOptions,
)
from .chat_parts import (
    TextPart as TextPart,
)
from .chat_parts import (
    ToolCallParam as ToolCallParam,
)
from .chat_parts import (
    ToolChoice as ToolChoice,
)
from .chat_parts import (
    ToolParam as ToolParam,
)
from .chat_parts import (
    _json_or_text as _json_or_text,
)
from .openai_shapes import (  # re-exported: this module held them before it was split
    AssistantMessage as AssistantMessage,
)
from .openai_shapes import (
    ChatChoice as ChatChoice,
)
from .openai_shapes import (
    ChatChunkChoice as ChatChunkChoice,
)
from .openai_shapes import (
    ChatCompletionChunk as ChatCompletionChunk,
)
from .openai_shapes import (
    ChatCompletionResponse as ChatCompletionResponse,
)
from .openai_shapes import (
    ChatDelta as ChatDelta,
)
from .openai_shapes import (
    ChatLogprobs as ChatLogprobs,
)
from .openai_shapes import (
    CompletionChoice as CompletionChoice,
)
from .openai_shapes import (
    CompletionLogprobs as CompletionLogprobs,
)
from .openai_shapes import (
    CompletionResponse as CompletionResponse,
)
from .openai_shapes import (
    DeltaFunctionCall as DeltaFunctionCall,
)
from .openai_shapes import (
    DeltaToolCall as DeltaToolCall,
)
from .openai_shapes import (
    ErrorDetail as ErrorDetail,
)
from .openai_shapes import (
    ErrorResponse as ErrorResponse,
)
from .openai_shapes import (
    FinishReason as FinishReason,
)
from .openai_shapes import (
    ModelCard as ModelCard,
)
from .openai_shapes import (
    ModelList as ModelList,
)
from .openai_shapes import (
    TokenLogprob as TokenLogprob,
)
from .openai_shapes import (
    ToolCall as ToolCall,
)
from .openai_shapes import (
    TopLogprob as TopLogprob,
)
from .openai_shapes import (
    Usage as Usage,
)
from .schema_base import (
    _TAG as _TAG,
)
from .schema_base import (  # re-exported: this module held them before it was split
    INT64_MAX as INT64_MAX,
)
from .schema_base import (
    INT64_MIN as INT64_MIN,
)
from .schema_base import (
    MAX_PROMPTS as MAX_PROMPTS,
)
from .schema_base import (
    MAX_TOOLS as MAX_TOOLS,
)
from .schema_base import (
    Int64 as Int64,
)
from .schema_base import (
    OpenAIModel as OpenAIModel,
)
from .schema_base import (
    OpenAIResponseModel as OpenAIResponseModel,
)
from .schema_base import (
    PromptInput as PromptInput,
)
from .schema_base import (
    by_json_type as by_json_type,
)
from .schema_base import (
    field_path as field_path,
)
from .schema_base import (
    parse_request as parse_request,
)
from .schema_base import (
    validation_error as validation_error,
)

if TYPE_CHECKING:
    Stop: TypeAlias = str | list[str]
else:
    Stop = by_json_type("must be a string or a list of strings", string=str, array=list[str])


class EngineSamplingFields(OpenAIModel):
    """The SamplingParams fields that HTTP bodies and the WebSocket ``params`` both carry,
    under SamplingParams' own names and with one type each: the shared part of every
    generation request's schema. ``null`` means "not given"."""

    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: Int64 | None = None
    seed: Int64 | None = None
    stop: Stop | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: Int64 | None = None
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: Int64 | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None


class GenerateParams(EngineSamplingFields):
    """The WebSocket ``generate`` frame's ``params``: every SamplingParams field a client may
    set, by its own name (see ``docs/websocket.md``). Unknown fields are refused, not
    ignored: the frame names engine fields, so a typo is an error. Types are checked here;
    ranges are SamplingParams' (:meth:`to_sampling_params`).

    A ``null`` means "not given", except where SamplingParams' default is not ``None``
    and ``None`` is a value of the field: ``max_tokens`` (default 16; ``null``: no limit).
    """

    model_config = ConfigDict(extra="forbid")

    max_tokens: Int64 | None = 16
    best_of: Int64 | None = None
    logprobs: Int64 | None = None
    prompt_logprobs: Int64 | None = None
    detokenize: bool | None = None
    logit_bias: dict[Int64, float] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams parses it

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: object) -> object:
        """Keys are token ids: integers (msgpack) or their decimal strings (JSON)."""
        if not isinstance(value, dict):
            return value
        out: dict[object, object] = {}
        for key, bias in value.items():
            if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,20}", key):
                out[int(key)] = bias
            elif isinstance(key, int) and not isinstance(key, bool):
                out[key] = bias
            else:
                raise ValueError(f"keys must be token ids, got {str(key)[:40]!r}")
        return out

    def to_sampling_params(self, *, max_n: int) -> SamplingParams:
        """The engine's parameters (DELTA outputs); a ValidationError names the field as
        SamplingParams does (``temperature``, ``structured_outputs.json``)."""
        fields = type(self).model_fields
        kwargs: dict[str, Any] = {
            name: value
            for name, info in fields.items()
            if (value := getattr(self, name)) is not None or info.default is not None
        }
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = StructuredOutputsParams.from_dict(
                kwargs["structured_outputs"]
            )
        params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
        if params.n > max_n:
            raise ValidationError("n", f"must be <= {max_n}, got {params.n}")
        return params


class SamplingFields(EngineSamplingFields):
    """The sampling fields both HTTP endpoints share, OpenAI's and vLLM's extras."""

    model: str | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    priority: Int64 | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    guided_json: JsonSchemaValue | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    cache_salt: str | None = None
    functions: Any = None  # deprecated by OpenAI: refused

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def renames(self) -> dict[str, str]:
        """Engine field -> this request's name for it, where they differ."""
        return {}

    def with_cache_salt(self, prompt: PromptInput) -> PromptInput:
        """``prompt`` as a dict prompt carrying ``cache_salt`` (unchanged without one): prompts
        with different salts never share prefix-cache blocks."""
        if self.cache_salt is None:
            return prompt
        if isinstance(prompt, str):
            return {"prompt": prompt, "cache_salt": self.cache_salt}
        return {**prompt, "cache_salt": self.cache_salt}

    def engine_params(
        self,
        extra: Mapping[str, Any],
        *,
        max_n: int,
        structured_outputs: StructuredOutputsParams | None,
    ) -> SamplingParams:
        """SamplingParams from the fields it shares with this model, plus ``extra``; a
        ValidationError names the request's field (see :meth:`renames`)."""
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options", "is only allowed with stream=true")
        if self.functions:
            raise ValidationError(
                "functions", "is deprecated by OpenAI and not supported; use tools"
            )
        if self.cache_salt is not None and not self.cache_salt:
            raise ValidationError("cache_salt", "must be a non-empty string")
        kwargs: dict[str, Any] = {
            name: value
            for name in _SHARED_WITH_SAMPLING_PARAMS
            if (value := getattr(self, name)) is not None
        }
        if self.logit_bias is not None:
            kwargs["logit_bias"] = _token_bias(self.logit_bias)
        kwargs.update(extra)
        n = kwargs.get("n", 1)
        if n > max_n:
            raise ValidationError("n", f"must be <= {max_n}, got {n}")
        try:
            return SamplingParams(
                **kwargs,
                structured_outputs=structured_outputs,
                output_kind=RequestOutputKind.DELTA,
            )
        except ValidationError as exc:
            raise exc.renamed(self.renames().get(exc.field, exc.field)) from None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not re.fullmatch(r"[0-9]{1,19}", key):
                raise ValueError(f"keys must be token ids, got {key[:40]!r}")
        return value


_SHARED_WITH_SAMPLING_PARAMS = tuple(
    sorted(
        {f.name for f in dataclasses.fields(SamplingParams)}.intersection(
            SamplingFields.model_fields
        )
        - {"logit_bias", "structured_outputs"}  # converted, or read by ``chat_outputs``
    )
)
"""The request fields that are SamplingParams fields by the same name (temperature, n ...)."""


def _token_bias(bias: dict[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        token_id = int(key)  # digits only: see SamplingFields._logit_bias_keys
        if token_id > INT64_MAX:
            raise ValidationError("logit_bias", f"keys must be token ids, got {key!r}")
        out[token_id] = value
    return out


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = None
    best_of: Any = None  # a completions parameter: refused

    def renames(self) -> dict[str, str]:
        """Engine field -> this request's name for it (the first of two names given wins)."""
        return {
            "max_tokens": "max_completion_tokens"
            if self.max_completion_tokens is not None
            else "max_tokens",
            "logprobs": "top_logprobs" if self.top_logprobs is not None else "logprobs",
            "prompt": "messages",
            "prompt_token_ids": "messages",
        }

    def to_sampling_params(
        self, *, max_n: int, structured_outputs: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        """The engine's parameters; a ValidationError names the request's field.
        ``max_tokens`` defaults to the context limit, as OpenAI and vLLM do for chat."""
        if self.best_of is not None:
            raise ValidationError("best_of", "is not a chat completions parameter")
        extra: dict[str, Any] = {}
        extra["max_tokens"] = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValidationError("top_logprobs", "needs logprobs=true")
            if self.top_logprobs < 0:
                raise ValidationError("top_logprobs", f"must be >= 0, got {self.top_logprobs}")
        if self.logprobs:
            extra["logprobs"] = self.top_logprobs or 0
        return self.engine_params(extra, max_n=max_n, structured_outputs=structured_outputs)


if TYPE_CHECKING:
    PromptItems: TypeAlias = list[str | int | list[int]]
    Prompt: TypeAlias = str | PromptItems
else:
    PromptItems = list[
        by_json_type(
            "must be a string, a token id or a list of token ids",
            string=str,
            integer=Int64,
            array=list[Int64],
        )
    ]
    Prompt = by_json_type(
        "must be a string, a list of strings, a list of token ids or a list of token id lists",
        string=str,
        array=Annotated[PromptItems, Field(min_length=1)],
    )


def one_kind_of_prompt(value: str | PromptItems, noun: str = "prompts") -> str | PromptItems:
    """A ``Prompt`` of one kind (strings, token ids, token id lists), none empty, at most
    ``MAX_PROMPTS`` of them; ValueError (pydantic's field error) if not."""
    if isinstance(value, str):
        return value
    kinds = {type(v) for v in value}
    if len(kinds) > 1:
        raise ValueError("must be strings, token ids or token id lists, not a mix")
    if isinstance(value[0], list) and any(not v for v in value):
        raise ValueError("token id lists must not be empty")
    count = len(value) if not isinstance(value[0], int) else 1
    if count > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} {noun} per request, got {count}")
    return value


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: Int64 | None = None
    logprobs: Int64 | None = None
    echo: bool | None = None
    best_of: Int64 | None = None
    suffix: str | None = None
    prompt_logprobs: Int64 | None = None

    @field_validator("prompt")
    @classmethod
    def _one_kind_of_prompt(cls, value: str | PromptItems) -> str | PromptItems:
        return one_kind_of_prompt(value)

    def renames(self) -> dict[str, str]:
        """Engine field -> this request's name for it."""
        return {"prompt": "prompt", "prompt_token_ids": "prompt"}

    def prompts(self) -> list[PromptInput]:
        """One engine prompt per prompt given (token ids as ``{"prompt_token_ids"}``), each
        with the request's ``cache_salt``."""
        value = self.prompt
        prompts: list[PromptInput]
        if isinstance(value, str):
            prompts = [value]
        elif isinstance(value[0], int):
            prompts = [{"prompt_token_ids": list(value)}]
        else:
            prompts = [v if isinstance(v, str) else {"prompt_token_ids": v} for v in value]
        return [self.with_cache_salt(prompt) for prompt in prompts]

    def to_sampling_params(
        self, *, max_n: int, structured_outputs: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        """The engine's parameters; a ValidationError names the request's field."""
        if self.suffix:
            raise ValidationError("suffix", "is not supported by this server")
        extra: dict[str, Any] = {}
        if self.max_tokens is not None:
            extra["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            if self.logprobs < 0:
                raise ValidationError("logprobs", f"must be >= 0, got {self.logprobs}")
            extra["logprobs"] = self.logprobs
        if self.best_of is not None:
            extra["best_of"] = self.best_of
        return self.engine_params(extra, max_n=max_n, structured_outputs=structured_outputs)
