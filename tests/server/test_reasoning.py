"""Reasoning parsers: <think> content -> reasoning_content, whole or streamed in any pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from legato.server.reasoning import (
    DeepSeekR1ReasoningParser,
    ReasoningParser,
    reasoning_parser,
)


@pytest.mark.parametrize(
    ("text", "qwen3", "deepseek_r1"),
    [
        (
            "<think>\nhmm, 2+2</think>\n\nIt is 4.",
            ("\nhmm, 2+2", "It is 4."),
            ("\nhmm, 2+2", "It is 4."),
        ),
        ("hmm</think>It is 4.", (None, "hmm</think>It is 4."), ("hmm", "It is 4.")),
        ("It is 4.", (None, "It is 4."), ("It is 4.", "")),
        ("<think>cut off mid-tho", ("cut off mid-tho", ""), ("cut off mid-tho", "")),
        ("<think></think>Answer", ("", "Answer"), ("", "Answer")),
        ("a < b </thin", (None, "a < b </thin"), ("a < b </thin", "")),
    ],
)
def test_split(
    text: str, qwen3: tuple[str | None, str], deepseek_r1: tuple[str | None, str]
) -> None:
    assert ReasoningParser().split(text) == qwen3
    assert DeepSeekR1ReasoningParser().split(text) == deepseek_r1


def test_streaming_holds_back_a_partial_tag() -> None:
    parser = ReasoningParser()
    first = parser.feed("<thi")
    assert first.reasoning == "" and first.content == ""
    parser = ReasoningParser()
    out = [parser.feed(p) for p in ["<think>", "step one", "</th", "ink>\n", "Done."]]
    assert [o.reasoning for o in out] == ["", "step one", "", "", ""]
    assert [o.content for o in out] == ["", "", "", "", "Done."]
    assert parser.finish().content == ""


def _cuts(text: str) -> st.SearchStrategy[list[str]]:
    return st.lists(st.integers(0, len(text)), max_size=10).map(
        lambda points: [
            text[a:b] for a, b in zip([0, *sorted(points)], [*sorted(points), len(text)])
        ]
    )


@pytest.mark.parametrize("kind", [ReasoningParser, DeepSeekR1ReasoningParser])
@pytest.mark.parametrize(
    "text",
    [
        "<think>\nplan: a<b </think>\n\nfinal <b>answer</b>",
        "plain <thin answer",
        "r</think>c",
        "<think>open",
    ],
)
@given(data=st.data())
@settings(max_examples=50, deadline=None)
def test_streamed_pieces_add_up_to_the_split(
    kind: type[ReasoningParser], text: str, data: st.DataObject
) -> None:
    parser = kind()
    reasoning = content = ""
    for piece in data.draw(_cuts(text)):
        delta = parser.feed(piece)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    last = parser.finish()
    reasoning, content = reasoning + last.reasoning, content + last.content
    whole_reasoning, whole_content = kind().split(text)
    assert reasoning == (whole_reasoning or "") and content == whole_content


def test_names() -> None:
    assert reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("o1")
