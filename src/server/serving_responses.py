"""``/v1/responses``: OpenAI's Responses API over the chat path, with its store.

The request is rendered with the chat template (``instructions`` as the system
message, function calls and their outputs as ``tool_calls`` / ``tool`` messages),
generated like a chat completion with one choice, and read by the same parsers
(``--reasoning-parser``, the tool parsers of ``tool_choice``). The answer is a
``response`` object whose ``output`` lists items (``responses_items``).

Streamed, the events are those the official client's ``responses.stream``
accumulates: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, (``response.content_part.added``, text deltas,
``...done``, ``response.content_part.done`` | ``response.function_call_arguments.delta``,
``...done``), ``response.output_item.done``, and last ``response.completed``, each
with a ``sequence_number``. As vLLM does, a response cut short by
``max_output_tokens`` still ends with ``response.completed``; its ``status`` is
``incomplete``.

State (``response_store``): a response is stored unless ``store`` is false;
``previous_response_id`` continues a stored one (its input and output come before
the new input; its ``instructions`` do not carry over, as OpenAI's);
``GET /v1/responses/{id}`` reads one, ``DELETE`` forgets it. ``background: true``
answers at once with status ``queued``; the request runs in the server's nursery
(``in_progress`` once the engine accepted it, then ``completed`` / ``incomplete`` /
``failed``), and ``POST /v1/responses/{id}/cancel`` cancels it, which aborts its
engine request (status ``cancelled``).

Imports trio; never torch.
"""

from __future__ import annotations

import re
import time
from typing import Any

import trio

from ..protocol.outputs import CompletionOutput
from ..protocol.params import LoRARequest, SamplingParams
from .agent_prompt import plan_and_render
from .asgi import HTTPError, Request, send_json
from .chat_outputs import ChoiceReader
from .lora_routes import select_model
from .openai_protocol import parse_request
from .response_store import StoredResponse
from .responses_items import OutputItems, item_id, items_as_messages
from .responses_protocol import RENAMES, ResponsesRequest
from .serving_base import Job, SSEEvent, StreamingGeneration, stream_error
from .state import Handler, ServingState
from .tool_choice import ToolPlan

CANCEL_WAIT = 10.0
"""Seconds a cancel waits for the background run to end (its engine request aborted)."""


class ResponsesServing(StreamingGeneration):
    """A Responses API request: one choice, answered as a ``response`` object (stored
    unless ``store`` is false)."""

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
            request_id=item_id("resp"),
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

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        jobs: list[Job],
        error: HTTPError | None = None,
    ) -> dict[str, Any]:
        """The ``response`` object (``usage`` once it is complete)."""
        typed = self.typed
        finish = next((c.finish_reason for job in jobs for c in job.choices.values()), None)
        incomplete = None
        if status == "completed" and finish == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif status == "completed" and finish == "abort":
            status = "cancelled"
        usage = None
        if status not in ("queued", "in_progress"):
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
            "background": bool(typed.background),
            "error": None if error is None else {"code": error.code, "message": error.message},
            "incomplete_details": incomplete,
            "instructions": typed.instructions,
            "max_output_tokens": typed.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": typed.parallel_tool_calls is not False,
            "previous_response_id": typed.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": typed.stores,
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

    def remember(self, body: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
        """Store a finished (non-background) response unless ``store`` is false; the body."""
        if self.typed.stores:
            conversation = self.typed.conversation() + items_as_messages(items)
            self.state.responses.put(self.request_id, StoredResponse(body, conversation))
        return body

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
        response = self.remember(self.body("completed", self.output.items, jobs), self.output.items)
        return [*events, self.output.event("response.completed", response=response)]

    def error_events(self, exc: Exception) -> list[SSEEvent]:
        error = stream_error(exc)
        return [
            self.output.event("error", code=error.code, message=error.message, param=error.param)
        ]

    def final_items(self, jobs: list[Job], status: str | None = None) -> list[dict[str, Any]]:
        """The output items of what the jobs generated (so far)."""
        text = "".join(job.choices[0].text for job in jobs if 0 in job.choices)
        fields, _ = self._new_reader().message(text)
        items = OutputItems()
        items.feed(fields)
        items.close(status or self._item_status(jobs))
        return items.items

    def response(self, jobs: list[Job]) -> dict[str, Any]:
        items = self.final_items(jobs)
        return self.remember(self.body("completed", items, jobs), items)

    # ------------------------------------------------------------------ background

    async def start_background(self) -> None:
        """Store the response as ``queued``, start it in the server's nursery, answer."""
        state = self.state
        nursery = state.responses.nursery
        if nursery is None:
            raise HTTPError(400, "background responses need a running server", param="background")
        state.check_capacity(self.params.n)  # a 503 now rather than a failed response later
        entry = StoredResponse(self.body("queued", [], []), self.typed.conversation())
        entry.scope = trio.CancelScope()
        state.responses.put(self.request_id, entry)
        nursery.start_soon(self._background, entry)
        await send_json(self.request.send, 200, entry.body)

    async def _background(self, entry: StoredResponse) -> None:
        """Run detached; the entry's body follows (in_progress, then the end status)."""
        jobs: list[Job] = []
        status, error = "completed", None

        def accepted() -> None:
            if entry.running:
                entry.body = self.body("in_progress", [], jobs)

        assert entry.scope is not None
        try:
            with entry.scope:
                await self.run_detached(jobs, accepted)
            if entry.scope.cancelled_caught:
                status = "cancelled"
        except Exception as exc:  # the request's own failure: the response records it
            status, error = "failed", stream_error(exc)
        finally:
            if status == "completed" and entry.status == "cancelled":
                status = "cancelled"  # cancelled just as it finished
            items = self.final_items(jobs, "incomplete" if status != "completed" else None)
            conversation = self.typed.conversation() + items_as_messages(items)
            self.state.responses.update(
                self.request_id, entry, self.body(status, items, jobs, error), conversation
            )
            entry.done.set()


RESPONSE_ID = re.compile(r"^/v1/responses/(?P<id>[A-Za-z0-9_-]{1,128})(?:/cancel)?$")
"""The id in ``/v1/responses/{id}`` and ``/v1/responses/{id}/cancel``."""


def _stored(request: Request, state: ServingState) -> tuple[str, StoredResponse]:
    match = RESPONSE_ID.match(request.path)
    assert match is not None, "routed here by RESPONSE_ROUTES"
    response_id = match["id"]
    entry = state.responses.get(response_id)
    if entry is None:
        raise HTTPError(
            404,
            f"Response with id {response_id!r} not found (never stored, or evicted).",
            param="response_id",
            code="not_found",
        )
    return response_id, entry


async def create_response(request: Request, state: ServingState) -> None:
    """``POST /v1/responses``."""
    state.check_available()
    settings = state.settings
    body = await request.json(settings.max_body_bytes)
    typed: ResponsesRequest = parse_request(ResponsesRequest, body)
    typed.check_state()
    if typed.previous_response_id is not None:
        previous = state.responses.get(typed.previous_response_id)
        if previous is None:
            raise HTTPError(
                404,
                f"Previous response with id {typed.previous_response_id!r} not found "
                "(never stored, or evicted).",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        if previous.running:
            raise HTTPError(
                400, "is still in progress", param="previous_response_id", code="invalid_value"
            )
        typed.continue_from(previous.conversation)
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
    serving = ResponsesServing(state, request, typed, tools, rendered, params, lora, renames)
    if typed.background:
        await serving.start_background()
    else:
        await serving.run()


async def stored_response(request: Request, state: ServingState) -> None:
    """``GET /v1/responses/{id}``: a stored response (a background one: as it is now)."""
    _, entry = _stored(request, state)
    await send_json(request.send, 200, entry.body)


async def delete_response(request: Request, state: ServingState) -> None:
    """``DELETE /v1/responses/{id}``: forget a stored response (a running one is cancelled)."""
    response_id, _ = _stored(request, state)
    state.responses.pop(response_id)
    await send_json(
        request.send, 200, {"id": response_id, "object": "response.deleted", "deleted": True}
    )


async def cancel_response(request: Request, state: ServingState) -> None:
    """``POST /v1/responses/{id}/cancel``: cancel a queued or running background response.

    Its run is cancelled, which aborts its engine request; the answer (status
    ``cancelled``) comes once the run has ended, or after ``CANCEL_WAIT`` seconds.
    """
    _, entry = _stored(request, state)
    if not entry.running or entry.scope is None:
        raise HTTPError(
            400,
            f"only a background response that is queued or in progress can be cancelled "
            f"(this one is {entry.status})",
            param="response_id",
            code="invalid_value",
        )
    entry.body = {**entry.body, "status": "cancelled"}
    entry.scope.cancel()
    with trio.move_on_after(CANCEL_WAIT):
        await entry.done.wait()
    await send_json(request.send, 200, entry.body)


RESPONSE_ROUTES: tuple[tuple[re.Pattern[str], dict[str, Handler]], ...] = (
    (
        re.compile(r"^/v1/responses/[A-Za-z0-9_-]{1,128}$"),
        {"GET": stored_response, "DELETE": delete_response},
    ),
    (re.compile(r"^/v1/responses/[A-Za-z0-9_-]{1,128}/cancel$"), {"POST": cancel_response}),
)
"""The routes with a response id in the path: (path pattern, method -> handler)."""
