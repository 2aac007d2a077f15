"""The OpenAI request and response shapes as pydantic v2 models: one source of truth.

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
refused rather than silently ignored; ``null`` means "not given". Response
models describe exactly what the handlers send, for the OpenAPI document
and for tests that check the handlers' output against them.

Pure code: never imports trio or torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from ..protocol.errors import ValidationError
from ..protocol.params import RequestOutputKind, SamplingParams
from ..protocol.structured import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
"""Integers a client gives must fit in 64 bits: the engine stores them in int64 arrays."""

_TAG = "§"  # prefix of union tags in error locations; :func:`field_path` drops them

_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)

MAX_PROMPTS = 256
"""At most this many prompts in one ``/v1/completions`` request."""

PromptInput = str | dict[str, Any]

MAX_TOOLS = 128
"""The most tools a request may declare (their checks and the template grow with it)."""


def _json_type(value: Any) -> str | None:
    for python_type, name in _JSON_TYPES:
        if isinstance(value, python_type):
            return _TAG + name
    return None


def by_json_type(message: str, **members: Any) -> Any:
    """A union whose member is picked by the input's JSON type (``string=str, array=list[X]``).

    Any other type is one error, ``message``, located at the field itself.
    """
    tagged = tuple(Annotated[member, Tag(_TAG + name)] for name, member in members.items())
    return Annotated[
        Union[tagged],  # noqa: UP007 - a runtime-built union
        Discriminator(_json_type, custom_error_type="invalid_type", custom_error_message=message),
    ]


class OpenAIModel(BaseModel):
    """Strict types; unknown fields ignored (forward compatibility, as OpenAI and vLLM)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class OpenAIResponseModel(BaseModel):
    """What the server sends; lenient on input, since it only documents and checks our output."""

    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------ messages and tools


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


if TYPE_CHECKING:
    MessageContent: TypeAlias = str | list[TextPart]
else:
    MessageContent = by_json_type(
        "must be a string or a list of content parts", string=str, array=list[TextPart]
    )


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCallParam(OpenAIModel):
    """A call in an assistant message of the conversation so far."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """One message of ``messages``. ``tool`` messages answer ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it (arguments parsed back into objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not FUNCTION_NAME.match(value):
            raise ValueError("must be 1 to 64 letters, digits, '_', '.' or '-'")
        return value


class ToolParam(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


if TYPE_CHECKING:
    ToolChoice: TypeAlias = Literal["none", "auto", "required"] | NamedToolChoice
else:
    ToolChoice = by_json_type(
        'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        string=Literal["none", "auto", "required"],
        object=NamedToolChoice,
    )


# ------------------------------------------------------------------ structured outputs


if TYPE_CHECKING:
    JsonSchemaValue: TypeAlias = dict[str, Any] | str
else:
    JsonSchemaValue = by_json_type(
        "must be a JSON Schema (an object, or its JSON text)", object=dict[str, Any], string=str
    )


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsOptions(OpenAIModel):
    """vLLM's ``structured_outputs`` request field (StructuredOutputsParams' shape)."""

    json_: JsonSchemaValue | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


class StreamOptions(OpenAIModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


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
        if isinstance(value, str):
            return value
        kinds = {type(v) for v in value}
        if len(kinds) > 1:
            raise ValueError("must be strings, token ids or token id lists, not a mix")
        if isinstance(value[0], list) and any(not v for v in value):
            raise ValueError("token id lists must not be empty")
        count = len(value) if not isinstance(value[0], int) else 1
        if count > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {count}")
        return value

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


# ------------------------------------------------------------------ responses


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


# ------------------------------------------------------------------ errors


def field_path(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "content")`` -> ``"messages[0].content"`` (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(_TAG):
            out += f".{part}" if out else part
    return out


def _message(error: Any) -> str:
    kind, text = error["type"], error["msg"]
    if kind == "missing":
        return "is required"
    if kind == "too_short":
        return "must not be empty" if error["ctx"].get("min_length") == 1 else str(text)
    if kind == "literal_error":
        return f"must be {text.removeprefix('Input should be ')}"
    if kind == "value_error":
        return str(text).removeprefix("Value error, ")
    return str(text).replace("Input should be", "must be", 1)


def validation_error(exc: pydantic.ValidationError) -> ValidationError:
    """Our one validation error (field + reason) for pydantic's first error."""
    first = exc.errors(include_url=False)[0]
    path = field_path(tuple(first["loc"])) or "body"
    return ValidationError(path, _message(first))


def parse_request(model: type[OpenAIModel], body: object) -> Any:
    """Validate a decoded JSON body as ``model``; ValidationError naming the field if it is not."""
    if not isinstance(body, dict):
        raise ValidationError("body", "must be a JSON object")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None
