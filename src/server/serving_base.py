"""One generation request served over HTTP: the part every generation API shares.

:class:`StreamingGeneration` runs a request's engine streams and answers as
one JSON body or as server-sent events. Its subclasses (completions, chat,
responses, messages: vLLM's ``serving_*`` split) say only what differs: the
events a stream starts with, the events one engine delta makes, the events
that end it, the error event, and the whole body.

Contract, for every subclass:

- The request's engine streams are entered and their first outputs awaited
  *before* any response is sent, so a prompt the engine rejects (too long,
  token ids outside the vocabulary) is a 400 even with ``stream: true``.
- A client that disconnects (``http.disconnect``) cancels the work: leaving
  the streams aborts the engine requests and frees their KV blocks.
- Once an SSE response has started, a failure (the engine dying) is sent as
  the API's error event, and the stream ends.
- finish_reason is the engine's: "stop", "length", or "abort" (aborted by
  the server, e.g. past the shutdown grace period); subclasses translate it.

Imports trio; never torch.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import trio

from ..protocol.client import OutputStream
from ..protocol.errors import EngineBusyError, EngineDeadError, ValidationError
from ..protocol.outputs import CompletionOutput, Logprob, RequestOutput
from ..protocol.params import LoRARequest, SamplingParams
from . import openai_schemas as schemas
from .asgi import HTTPError, Receive, Request, SSEResponse, send_json, watch_disconnect
from .state import LiveRequest, ServingState

logger = logging.getLogger("legato.server")

T = TypeVar("T")

SSEEvent = tuple[str | None, Any]
"""One server-sent event: its ``event:`` name (None: unnamed) and its JSON ``data``."""


class Disconnected(Exception):
    """The client went away while its request was being served."""


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` while watching ``receive`` for the client's disconnect.

    On a disconnect ``work`` is cancelled and ``Disconnected`` is raised.
    Exceptions from ``work`` propagate unwrapped.
    """
    result: list[T] = []
    error: list[Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_disconnect, receive, nursery.cancel_scope)
        try:
            result.append(await work())
        except Exception as exc:
            error.append(exc)
        nursery.cancel_scope.cancel()
    if error:
        raise error[0]
    if not result:
        raise Disconnected()
    return result[0]


def stream_error(exc: BaseException) -> HTTPError:
    """What a started stream reports when it fails (the detail of a bug stays in the log)."""
    if isinstance(exc, EngineDeadError):
        return HTTPError(503, f"the engine is dead: {exc}", code="engine_dead")
    if isinstance(exc, EngineBusyError):  # the engine's admission bound: retry later
        return HTTPError(503, str(exc), code="server_busy")
    if isinstance(exc, ValidationError):  # the request's own input, found while generating
        return HTTPError(400, str(exc), param=exc.field, code="invalid_value")
    logger.error("a stream failed", exc_info=exc)
    return HTTPError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def error_event(exc: BaseException) -> dict[str, Any]:
    """The body of the OpenAI SSE error event sent when a started stream fails."""
    return stream_error(exc).body()


@dataclass
class Job:
    """One engine request of an HTTP request (one prompt; ``n`` choices)."""

    prompt_index: int
    stream: OutputStream
    first: RequestOutput
    prompt_text: str = ""
    choices: dict[int, schemas.ChoiceState] = field(default_factory=dict)
    text_offsets: dict[int, int] = field(default_factory=dict)
    echoed: set[int] = field(default_factory=set)

    @property
    def prompt_tokens(self) -> int:
        return len(self.first.prompt_token_ids or ())


async def open_jobs(
    state: ServingState,
    stack: AsyncExitStack,
    prompts: list[Any],
    params: SamplingParams,
    live: LiveRequest,
    priority: int,
    renames: Mapping[str, str],
    lora_request: LoRARequest | None = None,
) -> list[Job]:
    """Submit one engine request per prompt and wait for each one's first output.

    The streams live in ``stack`` (leaving it aborts unfinished ones).
    Raises the engine's ValidationError (renamed) or EngineDeadError.
    """
    streams = []
    for engine_id, prompt in zip(live.engine_ids, prompts):
        stream = state.engine.generate(
            prompt, params, engine_id, priority=priority, lora_request=lora_request
        )
        streams.append(await stack.enter_async_context(stream))
    jobs = []
    for index, stream in enumerate(streams):
        try:
            first = await stream.__anext__()
        except ValidationError as exc:
            raise schemas.in_request_terms(exc, renames) from None
        jobs.append(Job(index, stream, first))
    return jobs


def decoder(state: ServingState) -> schemas.DecodeToken:
    """Token id (+ its Logprob) -> text, preferring the engine's decoded token."""
    token_text = state.engine.token_text

    def decode(token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return token_text(token_id)

    return decode


async def _drain(job: Job, on_output: Callable[[Job, RequestOutput], Awaitable[None]]) -> None:
    """Feed the job's outputs (its first one included) to ``on_output`` until it finishes."""
    await on_output(job, job.first)
    if job.first.finished:
        return
    async for output in job.stream:
        await on_output(job, output)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _engine_ids(request_id: str, count: int) -> list[str]:
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


def _outcome(jobs: list[Job]) -> str:
    reasons = {c.finish_reason or "?" for job in jobs for c in job.choices.values()}
    return ",".join(sorted(reasons)) or "?"


class StreamingGeneration(ABC):
    """One generation request: its engine streams, answered whole or streamed.

    Subclasses override :meth:`delta_events` and :meth:`response` (and, where their API
    has them, :meth:`start_events`, :meth:`end_events`, :meth:`error_events`). The hooks
    are synchronous: nothing between two events can be interrupted half-way.
    """

    ends_with_done: ClassVar[bool] = True
    """Whether the stream ends with ``data: [DONE]`` (OpenAI's chunked APIs) or just ends."""

    def __init__(
        self,
        state: ServingState,
        request: Request,
        *,
        request_id: str,
        model: str,
        prompts: list[Any],
        params: SamplingParams,
        priority: int = 0,
        stream: bool = False,
        renames: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.state = state
        self.request = request
        self.request_id = request_id
        self.model = model
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.stream = stream
        self.renames: Mapping[str, str] = renames or {}
        self.lora_request = lora_request
        self.created = int(time.time())
        self.started = time.monotonic()
        self.outcome = ""  # for the log line: finish reasons, or what went wrong

    # ------------------------------------------------------------ what subclasses say

    async def prepare(self, jobs: list[Job]) -> None:  # noqa: B027 - most need nothing
        """Work before the answer starts, once the engine accepted every prompt (a
        checkpoint where it awaits: the hooks after it are synchronous)."""

    def start_events(self, jobs: list[Job]) -> list[SSEEvent]:
        """The events a stream starts with (after the engine accepted every prompt)."""
        return []

    @abstractmethod
    def delta_events(self, job: Job, delta: CompletionOutput) -> list[SSEEvent]:
        """The events one engine delta of one choice makes (none while text is held back)."""

    def end_events(self, jobs: list[Job]) -> list[SSEEvent]:
        """The events a stream ends with once every choice finished."""
        return []

    def error_events(self, exc: Exception) -> list[SSEEvent]:
        """The events a started stream ends with when it fails."""
        return [(None, error_event(exc))]

    @abstractmethod
    def response(self, jobs: list[Job]) -> dict[str, Any]:
        """The whole answer of a request that did not ask to stream."""

    # ------------------------------------------------------------ shared

    @staticmethod
    def token_counts(jobs: list[Job]) -> tuple[int, int]:
        """(prompt tokens, completion tokens) over every job and choice."""
        completion = sum(len(c.token_ids) for job in jobs for c in job.choices.values())
        return sum(job.prompt_tokens for job in jobs), completion

    async def run(self) -> None:
        """Serve the request; the response is complete (or the client gone) on return."""
        state = self.state
        jobs: list[Job] = []
        try:
            engine_ids = _engine_ids(self.request_id, len(self.prompts))
            with state.track(self.request_id, engine_ids, n=self.params.n) as live:
                async with AsyncExitStack() as stack:

                    async def start() -> list[Job]:
                        return await open_jobs(
                            state,
                            stack,
                            self.prompts,
                            self.params,
                            live,
                            self.priority,
                            self.renames,
                            self.lora_request,
                        )

                    jobs = await until_disconnect(self.request.receive, start)
                    await until_disconnect(self.request.receive, lambda: self.prepare(jobs))
                    respond = self._stream if self.stream else self._collect
                    await until_disconnect(self.request.receive, lambda: respond(jobs))
            if live.scope.cancelled_caught:
                self.outcome = self.outcome or "cancelled by shutdown"
        except Disconnected:
            # A client that leaves right after the last byte is not an interruption.
            self.outcome = self.outcome or "client disconnected"
        except Exception as exc:
            self.outcome = f"error: {type(exc).__name__}"
            raise
        finally:
            self._log_request(jobs)

    def _log_request(self, jobs: list[Job]) -> None:
        """The request's line in the request log: its token counts and its outcome."""
        prompt_tokens, completion_tokens = self.token_counts(jobs)
        self.state.log_request(
            self.request_id,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            started=self.started,
            outcome=self.outcome or "?",
        )

    async def run_detached(self, jobs: list[Job], on_accepted: Callable[[], None]) -> None:
        """Serve the request with no client to answer (a background response).

        The engine's jobs are appended to ``jobs`` as they start (so a caller whose
        scope is cancelled still has what was generated) and drained to the end;
        ``on_accepted`` is called once the engine accepted every prompt. Cancelling
        the caller's scope aborts the engine requests (leaving their streams). Raises
        what admission and the engine raise (``Unavailable``, ``ValidationError``,
        ``EngineDeadError``).
        """
        state = self.state

        async def on_output(job: Job, output: RequestOutput) -> None:
            self._accumulate(job, output)
            await trio.lowlevel.checkpoint()

        try:
            engine_ids = _engine_ids(self.request_id, len(self.prompts))
            with state.track(self.request_id, engine_ids, n=self.params.n) as live:
                async with AsyncExitStack() as stack:
                    jobs += await open_jobs(
                        state,
                        stack,
                        self.prompts,
                        self.params,
                        live,
                        self.priority,
                        self.renames,
                        self.lora_request,
                    )
                    on_accepted()
                    for job in jobs:
                        await _drain(job, on_output)
            self.outcome = (
                "cancelled by shutdown" if live.scope.cancelled_caught else _outcome(jobs)
            )
        except trio.Cancelled:
            self.outcome = "cancelled"
            raise
        except Exception as exc:
            self.outcome = f"error: {type(exc).__name__}"
            raise
        finally:
            self._log_request(jobs)

    @staticmethod
    def _accumulate(job: Job, output: RequestOutput) -> list[CompletionOutput]:
        for delta in output.outputs:
            job.choices.setdefault(delta.index, schemas.ChoiceState(delta.index)).add(delta)
        return output.outputs

    async def _collect(self, jobs: list[Job]) -> None:
        async def on_output(job: Job, output: RequestOutput) -> None:
            self._accumulate(job, output)
            await trio.lowlevel.checkpoint()

        for job in jobs:
            await _drain(job, on_output)
        self.outcome = _outcome(jobs)
        await send_json(self.request.send, 200, self.response(jobs))

    async def _stream(self, jobs: list[Job]) -> None:
        sse = SSEResponse(self.request.send)
        await sse.start()
        lock = trio.Lock()

        async def send(events: list[SSEEvent]) -> None:
            async with lock:
                for name, data in events:
                    await sse.event(data, name)

        await send(self.start_events(jobs))
        failures: list[Exception] = []

        async def on_output(job: Job, output: RequestOutput) -> None:
            for delta in self._accumulate(job, output):
                events = self.delta_events(job, delta)
                if events:
                    await send(events)

        async def pump(job: Job, cancel: trio.CancelScope) -> None:
            # The engine died, or a bug: the stream ends with an error event.
            try:
                await _drain(job, on_output)
            except Exception as exc:
                failures.append(exc)
                cancel.cancel()

        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(pump, job, nursery.cancel_scope)
        if failures:
            self.outcome = f"error: {type(failures[0]).__name__}"
            await send(self.error_events(failures[0]))
        else:
            self.outcome = _outcome(jobs)
            await send(self.end_events(jobs))
        await (sse.done() if self.ends_with_done else sse.end())
