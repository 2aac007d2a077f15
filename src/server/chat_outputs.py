"""What a request's new OpenAI fields mean for the engine and for the answer.

- :func:`output_constraint`: ``response_format``, vLLM's ``structured_outputs`` and the older
  ``guided_*`` fields (at most one of them) -> the request's
  :class:`~legato.protocol.structured.StructuredOutputsParams`, errors naming the field;
- :class:`ChoiceReader`: one chat choice's text -> the message fields OpenAI sends
  (``content``, ``reasoning_content``, ``tool_calls``), whole (:meth:`ChoiceReader.message`)
  or streamed as deltas (:meth:`ChoiceReader.update`). The
  reasoning parser (``--reasoning-parser``) splits ``<think>`` first; the tool parser (from
  ``tool_choice``, see :mod:`legato.server.tool_choice`) reads the calls from the content.
  Streamed deltas add up to exactly the whole answer (both parsers guarantee it).

Pure code: never imports trio or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..protocol.errors import ValidationError
from ..protocol.structured import StructuredOutputsParams
from .openai_protocol import SamplingFields
from .reasoning import ReasoningParser
from .tool_parsers import ToolParser, merge_deltas

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def output_constraint(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, or None for free text.

    ``response_format`` {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"schema": ...}}; ``structured_outputs``; ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``. Giving two of them is a ValidationError.
    """
    found: list[StructuredOutputsParams] = []
    names: list[str] = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        names.append("response_format")
        if fmt.type == "json_object":
            found.append(StructuredOutputsParams(json_object=True, field="response_format"))
        else:
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValidationError(
                    "response_format.json_schema.schema", 'is required with type "json_schema"'
                )
            found.append(
                StructuredOutputsParams(
                    json=fmt.json_schema.json_schema,
                    # strict: no properties beyond the schema's, as OpenAI's strict mode
                    disable_additional_properties=bool(fmt.json_schema.strict),
                    field="response_format",
                    spec_field="response_format.json_schema.schema",
                )
            )
    if request.structured_outputs is not None:
        names.append("structured_outputs")
        options = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(StructuredOutputsParams.from_dict(options, field="structured_outputs"))
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            names.append(name)
            extra: dict[str, Any] = {}
            if request.guided_whitespace_pattern is not None:
                extra["whitespace_pattern"] = request.guided_whitespace_pattern
            found.append(
                StructuredOutputsParams(**{kind: value}, **extra, field=name, spec_field=name)
            )
    if len(found) > 1:
        raise ValidationError(names[1], f"cannot be combined with {names[0]}")
    return found[0] if found else None


class ChoiceReader:
    """One chat choice's output as OpenAI message fields, whole or streamed."""

    def __init__(
        self,
        reasoning: Callable[[], ReasoningParser] | None,
        tools: Callable[[], ToolParser] | None,
    ) -> None:
        self.reasoning = reasoning() if reasoning is not None else None
        self.tools = tools() if tools is not None else None

    @property
    def active(self) -> bool:
        """Whether the output is more than plain content."""
        return self.reasoning is not None or self.tools is not None

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The whole message's fields for ``text``, and whether it called tools."""
        fields: dict[str, Any] = {"content": text}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
            fields = {"content": text, "reasoning_content": reasoning}
        if self.tools is not None:
            parsed = self.tools.parse(text)
            fields["content"] = parsed.content
            if parsed.tool_calls:
                fields["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
                return fields, True
        return fields, False

    def update(self, delta_text: str, *, final: bool) -> dict[str, Any]:
        """The delta fields that appending ``delta_text`` adds (may be none); ``final``: the
        output is complete, so everything held back (a possible tag start) is flushed too."""
        out: dict[str, Any] = {}
        content = delta_text
        if self.reasoning is not None:
            parts = [self.reasoning.feed(delta_text)]
            if final:
                parts.append(self.reasoning.finish())
            reasoning = "".join(p.reasoning for p in parts)
            content = "".join(p.content for p in parts)
            if reasoning:
                out["reasoning_content"] = reasoning
        if self.tools is not None:
            pieces = [self.tools.feed(content)]
            if final:
                pieces.append(self.tools.finish())
            content = "".join(p.content for p in pieces)
            calls = merge_deltas([c for p in pieces for c in p.tool_calls])
            if calls:
                out["tool_calls"] = [c.to_openai() for c in calls]
        if content:
            out["content"] = content
        return out

    @property
    def called_tools(self) -> bool:
        """Whether the streamed output turned out to call tools."""
        return self.tools is not None and self.tools.called_tools
