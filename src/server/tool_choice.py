"""``tools`` + ``tool_choice`` -> the output constraint and the parser that reads the output.

- ``"none"`` (or no tools): plain text; no constraint, no parser.
- ``"auto"``: the model decides; the server's ``--tool-call-parser`` reads
  its calls from the text. Refused (400) when the server was started without
  ``--enable-auto-tool-choice``, as vLLM does.
- ``"required"``: the output is constrained to a JSON array of
  ``{"name": <one of the tools>, "parameters": <that tool's schema>}``
  (at most one item when ``parallel_tool_calls`` is false), so it always
  parses into calls whose arguments satisfy their schemas.
- a named function: the output is constrained to that function's parameters
  schema and *is* the call's arguments.

Pure code; never imports trio or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..protocol.errors import ValidationError
from ..protocol.structured import StructuredOutputsParams
from .openai_protocol import NamedToolChoice, ToolParam
from .tool_parsers import NamedFunctionParser, RequiredArrayParser, ToolParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for generation and for reading the output."""

    constraint: StructuredOutputsParams | None  # the grammar the output must follow
    parser: Callable[[], ToolParser] | None  # one per choice; None: the output is text
    template_tools: list[dict[str, Any]] | None  # ``tools`` as the chat template gets them


def _parameters(tool: ToolParam) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def required_schema(tools: Sequence[ToolParam], *, parallel: bool) -> dict[str, Any]:
    """The JSON Schema of a ``tool_choice="required"`` output: a non-empty array of calls."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(
    tools: Sequence[ToolParam] | None,
    tool_choice: str | NamedToolChoice | None,
    *,
    parallel_tool_calls: bool | None,
    auto_parser: Callable[[], ToolParser] | None,
) -> ToolPlan:
    """The plan for a request; ValidationError naming ``tool_choice`` / ``tools`` when it cannot be.

    ``auto_parser`` is the server's ``--tool-call-parser`` (None without
    ``--enable-auto-tool-choice``). The default choice is "auto" when tools are
    given (OpenAI's default), "none" otherwise.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValidationError("tool_choice", "needs tools")
        return ToolPlan(None, None, None)
    names = [tool.function.name for tool in tools]
    seen: set[str] = set()
    for name in names:  # linear: a set, not list.count
        if name in seen:
            raise ValidationError("tools", f"function name {name!r} is given twice")
        seen.add(name)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(None, None, template_tools)
    if choice == "auto":
        if auto_parser is None:
            raise ValidationError(
                "tool_choice",
                '"auto" needs the server started with --enable-auto-tool-choice'
                " and --tool-call-parser",
            )
        return ToolPlan(None, auto_parser, template_tools)
    if choice == "required":
        schema = required_schema(tools, parallel=parallel_tool_calls is not False)
        constraint = StructuredOutputsParams(json=schema, field="tool_choice", spec_field="tools")
        return ToolPlan(constraint, RequiredArrayParser, template_tools)
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    chosen = next((tool for tool in tools if tool.function.name == name), None)
    if chosen is None:
        raise ValidationError("tool_choice.function.name", f"{name!r} is not one of the tools")
    constraint = StructuredOutputsParams(
        json=_parameters(chosen),
        field="tool_choice",
        spec_field=f"tools[{names.index(name)}].function.parameters",
    )
    return ToolPlan(constraint, lambda: NamedFunctionParser(name), template_tools)
