"""Chat messages as templates see them: hostile tool-call arguments stay text."""

from __future__ import annotations

from legato.server.chat_parts import ChatMessage


def test_arguments_nested_too_deep_for_json_stay_text() -> None:
    """A tool call's arguments are parsed back into an object for the template when
    they are JSON; a string nested past the JSON parser's recursion limit is passed
    on as text instead of failing the request (a RecursionError was a 500)."""
    deep = "[" * 100_000
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": deep}},
    ]
    message = ChatMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": calls}
    )
    parsed = message.for_template()["tool_calls"]
    assert parsed[0]["function"]["arguments"] == {"x": 1}
    assert parsed[1]["function"]["arguments"] == deep
