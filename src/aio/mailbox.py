"""The mailbox the engine thread fills for one asyncio stream, and the trio task behind
that stream (submit, forward every output, report the end). Never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
)
from typing import Generic, cast

from ..engine import AsyncEngine, RequestStream
from ..engine.thread import SHUT_DOWN
from ..protocol.errors import EngineDeadError
from .thread import OutputT, _EngineThread, _set_result


class _Mailbox(Generic[OutputT]):
    """What the engine thread leaves for one stream's consumer (touched on the event
    loop only, through posted callbacks). The engine-thread task holds this, never the
    ``AioStream``, so a stream dropped unfinished is collected and aborts itself."""

    def __init__(self, submitted: asyncio.Future[None]) -> None:
        self.pending: list[OutputT] = []
        self.error: BaseException | None = None
        self.ended = False  # the engine side has nothing more to send
        self.waiter: asyncio.Future[None] | None = None
        self.submitted = submitted

    def on_submitted(self) -> None:
        _set_result(self.submitted, None)

    def on_output(self, output: OutputT) -> None:
        self.pending.append(output)
        self.wake()

    def on_end(self, error: BaseException | None) -> None:
        if self.ended:
            return
        self.ended = True
        if error is not None and self.error is None:
            self.error = error
            self.pending.clear()
        if not self.submitted.done():
            if error is not None:
                self.submitted.set_exception(error)
                self.submitted.exception()  # retrieved, whether or not anyone entered
            else:
                self.submitted.set_result(None)
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


async def _serve_stream(
    runner: _EngineThread,
    engine: AsyncEngine,
    open_stream: Callable[[AsyncEngine], AsyncIterator[OutputT]],
    mailbox: _Mailbox[OutputT],
) -> None:
    """The trio task behind one stream: submit, forward every output, report the end.

    Cancelled by the consumer (it left) or by shutdown; either way the mailbox ends
    with the shutdown error (a consumer that left no longer reads it)."""
    post = runner.post
    error: BaseException | None = EngineDeadError(SHUT_DOWN)
    try:
        stream = open_stream(engine)
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(stream, RequestStream):
                await stack.enter_async_context(stream)
            else:
                stack.push_async_callback(cast(AsyncGenerator[OutputT, None], stream).aclose)
            post(mailbox.on_submitted)
            async for output in stream:
                post(mailbox.on_output, output)
        error = None
    except Exception as exc:
        error = exc
    finally:
        post(mailbox.on_end, error)
