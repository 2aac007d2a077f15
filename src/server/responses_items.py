"""A Responses API answer's ``output`` items and the stream events that build them.

:class:`OutputItems` turns the message fields a ``ChoiceReader`` gives (reasoning,
text, tool calls; whole or as deltas) into ``reasoning`` / ``message`` /
``function_call`` items, numbering every event it makes; :func:`items_as_messages`
turns finished items back into the chat messages a later ``previous_response_id``
continues from.

Pure code: never imports trio or torch.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

SSEEvent = tuple[str | None, Any]
"""One server-sent event: its ``event:`` name and its JSON ``data`` (as ``serving_base``)."""


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """One answer's output items, built from the message fields a :class:`ChoiceReader`
    gives (whole or as deltas), with the stream events that build them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.sequence = 0
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # the reader's call index -> its item

    def event(self, kind: str, **fields: Any) -> SSEEvent:
        """A numbered event."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, data

    def feed(self, fields: dict[str, Any]) -> list[SSEEvent]:
        """The events for new message fields (``reasoning_content``, ``content``,
        ``tool_calls`` as OpenAI chat deltas or whole calls)."""
        events: list[SSEEvent] = []
        if fields.get("reasoning_content"):
            events += self._text("reasoning", fields["reasoning_content"])
        if fields.get("content"):
            events += self._text("message", fields["content"])
        for call in fields.get("tool_calls") or ():
            events += self._call(call)
        return events

    def close(self, status: str = "completed") -> list[SSEEvent]:
        """Finish the open item (the answer is complete); at least one message is made."""
        if not self.items:
            self._open_item("message")
        return self._finish(status)

    # ---------------------------------------------------------------- items

    def _index(self, item: dict[str, Any]) -> int:
        return self.items.index(item)

    def _open_item(self, kind: str) -> list[SSEEvent]:
        item: dict[str, Any]
        part: dict[str, Any]
        if kind == "message":
            item = {
                "id": item_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open = item
        index = self._index(item)
        added = {**item, "content": []}
        events = [self.event("response.output_item.added", output_index=index, item=added)]
        item["content"].append(part)
        events.append(
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            )
        )
        return events

    def _text(self, kind: str, text: str) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        if self._open is None or self._open["type"] != kind:
            events += self._finish("completed")
            events += self._open_item(kind)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        delta = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(
            self.event(
                delta,
                item_id=item["id"],
                output_index=self._index(item),
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _call(self, call: dict[str, Any]) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        function = call.get("function") or {}
        index = call.get("index", len(self._calls))
        item = self._calls.get(index)
        if item is None or call.get("id") is not None:
            events += self._finish("completed")
            item = {
                "id": item_id("fc"),
                "type": "function_call",
                "call_id": call.get("id") or item_id("call"),
                "name": function.get("name") or "",
                "arguments": "",
                "status": "in_progress",
            }
            self._calls[index] = item
            self.items.append(item)
            self._open = item
            events.append(
                self.event(
                    "response.output_item.added", output_index=self._index(item), item=dict(item)
                )
            )
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._index(item),
                    delta=arguments,
                )
            )
        return events

    def _finish(self, status: str) -> list[SSEEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._index(item)
        events: list[SSEEvent] = []
        if item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            done = (
                "response.output_text.done"
                if item["type"] == "message"
                else "response.reasoning_text.done"
            )
            extra: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            events.append(
                self.event(
                    done,
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    **extra,
                )
            )
            events.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        if item["type"] != "reasoning":
            item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


def items_as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Finished output items as the chat messages of the assistant's turn: the text of each
    ``message`` and the ``function_call`` items as one message's ``tool_calls`` (reasoning is
    left out, as chat templates drop earlier turns' reasoning)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            messages.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            try:
                arguments: Any = json.loads(item["arguments"])
            except ValueError:
                arguments = item["arguments"]
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return messages
