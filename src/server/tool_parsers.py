"""Tool-call parsers: the model's text -> OpenAI ``tool_calls``, whole or as streamed deltas.

A parser knows one chat template's format; ``--tool-call-parser NAME`` picks it
(:data:`TOOL_PARSERS`), as in vLLM:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (Hermes, Qwen2.5/Qwen3, SmolLM2 templates); text before the first
  block is the message content.
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}``
  objects (optionally after ``<|python_tag|>``, several separated by ``;``);
  output that does not start with ``{`` is plain content.

Two more are used for ``tool_choice`` "required" and a named function, where
the output is grammar-constrained (:mod:`legato.server.tool_choice`) and so
always parses: ``required_array`` (a JSON array of ``{"name", "parameters"}``)
and :class:`NamedFunctionParser` (the output *is* the arguments).

Streaming follows OpenAI: the first delta of a call carries ``index``, ``id``,
``type`` and ``function.name`` (with ``arguments: ""``), later deltas carry
only ``index`` and a piece of ``function.arguments``; the pieces concatenate
to the final arguments string. A parser instance holds one choice's stream
state: one per choice, fed every new piece of text with :meth:`feed`, then
:meth:`finish` once at the end.

Pure code; never imports trio or torch.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import partial_json


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One complete call: ``arguments`` is a JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class DeltaToolCall:
    """One streamed piece of a call. The first piece of a call has ``id`` and ``name``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass
class DeltaMessage:
    """What one step adds to a streamed message: content text and/or tool-call pieces."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ParsedMessage:
    """A whole message: its content (None when only calls) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


# ------------------------------------------------------------------ one call object


class _CallStream:
    """Streams one ``{"name": ..., <args key>: {...}}`` object as it grows.

    Only a prefix of the final raw text of the arguments value is ever sent;
    an arguments value that is a JSON string is sent decoded, once complete.
    """

    def __init__(self, index: int, args_keys: tuple[str, ...], call_id: str | None = None) -> None:
        self.index = index
        self.args_keys = args_keys
        self.id = call_id or new_call_id()
        self.name: str | None = None
        self.sent_args = 0  # characters of the raw arguments text already sent
        self.done = False

    def update(self, text: str, *, final: bool) -> list[DeltaToolCall]:
        """Deltas for the object's text so far (``final``: no more text will come)."""
        out: list[DeltaToolCall] = []
        if self.done:
            return out
        if self.name is None:
            self.name = partial_json.string_field(text, "name")
            if self.name is None:
                return out
            out.append(DeltaToolCall(self.index, "", self.id, self.name))
        start = partial_json.member_value_start(text, self.args_keys)
        if start is None:
            if final:
                self.done = True
                if not self.sent_args:
                    out.append(DeltaToolCall(self.index, "{}"))
            return out
        end = partial_json.value_end(text, start)
        if text[start] == '"':  # arguments given as a JSON string: send it decoded, whole
            if end is not None:
                out.append(DeltaToolCall(self.index, json.loads(text[start:end])))
                self.done = True
            return out
        raw = text[start:] if end is None else text[start:end]
        if end is None and final:
            raw = raw.rstrip()
        if len(raw) > self.sent_args:
            out.append(DeltaToolCall(self.index, raw[self.sent_args :]))
            self.sent_args = len(raw)
        self.done = end is not None or final
        return out


def merge_deltas(deltas: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """Consecutive pieces of the same call (with no new header between them) joined into one."""
    merged: list[DeltaToolCall] = []
    for d in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.index == d.index and d.id is None:
            last.arguments += d.arguments
        else:
            merged.append(DeltaToolCall(d.index, d.arguments, d.id, d.name))
    return merged


# ------------------------------------------------------------------ parsers


class ToolParser(ABC):
    """Parses one choice's output. Whole: :meth:`parse`; streamed: :meth:`feed` then :meth:`finish`."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self.text = ""
        self.sent_content = 0
        self.calls: list[_CallStream] = []

    def fresh(self) -> ToolParser:
        """A new parser of the same kind and settings, with no stream state."""
        return type(self)()

    def parse(self, text: str) -> ParsedMessage:
        """The whole output as content and calls: exactly what streaming it would send.

        Output that looks like calls but does not hold well-formed ones (a call
        whose arguments are not JSON) is returned whole, as content.
        """
        parser = self.fresh()
        content = ""
        calls: list[ToolCall] = []
        for delta in (parser.feed(text), parser.finish()):
            content += delta.content
            for piece in delta.tool_calls:
                if piece.id is not None:
                    calls.append(ToolCall(piece.name or "", "", piece.id))
                calls[-1].arguments += piece.arguments
        if any(c.name is None for c in parser.calls):  # a block with no call in it
            return ParsedMessage(text, [])
        for call in calls:
            try:
                json.loads(call.arguments)
            except json.JSONDecodeError:
                return ParsedMessage(text, [])
        return ParsedMessage((content.strip() or None) if calls else content, calls)

    @abstractmethod
    def _deltas(self, *, final: bool) -> DeltaMessage:
        """What ``self.text`` adds since the last call."""

    def feed(self, delta_text: str) -> DeltaMessage:
        """The new content and call pieces once ``delta_text`` is appended to the output."""
        self.text += delta_text
        return self._deltas(final=False)

    def finish(self) -> DeltaMessage:
        """Flush everything held back: the output is complete."""
        return self._deltas(final=True)

    @property
    def called_tools(self) -> bool:
        """Whether the streamed output turned out to call tools (finish_reason "tool_calls")."""
        return any(c.name is not None for c in self.calls)

    def _content_upto(self, end: int) -> str:
        piece = self.text[self.sent_content : end] if end > self.sent_content else ""
        self.sent_content = max(self.sent_content, end)
        return piece


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks; text before the first block is content."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    ARGS = ("arguments", "parameters")

    def _blocks(self, text: str) -> list[tuple[int, int, int | None]]:
        """``(tag start, body start, body end or None)`` for each block.

        A closing tag inside the call's JSON (in a string) does not end the block.
        """
        blocks = []
        pos = 0
        while (start := text.find(self.START, pos)) >= 0:
            body = start + len(self.START)
            first = partial_json.skip_ws(text, body)
            if text.startswith("{", first):
                obj_end = partial_json.value_end(text, first)
                end = -1 if obj_end is None else text.find(self.END, obj_end)
            else:
                end = text.find(self.END, body)
            blocks.append((start, body, end if end >= 0 else None))
            if end < 0:
                break
            pos = end + len(self.END)
        return blocks

    def _deltas(self, *, final: bool) -> DeltaMessage:
        blocks = self._blocks(self.text)
        if not blocks:
            hold = 0 if final else _held_back(self.text, self.START)
            return DeltaMessage(self._content_upto(len(self.text) - hold))
        content = self._content_upto(blocks[0][0]).rstrip() if not self.calls else ""
        out: list[DeltaToolCall] = []
        for i, (_, body, end) in enumerate(blocks):
            if i == len(self.calls):
                self.calls.append(_CallStream(i, self.ARGS))
            text = self.text[body:end] if end is not None else self.text[body:]
            if end is None and not final:
                text = text[: len(text) - _held_back(text, self.END)]
            out += self.calls[i].update(text, final=final or end is not None)
        return DeltaMessage(content, merge_deltas(out))


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, ``;``-separated."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    ARGS = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self.body: int | None = None  # where the calls start, once known
        self.plain = False  # decided: the output is plain content

    def _deltas(self, *, final: bool) -> DeltaMessage:
        if self.body is None and not self.plain:
            pos = partial_json.skip_ws(self.text, 0)
            rest = self.text[pos:]
            if rest.startswith(self.TAG):
                pos = partial_json.skip_ws(self.text, pos + len(self.TAG))
                rest = self.text[pos:]
            elif rest and self.TAG.startswith(rest) and not final:
                return DeltaMessage()  # maybe the tag, still arriving
            if not rest and not final:
                return DeltaMessage()
            if rest.startswith("{"):
                self.body = pos
            else:
                self.plain = True
        if self.body is None:
            return DeltaMessage(self._content_upto(len(self.text)))
        start = self.body
        out: list[DeltaToolCall] = []
        for i, (s, e) in enumerate(partial_json.split_top_level(self.text[start:])):
            if i == len(self.calls):
                self.calls.append(_CallStream(i, self.ARGS))
            end = start + e if e is not None else None
            text = self.text[start + s : end] if end is not None else self.text[start + s :]
            out += self.calls[i].update(text, final=final or e is not None)
        return DeltaMessage("", merge_deltas(out))


class RequiredArrayParser(ToolParser):
    """``tool_choice="required"``: the output is ``[{"name": ..., "parameters": {...}}, ...]``."""

    name = "required_array"
    ARGS = ("parameters",)

    def _deltas(self, *, final: bool) -> DeltaMessage:
        body = self.text.find("[")
        if body < 0:
            return DeltaMessage()
        out: list[DeltaToolCall] = []
        for i, (s, e) in enumerate(partial_json.split_top_level(self.text[body + 1 :])):
            if i == len(self.calls):
                self.calls.append(_CallStream(i, self.ARGS))
            start = body + 1 + s
            text = self.text[start : body + 1 + e] if e is not None else self.text[start:]
            out += self.calls[i].update(text, final=final or e is not None)
        return DeltaMessage("", merge_deltas(out))


class NamedFunctionParser(ToolParser):
    """A named ``tool_choice``: the whole output is that function's arguments."""

    name = "named_function"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def fresh(self) -> ToolParser:
        return NamedFunctionParser(self.function_name)

    def _deltas(self, *, final: bool) -> DeltaMessage:
        if not self.calls:
            call = _CallStream(0, ())
            call.name = self.function_name
            self.calls.append(call)
            header = [DeltaToolCall(0, "", call.id, self.function_name)]
        else:
            header = []
        call = self.calls[0]
        raw = self.text.strip()  # trailing space is sent once something follows it
        piece = raw[call.sent_args :]
        call.sent_args = max(call.sent_args, len(raw))
        return DeltaMessage("", merge_deltas(header + ([DeltaToolCall(0, piece)] if piece else [])))


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
"""``--tool-call-parser`` names -> parser factories (one parser per choice)."""


def tool_parser(name: str) -> Callable[[], ToolParser]:
    """The parser factory for ``--tool-call-parser name``; ValueError listing the known ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None
