"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

The request is rendered with the chat template (``instructions`` as the system
message, function calls and their outputs as ``tool_calls`` / ``tool`` messages),
generated like a chat completion with one choice, and read by the same parsers
(``--reasoning-parser``, the tool parsers of ``tool_choice``). The answer is a
``response`` object whose ``output`` lists items: a ``reasoning`` item (with a
reasoning parser), a ``message`` with one ``output_text`` part, and one
``function_call`` item per call.

Streamed, the events are those the official client's ``responses.stream``
accumulates: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, (``response.content_part.added``, text deltas,
``...done``, ``response.content_part.done`` | ``response.function_call_arguments.delta``,
``...done``), ``response.output_item.done``, and last ``response.completed``, each
with a ``sequence_number``. As vLLM does, a response cut short by
``max_output_tokens`` still ends with ``response.completed``; its ``status`` is
``incomplete``. Nothing is stored: ``previous_response_id`` and ``background`` are
refused with a 400.

Imports trio; never torch.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..protocol.outputs import CompletionOutput
from ..protocol.params import LoRARequest, SamplingParams
from .agent_prompt import plan_and_render
from .asgi import Request
from .chat_outputs import ChoiceReader
from .lora_routes import select_model
from .openai_protocol import parse_request
from .responses_protocol import RENAMES, ResponsesRequest
from .serving_base import Job, SSEEvent, StreamingGeneration, stream_error
from .state import ServingState
from .tool_choice import ToolPlan


def _id(prefix: str) -> str:
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
                "id": _id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
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
                "id": _id("fc"),
                "type": "function_call",
                "call_id": call.get("id") or _id("call"),
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


class ResponsesServing(StreamingGeneration):
    """A Responses API request: one choice, answered as a ``response`` object."""

    ends_with_done = False

    def __init__(
        self,
        state: ServingState,
        request: Request,
        typed: ResponsesRequest,
        tools: ToolPlan,
        prompt: dict[str, Any],
        params: SamplingParams,
        lora: LoRARequest | None,
        renames: dict[str, str],
    ) -> None:
        self.typed = typed
        self.tools = tools
        fmt = typed.text.format if typed.text is not None else None
        self.format = (
            fmt.model_dump(by_alias=True, exclude_none=True)
            if fmt is not None
            else {"type": "text"}
        )
        super().__init__(
            state,
            request,
            request_id=_id("resp"),
            model=lora.lora_name if lora is not None else state.model_name,
            prompts=[prompt],
            params=params,
            priority=typed.priority or 0,
            stream=bool(typed.stream),
            renames=renames,
            lora_request=lora,
        )
        self.created = int(time.time())
        self.reader = self._new_reader()
        self.output = OutputItems()

    def _new_reader(self) -> ChoiceReader:
        return ChoiceReader(self.state.settings.reasoning, self.tools.parser)

    def body(self, status: str, output: list[dict[str, Any]], jobs: list[Job]) -> dict[str, Any]:
        """The ``response`` object (``usage`` once it is complete)."""
        typed = self.typed
        finish = next((c.finish_reason for job in jobs for c in job.choices.values()), None)
        incomplete = None
        if status == "completed" and finish == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif status == "completed" and finish == "abort":
            status = "cancelled"
        usage = None
        if status != "in_progress":
            prompt_tokens, output_tokens = self.token_counts(jobs)
            usage = {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + output_tokens,
            }
        tool_choice: Any = typed.tool_choice or ("auto" if typed.tools else "none")
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": typed.instructions,
            "max_output_tokens": typed.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": typed.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": self.params.temperature,
            "text": {"format": self.format},
            "tool_choice": tool_choice
            if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "tools": [tool.model_dump(exclude_none=True) for tool in typed.tools or ()],
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": typed.user,
            "metadata": typed.metadata or {},
        }

    def start_events(self, jobs: list[Job]) -> list[SSEEvent]:
        response = self.body("in_progress", [], jobs)
        return [
            self.output.event("response.created", response=response),
            self.output.event("response.in_progress", response=response),
        ]

    def delta_events(self, job: Job, delta: CompletionOutput) -> list[SSEEvent]:
        final = delta.finish_reason is not None
        if self.reader.active:
            fields = self.reader.update(delta.text, final=final)
        else:
            fields = {"content": delta.text}
        return self.output.feed(fields)

    def _item_status(self, jobs: list[Job]) -> str:
        finish = next((c.finish_reason for job in jobs for c in job.choices.values()), None)
        return "incomplete" if finish in ("length", "abort") else "completed"

    def end_events(self, jobs: list[Job]) -> list[SSEEvent]:
        events = self.output.close(self._item_status(jobs))
        response = self.body("completed", self.output.items, jobs)
        return [*events, self.output.event("response.completed", response=response)]

    def error_events(self, exc: Exception) -> list[SSEEvent]:
        error = stream_error(exc)
        return [
            self.output.event("error", code=error.code, message=error.message, param=error.param)
        ]

    def response(self, jobs: list[Job]) -> dict[str, Any]:
        (job,) = jobs
        text = job.choices[0].text if 0 in job.choices else ""
        fields, _ = self._new_reader().message(text)
        items = OutputItems()
        items.feed(fields)
        items.close(self._item_status(jobs))
        return self.body("completed", items.items, jobs)


async def create_response(request: Request, state: ServingState) -> None:
    """``POST /v1/responses``."""
    state.check_available()
    settings = state.settings
    body = await request.json(settings.max_body_bytes)
    typed: ResponsesRequest = parse_request(ResponsesRequest, body)
    typed.refuse_unsupported()
    lora = select_model(state, typed.model)
    tools_in, choice = typed.chat_tools()
    tools, rendered, params, renames = await plan_and_render(
        state,
        typed,
        tools_in,
        choice,
        typed.parallel_tool_calls,
        renames=RENAMES,
        format_field="text.format",
        parameters_field="parameters",
    )
    await ResponsesServing(state, request, typed, tools, rendered, params, lora, renames).run()
