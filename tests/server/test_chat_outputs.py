"""Request fields -> output constraint; one choice's text -> OpenAI message fields, streamed
pieces adding up to the whole answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from legato.protocol.errors import ValidationError
from legato.server.chat_outputs import ChoiceReader, output_constraint
from legato.server.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request
from legato.server.reasoning import ReasoningParser
from legato.server.tool_parsers import HermesToolParser

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(ChatCompletionRequest, body)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("fields", "kind", "value", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "json",
            SCHEMA,
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+", "structured_outputs"),
        ({"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA), "guided_json"),
        ({"guided_choice": ["x", "y"]}, "choice", ["x", "y"], "guided_choice"),
        ({"guided_grammar": "start: 'a'"}, "grammar", "start: 'a'", "guided_grammar"),
    ],
)
def test_each_field_becomes_its_constraint(
    fields: dict[str, Any], kind: str, value: Any, field: str
) -> None:
    constraint = output_constraint(chat(**fields))
    assert constraint is not None
    assert constraint.kind == kind and getattr(constraint, kind) == value
    assert constraint.field == field


def test_text_or_nothing_is_free_and_strict_closes_objects() -> None:
    assert output_constraint(chat()) is None
    assert output_constraint(chat(response_format={"type": "text"})) is None
    strict = {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}}
    constraint = output_constraint(chat(response_format=strict))
    assert constraint is not None and constraint.disable_additional_properties
    assert constraint.spec_name == "response_format.json_schema.schema"


def test_two_constraints_or_a_schemaless_json_schema_are_refused_by_name() -> None:
    with pytest.raises(ValidationError) as info:
        output_constraint(chat(response_format={"type": "json_object"}, guided_regex="a"))
    assert info.value.field == "guided_regex"
    with pytest.raises(ValidationError) as info:
        output_constraint(chat(response_format={"type": "json_schema", "json_schema": {}}))
    assert info.value.field == "response_format.json_schema.schema"
    with pytest.raises(ValidationError) as info:
        parse_request(CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": 3}})
    assert info.value.field == "structured_outputs.regex"


OUTPUT = (
    "<think>the user wants weather</think>\nLet me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_whole_message_splits_reasoning_content_and_calls() -> None:
    fields, called = ChoiceReader(ReasoningParser, HermesToolParser).message(OUTPUT)
    assert called
    assert fields["reasoning_content"] == "the user wants weather"
    assert fields["content"] == "Let me check."
    (call,) = fields["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    plain, called = ChoiceReader(None, None).message(OUTPUT)
    assert plain == {"content": OUTPUT} and not called


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(OUTPUT)), max_size=12))
def test_streamed_deltas_add_up_to_the_whole_message(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(OUTPUT)]
    reader = ChoiceReader(ReasoningParser, HermesToolParser)
    reasoning = content = ""
    calls: dict[int, dict[str, str]] = {}
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        delta = reader.update(OUTPUT[start:end], final=i == len(bounds) - 2)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
            if "id" in piece:
                call["name"] = piece["function"]["name"]
            call["arguments"] += piece["function"]["arguments"]
    assert reader.called_tools
    whole, _ = ChoiceReader(ReasoningParser, HermesToolParser).message(OUTPUT)
    assert reasoning == whole["reasoning_content"]
    assert content.strip() == whole["content"]
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
