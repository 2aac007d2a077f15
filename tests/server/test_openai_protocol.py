"""The pydantic request models: strict types, errors located the way a client reads them."""

from __future__ import annotations

from typing import Any

import pytest

from legato.protocol.errors import ValidationError
from legato.server.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    NamedToolChoice,
    field_path,
    parse_request,
)

USER = [{"role": "user", "content": "hi"}]


def _error(model: Any, body: Any) -> tuple[str, str]:
    with pytest.raises(ValidationError) as caught:
        parse_request(model, body)
    message = str(caught.value).removeprefix(caught.value.field + ": ")
    return caught.value.field, message


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        ({}, "messages", "is required"),
        ({"messages": []}, "messages", "must not be empty"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or a list"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text",
            "valid string",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
            "'text'",
        ),
        ({"messages": [USER[0], {"role": "robot", "content": "x"}]}, "messages[1].role", "'user'"),
        ({"messages": USER, "temperature": "0.5"}, "temperature", "valid number"),
        ({"messages": USER, "temperature": True}, "temperature", "valid number"),
        ({"messages": USER, "n": 2.0}, "n", "valid integer"),
        ({"messages": USER, "n": True}, "n", "valid integer"),
        ({"messages": USER, "seed": 2**64}, "seed", "less than or equal"),
        ({"messages": USER, "stop": 7}, "stop", "string or a list of strings"),
        ({"messages": USER, "stop": ["a", None]}, "stop[1]", "valid string"),
        ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"messages": USER, "logit_bias": {"5": "1"}}, "logit_bias.5", "valid number"),
        (
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
            "letters",
        ),
        (
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
            },
            "tools[0].function.parameters",
            "dictionary",
        ),
        ({"messages": USER, "tool_choice": "always"}, "tool_choice", "'auto'"),
        ({"messages": USER, "tool_choice": 3}, "tool_choice", '"required"'),
        (
            {"messages": USER, "tool_choice": {"type": "function"}},
            "tool_choice.function",
            "is required",
        ),
        (
            {"messages": USER, "response_format": {"type": "yaml"}},
            "response_format.type",
            "json_schema",
        ),
        (
            {
                "messages": USER,
                "response_format": {"type": "json_schema", "json_schema": {"schema": "x"}},
            },
            "response_format.json_schema.schema",
            "dictionary",
        ),
        (
            {"messages": USER, "structured_outputs": {"json": 1}},
            "structured_outputs.json",
            "JSON Schema",
        ),
        (
            {"messages": USER, "structured_outputs": {"choice": "ab"}},
            "structured_outputs.choice",
            "valid list",
        ),
        ({"messages": USER, "guided_json": ["x"]}, "guided_json", "JSON Schema"),
        ({"messages": USER, "chat_template_kwargs": []}, "chat_template_kwargs", "dictionary"),
        (
            {"messages": USER, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "boolean",
        ),
    ],
)
def test_chat_errors_name_the_field(body: dict[str, Any], field: str, needle: str) -> None:
    got_field, message = _error(ChatCompletionRequest, body)
    assert got_field == field
    assert needle in message


@pytest.mark.parametrize(
    ("prompt", "field", "needle"),
    [
        ([], "prompt", "must not be empty"),
        (5, "prompt", "a list of token id lists"),
        (["a", 1], "prompt", "not a mix"),
        ([1, True], "prompt[1]", "a token id"),
        ([[1], []], "prompt", "must not be empty"),
        ([[1, "2"]], "prompt[0][1]", "valid integer"),
    ],
)
def test_completion_prompt_errors(prompt: Any, field: str, needle: str) -> None:
    got_field, message = _error(CompletionRequest, {"prompt": prompt})
    assert got_field == field and needle in message


def test_valid_bodies_parse_and_unknown_fields_are_ignored() -> None:
    chat = parse_request(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x": 1}'},
                        }
                    ],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
            "temperature": 1,  # an integer is a number
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
            },
            "a_future_openai_field": {"anything": True},
        },
    )
    assert chat.temperature == 1.0
    assert isinstance(chat.tool_choice, NamedToolChoice)
    assert chat.response_format.json_schema.json_schema == {"type": "object"}
    assert chat.messages[1].text() == "a\nb"
    assert chat.messages[2].for_template()["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    completion = parse_request(CompletionRequest, {"prompt": [[1, 2], [3]], "guided_regex": "a+"})
    assert completion.prompt == [[1, 2], [3]] and completion.guided_regex == "a+"


def test_body_must_be_an_object() -> None:
    assert _error(ChatCompletionRequest, [1]) == ("body", "must be a JSON object")


def test_field_path() -> None:
    assert (
        field_path(("messages", 0, "content", "§array", 1, "text")) == "messages[0].content[1].text"
    )
    assert field_path(("prompt", 0, 2)) == "prompt[0][2]"


def test_response_models_accept_what_openai_sends() -> None:
    ChatCompletionResponse.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    },
                    "logprobs": None,
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
    )
    ChatCompletionChunk.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"'}}]},
                    "finish_reason": None,
                }
            ],
        }
    )
