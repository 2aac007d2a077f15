"""StructuredOutputsParams: shape checks that name the field; the grammar engine judges the rest."""

from __future__ import annotations

from typing import Any

import pytest

from legato.protocol.errors import ValidationError
from legato.protocol.structured import MAX_SPEC_CHARS, StructuredOutputsParams


def test_each_kind_alone() -> None:
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert StructuredOutputsParams(json='{"type": "object"}').kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(choice=["a", "b"]).kind == "choice"
    assert StructuredOutputsParams(grammar="start: /a/").kind == "grammar"


@pytest.mark.parametrize(
    ("kwargs", "field", "needle"),
    [
        ({}, "structured_outputs", "got none"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs", "got regex, choice"),
        ({"json_object": False}, "structured_outputs", "got none"),
        ({"json": 5}, "structured_outputs.json", "JSON Schema object"),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json", "JSON Schema object"),
        ({"regex": 5}, "structured_outputs.regex", "must be a string"),
        ({"choice": []}, "structured_outputs.choice", "non-empty list"),
        ({"choice": ["a", 1]}, "structured_outputs.choice", "non-empty list"),
        ({"choice": "ab"}, "structured_outputs.choice", "non-empty list"),
        ({"grammar": ["start"]}, "structured_outputs.grammar", "must be a string"),
        ({"json_object": "yes"}, "structured_outputs.json_object", "true or false"),
        (
            {"regex": "a", "disable_any_whitespace": 1},
            "structured_outputs.disable_any_whitespace",
            "true or false",
        ),
        ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, "structured_outputs.regex", "larger than"),
    ],
)
def test_bad_shapes_name_the_field(kwargs: dict[str, Any], field: str, needle: str) -> None:
    with pytest.raises(ValidationError) as caught:
        StructuredOutputsParams(**kwargs)
    assert caught.value.field == field
    assert needle in str(caught.value)


def test_from_dict_names_fields_under_the_callers_name() -> None:
    params = StructuredOutputsParams.from_dict({"regex": "a", "choice": None}, field="guided")
    assert params.kind == "regex" and params.name("regex") == "guided.regex"
    with pytest.raises(ValidationError) as caught:
        StructuredOutputsParams.from_dict({"regexp": "a"}, field="extra.structured_outputs")
    assert caught.value.field == "extra.structured_outputs.regexp"
    with pytest.raises(ValidationError) as caught:
        StructuredOutputsParams.from_dict(["a"])
    assert caught.value.field == "structured_outputs"


def test_to_dict_round_trips() -> None:
    params = StructuredOutputsParams(json={"type": "string"}, disable_additional_properties=True)
    assert params.to_dict() == {"json": {"type": "string"}, "disable_additional_properties": True}
    assert StructuredOutputsParams.from_dict(params.to_dict()) == params
    assert params.spec_text() == '{"type":"string"}'
