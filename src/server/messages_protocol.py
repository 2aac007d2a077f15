"""Anthropic's Messages API request (``POST /v1/messages``) as a pydantic model.

The same rules as ``openai_protocol``: strict types, unknown fields ignored, errors
naming the field as the client wrote it (``messages[1].content[0].tool_use_id``). The
model is the only parser of the body: it turns itself into chat messages for the
template (:meth:`MessagesRequest.chat_messages`), into the tools plan's input
(:meth:`MessagesRequest.chat_tools`) and into ``SamplingParams``
(:meth:`MessagesRequest.to_sampling_params`), which stays the only range checker.
Content the engine cannot read (images, documents) is refused with a 400 naming it.

Pure code: never imports trio or torch.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, Union

from pydantic import Discriminator, Field, Tag

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
    by_json_type,
)


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIModel):
    """A call the model made earlier (in an assistant message)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


if TYPE_CHECKING:
    ToolResultContent: TypeAlias = str | list[TextBlock]
else:
    ToolResultContent = by_json_type(
        "must be a string or a list of text blocks", string=str, array=list[TextBlock]
    )


class ToolResultBlock(OpenAIModel):
    """The caller's answer to a ``tool_use`` (in a user message)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: ToolResultContent = ""
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(OpenAIModel):
    """Earlier thinking given back: accepted, and left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


def _block_kind(value: Any) -> str | None:
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        kind: str = value["type"]
        return _TAG + ("thinking" if kind == "redacted_thinking" else kind)
    return None


if TYPE_CHECKING:
    Block: TypeAlias = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
else:
    Block = Annotated[
        Union[  # noqa: UP007 - tagged members
            Annotated[TextBlock, Tag(_TAG + "text")],
            Annotated[ToolUseBlock, Tag(_TAG + "tool_use")],
            Annotated[ToolResultBlock, Tag(_TAG + "tool_result")],
            Annotated[ThinkingBlock, Tag(_TAG + "thinking")],
        ],
        Discriminator(
            _block_kind,
            custom_error_type="invalid_type",
            custom_error_message='must be a content block of type "text", "tool_use", '
            '"tool_result" or "thinking" (this server reads text only)',
        ),
    ]

if TYPE_CHECKING:
    Content: TypeAlias = str | list[Block]
else:
    Content = by_json_type(
        "must be a string or a list of content blocks", string=str, array=list[Block]
    )


class Message(OpenAIModel):
    role: Literal["user", "assistant"]
    content: Content


if TYPE_CHECKING:
    System: TypeAlias = str | list[TextBlock]
else:
    System = by_json_type(
        "must be a string or a list of text blocks", string=str, array=list[TextBlock]
    )


class Tool(OpenAIModel):
    """``{"name", "description"?, "input_schema"}`` (a client tool)."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    """``output_config``: ``format`` constrains the answer to a JSON schema; ``effort`` is
    accepted and has no effect here."""

    format: OutputFormat | None = None
    effort: str | None = None


class Metadata(OpenAIModel):
    user_id: str | None = None


class MessagesRequest(OpenAIModel):
    """``POST /v1/messages`` (and ``/v1/messages/count_tokens``, which needs no
    ``max_tokens``)."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Int64 | None = None
    system: System | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """``system`` + ``messages`` as chat messages for the template: ``tool_use`` blocks
        become the assistant message's ``tool_calls``, each ``tool_result`` a ``tool``
        message."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system
            text = system if isinstance(system, str) else "\n".join(b.text for b in system)
            out.append({"role": "system", "content": text})
        for message in self.messages:
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for block in message.content:
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    function = {"name": block.name, "arguments": block.input}
                    calls.append({"id": block.id, "type": "function", "function": function})
                elif isinstance(block, ToolResultBlock):
                    out.append(
                        {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                    )
            if texts or calls:
                entry: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
                if calls:
                    entry["tool_calls"] = calls
                out.append(entry)
        return out

    def chat_tools(self) -> tuple[list[ToolParam] | None, str | NamedToolChoice | None, bool]:
        """``tools``, ``tool_choice`` and parallel calls in chat's shape, for ``plan_tools``."""
        tools = None
        if self.tools is not None:
            tools = []
            for index, tool in enumerate(self.tools):
                if not FUNCTION_NAME.match(tool.name):
                    raise ValidationError(
                        f"tools[{index}].name", "must be 1 to 64 letters, digits, '_', '.' or '-'"
                    )
                function = FunctionDefinition(
                    name=tool.name, description=tool.description, parameters=tool.input_schema
                )
                tools.append(ToolParam(type="function", function=function))
        choice = self.tool_choice
        parallel = not (choice is not None and choice.disable_parallel_tool_use)
        if choice is None:
            return tools, None, parallel
        if choice.type == "tool":
            if choice.name is None:
                raise ValidationError("tool_choice.name", 'is required with type "tool"')
            named = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
            return tools, named, parallel
        return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel

    def output_constraint(self) -> StructuredOutputsParams | None:
        """``output_config.format`` as the output's grammar (None: free text)."""
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is None:
            return None
        return StructuredOutputsParams(
            json=fmt.json_schema,
            field="output_config.format",
            spec_field="output_config.format.schema",
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
                ("stop", self.stop_sequences),
            )
            if value is not None
        }
        return SamplingParams(
            **kwargs,
            max_tokens=self.max_tokens,
            structured_outputs=structured_outputs,
            output_kind=RequestOutputKind.DELTA,
        )


RENAMES = {"stop": "stop_sequences", "prompt": "messages", "prompt_token_ids": "messages"}
"""Engine field -> the Messages request's name for it."""


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as Anthropic's ``input`` object (``{}`` when not an object)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
