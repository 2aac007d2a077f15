"""Parsing ``/v1/embeddings`` bodies (by their pydantic model) and building OpenAI's
response shape."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest

from legato.protocol.errors import ValidationError
from legato.server.embeddings import embedding_response, parse_embedding_request


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([5, 6, 7], [{"prompt_token_ids": [5, 6, 7]}]),
        ([[5], [6, 7]], [{"prompt_token_ids": [5]}, {"prompt_token_ids": [6, 7]}]),
    ],
)
def test_every_input_shape(value: Any, expected: list[Any]) -> None:
    request = parse_embedding_request({"input": value, "model": "m"}, hidden_size=64)
    assert request.inputs == expected
    assert request.model == "m" and request.encoding_format == "float"
    assert request.params.task == "embed" and request.params.dimensions is None


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({}, "input", "is required"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [1, "a"]}, "input", "not a mix"),
        ({"input": [[1], []]}, "input", "must not be empty"),
        ({"input": [True]}, "input[0]", "must be a string"),
        ({"input": "x", "encoding_format": "binary"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "x", "dimensions": 32}, "dimensions", "not trained to be shortened"),
        ({"input": "x", "dimensions": "32"}, "dimensions", "must be a valid integer"),
        ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "x", "model": 3}, "model", "must be a valid string"),
        ({"input": "x", "add_special_tokens": "yes"}, "add_special_tokens", "boolean"),
        ({"input": ["x"] * 257}, "input", "at most 256"),
    ],
)
def test_bad_bodies_name_the_field(body: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        parse_embedding_request(body, hidden_size=64)
    assert info.value.field == field


def test_dimensions_where_the_model_allows() -> None:
    same = parse_embedding_request({"input": "x", "dimensions": 64}, hidden_size=64)
    assert same.params.dimensions is None  # the full vector: nothing to shorten
    short = parse_embedding_request(
        {"input": "x", "dimensions": 16}, hidden_size=64, matryoshka=True
    )
    assert short.params.dimensions == 16
    with pytest.raises(ValidationError, match="<= 64"):
        parse_embedding_request({"input": "x", "dimensions": 65}, hidden_size=64, matryoshka=True)


def test_response_shape_and_base64() -> None:
    vectors = [[0.5, -1.25, 3.0], [0.0, 1.0, 2.0]]
    floats = embedding_response("m", vectors, 7, "float")
    assert floats["object"] == "list" and floats["model"] == "m"
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert floats["data"][1] == {"object": "embedding", "index": 1, "embedding": [0.0, 1.0, 2.0]}
    packed = embedding_response("m", vectors, 7, "base64")
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack("<3f", raw)) == vectors[0]
