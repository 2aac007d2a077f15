"""Tool-call parsers: whole outputs, and streamed deltas that add up to the same answer
however the text is cut into pieces."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from legato.server.tool_parsers import (
    DeltaMessage,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedFunctionParser,
    RequiredArrayParser,
    ToolParser,
    tool_parser,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'


def _calls(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    parsed = parser.parse(text)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_hermes_whole() -> None:
    text = f'Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{{"name": "now", "arguments": {{}}}}</tool_call>'
    content, calls = _calls(HermesToolParser(), text)
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "Paris", "unit": "c"}), ("now", {})]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text, no tools.", "Just text, no tools.", []),
        (
            f"<tool_call>{WEATHER}",
            None,
            [("get_weather", {"city": "Paris", "unit": "c"})],
        ),  # cut at EOS
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ('<tool_call>{"name": "f", "arguments": {"a": [1, </tool_call>', None, None),
        (
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
            None,
            [("f", {"a": 1})],
        ),
        ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
        ("a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag", []),
    ],
)
def test_hermes_edge_cases(text: str, content: str | None, calls: list[Any] | None) -> None:
    parsed = HermesToolParser().parse(text)
    if calls is None:  # malformed arguments: the text comes back whole
        assert parsed.content == text and parsed.tool_calls == []
        return
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


def test_hermes_streaming_matches_openai_shape() -> None:
    parser = HermesToolParser()
    deltas = [
        parser.feed(piece)
        for piece in ["Sure", " <tool", "_call>", WEATHER[:26], WEATHER[26:], "</tool_call>"]
    ]
    deltas.append(parser.finish())
    assert deltas[0].content == "Sure" and deltas[1].content == " " and not deltas[2]
    header = deltas[3].tool_calls[0].to_openai()
    assert (
        header["index"] == 0 and header["type"] == "function" and header["id"].startswith("call_")
    )
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    later = [d.to_openai() for m in deltas[4:] for d in m.tool_calls]
    assert all(
        set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in later
    )
    assert json.loads("".join(d["function"]["arguments"] for d in later)) == {
        "city": "Paris",
        "unit": "c",
    }
    assert parser.called_tools


def test_llama3_json() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    content, calls = _calls(Llama3JsonToolParser(), text)
    assert content is None and calls == [("a", {"x": 1}), ("b", {})]
    assert _calls(Llama3JsonToolParser(), "Hello {there}") == ("Hello {there}", [])
    assert _calls(Llama3JsonToolParser(), "<|python") == ("<|python", [])


def test_llama3_streaming_waits_for_the_first_character() -> None:
    parser = Llama3JsonToolParser()
    assert not parser.feed("  ") and not parser.feed("<|python_")
    assert not parser.feed("tag|>")
    first = parser.feed('{"name": "a", "parameters": {"x"')
    assert first.tool_calls[0].name == "a" and first.content == ""
    plain = Llama3JsonToolParser()
    assert plain.feed("Hi").content == "Hi" and not plain.called_tools


def test_required_array() -> None:
    text = '[{"name":"a","parameters":{"q":"}]"}},{"name":"b","parameters":{}}]'
    assert _calls(RequiredArrayParser(), text) == (None, [("a", {"q": "}]"}), ("b", {})])
    assert RequiredArrayParser().parse("[1]").tool_calls == []


def test_named_function() -> None:
    parser = NamedFunctionParser("f")
    first = parser.feed('{"a"')
    assert first.tool_calls[0].name == "f" and first.tool_calls[0].arguments == '{"a"'
    assert parser.feed(": 1} ").tool_calls[0].arguments == ": 1}"
    assert _calls(NamedFunctionParser("f"), '{"a": 1}') == (None, [("f", {"a": 1})])


def test_unknown_parser_lists_the_known() -> None:
    assert tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        tool_parser("nope")


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    content = ""
    calls: list[list[str]] = []
    deltas: list[DeltaMessage] = [parser.feed(p) for p in pieces] + [parser.finish()]
    for delta in deltas:
        content += delta.content
        for piece in delta.tool_calls:
            if piece.id is not None:
                assert piece.index == len(calls)
                calls.append([piece.name or "", ""])
            else:
                assert piece.index == len(calls) - 1  # pieces of the newest call only
            calls[-1][1] += piece.arguments
    return content, [(n, a) for n, a in calls]


def _cuts(text: str) -> st.SearchStrategy[list[str]]:
    return st.lists(st.integers(0, len(text)), max_size=12).map(
        lambda points: [
            text[a:b] for a, b in zip([0, *sorted(points)], [*sorted(points), len(text)])
        ]
    )


SAMPLES: list[tuple[type[ToolParser], str]] = [
    (
        HermesToolParser,
        f'Thinking aloud <x> first.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{{"name": "t", "arguments": {{"s": "</tool_call> {{"}}}}</tool_call>',
    ),
    (HermesToolParser, "No calls here, only <b>text</b> and a < sign."),
    (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2, {"y": "z;"}]}}; {"name": "b", "parameters": {}}',
    ),
    (Llama3JsonToolParser, "Plain answer."),
    (
        RequiredArrayParser,
        '[{"name":"a","parameters":{"k":"v]"}},{"name":"b","parameters":{"n":12}}]',
    ),
]


@pytest.mark.parametrize(("kind", "text"), SAMPLES)
@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_streamed_pieces_add_up_to_the_whole_parse(
    kind: type[ToolParser], text: str, data: st.DataObject
) -> None:
    pieces = data.draw(_cuts(text))
    content, calls = _stream(kind(), pieces)
    whole = kind().parse(text)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    if whole.tool_calls:
        assert (content.strip() or None) == whole.content
    else:
        assert content == text == whole.content
