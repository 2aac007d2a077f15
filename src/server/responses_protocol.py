"""OpenAI's Responses API request (``POST /v1/responses``) as a pydantic model.

The same rules as ``openai_protocol``: strict types, unknown fields ignored, errors
naming the field as the client wrote it (``input[2].call_id``, ``text.format.schema``).
The model is the only parser of the body: it turns itself into chat messages for the
template (:meth:`ResponsesRequest.chat_messages`), into the tools plan's input
(:meth:`ResponsesRequest.chat_tools`) and into ``SamplingParams``
(:meth:`ResponsesRequest.to_sampling_params`), which stays the only range checker.

Pure code: never imports trio or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, Union

from pydantic import Discriminator, Field, PrivateAttr, Tag

from ..protocol.errors import ValidationError
from ..protocol.params import RequestOutputKind, SamplingParams
from ..protocol.structured import StructuredOutputsParams
from .openai_protocol import (
    _TAG,
    FUNCTION_NAME,
    MAX_TOOLS,
    FunctionDefinition,
    Int64,
    NamedFunction,
    NamedToolChoice,
    OpenAIModel,
    ToolParam,
    _json_or_text,
    by_json_type,
)


class InputText(OpenAIModel):
    """A text part of an input message (``output_text``: an earlier answer given back)."""

    type: Literal["input_text", "output_text"]
    text: str


if TYPE_CHECKING:
    InputContent: TypeAlias = str | list[InputText]
else:
    InputContent = by_json_type(
        "must be a string or a list of input_text parts", string=str, array=list[InputText]
    )


class InputMessage(OpenAIModel):
    """``{"role", "content"}`` (``type`` "message", or no ``type``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: InputContent

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(OpenAIModel):
    """A call the model made earlier, given back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIModel):
    """The caller's answer to a function call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(OpenAIModel):
    """An earlier reasoning item given back: accepted, and left out of the prompt (as
    chat templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return _TAG + kind if isinstance(kind, str) else None
    return None


if TYPE_CHECKING:
    InputItem: TypeAlias = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
else:
    InputItem = Annotated[
        Union[  # noqa: UP007 - tagged members
            Annotated[InputMessage, Tag(_TAG + "message")],
            Annotated[FunctionCallItem, Tag(_TAG + "function_call")],
            Annotated[FunctionCallOutputItem, Tag(_TAG + "function_call_output")],
            Annotated[ReasoningItem, Tag(_TAG + "reasoning")],
        ],
        Discriminator(
            _item_kind,
            custom_error_type="invalid_type",
            custom_error_message='must be an object of type "message", "function_call", '
            '"function_call_output" or "reasoning"',
        ),
    ]

if TYPE_CHECKING:
    Input: TypeAlias = str | list[InputItem]
else:
    Input = by_json_type(
        "must be a string or a list of input items",
        string=str,
        array=Annotated[list[InputItem], Field(min_length=1)],
    )


class FunctionTool(OpenAIModel):
    """``{"type": "function", "name", "description"?, "parameters"?, "strict"?}``."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


if TYPE_CHECKING:
    ResponsesToolChoice: TypeAlias = Literal["none", "auto", "required"] | FunctionChoice
else:
    ResponsesToolChoice = by_json_type(
        'must be "none", "auto", "required" or {"type": "function", "name": ...}',
        string=Literal["none", "auto", "required"],
        object=FunctionChoice,
    )


class TextFormat(OpenAIModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ReasoningConfig(OpenAIModel):
    """Accepted for compatibility; the model's own template decides whether it reasons."""

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(OpenAIModel):
    """``POST /v1/responses``."""

    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Int64 | None = None
    seed: Int64 | None = None
    priority: Int64 | None = None

    _previous: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    @property
    def stores(self) -> bool:
        """Whether the response is stored (``store`` defaults to true, as OpenAI's)."""
        return self.store is not False

    def check_state(self) -> None:
        """400 for a combination of ``store`` / ``background`` / ``stream`` that cannot work."""
        if self.background and not self.stores:
            raise ValidationError(
                "background", "needs store: a background response is only reachable stored"
            )
        if self.background and self.stream:
            raise ValidationError("stream", "cannot be combined with background on this server")

    def continue_from(self, conversation: list[dict[str, Any]]) -> None:
        """Put the stored conversation of ``previous_response_id`` before ``input``."""
        self._previous = list(conversation)

    def conversation(self) -> list[dict[str, Any]]:
        """The previous response's conversation, then ``input``, as chat messages (no
        ``instructions``: they do not carry over to a continuation)."""
        messages: list[dict[str, Any]] = list(self._previous)
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        for item in self.input:
            if isinstance(item, InputMessage):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": _json_or_text(item.arguments)},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
        return messages

    def chat_messages(self) -> list[dict[str, Any]]:
        """``instructions`` + the conversation as chat messages for the template: consecutive
        function calls become one assistant message's ``tool_calls``, each output a
        ``tool`` message."""
        system = (
            [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        )
        return system + self.conversation()

    def chat_tools(self) -> tuple[list[ToolParam] | None, str | NamedToolChoice | None]:
        """``tools`` and ``tool_choice`` in chat's shape, for ``plan_tools``."""
        tools = None
        if self.tools is not None:
            tools = []
            for index, tool in enumerate(self.tools):
                if not FUNCTION_NAME.match(tool.name):
                    raise ValidationError(
                        f"tools[{index}].name", "must be 1 to 64 letters, digits, '_', '.' or '-'"
                    )
                function = FunctionDefinition(
                    name=tool.name,
                    description=tool.description,
                    parameters=tool.parameters,
                    strict=tool.strict,
                )
                tools.append(ToolParam(type="function", function=function))
        choice: str | NamedToolChoice | None
        if isinstance(self.tool_choice, FunctionChoice):
            choice = NamedToolChoice(
                type="function", function=NamedFunction(name=self.tool_choice.name)
            )
        else:
            choice = self.tool_choice
        return tools, choice

    def output_constraint(self) -> StructuredOutputsParams | None:
        """``text.format`` as the output's grammar (None: free text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, field="text.format")
        if fmt.json_schema is None:
            raise ValidationError("text.format.schema", 'is required with type "json_schema"')
        return StructuredOutputsParams(
            json=fmt.json_schema,
            disable_additional_properties=bool(fmt.strict),
            field="text.format",
            spec_field="text.format.schema",
        )

    def to_sampling_params(
        self, structured_outputs: StructuredOutputsParams | None
    ) -> SamplingParams:
        """The engine's parameters; SamplingParams' ValidationError names the engine field
        (``RENAMES`` maps it back to the request's)."""
        kwargs: dict[str, Any] = {
            name: value
            for name, value in (
                ("temperature", self.temperature),
                ("top_p", self.top_p),
                ("top_k", self.top_k),
                ("seed", self.seed),
            )
            if value is not None
        }
        return SamplingParams(
            **kwargs,
            max_tokens=self.max_output_tokens,  # None: up to the context limit
            structured_outputs=structured_outputs,
            output_kind=RequestOutputKind.DELTA,
        )


RENAMES = {"max_tokens": "max_output_tokens", "prompt": "input", "prompt_token_ids": "input"}
"""Engine field -> the Responses request's name for it."""
