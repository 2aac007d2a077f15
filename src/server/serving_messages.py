"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API
over the chat path.

The request is rendered with the chat template (``system`` first, ``tool_use``
blocks as ``tool_calls``, ``tool_result`` blocks as ``tool`` messages), generated
like a chat completion with one choice and read by the same parsers. The answer is
a ``message`` whose ``content`` holds a ``thinking`` block (with a reasoning
parser), a ``text`` block, and one ``tool_use`` block per call; ``stop_reason`` is
``end_turn``, ``max_tokens``, ``stop_sequence`` (with ``stop_sequence`` set) or
``tool_use``.

Streamed, the events are those the official client's ``messages.stream``
accumulates: ``message_start``, per block ``content_block_start``,
``content_block_delta`` (``text_delta`` | ``thinking_delta`` | ``input_json_delta``),
``content_block_stop``, then ``message_delta`` (stop reason, output tokens) and
``message_stop``. A failure after the start is an ``error`` event in Anthropic's
shape. Errors before it are Anthropic's error body (``legato.server.http``).

Imports trio; never torch.
"""

from __future__ import annotations

import uuid
from typing import Any

from ..protocol.errors import ValidationError
from ..protocol.outputs import CompletionOutput
from ..protocol.params import LoRARequest, SamplingParams
from .agent_prompt import plan_and_render
from .asgi import Request, send_json
from .chat_outputs import ChoiceReader
from .lora_routes import select_model
from .messages_protocol import RENAMES, MessagesRequest, tool_input
from .openai_protocol import parse_request
from .serving_base import Job, SSEEvent, StreamingGeneration, stream_error
from .state import ServingState
from .tool_choice import ToolPlan


class ContentBlocks:
    """One answer's content blocks, built from the message fields a :class:`ChoiceReader`
    gives (whole or as deltas), with the stream events that build them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._arguments: dict[int, str] = {}  # block index -> its call's JSON text so far
        self._calls: dict[int, int] = {}  # the reader's call index -> block index

    def feed(self, fields: dict[str, Any]) -> list[SSEEvent]:
        """The events for new message fields (``reasoning_content``, ``content``,
        ``tool_calls`` as OpenAI chat deltas or whole calls)."""
        events: list[SSEEvent] = []
        if fields.get("reasoning_content"):
            events += self._text("thinking", fields["reasoning_content"])
        if fields.get("content"):
            events += self._text("text", fields["content"])
        for call in fields.get("tool_calls") or ():
            events += self._call(call)
        return events

    def close(self) -> list[SSEEvent]:
        """Finish the open block (the answer is complete)."""
        return self._finish()

    @property
    def called_tools(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.blocks)

    def _start(self, block: dict[str, Any]) -> list[SSEEvent]:
        events = self._finish()
        self.blocks.append(block)
        self._open = block
        index = len(self.blocks) - 1
        started = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        data = {"type": "content_block_start", "index": index, "content_block": started}
        return [*events, ("content_block_start", data)]

    def _text(self, kind: str, text: str) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        if self._open is None or self._open["type"] != kind:
            block: dict[str, Any] = {"type": "text", "text": ""}
            if kind == "thinking":
                block = {"type": "thinking", "thinking": "", "signature": ""}
            events += self._start(block)
        assert self._open is not None
        self._open[kind] += text
        delta: dict[str, Any] = {"type": "text_delta", "text": text}
        if kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": text}
        data = {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}
        return [*events, ("content_block_delta", data)]

    def _call(self, call: dict[str, Any]) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        function = call.get("function") or {}
        number = call.get("index", len(self._calls))
        if number not in self._calls or call.get("id") is not None:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                "name": function.get("name") or "",
                "input": {},
            }
            events += self._start(block)
            self._calls[number] = len(self.blocks) - 1
        index = self._calls[number]
        arguments = function.get("arguments") or ""
        if arguments:
            self._arguments[index] = self._arguments.get(index, "") + arguments
            delta = {"type": "input_json_delta", "partial_json": arguments}
            data = {"type": "content_block_delta", "index": index, "delta": delta}
            events.append(("content_block_delta", data))
        return events

    def _finish(self) -> list[SSEEvent]:
        block, self._open = self._open, None
        if block is None:
            return []
        index = self.blocks.index(block)
        if block["type"] == "tool_use":
            block["input"] = tool_input(self._arguments.get(index, ""))
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]


class MessagesServing(StreamingGeneration):
    """A Messages API request: one choice, answered as a ``message``."""

    ends_with_done = False

    def __init__(
        self,
        state: ServingState,
        request: Request,
        typed: MessagesRequest,
        tools: ToolPlan,
        prompt: dict[str, Any],
        params: SamplingParams,
        lora: LoRARequest | None,
        renames: dict[str, str],
    ) -> None:
        self.typed = typed
        self.tools = tools
        super().__init__(
            state,
            request,
            request_id=f"msg_{uuid.uuid4().hex}",
            model=lora.lora_name if lora is not None else state.model_name,
            prompts=[prompt],
            params=params,
            stream=bool(typed.stream),
            renames=renames,
            lora_request=lora,
        )
        self.reader = self._new_reader()
        self.content = ContentBlocks()

    def _new_reader(self) -> ChoiceReader:
        return ChoiceReader(self.state.settings.reasoning, self.tools.parser)

    def _stop(self, jobs: list[Job], called_tools: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        choice = next((c for job in jobs for c in job.choices.values()), None)
        if choice is None:
            return "end_turn", None
        if choice.finish_reason == "length":
            return "max_tokens", None
        if called_tools:
            return "tool_use", None
        stops = self.typed.stop_sequences or ()
        if isinstance(choice.stop_reason, str) and choice.stop_reason in stops:
            return "stop_sequence", choice.stop_reason
        return "end_turn", None

    def _message(self, content: list[dict[str, Any]], jobs: list[Job]) -> dict[str, Any]:
        prompt_tokens, output_tokens = self.token_counts(jobs)
        return {
            "id": self.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": output_tokens},
        }

    def start_events(self, jobs: list[Job]) -> list[SSEEvent]:
        message = self._message([], jobs)
        return [("message_start", {"type": "message_start", "message": message})]

    def delta_events(self, job: Job, delta: CompletionOutput) -> list[SSEEvent]:
        final = delta.finish_reason is not None
        if self.reader.active:
            fields = self.reader.update(delta.text, final=final)
        else:
            fields = {"content": delta.text}
        return self.content.feed(fields)

    def end_events(self, jobs: list[Job]) -> list[SSEEvent]:
        events = self.content.close()
        stop_reason, stop_sequence = self._stop(jobs, self.content.called_tools)
        _, output_tokens = self.token_counts(jobs)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens},
        }
        return [*events, ("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def error_events(self, exc: Exception) -> list[SSEEvent]:
        return [("error", stream_error(exc).anthropic_body())]

    def response(self, jobs: list[Job]) -> dict[str, Any]:
        (job,) = jobs
        text = job.choices[0].text if 0 in job.choices else ""
        fields, _ = self._new_reader().message(text)
        blocks = ContentBlocks()
        blocks.feed(fields)
        blocks.close()
        message = self._message(blocks.blocks, jobs)
        message["stop_reason"], message["stop_sequence"] = self._stop(jobs, blocks.called_tools)
        return message


async def _prepare(
    state: ServingState, request: Request, *, count_only: bool
) -> tuple[
    MessagesRequest, ToolPlan, dict[str, Any], SamplingParams, dict[str, str], LoRARequest | None
]:
    """Parse, pick the model, plan the tools, check the parameters, render the prompt."""
    state.check_available()
    settings = state.settings
    body = await request.json(settings.max_body_bytes)
    typed: MessagesRequest = parse_request(MessagesRequest, body)
    if typed.max_tokens is None and not count_only:
        raise ValidationError("max_tokens", "is required")
    lora = select_model(state, typed.model)
    tools_in, choice, parallel = typed.chat_tools()
    if count_only:  # the tools reach the template; no output is read
        choice = "none"
    tools, rendered, params, renames = await plan_and_render(
        state,
        typed,
        tools_in,
        choice,
        parallel,
        renames=RENAMES,
        format_field="output_config.format",
        parameters_field="input_schema",
    )
    return typed, tools, rendered, params, renames, lora


async def create_message(request: Request, state: ServingState) -> None:
    """``POST /v1/messages``."""
    typed, tools, rendered, params, renames, lora = await _prepare(state, request, count_only=False)
    await MessagesServing(state, request, typed, tools, rendered, params, lora, renames).run()


async def count_tokens(request: Request, state: ServingState) -> None:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens"}`` of the rendered prompt."""
    rendered = (await _prepare(state, request, count_only=True))[2]
    await send_json(request.send, 200, {"input_tokens": len(rendered["prompt_token_ids"])})
