"""``RequestStream``: one request's outputs, as the caller reads them.

A stream is both an async iterator and an async context manager, so that
leaving its scope, cancelling it or dropping it aborts the request. It holds
the request as the caller asked for it (prompt, parameters, adapter, render
options) until it is submitted, and talks to its engine only through
``StreamOwner`` (``AsyncEngine`` is one).

Never imports the engine, the actors' internals beyond ``OutputSlot``, models
or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import trio

from ..actors.output_slot import OutputSlot
from ..frontend.renderer import PromptType
from ..protocol.outputs import RequestOutput
from ..protocol.params import LoRARequest, PoolingParams, SamplingParams


@dataclass(frozen=True)
class StreamRequest:
    """What a stream submits, as the caller gave it (checked by ``generate``)."""

    prompt: PromptType
    params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None  # the adapter it runs through
    pooling_params: PoolingParams | None = None  # set for an encode() request
    tokenization_kwargs: dict[str, Any] | None = None
    prompt_text: str | None = None


class StreamOwner(Protocol):
    """What a stream asks of its engine."""

    async def _submit(self, stream: RequestStream) -> None:
        """Render and register the stream's request (a checkpoint); raise if it cannot."""

    def _release(self, request_id: str, engine_id: str) -> None:
        """Forget a request whose stream has ended."""

    def _abort_quietly(self, request_id: str, engine_id: str) -> None:
        """Abort a request whose consumer left. Never blocks; safe from ``run_sync_soon``."""


class RequestStream:
    """One request's outputs: an async iterator that is also an async context manager.

    The request is submitted on ``__aenter__`` or the first ``__anext__``.
    ``__anext__`` is a checkpoint; if the caller is cancelled while waiting,
    the request is aborted and ``Cancelled`` propagates (cancellation is never
    an error). ``aclose()`` and leaving the ``async with`` abort an unfinished
    request; so does dropping the stream unfinished (``break``), as a fallback.
    A dead engine raises ``EngineDeadError`` (cause chained) from ``__anext__``.
    Each output names the request's adapter (``lora_request``), set by the
    output processor.
    """

    def __init__(self, engine: StreamOwner, request: StreamRequest, request_id: str) -> None:
        self._engine = engine
        self.request = request
        self.request_id = request_id
        self.engine_id = ""  # the engine's own id for this request, set on submission
        self.slot = OutputSlot(request.params.output_kind)
        self._submitted = False
        self._done = False
        self._token = trio.lowlevel.current_trio_token()

    async def __aenter__(self) -> RequestStream:
        await self._submit()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if not self._submitted:
            await self._submit()
        try:
            output = await self.slot.get()
        except trio.Cancelled:
            self._abandon()
            raise
        except BaseException:
            self._finish()
            raise
        if output.finished:
            self._finish()
        return output

    async def aclose(self) -> None:
        """Abort the request if it is still running. Idempotent; a checkpoint."""
        self._abandon()
        await trio.lowlevel.checkpoint()

    async def _submit(self) -> None:
        if self._submitted:
            return
        self._submitted = True
        try:
            await self._engine._submit(self)
        except BaseException:
            self._done = True
            raise

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self.request_id, self.engine_id)

    def _abandon(self) -> None:
        if self._submitted and not self._done:
            self._done = True
            self._engine._abort_quietly(self.request_id, self.engine_id)

    def __del__(self) -> None:
        # Fallback for `break` out of `async for` without `async with`: CPython frees
        # the stream at once. run_sync_soon is safe from any thread and from GC. The
        # abort names this request's engine id, so a later request reusing the
        # caller's id is never hit by it.
        if self._submitted and not self._done:
            self._done = True
            try:
                self._token.run_sync_soon(
                    self._engine._abort_quietly, self.request_id, self.engine_id
                )
            except trio.RunFinishedError:
                pass
