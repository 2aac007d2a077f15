"""The parts of a chat request as pydantic models: messages, tools and the tool choice,
and the structured-output fields (``response_format``, vLLM's ``structured_outputs``).
The Responses and Messages APIs reuse the tool models.

Pure code: never imports trio or torch.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from pydantic import Field, field_validator

from .schema_base import OpenAIModel, by_json_type


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
    """``text`` parsed as JSON, or as it is when it is not JSON (or nested too deep to
    parse: a hostile arguments string must not fail the request)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
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
