"""Reasoning parsers: a thinking model's ``<think>...</think>`` -> ``reasoning_content``.

``--reasoning-parser NAME`` picks one (:data:`REASONING_PARSERS`), as in vLLM:

- ``qwen3``: an output that opens with ``<think>`` reasons until
  ``</think>`` (all of it, if the output was cut before the tag); an output
  that does not open with it (thinking switched off) is all content. This
  rule is decided by the first characters, so a stream never has to take
  back what it sent.
- ``deepseek_r1``: the chat template already opened ``<think>`` in the
  prompt, so the output *starts* in reasoning: everything before
  ``</think>`` is reasoning (a leading ``<think>`` is dropped), and an output
  with no ``</think>`` is all reasoning.

One parser instance per choice for streaming: :meth:`ReasoningParser.feed`
each new piece of text, :meth:`ReasoningParser.finish` once at the end; a
partly received tag is held back until it is known to be one.

Pure code; never imports trio or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _hold(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits one choice's output into reasoning and content."""

    name = "qwen3"
    START, END = "<think>", "</think>"
    starts_in_reasoning = False

    def __init__(self) -> None:
        self.text = ""
        self.sent_reasoning = 0  # characters of the reasoning span already sent
        self.sent_content = 0  # characters of the content span already sent

    def split(self, text: str, *, final: bool = True) -> tuple[str | None, str]:
        """``(reasoning or None, content)`` of ``text``."""
        reasoning_span, content_span = self._spans(text, final=final)
        reasoning = text[reasoning_span[0] : reasoning_span[1]] if reasoning_span else None
        content = text[content_span[0] : content_span[1]] if content_span else ""
        return reasoning, content.lstrip("\n") if reasoning_span else content

    def _spans(
        self, text: str, *, final: bool
    ) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """Index ranges of the reasoning and of the content found in ``text`` so far."""
        lead = len(text) - len(text.lstrip())
        opened = text.startswith(self.START, lead)
        start = lead + len(self.START) if opened else 0
        if not opened and not final and text[lead:] and self.START.startswith(text[lead:]):
            return None, None  # perhaps "<think>" still arriving
        if not opened and not self.starts_in_reasoning:  # no thinking at all: plain content
            return None, (0, len(text))
        end = text.find(self.END, start)
        if end < 0:
            return (start, len(text) - (0 if final else _hold(text, self.END))), None
        return (start, end), (end + len(self.END), len(text))

    def feed(self, delta_text: str) -> ReasoningDelta:
        """What appending ``delta_text`` adds to the reasoning and to the content."""
        self.text += delta_text
        return self._deltas(final=False)

    def finish(self) -> ReasoningDelta:
        """Flush what was held back: the output is complete."""
        return self._deltas(final=True)

    def _deltas(self, *, final: bool) -> ReasoningDelta:
        reasoning_span, content_span = self._spans(self.text, final=final)
        out = ReasoningDelta()
        if reasoning_span is not None:
            begin = reasoning_span[0] + self.sent_reasoning
            if reasoning_span[1] > begin:
                out.reasoning = self.text[begin : reasoning_span[1]]
                self.sent_reasoning = reasoning_span[1] - reasoning_span[0]
        if content_span is not None:
            begin = content_span[0] + self.sent_content
            piece = self.text[begin : content_span[1]]
            if reasoning_span is not None and self.sent_content == 0:
                stripped = piece.lstrip("\n")  # the newline(s) after </think>
                if not stripped and not final:
                    return out
                self.sent_content += len(piece) - len(stripped)
                piece = stripped
            out.content = piece
            self.sent_content += len(piece)
        return out


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    ReasoningParser.name: ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}
"""``--reasoning-parser`` names -> parser factories (one parser per choice)."""


def reasoning_parser(name: str) -> Callable[[], ReasoningParser]:
    """The parser factory for ``--reasoning-parser name``; ValueError listing the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None
